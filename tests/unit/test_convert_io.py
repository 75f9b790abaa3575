"""The byte-level paths of the streaming converters, against torch's own results (no
processes): the runs/slices that Megatron -> HF copies file to file, the torch.save record
parser behind ``TorchDistReader.read_parts``, and mapped reads with their page release."""

from __future__ import annotations

import io

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
    assert reader._maps.locate(hf_io.bytes_of(view)) is not None
    assert reader._maps.locate(hf_io.bytes_of(t)) is None
    shard.write_bytes("y", hf_io.byte_slices([view], hf_io.element_runs(view[16:48])),
                      reader._maps)
    z = t[0, :4].clone()
    shard.write_bytes("z", [hf_io.bytes_of(z)], reader._maps)  # not mapped: pwrite
    with pytest.raises(ValueError, match="planned"):
        shard.write_bytes("z", [hf_io.bytes_of(z[:3])])
    shard.close()
    back = load_file(out / plan.file)
    assert torch.equal(back["y"], t[16:48]) and torch.equal(back["z"], t[0, :4])


def _resident_kb() -> int:
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise RuntimeError("no VmRSS")


def test_records_copy_mapped_pieces_file_to_file_aligned_and_load_back(tmp_path, monkeypatch):
    """HF -> Megatron's record writer: a tensor given as pieces (views of two mapped input
    files, then memory) is one torch.save record whose mapped bytes are kernel copies,
    whose data is aligned, and which torch.load (as megatron's loader does) and the
    Megatron -> HF record parser read back."""
    from safetensors.torch import save_file

    x, y = torch.randn(64, 512), torch.randn(32, 512)
    save_file({"x": x}, str(tmp_path / "a.safetensors"))
    save_file({"pad": torch.zeros(3), "y": y}, str(tmp_path / "b.safetensors"))
    reader = hf_io.SafetensorsReader(tmp_path)
    copies = []
    real = hf_io.copy_range
    monkeypatch.setattr(hf_io, "copy_range", lambda *a: copies.append(a[-1]) or real(*a))
    tail = torch.randn(2, 512)
    out = torch_dist_io._RecordFile(tmp_path / "out.distcp", reader.maps)
    first = out.tensor((1, 8, 512), [reader.mapped("x")[:8].reshape(-1)])
    obj = out.bytes(b"an object record")
    second = out.tensor((98, 512), [reader.mapped("y").reshape(-1),
                                    reader.mapped("x").reshape(-1), tail.reshape(-1)])
    out.close()
    assert copies == [8 * 512 * 4, y.nbytes, x.nbytes]  # the in-memory piece: pwrite
    data = (tmp_path / "out.distcp").read_bytes()
    assert data[obj[0]:obj[0] + obj[1]] == b"an object record"
    for (offset, length), want in ((first, x[:8][None]), (second, torch.cat([y, x, tail]))):
        back = torch.load(io.BytesIO(data[offset:offset + length]), weights_only=True)
        assert torch.equal(back, want)
        start, dtype, shape = torch_dist_io._record_layout(tmp_path / "out.distcp", offset,
                                                           length)
        assert (dtype, shape) == (torch.float32, tuple(want.shape))
        assert (offset + start) % torch_dist_io._ALIGN == 0


def test_split_parts_are_views_of_the_inputs_that_concatenate_to_the_split():
    """The parts HF -> Megatron writes from are views of the HF tensors (no copy) and
    concatenate to the TP shard a pure-torch reference builds (q/k/v per query group,
    zero-padded vocabulary)."""
    q, k, v = torch.randn(64, 64), torch.randn(32, 64), torch.randn(32, 64)
    emb = torch.randn(103, 64)
    groups = 2
    qkv = torch.cat([q.view(groups, -1, 64), k.view(groups, -1, 64), v.view(groups, -1, 64)],
                    dim=1).reshape(-1, 64)
    for tp in (1, 2):
        padded = torch.cat([emb, emb.new_zeros(128 * tp - 103, 64)])
        for kind, full, ref in (("qkv", [q, k, v], qkv), ("vocab", [emb], padded)):
            for rank in range(tp):
                parts = hf_bridge.split_parts_for_rank(kind, full, ARCH, tp, rank)
                assert torch.equal(torch.cat(parts), ref.chunk(tp)[rank]), (kind, tp, rank)
                inputs = {t.untyped_storage().data_ptr() for t in full}
                assert sum(p.untyped_storage().data_ptr() in inputs for p in parts) >= \
                    len(parts) - (kind == "vocab")
