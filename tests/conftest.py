"""Shared fixtures and helper proposers for the runtime tests.

Fixtures:
    smol     -- the real default target (SmolLM2-135M, float32), loaded once per test run.
    tiny     -- a seeded random:llama target (vocab 8, hidden 64, 4 layers) whose
                next-token distributions are far from uniform; EOS switched off so
                every output has the requested length (distribution tests).
    tiny256  -- a seeded random:llama target with the default byte vocabulary (256).
    one_thread -- runs a test with ``torch.set_num_threads(1)`` and restores the previous
                value afterwards. Our modules opt in with ``pytestmark``; it is *not*
                autouse. On this 2-core machine, shared with other jobs, two OpenMP
                threads per process make small matmuls 10-25x slower (spin contention).
    one_thread_module -- the same for a whole module (module-scoped fixtures included).

Helper proposers (all subclasses of :class:`dspine.drafter.checkpoint.Proposer`):
    OracleProposer       -- proposes the target's own greedy continuation (from a plain
                            ``Engine(target, None, "ar")`` run), q = point mass.
    AlwaysWrongProposer  -- proposes ``(oracle + 1) % V``: never the target's argmax.
    MixedProposer        -- per cycle c: the first ``c % block_size`` proposals are the
                            oracle's, the rest wrong; records what it proposed.
"""
from __future__ import annotations

import contextlib
import os

# measured choices (dspine.tune) stay in memory during tests: no test reads a cache that an
# earlier run or another machine wrote, and none writes to the user's $DSPINE_HOME/tune
os.environ.setdefault("DSPINE_TUNE", "off")

import pytest
import torch

from dspine.config import SamplingConfig
from dspine.drafter.checkpoint import random_drafter
from dspine.proposers.base import Proposal, Proposer
from dspine.proposers.drafter import DrafterProposer
from dspine.core.engine import Engine
from dspine.target.adapter import load_target

# -- targets -------------------------------------------------------------------------------

TINY_VOCAB = 8
TINY_SEED = 0


@contextlib.contextmanager
def _single_thread():
    prev = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(prev)


@pytest.fixture
def one_thread():
    with _single_thread():
        yield


@pytest.fixture(scope="module")
def one_thread_module():
    """``one_thread`` for a whole module, its module-scoped fixtures included."""
    with _single_thread():
        yield


@pytest.fixture(scope="session")
def smol():
    """The real default target (float32), loaded once."""
    return load_target("smollm2-135m", dtype="float32")


@pytest.fixture
def smol_lean(smol):
    """The real target on the dense runtime with blockq linears, decoding on the lean path
    (restored afterwards); skipped where the blockq kernels cannot be built."""
    from dspine.runtime import blockq
    from dspine.runtime.packed import apply_linear_backend

    if blockq.kernels(progress=False) is None:
        pytest.skip(f"the blockq kernels cannot be built here: {blockq.unavailable_reason()}")
    smol.set_runtime("dense")
    apply_linear_backend(smol, "blockq", progress=False)
    try:
        assert smol.runtime.decode_path == "lean"
        yield smol
    finally:
        apply_linear_backend(smol, "aten", progress=False)
        smol.set_runtime("hf")


@pytest.fixture(scope="session")
def tiny():
    """random:llama, vocab 8, EOS off (every sampled sequence has the full length)."""
    t = load_target("random:llama", vocab_size=TINY_VOCAB, seed=TINY_SEED)
    t.eos_token_ids = frozenset()
    return t


@pytest.fixture(scope="session")
def tiny256():
    """random:llama with the byte vocabulary (256), EOS = 0 as shipped."""
    return load_target("random:llama", vocab_size=256, seed=1)


# -- greedy continuations ------------------------------------------------------------------

_AR_CACHE: dict = {}


