"""Turn a metrics.jsonl log into a PNG dashboard.

  python tools/plot_metrics.py --metrics runs/rl/metrics.jsonl --out runs/rl/dashboard.png
"""

import argparse
import sys

from megatron_klear.config import OneLineParser
from megatron_klear.train.plot import plot_metrics


def main() -> None:
    p = OneLineParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--metrics", required=True, help="metrics.jsonl written by klear-sft/klear-rl")
    p.add_argument("--out", required=True, help="PNG to write")
    p.add_argument("--keys", nargs="+", default=None, help="metrics to plot (default: essentials)")
    args = p.parse_args()
    try:
        print(plot_metrics(args.metrics, args.out, args.keys))
    except (ValueError, FileNotFoundError) as exc:
        sys.exit(f"error: {exc}")


if __name__ == "__main__":
    main()
