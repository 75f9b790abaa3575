"""The embedded CPU rollout server: SGLang's HTTP API over an HF Qwen3 model (aiohttp).

On GPU clusters the trainer talks to SGLang servers; on CPU it talks to this server, which
speaks the same API (sglang 0.5.x, see docs/ARCHITECTURE.md "SGLang protocol facts"), so
the trainer's rollout and weight-sync code is one code path exercised in CI over real HTTP
and a real torch.distributed group:

* ``POST /generate`` -- text or input_ids, sampling_params (n, temperature, top_p, top_k,
  max_new_tokens, stop, stop_token_ids, ignore_eos), return_logprob, logprob_start_len,
  top_logprobs_num; responses with ``text``, ``output_ids`` and ``meta_info`` (finish_reason,
  output_token_logprobs ``[[logprob, id, None], ...]``, input_token_logprobs, with
  top_logprobs_num k > 0 input_top_logprobs and output_top_logprobs, weight_version);
  a list when n > 1. Logprobs are ``log_softmax(logits / temperature)`` (see sampling.py).
* health/admin: ``/health``, ``/health_generate``, ``/flush_cache``, ``/model_info``,
  ``/get_weight_version``, ``/pause_generation``, ``/continue_generation``;
* weight updates: ``/init_weights_update_group``, ``/begin_weight_update``,
  ``/update_weights_from_distributed`` (per tensor -- received straight into the matching
  parameter -- or ``load_format="flattened_bucket"``: one uint8 buffer holding the tensors'
  bytes back to back in request order, received into a reused buffer),
  ``/end_weight_update``, ``/destroy_weights_update_group``. Updates outside begin/end are
  refused (sglang >= 0.5.19 rule).
  ``/update_weights_from_tensor`` (SGLang's ``serialized_named_tensors``: tensors passed by
  torch multiprocessing handle, ``load_format`` null or ``"flattened_bucket"``; colocated
  mode, tensor_handles.py) is copied into the parameters.
* colocation: ``/release_memory_occupation`` and ``/resume_memory_occupation`` with SGLang's
  ``tags`` (``kv_cache``, ``weights``, ``cuda_graph``; none: all), kept as SGLang 0.5.23
  keeps them with ``--enable-memory-saver``
  (sglang/srt/managers/scheduler_components/weight_updater.py, ``release_memory_occupation``
  / ``resume_memory_occupation``): releasing a tag that is released already (torch_memory_saver:
  "Cannot pause allocation that is not active") or resuming one that is not released
  (``offload_tags.remove`` raises in the scheduler) ENDS the server process, as the real
  scheduler's failure ends SGLang. Releasing ``weights`` frees the parameters; resumed,
  they hold NaN until the next update (SGLang's hold whatever torch_memory_saver maps).
  There is no KV cache between batches here, so ``kv_cache`` only marks the server unable
  to generate; ``cuda_graph`` has nothing to free on a CPU. While any tag is released,
  /generate is refused (400). ``/server_info`` reports the released tags as
  ``memory_released`` (SGLang keeps its ``offload_tags`` internal: a colocated trainer asks
  this server, and assumes the launch scripts' state of a real one, train/colocate.py).
* routed experts (MoE routing replay): returned only when the server was started with
  ``--enable-return-routed-experts``; without it a request's ``return_routed_experts`` is
  ignored, as SGLang 0.5.23 ignores it (sglang/srt/state_capturer/routed_experts.py).
* tensor handles of (virtual) GPU memory: a handle names the device it was made on by UUID
  (SGLang's ``monkey_patch_torch_reductions``); one for a GPU outside this server's
  ``CUDA_VISIBLE_DEVICES`` is refused as SGLang refuses it ("Invalid device_uuid",
  sglang/srt/utils/patch_torch.py).

Bad requests get HTTP 400 with ``{"error": {"message": ...}}`` naming the field.
Run: ``python -m megatron_klear.rollout.engine.server --model DIR --port P``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import pickle
import random
import signal
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Callable

import torch
from aiohttp import web

from megatron_klear.config import OneLineParser
from megatron_klear.heap import freeze_startup_heap, keep_freed_memory
from megatron_klear.orphans import exit_when_orphaned
from megatron_klear.rollout.orchestration.client import encode_routed_experts
from megatron_klear.rollout.engine.generator import Generator, Sequence
from megatron_klear.rollout.orchestration.request import RequestError, SamplingParams
from megatron_klear.rollout.transport.tensor_handles import bucket_tensors, deserialize
from megatron_klear.rollout.transport.update_group import (UpdateGroup, open_update_group,
                                                           parse_dtype)

__all__ = ["RolloutServer", "build_app", "main"]

log = logging.getLogger("megatron_klear.rollout.engine.server")

# test hook: "SEED:MAX_S" delays each /generate reply by a seeded random time in [0, MAX_S), so
# tests can make replies arrive in another order than the requests went out (tests/multiprocess/test_rl.py)
REPLY_DELAY_ENV = "MEGATRON_KLEAR_TEST_REPLY_DELAY"


def _reply_delays(server_seed: int) -> Callable[[], float] | None:
    """The seeded delay draws of :data:`REPLY_DELAY_ENV` (None when unset); a bad value exits
    2 naming it."""
    value = os.environ.get(REPLY_DELAY_ENV)
    if not value:
        return None
    try:
        seed, max_s = (float(x) for x in value.split(":"))
    except ValueError:
        print(f"error: {REPLY_DELAY_ENV}={value!r}: expected SEED:MAX_SECONDS, e.g. 0:0.5",
              file=sys.stderr)
        raise SystemExit(2) from None
    rng = random.Random(int(seed) * 1000 + server_seed)
    return lambda: rng.uniform(0.0, max_s)


# SGLang's memory tags (sglang/srt/constants.py, GPU_MEMORY_ALL_TYPES), in its order
MEMORY_TAGS = ("kv_cache", "weights", "cuda_graph")


def _error(message: str, status: int = 400) -> web.Response:
    return web.json_response({"error": {"message": message}}, status=status)


async def _json_body(request: web.Request) -> dict:
    try:
        body = await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise RequestError(f"request body is not valid JSON ({exc})") from exc
    if not isinstance(body, dict):
        raise RequestError("request body must be a JSON object")
    return body


@dataclass
class _Request:
    """One /generate call: its n sequences and the future its handler awaits."""

    rid: str
    seqs: list[Sequence]
    future: asyncio.Future
    return_logprob: bool
    logprob_start_len: int
    batched: bool = False  # SGLang's batch form: the reply is a list, one output per prompt
    return_routed_experts: bool = False
    start: float = field(default_factory=time.monotonic)


class RolloutServer:
    """State of one embedded server: generator, scheduler, pause flags, weight-update groups."""

    def __init__(self, generator: Generator, *, max_batch_seqs: int = 64,
                 deterministic: bool = False, return_routed_experts: bool = False,
                 seed: int = 0) -> None:
        self.gen = generator
        self.reply_delay = _reply_delays(seed)
        self.deterministic = deterministic
        self.return_routed_experts = return_routed_experts  # --enable-return-routed-experts
        self.max_batch_seqs = max_batch_seqs
        self.weight_version = "default"
        self.pending: list[_Request] = []
        self.running: list[_Request] = []
        self.wakeup = asyncio.Event()
        self.abort = threading.Event()
        self.retract = threading.Event()  # the running batch re-prefills when it resumes
        self.resumed = threading.Event()
        self.resumed.set()
        self.groups: dict[str, UpdateGroup] = {}
        self.in_weight_update = False
        self.update_lock = asyncio.Lock()
        self.released: set[str] = set()  # memory tags released (colocated mode)

    # ------------------------------------------------------------------ scheduler
    async def scheduler(self) -> None:
        """Gather pending requests and decode them together, batch after batch."""
        while True:
            await self.wakeup.wait()
            self.wakeup.clear()
            while self.pending:
                await asyncio.to_thread(self.resumed.wait)
                self.running, budget = [], self.max_batch_seqs
                while self.pending and (not self.running or budget >= len(self.pending[0].seqs)):
                    budget -= len(self.pending[0].seqs)
                    self.running.append(self.pending.pop(0))
                await self._run(self.running)
                self.running = []

    async def _run(self, batch: list[_Request]) -> None:
        seqs = [s for r in batch for s in r.seqs]
        self.retract.clear()  # a new batch prefills with the weights loaded now anyway
        try:
            await asyncio.to_thread(self.gen.run_batch, seqs, self.abort, self.resumed,
                                    self.retract)
        except Exception as exc:  # a model failure fails these requests, not the server
            log.exception("generation failed")
            for r in batch:
                if not r.future.done():
                    r.future.set_exception(exc)
            return
        for r in batch:
            if not r.future.done():
                r.future.set_result(self._response(r))

    def _response(self, r: _Request) -> dict | list[dict]:
        outs = []
        for i, s in enumerate(r.seqs):
            meta = {"id": r.rid if len(r.seqs) == 1 else f"{r.rid}_{i}",
                    "finish_reason": s.finish_reason, "prompt_tokens": len(s.prompt_ids),
                    "completion_tokens": len(s.output_ids), "cached_tokens": 0,
                    "weight_version": self.weight_version,
                    "e2e_latency": time.monotonic() - r.start}
            if r.return_logprob:
                meta["output_token_logprobs"] = [[lp, t, None]
                                                 for lp, t in zip(s.logprobs, s.output_ids)]
                if r.logprob_start_len >= 0:
                    meta["input_token_logprobs"] = self._input_logprobs(s, r.logprob_start_len)
                if s.top_logprobs_num:
                    meta.update(self._top_logprobs(s, r.logprob_start_len))
            if r.return_routed_experts:  # SGLang's form: base64 int32 [positions, layers, k]
                meta["routed_experts"] = encode_routed_experts(s.routed_experts())
            outs.append({"text": s.text, "output_ids": list(s.output_ids), "meta_info": meta})
        return outs if r.batched or len(outs) > 1 else outs[0]

    @staticmethod
    def _input_logprobs(s: Sequence, start: int) -> list[list]:
        """SGLang's ``input_token_logprobs``: one entry per prompt token from ``start`` on,
        the first one's logprob None whatever ``start`` is
        (sglang/srt/managers/scheduler_components/logprob_result_processor.py
        ``_process_input_token_logprobs``: ``[None] + input_token_logprobs[:-1]``)."""
        lps = [None] + s.input_logprobs
        return [[None if j == start else lps[j], s.prompt_ids[j], None]
                for j in range(start, len(s.prompt_ids))]

    @staticmethod
    def _top_logprobs(s: Sequence, start: int) -> dict[str, list]:
        """SGLang 0.5.23's ``input_top_logprobs`` / ``output_top_logprobs`` of a request with
        ``top_logprobs_num`` k: per position a list of k ``[logprob, id, None]`` sorted by
        logprob, descending; the input rows align with ``input_token_logprobs`` (from
        ``start`` on, the first None: sglang/srt/managers/scheduler_components/
        logprob_result_processor.py ``_process_input_top_logprobs`` puts ``[None]`` before the
        rows and pops the last, tokenizer_manager.py ``detokenize_top_logprobs_tokens`` keeps
        the None); empty without input log-probs (``start`` -1: SGLang's scheduler.py moves
        it to the prompt's end, so no input row is left)."""
        def rows(tops):
            return [[[lp, t, None] for lp, t in zip(vals, ids)] for vals, ids in tops]
        return {"output_top_logprobs": rows(s.output_top_logprobs),
                "input_top_logprobs": [None] + rows(s.input_top_logprobs[start:])
                if start >= 0 else []}

    # ------------------------------------------------------------------ /generate
    def parse_generate(self, body: dict) -> _Request:
        """Validate a /generate body into a queued request (RequestError names the field).

        SGLang's batch form is accepted too: ``input_ids`` a list of id lists (or ``text`` a
        list of strings) with ``sampling_params`` one object for all or a list of one per
        prompt; the reply is then a list with one output per prompt, in order. Within a batch
        every prompt must have n = 1 (SGLang orders a batch's n > 1 copies its own way,
        sglang/srt/managers/io_struct.py ``GenerateReqInput``; the client never sends that).
        """
        if body.get("stream"):
            raise RequestError("stream=true is not supported by the embedded server")
        if self.released & set(MEMORY_TAGS):
            raise RequestError(f"memory released (tags {sorted(self.released)}): POST "
                               "/resume_memory_occupation before generating")
        prompts, batched = self._prompts(body)
        cfgs = self._sampling_configs(body.get("sampling_params"), len(prompts), batched)
        start = body.get("logprob_start_len", -1)
        want_input = bool(body.get("return_logprob")) and isinstance(start, int) and start >= 0
        tops = self._top_logprobs_nums(body.get("top_logprobs_num"), len(prompts))
        seqs = []
        for prompt, cfg, top in zip(prompts, cfgs, tops):
            self._check_prompt(prompt, cfg, start)
            for s in self._sequences(prompt, cfg, want_input):
                s.top_logprobs_num = top if body.get("return_logprob") else 0
                seqs.append(s)
        # SGLang ignores the field unless started with --enable-return-routed-experts
        routed = bool(body.get("return_routed_experts")) and self.return_routed_experts
        if routed and not self.gen.moe_layers:
            raise RequestError("return_routed_experts: the served model has no MoE layers")
        for s in seqs:
            s.want_routed_experts = routed
        rid = body.get("rid") or uuid.uuid4().hex
        return _Request(str(rid), seqs, asyncio.get_running_loop().create_future(),
                        bool(body.get("return_logprob")), start, batched, routed)

    @staticmethod
    def _top_logprobs_nums(value, count: int) -> list[int]:
        """``top_logprobs_num`` per prompt: one int for all, or one per prompt of a batch
        (SGLang's ``GenerateReqInput.normalize_param``, sglang/srt/managers/io_struct.py); None
        is 0."""
        nums = value if isinstance(value, list) else [value or 0] * count
        if len(nums) != count or not all(isinstance(k, int) and k >= 0 for k in nums):
            raise RequestError(f"top_logprobs_num must be an integer >= 0 or a list of {count} "
                               f"(one per prompt), got {value!r}")
        return nums

    def _sampling_configs(self, params, count: int, batched: bool) -> list[SamplingParams]:
        if not (batched and isinstance(params, list)):
            return [SamplingParams.from_request(params)] * count
        if len(params) != count:
            raise RequestError(f"sampling_params: a list of {len(params)} for {count} prompts; "
                               "give one object per prompt or one object for all")
        cfgs = [SamplingParams.from_request(p) for p in params]
        if any(c.n > 1 for c in cfgs):
            raise RequestError("sampling_params.n must be 1 for every prompt of a batch request "
                               "(send the n samples as n prompts)")
        return cfgs

    def _check_prompt(self, prompt: list[int], cfg: SamplingParams, start) -> None:
        if len(prompt) + cfg.max_new_tokens > self.gen.context_length:
            raise RequestError(f"prompt ({len(prompt)} tokens) + max_new_tokens "
                               f"({cfg.max_new_tokens}) exceeds the context length "
                               f"{self.gen.context_length}")
        if not isinstance(start, int) or start >= max(len(prompt), 1):
            raise RequestError(f"logprob_start_len={start!r} must be an integer < the prompt "
                               f"length {len(prompt)} (-1: no input logprobs)")

    def _sequences(self, prompt: list[int], cfg: SamplingParams,
                   want_input: bool) -> list[Sequence]:
        seqs = [Sequence(list(prompt), cfg, want_input) for _ in range(cfg.n)]
        if cfg.sampling_seed is not None and self.deterministic:
            # SGLang's seeded sampler (sglang/srt/layers/sampler.py, multinomial_with_seed)
            # draws from (seed, position) only, and every copy of an n > 1 request carries the
            # request's seed: the copies come out identical. Without
            # --enable-deterministic-inference SGLang ignores the seed; so does this server.
            for s in seqs:
                s.seed = cfg.sampling_seed
        return seqs

    def _prompts(self, body: dict) -> tuple[list[list[int]], bool]:
        """The prompts' token ids and whether the body used the batch form."""
        text, ids = body.get("text"), body.get("input_ids")
        if (text is None) == (ids is None):
            raise RequestError("give exactly one of 'text' or 'input_ids'")
        if text is not None:
            batched = isinstance(text, list)
            texts = text if batched else [text]
            if not texts or not all(isinstance(t, str) for t in texts):
                raise RequestError("'text' must be a string or a non-empty list of strings")
            prompts = [self.gen.tokenizer.encode(t, add_special_tokens=False) for t in texts]
        else:
            batched = isinstance(ids, list) and bool(ids) and all(isinstance(x, list) for x in ids)
            prompts = ids if batched else [ids]
        vocab = self.gen.config.vocab_size
        for p in prompts:
            if not isinstance(p, list) or not all(isinstance(t, int) and 0 <= t < vocab
                                                  for t in p):
                raise RequestError(f"'input_ids' must be a list of token ids in [0, {vocab}) "
                                   "or a list of such lists")
            if not p:
                raise RequestError("the prompt is empty")
        return prompts, batched

    async def generate(self, request: web.Request) -> web.Response:
        """POST /generate."""
        req = self.parse_generate(await _json_body(request))
        self.pending.append(req)
        self.wakeup.set()
        reply = await req.future
        if self.reply_delay is not None:
            await asyncio.sleep(self.reply_delay())
        return web.json_response(reply)

    # ------------------------------------------------------------------ admin
    async def health(self, request: web.Request) -> web.Response:
        """GET /health: 200 while the server runs."""
        return web.Response(status=200)

    async def health_generate(self, request: web.Request) -> web.Response:
        """GET /health_generate: 200 once a 1-token generation completes, else 503."""
        req = self.parse_generate({"input_ids": [0], "sampling_params": {"max_new_tokens": 1}})
        self.pending.append(req)
        self.wakeup.set()
        try:
            await asyncio.wait_for(asyncio.shield(req.future), timeout=20)
        except Exception:
            return web.Response(status=503)
        return web.Response(status=200)

    async def flush_cache(self, request: web.Request) -> web.Response:
        """GET/POST /flush_cache: nothing is cached across requests; refused while busy."""
        if self.pending or self.running:
            return web.Response(status=400, text="Cache not flushed: there are running or "
                                "waiting requests.")
        return web.Response(status=200, text="Cache flushed.")

    async def model_info(self, request: web.Request) -> web.Response:
        """GET /model_info."""
        return web.json_response({"model_path": self.gen.model_dir,
                                  "tokenizer_path": self.gen.model_dir, "is_generation": True,
                                  "weight_version": self.weight_version,
                                  "preferred_sampling_params": None})

    async def server_info(self, request: web.Request) -> web.Response:
        """GET /server_info: the fields of SGLang's reply the trainer reads (SGLang returns
        every server argument, sglang/srt/entrypoints/http_server.py ``server_info``)."""
        return web.json_response({"model_path": self.gen.model_dir, "tp_size": 1, "pp_size": 1,
                                  "dp_size": 1, "device": self.gen.device.type,
                                  "enable_deterministic_inference": self.deterministic,
                                  "enable_return_routed_experts": self.return_routed_experts,
                                  "enable_memory_saver": True,
                                  "memory_released": sorted(self.released),
                                  "version": "embedded", "weight_version": self.weight_version})

    async def get_weight_version(self, request: web.Request) -> web.Response:
        """GET /get_weight_version."""
        return web.json_response({"weight_version": self.weight_version})

    async def pause_generation(self, request: web.Request) -> web.Response:
        """POST /pause_generation {mode: abort | in_place | retract}."""
        mode = (await _json_body(request)).get("mode", "abort")
        if mode not in ("abort", "in_place", "retract"):
            raise RequestError(f"mode={mode!r}: expected 'abort', 'in_place' or 'retract'")
        self.resumed.clear()
        if mode == "retract":
            self.retract.set()
        if mode == "abort":
            self.abort.set()
            await self._abort_pending()
        # reply shapes of sglang/srt/entrypoints/http_server.py pause/continue_generation
        return web.json_response({"message": "Generation paused successfully.", "status": "ok"})

    async def _abort_pending(self) -> None:
        self.resumed.set()  # let the running batch observe the abort and finish
        while self.running:
            await asyncio.sleep(0.01)
        for r in self.pending:
            for s in r.seqs:
                s.finish_reason = {"type": "abort", "message": "generation paused"}
            r.future.set_result(self._response(r))
        self.pending.clear()
        self.resumed.clear()
        self.abort.clear()

    async def continue_generation(self, request: web.Request) -> web.Response:
        """POST /continue_generation."""
        self.abort.clear()
        self.resumed.set()
        self.wakeup.set()
        return web.json_response({"message": "Generation continued successfully.",
                                  "status": "ok"})

    # ------------------------------------------------------------------ weight updates
    async def init_weights_update_group(self, request: web.Request) -> web.Response:
        """POST /init_weights_update_group: join the trainer's group as rank_offset (+ tp 0)."""
        body = await _json_body(request)
        missing = [k for k in ("master_address", "master_port", "rank_offset", "world_size")
                   if k not in body]
        if missing:
            raise RequestError(f"init_weights_update_group: missing field(s) {missing}")
        name = body.get("group_name", "weight_update_group")
        backend = body.get("backend") or "gloo"
        if backend == "nccl" and self.gen.device.type != "cuda":  # NCCL's own refusal, early
            raise RequestError(f"backend 'nccl': this server computes on {self.gen.device} (its "
                               "/server_info device) and NCCL moves CUDA tensors only; the "
                               "trainer must form the weight-update group with gloo")
        if name in self.groups:
            raise RequestError(f"group_name {name!r} already exists; destroy it first")
        group = await asyncio.to_thread(
            open_update_group, body["master_address"], int(body["master_port"]),
            int(body["rank_offset"]), int(body["world_size"]), name, backend,
            float(body.get("timeout_s", 300)))
        self.groups[name] = group
        return web.json_response({"success": True, "message": f"joined {name!r} as rank "
                                  f"{group.rank} of {group.world_size}"})

    async def begin_weight_update(self, request: web.Request) -> web.Response:
        """POST /begin_weight_update: open the session in which weight updates are accepted.

        One session at a time, as sglang/srt/managers/scheduler_components/weight_updater.py
        (``begin_weight_update``): a second begin is refused with HTTP 400.
        """
        if self.in_weight_update:
            return web.json_response({"success": False, "message": "a weight-update session "
                                      "is already open; call end_weight_update() first"},
                                     status=400)
        self.in_weight_update = True
        return web.json_response({"success": True, "message": "Success"})

    async def end_weight_update(self, request: web.Request) -> web.Response:
        """POST /end_weight_update: close the session (HTTP 400 when none is open)."""
        if not self.in_weight_update:
            return web.json_response({"success": False, "message": "no weight-update session "
                                      "is open; call begin_weight_update() first"}, status=400)
        self.in_weight_update = False
        return web.json_response({"success": True, "message": "Success"})

    async def update_weights_from_distributed(self, request: web.Request) -> web.Response:
        """POST /update_weights_from_distributed: receive tensors by broadcast(src=0), load them.

        The whole broadcast is received before a wrong name/shape is reported (400), so the
        trainer never hangs.
        """
        body = await _json_body(request)
        if not self.in_weight_update:
            raise RequestError("weight updates must happen between POST /begin_weight_update "
                               "and POST /end_weight_update")
        names, dtypes, shapes = (body.get(k) for k in ("names", "dtypes", "shapes"))
        if not (isinstance(names, list) and isinstance(dtypes, list) and isinstance(shapes, list)
                and len(names) == len(dtypes) == len(shapes) and names):
            raise RequestError("names, dtypes and shapes must be non-empty lists of equal length")
        group = self.groups.get(body.get("group_name", "weight_update_group"))
        if group is None:
            raise RequestError(f"group_name {body.get('group_name')!r} unknown; call "
                               f"/init_weights_update_group first (known: {sorted(self.groups)})")
        specs = [(n, parse_dtype(d), tuple(int(x) for x in s))
                 for n, d, s in zip(names, dtypes, shapes)]
        fmt = body.get("load_format")
        if fmt not in (None, "flattened_bucket"):
            raise RequestError(f"load_format={fmt!r}: expected null or 'flattened_bucket'")
        if fmt == "flattened_bucket":
            _check_aligned(specs)
        self._check_weights_resident()
        async with self.update_lock:
            try:
                with self.gen.receiving(specs, fmt == "flattened_bucket") as tensors:
                    await group.abroadcast(tensors)  # joined from this loop, all posted at once
            except ValueError as exc:
                return web.json_response({"success": False, "message": str(exc)}, status=400)
        if body.get("weight_version") is not None:
            self.weight_version = str(body["weight_version"])
        return web.json_response({"success": True, "message": "Succeeded to update parameter "
                                  f"online ({len(specs)} tensors)."})

    def _check_weights_resident(self) -> None:
        if "weights" in self.released:
            raise RequestError("the weights are released: POST /resume_memory_occupation "
                               '{"tags": ["weights"]} before updating them')

    async def update_weights_from_tensor(self, request: web.Request) -> web.Response:
        """POST /update_weights_from_tensor: SGLang's ``UpdateWeightsFromTensorReqInput``
        (sglang/srt/managers/io_struct.py). ``serialized_named_tensors`` has one base64
        ``MultiprocessingSerializer`` entry per TP rank (this server is rank 0 and reads
        entry 0): a ``flattened_bucket`` dict or a list of (name, tensor). The tensors are
        mapped from the sender's memory by handle and copied into the parameters. Outside a
        begin/end session it is refused with SGLang's message
        (sglang/srt/managers/scheduler_components/weight_updater.py)."""
        body = await _json_body(request)
        entries, fmt = body.get("serialized_named_tensors"), body.get("load_format")
        if not (isinstance(entries, list) and entries and all(isinstance(e, str)
                                                              for e in entries)):
            raise RequestError("serialized_named_tensors must be a non-empty list of base64 "
                               "strings, one per TP rank")
        if fmt not in (None, "flattened_bucket"):
            raise RequestError(f"load_format={fmt!r}: expected null or 'flattened_bucket'")
        if not self.in_weight_update:
            return web.json_response({"success": False, "message": "update_weights_from_tensor "
                                      "must run between begin_weight_update() and "
                                      "end_weight_update()"}, status=400)
        self._check_weights_resident()
        try:
            obj = deserialize(entries[0])
            named = bucket_tensors(obj) if fmt == "flattened_bucket" else _named_list(obj)
            async with self.update_lock:
                await asyncio.to_thread(self.gen.load_tensors, named)
        except (ValueError, RuntimeError, pickle.UnpicklingError) as exc:
            return web.json_response({"success": False, "message": str(exc)}, status=400)
        message = "Success"
        if body.get("weight_version") is not None:
            self.weight_version = str(body["weight_version"])
            message += f" Weight version updated to {self.weight_version}."
        return web.json_response({"success": True, "message": message})

    def _memory_tags(self, body: dict) -> list[str]:
        """The request's tags, none meaning all three. Any other string is taken as SGLang
        takes it: into its ``offload_tags``, with nothing to pause or resume."""
        tags = body.get("tags") or list(MEMORY_TAGS)
        if not (isinstance(tags, list) and all(isinstance(t, str) for t in tags)):
            raise RequestError(f"tags={tags!r}: expected a list of tag names ({list(MEMORY_TAGS)} "
                               "are SGLang's) or none for all")
        return tags

    async def release_memory_occupation(self, request: web.Request) -> web.Response:
        """POST /release_memory_occupation {tags}: free the tagged memory. Only when idle
        (a paused server's queued requests do not count), as SGLang asserts. A tag that is
        released already ends the server (torch_memory_saver's pause of a paused region)."""
        tags = self._memory_tags(await _json_body(request))
        if self.running or (self.pending and self.resumed.is_set()):
            raise RequestError("release_memory_occupation should be called only when server "
                               "is idle.")
        again = [t for t in tags if t in self.released and t in MEMORY_TAGS]  # paused twice
        if again:
            _end_engine(f"release_memory_occupation{again}: Cannot pause allocation that is "
                        "not active (torch_memory_saver; the tags were released already)")
        if "weights" in tags:
            async with self.update_lock:
                await asyncio.to_thread(self.gen.release_weights)
        self.released.update(tags)
        return web.json_response(None)  # SGLang's handler returns nothing (JSON null)

    async def resume_memory_occupation(self, request: web.Request) -> web.Response:
        """POST /resume_memory_occupation {tags}: allocate the tagged memory again. A tag
        that is not released ends the server (SGLang's ``offload_tags.remove`` raises
        KeyError in the scheduler, whose failure ends the server)."""
        tags = self._memory_tags(await _json_body(request))
        missing = [t for t in tags if t not in self.released]
        if missing:
            _end_engine(f"resume_memory_occupation: KeyError {missing} (the tags are not "
                        "released; SGLang's scheduler fails on offload_tags.remove)")
        if "weights" in tags:
            async with self.update_lock:
                await asyncio.to_thread(self.gen.resume_weights)
        self.released.difference_update(tags)
        return web.json_response(None)

    async def destroy_weights_update_group(self, request: web.Request) -> web.Response:
        """POST /destroy_weights_update_group {group_name}."""
        name = (await _json_body(request)).get("group_name", "weight_update_group")
        group = self.groups.pop(name, None)
        if group is None:
            raise RequestError(f"group_name {name!r} unknown (known: {sorted(self.groups)})")
        group.close()
        return web.json_response({"success": True, "message": f"destroyed {name!r}"})


def _end_engine(reason: str) -> None:
    """End this server process at once, with no reply, as a failing SGLang scheduler ends
    its server (sglang/srt/managers/scheduler.py ``run_scheduler_process``: the exception is
    logged and the parent killed with SIGQUIT): the client sees the connection drop."""
    log.error("engine ended: %s", reason)
    logging.shutdown()
    os._exit(1)


def _named_list(obj: object) -> list[tuple[str, torch.Tensor]]:
    """A deserialized ``load_format=None`` entry: a list of (name, tensor)."""
    if not (isinstance(obj, list) and all(isinstance(x, tuple) and len(x) == 2
                                          and isinstance(x[1], torch.Tensor) for x in obj)):
        raise ValueError("a serialized_named_tensors entry without load_format must be a list "
                         "of (name, tensor)")
    return obj


def _check_aligned(specs: list[tuple[str, torch.dtype, tuple]]) -> None:
    """Refuse (before joining the broadcast) a bucket whose tensor starts at an offset that is
    not a multiple of its element size, as SGLang's ``FlattenedTensorBucket.empty``
    (sglang/srt/weight_sync/tensor_bucket.py) does."""
    offset = 0
    for name, dtype, shape in specs:
        if offset % dtype.itemsize:
            raise RequestError(f"Unaligned received tensor {name}: byte offset {offset}, "
                               f"dtype {dtype}")
        offset += torch.Size(shape).numel() * dtype.itemsize


@web.middleware
async def _errors(request: web.Request, handler):
    """Bad requests -> 400 with a message; anything unexpected -> 500 with a message."""
    try:
        return await handler(request)
    except RequestError as exc:
        return _error(str(exc))
    except web.HTTPException:
        raise
    except Exception as exc:  # keep the server alive and tell the client what failed
        log.exception("request %s failed", request.path)
        return _error(f"{type(exc).__name__}: {exc}", status=500)


def build_app(server: RolloutServer) -> web.Application:
    """The aiohttp application with SGLang's routes; starts the scheduler on startup."""
    app = web.Application(middlewares=[_errors], client_max_size=64 * 2**20)
    s = server
    for path, handler in [("/health", s.health), ("/health_generate", s.health_generate),
                          ("/model_info", s.model_info), ("/get_model_info", s.model_info),
                          ("/get_weight_version", s.get_weight_version),
                          ("/server_info", s.server_info),
                          ("/flush_cache", s.flush_cache)]:
        app.router.add_get(path, handler)
    for path, handler in [("/generate", s.generate), ("/flush_cache", s.flush_cache),
                          ("/pause_generation", s.pause_generation),
                          ("/continue_generation", s.continue_generation),
                          ("/init_weights_update_group", s.init_weights_update_group),
                          ("/begin_weight_update", s.begin_weight_update),
                          ("/end_weight_update", s.end_weight_update),
                          ("/update_weights_from_distributed", s.update_weights_from_distributed),
                          ("/destroy_weights_update_group", s.destroy_weights_update_group),
                          ("/update_weights_from_tensor", s.update_weights_from_tensor),
                          ("/release_memory_occupation", s.release_memory_occupation),
                          ("/resume_memory_occupation", s.resume_memory_occupation)]:
        app.router.add_post(path, handler)

    async def start_scheduler(app: web.Application):
        task = asyncio.create_task(s.scheduler())
        yield
        task.cancel()

    app.cleanup_ctx.append(start_scheduler)
    return app


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = OneLineParser(description="Embedded CPU rollout server (SGLang HTTP API).")
    p.add_argument("--model", "--model-path", dest="model", required=True,
                   help="directory of a Hugging Face Qwen3 checkpoint (config.json + weights)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--seed", type=int, default=0, help="sampling RNG seed (unseeded requests)")
    p.add_argument("--enable-deterministic-inference", action="store_true",
                   help="honour sampling_params.sampling_seed, as SGLang does with this flag")
    p.add_argument("--enable-return-routed-experts", action="store_true",
                   help="answer return_routed_experts (MoE routing replay), as SGLang does only "
                        "with this flag")
    p.add_argument("--enable-batch-invariant", action="store_true",
                   help="decode each sequence alone (no padding, one row per forward), so its "
                        "tokens and log-probs do not depend on the batch it came in (slower)")
    p.add_argument("--rl-on-policy-target", choices=["megatron"], default=None,
                   help="round the forward as the trainer's does (SGLang's flag for true "
                        "on-policy RL): fp32 prefill log-probs equal megatron's at TP=1")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                   help="where the model computes (SGLang's flag; cuda: the GPU check's "
                        "colocated hand-over over CUDA IPC handles, tests/gpu/gpu_check.py)")
    p.add_argument("--load-format", default="auto", choices=["auto", "dummy"],
                   help="dummy: random weights from config.json (benchmarks), as in SGLang")
    p.add_argument("--max-batch-seqs", type=int, default=64,
                   help="most sequences decoded together in one batch")
    p.add_argument("--num-threads", type=int, default=int(os.environ.get("OMP_NUM_THREADS", 1)),
                   help="torch intra-op threads")
    return p.parse_args(argv)


