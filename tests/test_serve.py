"""OpenAI-compatible server over the batched engine.

Servers run in-process (uvicorn in a thread) on 127.0.0.1 with a free port, except
one ``dspine serve`` subprocess test (start-up line, SIGTERM, --max-running guard).
Batched path: random llama target + random dspine drafter; references come from
single-request engines (``Engine(target, None, "ar")`` for greedy).
"""
from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest

from conftest import KnownContinuation
from dspine.config import SpeculativeConfig
from dspine.core.batch import BatchEngine
from dspine.config import SamplingConfig
from dspine.drafter.checkpoint import random_drafter
from dspine.proposers.drafter import DrafterProposer
from dspine.core.engine import Engine
from dspine.serve import ServerThread, create_app
from dspine.target.adapter import load_target

MODEL = "random:llama"
PROMPTS = ["hello world", "a", "The quick brown fox", "xyz" * 7, "12", "foo bar baz", "q" * 30, "zz top"]
LENS = [12, 20, 5, 16, 9, 1, 14, 24]


pytestmark = pytest.mark.usefixtures("one_thread_module")


@pytest.fixture(scope="module")
def ref_target():
    return load_target(MODEL)


@pytest.fixture(scope="module")
def ar(ref_target):
    return Engine(ref_target, None, "ar")


@pytest.fixture(scope="module")
def spec_ref(ref_target):
    """A single-request engine with the same (seeded) drafter as the server."""
    return Engine(ref_target, DrafterProposer(random_drafter(ref_target, "dspine", seed=0)), "dspine")


@pytest.fixture(scope="module")
def server():
    target = load_target(MODEL)
    eng = Engine(target, DrafterProposer(random_drafter(target, "dspine", seed=0)), "dspine")
    app = create_app(BatchEngine(eng, 8), MODEL, max_queue=8, info={"mode": "dspine"})
    with ServerThread(app) as srv:
        yield srv


def health(srv) -> dict:
    return httpx.get(srv.url + "/health", timeout=10).json()


def wait_idle(srv, timeout: float = 20.0) -> dict:
    t0 = time.monotonic()
    while True:
        h = health(srv)
        if h["running"] == 0 and h["queued"] == 0:
            return h
        if time.monotonic() - t0 > timeout:
            raise AssertionError(f"server not idle: {h}")
        time.sleep(0.05)


def sse_events(lines) -> list:
    """Parsed ``data:`` payloads of an SSE stream; the last one is the string '[DONE]'."""
    out = []
    for line in lines:
        if not line.startswith("data: "):
            continue
        d = line[6:]
        out.append(d if d == "[DONE]" else json.loads(d))
    return out


async def apost(client: httpx.AsyncClient, path: str, body: dict) -> dict:
    """POST, streamed or not; returns {status, text, ids, finish, usage} (or the error JSON)."""
    if not body.get("stream"):
        r = await client.post(path, json=body)
        j = r.json()
        if r.status_code != 200:
            return {"status": r.status_code, "error": j}
        c = j["choices"][0]
        text = c["message"]["content"] if "message" in c else c["text"]
        return {"status": 200, "text": text, "ids": c.get("token_ids"), "finish": c["finish_reason"],
                "usage": j["usage"]}
    async with client.stream("POST", path, json=body) as r:
        if r.status_code != 200:
            await r.aread()
            return {"status": r.status_code, "error": r.json()}
        lines = [line async for line in r.aiter_lines()]
    ev = sse_events(lines)
    assert ev[-1] == "[DONE]"
    text, ids, finish, usage = "", [], None, None
    for e in ev[:-1]:
        if "error" in e:
            return {"status": 500, "error": e}
        if e.get("usage"):
            usage = e["usage"]
        for c in e["choices"]:
            text += c["delta"].get("content", "") if "delta" in c else c["text"]
            ids += c.get("token_ids", [])
            finish = c["finish_reason"] or finish
    return {"status": 200, "text": text, "ids": ids, "finish": finish, "usage": usage}


