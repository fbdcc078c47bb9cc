"""Lazy draft-context commits (DraftContextCache.defer / flush): the drafter projects its
context only when it next drafts, in one call, and the result equals committing cycle by
cycle (the K/V of a position depends on its own features and position only)."""
from __future__ import annotations

import pytest
import torch
from conftest import random_proposer

from dspine.config import SamplingConfig
from dspine.core.engine import Engine
from dspine.control.base import Controller, FixedPolicy
from dspine.proposers import DraftContextCache

pytestmark = pytest.mark.usefixtures("one_thread")


def _features(prop, n: int, seed: int) -> torch.Tensor:
    F = prop.drafter.fc.weight.shape[1]  # F feature layers x the target's hidden size
    return torch.randn(n, F, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("mode", ["dspine", "dflash"])
def test_deferred_commits_equal_eager_ones(tiny256, mode):
    prop = random_proposer(tiny256, mode, 4)
    lazy = prop.new_state([1, 2, 3])
    eager = DraftContextCache(prop.cfg.num_layers, prop.cfg.window)  # no projector: append directly
    start = 0
    for i, n in enumerate([5, 1, 3, 1, 1, 2]):
        f = _features(prop, n, i)
        prop.commit(lazy, f, start)
        pos = torch.arange(start, start + n)
        eager.append(prop.drafter.context_kv(f[None], pos[None]), pos)
        start += n
    assert lazy.written == 0 and len(lazy.pending) == 6  # nothing projected yet
    (kv_l, pos_l, val_l), (kv_e, pos_e, val_e) = lazy.as_batch(), eager.as_batch()
    assert lazy.written == eager.written == start and not lazy.pending
    assert torch.equal(pos_l, pos_e) and torch.equal(val_l, val_e)
    for (kl, vl), (ke, ve) in zip(kv_l, kv_e):
        torch.testing.assert_close(kl, ke, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(vl, ve, rtol=1e-5, atol=1e-6)


def test_deferred_commits_keep_only_the_window(tiny256):
    prop = random_proposer(tiny256, "dspine", 4)
    W = prop.cfg.window
    s = prop.new_state([1])
    for i in range(3):
        prop.commit(s, _features(prop, W // 2 + 1, i), i * (W // 2 + 1))
    s.flush()
    total = 3 * (W // 2 + 1)
    assert s.written == W and sorted(s.pos[s.valid].tolist()) == list(range(total - W, total))


def test_copied_features_survive_a_reused_buffer(tiny256):
    prop = random_proposer(tiny256, "dspine", 4)
    s = prop.new_state([1])
    buf = _features(prop, 3, 0)
    want = buf.clone()
    prop.commit(s, buf, 0)
    buf.zero_()  # the target reuses its feature buffer on the next forward
    assert torch.equal(s.pending[0][0], want)


class _Every(Controller):
    """Verify n_max proposals every ``k``-th cycle, none otherwise."""

    name = "every"

    def __init__(self, k: int):
        self.k, self.calls = k, 0

    def __call__(self, req, n_max: int) -> int:
        self.calls += 1
        return n_max if self.calls % self.k == 0 else 0


def test_cycles_without_drafting_cost_no_drafter_work(tiny256, monkeypatch):
    prop = random_proposer(tiny256, "dspine", 4)
    calls = []
    real = prop.drafter.context_kv
    monkeypatch.setattr(prop.drafter, "context_kv", lambda f, p: calls.append(f.shape[1]) or real(f, p))
    eng = Engine(tiny256, prop, "dspine", verify_policy=FixedPolicy(0))
    ref = Engine(tiny256, None, "ar").generate([3, 4, 5, 6], SamplingConfig(), 12).token_ids
    assert eng.generate([3, 4, 5, 6], SamplingConfig(), 12).token_ids == ref
    assert calls == []  # plain target steps only: the drafter's context was never projected
    pol = _Every(4)
    eng = Engine(tiny256, prop, "dspine", verify_policy=pol)
    res = eng.generate([3, 4, 5, 6], SamplingConfig(), 12)
    assert res.token_ids == ref
    drafted = sum(1 for c in range(1, pol.calls + 1) if c % 4 == 0)
    assert 0 < len(calls) == drafted  # one projection per drafting cycle, however many positions waited
    assert calls[0] >= 4  # the prompt and the plain steps before it, in one call


def test_a_drafting_cycle_records_the_context_it_projected(tiny256, monkeypatch):
    """A drafting cycle's record says how many earlier positions it projected and how long
    that took (``context_rows`` / ``context_s``, part of ``draft_s``, which the cost policy
    charges to that cycle: ``benchmarks/cycle_sources.py`` reports it per group)."""
    prop = random_proposer(tiny256, "dspine", 4)
    calls = []
    real = prop.drafter.context_kv
    monkeypatch.setattr(prop.drafter, "context_kv", lambda f, p: calls.append(f.shape[1]) or real(f, p))
    cycles = []
    Engine(tiny256, prop, "dspine", verify_policy=_Every(4)).generate(
        [3, 4, 5, 6], SamplingConfig(), 12, on_cycle=lambda req: cycles.append(req.cycles[-1]))
    drafting = [c for c in cycles if c.n > 0]
    assert drafting and [c.context_rows for c in drafting] == calls  # each projected what waited
    assert all(0 < c.context_s <= c.draft_s for c in drafting)
    assert all(c.context_rows == 0 and c.context_s == 0.0 for c in cycles if c.n == 0)
