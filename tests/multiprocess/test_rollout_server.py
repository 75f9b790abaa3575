"""The embedded rollout server over real HTTP, driven by the trainer's RolloutClient.

Two real server processes on 127.0.0.1; every numeric check compares with an independent
transformers forward pass (tests/rollout_helpers.py).
"""

from __future__ import annotations

import asyncio
import threading
import time

import aiohttp
import pytest
import torch

from megatron_klear.rollout.orchestration.client import RolloutClient, SamplingParams
from megatron_klear.rollout.engine.launcher import launch_embedded_servers
from tests.rollout_helpers import (load_reference, make_tiny_model, reference_greedy,
                                   reference_logprobs)

PROMPTS = ["What is 2+3?", "Write a haiku", "x", "def f(a):"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def servers(model_dir, tmp_path_factory):
    with launch_embedded_servers(model_dir, 2, log_dir=tmp_path_factory.mktemp("logs")) as s:
        yield s


@pytest.fixture(scope="module")
def reference(model_dir):
    return load_reference(model_dir)


@pytest.fixture()
def client(servers):
    return RolloutClient(servers.urls, request_timeout_s=60, max_retries=1, backoff_s=0.1)


def _post(url: str, path: str, body) -> tuple[int, object]:
    async def go():
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
            kwargs = {"data": body} if isinstance(body, (str, bytes)) else {"json": body}
            async with session.post(url + path, **kwargs) as resp:
                if resp.content_type == "application/json":
                    return resp.status, await resp.json()
                return resp.status, await resp.text()
    return asyncio.run(go())


def test_generate_well_formed_and_logprobs_match_reference(client, reference):
    """n samples per prompt, in order; ids, text, logprobs and finish reasons are consistent."""
    model, tok = reference
    params = SamplingParams(max_new_tokens=12, temperature=0.8, top_p=0.95, n=3)
    results = client.generate(PROMPTS, params)
    assert len(results) == len(PROMPTS)
    for prompt, gens in zip(PROMPTS, results):
        prompt_ids = tok.encode(prompt, add_special_tokens=False)
        assert len(gens) == 3
        for g in gens:
            assert g.prompt_tokens == len(prompt_ids)
            assert g.weight_version == "default"
            assert 1 <= len(g.output_ids) == len(g.logprobs) <= 12
            assert g.finish_reason in ("stop", "length")
            if g.finish_reason == "length":
                assert len(g.output_ids) == 12
            else:
                assert g.output_ids[-1] == tok.eos_token_id
            assert g.text == tok.decode(g.output_ids, skip_special_tokens=True)
            ref = reference_logprobs(model, prompt_ids + g.output_ids, 0.8)[len(prompt_ids) - 1:]
            torch.testing.assert_close(torch.tensor(g.logprobs), ref, atol=1e-4, rtol=0)


def test_greedy_equals_reference_argmax(client, reference):
    """temperature 0 decodes the argmax path (KV cache + batching do not change it)."""
    model, tok = reference
    prompts = [tok.encode(p, add_special_tokens=False) for p in PROMPTS]
    results = client.generate(prompts, SamplingParams(max_new_tokens=10, temperature=0.0))
    for ids, (g,) in zip(prompts, results):
        ref = reference_greedy(model, ids, 10)
        assert g.output_ids == ref[:len(g.output_ids)]
        assert len(g.output_ids) == 10 or g.output_ids[-1] == tok.eos_token_id


def test_stop_string_and_stop_token(client, reference):
    """Stop strings cut the text before the match; stop ids end the output at that id."""
    _, tok = reference
    base = client.generate(["Hello"], SamplingParams(max_new_tokens=16, temperature=0.0))[0][0]
    cut = next(i for i in range(1, len(base.text)) if base.text[i] not in base.text[:i])
    stop = base.text[cut]
    by_string = client.generate(["Hello"], SamplingParams(max_new_tokens=16, temperature=0.0,
                                                          stop=[stop]))[0][0]
    assert by_string.finish_reason == "stop"
    assert by_string.text == base.text[:cut]
    stop_id = base.output_ids[2]
    by_id = client.generate(["Hello"], SamplingParams(max_new_tokens=16, temperature=0.0,
                                                      stop_token_ids=[stop_id]))[0][0]
    first = base.output_ids.index(stop_id)
    assert by_id.finish_reason == "stop"
    assert by_id.output_ids == base.output_ids[:first + 1]


def test_top_k_restricts_samples(client, reference):
    """With top_k=2 every sampled token is one of the reference's two most likely tokens."""
    model, tok = reference
    prompt = tok.encode("abc", add_special_tokens=False)
    gens = client.generate([prompt], SamplingParams(max_new_tokens=8, top_k=2, n=4))[0]
    for g in gens:
        seq = prompt + g.output_ids
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([seq])).logits[0]
        for j, t in enumerate(g.output_ids):
            assert t in logits[len(prompt) - 1 + j].topk(2).indices.tolist()