def run_all(srv, jobs: list[tuple[str, dict]], timeout: float = 120.0) -> list[dict]:
    async def main():
        async with httpx.AsyncClient(base_url=srv.url, timeout=timeout) as c:
            return await asyncio.gather(*[apost(c, p, b) for p, b in jobs])
    return asyncio.run(main())


def metric(srv, name: str) -> float:
    text = httpx.get(srv.url + "/metrics", timeout=10).text
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise KeyError(name)


# -- tests ----------------------------------------------------------------------------
def test_info_endpoints(server):
    m = httpx.get(server.url + "/v1/models").json()
    assert m["object"] == "list" and m["data"][0]["id"] == MODEL
    h = health(server)
    assert h["status"] == "ok" and h["max_running"] == 8 and h["free_slots"] == 8
    text = httpx.get(server.url + "/metrics").text
    for name in ("dspine_requests_total", "dspine_generation_tokens_total", "dspine_acceptance_length_bucket",
                 "dspine_cycle_seconds_bucket", "dspine_queue_depth", "dspine_running_requests",
                 "dspine_free_slots", "dspine_cache_bytes"):
        assert name in text, name


def test_greedy_concurrent_equals_single_ar(server, ar):
    jobs = []
    for i, (p, n) in enumerate(zip(PROMPTS, LENS)):
        body = {"model": MODEL, "prompt": p, "max_tokens": n, "temperature": 0, "return_token_ids": True,
                "stream": i % 2 == 1}
        if body["stream"]:
            body["stream_options"] = {"include_usage": True}
        jobs.append(("/v1/completions", body))
    before = metric(server, "dspine_batch_size_sum")
    got = run_all(server, jobs)
    for p, n, g in zip(PROMPTS, LENS, got):
        ids = ar.target.encode_prompt(p)
        want = ar.generate(ids, max_new_tokens=n)
        assert g["status"] == 200
        assert g["ids"] == want.token_ids
        assert g["text"] == want.text
        assert g["finish"] == want.finish_reason
        assert g["usage"]["prompt_tokens"] == len(ids) and g["usage"]["completion_tokens"] == len(want.token_ids)
    # the requests really were verified together (mean batch size > 1)
    sums = metric(server, "dspine_batch_size_sum") - before
    assert sums > 0
    h = wait_idle(server)
    assert h["free_slots"] == 8 and h["cache_bytes"] == 0


def test_seeded_sampling_reproducible_alone_and_in_batch(server, spec_ref):
    body = {"prompt": "seeded sampling", "max_tokens": 18, "temperature": 0.8, "top_k": 50, "top_p": 0.95,
            "min_p": 0.01, "seed": 1234, "return_token_ids": True}
    alone1 = run_all(server, [("/v1/completions", body)])[0]
    alone2 = run_all(server, [("/v1/completions", dict(body, stream=True))])[0]
    others = [("/v1/completions", {"prompt": p, "max_tokens": n, "temperature": 0.7 if i % 2 else 0,
                                   "seed": i, "return_token_ids": True})
              for i, (p, n) in enumerate(zip(PROMPTS[:7], LENS[:7]))]
    mixed = run_all(server, others[:3] + [("/v1/completions", body)] + others[3:])[3]
    want = spec_ref.generate(spec_ref.target.encode_prompt(body["prompt"]),
                             SamplingConfig(temperature=0.8, top_k=50, top_p=0.95, min_p=0.01, seed=1234), 18)
    assert alone1["ids"] == alone2["ids"] == mixed["ids"] == want.token_ids
    assert alone1["text"] == mixed["text"] == want.text


