"""The embedded server's model: an HF Qwen3 checkpoint and batched KV-cache decoding.

One :class:`Generator` owns the transformers model. :meth:`Generator.run_batch` decodes a
batch of sequences (the n samples of every request the scheduler gathered) together: the
prompts are left-padded, prefilled once, then decoded step by step with a shared KV cache.
The model lock is taken per forward step, so a weight update waits at most one step and
a paused batch (``in_place``, ``retract``) does not block it; after a ``retract`` pause the
batch is prefilled again with the new weights.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch

from megatron_klear import platform
from megatron_klear.rollout.engine.qwen3_decode import ONEDNN_MIN_ROWS, FusedWeights, KVCache, \
    check_supported, forward
from megatron_klear.rollout.engine.sampling import (RowSettings, find_stop_string, sample_next,
                                                    seeded_uniforms, token_logprobs)
from megatron_klear.rollout.orchestration.request import SamplingParams

__all__ = ["Sequence", "Generator"]

INITIAL_DECODE_CAPACITY = 1024  # new tokens the KV cache holds before it first grows
# a batch drops its finished rows (one copy of the KV cache) once a quarter of them have
# finished: each later step computes only unfinished rows, as SGLang's running batch does
COMPACT_AT = 0.75
# a batch of at least ONEDNN_MIN_ROWS rows is compacted to a multiple of this many (a few
# finished rows stay, their tokens unused): oneDNN builds a kernel per row count, so the
# counts stay few, as SGLang pads a decode batch to one of its CUDA graphs' batch sizes
ROW_QUANTUM = 16


@dataclass
class Sequence:
    """One sample being decoded: prompt, sampling config and what was generated so far."""

    prompt_ids: list[int]
    cfg: SamplingParams
    want_input_logprobs: bool = False
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    input_logprobs: list[float] = field(default_factory=list)
    # SGLang's top_logprobs_num: the k most likely tokens of each position, as (logprobs, ids)
    # sorted by logprob, descending (torch.topk, as sglang/srt/layers/logprob_processor.py)
    top_logprobs_num: int = 0
    input_top_logprobs: list[tuple[list[float], list[int]]] = field(default_factory=list)
    output_top_logprobs: list[tuple[list[float], list[int]]] = field(default_factory=list)
    text: str = ""
    finish_reason: dict | None = None
    seed: int | None = None  # sampling_seed (deterministic inference): draws from (seed, pos)
    want_routed_experts: bool = False
    routed: list[torch.Tensor] = field(default_factory=list)  # [positions, layers, top-k] runs

    def routed_experts(self) -> torch.Tensor:
        """The experts that routed every forwarded token, as SGLang's return_routed_experts:
        positions 0 .. prompt + output - 2 (the last sampled token is never forwarded)."""
        return torch.cat(self.routed)[:len(self.prompt_ids) + len(self.output_ids) - 1]


def expert_views(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Per-expert checkpoint names -> views of transformers' fused Qwen3-MoE expert tensors.

    transformers 5 holds a sparse layer's experts as ``mlp.experts.gate_up_proj`` [E, 2I, H]
    (gate rows first) and ``mlp.experts.down_proj`` [E, H, I]; checkpoints and weight sync
    name them per expert (``mlp.experts.{e}.gate_proj.weight``, as SGLang's Qwen3-MoE
    ``load_weights`` expects, sglang/srt/models/qwen3_moe.py). Each view is contiguous, so a
    broadcast lands directly in the fused tensor. Empty for a dense model.
    """
    views: dict[str, torch.Tensor] = {}
    for name, module in model.named_modules():
        gate_up, down = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
        if not (isinstance(gate_up, torch.nn.Parameter) and gate_up.dim() == 3):
            continue
        inter = gate_up.shape[1] // 2
        for e in range(gate_up.shape[0]):
            views[f"{name}.{e}.gate_proj.weight"] = gate_up.data[e, :inter]
            views[f"{name}.{e}.up_proj.weight"] = gate_up.data[e, inter:]
            views[f"{name}.{e}.down_proj.weight"] = down.data[e]
    return views


