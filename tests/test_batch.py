"""BatchEngine: batched verification with ragged accepted lengths.

Tiny random llama target (ByteTokenizer, float32); the reference is always the
single-request engine (``Engine(target, None, "ar")`` for greedy).
"""
from __future__ import annotations

import pytest
import torch

from conftest import KnownContinuation
from dspine.core.batch import BatchEngine
from dspine.config import SamplingConfig
from dspine.drafter.checkpoint import random_drafter
from dspine.proposers.drafter import DrafterProposer
from dspine.core.engine import Engine, EngineError
from dspine.target.adapter import load_target

PROMPTS = ["hello world", "a", "The quick brown fox jumps over", "xyz" * 9, "12", "foo bar baz", "q" * 40, "zz top"]
LENS = [20, 33, 5, 28, 17, 1, 25, 40]


pytestmark = pytest.mark.usefixtures("one_thread_module")


@pytest.fixture(scope="module")
def target():
    torch.manual_seed(0)
    return load_target("random:llama")


@pytest.fixture(scope="module")
def ar(target):
    return Engine(target, None, "ar")


@pytest.fixture(scope="module")
def spec(target):
    return Engine(target, DrafterProposer(random_drafter(target, "dspine", seed=0)), "dspine")


@pytest.fixture(scope="module")
def prompts(target):
    return [target.encode_prompt(p) for p in PROMPTS]


@pytest.fixture(scope="module")
def ref_greedy(ar, prompts):
    return [ar.generate(p, max_new_tokens=m) for p, m in zip(prompts, LENS)]


@pytest.mark.parametrize("mode", ["dspine", "dflash", "ar"])
def test_greedy_batched_equals_single_ar(target, prompts, ref_greedy, mode):
    if mode == "ar":
        eng = Engine(target, None, "ar")
    else:
        eng = Engine(target, DrafterProposer(random_drafter(target, mode, seed=1)), mode)
    be = BatchEngine(eng, 8)
    got = be.generate_many(prompts, max_new_tokens=LENS)
    for r, g in zip(ref_greedy, got):
        assert g.token_ids == r.token_ids
        assert g.text == r.text and g.finish_reason == r.finish_reason
    assert be.free_slots == 8 and be.cache_bytes() == 0 and be.kv.nbytes() == 0


def test_ragged_acceptance_oracle(target, prompts, ref_greedy):
    refs = {tuple(p): r.token_ids for p, r in zip(prompts, ref_greedy)}
    eng = Engine(target, KnownContinuation(refs, wrong=lambda c, pos, n: pos % 7), "dspine")
    be = BatchEngine(eng, 8)
    got = be.generate_many(prompts, max_new_tokens=LENS)
    for r, g in zip(ref_greedy, got):
        assert g.token_ids == r.token_ids
    taus = [g.stats.accepted_length_mean for g in got if g.stats.cycles]
    assert max(taus) > 2.0  # multi-token blocks were accepted, with ragged lengths
    assert len({round(t, 3) for t in taus}) > 1


def test_continuous_batching_with_fewer_slots_and_cancel(target, prompts, ref_greedy, spec):
    be = BatchEngine(spec, 3)
    reqs = {}
    pending = list(range(len(prompts)))
    cancelled = None
    cycles = 0
    while pending or be.running:
        while pending and be.free_slots > 0:
            i = pending.pop(0)
            reqs[i] = be.add(prompts[i], None, LENS[i])
        be.step()
        cycles += 1
        if cycles == 3 and cancelled is None:  # cancel one in the middle of the batch
            r = next(r for r in be.running if r is not be.running[-1])
            cancelled = next(i for i, q in reqs.items() if q is r)
            be.remove(r, "cancelled")
            assert r.finish_reason == "cancelled" and r.draft_state is None
    for i, r in reqs.items():
        if i == cancelled:
            n = len(r.out_ids)
            assert r.out_ids == ref_greedy[i].token_ids[:n]
        else:
            assert r.out_ids == ref_greedy[i].token_ids, i
    assert cancelled is not None
    assert be.free_slots == 3 and be.cache_bytes() == 0


