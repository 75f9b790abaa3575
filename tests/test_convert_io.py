"""The byte-level paths of the streaming converters, against torch's own results (no
processes): the runs/slices that Megatron -> HF copies file to file, the torch.save record
parser behind ``TorchDistReader.read_parts``, and mapped reads with their page release."""

from __future__ import annotations

import pytest
import torch

from megatron_klear.checkpoint import hf_bridge, hf_io, torch_dist_io
from megatron_klear.models.qwen3 import qwen3_config_from_hf
from megatron_klear.models.tiny import tiny_qwen3_config

ARCH = qwen3_config_from_hf(tiny_qwen3_config(vocab_size=103))  # 4 heads, 2 groups, head_dim 16


@pytest.mark.parametrize("kind,shape", [("qkv", (128, 64)), ("gate_up", (256, 64)),
                                        ("vocab", (128, 64)), ("row", (64, 128)),
                                        ("replicated", (16,))])
@pytest.mark.parametrize("cuts", [[], [1], [5, 77]])
def test_byte_slices_of_meta_runs_are_merge_shards_bytes(kind, shape, cuts):
    """Runs found on a meta tensor's views, sliced out of the parameter given as parts
    (saved chunks), are the bytes of merge_shards' HF tensors."""
    full = torch.randn(shape).to(torch.bfloat16)
    rows = [0, *[c for c in cuts if c < shape[0]], shape[0]]
    parts = [full[a:b].clone() for a, b in zip(rows, rows[1:])]
    meta = torch.empty(shape, dtype=full.dtype, device="meta")
    expected = hf_bridge.merge_shards(kind, [full], ARCH)
    views = [v for v, _ in hf_bridge.merge_views(kind, meta, 1, ARCH)]
    assert len(views) == len(expected)
    for view, want in zip(views, expected):
        got = b"".join(bytes(b) for b in hf_io.byte_slices(parts, hf_io.element_runs(view)))
        assert got == want.contiguous().view(torch.uint8).numpy().tobytes()


def test_element_runs_of_a_transpose_are_single_elements():
    t = torch.empty(3, 4, device="meta").t()
    assert hf_io.element_runs(t) == [(i + 4 * j, 1) for i in range(4) for j in range(3)]


def test_record_layout_finds_plain_tensors_and_refuses_the_rest(tmp_path):
    base = torch.arange(48, dtype=torch.float16).reshape(6, 8)
    cases = {"plain": base, "transposed": base.t(), "offset_view": base[1:],
             "not_a_tensor": {"a": base}}
    for name, obj in cases.items():
        torch.save(obj, tmp_path / name)
    path = tmp_path / "plain"
    data = path.read_bytes()
    offset, dtype, shape = torch_dist_io._record_layout(path, 0, len(data))
    assert (dtype, shape) == (torch.float16, (6, 8))
    assert data[offset:offset + base.nbytes] == base.numpy().tobytes()
    for name in ("transposed", "offset_view", "not_a_tensor"):
        size = (tmp_path / name).stat().st_size
        assert torch_dist_io._record_layout(tmp_path / name, 0, size) is None, name


def test_mapped_reads_equal_reads_and_release_their_pages(tmp_path):
    from safetensors.torch import save_file

    tensors = {"a": torch.randn(512, 1024), "b": torch.randn(7).to(torch.bfloat16)}
    save_file(tensors, str(tmp_path / "model.safetensors"))
    reader = hf_io.SafetensorsReader(tmp_path)
    for name, t in tensors.items():
        assert torch.equal(reader.mapped(name), t) and torch.equal(reader(name), t)
    view = reader.mapped("a")
    reader.release()  # the checks above touched every page
    resident = _resident_kb()
    view.sum()  # touch the pages: 2 MB become resident
    touched = _resident_kb()
    reader.release()
    assert touched - resident > 1500 and touched - _resident_kb() > 1500
    assert torch.equal(view, tensors["a"])  # released pages read in again from the file


def test_write_bytes_copies_mapped_bytes_file_to_file(tmp_path):
    from safetensors.torch import load_file, save_file

    t = torch.randn(64, 32)
    save_file({"x": t}, str(tmp_path / "in.safetensors"))
    reader = hf_io.SafetensorsReader(tmp_path)
    view = reader.mapped("x")
    plan = hf_io.ShardPlan("out.safetensors", [("y", t.dtype, (32, 32)), ("z", t.dtype, (4,))])
    out = tmp_path / "out"
    out.mkdir()
    shard = hf_io.ShardWriter(out / plan.file, plan)
    assert reader._maps.locate(hf_io._bytes_of(view)) is not None
    assert reader._maps.locate(hf_io._bytes_of(t)) is None
    shard.write_bytes("y", hf_io.byte_slices([view], hf_io.element_runs(view[16:48])),
                      reader._maps)
    z = t[0, :4].clone()
    shard.write_bytes("z", [hf_io._bytes_of(z)], reader._maps)  # not mapped: pwrite
    with pytest.raises(ValueError, match="planned"):
        shard.write_bytes("z", [hf_io._bytes_of(z[:3])])
    shard.close()
    back = load_file(out / plan.file)
    assert torch.equal(back["y"], t[16:48]) and torch.equal(back["z"], t[0, :4])


def _resident_kb() -> int:
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise RuntimeError("no VmRSS")


def test_torch_save_of_a_mapped_tensor_is_a_kernel_copy_that_loads_back(tmp_path, monkeypatch):
    """HF -> Megatron's output stream: torch.save of a view of a mapped input file copies
    its data file to file, and torch.load (as megatron's loader does) reads it back."""
    from safetensors.torch import save_file

    t = torch.randn(64, 512)
    save_file({"x": t}, str(tmp_path / "in.safetensors"))
    reader = hf_io.SafetensorsReader(tmp_path)
    copies = []
    real = hf_io.copy_range
    monkeypatch.setattr(hf_io, "copy_range",
                        lambda *a: copies.append(a[-1]) or real(*a))
    with open(tmp_path / "rec.pt", "wb") as f, torch_dist_io._no_crc32():
        stream = torch_dist_io._CopyingStream(f, reader.maps)
        torch.save({"a": reader.mapped("x"), "b": t[:2].clone()}, stream)
    assert copies == [t.nbytes]  # the small tensor and the zip records were plain writes
    back = torch.load(tmp_path / "rec.pt", weights_only=True)
    assert torch.equal(back["a"], t) and torch.equal(back["b"], t[:2])