class _Draws:
    """The uniform draws of a decode batch, one per request row per step, finished or not (so
    a row's draws do not depend on when others finish): from the server's stream, or for a
    seeded sequence from (seed, position) only, like SGLang's ``multinomial_with_seed``
    (sglang/srt/layers/sampler.py), so it does not depend on the batch or server."""

    def __init__(self, seqs: list[Sequence], generator: torch.Generator) -> None:
        self.seqs, self.generator = seqs, generator
        self.seeded = [i for i, s in enumerate(seqs) if s.seed is not None]
        self.seeds = torch.tensor([seqs[i].seed % 2**63 for i in self.seeded], dtype=torch.long)

    def next(self) -> torch.Tensor:
        out = torch.rand(len(self.seqs), generator=self.generator, dtype=torch.float64)
        if self.seeded:
            pos = torch.tensor([len(self.seqs[i].prompt_ids) + len(self.seqs[i].output_ids)
                                for i in self.seeded])
            out[self.seeded] = seeded_uniforms(self.seeds, pos)
        return out


def _compaction(live: list[Sequence]) -> list[int] | None:
    """The rows a decoding batch keeps once it drops finished ones (COMPACT_AT): the
    unfinished rows, and from ONEDNN_MIN_ROWS rows on as many finished ones as make a multiple
    of ROW_QUANTUM; None while it keeps them all."""
    unfinished = [i for i, s in enumerate(live) if s.finish_reason is None]
    rows = len(unfinished)
    if rows >= ONEDNN_MIN_ROWS:
        rows = -(-rows // ROW_QUANTUM) * ROW_QUANTUM
    if rows > COMPACT_AT * len(live):
        return None
    finished = [i for i, s in enumerate(live) if s.finish_reason is not None]
    return sorted(unfinished + finished[:rows - len(unfinished)])


class Generator:
    """An HF Qwen3 model with batched sampling (fp32 by default).

    ``device``: where the weights, the KV cache and the forward live (``cpu``; ``cuda`` for
    the GPU check's colocated hand-over, tests/gpu/gpu_check.py); sampling stays on the host
    (the last logits are copied there each step), so its numbers do not depend on it.

    ``batch_invariant``: :meth:`run_batch` decodes every sequence alone, so a sequence's
    tokens and log-probs are the same whatever other sequences came in its batch: a batched
    forward's numbers depend on the batch (the left padding a row gets changes the length,
    so the order, of its attention reductions; the row count picks oneDNN's and MKL's
    kernels), measured in docs/rollout.md. It costs the batching's speed. ``on_policy``: the
    forward rounds as the trainer's megatron forward does (q/k norm and rotary embedding as
    separate ops), so a prefill's log-probs equal the trainer's bit for bit at TP=1."""

    def __init__(self, model_dir: str | Path, *, seed: int = 0, dtype: torch.dtype = torch.float32,
                 load_format: str = "auto", device: str = "cpu",
                 batch_invariant: bool = False, on_policy: bool = False) -> None:
        from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

        self.model_dir = str(model_dir)
        self.batch_invariant = batch_invariant
        self.on_policy = on_policy
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
        if load_format == "dummy":  # SGLang's --load-format dummy: random weights, no file reads
            config = AutoConfig.from_pretrained(self.model_dir)
            self.model = AutoModelForCausalLM.from_config(config).to(dtype)
        else:
            self.model = AutoModelForCausalLM.from_pretrained(self.model_dir, dtype=dtype)
        self.device = torch.device(device)
        self.model.to(self.device).eval().requires_grad_(False)
        self.config = self.model.config
        check_supported(self.config)
        self.dtype = dtype
        self.context_length = int(self.config.max_position_embeddings)
        self.eos_ids = self._eos_ids()
        self.lock = threading.Lock()
        self.generator = torch.Generator().manual_seed(seed)
        self._capturing = False
        self._captured: dict[int, torch.Tensor] = {}
        self.moe_layers = self._hook_routers()
        self.params = dict(self.model.named_parameters()) | expert_views(self.model)
        self._recv_pool: dict[str, list[list]] = {}  # flat buckets (receiving)
        self._released: dict[str, torch.Size] | None = None  # shapes while weights are released
        self._fused: FusedWeights | None = None  # of the current weights; None: build anew

    def _hook_routers(self) -> list[int]:
        """Record each sparse layer's top-k expert ids (transformers' Qwen3MoeTopKRouter
        returns logits, scores, indices) while :attr:`_capturing`; the layers hooked."""
        layers = []
        for i, layer in enumerate(self.model.model.layers):
            gate = getattr(layer.mlp, "gate", None)
            if gate is None or not hasattr(gate, "top_k"):
                continue

            def hook(_module, _inputs, output, i=i):
                if self._capturing:
                    self._captured[i] = output[2]
            gate.register_forward_hook(hook)
            layers.append(i)
        return layers

    def _routing(self, b: int, t: int) -> torch.Tensor:
        """The ids recorded by the last forward of ``b`` x ``t`` tokens: [b, t, layers, k]
        (layers without experts hold 0, as SGLang's capture buffer)."""
        k = int(self.config.num_experts_per_tok)
        out = torch.zeros(b, t, self.config.num_hidden_layers, k, dtype=torch.int16)
        for i in self.moe_layers:
            out[:, :, i] = self._captured[i].view(b, t, k).cpu()
        return out

    def _eos_ids(self) -> set[int]:
        eos = self.config.eos_token_id
        ids = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        if self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        return ids

    # ------------------------------------------------------------------ decoding
    @torch.no_grad()
    def run_batch(self, seqs: list[Sequence], abort: threading.Event,
                  running: threading.Event, retract: threading.Event | None = None) -> None:
        """Decode ``seqs`` to completion in place (``finish_reason`` set on every one).

        ``running`` is cleared while generation is paused (decoding waits between steps);
        ``abort`` set finishes every unfinished sequence with reason ``abort``; ``retract`` set
        (a ``retract`` pause, as SGLang's) drops the KV cache when decoding resumes and
        prefills prompt + tokens so far again with the weights loaded meanwhile.
        ``batch_invariant``: one sequence after the other, each its own batch.
        """
        if self.batch_invariant and len(seqs) > 1:
            for s in seqs:
                self.run_batch([s], abort, running, retract)
            return
        self._capturing = any(s.want_routed_experts for s in seqs)
        ids, logits, pos, cache = self._prefill(seqs)
        self._fill_input_logprobs(seqs, ids, logits)
        last = logits[:, -1]
        for s in seqs:
            if s.cfg.max_new_tokens == 0:
                self._finish(s, {"type": "length", "length": 0})
        settings, draws = RowSettings.of([s.cfg for s in seqs]), _Draws(seqs, self.generator)
        live, rows = list(seqs), torch.arange(len(seqs))  # the cache's rows (_compaction)
        while any(s.finish_reason is None for s in seqs):
            running.wait()
            if abort.is_set():
                self._abort(seqs)
                break
            if retract is not None and retract.is_set():
                retract.clear()
                _, logits, pos, cache = self._prefill(live)
                last = logits[:, -1]
            self._step(live, settings, token_logprobs(last, settings.temperature),
                       draws.next()[rows])
            if all(s.finish_reason is not None for s in seqs):
                break
            keep = _compaction(live)
            if keep is not None:  # drop finished rows from the batch
                index = torch.tensor(keep)
                cache.select(index)
                live, rows, pos = [live[i] for i in keep], rows[index], pos[index]
                settings = settings.select(index)
            nxt = torch.tensor([[s.output_ids[-1] if s.output_ids else 0] for s in live])
            pos = pos + 1
            last = self._forward(nxt, pos, cache)[:, -1]
            if self._capturing:
                step = self._routing(len(live), 1)
                for row, s in enumerate(live):
                    if s.finish_reason is None:
                        s.routed.append(step[row])

    def _prefill(self, seqs: list[Sequence]):
        """A fresh KV cache of every sequence's prompt + tokens so far (left-padded): the ids,
        logits (of every position where a sequence wants input logprobs, else of the last),
        last positions and cache. Identical rows are computed once."""
        rows = [tuple(s.prompt_ids + s.output_ids) for s in seqs]
        unique = {row: i for i, row in enumerate(dict.fromkeys(rows))}
        ids, mask = self._left_pad([list(row) for row in unique])
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        longest = max(s.cfg.max_new_tokens - len(s.output_ids) for s in seqs)
        cache = KVCache(self.config, mask.to(self.device), self.dtype,
                        ids.shape[1] + min(longest, INITIAL_DECODE_CAPACITY))
        logits = self._forward(ids, positions, cache,
                               all_logits=any(s.want_input_logprobs for s in seqs))
        routing = self._routing(*ids.shape) if self._capturing else None
        if len(unique) < len(rows):  # the n samples of a prompt share one prefill (a prefix
            index = torch.tensor([unique[row] for row in rows])  # cache hit in SGLang)
            cache.select(index)
            ids, logits, positions = ids[index], logits[index], positions[index]
            routing = None if routing is None else routing[index]
        if routing is not None:  # every token so far (left padding dropped); a retract redoes it
            for row, (s, tokens) in enumerate(zip(seqs, rows)):
                s.routed = [routing[row, ids.shape[1] - len(tokens):]]
        return ids, logits, positions[:, -1:], cache

    def _forward(self, ids: torch.Tensor, positions: torch.Tensor, cache: KVCache,
                 all_logits: bool = False) -> torch.Tensor:
        with self.lock:
            if self._fused is None and self._fuses():
                self._fused = FusedWeights(self.model)
            return forward(self.model, ids.to(self.device), positions.to(self.device), cache,
                           all_logits, self._fused, fused_rope=not self.on_policy).cpu()

    def _fuses(self) -> bool:
        """Whether the forward runs fused projections: an fp32 CPU model where oneDNN's
        linear runs (the only place they gain; elsewhere the copy would be memory for
        nothing)."""
        return (self.dtype == torch.float32 and self.device.type == "cpu"
                and platform.onednn_linear() is not None)

    def _weights_changed(self) -> None:
        """Drop the fused copy of the weights; with the lock held, by every method that
        changes a parameter (the next forward fuses the new ones)."""
        self._fused = None

    def _left_pad(self, prompts: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        width = max(len(p) for p in prompts)
        pad = self.tokenizer.pad_token_id or 0
        ids = torch.full((len(prompts), width), pad, dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for row, p in enumerate(prompts):
            ids[row, width - len(p):] = torch.tensor(p, dtype=torch.long)
            mask[row, width - len(p):] = 1
        return ids, mask

    def _fill_input_logprobs(self, seqs: list[Sequence], ids: torch.Tensor,
                             logits: torch.Tensor) -> None:
        """Logprob of prompt token j given tokens < j (j >= 1), for sequences that ask: of
        the unscaled logits, whatever the request's temperature, as SGLang's
        (sglang/srt/layers/logprob_processor.py applies no temperature to input logprobs)."""
        for row, s in enumerate(seqs):
            if not s.want_input_logprobs or len(s.prompt_ids) < 2:
                continue
            start = ids.shape[1] - len(s.prompt_ids)
            temp = torch.ones(len(s.prompt_ids) - 1)
            lp = token_logprobs(logits[row, start:-1], temp)
            targets = ids[row, start + 1:]
            s.input_logprobs = lp.gather(1, targets[:, None])[:, 0].tolist()
            if s.top_logprobs_num:
                s.input_top_logprobs = _top_logprobs(lp, [s.top_logprobs_num] * len(lp))

    def _step(self, seqs: list[Sequence], settings: RowSettings, logprobs: torch.Tensor,
              uniforms: torch.Tensor) -> None:
        tokens = sample_next(logprobs, settings, uniforms)
        chosen = logprobs.gather(1, tokens[:, None])[:, 0].tolist()
        ks = [s.top_logprobs_num if s.finish_reason is None else 0 for s in seqs]
        tops = _top_logprobs(logprobs, ks) if any(ks) else []
        for row, (s, tok, lp) in enumerate(zip(seqs, tokens.tolist(), chosen)):
            if s.finish_reason is not None:
                continue
            s.output_ids.append(tok)
            s.logprobs.append(lp)
            if s.top_logprobs_num:
                s.output_top_logprobs.append(tops[row])
            self._check_stop(s, tok)

    def _check_stop(self, s: Sequence, tok: int) -> None:
        if (tok in self.eos_ids and not s.cfg.ignore_eos) or tok in s.cfg.stop_token_ids:
            self._finish(s, {"type": "stop", "matched": tok})
            return
        if s.cfg.stop:
            text = self.decode(s.output_ids, s.cfg)
            hit = find_stop_string(text, s.cfg.stop)
            if hit is not None:
                s.text = text[:hit[0]]
                s.finish_reason = {"type": "stop", "matched": hit[1]}
                return
        if (len(s.output_ids) >= s.cfg.max_new_tokens
                or len(s.prompt_ids) + len(s.output_ids) >= self.context_length):
            self._finish(s, {"type": "length", "length": len(s.output_ids)})

    def _finish(self, s: Sequence, reason: dict) -> None:
        s.text = self.decode(s.output_ids, s.cfg)
        s.finish_reason = reason

    def _abort(self, seqs: list[Sequence]) -> None:
        for s in seqs:
            if s.finish_reason is None:
                self._finish(s, {"type": "abort", "message": "Abort before finishing: "
                                 "generation paused with mode='abort'"})

    def decode(self, ids: list[int], cfg: SamplingParams) -> str:
        """Detokenise generated ids (special tokens skipped unless the request says not to)."""
        return self.tokenizer.decode(ids, skip_special_tokens=cfg.skip_special_tokens)

    # ------------------------------------------------------------------ weights
    @contextlib.contextmanager
    def receiving(self, specs: list[tuple[str, torch.dtype, tuple]], flattened: bool
                  ) -> Iterator[list[torch.Tensor]]:
        """The tensors to receive one weight-update request's broadcasts into (from the
        trainer, rank 0 of the group), in order; they are loaded when the block ends.

        Per tensor (``flattened`` False): a tensor whose name, shape and dtype match a
        parameter is received straight into the parameter's storage (no allocation, no
        copy; the model lock is held for the block), others into a new tensor copied in at
        the end. ``flattened``: one uint8 buffer holding the tensors' bytes back to back,
        from a pool per bucket; every parameter of the same dtype then becomes a view of the
        received bytes (no copy; others -- another dtype, fused expert views -- are copied).
        SGLang copies instead (``FlattenedTensorBucket`` views -> ``model.load_weights``,
        sglang/srt/weight_sync/tensor_bucket.py); the result, parameters holding the sent
        values, is the same. The block may post every broadcast before awaiting any (as
        SGLang's per-tensor path does, weight_updater.py). A name this model lacks or a
        wrong shape raises ValueError only after the block (so the sender never hangs in
        its broadcast), with nothing loaded; nothing is loaded either when the block fails.
        """
        errors = [e for e in (self._check_spec(n, shape) for n, _, shape in specs) if e]
        if flattened:
            sizes = [torch.Size(shape).numel() * dt.itemsize for _, dt, shape in specs]
            slot = self._free_buffer(specs[0][0], sum(sizes))
            yield [slot[0][:sum(sizes)]]
            if not errors:
                self._load_flat(specs, sizes, slot)
        else:
            direct = [not errors and self.params[n].dtype == dt
                      and self.params[n].is_contiguous() for n, dt, _ in specs]
            try:
                with self.lock if any(direct) else contextlib.nullcontext():
                    tensors = [self.params[n].data if d else
                               torch.empty(shape, dtype=dt, device=self.device)
                               for (n, dt, shape), d in zip(specs, direct)]
                    yield tensors
                if not errors:
                    with self.lock:
                        for (name, _, _), d, t in zip(specs, direct, tensors):
                            if not d:
                                self.params[name].copy_(t)
            finally:  # direct receives change parameters even in a block that failed
                with self.lock:
                    self._weights_changed()
        if errors:
            raise ValueError(errors[0])

    def load_tensors(self, named: list[tuple[str, torch.Tensor]]) -> None:
        """Copy ``(name, tensor)`` into the parameters (a tensor update passed by handle: the
        sender's memory is reused for its next bucket, so nothing may stay a view of it, as
        SGLang's ``model.load_weights`` copies). ValueError names the first unknown name or
        wrong shape, before anything is loaded."""
        errors = [e for e in (self._check_spec(n, tuple(t.shape)) for n, t in named) if e]
        if errors:
            raise ValueError(errors[0])
        with self.lock:
            self._weights_changed()
            for name, tensor in named:
                self.params[name].copy_(tensor)

    @property
    def weights_released(self) -> bool:
        """True between :meth:`release_weights` and :meth:`resume_weights`."""
        return self._released is not None

    def release_weights(self) -> int:
        """Free every parameter's memory (SGLang's ``release_memory_occupation`` with tag
        ``weights``, which unmaps it through torch_memory_saver); the bytes freed. On a GPU
        the caching allocator's free blocks (the parameters', the last batches' KV caches) go
        back to the driver too, so the device's free memory rises as with SGLang."""
        with self.lock:
            self._weights_changed()
            named = dict(self.model.named_parameters())
            self._released = {n: p.shape for n, p in named.items()}
            freed = sum(p.numel() * p.element_size() for p in named.values())
            for p in named.values():
                p.data = torch.empty(0, dtype=p.dtype, device=self.device)
            self.params, self._recv_pool = {}, {}
        torch.cuda.empty_cache()  # nothing to do where CUDA was never initialised
        return freed

    def resume_weights(self) -> None:
        """Allocate the parameters again. Their values are undefined until the next weight
        update, as SGLang's after a resume without ``--enable-weights-cpu-backup``
        (torch_memory_saver maps fresh pages); here they are NaN, so a rollout or probe
        served before the update shows it instead of passing by chance."""
        with self.lock:
            self._weights_changed()
            for name, p in self.model.named_parameters():
                p.data = torch.full(self._released[name], float("nan"), dtype=p.dtype,
                                    device=self.device)
            self._released = None
            self.params = dict(self.model.named_parameters()) | expert_views(self.model)

    def _check_spec(self, name: str, shape: tuple) -> str | None:
        param = self.params.get(name)
        if param is None:
            return f"unknown parameter {name!r}: not a tensor of this Qwen3 model"
        if tuple(param.shape) != tuple(shape):
            return (f"shape mismatch for {name!r}: the server holds {tuple(param.shape)}, "
                    f"the request sent {tuple(shape)}")
        return None

    def _load_flat(self, specs: list[tuple[str, torch.dtype, tuple]], sizes: list[int],
                   slot: list) -> None:
        """Parameters become views of the received bytes (``slot``: [buffer, names]); the
        names of those that did are kept with the buffer for :meth:`_free_buffer`."""
        buf, views, offset = slot[0], [], 0
        with self.lock:
            self._weights_changed()
            for (name, dtype, shape), size in zip(specs, sizes):
                received = buf[offset:offset + size].view(dtype).view(shape)
                param = self.params[name]
                if isinstance(param, torch.nn.Parameter) and param.dtype == dtype:
                    param.data = received
                    views.append(name)
                else:
                    param.copy_(received)
                offset += size
        slot[1] = views

    def _free_buffer(self, key: str, nbytes: int) -> list:
        """[a uint8 buffer of ``nbytes`` that no parameter is a view of, names]: one of the
        two pooled for the bucket ``key`` (its first tensor's name: the same bucket comes
        every sync, so pages are reused, not faulted in again; the other one backs the live
        parameters). Only :meth:`_load_flat` makes a parameter a view of a pooled buffer, so
        the parameters it made views of that buffer the last time are the only ones to check
        (a few per bucket instead of every parameter per request)."""
        def in_use(slot: list) -> bool:
            ptr = slot[0].untyped_storage().data_ptr()
            return any(self.params[n].untyped_storage().data_ptr() == ptr for n in slot[1])

        pool = self._recv_pool.setdefault(key, [])
        free = [slot for slot in pool if not in_use(slot)]
        fits = next((slot for slot in free if slot[0].numel() >= nbytes), None)
        if fits is None:
            fits = [torch.empty(nbytes, dtype=torch.uint8, device=self.device), []]
            if free:  # a free one too small: replaced
                pool[:] = [slot for slot in pool if slot is not free[0]]
            if len(pool) < 2:  # else both back parameters: this one is not pooled
                pool.append(fits)
        return fits


def _top_logprobs(logprobs: torch.Tensor, ks: list[int]) -> list[tuple[list[float], list[int]]]:
    """Per row of ``logprobs`` [rows, V]: its ``ks[row]`` largest log-probs and their ids,
    sorted descending. As SGLang's ``get_top_logprobs_raw``
    (sglang/srt/layers/logprob_processor.py): one ``topk`` at the largest k for all rows,
    each row then cut to its own k."""
    values, ids = logprobs.topk(min(max(ks), logprobs.shape[-1]), dim=-1)
    return [(v[:k], i[:k]) for v, i, k in zip(values.tolist(), ids.tolist(), ks)]