def test_prompt_logprobs_every_server(client, reference):
    """The probe's request returns the reference's logprobs of tokens 1..L-1 on each server."""
    model, tok = reference
    ids = tok.encode("The quick brown fox", add_special_tokens=False)
    per_server = client.prompt_logprobs(ids)
    assert len(per_server) == 2
    for lps in per_server:
        torch.testing.assert_close(torch.tensor(lps), reference_logprobs(model, ids),
                                   atol=1e-4, rtol=0)


@pytest.mark.parametrize("body, status, needle", [
    ("not json", 400, "not valid JSON"),
    ({"sampling_params": {}}, 400, "exactly one of 'text' or 'input_ids'"),
    ({"input_ids": [1, 99999]}, 400, "input_ids"),
    ({"text": "a", "sampling_params": {"top_p": 1.5}}, 400, "top_p"),
    ({"text": "a", "sampling_params": {"n": 0}}, 400, "sampling_params.n"),
    ({"text": "a", "sampling_params": {"max_new_tokens": 100000}}, 400, "context length"),
    ({"text": "a", "sampling_params": {"stop": [""]}}, 400, "stop"),
    ({"input_ids": [[1], [2]], "sampling_params": [{}]}, 400, "a list of 1 for 2 prompts"),
    ({"text": ["a", "b"], "sampling_params": [{"n": 2}, {}]}, 400, "n must be 1"),
    ({"input_ids": [[1], []]}, 400, "the prompt is empty"),
])
def test_malformed_generate_gets_400(servers, body, status, needle):
    code, reply = _post(servers.urls[0], "/generate", body)
    assert code == status
    assert needle in reply["error"]["message"]


def test_weight_update_refused_outside_begin_end(servers):
    """sglang >= 0.5.19 rule: updates outside begin/end fail with a message."""
    body = {"names": ["model.norm.weight"], "dtypes": ["float32"], "shapes": [[64]],
            "group_name": "nope"}
    code, reply = _post(servers.urls[0], "/update_weights_from_distributed", body)
    assert code == 400 and "begin_weight_update" in reply["error"]["message"]
    assert _post(servers.urls[0], "/begin_weight_update", {})[0] == 200
    try:
        code, reply = _post(servers.urls[0], "/update_weights_from_distributed", body)
        assert code == 400 and "init_weights_update_group" in reply["error"]["message"]
    finally:
        assert _post(servers.urls[0], "/end_weight_update", {})[0] == 200
    assert _post(servers.urls[0], "/end_weight_update", {})[0] == 400


def test_admin_endpoints(client):
    assert client.health() == {u: True for u in client.urls}
    info = client.get_all("/model_info")
    assert all(v["is_generation"] and v["weight_version"] == "default" for v in info.values())
    assert all(v.startswith("Cache flushed") for v in client.get_all("/flush_cache").values())
    assert all(v == "" for v in client.get_all("/health_generate").values())


def test_pause_in_place_holds_requests_until_continue(servers):
    """A request sent while paused completes only after /continue_generation."""
    c = RolloutClient(servers.urls[:1], request_timeout_s=60, max_retries=0)
    c.post_all("/pause_generation", {"mode": "in_place"})
    done: list = []
    worker = threading.Thread(target=lambda: done.append(
        c.generate(["hi"], SamplingParams(max_new_tokens=4))))
    worker.start()
    time.sleep(1.0)
    assert not done, "generation ran while the server was paused"
    c.post_all("/continue_generation", {})
    worker.join(timeout=30)
    assert done and len(done[0][0][0].output_ids) >= 1


