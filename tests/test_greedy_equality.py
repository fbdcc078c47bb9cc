"""Greedy losslessness: every mode emits exactly the target's own greedy token ids.

Real default target (SmolLM2-135M, float32) for the main checks; the tiny random
target for the mixed oracle/wrong proposer. Reference implementation beside ours:
``ar`` equals Hugging Face ``model.generate(do_sample=False)``.
"""
from __future__ import annotations

import math

import pytest
import torch

from conftest import (AlwaysWrongProposer, MixedProposer, OracleProposer, ar_continuation,
                      random_proposer, run_cycles)
from dspine.config import SamplingConfig
from dspine.core.engine import Engine

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPTS = {
    "chat_code": ("Write a Python function that reverses a string.", True),
    "chat_prose": ("Explain what a hash table is in one paragraph.", True),
    "raw_code": ('def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n', False),
}
M_RANDOM = 24  # tokens per random-drafter run (tau ~ 1: one target forward per token)
M_ORACLE = 40


def prompt_ids(target, key):
    text, chat = PROMPTS[key]
    return target.encode_prompt(text, chat=chat)


@pytest.mark.parametrize("key", ["chat_code", "raw_code"])
def test_ar_equals_hf_generate(smol, key):
    ids = prompt_ids(smol, key)
    ours = ar_continuation(smol, ids, M_ORACLE)[:M_RANDOM]  # Engine(smol, None, "ar") output
    inp = torch.tensor([ids])
    with torch.no_grad():
        out = smol.model.generate(inp, attention_mask=torch.ones_like(inp), do_sample=False,
                                  max_new_tokens=M_RANDOM, min_new_tokens=M_RANDOM,
                                  pad_token_id=smol.tokenizer.eos_token_id)
    assert out[0, len(ids):].tolist() == ours
    # these prompts do not reach EOS within M_ORACLE tokens (the oracle tests rely on it)
    assert not set(ar_continuation(smol, ids, M_ORACLE)) & smol.eos_token_ids


# every (mode, block size) once; prompts rotate so both modes see both prompts
RANDOM_GRID = [("dspine", 2, "chat_code"), ("dspine", 8, "raw_code"), ("dspine", 16, "chat_code"),
               ("dflash", 2, "raw_code"), ("dflash", 8, "chat_code"), ("dflash", 16, "raw_code")]


@pytest.mark.parametrize("mode,block_size,key", RANDOM_GRID)
def test_random_drafter_equals_ar(smol, mode, block_size, key):
    ids = prompt_ids(smol, key)
    ref = ar_continuation(smol, ids, M_ORACLE)[:M_RANDOM]
    eng = Engine(smol, random_proposer(smol, mode, block_size), mode)
    res = eng.generate(ids, SamplingConfig(), M_RANDOM)
    assert res.token_ids == ref
    assert res.mode == mode and res.finish_reason == "length"
    st = res.stats
    assert st.output_tokens == M_RANDOM
    # every cycle verified min(B-1, remaining-1) proposals and emitted >= 1 token
    assert all(0 <= n <= block_size - 1 for n in st.verification_lengths)
    assert st.verification_lengths[0] == min(block_size - 1, M_RANDOM - 2)
    assert 1.0 <= st.accepted_length_mean <= block_size
    assert abs(st.accepted_length_mean * st.cycles - (M_RANDOM - 1)) < 1e-9


@pytest.mark.parametrize("block_size,key", [(2, "chat_code"), (8, "chat_code"), (16, "chat_code"),
                                            (8, "raw_code"), (16, "chat_prose")])
def test_oracle_full_acceptance(smol, block_size, key):
    ids = prompt_ids(smol, key)
    ref = ar_continuation(smol, ids, M_ORACLE)
    prop = OracleProposer(smol, ids, block_size, horizon=M_ORACLE)
    req = run_cycles(Engine(smol, prop, "dspine"), ids, max_new_tokens=M_ORACLE)
    assert req.out_ids == ref
    emitted = [c.emitted for c in req.cycles]
    ns = [c.n for c in req.cycles]
    # the first token comes from prefill; every cycle but the last is a full block
    assert len(emitted) == math.ceil((M_ORACLE - 1) / block_size)
    assert emitted[:-1] == [block_size] * (len(emitted) - 1)
    assert ns[:-1] == [block_size - 1] * (len(ns) - 1)
    assert emitted[-1] == (M_ORACLE - 1) - block_size * (len(emitted) - 1)
    assert 1 <= emitted[-1] <= block_size
    assert ns[-1] == emitted[-1] - 1  # capped: all proposals accepted, plus the bonus
    res = Engine(smol, prop, "dspine").result(req)
    assert max(ns) == min(block_size - 1, M_ORACLE - 2)
    assert res.stats.accepted_per_position == [1.0] * max(ns)
    assert res.stats.accepted_length_mean == pytest.approx((M_ORACLE - 1) / len(emitted))


@pytest.mark.parametrize("block_size,key", [(2, "raw_code"), (16, "chat_prose")])
def test_always_wrong_tau_one(smol, block_size, key):
    ids = prompt_ids(smol, key)
    m = 16
    ref = ar_continuation(smol, ids, M_ORACLE)[:m]
    prop = AlwaysWrongProposer(smol, ids, block_size, horizon=M_ORACLE)
    res = Engine(smol, prop, "dspine").generate(ids, SamplingConfig(), m)
    assert res.token_ids == ref
    assert res.stats.cycles == m - 1
    assert res.stats.accepted_length_mean == 1.0
    assert set(res.stats.accepted_per_position) == {0.0}
    assert max(res.stats.verification_lengths) == min(block_size - 1, m - 2)


@pytest.mark.parametrize("block_size", [4, 8])
def test_mixed_proposer_tiny(tiny256, block_size):
    """Alternating accepted lengths 0..B-1 on the tiny target: ids equal ar, and every
    cycle accepts exactly the oracle part of its block."""
    t = tiny256
    ids = [5, 17, 99, 3, 42, 7]
    m = 60
    saved = t.eos_token_ids
    t.eos_token_ids = frozenset()  # EOS handling is test_stops' job
    try:
        ref = ar_continuation(t, ids, m + block_size)[:m]
        prop = MixedProposer(t, ids, block_size, horizon=m + block_size)
        req = run_cycles(Engine(t, prop, "dspine"), ids, max_new_tokens=m)
    finally:
        t.eos_token_ids = saved
    assert req.out_ids == ref
    assert len(req.cycles) >= block_size  # every accepted length 0..B-1 was exercised
    for c, rec in enumerate(req.cycles):
        good = c % block_size
        assert rec.emitted == min(good, rec.n) + 1, (c, rec)
    # the target cache holds exactly prompt + emitted tokens minus the unprocessed last one
    assert req.cache.length == len(ids) + len(req.out_ids) - 1
    assert req.cache.seq_length() == req.cache.length