@pytest.mark.parametrize("chat", [False, True])
def test_stream_equals_non_stream(server, chat):
    if chat:
        path = "/v1/chat/completions"
        body = {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi there"}],
                "max_tokens": 20, "temperature": 0, "return_token_ids": True}
    else:
        path = "/v1/completions"
        body = {"prompt": "streaming check", "max_tokens": 20, "temperature": 0, "return_token_ids": True,
                "stop": ["\n\n"]}
    plain, streamed = run_all(server, [(path, body), (path, dict(body, stream=True,
                                                                 stream_options={"include_usage": True}))])
    assert plain["status"] == streamed["status"] == 200
    assert streamed["text"] == plain["text"]
    assert streamed["ids"] == plain["ids"]
    assert streamed["finish"] == plain["finish"]
    assert streamed["usage"] == plain["usage"]


def test_stop_inside_accepted_block_stream(ar):
    target = ar.target
    cands = [f"stop test {i}" for i in range(12)]
    refs, pick = {}, None
    for p in cands:
        ids = target.encode_prompt(p)
        r = ar.generate(ids, max_new_tokens=30)
        refs[tuple(ids)] = r.token_ids
        t = r.text
        for k in range(4, len(t) - 2):
            if pick is None and "\ufffd" not in t[k:k + 2] and t.find(t[k:k + 2]) == k:
                pick = (p, t[k:k + 2], k)
    assert pick is not None
    prompt, stop, k = pick
    want = ar.generate(target.encode_prompt(prompt), max_new_tokens=30, stop=[stop])
    eng = Engine(target, KnownContinuation(refs), "dspine")
    app = create_app(BatchEngine(eng, 4), MODEL, max_queue=4)
    with ServerThread(app) as srv:
        body = {"prompt": prompt, "max_tokens": 30, "temperature": 0, "stop": stop, "return_token_ids": True}
        s, ns = run_all(srv, [("/v1/completions", dict(body, stream=True, stream_options={"include_usage": True})),
                                  ("/v1/completions", body)])
        tau = metric(srv, "dspine_acceptance_length_sum") / metric(srv, "dspine_acceptance_length_count")
    for g in (s, ns):
        assert g["text"] == want.text and len(g["text"]) == k
        assert g["ids"] == want.token_ids
        assert g["usage"]["completion_tokens"] == len(want.token_ids)
        assert g["finish"] == "stop"
    assert tau > 2.0  # blocks of several tokens were accepted: the stop fell inside one


BAD = [
    ("/v1/completions", {"prompt": "x", "temperature": -1}, 400, "temperature"),
    ("/v1/completions", {"prompt": "x", "temperature": "hot"}, 400, "temperature"),
    ("/v1/completions", {"prompt": "x", "top_p": 0}, 400, "top_p"),
    ("/v1/completions", {"prompt": "x", "top_k": -5}, 400, "top_k"),
    ("/v1/completions", {"prompt": "x", "min_p": 1.5}, 400, "min_p"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "stop": ["\n", ""]}, 400, "stop"),  # an empty stop: refused, not dropped
    ("/v1/completions", {"prompt": "x", "n": 2}, 400, "n"),
    ("/v1/completions", {"prompt": "x", "stop": 5}, 400, "stop"),
    ("/v1/completions", {"prompt": "x", "seed": -1}, 400, "seed"),
    ("/v1/completions", {"prompt": "x", "logprobs": 3}, 400, "logprobs"),
    ("/v1/completions", {"prompt": ["a", "b"]}, 400, "prompt"),
    ("/v1/completions", {"max_tokens": 3}, 400, "prompt"),
    ("/v1/completions", {"prompt": ""}, 400, "prompt"),
    ("/v1/completions", {"prompt": [999999]}, 400, "prompt"),
    ("/v1/completions", {"prompt": [True, 1.0]}, 400, "prompt"),  # not token ids (were read as [1, 1])
    ("/v1/completions", {"prompt": [[1, 2.5]]}, 400, "prompt"),
    ("/v1/completions", {"prompt": ["hi", 5]}, 400, "prompt"),
    ("/v1/completions", {"prompt": [None]}, 400, "prompt"),
    ("/v1/completions", {"prompt": [[True]]}, 400, "prompt"),
    ("/v1/completions", {"prompt": "x" * 5000, "max_tokens": 1}, 400, "prompt"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 4096}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "model": "gpt-4"}, 404, "model"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "bob", "content": "x"}]}, 400, "messages.0.role"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": ""}]}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "stream": "maybe"}, 400, "stream"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "tools": [{"type": "function", "function": {"name": "f"}}]}, 400, "tools"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "tool_choice": "required"},
     400, "tool_choice"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "response_format": {"type": "json_object"}}, 400, "response_format"),
]