def test_pause_abort_replies_abort_and_client_retries(servers):
    """An aborted request gets SGLang's finish_reason {"type": "abort"}; the client never
    returns such a sample: it retries it and gets a real one after /continue_generation."""
    url = servers.urls[0]
    c = RolloutClient([url], request_timeout_s=60, max_retries=3, backoff_s=0.2)
    c.post_all("/pause_generation", {"mode": "in_place"})
    raw: list = []
    done: list = []
    workers = [threading.Thread(target=lambda: raw.append(_post(
                   url, "/generate", {"text": "hi", "sampling_params": {"max_new_tokens": 4}}))),
               threading.Thread(target=lambda: done.append(
                   c.generate(["ho"], SamplingParams(max_new_tokens=4))))]
    for w in workers:
        w.start()
    time.sleep(1.0)
    paused = c.post_all("/pause_generation", {"mode": "abort"})[url]
    assert paused == {"message": "Generation paused successfully.", "status": "ok"}
    workers[0].join(timeout=30)
    assert raw[0][1]["meta_info"]["finish_reason"]["type"] == "abort"
    c.post_all("/continue_generation", {})
    workers[1].join(timeout=60)
    assert done and done[0][0][0].finish_reason in ("stop", "length")


def test_seed_semantics_match_sglang(servers, client):
    """As SGLang with --enable-deterministic-inference: a seeded request's n copies share the
    seed and come out identical, and the sample depends on (seed, position) only, not on the
    server; the client therefore sends each sample with its own seed: distinct, reproducible."""
    body = {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 8, "n": 3,
                                                         "sampling_seed": 5}}
    code, outs = _post(servers.urls[0], "/generate", body)
    assert code == 200 and len({tuple(o["output_ids"]) for o in outs}) == 1
    body["sampling_params"]["n"] = 1
    assert _post(servers.urls[1], "/generate", body)[1]["output_ids"] == outs[0]["output_ids"]
    params = SamplingParams(max_new_tokens=8, n=3)
    gens = client.generate([[5, 6, 7]], params, seeds=[5])[0]
    assert len({tuple(g.output_ids) for g in gens}) == 3
    assert [g.output_ids for g in client.generate([[5, 6, 7]], params, seeds=[5])[0]] == \
        [g.output_ids for g in gens]
    info = client.server_info()[servers.urls[0]]
    assert info["tp_size"] == 1 and info["enable_deterministic_inference"] is True


def test_batch_form_answers_each_prompt_as_its_own_request(servers):
    """SGLang's batch form (a list of prompts, one sampling_params per prompt): one output per
    prompt in order, each the same as that prompt sent alone (seeded, so the draws depend on
    (seed, position) only, not on the batch), as the client's rollout requests rely on."""
    prompts, seeds = [[5, 6, 7], [9, 10], [5, 6, 7]], [3, 4, 8]
    body = {"input_ids": prompts, "return_logprob": True,
            "sampling_params": [{"max_new_tokens": 6, "sampling_seed": s} for s in seeds]}
    code, outs = _post(servers.urls[0], "/generate", body)
    assert code == 200 and isinstance(outs, list) and len(outs) == 3
    for prompt, seed, out in zip(prompts, seeds, outs):
        alone = {"input_ids": prompt, "return_logprob": True,
                 "sampling_params": {"max_new_tokens": 6, "sampling_seed": seed}}
        single = _post(servers.urls[1], "/generate", alone)[1]
        assert out["output_ids"] == single["output_ids"]
        torch.testing.assert_close([x[0] for x in out["meta_info"]["output_token_logprobs"]],
                                   [x[0] for x in single["meta_info"]["output_token_logprobs"]],
                                   atol=1e-5, rtol=0)
    assert outs[0]["output_ids"] != outs[2]["output_ids"]  # same prompt, other seed
    one = _post(servers.urls[0], "/generate", {"text": ["x"], "sampling_params": {
        "max_new_tokens": 2}})[1]
    assert isinstance(one, list) and len(one) == 1  # the batch form replies with a list


def test_generate_inside_running_event_loop(client):
    """The sync wrapper works when the caller's thread already runs an event loop."""
    async def caller():
        return client.generate(["a"], SamplingParams(max_new_tokens=2))

    assert len(asyncio.run(caller())[0][0].output_ids) >= 1


def _peer_port_server() -> tuple[str, callable, list]:
    """A real aiohttp server (own thread) answering GET /port with the client's TCP port, so
    a test can tell a reused connection from a new one, and GET /health; returns (url, stop,
    the client ports of every request)."""
    from aiohttp import web

    seen = []

    async def port(request: web.Request) -> web.Response:
        seen.append(request.transport.get_extra_info("peername")[1])
        return web.json_response(seen[-1])

    loop = asyncio.new_event_loop()
    app = web.Application()
    app.router.add_get("/port", port)
    app.router.add_get("/health", port)
    runner = web.AppRunner(app)
    loop.run_until_complete(runner.setup())
    site = web.TCPSite(runner, "127.0.0.1", 0)
    loop.run_until_complete(site.start())
    url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()

    def stop() -> None:
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result()
        loop.call_soon_threadsafe(loop.stop)
        thread.join()

    return url, stop, seen


