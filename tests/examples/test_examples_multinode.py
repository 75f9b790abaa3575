"""The example scripts as multi-node jobs, and the README's Usage run as written.

The recipe scripts (klear_8b SFT -> math RL -> code RL, qwen3_32b SFT -> RL, qwen3_30b_a3b
MoE RL) are launched the way their headers say, as 2 "nodes" on this host: two launches of
the script with ``NNODES=2``, ``NODE_RANK`` 0 and 1, ``MASTER_ADDR=127.0.0.1``, a free
``MASTER_PORT`` and ``GPUS_PER_NODE=1``, one process each, the pipeline stages split across
the nodes (PP=2; the MoE recipe splits its experts across them instead, EP=2).
single_node_8gpu/run_rl.sh is one node, as its header says (2 training ranks, PP=2).
(uneven_pp_94_layers is left to its dry run in test_examples.py and to
test_pipeline_layouts.py, to keep this tier short.)

The model is a tiny Qwen3 built here; the recipe YAML's GPU-only settings (Transformer
Engine, bf16, sequence parallel, optimizer offload) and its sizes are overridden on the
command line after ``--config``, which is itself under test: the runs' metrics show the
command line's values where they differ from the YAML, and the YAML's where it is silent.

Rollout servers are started the way ``examples/klear_8b/launch_sglang.sh`` starts them (its
``--dry-run`` prints the commands and URLs: same model, same ports), as embedded CPU servers
speaking SGLang's HTTP API (megatron_klear/rollout/engine/server.py stands in for
sglang.launch_server; the real SGLang tier is tests/interop/).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from megatron_klear.distributed import free_port, free_port_range
from megatron_klear.rollout.engine.launcher import launch_embedded_servers
from megatron_klear.train.metrics import read_metrics

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
LAUNCH_TIMEOUT_S = 300

# The recipes' GPU-only settings, off for CPU; their memory features that run on a CPU
# (distributed optimizer, overlapped grad reduce / param gather, full recompute) stay on.
CPU = ["--transformer-impl", "local", "--no-bf16", "--no-sequence-parallel",
       "--tensor-model-parallel-size", "1", "--no-progress-bar"]
PP2 = ["--pipeline-model-parallel-size", "2"]
# Tiny sizes. SFT: the YAML's cosine decay to its min-lr 4e-5 stays; --lr differs from it.
SFT_LR, SFT_ITERS = 3e-4, 2
SFT = ["--seq-length", "128", "--global-batch-size", "2", "--train-iters", str(SFT_ITERS),
       "--lr", str(SFT_LR), "--lr-warmup-iters", "0"]
# RL: --no-dynamic-sampling and --rollout-gen-batch-size 0 (the YAML over-generates and drops
# the groups that a tiny model's zero rewards leave uninformative), --lr-warmup-iters 0 and
# --lr 2e-6 (the YAML's 1e-6) are overrides the metrics show.
RL_LR, RL_PROMPTS = 2e-6, 2
RL = ["--rollout-batch-size", str(RL_PROMPTS), "--mini-batch-size", "2",
      "--n-samples-per-prompt", "2", "--rollout-max-response-len", "12", "--no-dynamic-sampling",
      "--rollout-gen-batch-size", "0", "--lr-warmup-iters", "0",
      "--lr", str(RL_LR), "--train-iters", "1", "--save-interval", "1"]


def node_env(**extra: str) -> dict[str, str]:
    """The environment of one launch: this interpreter, one thread per process, no CUDA."""
    env = dict(os.environ, PYTHON=sys.executable, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore",
               PYTHONPATH=str(ROOT), CUDA_VISIBLE_DEVICES="")
    env.update(extra)
    return env


def launch_nodes(script: Path, args: list[str], log_dir: Path, nodes: int = 2, **env: str
                 ) -> None:
    """Run ``bash script args`` as node 0 .. nodes-1 of a job on this host (one process per
    node unless the script says otherwise); fail with the logs' tails when a node exits
    non-zero or the job outlives LAUNCH_TIMEOUT_S."""
    port = str(free_port())
    log_dir.mkdir(parents=True, exist_ok=True)
    procs, logs = [], []
    for rank in range(nodes):
        log = log_dir / f"{script.parent.name}_{script.stem}_node{rank}.log"
        logs.append(log)
        procs.append(subprocess.Popen(
            ["bash", str(script), *args], cwd=ROOT, start_new_session=True,
            stdout=log.open("w"), stderr=subprocess.STDOUT,
            env=node_env(NNODES=str(nodes), NODE_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                         MASTER_PORT=port, GPUS_PER_NODE="1", **env)))
    wait_all(procs, logs)


def wait_all(procs: list[subprocess.Popen], logs: list[Path]) -> None:
    """Wait for every launch; kill all of them (their sessions) on a failure or timeout."""
    deadline = time.monotonic() + LAUNCH_TIMEOUT_S
    try:
        while any(p.poll() is None for p in procs):
            if time.monotonic() > deadline or any(p.returncode for p in procs):
                break
            time.sleep(0.2)
    finally:
        for p in procs:
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    tails = "\n".join(f"--- {log.name} (exit {p.returncode})\n" +
                      "".join(log.read_text().splitlines(True)[-25:])
                      for p, log in zip(procs, logs))
    assert all(p.returncode == 0 for p in procs), tails


@contextlib.contextmanager
def servers_like_launch_sglang(model: Path, count: int, log_dir: Path):
    """Rollout servers where ``launch_sglang.sh`` puts them: its --dry-run gives the commands
    (model, ports) and the URLs it prints for ROLLOUT_URLS; embedded servers take those ports
    and serve that model. Yields the URLs as the script printed them."""
    base = free_port_range(count)
    out = subprocess.run(
        ["bash", str(EXAMPLES / "klear_8b" / "launch_sglang.sh"), "--dry-run"], cwd=ROOT,
        env=node_env(MODEL=str(model), SERVER_TP="1", GPUS_PER_NODE=str(count),
                     BASE_PORT=str(base), HOST="127.0.0.1"),
        capture_output=True, text=True, check=True).stdout.splitlines()
    commands = [shlex.split(line) for line in out if "sglang.launch_server" in line]
    urls = [line for line in out if line.startswith("http://")]
    assert len(commands) == len(urls) == count
    for i, cmd in enumerate(commands):
        assert cmd[cmd.index("--model-path") + 1] == str(model)
        assert cmd[cmd.index("--port") + 1] == str(base + i)
    with launch_embedded_servers(model, count, base_port=base, log_dir=log_dir) as servers:
        assert servers.urls == urls
        yield urls


def cosine_lr(step: int, total: int, lr: float, min_lr: float) -> float:
    """Megatron's cosine decay without warmup after ``step`` of ``total`` steps (the LR that
    step ``step`` logs: the scheduler has stepped)."""
    return min_lr + (lr - min_lr) * 0.5 * (1 + math.cos(math.pi * step / total))


def hf_tensors(hf_dir: Path) -> dict[str, torch.Tensor]:
    """Every tensor of an HF safetensors directory."""
    from safetensors.torch import load_file

    out = {}
    for f in sorted(hf_dir.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def max_abs_diff(a: Path, b: Path) -> float:
    """Largest |difference| over the tensors of two HF directories (same names required)."""
    ta, tb = hf_tensors(a), hf_tensors(b)
    assert ta.keys() == tb.keys()
    return max(float((ta[k].float() - tb[k].float()).abs().max()) for k in ta)


def checkpoints(save: Path) -> list[int]:
    """Iterations of the complete checkpoints in a --save dir."""
    return sorted(int(p.name.split("_")[1]) for p in save.glob("iter_*")
                  if (p / "klear_meta.json").is_file())


# ---------------------------------------------------------------- tiny models and data
@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny dense Qwen3 and a tiny Qwen3-MoE (HF dirs), arithmetic SFT/RL/eval data and a
    code-RL set with stdin/stdout tests."""
    from megatron_klear.data.records_io import write_records
    from megatron_klear.data.synthetic import write_arithmetic_data
    from megatron_klear.models.tiny import save_tiny_hf_model

    root = tmp_path_factory.mktemp("multinode")
    data = write_arithmetic_data(root / "data", seed=1, n_sft=64, n_rl=32, n_eval=4)
    data["code"] = root / "data" / "code.jsonl"
    write_records(data["code"], ({"prompt": f"Read n from stdin and print n+{k}.",
                                  "answer": {"inputs": ["1\n", "5\n"],
                                             "outputs": [f"{1 + k}\n", f"{5 + k}\n"]}}
                                 for k in range(4)))
    return {"root": root, "data": data, "logs": root / "logs",
            "base": save_tiny_hf_model(root / "base_hf", seed=1),
            "moe": save_tiny_hf_model(root / "moe_hf", seed=1, moe=True)}