def test_validation_errors(server):
    with httpx.Client(base_url=server.url, timeout=30) as c:
        for path, body, status, param in BAD:
            r = c.post(path, json=body)
            assert r.status_code == status, (body, r.text)
            err = r.json()["error"]
            assert err["param"] == param, (body, err)
            assert err["message"] and err["type"]
        r = c.post("/v1/completions", json={"prompt": [True, 1]})  # says what a prompt may be
        assert "list of token ids (JSON integers)" in r.json()["error"]["message"]
        r = c.post("/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
        assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]
        r = c.get("/v1/nothing")
        assert r.status_code == 404 and "error" in r.json()
        for path, raw, param in (("/v1/completions", b'{"prompt": "\\ud800"}', "prompt"),  # lone surrogate
                                 ("/v1/chat/completions",
                                  b'{"messages": [{"role": "user", "content": "\\ud800"}]}', "messages")):
            r = c.post(path, content=raw, headers={"content-type": "application/json"})
            assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
        # a tiny temperature is the argmax limit, not a crash of the batch (was a 500 for all)
        r = c.post("/v1/completions", json={"prompt": "x", "temperature": 2e-308, "max_tokens": 4})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1
    h = health(server)
    assert h["running"] == 0 and h["cache_bytes"] == 0


def test_disconnect_frees_state(server):
    start = wait_idle(server)
    with httpx.Client(base_url=server.url, timeout=30) as c:
        with c.stream("POST", "/v1/completions", json={"prompt": "long one", "max_tokens": 2000,
                                                        "temperature": 0, "stream": True}) as r:
            n, seen = 0, None
            for line in r.iter_lines():
                n += line.startswith("data: ")
                if n >= 3:
                    seen = health(server)  # still streaming: its state is held
                    break  # leaving iter_lines closes the connection
            assert seen["running"] == 1 and seen["cache_bytes"] > 0
    # non-streamed: the client gives up (timeout) and closes the connection
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/completions", json={"prompt": "long two", "max_tokens": 2000,
                                                         "temperature": 0}, timeout=1.0)
    h = wait_idle(server)
    assert h["free_slots"] == start["free_slots"] == 8
    assert h["cache_bytes"] == start["cache_bytes"] == 0
    assert metric(server, 'dspine_requests_total{endpoint="completions",outcome="cancelled"}') >= 2


