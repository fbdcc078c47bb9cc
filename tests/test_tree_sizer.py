"""Per-cycle size of best-first draft trees (``--tree-size cost``, dspine.control.tree_sizer)."""
from __future__ import annotations

import math

import pytest
import torch

from conftest import ar_continuation, random_proposer
from dspine.build import default_drafter_path
from dspine.config import SamplingConfig
from dspine.drafter.checkpoint import load_drafter
from dspine.proposers.drafter import DrafterProposer
from dspine.core.engine import Engine
from dspine.control.cost_curve import CostCurve
from dspine.control.policy import CostModelPolicy
from dspine.trees import DraftTree, TreeSpec
from dspine.trees.build import dynamic_tree, graft
from dspine.control.tree_sizer import TreeSizer, prefix_tokens_expected

pytestmark = pytest.mark.usefixtures("one_thread")


def _tables(n=4, K=5, seed=0, scale=3.0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, K, K, generator=g) * scale, torch.randint(0, 1000, (n, K), generator=g)


def test_best_first_tree_carries_path_probabilities_and_every_prefix_is_a_tree():
    T, cand = _tables()
    tree = dynamic_tree(T, cand, 4, 12)
    p = tree.path_prob
    assert p is not None and p.shape == (12,) and bool((p[1:] <= p[:-1] + 1e-12).all())
    sm = torch.softmax(T.double(), -1)
    for i in range(tree.size):  # product of the softmax along the path (the candidate index chain)
        path, node = [], i
        while node >= 0:
            path.append(node)
            node = int(tree.parent[node])
        prob, j = 1.0, 0
        for d, nd in enumerate(reversed(path)):
            v = int((cand[d] == tree.tokens[nd]).nonzero()[0])
            prob *= float(sm[d, j, v])
            j = v
        assert math.isclose(prob, float(p[i]), rel_tol=1e-9)
    for m in range(1, tree.size + 1):
        sub = tree.prefix(m)
        assert sub.size == m and torch.equal(sub.tokens, tree.tokens[:m]) and torch.equal(sub.path_prob, p[:m])
    with pytest.raises(ValueError):
        tree.prefix(0)
    with pytest.raises(ValueError):
        tree.prefix(13)
    merged, added = graft(tree, [999, 998], merge=True)
    assert added == 2 and merged.path_prob.shape == (14,) and math.isnan(float(merged.path_prob[-1]))


def _tree(probs):
    n = len(probs)
    return DraftTree(torch.arange(n), torch.arange(-1, n - 1), torch.arange(1, n + 1),
                     path_prob=torch.tensor(probs, dtype=torch.float64))


def test_sizer_verifies_more_when_verification_is_cheap_and_less_when_it_is_dear():
    probs = [0.9, 0.8, 0.6, 0.4, 0.3, 0.2, 0.1, 0.05, 0.02, 0.01]
    flat = TreeSizer([0.1] * 16)  # a forward costs the same at any length: every node pays
    assert flat.choose(_tree(probs)) == 10
    steep = TreeSizer([0.1 * t for t in range(1, 17)])  # cost proportional to tokens
    m = steep.choose(_tree(probs))
    assert 1 <= m < 10
    e = prefix_tokens_expected(_tree(probs), steep)
    rates = [float(e[k - 1]) / steep.verify_cost(k + 1) for k in range(1, 11)]
    assert m == 1 + max(range(10), key=lambda k: rates[k])  # the argmax of expected tokens per second
    # drafting time already spent raises the worth of longer trees (rate = E / (D + V))
    assert steep.choose(_tree(probs), draft_s=5.0) >= m
    # beyond the measured curve: linear in the upper half's slope
    s = TreeSizer([1.0, 2.0, 3.0, 4.0])
    assert s.predicted_verify_s(6) == pytest.approx(6.0)
    assert TreeSizer([0.1] * 4).choose(DraftTree(torch.arange(3), torch.arange(-1, 2), torch.arange(1, 4))) == 3