def _sft_metrics_follow_cli_over_yaml(save: Path, yaml_min_lr: float) -> None:
    """SFT steps of a recipe run: --train-iters and --lr from the command line, the cosine
    decay to min-lr from the YAML (the LR of each step says both)."""
    steps = read_metrics(save / "metrics.jsonl")
    assert [m["step"] for m in steps] == list(range(1, SFT_ITERS + 1))
    for m in steps:
        want = cosine_lr(m["step"], SFT_ITERS, SFT_LR, yaml_min_lr)
        assert m["lr"] == pytest.approx(want, rel=1e-6), (m["step"], m["lr"], want)
    assert checkpoints(save) == [SFT_ITERS]


# ---------------------------------------------------------- klear_8b: SFT -> math RL -> code RL
@pytest.fixture(scope="module")
def klear_sft(tiny):
    """examples/klear_8b/run_sft.sh as 2 nodes (its YAML's PP=2): OUT/sft and OUT/sft_hf."""
    out = tiny["root"] / "klear-8b"
    launch_nodes(EXAMPLES / "klear_8b" / "run_sft.sh", CPU + SFT, tiny["logs"],
                 MODEL=str(tiny["base"]), SFT_DATA=str(tiny["data"]["sft"]), OUT=str(out))
    return out


def test_klear_8b_sft_takes_the_command_line_over_the_yaml(tiny, klear_sft):
    _sft_metrics_follow_cli_over_yaml(klear_sft / "sft", yaml_min_lr=4e-5)
    assert max_abs_diff(klear_sft / "sft_hf", tiny["base"]) > 1e-4  # SFT moved the weights