def ar_continuation(target, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """Greedy continuation of ``prompt_ids`` by the plain ``ar`` engine (EOS ignored).

    Cached per (target, prompt, length). EOS is switched off for the run so the
    continuation always has ``max_new_tokens`` tokens (an oracle must be able to
    propose past an EOS when a test moves the EOS id).
    """
    key = (id(target), tuple(prompt_ids), max_new_tokens)
    if key not in _AR_CACHE:
        saved = target.eos_token_ids
        target.eos_token_ids = frozenset()
        try:
            res = Engine(target, None, "ar").generate(list(prompt_ids), SamplingConfig(), max_new_tokens)
        finally:
            target.eos_token_ids = saved
        assert len(res.token_ids) == max_new_tokens
        _AR_CACHE[key] = res.token_ids
    return _AR_CACHE[key]


def assert_greedy_equals_ar(target, eng, tokens: int = 40) -> None:
    """``eng``'s greedy output equals the plain ``ar`` loop's on a code and a chat prompt, and
    it accepted drafted tokens (τ > 1: the proposal path really ran)."""
    ar = Engine(target, None, "ar")
    for prompt, chat in (("def fibonacci(n):", False), ("Name three prime numbers.", True)):
        ids = target.encode_prompt(prompt, chat=chat)
        want = ar.generate(ids, SamplingConfig(), tokens).token_ids
        got = eng.generate(ids, SamplingConfig(), tokens)
        assert got.token_ids == want and got.stats.accepted_length_mean > 1.0


class _State:
    def __init__(self, prompt_ids):
        self.prompt_len = len(prompt_ids)
        self.cycles = 0
        self.proposed: list[list[int]] = []


class OracleProposer(Proposer):
    """Proposes the target's greedy continuation (computed once with the ``ar`` engine).

    The proposal for the block after the anchor at absolute position ``pos`` is
    ``cont[pos - P + 1 : pos - P + 1 + n]`` where P is the prompt length (the anchor is
    output token ``pos - P``). Past the precomputed continuation it proposes token 0.
    With sampling, q is a point mass on the proposal (a valid q: the proposal is a
    deterministic function of the past).
    """

    def __init__(self, target, prompt_ids: list[int], block_size: int, horizon: int = 64):
        self.target = target
        self.block_size = block_size
        self.vocab = target.vocab_size
        self.prompt = list(prompt_ids)
        self.cont = ar_continuation(target, self.prompt, horizon)

    def new_state(self, prompt_ids):
        assert list(prompt_ids) == self.prompt, "oracle built for another prompt"
        return _State(prompt_ids)

    def oracle_tokens(self, state, anchor_pos: int, n: int) -> list[int]:
        k = anchor_pos - state.prompt_len + 1
        return [self.cont[j] if j < len(self.cont) else 0 for j in range(k, k + n)]

    def tokens(self, state, anchor_pos: int, n: int) -> list[int]:
        return self.oracle_tokens(state, anchor_pos, n)

    def propose(self, state, anchor, anchor_pos, n, sampling, gen):
        toks = self.tokens(state, anchor_pos, n)
        state.cycles += 1
        state.proposed.append(toks)
        t = torch.tensor(toks, dtype=torch.long)
        if sampling.greedy:
            return Proposal(t)
        return Proposal(t, t[:, None].clone(), torch.ones(n, 1, dtype=torch.float64))


class AlwaysWrongProposer(OracleProposer):
    """Proposes ``(oracle + 1) % V``: never the target's greedy token."""

    def tokens(self, state, anchor_pos, n):
        return [(t + 1) % self.vocab for t in self.oracle_tokens(state, anchor_pos, n)]


class MixedProposer(OracleProposer):
    """Cycle c proposes ``c % block_size`` oracle tokens, then wrong ones."""

    def tokens(self, state, anchor_pos, n):
        good = state.cycles % self.block_size
        ora = self.oracle_tokens(state, anchor_pos, n)
        return [t if i < good else (t + 1) % self.vocab for i, t in enumerate(ora)]


class KnownContinuation(Proposer):
    """Proposes a known continuation of each prompt (``refs``: prompt ids tuple -> the ids
    that follow, e.g. the target's greedy output), reading it by absolute position; past
    its end it proposes token 1. ``wrong(cycle, anchor_pos, n)`` names the proposal index
    to corrupt (``(t + 1) % vocab``) in a cycle: ``None`` keeps it, ``"all"`` corrupts every
    proposal. ``needs_features``: the engine captures the target's layer 0 for it (as a
    drafter's features are captured, then ignored) or nothing."""

    feature_layers = [0]

    def __init__(self, refs: dict[tuple, list[int]], block_size: int = 16, vocab: int = 256, wrong=None,
                 needs_features: bool = True):
        self.refs, self.block_size, self.vocab, self.wrong = refs, block_size, vocab, wrong
        self.needs_features = needs_features
        self.cycles = 0

    def new_state(self, prompt_ids):
        return list(prompt_ids) + list(self.refs[tuple(prompt_ids)])

    def propose(self, state, anchor, anchor_pos, n, sampling, gen):
        toks = [state[anchor_pos + 1 + i] if anchor_pos + 1 + i < len(state) else 1 for i in range(n)]
        bad = self.wrong(self.cycles, anchor_pos, n) if self.wrong else None
        self.cycles += 1
        if bad == "all":
            toks = [(t + 1) % self.vocab for t in toks]
        elif bad is not None and bad < n:
            toks[bad] = (toks[bad] + 1) % self.vocab or 1
        return Proposal(torch.tensor(toks, dtype=torch.long))


def random_proposer(target, mode: str, block_size: int, **overrides) -> DrafterProposer:
    """The untrained (seeded) DSpine / DFlash-style drafter for ``target``."""
    return DrafterProposer(random_drafter(target, mode=mode, block_size=block_size, **overrides))


def run_cycles(engine: Engine, prompt_ids, sampling=None, max_new_tokens=32, stop=None):
    """Drive ``engine`` with start/step; returns the finished Request (cycle records kept)."""
    req = engine.start(list(prompt_ids), sampling or SamplingConfig(), max_new_tokens, stop)
    while not req.finished:
        engine.step(req)
    return req


def load_script(relpath: str):
    """A repository script that is not a package module (``benchmarks/x.py``, ``scripts/y.py``)
    imported by path, for tests of its functions."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / relpath
    spec = importlib.util.spec_from_file_location(path.stem, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod
