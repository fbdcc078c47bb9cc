"""Capping inside an accepted block: EOS, stop strings, max_new_tokens (spec section 5),
the drafter's attention window, and the target context limit.

"No token past a stop is ever emitted or kept in any cache": besides the emitted ids we
check that the target cache and the draft context cache end holding exactly the prompt
and the emitted tokens except the last one (which is never fed to the target), as in
the plain ``ar`` loop.
"""
from __future__ import annotations

import pytest
import torch

from conftest import OracleProposer, ar_continuation, random_proposer, run_cycles
from dspine.config import SamplingConfig
from dspine.drafter.checkpoint import random_drafter
from dspine.proposers.base import Proposal
from dspine.proposers.drafter import DrafterProposer
from dspine.core.engine import Engine, EngineError

pytestmark = pytest.mark.usefixtures("one_thread")

TINY_PROMPT = [5, 17, 99, 3, 42, 7]
FOX = "The quick brown fox jumps over the lazy dog. The quick brown fox"


class OracleDrafter(DrafterProposer):
    """Runs the real (random) drafter and its draft context cache, but proposes the
    target's greedy continuation: full acceptance with real feature commits."""

    def __init__(self, drafter, oracle: OracleProposer):
        super().__init__(drafter)
        self.oracle = oracle

    def new_state(self, prompt_ids):
        st = super().new_state(prompt_ids)
        st.prompt_len = len(prompt_ids)
        return st

    def propose(self, state, anchor, anchor_pos, n, sampling, gen):
        prop = super().propose(state, anchor, anchor_pos, n, sampling, gen)
        toks = self.oracle.oracle_tokens(state, anchor_pos, n)
        return Proposal(torch.tensor(toks, dtype=torch.long), draft_s=prop.draft_s)


def assert_caches_consistent(req):
    """Target and draft caches hold prompt + emitted tokens minus the last, nothing more."""
    expect = len(req.prompt_ids) + len(req.out_ids) - 1
    assert req.cache.length == expect
    assert req.cache.seq_length() == expect
    st = req.draft_state
    if hasattr(st, "window"):  # DraftContextCache: exactly the last `window` committed positions
        st.flush()  # commits are projected lazily (when the drafter next drafts)
        valid = sorted(st.pos[st.valid].tolist())
        assert valid == list(range(max(0, expect - st.window), expect))


# -- EOS ---------------------------------------------------------------------------------------

def _eos_inside_block(cont, block_size):
    """A token whose first occurrence j is an accepted proposal (not the cycle's bonus)."""
    for j in range(2, len(cont) - 1):
        if j % block_size != 0 and cont[j] not in cont[:j]:
            return j
    raise AssertionError("no suitable token")


@pytest.mark.parametrize("block_size", [4, 8])
def test_eos_inside_accepted_block(tiny256, monkeypatch, block_size):
    t = tiny256
    cont = ar_continuation(t, TINY_PROMPT, 40)
    j = _eos_inside_block(cont, block_size)
    monkeypatch.setattr(t, "eos_token_ids", frozenset({cont[j]}))
    ar = Engine(t, None, "ar").generate(TINY_PROMPT, SamplingConfig(), 40)
    assert ar.token_ids == cont[: j + 1] and ar.finish_reason == "stop"
    oracle = OracleProposer(t, TINY_PROMPT, block_size, horizon=40)
    for prop in (oracle, OracleDrafter(random_drafter(t, "dspine", block_size), oracle)):
        eng = Engine(t, prop, "dspine")
        req = run_cycles(eng, TINY_PROMPT, max_new_tokens=40)
        assert req.out_ids == ar.token_ids
        assert req.finish_reason == "stop"
        # the EOS came inside a fully accepted block: that cycle emitted more than was kept
        assert sum(c.emitted for c in req.cycles) > len(req.out_ids) - 1
        assert_caches_consistent(req)
        res = eng.result(req)
        assert res.text == ar.text and res.token_ids[-1] == cont[j]