def test_sizer_calibrates_on_what_verification_accepts():
    """Nodes the drafter rates 0.9 that the target never accepts stop being verified (a
    sizer that ignored its observations would keep choosing them)."""
    probs = [0.9, 0.88, 0.86, 0.84, 0.82, 0.8]
    curve = [0.1 + 0.02 * t for t in range(16)]
    sizer = TreeSizer(curve)
    before = sizer.choose(_tree(probs))
    for _ in range(200):
        sizer.observe(_tree(probs), [], 0.1)  # nothing accepted
    assert sizer.accept_prob(0.88) < 0.1 < TreeSizer(curve).accept_prob(0.88)
    assert sizer.choose(_tree(probs)) < before
    good = TreeSizer(curve)
    for _ in range(200):
        good.observe(_tree(probs), list(range(6)), 0.1)  # every node accepted
    assert good.accept_prob(0.88) > 0.9 and good.choose(_tree(probs)) == 6
    slow = TreeSizer(curve)
    for _ in range(50):
        slow.observe(_tree(probs), [], 10 * slow.predicted_verify_s(7))  # the machine is 10x slower now
    assert slow.verify_cost(7) == pytest.approx(10 * slow.predicted_verify_s(7), rel=1e-6)


def test_sizer_refuses_bad_settings():
    for bad in ([], [0.0], [float("nan")], [-1.0]):
        with pytest.raises(ValueError):
            TreeSizer(bad)
    with pytest.raises(ValueError, match="SpeculativeConfig.tree_size"):
        TreeSpec(8, size="huge")


@pytest.fixture(scope="module")
def dense256():
    from dspine.target.adapter import load_target
    t = load_target("random:llama", vocab_size=256, seed=0)
    t.set_runtime("dense")
    return t


def _cost_policy():
    return CostModelPolicy(CostCurve([0.01 * (1 + 0.1 * t) for t in range(16)], draft_s=0.001,
                                     final_per_row_s=0.0001))


def test_tree_size_cost_greedy_equals_ar_random_target(dense256):
    prompt = list(range(1, 30))
    ref = Engine(dense256, None, "ar").generate(prompt, SamplingConfig(), 40).token_ids
    spec = TreeSpec(24, size="cost")
    eng = Engine(dense256, random_proposer(dense256, "dspine", 8, seed=1), "dspine", verify_policy=_cost_policy(),
                 tree=spec)
    res = eng.generate(prompt, SamplingConfig(), 40)
    assert res.token_ids == ref
    assert eng.verify_policy.sizer is not None and eng.verify_policy.sizer.chosen
    assert res.stats.kernels["draft_tree"] == "tree(budget=24, shape=dynamic, size=cost)"
    # without the cost policy's curve the size stays fixed, and --json says so
    fixed = Engine(dense256, random_proposer(dense256, "dspine", 8, seed=1), "dspine", tree=spec)
    assert not fixed.verify_policy.sizes_trees and "needs --verify-policy cost" in fixed.tree_info()
    assert fixed.generate(prompt, SamplingConfig(), 40).token_ids == ref


def test_tree_size_cost_greedy_equals_ar_real_target_shipped_drafter(smol):
    prev = smol.runtime_name
    smol.set_runtime("dense")
    try:
        ids = smol.encode_prompt("Write a Python function that reverses a string.", chat=True)
        ref = ar_continuation(smol, ids, 40)
        drafter = load_drafter(default_drafter_path("smollm2-135m", "dspine"), smol)
        eng = Engine(smol, DrafterProposer(drafter), "dspine", verify_policy=_cost_policy(),
                     tree=TreeSpec(32, size="cost"))
        res = eng.generate(ids, SamplingConfig(), 40)
        assert res.token_ids == ref
        assert eng.verify_policy.sizer.chosen and max(res.stats.tree_nodes) <= 32
    finally:
        smol.set_runtime(prev)