def test_sampled_reproducible_alone_and_in_batch(target, prompts, spec):
    samp = [SamplingConfig(temperature=0.9, top_k=40, top_p=0.95, seed=100 + i) for i in range(len(prompts))]
    single = [spec.generate(p, s, m).token_ids for p, s, m in zip(prompts, samp, LENS)]
    alone = [BatchEngine(spec, 8).generate_many([p], [s], [m])[0].token_ids
             for p, s, m in zip(prompts[:3], samp[:3], LENS[:3])]
    mixed_samp = [s if i % 2 == 0 else SamplingConfig() for i, s in enumerate(samp)]  # greedy + sampled
    mixed = BatchEngine(spec, 8).generate_many(prompts, mixed_samp, LENS)
    assert alone == single[:3]
    for i, g in enumerate(mixed):
        if i % 2 == 0:
            assert g.token_ids == single[i]


def test_stop_inside_accepted_block(target, prompts, ref_greedy, ar):
    refs = {tuple(p): r.token_ids for p, r in zip(prompts, ref_greedy)}
    # a 2-character stop string first occurring well inside a reference output
    i, k = next((i, k) for i in sorted(range(len(prompts)), key=lambda i: -LENS[i])
                for k in range(4, len(ref_greedy[i].text) - 2)
                if "\ufffd" not in ref_greedy[i].text[k:k + 2]
                and ref_greedy[i].text.find(ref_greedy[i].text[k:k + 2]) == k)
    text = ref_greedy[i].text
    stop = [text[k:k + 2]]
    want = ar.generate(prompts[i], max_new_tokens=LENS[i], stop=stop)
    eng = Engine(target, KnownContinuation(refs), "dspine")
    j = (i + 1) % len(prompts)
    got = BatchEngine(eng, 8).generate_many([prompts[i], prompts[j]], max_new_tokens=[LENS[i], LENS[j]],
                                            stop=[stop, None])
    assert got[0].text == want.text == text[:k]
    assert got[0].token_ids == want.token_ids and got[0].finish_reason == "stop"
    assert got[0].stats.accepted_length_mean > 2.0  # the stop fell inside an accepted block
    assert got[1].token_ids == ref_greedy[j].token_ids


def test_sequential_fallback(target, prompts, ref_greedy, spec):
    be = BatchEngine(spec, 4)
    be.batched = False  # what non-attention (hybrid) targets get
    got = be.generate_many(prompts[:4], max_new_tokens=LENS[:4])
    assert [g.token_ids for g in got] == [r.token_ids for r in ref_greedy[:4]]
    assert be.cache_bytes() == 0


def test_max_running_guard(spec):
    with pytest.raises(EngineError, match="max_running"):
        BatchEngine(spec, 9)
    with pytest.raises(EngineError, match="max_running"):
        BatchEngine(spec, 0)


def test_invalid_request_does_not_join(spec):
    be = BatchEngine(spec, 2)
    with pytest.raises(EngineError):
        be.add([], None, 4)
    with pytest.raises(EngineError):
        be.add([5, 6], None, 10**6)
    assert be.free_slots == 2 and be.cache_bytes() == 0