def test_eos_real_target(smol):
    """Real target, chat prompt that ends with EOS: spec modes stop at the same EOS."""
    ids = smol.encode_prompt("Name three primary colors.", chat=True)
    ar = Engine(smol, None, "ar").generate(ids, SamplingConfig(), 40)
    assert ar.finish_reason == "stop" and ar.token_ids[-1] in smol.eos_token_ids
    prop = OracleProposer(smol, ids, 8, horizon=40)
    res = Engine(smol, prop, "dspine").generate(ids, SamplingConfig(), 40)
    assert res.token_ids == ar.token_ids and res.text == ar.text and res.finish_reason == "stop"


# -- stop strings -------------------------------------------------------------------------------

def test_stop_string_inside_accepted_block(smol):
    ids = smol.encode_prompt(FOX)
    cont = ar_continuation(smol, ids, 40)
    tok = smol.tokenizer
    full = tok.decode(cont, skip_special_tokens=True)
    stop = "ver wa"  # spans ' clever' | ' way'
    # the token completing the stop string: the shortest prefix whose text contains it
    j = next(k for k in range(1, len(cont) + 1) if stop in tok.decode(cont[:k], skip_special_tokens=True)) - 1
    assert 0 < j % 8 < 7  # inside an accepted block of the oracle at B = 8 (not its bonus)
    ar = Engine(smol, None, "ar").generate(ids, SamplingConfig(), 40, stop=["zzz", stop])
    assert ar.token_ids == cont[: j + 1]
    assert ar.text == full[: full.find(stop)] and ar.text.endswith(" in a cle")
    assert ar.finish_reason == "stop"
    prop = OracleProposer(smol, ids, 8, horizon=40)
    eng = Engine(smol, prop, "dspine")
    req = run_cycles(eng, ids, max_new_tokens=40, stop=["zzz", stop])
    res = eng.result(req)
    assert res.token_ids == ar.token_ids and res.text == ar.text and res.finish_reason == "stop"
    assert sum(c.emitted for c in req.cycles) > len(req.out_ids) - 1  # tokens were cut
    assert_caches_consistent(req)
    # streaming: the deltas concatenate to the final text, never past the stop
    chunks = []
    res2 = Engine(smol, prop, "dspine").generate(ids, SamplingConfig(), 40, stop=[stop], on_text=chunks.append)
    assert "".join(chunks) == res2.text == ar.text


# -- max_new_tokens -------------------------------------------------------------------------------

@pytest.mark.parametrize("max_new", [1, 2, 5])
def test_max_new_tokens_inside_block(tiny256, monkeypatch, max_new):
    t = tiny256
    monkeypatch.setattr(t, "eos_token_ids", frozenset())
    cont = ar_continuation(t, TINY_PROMPT, 40)
    oracle = OracleProposer(t, TINY_PROMPT, 16, horizon=40)
    for prop in (oracle, OracleDrafter(random_drafter(t, "dspine", 16), oracle)):
        eng = Engine(t, prop, "dspine")
        req = run_cycles(eng, TINY_PROMPT, max_new_tokens=max_new)
        assert req.out_ids == cont[:max_new]
        assert req.finish_reason == "length"
        # one cycle verifying exactly max_new - 2 proposals (the prefill gave the first token)
        assert [c.n for c in req.cycles] == ([] if max_new == 1 else [max_new - 2])
        assert_caches_consistent(req)


def test_max_new_tokens_real_target(smol):
    ids = smol.encode_prompt(FOX)
    prop = OracleProposer(smol, ids, 16, horizon=40)
    res = Engine(smol, prop, "dspine").generate(ids, SamplingConfig(), 5)
    assert res.token_ids == ar_continuation(smol, ids, 40)[:5]
    assert res.stats.cycles == 1 and res.stats.verification_lengths == [3]
    assert res.finish_reason == "length"


# -- drafter window ---------------------------------------------------------------------------------