def test_bounded_load_with_cancellations(server, ar):
    """200 requests from 24 clients (mixed lengths, streams, chat, stops), ~15% cancelled
    mid-flight, 429s retried a few times with back-off; greedy results stay exact."""
    start = wait_idle(server)
    rng = random.Random(0)
    statuses: dict[str, int] = {}
    errors: list[str] = []
    done_greedy: list[tuple[list[int], dict, dict]] = []
    plan = []
    for i in range(200):
        chat = rng.random() < 0.3
        body = {"max_tokens": rng.choice([1, 2, 3, 5, 8, 12]), "temperature": rng.choice([0, 0.7]),
                "seed": i, "stream": rng.random() < 0.5, "stream_options": {"include_usage": True},
                "return_token_ids": True}
        if rng.random() < 0.3:
            body["stop"] = ["e", "\n"]
        if chat:
            body["messages"] = [{"role": "user", "content": f"load {i}"}]
        else:
            body["prompt"] = "load test " * rng.randint(1, 6)
        plan.append(("/v1/chat/completions" if chat else "/v1/completions", body,
                     rng.uniform(0.01, 0.4) if rng.random() < 0.15 else None))

    def bump(k):
        statuses[k] = statuses.get(k, 0) + 1

    async def one(c, sem, path, body, cancel_after):
        async with sem:
            for attempt in range(4):
                task = asyncio.ensure_future(apost(c, path, body))
                try:
                    if cancel_after is None:
                        res = await task
                    else:
                        done, _ = await asyncio.wait({task}, timeout=cancel_after)
                        if not done:
                            task.cancel()  # the client goes away mid-request
                            bump("cancelled")
                            return
                        res = task.result()
                except Exception as e:  # noqa: BLE001
                    errors.append(f"{type(e).__name__}: {e}")
                    return
                bump(str(res["status"]))
                if res["status"] == 429:
                    await asyncio.sleep(0.05 * (attempt + 1) + rng.random() * 0.1)
                    continue
                if res["status"] != 200:
                    errors.append(str(res))
                elif not 1 <= res["usage"]["completion_tokens"] <= body["max_tokens"]:
                    errors.append(f"bad usage {res['usage']} for {body}")
                elif body["temperature"] == 0:
                    done_greedy.append((res["ids"], res, body))
                return

    async def main():
        sem = asyncio.Semaphore(24)
        limits = httpx.Limits(max_connections=32, max_keepalive_connections=32)
        async with httpx.AsyncClient(base_url=server.url, timeout=60, limits=limits) as c:
            await asyncio.wait_for(asyncio.gather(*[one(c, sem, *p) for p in plan]), 150)

    t0 = time.monotonic()
    asyncio.run(main())
    wall = time.monotonic() - t0
    assert not errors, errors[:5]
    assert statuses.get("200", 0) >= 100, statuses
    assert statuses.get("429", 0) >= 1, statuses  # the bounded queue refused some
    h = wait_idle(server)
    assert h["free_slots"] == start["free_slots"] == 8
    assert h["cache_bytes"] == start["cache_bytes"] == 0
    assert h["target_kv_bytes"] == 0 and h["draft_kv_bytes"] == 0
    # exactness under load (rows joined, left and moved around these requests)
    for ids, res, body in done_greedy:
        text = body["messages"][0]["content"] if "messages" in body else body["prompt"]
        want = ar.generate(ar.target.encode_prompt(text), max_new_tokens=body["max_tokens"], stop=body.get("stop"))
        assert ids == want.token_ids and res["text"] == want.text
    print(f"load: {statuses} in {wall:.1f}s, {len(done_greedy)} greedy results checked")


def test_queued_cancel_and_internal_error(ar):
    """A client leaving while queued frees its queue place; an engine failure answers 500
    JSON (no hung connection) and the server keeps serving."""
    app = create_app(BatchEngine(Engine(ar.target, None, "ar"), 1), MODEL, max_queue=1)
    with ServerThread(app) as srv:
        with httpx.stream("POST", srv.url + "/v1/completions", timeout=30,
                          json={"prompt": "long one", "max_tokens": 3000, "temperature": 0, "stream": True}) as a:
            it = a.iter_lines()
            next(x for x in it if x.startswith("data: "))
            with pytest.raises(httpx.ReadTimeout):  # queued behind A, then the client leaves
                httpx.post(srv.url + "/v1/completions", json={"prompt": "b", "max_tokens": 2}, timeout=0.5)
            t0 = time.monotonic()
            while health(srv)["queued"] and time.monotonic() - t0 < 10:
                time.sleep(0.05)
            h = health(srv)
            assert h["queued"] == 0 and h["running"] == 1
            next(x for x in it if x.startswith("data: "))  # A still streams
        wait_idle(srv)
        batch = app.state.batch
        real_step = batch.step
        calls = {"n": 0}

        def failing_step():
            calls["n"] += 1
            if calls["n"] == 1:
                raise RuntimeError("injected failure")
            return real_step()
        batch.step = failing_step
        r = httpx.post(srv.url + "/v1/completions", json={"prompt": "x", "max_tokens": 5}, timeout=30)
        assert r.status_code == 500 and "injected failure" in r.json()["error"]["message"]
        r = httpx.post(srv.url + "/v1/completions", json={"prompt": "x", "max_tokens": 5, "temperature": 0},
                       timeout=30)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 5
        h = wait_idle(srv)
        assert h["free_slots"] == 1 and h["cache_bytes"] == 0


