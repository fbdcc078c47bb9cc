"""The short soak: 90 mixed requests from 8 concurrent clients against an in-process server
(random target, random DSpine drafter with the copy-or-draft proposer and an API key); the
long one is ``benchmarks/soak.py`` on the real target."""
from __future__ import annotations

import pytest

from dspine.config import SpeculativeConfig
from dspine.core.batch import BatchEngine
from dspine.build import build_engine
from dspine.config import SamplingConfig
from dspine.core.engine import Engine
from dspine.serve import ServerThread, create_app
from dspine.serve.auth import APIKeys
from dspine.serve.soak import KINDS, make_specs, rss_of, soak

pytestmark = pytest.mark.usefixtures("one_thread_module")
MODEL = "random:llama"


def test_short_soak_loses_nothing_and_leaks_nothing():
    target, eng = build_engine(SpeculativeConfig(target=MODEL, drafter="random", mode="dspine",
                                                 verify_policy="cost", proposer="hybrid", concurrency=4,
                                                 ngram_cache_tokens=2000, linear_backend="aten",
                                                 tree_budget=0))
    app = create_app(BatchEngine(eng, 4), MODEL, max_queue=64, api_keys=APIKeys({"soak": None}))
    with ServerThread(app) as srv:
        res = soak(srv.url, n=10 * len(KINDS), clients=8, seed=1, api_key="soak", rss=rss_of())
    d = res.to_dict()
    assert not res.wrong and not res.lost and not res.unexpected and res.server_errors == 0, d
    assert res.by_kind == {k: 10 for k in KINDS}, d
    assert res.after["free_slots"] == res.before["free_slots"] == 4 and res.after["running"] == 0, d
    assert res.ok(), d
    # the references themselves are the target's: a greedy one equals the single-request ar engine
    ar = Engine(target, None, "ar")
    spec = next(s for s in make_specs(10 * len(KINDS), MODEL, eng.max_positions, 1) if s.kind == "greedy")
    want = ar.generate(target.encode_prompt(spec.body["prompt"]), SamplingConfig(), spec.body["max_tokens"]).text
    import httpx

    with ServerThread(create_app(BatchEngine(eng, 4), MODEL)) as srv:
        got = httpx.post(srv.url + spec.path, json=spec.body, timeout=60).json()["choices"][0]["text"]
    assert got == want


def test_soak_catches_a_wrong_answer(monkeypatch):
    """Negative control: a server whose batched answers differ from its single-request ones
    (here: every reply after the references is cut by one character) fails the soak."""
    target, eng = build_engine(SpeculativeConfig(target=MODEL, drafter=None, mode="ar", concurrency=2,
                                                 verify_policy="fixed", proposer="drafter",
                                                 linear_backend="aten", tree_budget=0))
    app = create_app(BatchEngine(eng, 2), MODEL)
    import dspine.serve.soak as soak_mod

    real = soak_mod._send
    calls = {"n": 0, "refs": None}

    async def send(client, spec, headers):
        st, text = await real(client, spec, headers)
        calls["n"] += 1
        if calls["refs"] is not None and text:
            text = text[:-1]
        return st, text

    async def state(client, rss):  # the references are done when the baseline is taken
        calls["refs"] = calls["n"]
        return await orig_state(client, rss)

    orig_state = soak_mod._state
    monkeypatch.setattr(soak_mod, "_send", send)
    monkeypatch.setattr(soak_mod, "_state", state)
    with ServerThread(app) as srv:
        res = soak(srv.url, n=2 * len(KINDS), clients=4, seed=2)
    assert res.wrong and not res.ok()