def test_prompt_longer_than_drafter_window(smol):
    text = ("In the beginning of the project, the engineers wrote a long specification that described "
            "every component of the system in detail, including the drafter, the verifier, the sampler, "
            "the caches and the command line interface, so that every later change could be checked against it.")
    ids = smol.encode_prompt(text)
    assert len(ids) > 3 * 16
    ref = ar_continuation(smol, ids, 40)[:16]
    eng = Engine(smol, random_proposer(smol, "dspine", 8, window=16), "dspine")
    req = run_cycles(eng, ids, max_new_tokens=16)
    assert req.out_ids == ref
    st = req.draft_state
    assert st.pos.shape[0] == 16  # the ring buffer never grew past the window
    assert_caches_consistent(req)


def test_window_ring_buffer_with_acceptance(tiny256, monkeypatch):
    """Oracle tokens through the real drafter with a window of 16 and blocks of 8: the
    draft context wraps many times while multi-token commits land in it."""
    t = tiny256
    monkeypatch.setattr(t, "eos_token_ids", frozenset())
    prompt = list(range(1, 41))  # 40 tokens > window
    oracle = OracleProposer(t, prompt, 8, horizon=64)
    eng = Engine(t, OracleDrafter(random_drafter(t, "dspine", 8, window=16), oracle), "dspine")
    req = run_cycles(eng, prompt, max_new_tokens=50)
    assert req.out_ids == ar_continuation(t, prompt, 64)[:50]
    assert [c.emitted for c in req.cycles][:-1] == [8] * (len(req.cycles) - 1)
    assert_caches_consistent(req)


# -- context limit and other refused requests ---------------------------------------------------------

def test_context_limit(smol, tiny256):
    n_ctx = smol.config.max_position_embeddings
    eng = Engine(smol, random_proposer(smol, "dspine", 8), "dspine")
    with pytest.raises(EngineError, match="context window"):
        eng.generate([1] * (n_ctx - 2), SamplingConfig(), 3)
    with pytest.raises(EngineError, match="context window"):
        Engine(smol, None, "ar").generate([1] * 10, SamplingConfig(), n_ctx)
    # the boundary itself is accepted (tiny target: 4096 positions)
    t = tiny256
    n_ctx = t.config.max_position_embeddings
    eng = Engine(t, random_proposer(t, "dspine", 4), "dspine")
    with pytest.raises(EngineError, match="context window"):
        eng.generate([1] * (n_ctx - 2), SamplingConfig(), 3)
    res = eng.generate([1] * (n_ctx - 3), SamplingConfig(), 3)
    assert len(res.token_ids) <= 3


def test_refused_requests(tiny256):
    eng = Engine(tiny256, random_proposer(tiny256, "dspine", 4), "dspine")
    with pytest.raises(EngineError, match="empty"):
        eng.generate([], SamplingConfig(), 4)
    with pytest.raises(EngineError, match="max_new_tokens"):
        eng.generate([1, 2], SamplingConfig(), 0)
    with pytest.raises(EngineError, match="vocabulary"):
        eng.generate([1, 256], SamplingConfig(), 4)
    with pytest.raises(EngineError, match="mode"):
        Engine(tiny256, None, "medusa")
    with pytest.raises(EngineError, match="drafter"):
        Engine(tiny256, None, "dspine")


def test_stop_checked_after_each_token_of_a_block(tiny256):
    """The plain loop checks the text after every token; a block emitted at once must
    stop at the same token even when only an intermediate text holds the stop string
    (here U+FFFD of a UTF-8 character split over two byte tokens: 'é' = C3 A9)."""
    eng = Engine(tiny256, None, "ar")

    def emit_after_a(stop, new):
        req = eng.start(TINY_PROMPT, SamplingConfig(), 10, stop)
        req.out_ids[:] = [65]  # 'A', whatever the first sampled token was
        req.finished, req.finish_reason = False, None
        eng.emit(req, new)
        return req

    one_by_one = emit_after_a(["\ufffd"], [0xC3])
    assert one_by_one.out_ids == [65, 0xC3] and one_by_one.finish_reason == "stop"
    block = emit_after_a(["\ufffd"], [0xC3, 0xA9, 66])  # 'é' completes in the same block
    assert block.out_ids == [65, 0xC3] and block.finish_reason == "stop"
    other = emit_after_a(["x"], [0xC3, 0xA9, 66])
    assert other.out_ids == [65, 0xC3, 0xA9, 66] and not other.finished