@pytest.mark.parametrize("where", ["verification", "final-stage chain"])
@pytest.mark.parametrize("batched", [True, False])
def test_a_failing_request_leaves_the_others_unchanged(target, prompts, ref_greedy, spec, monkeypatch, batched,
                                                      where):
    """A request whose own part of a cycle raises (its verification, or its final-stage
    chain inside the batched drafter call) finishes with ``finish_reason == "error"``;
    the other requests of the same cycles keep the exact single-request outputs and
    every cache is freed. Before, one such request failed the whole batch."""
    import dspine.core.verify as verify_mod
    import dspine.proposers.drafter as draft_mod

    bad = {"gen": None, "calls": 0}
    real = verify_mod.verify if where == "verification" else draft_mod.chain

    def failing_for_one(*args, **kw):
        if args[-1] is bad["gen"]:  # both take the request's generator last among positional arguments
            bad["calls"] += 1
            if bad["calls"] >= 3:  # from its third cycle on: it has emitted a few tokens already
                raise RuntimeError(f"injected {where} failure")
        return real(*args, **kw)

    if where == "verification":
        monkeypatch.setattr(verify_mod, "verify", failing_for_one)  # behind verify_proposal
    else:
        monkeypatch.setattr(draft_mod, "chain", failing_for_one)
    be = BatchEngine(spec, 4)
    if not batched:
        be.batched = False  # the per-request fallback of non-attention targets
    reqs = [be.add(p, None, m) for p, m in zip(prompts[:4], LENS[:4])]
    victim = max(range(4), key=lambda i: LENS[i])
    bad["gen"] = reqs[victim].gen
    while be.running:
        ran = [r for r in be.running if r is not reqs[victim]]
        ncyc = {id(r): len(r.cycles) for r in ran}
        be.step()
        if not batched and reqs[victim].finish_reason == "error" and "checked" not in bad:
            bad["checked"] = True  # the failing step's summary counts only the cycles that ran
            new = [r.cycles[-1] for r in ran if len(r.cycles) > ncyc[id(r)]]
            assert be.last_cycle.draft_s == sum(c.draft_s for c in new)
            assert be.last_cycle.verify_s == sum(c.verify_s for c in new)
    assert batched or "checked" in bad
    assert bad["calls"] == (4 if batched and where != "verification" else 3)  # batched: failed, retried alone
    v = reqs[victim]
    assert v.finish_reason == "error" and f"injected {where} failure" in v.error
    assert 0 < len(v.out_ids) < LENS[victim] and v.out_ids == ref_greedy[victim].token_ids[:len(v.out_ids)]
    for i, r in enumerate(reqs):
        if i != victim:
            assert r.finish_reason != "error" and r.out_ids == ref_greedy[i].token_ids, i
    assert be.free_slots == 4 and be.cache_bytes() == 0


def test_retried_batched_draft_keeps_every_sampled_output(target, prompts, spec, monkeypatch):
    """A batched drafter call that fails part-way (here the final-stage chain of one
    request, once) is retried one request at a time from the generators' saved states,
    so every seeded sampled output still equals its single-request run."""
    import dspine.proposers.drafter as draft_mod

    samp = [SamplingConfig(temperature=0.8, seed=7 + i) for i in range(4)]
    single = [spec.generate(p, s, m).token_ids for p, s, m in zip(prompts[:4], samp, LENS[:4])]
    real, calls = draft_mod.chain, {"n": 0}

    def chain_failing_once(*args, **kw):
        calls["n"] += 1
        if calls["n"] == 6:  # inside a batched call, after other requests' chains drew
            raise RuntimeError("transient failure")
        return real(*args, **kw)

    monkeypatch.setattr(draft_mod, "chain", chain_failing_once)
    got = BatchEngine(spec, 4).generate_many(prompts[:4], samp, LENS[:4])
    assert calls["n"] > 6
    assert [g.finish_reason != "error" for g in got] == [True] * 4
    assert [g.token_ids for g in got] == single


def test_commit_many_equals_commit_per_request(target):
    """One context projection for the batch (``DrafterProposer.commit_many``) fills every
    request's draft context exactly as per-request commits do: same positions, ring
    order and K/V (to float rounding), with an empty commit and one beyond the window."""
    d = random_drafter(target, "dspine", seed=3)
    prop = DrafterProposer(d)
    F = d.fc.in_features
    g = torch.Generator().manual_seed(0)
    W = d.cfg.window
    plan = [(5, 0), (0, 7), (1, 12), (W + 9, 0)]  # (features, start position)
    feats = [torch.randn(n, F, generator=g) for n, _ in plan]
    one = [prop.new_state([1]) for _ in plan]
    many = [prop.new_state([1]) for _ in plan]
    for s, f, (_, p) in zip(one, feats, plan):
        prop.commit(s, f, p)
    prop.commit_many(many, feats, [p for _, p in plan])
    for s in one:  # commits are lazy: one projection per request here, one for all of them below
        s.flush()
    prop.flush_many(many)
    for a, b in zip(one, many):
        assert a.written == b.written
        if a.pos is None:
            assert b.pos is None
            continue
        assert torch.equal(a.pos, b.pos) and torch.equal(a.valid, b.valid)
        for x, y in zip(a.k + a.v, b.k + b.v):
            torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-5)