def _load_generator(args: argparse.Namespace) -> Generator:
    """The model of ``--model``, or SystemExit naming the flag and what is wrong."""
    if not os.path.isfile(os.path.join(args.model, "config.json")):
        raise SystemExit(f"--model {args.model}: no config.json; pass the directory of a "
                         "Hugging Face Qwen3 checkpoint")
    try:
        return Generator(args.model, seed=args.seed, dtype=getattr(torch, args.dtype),
                         load_format=args.load_format, device=args.device,
                         batch_invariant=args.enable_batch_invariant,
                         on_policy=args.rl_on_policy_target == "megatron")
    except (OSError, ValueError, KeyError) as exc:
        raise SystemExit(f"--model {args.model}: cannot load a Qwen3 model ({exc})") from exc


async def _serve(args: argparse.Namespace, generator: Generator) -> None:
    server = RolloutServer(generator, max_batch_seqs=args.max_batch_seqs,
                           deterministic=args.enable_deterministic_inference,
                           return_routed_experts=args.enable_return_routed_experts,
                           seed=args.seed)
    runner = web.AppRunner(build_app(server), access_log=None)
    await runner.setup()
    await web.TCPSite(runner, args.host, args.port).start()
    print(f"rollout server ready on http://{args.host}:{args.port}", flush=True)
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        asyncio.get_running_loop().add_signal_handler(sig, stop.set)
    await stop.wait()
    await runner.cleanup()


def main(argv: list[str] | None = None) -> None:
    """CLI entry point: ``python -m megatron_klear.rollout.engine.server --model DIR --port P``."""
    args = _parse_args(argv)
    exit_when_orphaned()  # also when the launcher's parent-death signal cannot fire
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    torch.set_num_threads(max(1, args.num_threads))
    keep_freed_memory()  # a decode batch's KV cache reuses the last one's pages
    generator = _load_generator(args)
    freeze_startup_heap()
    asyncio.run(_serve(args, generator))


if __name__ == "__main__":
    main()
