"""Async HTTP client for SGLang servers, an sglang_router, or embedded rollout servers.

One client serves the trainer on GPU clusters (SGLang) and on CPU (the embedded server), since
both speak the same API. Guarantees:

* every prompt is answered or the call fails loudly -- a failed request (connection error,
  timeout, HTTP 5xx, or a sample the server aborted, ``finish_reason.type == "abort"``) is
  retried with exponential backoff on the least-loaded server that is not marked down (a
  server that keeps failing stays down longer); after ``max_retries`` retries a
  :class:`RolloutError` names every server URL and its last error;
* seeded sampling stays correct on SGLang: each of the n samples of a seeded prompt is its
  own n=1 prompt of a batch request with its own seed (:func:`sample_seed`). SGLang gives
  the n copies of one request the same ``sampling_seed``, and its seeded sampler depends
  only on (seed, position, token) (``sglang/srt/layers/sampler.py``,
  ``multinomial_with_seed``), so n copies of one seeded request come out identical. SGLang
  honours the seed only when the server runs with ``--enable-deterministic-inference``;
  without it the samples are distinct but not reproducible (docs/rollout.md);
* a bad request (HTTP 4xx) is not retried: it is a bug, reported with the server's message;
* at most ``max_concurrency`` requests are in flight.
"""

from __future__ import annotations

import asyncio
import base64
import concurrent.futures
import contextlib
import logging
import threading
import time
from dataclasses import dataclass
from typing import Any, AsyncIterator, Iterator

import aiohttp
import torch

from megatron_klear.rollout.orchestration.request import SamplingParams  # the one sampling contract

__all__ = ["SamplingParams", "Generation", "RolloutClient", "RolloutError",
           "RoutedExpertsMissing", "sample_seed"]


log = logging.getLogger("megatron_klear.rollout.orchestration.client")


class RolloutError(RuntimeError):
    """Generation could not be completed; the message names the server URL(s) and why."""


class _BadRequest(RolloutError):
    """HTTP 4xx: the request itself is wrong; retrying elsewhere would not help."""


class RoutedExpertsMissing(RolloutError):
    """Routing replay asked for the routed experts and a server returned none: the run stops
    (training would silently route by the trainer's own top-k instead)."""


class _Aborted(RolloutError):
    """The server aborted a sample (paused, shutting down): retried like a failed request."""


def sample_seed(prompt_seed: int, j: int) -> int:
    """The ``sampling_seed`` of sample ``j`` of a prompt seeded ``prompt_seed`` (< 2**31)."""
    return (prompt_seed * 1_000_003 + 7919 * j + 1) % 2**31


@dataclass
class Generation:
    """One sampled response."""

    text: str
    output_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    weight_version: str | None
    prompt_tokens: int
    routed_experts: torch.Tensor | None = None  # flat [(prompt + response - 1) x layers x k]

    @classmethod
    def from_sglang(cls, out: dict) -> "Generation":
        """Parse one SGLang /generate response object."""
        meta = out.get("meta_info", {})
        reason = meta.get("finish_reason") or {}
        experts = meta.get("routed_experts")
        return cls(text=out.get("text", ""), output_ids=list(out.get("output_ids") or []),
                   logprobs=[float(x[0]) for x in meta.get("output_token_logprobs") or []],
                   finish_reason=reason.get("type", "unknown") if isinstance(reason, dict)
                   else str(reason),
                   weight_version=meta.get("weight_version"),
                   prompt_tokens=int(meta.get("prompt_tokens", 0)),
                   routed_experts=None if experts is None else decode_routed_experts(experts))


def encode_routed_experts(experts: torch.Tensor) -> str:
    """SGLang's ``meta_info.routed_experts``: base64 of the int32 expert ids [positions, layers,
    top-k] in C order (sglang/srt/managers/detokenizer_manager.py)."""
    return base64.b64encode(experts.to(torch.int32).contiguous().numpy().tobytes()).decode()


def decode_routed_experts(text: str) -> torch.Tensor:
    """The flat expert ids of :func:`encode_routed_experts` (int16; the caller knows the
    model's layers and top-k)."""
    return torch.frombuffer(bytearray(base64.b64decode(text)), dtype=torch.int32).to(torch.int16)


@dataclass
class _Server:
    url: str
    outstanding: int = 0
    down_until: float = 0.0
    failures: int = 0  # consecutive failed requests: how long the server stays marked down
    last_error: str = ""


def _not_aborted(reply: Any) -> None:
    """Raise :class:`_Aborted` when any sample of a /generate reply was aborted."""
    for out in reply if isinstance(reply, list) else [reply]:
        reason = (out.get("meta_info") or {}).get("finish_reason") if isinstance(out, dict) \
            else None
        if isinstance(reason, dict) and reason.get("type") == "abort":
            raise _Aborted(f"sample aborted by the server: {reason.get('message', '')}")