def test_keep_alive_reuses_one_connection_and_return_errors_tries_every_server():
    url, stop, seen = _peer_port_server()
    try:
        client = RolloutClient([url])
        outside = {client.get_all("/port")[url] for _ in range(3)}
        assert len(outside) == 3  # a new connection per call
        with client.keep_alive():
            seen.clear()
            inside = {client.get_all("/port")[url] for _ in range(3)}
            with client.keep_alive():  # a nested block shares the loop and its connections
                assert client.health() == {url: True}
                inside.add(client.get_all("/port")[url])
        assert len(inside) == 1 and len(seen) == 5 and set(seen) == inside
        dead = "http://127.0.0.1:9"  # discard port: connection refused
        both = RolloutClient([url, dead], max_retries=0)
        with both.keep_alive():
            replies = both.post_all("/port", {}, return_errors=True)
        assert isinstance(replies[dead], Exception) and dead in str(replies[dead])
        assert isinstance(replies[url], Exception) and "405" in str(replies[url])
        with pytest.raises(Exception, match="127.0.0.1:9"):
            both.get_all("/port")
    finally:
        stop()


@pytest.mark.parametrize("retract", [True, False], ids=["retract", "in_place"])
def test_retract_pause_reprefills_with_the_new_weights(model_dir, reference, tmp_path, retract):
    """A weight update while decoding is paused after 3 tokens: with a ``retract`` pause the
    rest is sampled from the new weights over prompt + tokens so far (as SGLang re-prefills a
    retracted request); ``in_place`` keeps the old KV cache, so token 3 still comes from the
    logits the old weights computed."""
    from megatron_klear.rollout.engine.generator import Generator, Sequence
    from megatron_klear.rollout.orchestration.request import SamplingParams

    old_ref, _ = reference
    new_ref, _ = load_reference(make_tiny_model(tmp_path / "new", seed=1))
    gen = Generator(model_dir, seed=0)
    retract_flag = threading.Event()

    class PauseAfter3(threading.Event):  # the real Event; the 4th wait is the pause
        calls = 0

        def wait(self, timeout=None):
            self.calls += 1
            if self.calls == 4:  # a weight update, as /update_weights_from_tensor loads it
                gen.load_tensors(list(new_ref.named_parameters()))
                if retract:
                    retract_flag.set()
            return super().wait(timeout)

    running = PauseAfter3()
    running.set()
    seq = Sequence([5, 6, 7, 8], SamplingParams(max_new_tokens=8, ignore_eos=True), seed=3)
    gen.run_batch([seq], threading.Event(), running, retract_flag)
    ids = seq.prompt_ids + seq.output_ids
    got = torch.tensor(seq.logprobs)
    old = reference_logprobs(old_ref, ids)[len(seq.prompt_ids) - 1:]
    new = reference_logprobs(new_ref, ids)[len(seq.prompt_ids) - 1:]
    assert len(got) == 8 and (got[:3] - old[:3]).abs().max() < 1e-4  # before the update
    assert (old[3:] - new[3:]).abs().max() > 1e-2  # the two models disagree
    if retract:
        assert (got[3:] - new[3:]).abs().max() < 1e-4
    else:
        assert abs(got[3] - old[3]) < 1e-4 and (got[4:] - new[4:]).abs().max() > 1e-3


