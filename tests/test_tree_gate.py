"""Tree or chain by measured rate (dspine.control.tree_gate, 2026-12-03).

- with injected cycle times the gate drafts the kind with the higher tokens per second, keeps
  exploring the other one, follows a change, and keeps sources apart;
- on an engine (``--tree-size cost``) both kinds run, greedy output equals ``ar``;
- sampled output with the gate alternating trees and chains is the target's exact
  distribution (chi-square), and with both verifiers broken it is not (negative control).
"""
from __future__ import annotations

import math

import pytest

import dspine.core.verify
from conftest import random_proposer
from dspine.config import SamplingConfig
from dspine.core.engine import Engine
from dspine.control.base import FixedPolicy
from dspine.control.cost_curve import CostCurve
from dspine.control.policy import CostModelPolicy
from dspine.control.priced import PricedController
from dspine.target.adapter import load_target
from dspine.trees import TreeSpec
from dspine.control.tree_gate import TreeGate
from test_distribution import (ALPHA, N, N_NEG, PROMPT, SETTINGS, _verify_residual_is_p, chi2_pvalue,
                               exact_distribution, sample_counts, strong_bridge_drafter)
from test_trees import _broken_no_residual, tiny_dense  # noqa: F401 (a fixture)

pytestmark = pytest.mark.usefixtures("one_thread")


def _run(gate: TreeGate, cycles: int, rate: dict[bool, tuple[float, float]], source: str = "draft") -> list[bool]:
    """Let ``gate`` decide ``cycles`` times; each kind's cycle emits/takes ``rate[kind]``."""
    out = []
    for _ in range(cycles):
        tree = gate.choose(source)
        tokens, seconds = rate[tree]
        gate.observe(source, tree, tokens, seconds)
        out.append(tree)
    return out


def test_gate_drafts_the_faster_kind_and_keeps_exploring():
    gate = TreeGate(half_life=8.0, warmup=2, explore_every=4)
    slow_trees = {True: (2.0, 0.020), False: (1.5, 0.010)}  # trees 100 tok/s, chains 150
    got = _run(gate, 40, slow_trees)
    assert got[:2] == [True, True] and got[2:4] == [False, False]  # warm-up: each kind first
    late = got[8:]
    assert sum(late) == len(late) // 4  # chains, but every 4th decision a tree
    assert gate.rate("draft", "chain") > gate.rate("draft", "tree")
    fast_trees = {True: (3.0, 0.012), False: (1.5, 0.010)}  # the machine changes: trees 250 tok/s
    late = _run(gate, 60, fast_trees)[-20:]
    assert sum(late) == 15  # trees now, every 4th decision a chain
    # sources are kept apart: a copy source starts its own warm-up
    assert _run(gate, 2, slow_trees, source="ngram") == [True, True]
    d = gate.describe()
    assert set(d["tokens_per_second"]) == {"draft", "ngram"} and d["tree_cycles"] + d["chain_cycles"] == 102


def test_gate_ignores_bad_times_and_refuses_bad_settings():
    gate = TreeGate()
    for bad in (0.0, -1.0, math.nan, math.inf):
        gate.observe("draft", True, 3, bad)
    assert gate.rate("draft", "tree") == 0.0 and gate.trees == 0
    for kw in (dict(half_life=0.0), dict(warmup=-1), dict(explore_every=-1)):
        with pytest.raises(ValueError):
            TreeGate(**kw)


def _cost_policy():
    return CostModelPolicy(CostCurve([0.01 * (1 + 0.1 * t) for t in range(16)], draft_s=0.001,
                                     final_per_row_s=0.0001))


def test_engine_with_the_gate_runs_both_kinds_and_greedy_equals_ar():
    t = load_target("random:llama", vocab_size=256, seed=0)
    t.set_runtime("dense")
    prompt = list(range(1, 30))
    ref = Engine(t, None, "ar").generate(prompt, SamplingConfig(), 48).token_ids
    eng = Engine(t, random_proposer(t, "dspine", 8, seed=1), "dspine", verify_policy=_cost_policy(),
                 tree=TreeSpec(24, size="cost"))
    ctl = eng.verify_policy  # the controller owns the gate (control/priced.py)
    assert ctl.gate is not None and ctl.sizes_trees
    ctl.gate = TreeGate(warmup=0, explore_every=2)  # alternate: both kinds every other cycle
    res = eng.generate(prompt, SamplingConfig(), 48)
    assert res.token_ids == ref
    assert ctl.gate.trees > 0 and ctl.gate.chains > 0
    assert "tree_gate" in res.stats.kernels
    # --tree-size fixed: every drafting cycle a tree, no gate
    fixed = Engine(t, random_proposer(t, "dspine", 8, seed=1), "dspine", verify_policy=_cost_policy(),
                   tree=TreeSpec(24, size="fixed"))
    assert fixed.verify_policy.gate is None and not fixed.verify_policy.sizes_trees


class _GatedFixed(FixedPolicy):
    """Fixed lengths; trees and chains alternate per drafting cycle through a TreeGate
    (the gate part of a priced controller, without its cost curve)."""

    def __init__(self):
        super().__init__()
        self.gate = TreeGate(warmup=0, explore_every=2)

    draft_tree = PricedController.draft_tree
    observe_cycle = PricedController.observe_cycle


def _gated_engine(tiny_dense):
    """Static trees (3 siblings, 2 children each) or chains, alternating per drafting cycle
    (the engine consults any gate it holds; the cost policy would mostly take plain steps
    on this tiny target)."""
    return Engine(tiny_dense, strong_bridge_drafter(tiny_dense, seed=3), "dspine", verify_policy=_GatedFixed(),
                  tree=TreeSpec(10, (3, 2)))


def test_gated_sampling_matches_target(tiny_dense):
    eng = _gated_engine(tiny_dense)
    P = exact_distribution(tiny_dense, PROMPT, SETTINGS["t1.0"])
    counts = sample_counts(eng, SETTINGS["t1.0"], N, tiny_dense.vocab_size)
    assert chi2_pvalue(counts, P) > ALPHA
    gate = eng.verify_policy.gate
    assert gate.trees > N // 10 and gate.chains > N // 10  # both kinds were sampled


def test_gated_sampling_negative_control_fails(tiny_dense, monkeypatch):
    monkeypatch.setattr(dspine.core.verify, "verify_tree", _broken_no_residual)
    monkeypatch.setattr(dspine.core.verify, "verify", _verify_residual_is_p)
    eng = _gated_engine(tiny_dense)
    P = exact_distribution(tiny_dense, PROMPT, SETTINGS["t1.0"])
    counts = sample_counts(eng, SETTINGS["t1.0"], N_NEG, tiny_dense.vocab_size)
    assert chi2_pvalue(counts, P) < ALPHA