def _run_rl_math(tiny, out: Path, urls: list[str], *extra: str) -> None:
    launch_nodes(EXAMPLES / "klear_8b" / "run_rl_math.sh",
                 CPU + RL + ["--eval-interval", "1", "--eval-k", "1", *extra],
                 tiny["logs"], OUT=str(out), MATH_DATA=str(tiny["data"]["rl"]),
                 EVAL_DATA=str(tiny["data"]["eval"]), ROLLOUT_URLS=" ".join(urls))


def test_klear_8b_math_rl_from_the_sft_checkpoint_resumes(tiny, klear_sft):
    """run_rl_math.sh --load OUT/sft (the SFT stage's checkpoint) against two servers started
    as launch_sglang.sh starts them: step 1 with periodic eval and HF export, then the same
    command with --train-iters 2 resumes from its own checkpoint at step 2."""
    from megatron_klear.data.prompts import load_prompt_dataset
    from megatron_klear.train.rl_data import PromptStream

    with servers_like_launch_sglang(klear_sft / "sft_hf", 2, tiny["logs"] / "servers") as urls:
        _run_rl_math(tiny, klear_sft, urls)
        first = read_metrics(klear_sft / "rl_math" / "metrics.jsonl")
        # RL started from the SFT weights: one step at lr 2e-6 moves no weight by more than
        # a few lr, while SFT moved them by > 1e-4 from the base model
        assert max_abs_diff(klear_sft / "rl_math_hf", klear_sft / "sft_hf") < 1e-5
        _run_rl_math(tiny, klear_sft, urls, "--train-iters", "2")
    steps = read_metrics(klear_sft / "rl_math" / "metrics.jsonl")
    assert [m["step"] for m in steps] == [1, 2]  # resumed at step 2, step 1 not re-run
    assert steps[0] == first[0]
    assert checkpoints(klear_sft / "rl_math") == [1, 2]
    # the data cursor resumed: step 2 trains the stream's next prompts (reference: the stream)
    stream = PromptStream(load_prompt_dataset(tiny["data"]["rl"]), seed=1234)
    for m in steps:
        want = sorted(s.index for _, s in stream.take(RL_PROMPTS))
        assert m["data/prompt_indices"] == want and m["data/consumed_prompts"] == \
            RL_PROMPTS * m["step"]
    for m in steps:
        assert m["lr"] == RL_LR  # --lr over the YAML's 1e-6 (constant schedule from the YAML)
        assert m["rollout/prompts_drawn"] == RL_PROMPTS  # --no-dynamic-sampling: no refill
        assert m["weight_sync/probe_max_abs_diff"] < 1e-4  # servers hold the trainer's weights
        assert m["eval/problems"] == 4 and "eval/avg@1" in m  # periodic eval, --eval-interval 1
    assert max_abs_diff(klear_sft / "rl_math_hf", klear_sft / "sft_hf") < 1e-5