# a kept-alive connection idle this long is not reused: below SGLang's keep-alive timeout
# (SGLANG_TIMEOUT_KEEP_ALIVE = 5 s, sglang/srt/environ.py, passed to uvicorn), so the client
# never sends on a connection the server is closing
KEEP_ALIVE_IDLE_S = 2.0


@dataclass
class _KeptAlive:
    """The event loop (run by its own thread) and session that
    :meth:`RolloutClient.keep_alive` shares between blocking calls."""

    loop: asyncio.AbstractEventLoop
    session: aiohttp.ClientSession | None = None


class RolloutClient:
    """Client of N rollout servers (or one router URL) with retries and load balancing."""

    def __init__(self, urls: list[str], *, max_concurrency: int = 64,
                 request_timeout_s: float = 600, max_retries: int = 3,
                 backoff_s: float = 0.5) -> None:
        if not urls:
            raise ValueError("RolloutClient: urls is empty; pass at least one server URL")
        self.servers = [_Server(u.rstrip("/")) for u in urls]
        self.active: set[str] | None = None  # generation goes only here (None: everywhere)
        self.max_concurrency = max_concurrency
        self.request_timeout_s = request_timeout_s
        self.max_retries = max_retries
        self.backoff_s = backoff_s
        self._kept: _KeptAlive | None = None

    @property
    def urls(self) -> list[str]:
        """The server base URLs."""
        return [s.url for s in self.servers]

    # ------------------------------------------------------------------ generation
    async def agenerate(self, prompts: list[str] | list[list[int]], params: SamplingParams,
                        seeds: list[int] | None = None,
                        max_new_tokens: list[int] | None = None) -> list[list[Generation]]:
        """n generations per prompt, in prompt order (token-id prompts go as input_ids).
        ``max_new_tokens``: a per-prompt limit instead of ``params.max_new_tokens`` (the
        turns of multi-turn rollouts, each with what is left of its token budget).

        ``seeds`` gives each prompt its own seed, so its samples do not depend on which server
        or batch serves them: sample j carries ``sample_seed(seed, j)``. Every sample is one
        n=1 prompt of SGLang's batch form (unseeded samples are independent draws either
        way); the samples are split into one batch request per server that may serve them,
        so a whole rollout costs a few HTTP requests instead of one per sample.
        """
        seeds = seeds if seeds is not None else [params.sampling_seed] * len(prompts)
        base = {k: v for k, v in params.to_sglang().items() if k != "sampling_seed"} | {"n": 1}
        limits = max_new_tokens if max_new_tokens is not None else [None] * len(prompts)
        items = [(prompt, {**base, **({} if seed is None else
                                      {"sampling_seed": sample_seed(seed, j)}),
                           **({} if limit is None else {"max_new_tokens": limit})})
                 for prompt, seed, limit in zip(prompts, seeds, limits) for j in range(params.n)]
        if not items:
            return [[] for _ in prompts]
        parts = len([s for s in self.servers if self.active is None or s.url in self.active])
        size = -(-len(items) // max(parts, 1))
        sem = asyncio.Semaphore(self.max_concurrency)
        async with self._session() as session:
            async def request(chunk: list[tuple]) -> list[Generation]:
                key = "text" if isinstance(chunk[0][0], str) else "input_ids"
                payload = {key: [p for p, _ in chunk], "sampling_params": [sp for _, sp in chunk],
                           "return_logprob": True}
                if params.return_routed_experts:
                    payload["return_routed_experts"] = True
                async with sem:
                    out = await self._post_balanced(session, "/generate", payload,
                                                    check=_not_aborted)
                if not isinstance(out, list) or len(out) != len(chunk):
                    raise RolloutError(f"/generate answered a batch of {len(chunk)} prompts with "
                                       f"{len(out) if isinstance(out, list) else 1} outputs")
                gens = [Generation.from_sglang(o) for o in out]
                if params.return_routed_experts and any(g.routed_experts is None for g in gens):
                    raise RoutedExpertsMissing(
                        "--use-routing-replay: a rollout server answered without "
                        "meta_info.routed_experts; SGLang returns them only when started with "
                        "--enable-return-routed-experts (add it to the launch, as examples/* "
                        "do under --use-routing-replay)")
                return gens

            chunks = [items[i:i + size] for i in range(0, len(items), size)]
            gens = [g for part in await asyncio.gather(*(request(c) for c in chunks))
                    for g in part]
        return [gens[i * params.n:(i + 1) * params.n] for i in range(len(prompts))]

    def generate(self, prompts: list[str] | list[list[int]], params: SamplingParams,
                 seeds: list[int] | None = None,
                 max_new_tokens: list[int] | None = None) -> list[list[Generation]]:
        """Blocking :meth:`agenerate`; works with or without a running loop in this thread."""
        return self._run_sync(self.agenerate(prompts, params, seeds, max_new_tokens))

    def post_balanced(self, path: str, payloads: list[dict]) -> list[Any]:
        """POST each of ``payloads`` to ``path`` on the least-loaded live server, concurrently
        (at most ``max_concurrency`` at once), retried as generations are; the replies in
        order."""
        async def run() -> list[Any]:
            sem = asyncio.Semaphore(self.max_concurrency)
            async with self._session() as session:
                async def one(payload: dict) -> Any:
                    async with sem:
                        return await self._post_balanced(session, path, payload)

                return list(await asyncio.gather(*(one(p) for p in payloads)))

        return self._run_sync(run()) if payloads else []

    def prompt_logprobs(self, input_ids: list[int]) -> list[list[float]]:
        """Per server: logprobs of tokens 1..L-1 of ``input_ids`` (temperature 1)."""
        payload = {"input_ids": list(input_ids), "return_logprob": True, "logprob_start_len": 0,
                   "sampling_params": {"max_new_tokens": 1, "temperature": 1.0}}
        replies = self.post_all("/generate", payload)
        return [[float(x[0]) for x in replies[s.url]["meta_info"]["input_token_logprobs"][1:]]
                for s in self.servers]

    async def _post_balanced(self, session: aiohttp.ClientSession, path: str,
                             payload: dict, check=None) -> Any:
        """POST to the least-loaded live server; retry failures on the others.

        ``check(reply)`` raises :class:`RolloutError` for a reply that must be retried.
        """
        for attempt in range(self.max_retries + 1):
            server = self._pick()
            server.outstanding += 1
            try:
                reply = await self._request(session, "POST", server.url + path, payload)
                if check is not None:
                    check(reply)
                server.failures = 0
                return reply
            except _BadRequest:
                raise
            except (aiohttp.ClientError, asyncio.TimeoutError, RolloutError, OSError) as exc:
                server.last_error = f"{type(exc).__name__}: {exc}"
                server.failures += 1
                server.down_until = time.monotonic() + self.backoff_s * 2 ** min(
                    server.failures, 8)
                if attempt == self.max_retries:
                    break
                log.warning("retrying POST %s after a failure on %s: %s", path, server.url,
                            server.last_error)
                await asyncio.sleep(self.backoff_s * 2 ** attempt)
            finally:
                server.outstanding -= 1
        status = "; ".join(f"{s.url}: {s.last_error or 'ok'}" for s in self.servers)
        raise RolloutError(f"POST {path} failed after {self.max_retries + 1} attempts on all "
                           f"servers [{status}]; no rollout server could serve it: restart the "
                           "servers and rerun the same command (the run resumes from its last "
                           "checkpoint)")

    def set_active(self, urls: list[str]) -> None:
        """Send generations only to ``urls`` (e.g. the servers that hold the current weights)."""
        unknown = set(u.rstrip("/") for u in urls) - set(self.urls)
        if unknown:
            raise ValueError(f"set_active: {sorted(unknown)} not among {self.urls}")
        self.active = {u.rstrip("/") for u in urls}

    def _pick(self) -> _Server:
        now = time.monotonic()
        pool = [s for s in self.servers if self.active is None or s.url in self.active]
        if not pool:
            raise RolloutError(f"no rollout server left: none of {self.urls} holds the current "
                               "weights (all failed); restart the servers and resume the run "
                               "from its checkpoint")
        live = [s for s in pool if s.down_until <= now]
        if not live:  # all marked down: try the one expected back first
            return min(pool, key=lambda s: s.down_until)
        return min(live, key=lambda s: s.outstanding)

    async def _request(self, session: aiohttp.ClientSession, method: str, url: str,
                       payload: dict | None = None) -> Any:
        async with session.request(method, url, json=payload) as resp:
            body = await resp.read()
            text = body.decode(errors="replace")
            if resp.status >= 500:
                raise RolloutError(f"{url} answered HTTP {resp.status}: {text[:500]}")
            if resp.status >= 400:
                raise _BadRequest(f"{url} rejected the request (HTTP {resp.status}): "
                                  f"{text[:500]}")
            if resp.content_type == "application/json":
                return await resp.json()
            return text

    # ------------------------------------------------------------------ admin
    def server_info(self) -> dict[str, dict]:
        """GET /server_info on every server: {url: SGLang's server info (tp_size, ...)}."""
        return self.get_all("/server_info")

    def health(self, timeout_s: float = 5.0) -> dict[str, bool]:
        """GET /health on every server: {url: healthy} (inside :meth:`keep_alive`, over its
        connections)."""
        async def check() -> dict[str, bool]:
            timeout = aiohttp.ClientTimeout(total=timeout_s)
            async with self._session() as session:
                async def one(url: str) -> bool:
                    try:
                        async with session.get(url + "/health", timeout=timeout) as resp:
                            return resp.status == 200
                    except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
                        return False

                flags = await asyncio.gather(*(one(s.url) for s in self.servers))
            return dict(zip(self.urls, flags))

        return self._run_sync(check())

    def post_all(self, path: str, payload: dict | None = None, *,
                 return_errors: bool = False) -> dict[str, Any]:
        """POST ``payload`` to ``path`` on every server concurrently: {url: reply}.
        ``return_errors``: a server's failure is its reply (a :class:`RolloutError`) instead
        of being raised, so the request is still made on every other server."""
        return self._run_sync(self._all("POST", path, payload, return_errors))

    def post_all_nowait(self, path: str, payload: dict | None = None
                        ) -> concurrent.futures.Future:
        """:meth:`post_all` without blocking: the future of its replies, set by the
        :meth:`keep_alive` loop that sends the requests (no other thread in between; a weight
        sync's per-bucket request). Only inside ``keep_alive``."""
        if self._kept is None:
            raise RuntimeError("post_all_nowait runs on the keep_alive() loop: call it inside "
                               "`with client.keep_alive():`")
        return asyncio.run_coroutine_threadsafe(self._all("POST", path, payload),
                                                self._kept.loop)

    def post_each_nowait(self, path: str, payloads: dict[str, dict]
                         ) -> concurrent.futures.Future:
        """:meth:`post_all_nowait` with one payload per server (``payloads[url]``), e.g. a
        tensor-handle update, whose handles each serve one receiver."""
        if self._kept is None:
            raise RuntimeError("post_each_nowait runs on the keep_alive() loop: call it inside "
                               "`with client.keep_alive():`")
        return asyncio.run_coroutine_threadsafe(self._all("POST", path, None, payloads=payloads),
                                                self._kept.loop)

    def get_all(self, path: str) -> dict[str, Any]:
        """GET ``path`` on every server concurrently: {url: reply}."""
        return self._run_sync(self._all("GET", path, None))

    async def _all(self, method: str, path: str, payload: dict | None,
                   return_errors: bool = False, payloads: dict[str, dict] | None = None
                   ) -> dict[str, Any]:
        async with self._session() as session:
            async def one(url: str) -> Any:
                body = payloads[url] if payloads is not None else payload
                try:
                    return await self._request(session, method, url + path, body)
                except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
                    raise RolloutError(f"{method} {url}{path} failed: "
                                       f"{type(exc).__name__}: {exc}") from exc

            replies = await asyncio.gather(*(one(s.url) for s in self.servers),
                                           return_exceptions=return_errors)
        return dict(zip(self.urls, replies))

    # ------------------------------------------------------------------ plumbing
    @contextlib.contextmanager
    def keep_alive(self) -> Iterator["RolloutClient"]:
        """Within the block, blocking calls share one event loop (on its own thread) and one
        session with kept-alive connections: about 0.25 ms per admin request here instead of
        1.1 ms with a new loop and connection each (measured against the embedded server).
        For a run's requests (the trainer's rollouts, a weight sync's admin and buckets);
        a block inside another one of the same client shares the outer one's loop."""
        if self._kept is not None:
            yield self
            return
        loop = asyncio.new_event_loop()
        thread = threading.Thread(target=loop.run_forever, name="rollout-client", daemon=True)
        thread.start()
        self._kept = kept = _KeptAlive(loop)
        try:
            yield self
        finally:
            self._kept = None
            if kept.session is not None:
                asyncio.run_coroutine_threadsafe(kept.session.close(), loop).result()
            loop.call_soon_threadsafe(loop.stop)
            thread.join()
            loop.close()

    @contextlib.asynccontextmanager
    async def _session(self) -> AsyncIterator[aiohttp.ClientSession]:
        """The kept-alive session when running on its loop, else a new one for the block."""
        kept = self._kept
        if kept is not None and asyncio.get_running_loop() is kept.loop:
            if kept.session is None:
                kept.session = self._new_session(keepalive_timeout=KEEP_ALIVE_IDLE_S)
            yield kept.session
            return
        async with self._new_session() as session:
            yield session

    def _new_session(self, **connector: Any) -> aiohttp.ClientSession:
        return aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=self.request_timeout_s),
            connector=aiohttp.TCPConnector(limit=self.max_concurrency, **connector))

    def _run_sync(self, coro) -> Any:
        """Run ``coro`` to completion from blocking code: on the kept-alive loop inside
        :meth:`keep_alive`, else on a new loop (in a helper thread when this thread's loop
        is busy)."""
        if self._kept is not None:
            return asyncio.run_coroutine_threadsafe(coro, self._kept.loop).result()
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return asyncio.run(coro)
        with concurrent.futures.ThreadPoolExecutor(1) as pool:  # caller's loop is busy
            return pool.submit(asyncio.run, coro).result()
