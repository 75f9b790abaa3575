"""W&B logging: an offline run holds the same metrics as metrics.jsonl, and a resumed run
continues the same W&B run. The run is read back from its ``.wandb`` files with the wandb
package's own record protobuf."""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

import pytest

from megatron_klear.config import ConfigError, parse_config
from megatron_klear.train.main import load_config
from megatron_klear.train.metrics import read_metrics
from tests.dist import run_distributed

wandb = pytest.importorskip("wandb")  # installed by requirements-ci.txt: CI never skips


def wandb_records(path: Path) -> Iterator[bytes]:
    """The records of a ``.wandb`` file: a 7-byte ``:W&B`` header, then LevelDB's log format
    (32 KiB blocks; each chunk has a 7-byte header: crc32c, little-endian length, type
    FULL=1 / FIRST=2 / MIDDLE=3 / LAST=4; a block's tail under 7 bytes is zero padding)."""
    data, block, pos, record = path.read_bytes(), 32768, 7, b""
    assert data[:4] == b":W&B", path
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:
            pos += left
            continue
        length, kind = int.from_bytes(data[pos + 4:pos + 6], "little"), data[pos + 6]
        if kind == 0:  # preallocated zeros past the last record
            break
        record += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            yield record
            record = b""


def wandb_history(run_dir: Path) -> dict[int, dict[str, float]]:
    """Step -> logged scalars of every ``.wandb`` file below ``run_dir`` (resumed runs write
    one file per process)."""
    import json

    from wandb.proto import wandb_internal_pb2 as pb

    out: dict[int, dict[str, float]] = {}
    for path in sorted(run_dir.rglob("run-*.wandb")):
        for raw in wandb_records(path):
            rec = pb.Record()
            rec.ParseFromString(raw)
            if rec.WhichOneof("record_type") != "history":
                continue
            items = {i.key or "/".join(i.nested_key): json.loads(i.value_json)
                     for i in rec.history.item}
            out[int(items.pop("_step"))] = {k: v for k, v in items.items()
                                             if not k.startswith("_")}
    return out


def _sft(rank, world, argv):
    from megatron_klear.train.sft import SFTConfig, train

    train(load_config(SFTConfig, argv))


def test_offline_run_matches_metrics_and_resume_continues_it(tmp_path):
    from megatron_klear.data.synthetic import write_arithmetic_data
    from megatron_klear.models.tiny import save_tiny_hf_model

    hf = save_tiny_hf_model(tmp_path / "hf", seed=0)
    data = write_arithmetic_data(tmp_path / "data", n_sft=40, n_rl=4, n_eval=4)["sft"]
    save = tmp_path / "ck"
    argv = ["--hf-checkpoint", str(hf), "--data-path", str(data), "--save", str(save),
            "--seq-length", "64", "--micro-batch-size", "2", "--global-batch-size", "2",
            "--no-progress-bar", "--save-interval", "1", "--wandb-project", "klear-test",
            "--wandb-run-name", "tiny-sft", "--wandb-mode", "offline"]
    run_distributed(_sft, 1, argv + ["--train-iters", "2"])
    run_distributed(_sft, 1, argv + ["--train-iters", "3", "--load", str(save)])

    run_ids = {p.name.rsplit("-", 1)[-1] for p in (save / "wandb").glob("offline-run-*")}
    assert run_ids == {(save / "wandb_run_id").read_text()}  # the resume continued the run
    logged = wandb_history(save / "wandb")
    metrics = {m["step"]: m for m in read_metrics(save / "metrics.jsonl")}
    assert sorted(logged) == sorted(metrics) == [1, 2, 3]
    for step, m in metrics.items():
        scalars = {k: v for k, v in m.items() if isinstance(v, (int, float)) and k != "step"
                   and k != "time"}
        assert scalars and logged[step] == pytest.approx(scalars, rel=1e-12), step


def test_wandb_flags_need_a_project():
    with pytest.raises(ConfigError, match="--wandb-run-name needs --wandb-project"):
        from megatron_klear.train.sft import SFTConfig

        parse_config(SFTConfig, ["--hf-checkpoint", "x", "--data-path", "y",
                                 "--wandb-run-name", "r"])