def test_klear_8b_code_rl_from_the_math_rl_checkpoint(tiny, klear_sft):
    """run_rl_code.sh: --load OUT/rl_math, its HF export as MODEL, the code reward."""
    if not (klear_sft / "rl_math_hf").is_dir():
        pytest.fail("needs test_klear_8b_math_rl_from_the_sft_checkpoint_resumes's outputs")
    with servers_like_launch_sglang(klear_sft / "rl_math_hf", 1, tiny["logs"] / "servers") as urls:
        launch_nodes(EXAMPLES / "klear_8b" / "run_rl_code.sh", CPU + RL, tiny["logs"],
                     OUT=str(klear_sft), CODE_DATA=str(tiny["data"]["code"]),
                     ROLLOUT_URLS=" ".join(urls))
    (m,) = read_metrics(klear_sft / "rl_code" / "metrics.jsonl")
    assert m["step"] == 1 and m["lr"] == RL_LR and checkpoints(klear_sft / "rl_code") == [1]
    # the recipe's code_klear: the mean of +-1 per test, -1 without a code block
    assert -2.0 <= m["rollout/reward_mean"] <= 1.0 and m["weight_sync/probe_max_abs_diff"] < 1e-4
    assert max_abs_diff(klear_sft / "rl_code_hf", klear_sft / "rl_math_hf") < 1e-5


# ---------------------------------------------------------------- the other recipes
def test_single_node_8gpu_rl_on_one_node(tiny, klear_sft):
    """single_node_8gpu/run_rl.sh as its header says (one node), training on TRAIN_GPUS=2
    ranks as 2 pipeline stages, rolling out on the servers given in ROLLOUT_URLS."""
    out = tiny["root"] / "one-node"
    with servers_like_launch_sglang(klear_sft / "sft_hf", 1, tiny["logs"] / "servers") as urls:
        launch_nodes(EXAMPLES / "single_node_8gpu" / "run_rl.sh", CPU + PP2 + RL, tiny["logs"],
                     nodes=1, TRAIN_GPUS="2", MODEL=str(klear_sft / "sft_hf"),
                     DATA=str(tiny["data"]["rl"]), OUT=str(out), ROLLOUT_URLS=" ".join(urls))
    (m,) = read_metrics(out / "metrics.jsonl")
    assert m["step"] == 1 and m["lr"] == RL_LR and m["weight_sync/probe_max_abs_diff"] < 1e-4
    assert checkpoints(out) == [1]


def test_qwen3_32b_sft_then_rl_from_its_checkpoint(tiny):
    """qwen3_32b: run_sft.sh, then run_rl.sh --load OUT/sft (its rl.yaml is TP8 x PP1; here
    PP=2 across the nodes)."""
    out = tiny["root"] / "qwen3-32b"
    launch_nodes(EXAMPLES / "qwen3_32b" / "run_sft.sh", CPU + PP2 + SFT, tiny["logs"],
                 MODEL=str(tiny["base"]), SFT_DATA=str(tiny["data"]["sft"]), OUT=str(out))
    _sft_metrics_follow_cli_over_yaml(out / "sft", yaml_min_lr=2.5e-5)
    with servers_like_launch_sglang(out / "sft_hf", 1, tiny["logs"] / "servers") as urls:
        launch_nodes(EXAMPLES / "qwen3_32b" / "run_rl.sh", CPU + PP2 + RL, tiny["logs"],
                     OUT=str(out), MATH_DATA=str(tiny["data"]["rl"]),
                     ROLLOUT_URLS=" ".join(urls))
    (m,) = read_metrics(out / "rl_math" / "metrics.jsonl")
    assert m["step"] == 1 and m["lr"] == RL_LR and m["weight_sync/probe_max_abs_diff"] < 1e-4
    assert max_abs_diff(out / "rl_math_hf", out / "sft_hf") < 1e-5  # started from the SFT


def test_qwen3_30b_a3b_moe_rl_experts_across_the_nodes(tiny):
    """qwen3_30b_a3b/run_rl.sh on a tiny Qwen3-MoE (4 experts), EP=2: each node holds two
    experts; every expert reaches the server once per sync and the probe agrees."""
    out = tiny["root"] / "qwen3-30b-a3b"
    with servers_like_launch_sglang(tiny["moe"], 1, tiny["logs"] / "servers") as urls:
        launch_nodes(EXAMPLES / "qwen3_30b_a3b" / "run_rl.sh",
                     CPU + RL + ["--expert-model-parallel-size", "2",
                                 "--no-optimizer-cpu-offload"],
                     tiny["logs"], MODEL=str(tiny["moe"]), OUT=str(out),
                     MATH_DATA=str(tiny["data"]["rl"]), ROLLOUT_URLS=" ".join(urls))
    (m,) = read_metrics(out / "rl_math" / "metrics.jsonl")
    assert m["step"] == 1 and m["lr"] == RL_LR and m["weight_sync/probe_max_abs_diff"] < 1e-4
    n_bytes = sum(t.numel() * t.element_size() for t in hf_tensors(tiny["moe"]).values())
    assert m["weight_sync/bytes"] == n_bytes  # all 4 experts of every layer, from both nodes
    assert hf_tensors(out / "rl_math_hf").keys() == hf_tensors(tiny["moe"]).keys()