def _read_until(proc, pattern: str, timeout: float, sink: list) -> str:
    box = {}

    def reader():
        for line in proc.stdout:
            sink.append(line)
            if pattern in line and "hit" not in box:
                box["hit"] = line
    th = threading.Thread(target=reader, daemon=True)
    th.start()
    t0 = time.monotonic()
    while "hit" not in box:
        if proc.poll() is not None or time.monotonic() - t0 > timeout:
            raise AssertionError("no start-up line: " + "".join(sink) + (proc.stderr.read() if proc.poll() is not None else ""))
        time.sleep(0.05)
    return box["hit"]


@pytest.mark.slow  # long CLI / subprocess run; the default suite stays under ~15 min on 2 cores
def test_cli_serve_subprocess_graceful_sigterm():
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    bad = subprocess.run([sys.executable, "-m", "dspine.cli", "serve", "--target", MODEL, "--max-running", "9",
                          "--port", "0"], capture_output=True, text=True, timeout=120, env=env)
    assert bad.returncode == 2 and "--max-running" in bad.stderr
    bad = subprocess.run([sys.executable, "-m", "dspine.cli", "serve", "--target", MODEL, "--verify-policy", "greedy",
                          "--port", "0"], capture_output=True, text=True, timeout=120, env=env)
    assert bad.returncode == 2 and "--verify-policy: invalid choice: 'greedy'" in bad.stderr
    proc = subprocess.Popen([sys.executable, "-m", "dspine.cli", "serve", "--target", MODEL, "--mode", "ar",
                             "--port", "0", "--threads", "1", "--max-running", "2", "--shutdown-timeout", "20"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    lines: list[str] = []
    try:
        line = _read_until(proc, "listening on http://127.0.0.1:", 120, lines)
        url = line.split("listening on ")[1].strip()
        r = httpx.post(url + "/v1/completions", json={"prompt": "hi", "max_tokens": 4, "temperature": 0}, timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
        # SIGTERM while a stream is running: the stream still finishes, then the server exits 0
        with httpx.stream("POST", url + "/v1/completions", timeout=60,
                          json={"prompt": "graceful", "max_tokens": 60, "temperature": 0, "stream": True}) as s:
            it = s.iter_lines()
            first = next(x for x in it if x.startswith("data: "))
            assert first
            proc.send_signal(signal.SIGTERM)
            rest = [x for x in it if x.startswith("data: ")]
        assert rest[-1] == "data: [DONE]"
        last = json.loads(rest[-2][6:])
        assert last["choices"][0]["finish_reason"] == "length"
        assert proc.wait(60) == 0
        time.sleep(0.2)
        out = "".join(lines)
        assert "serves" in out or "model 'random:llama'" in out
        assert "stopped" in out
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_cost_policy_server_greedy_equals_single_ar(ar):
    """`dspine serve --verify-policy cost`: one verification length per batched cycle
    (measured cost curve of this machine); outputs stay the plain loop's."""
    from dspine.tune.controller import make_policy

    target = load_target(MODEL)
    prop = DrafterProposer(random_drafter(target, "dspine", seed=0))
    eng = Engine(target, prop, "dspine", verify_policy=make_policy("cost", target, prop))
    batch = BatchEngine(eng, 4)
    app = create_app(batch, MODEL, max_queue=8, info={"mode": "dspine", "verify_policy": "cost"})
    with ServerThread(app) as srv:
        jobs = [("/v1/completions", {"prompt": p, "max_tokens": n, "temperature": 0, "return_token_ids": True})
                for p, n in zip(PROMPTS, LENS)]
        got = run_all(srv, jobs)
    for p, n, g in zip(PROMPTS, LENS, got):
        want = ar.generate(ar.target.encode_prompt(p), max_new_tokens=n)
        assert g["ids"] == want.token_ids
    assert batch.batch_policy is not None and batch.batch_policy.decisions


@pytest.mark.slow  # ~50 s; batched greedy = ar on the real target stays in the default suite (test_dense_runtime)
def test_real_target_greedy_equals_cli(capsys):
    """Default target smollm2-135m (float32), short outputs: batched dspine == `dspine generate --mode ar`."""
    from dspine.build import build_engine
    from dspine.cli.main import main
    from dspine.target.registry import TargetError

    try:
        target, eng = build_engine(SpeculativeConfig(target="smollm2-135m", drafter="random", mode="dspine",
                                                     dtype="float32", verify_policy="fixed",
                                                     proposer="drafter", linear_backend="aten",
                                                     tree_budget=0))
    except (TargetError, OSError, ValueError) as e:  # assets unavailable
        pytest.skip(f"default target unavailable: {e}")
    prompts = ["The capital of France is", "def fib(n):", "Once upon a time"]
    lens = [16, 24, 10]
    chat_q = "What is 2+2?"
    app = create_app(BatchEngine(eng, 8), "smollm2-135m", max_queue=4)
    with ServerThread(app) as srv:
        jobs = [("/v1/completions", {"prompt": p, "max_tokens": n, "temperature": 0, "return_token_ids": True})
                for p, n in zip(prompts, lens)]
        jobs.append(("/v1/chat/completions", {"messages": [{"role": "user", "content": chat_q}], "max_tokens": 16,
                                              "temperature": 0, "return_token_ids": True, "stream": True}))
        got = run_all(srv, jobs)
    ar = Engine(target, None, "ar")
    for p, n, g in zip(prompts, lens, got):
        want = ar.generate(target.encode_prompt(p), max_new_tokens=n)
        assert g["ids"] == want.token_ids and g["text"] == want.text
    # the chat request against the CLI itself (`dspine generate --chat --mode ar --json`)
    assert main(["generate", chat_q, "--chat", "--mode", "ar", "--max-new-tokens", "16", "--json"]) == 0
    cli = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert got[3]["ids"] == cli["token_ids"] and got[3]["text"] == cli["text"]


def test_queue_limit_holds_while_a_request_is_being_admitted(ar):
    """A request popped from the queue for prefill still holds its slot: with 1 slot and
    --max-queue 1, while A is in prefill B may wait and C is refused (429)."""
    import asyncio
    import threading

    from dspine.config import SamplingConfig
    from dspine.serve.scheduler import Job, QueueFull, Scheduler

    batch = BatchEngine(Engine(ar.target, None, "ar"), 1)
    entered, release = threading.Event(), threading.Event()
    real_add = batch.add

    def slow_add(*a, **kw):
        entered.set()
        release.wait(30)
        return real_add(*a, **kw)

    batch.add = slow_add
    sched = Scheduler(batch, max_queue=1)
    sched.start()
    loop = asyncio.new_event_loop()
    try:
        def job():
            return Job(ar.target.encode_prompt("hi"), SamplingConfig(), 2, [], loop)
        sched.submit(job())  # A: admitted, blocks in prefill
        assert entered.wait(30)
        sched.submit(job())  # B: waits (the one queue place)
        with pytest.raises(QueueFull):
            sched.submit(job())  # C: A holds the slot, B the queue place
    finally:
        release.set()
        sched.stop()
        loop.close()


def test_shutdown_deadline_answers_running_requests_with_503():
    """Requests still running when the graceful-shutdown time runs out get a proper
    OpenAI-style 503 (JSON; for a stream an error event and [DONE]) instead of a bare
    500 or a cut stream; their state is freed."""
    target = load_target(MODEL)
    batch = BatchEngine(Engine(target, None, "ar"), 4)
    step = batch.step

    def slow_step():  # keep the requests running past the deadline
        time.sleep(0.05)
        return step()

    batch.step = slow_step
    srv = ServerThread(create_app(batch, MODEL), shutdown_timeout=1.0).start()
    box: dict = {}

    def plain():
        box["plain"] = httpx.post(srv.url + "/v1/completions", timeout=60,
                                  json={"prompt": "hi", "max_tokens": 300, "temperature": 0})

    def stream():
        with httpx.stream("POST", srv.url + "/v1/completions", timeout=60,
                          json={"prompt": "hi", "max_tokens": 300, "temperature": 0, "stream": True}) as s:
            box["stream"] = [x for x in s.iter_lines() if x.startswith("data: ")]

    threads = [threading.Thread(target=f) for f in (plain, stream)]
    for t in threads:
        t.start()
    t0 = time.monotonic()
    while health(srv)["running"] < 2 and time.monotonic() - t0 < 30:
        time.sleep(0.05)
    srv.stop()
    for t in threads:
        t.join(60)
    r = box["plain"]
    assert r.status_code == 503 and "shutting down" in r.json()["error"]["message"], r.text
    ev = sse_events(box["stream"])
    assert ev[-1] == "[DONE]" and "shutting down" in ev[-2]["error"]["message"], ev[-3:]
    assert not batch.running  # the cancelled requests' state is freed


def test_a_request_failing_in_a_batched_cycle_fails_alone(ar, monkeypatch):
    """Two requests share batched cycles; the verification of one raises. It gets a 500
    naming the failure, the other finishes with the exact single-request greedy output."""
    import dspine.core.verify as verify_mod

    real_verify = verify_mod.verify
    seen = {"bad": 0}

    def verify_failing_for_seed_7(tokens, q_probs, q_ids, logits, sampling, gen):
        if sampling.seed == 7:
            seen["bad"] += 1
            if seen["bad"] == 8:
                seen["running"] = len(app.state.batch.running)
                raise RuntimeError("injected verification failure")
        return real_verify(tokens, q_probs, q_ids, logits, sampling, gen)

    monkeypatch.setattr(verify_mod, "verify", verify_failing_for_seed_7)
    eng = Engine(ar.target, DrafterProposer(random_drafter(ar.target, "dspine", seed=0)), "dspine")
    app = create_app(BatchEngine(eng, 2), MODEL, max_queue=2)
    with ServerThread(app) as srv:
        jobs = [("/v1/completions", {"prompt": PROMPTS[0], "max_tokens": 40, "temperature": 0, "seed": 7}),
                ("/v1/completions", {"prompt": PROMPTS[2], "max_tokens": 40, "temperature": 0, "seed": 8})]
        with httpx.Client(timeout=60) as c:
            out: list = [None, None]

            def post(i):
                out[i] = c.post(srv.url + jobs[i][0], json=jobs[i][1])
            th = [threading.Thread(target=post, args=(i,)) for i in range(2)]
            for t in th:
                t.start()
            for t in th:
                t.join(60)
        assert out[0].status_code == 500 and "injected verification failure" in out[0].json()["error"]["message"]
        assert out[1].status_code == 200
        assert seen["running"] == 2  # it failed inside a cycle the two requests shared
        want = ar.generate(ar.target.encode_prompt(PROMPTS[2]), max_new_tokens=40)
        assert out[1].json()["choices"][0]["text"] == want.text
        h = wait_idle(srv)
        assert h["free_slots"] == 2 and h["cache_bytes"] == 0
        assert metric(srv, 'dspine_requests_total{endpoint="completions",outcome="error"}') == 1