@pytest.mark.parametrize("seeded", [True, False])
def test_finished_rows_leave_the_batch_and_change_nothing(model_dir, reference, monkeypatch,
                                                          seeded):
    """A decoding batch drops its finished rows (generator.COMPACT_AT): later steps forward
    fewer rows, every sequence samples the same tokens and finishes the same way as when the
    whole batch decodes to its end (seeded draws from (seed, position); unseeded ones from
    the server's stream, which still advances by one draw per request), and its logprobs are
    the independent transformers forward's. Not bit-identical on every shape: a GEMM over
    fewer rows may round differently (<= 4.3e-6 measured here)."""
    from megatron_klear.rollout.engine import generator as gen_mod

    model, tok = reference
    gen = gen_mod.Generator(model_dir)
    widths: list[int] = []
    forward = gen._forward

    def counted(ids, *a, **k):
        widths.append(ids.shape[0])
        return forward(ids, *a, **k)
    monkeypatch.setattr(gen, "_forward", counted)
    # a tenth of the vocabulary stops a row: rows finish at different steps
    params = SamplingParams(max_new_tokens=40, stop_token_ids=list(range(10, 40, 3)))

    def decode(compact_at: float) -> list:
        monkeypatch.setattr(gen_mod, "COMPACT_AT", compact_at)
        gen.generator.manual_seed(0)
        widths.clear()
        seqs = [gen_mod.Sequence(tok.encode(p, add_special_tokens=False), params,
                                 seed=7 * i if seeded else None)
                for i, p in enumerate(PROMPTS * 4)]
        running = threading.Event()
        running.set()
        gen.run_batch(seqs, threading.Event(), running)
        return seqs

    whole = decode(0.0)  # never compacts: every step forwards all 16 rows
    assert set(widths[1:]) == {16}
    lengths = {len(s.output_ids) for s in whole}
    assert len(lengths) > 3 and min(lengths) < 20  # rows did finish at different steps
    compacted = decode(0.75)
    assert min(widths[1:]) < 8  # the later steps forwarded only the unfinished rows
    for a, b in zip(compacted, whole):
        assert (a.output_ids, a.finish_reason) == (b.output_ids, b.finish_reason)
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs),
                                   atol=1e-5, rtol=0)
        ref = reference_logprobs(model, a.prompt_ids + a.output_ids)[len(a.prompt_ids) - 1:]
        torch.testing.assert_close(torch.tensor(a.logprobs), ref, atol=1e-4, rtol=0)


def test_compaction_keeps_few_row_counts():
    """A batch drops finished rows once a quarter finished (COMPACT_AT), to the unfinished
    ones; from ONEDNN_MIN_ROWS rows on it keeps a multiple of ROW_QUANTUM (finished rows
    fill up), so oneDNN sees few row counts."""
    from megatron_klear.rollout.engine.generator import ROW_QUANTUM, Sequence, _compaction

    def batch(size: int, unfinished: list[int]) -> list:
        seqs = [Sequence([1], SamplingParams()) for _ in range(size)]
        for i, s in enumerate(seqs):
            s.finish_reason = None if i in unfinished else {"type": "stop"}
        return seqs

    assert ROW_QUANTUM == 16
    odd = list(range(1, 64, 2)) + [4, 8, 12, 16, 20, 22, 26, 30, 34, 38, 42, 46, 50, 54, 58]
    kept = _compaction(batch(64, odd))  # 47 unfinished of 64: 48 rows
    assert len(kept) == 48 and set(odd) < set(kept) and kept == sorted(kept)
    assert _compaction(batch(64, list(range(49)))) is None  # 49 -> 64 rows: no gain
    assert _compaction(batch(64, list(range(40)))) == list(range(48))
    assert _compaction(batch(64, list(range(20)))) == list(range(32))
    assert _compaction(batch(64, [3, 9])) == [3, 9]  # below 16 rows: exactly the unfinished
    assert _compaction(batch(12, list(range(10)))) is None  # 10 of 12 left: not yet


def test_batch_invariant_sequence_alone_equals_in_any_batch(model_dir, reference):
    """--enable-batch-invariant: a seeded sequence's tokens and log-probs are bit-identical
    decoded alone and in mixed batches (other prompts of other lengths before and after it,
    finishing at other steps). Without it the batched forward changes its log-probs (left
    padding, row counts: the cause this flag removes)."""
    from megatron_klear.rollout.engine.generator import Generator, Sequence

    _, tok = reference
    params = SamplingParams(max_new_tokens=16, temperature=1.0,
                            stop_token_ids=list(range(10, 40, 3)))
    ids = [tok.encode(p, add_special_tokens=False) for p in PROMPTS]
    running = threading.Event()
    running.set()

    def decode(gen: Generator, batch: list[int]) -> list[tuple]:
        seqs = [Sequence(list(ids[i % len(ids)]), params, seed=100 + i) for i in batch]
        gen.run_batch(seqs, threading.Event(), running)
        return [(s.output_ids, s.logprobs) for s in seqs]

    target = 2  # the one-token prompt "x": every other row pads it
    for invariant in (True, False):
        gen = Generator(model_dir, batch_invariant=invariant)
        alone = decode(gen, [target])[0]
        mixed = [decode(gen, [0, 1, target, 3, 4, 5])[2], decode(gen, [target, 7, 4, 1])[0],
                 decode(gen, [5, 6, 0, 3, 1, target])[5]]
        assert len(alone[0]) > 1
        same = [m == alone for m in mixed]
        assert all(same) if invariant else not all(same), (invariant, same)