# ---------------------------------------------------------------- README.md ## Usage
def readme_usage_commands() -> list[str]:
    """The shell commands of README.md's Usage block that converts, trains and evaluates
    (backslash continuations joined, runs of blanks made one)."""
    text = (ROOT / "README.md").read_text()
    usage = text[text.index("## Usage"):]
    usage = usage[:usage.index("\n## ", 1)]
    block = next(b for b in re.findall(r"```bash\n(.*?)```", usage, re.S)
                 if "convert_hf_to_megatron" in b)
    return [" ".join(line.split()) for line in block.replace("\\\n", " ").splitlines()
            if line.strip()]


def test_readme_usage_runs_as_written(tiny, tmp_path):
    """README.md's Usage (convert, SFT --load ckpt/base, RL --load ckpt/sft, klear-eval,
    convert back, plot) run as written, with the tiny model in place of Qwen3-8B-Base,
    2 ranks in place of 8 (TP1 x PP2), the CPU flags appended to the trainers and two
    embedded servers at the rollout URLs."""
    with servers_like_launch_sglang(tiny["base"], 2, tiny["logs"] / "servers") as urls:
        subs = {"Qwen3-8B-Base": str(tiny["base"]), "ckpt/": f"{tmp_path}/ckpt/",
                "out/hf": f"{tmp_path}/out/hf", "dashboard.png": f"{tmp_path}/dashboard.png",
                "--data-path sft.jsonl": f"--data-path {tiny['data']['sft']}",
                "--prompt-data math.jsonl": f"--prompt-data {tiny['data']['rl']}",
                "aime24=aime24.jsonl": f"aime24={tiny['data']['eval']}",
                "--tp 4 --pp 2": "--tp 1 --pp 2",
                "torchrun --nproc-per-node 8": f"{sys.executable} -m torch.distributed.run "
                                               "--nproc-per-node 2 --master-port PORT",
                "http://r0:30000 http://r0:30001": " ".join(urls),
                "--k 16 --max-new-tokens 32768": "--k 1 --max-new-tokens 12",
                "klear-eval ": f"{Path(sys.executable).parent / 'klear-eval'} --out-dir "
                               f"{tmp_path}/eval ",
                "python tools/": f"{sys.executable} tools/"}
        script = "\n".join(readme_usage_commands())
        for old, new in subs.items():
            assert old in script, f"README.md Usage no longer has {old!r}: update this test"
            script = script.replace(old, new)
        extra = {"megatron_klear.train.sft": CPU + SFT, "megatron_klear.train.rl": CPU + RL}
        for i, line in enumerate(script.splitlines()):
            argv = shlex.split(line.replace("PORT", str(free_port())))
            argv += next((v for k, v in extra.items() if k in argv), [])
            log = tiny["logs"] / f"readme_{i}.log"
            proc = subprocess.Popen(argv, cwd=ROOT, env=node_env(), start_new_session=True,
                                    stdout=log.open("w"), stderr=subprocess.STDOUT)
            wait_all([proc], [log])
    ckpt = tmp_path / "ckpt"
    assert [m["step"] for m in read_metrics(ckpt / "sft" / "metrics.jsonl")] == [1, 2]
    assert [m["step"] for m in read_metrics(ckpt / "rl_math" / "metrics.jsonl")] == [1]
    report = json.loads((tmp_path / "eval" / "report.json").read_text())
    assert 0.0 <= report["benchmarks"]["aime24"]["avg@1"] <= 1.0
    # the HF export of the RL checkpoint: RL started from the SFT weights (not the base's)
    assert json.loads((tmp_path / "out" / "hf" / "config.json").read_text())["model_type"] == \
        "qwen3"
    from megatron_klear.checkpoint.convert import convert_megatron_to_hf

    sft_hf = convert_megatron_to_hf(ckpt / "sft", tmp_path / "sft_hf")
    assert max_abs_diff(tmp_path / "out" / "hf", sft_hf) < 1e-5
    assert max_abs_diff(sft_hf, tiny["base"]) > 1e-4
    assert max_abs_diff(tmp_path / "out" / "hf", tmp_path / "eval" / "hf_model") == 0.0
    assert (tmp_path / "dashboard.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
