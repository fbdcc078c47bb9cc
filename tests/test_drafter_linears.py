"""The drafter's linears on Q8_0 blocks (dspine.tune.drafter, ``--drafter-linears``).

The drafter only proposes, so a q8 copy must leave every output the target's: greedy
equality with ``ar`` on the real target, and the exact sampled distribution on a tiny
target (chi-square) with a broken verifier as the negative control that must fail. The
copy rounds weights without touching the drafter it came from, and ``auto`` follows a
measurement.
"""
from __future__ import annotations

import pytest
import torch

from dspine.config import SpeculativeConfig
from dspine.drafter.checkpoint import random_drafter
from dspine.runtime import blockq as B
from dspine.runtime.blockq import BlockQLinear
from dspine.drafter.q8 import q8_round, quantize_drafter
from dspine.tune.drafter import plan_drafter_linears
from conftest import assert_greedy_equals_ar
from test_distribution import assert_exact_and_broken_verifier_fails, strong_bridge_drafter

pytestmark = pytest.mark.usefixtures("one_thread")


def _kernels_or_skip():
    if B.kernels(progress=False) is None:
        pytest.skip(f"the blockq kernels cannot be built here: {B.unavailable_reason()}")


def test_q8_copy_rounds_its_own_weights_and_leaves_the_drafter(tiny256):
    _kernels_or_skip()
    d = random_drafter(tiny256, mode="dspine", block_size=8, seed=1)
    before = {k: v.clone() for k, v in d.state_dict().items()}
    q = quantize_drafter(d)
    assert all(torch.equal(before[k], v) for k, v in d.state_dict().items())  # untouched
    assert isinstance(q.fc, BlockQLinear) and isinstance(q.layers[0].down, BlockQLinear)
    w = q.layers[0].gate.weight
    assert torch.equal(w, q8_round(d.layers[0].gate.weight)) and B.pack_q8(w) is not None
    assert q.head is d.head  # the target's head stays shared, not copied
    assert not torch.equal(w, d.layers[0].gate.weight)  # negative control: the rounding is real


def test_auto_follows_the_measurement_and_bad_values_are_refused(tiny256):
    _kernels_or_skip()
    d = random_drafter(tiny256, mode="dspine", block_size=8, seed=1)
    for fast, want in (("q8", True), ("float32", False)):
        got, choice = plan_drafter_linears(d, "auto", redo=True, progress=False,
                                           timer=lambda name, fn, r, cap: 1e-4 if name == fast else 1e-3)
        assert choice.chosen == fast and isinstance(got.fc, BlockQLinear) == want
    assert plan_drafter_linears(d, "float32")[0] is d
    with pytest.raises(ValueError, match="SpeculativeConfig.drafter_linears 'int4'"):
        plan_drafter_linears(d, "int4")
    with pytest.raises(ValueError, match="SpeculativeConfig.drafter_linears 'q8' cannot run here"):
        plan_drafter_linears(random_drafter(tiny256, mode="dspine", block_size=8, seed=1, dtype=torch.bfloat16), "q8")


def _q8_proposer(tiny):
    """The distribution tests' strong-bridge DSpine drafter (seed 3), its linears on Q8_0 blocks
    (messages of 32, so every linear packs and the block forward is the lean one in C++,
    :mod:`dspine.runtime.lean_drafter`, as the shipped drafter's)."""
    p = strong_bridge_drafter(tiny, 3, msg_dim=32, linears="q8")
    assert p.linears == "q8" and p.kernel_info()["drafter_linears"] == "q8"
    assert p.kernel_info()["drafter_forward"] == "lean"
    return p


@pytest.mark.slow  # the q8 drafter only proposes; its greedy test stays; the default suite stays under ~15 min on 2 cores
def test_q8_drafter_sampling_matches_target_and_a_broken_verifier_fails(tiny, monkeypatch):
    _kernels_or_skip()
    assert_exact_and_broken_verifier_fails(tiny, lambda: _q8_proposer(tiny), monkeypatch)


def test_q8_drafter_greedy_equals_ar_on_the_real_target():
    _kernels_or_skip()
    from dspine.build import build_engine

    target, eng = build_engine(SpeculativeConfig(target="smollm2-135m", drafter=None, mode="dspine",
                                                 verify_policy="fixed", proposer="drafter",
                                                 drafter_linears="q8", linear_backend="blockq",
                                                 tree_budget=0))
    assert eng.proposer.linears == "q8"
    assert_greedy_equals_ar(target, eng)
