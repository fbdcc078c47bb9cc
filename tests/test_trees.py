"""Draft trees: construction, the tree forward, verification, exactness.

Exactness is proven the way the chain's is (``tests/test_distribution.py``, ``tests/
test_greedy_equality.py``): greedy output equal to ``ar`` on the real target and on random
targets; sampled output compared by chi-square with the enumerated target distribution,
both for the tree verifier alone (one node with three siblings drawn without
replacement) and for the whole engine on the tiny random target; broken verifiers
(siblings accepted independently against p, residual not updated between siblings, q of
the first draw used for later siblings) are negative controls that must be rejected.
"""
from __future__ import annotations

import itertools
import math
from dataclasses import replace

import numpy as np
import pytest
import torch

import dspine.core.verify
from conftest import ar_continuation, random_proposer
from dspine.build import default_drafter_path
from dspine.config import SamplingConfig
from dspine.drafter.checkpoint import load_drafter
from dspine.proposers.drafter import DrafterProposer
from dspine.core.engine import Engine
from dspine.drafter.final_stage import chain
from dspine.proposers.copy_or_draft import HybridProposer
from dspine.core.sampling import filter_probs, make_generator, sample_index, uniform
from dspine.target.adapter import load_target
from dspine.trees import DraftTree, TreeSpec, parse_tree_shape
from dspine.trees.build import dynamic_tree, graft, static_tree
from dspine.trees.verify import TreeVerdict, verify_tree, verify_tree_greedy, verify_tree_sampling
from dspine.core.verify import verify_sampling
from test_distribution import (ALPHA, GEN_LEN, PROMPT, SETTINGS, chi2_pvalue, exact_distribution,
                               sample_counts, strong_bridge_drafter)

pytestmark = pytest.mark.usefixtures("one_thread")


def _tables(n=4, K=5, seed=0, scale=3.0):
    g = torch.Generator().manual_seed(seed)
    T = torch.randn(n, K, K, generator=g) * scale
    T[0] = T[0, 0]  # position 1 conditions on the anchor: every predecessor row equal
    cand = torch.stack([torch.randperm(50, generator=g)[:K] for _ in range(n)])
    return T, cand


# -- the tree structure ---------------------------------------------------------------------------

def test_tree_structure_and_mask():
    #        root
    #       /    \
    #      0      1
    #     / \      \
    #    2   3      4
    t = DraftTree(torch.tensor([10, 11, 12, 13, 14]), torch.tensor([-1, -1, 0, 0, 1]),
                  torch.tensor([1, 1, 2, 2, 2]))
    assert t.size == 5 and t.max_depth == 2
    assert t.children(-1) == [0, 1] and t.children(0) == [2, 3] and t.children(1) == [4]
    m = t.attention_mask()
    assert m.shape == (6, 6)
    assert m[3].tolist() == [True, True, False, True, False, False]  # node 2: root, node 0, itself
    assert m[5].tolist() == [True, False, True, False, False, True]  # node 4: root, node 1, itself
    assert t.positions().tolist() == [0, 1, 1, 2, 2, 2]


def test_tree_refuses_bad_structure():
    with pytest.raises(ValueError, match="parents must precede"):
        DraftTree(torch.tensor([1, 2]), torch.tensor([1, -1]), torch.tensor([2, 1]))
    with pytest.raises(ValueError, match="depth"):
        DraftTree(torch.tensor([1, 2]), torch.tensor([-1, 0]), torch.tensor([1, 1]))


def test_malformed_trees_and_inputs_are_refused():
    with pytest.raises(ValueError, match="3 tokens but 1 parents"):
        DraftTree(torch.tensor([1, 2, 3]), torch.tensor([-1]), torch.tensor([1]))
    with pytest.raises(ValueError, match="1-D int64"):
        DraftTree(torch.tensor([[1]]), torch.tensor([-1]), torch.tensor([1]))
    with pytest.raises(ValueError, match="come together"):
        DraftTree(torch.tensor([1]), torch.tensor([-1]), torch.tensor([1]), q_ids=torch.zeros(1, 2, dtype=torch.long))
    with pytest.raises(ValueError, match=r"must both be \[2, K\]"):
        DraftTree(torch.tensor([1, 2]), torch.tensor([-1, 0]), torch.tensor([1, 2]),
                  torch.zeros(5, 2, dtype=torch.long), torch.zeros(5, 2, dtype=torch.float64))
    t = DraftTree.chain(torch.tensor([1, 2]))
    with pytest.raises(ValueError, match=r"logits \[3, V\]"):
        verify_tree_greedy(t, torch.zeros(2, 8))
    T, cand = _tables(n=2, K=3, seed=0)
    s = static_tree(T, cand, 2, (2,), 4, SamplingConfig(temperature=1.0), make_generator(0))
    with pytest.raises(ValueError, match="merge=False"):
        graft(s, [1, 2], merge=True)
    for bad in ((-2,), (0,), None, ()):
        with pytest.raises(ValueError, match="widths"):
            static_tree(T, cand, 2, bad, 4, SamplingConfig(), None)
    with pytest.raises(ValueError, match="integer"):
        dynamic_tree(T, cand, 2, 2.5)


def test_tree_settings_refused_with_names():
    assert parse_tree_shape("dynamic") is None and parse_tree_shape("4,2,1") == (4, 2, 1)
    for bad in ("4,0", "", "x", "4,-1"):
        with pytest.raises(ValueError, match="SpeculativeConfig.tree_shape"):
            parse_tree_shape(bad)
    for bad in (-1, 257, True, 2.5, "4"):
        with pytest.raises(ValueError, match="SpeculativeConfig.tree_budget"):
            TreeSpec(bad)
    for bad in ((0,), (-1,), ()):
        with pytest.raises(ValueError, match="SpeculativeConfig.tree_shape"):
            TreeSpec(4, bad)
    for bad in ("1_0", "\u0663", "4,,2"):
        with pytest.raises(ValueError, match="SpeculativeConfig.tree_shape"):
            parse_tree_shape(bad)
    assert not TreeSpec(0).enabled and TreeSpec(3).describe() == "tree(budget=3, shape=dynamic)"
    # cost sizing cuts best-first trees only: a static shape says it is verified whole
    assert TreeSpec(3, size="cost").describe() == "tree(budget=3, shape=dynamic, size=cost)"
    assert "size=fixed: a static shape" in TreeSpec(7, shape=(4, 2, 1), size="cost").describe()


# -- construction ---------------------------------------------------------------------------------

def test_static_greedy_tree_has_the_widths_and_top_candidates():
    T, cand = _tables()
    t = static_tree(T, cand, 4, (3, 2), 100, SamplingConfig(), None)
    assert [len(t.children(-1))] == [3]
    assert all(len(t.children(c)) == 2 for c in t.children(-1))
    assert t.size == 3 + 6 + 6 + 6 and t.max_depth == 4
    assert t.tokens[t.children(-1)].tolist() == cand[0, torch.topk(T[0, 0], 3).indices].tolist()
    small = static_tree(T, cand, 4, (3, 2), 7, SamplingConfig(), None)  # budget cuts breadth first
    assert small.size == 7 and small.max_depth == 2
    assert static_tree(T, cand, 2, (3, 2), 100, SamplingConfig(), None).max_depth == 2


def test_dynamic_tree_is_the_most_probable_paths():
    T, cand = _tables(n=3, K=4, seed=1, scale=2.0)
    logp = torch.log_softmax(T.double(), -1)
    # every path (j1, j2, j3) of candidate indices; a prefix's probability >= its extensions'
    paths = {}
    for d in (1, 2, 3):
        for js in itertools.product(range(4), repeat=d):
            s, prev = 0.0, 0
            for i, j in enumerate(js):
                s += float(logp[i, prev, j])
                prev = j
            paths[js] = s
    for budget in (1, 5, 12):
        t = dynamic_tree(T, cand, 3, budget)
        assert t.size == budget
        best = sorted(paths.values(), reverse=True)[:budget]
        # reconstruct each node's path score from the tree
        got = []
        idx_of = {}
        for i in range(t.size):
            p = int(t.parent[i])
            d = int(t.depth[i])
            j = int((cand[d - 1] == t.tokens[i]).nonzero()[0])
            prefix = () if p < 0 else idx_of[p]
            idx_of[i] = prefix + (j,)
            got.append(paths[idx_of[i]])
        assert sorted(got, reverse=True) == pytest.approx(best)


def test_sampled_widths_one_reproduce_the_chain():
    T, cand = _tables(n=6, K=5, seed=2)
    cfg = SamplingConfig(temperature=0.9, top_k=4)
    for seed in range(20):
        g1, g2 = make_generator(seed), make_generator(seed)
        ch = chain(T, cand, 6, cfg, g1)
        t = static_tree(T, cand, 6, (1,), 100, cfg, g2)
        assert t.tokens.tolist() == ch.tokens.tolist()
        assert torch.equal(t.q_probs, ch.q_probs) and torch.equal(t.q_ids, ch.q_ids)
        assert uniform(g1) == uniform(g2)  # the same number of draws


def test_sampled_siblings_are_drawn_without_replacement_with_their_q():
    T, cand = _tables(n=2, K=5, seed=3, scale=1.0)
    cfg = SamplingConfig(temperature=1.0)
    t = static_tree(T, cand, 1, (4,), 100, cfg, make_generator(0))
    kids = t.children(-1)
    assert len(kids) == 4 and len(set(t.tokens[kids].tolist())) == 4
    q = filter_probs(T[0, 0], cfg)
    for k, c in enumerate(kids):
        earlier = [int((cand[0] == t.tokens[e]).nonzero()[0]) for e in kids[:k]]
        want = q.clone()
        want[earlier] = 0
        assert torch.allclose(t.q_probs[c], want / want.sum(), atol=1e-15)
    few = static_tree(T, cand, 1, (4,), 100, SamplingConfig(temperature=1.0, top_k=2), make_generator(0))
    assert few.size == 2  # only two candidates have mass after top-k 2


# -- verification ---------------------------------------------------------------------------------

def test_greedy_verification_takes_the_longest_argmax_path():
    t = DraftTree(torch.tensor([3, 4, 5, 6]), torch.tensor([-1, -1, 1, 1]), torch.tensor([1, 1, 2, 2]))
    logits = torch.full((5, 8), -5.0)
    for row, tok in ((0, 4), (2, 6), (4, 1)):  # root -> 4 (node 1) -> 6 (node 3) -> bonus 1
        logits[row, tok] = 5.0
    v = verify_tree_greedy(t, logits)
    assert v.path == [1, 3] and v.token == 1 and v.accepted == 2
    logits[2] = -5.0
    logits[2, 7] = 5.0  # node 1's target token is in no child: the correction
    assert verify_tree_greedy(t, logits) == TreeVerdict([1], 7)


def test_sampled_tree_verifier_on_a_chain_equals_the_chain_verifier():
    T, cand = _tables(n=5, K=5, seed=4, scale=1.5)
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(9)) * 2
    logits[:5, cand[:, 0]] += 3.0  # some acceptances
    cfg = SamplingConfig(temperature=1.0, top_p=0.95)
    for seed in range(40):
        ch = chain(T, cand, 5, cfg, make_generator(seed))
        tree = DraftTree.chain(ch.tokens, ch.q_ids, ch.q_probs)
        g1, g2 = make_generator(1000 + seed), make_generator(1000 + seed)
        a = verify_sampling(ch.tokens, ch.q_probs, ch.q_ids, logits, cfg, g1)
        b = verify_tree_sampling(tree, logits, cfg, g2)
        assert (a.accepted, a.token) == (b.accepted, b.token)
        assert b.path == list(range(b.accepted))


def test_sampled_verification_needs_q():
    t = DraftTree.chain(torch.tensor([1, 2]))
    with pytest.raises(ValueError, match="distribution q"):
        verify_tree_sampling(t, torch.zeros(3, 4), SamplingConfig(temperature=1.0), make_generator(0))


# one node with three siblings drawn without replacement: the emitted first token must be
# distributed as p (the target row), however q differs from p
V1, N1 = 6, 8000


def _one_node_case():
    p_logits = torch.tensor([2.0, 1.5, 0.2, -0.5, 1.0, -2.0])
    q_row = torch.tensor([0.1, 2.5, 1.8, 1.0, -1.0])  # drafter scores over the K=5 candidates
    cand = torch.tensor([[4, 1, 2, 3, 0]])  # candidate ids (token 5 is never proposed)
    return p_logits, q_row, cand


def _first_token_counts(verifier, n=N1, copy: int | None = None) -> tuple[np.ndarray, np.ndarray, int]:
    """Counts of the first emitted token over ``n`` seeds; ``copy``: a copied token grafted
    in front of the three drawn siblings (a point mass, examined first)."""
    p_logits, q_row, cand = _one_node_case()
    cfg = SamplingConfig(temperature=1.0)
    T = q_row.expand(1, 5, 5).clone()
    logits = torch.stack([p_logits] + [torch.zeros(V1)] * 4)  # rows of the children: unused here
    counts = np.zeros(V1, dtype=np.int64)
    second = 0
    for s in range(n):
        g = make_generator(s)
        tree = static_tree(T, cand, 1, (3,), 10, cfg, g)
        if copy is not None:
            tree = graft(tree, [copy], merge=False)[0]
        v = verifier(tree, logits[: tree.size + 1], cfg, g)
        first = int(tree.tokens[v.path[0]]) if v.path else v.token
        second += int(bool(v.path) and v.path[0] > 0)
        counts[first] += 1
    P = filter_probs(p_logits, cfg).numpy()
    return counts, P, second


def _broken_independent(tree, logits, cfg, gen):
    """BROKEN: each sibling is accepted with min(1, p/q_k) against the *original* p."""
    p = filter_probs(logits[0], cfg)
    for c in tree.children(-1):
        y = int(tree.tokens[c])
        qy = float(tree.q_probs[c][(tree.q_ids[c] == y).nonzero()[0]])
        if uniform(gen) < float(p[y]) / qy:
            return TreeVerdict([c], 0)
    return TreeVerdict([], sample_index(p, uniform(gen)))


def _broken_first_q(tree, logits, cfg, gen):
    """BROKEN: every sibling is divided by the first draw's q (not the q it was drawn from)."""
    q0 = tree.q_probs[tree.children(-1)[0]]
    bad = replace(tree, q_probs=q0.expand_as(tree.q_probs).clone(), _children=None)
    return verify_tree_sampling(bad, logits, cfg, gen)


def test_tree_verifier_samples_the_target_distribution():
    counts, P, second = _first_token_counts(verify_tree_sampling)
    assert chi2_pvalue(counts, P) > ALPHA
    assert second > N1 // 20  # later siblings were accepted: the residual path is exercised
    assert counts[5] > 0  # and a correction outside every draft


def test_tree_verifier_with_a_copied_branch_samples_the_target_distribution():
    counts, P, later = _first_token_counts(verify_tree_sampling, copy=0)  # token 0: p ~ 0.4
    assert chi2_pvalue(counts, P) > ALPHA
    assert later > N1 // 20  # drafter siblings after the rejected copy were accepted too


@pytest.mark.parametrize("broken", [_broken_independent, _broken_first_q])
def test_tree_verifier_negative_controls_fail(broken):
    counts, P, _ = _first_token_counts(broken, n=3000)
    assert chi2_pvalue(counts, P) < ALPHA


# -- the target forward over a tree and the commit --------------------------------------------------

@pytest.fixture(scope="module")
def tiny_dense():
    t = load_target("random:llama", vocab_size=8, seed=0)
    t.eos_token_ids = frozenset()
    t.set_runtime("dense")
    return t


@pytest.fixture(scope="module")
def dense256():
    t = load_target("random:llama", vocab_size=256, seed=0)
    t.set_runtime("dense")
    return t


def test_tree_forward_equals_each_path_as_a_chain(dense256):
    t = dense256
    prompt = list(range(3, 20))
    tree = DraftTree(torch.tensor([5, 6, 7, 8, 9]), torch.tensor([-1, -1, 0, 0, 2]), torch.tensor([1, 1, 2, 2, 3]))
    c = t.new_cache()
    t.forward(torch.tensor([prompt]), c, None)
    c.rollback(len(prompt))
    ids = torch.cat([torch.tensor([4]), tree.tokens])[None]
    out = t.forward(ids, c, [1, 3], tree=(tree.positions(), tree.attention_mask()))
    for path in ([0, 2, 4], [0, 3], [1]):
        ref_c = t.new_cache()
        seq = prompt + [4] + [int(tree.tokens[i]) for i in path]
        ref = t.forward(torch.tensor([seq]), ref_c, [1, 3])
        rows = [0] + [i + 1 for i in path]
        assert torch.allclose(out.logits[0, rows], ref.logits[0, len(prompt):], atol=1e-5)
        assert torch.allclose(out.features[0, rows], ref.features[0, len(prompt):], atol=1e-5)
    # keep the path 0 -> 2 -> 4: the cache then continues like the chain's
    c.keep_rows(len(prompt), [0, 1, 3, 5])
    assert c.length == len(prompt) + 4
    nxt = t.forward(torch.tensor([[11]]), c, None).logits[0, -1]
    ref_c = t.new_cache()
    ref = t.forward(torch.tensor([prompt + [4, 5, 7, 9, 11]]), ref_c, None).logits[0, -1]
    assert torch.allclose(nxt, ref, atol=1e-5)
    with pytest.raises(ValueError, match="cannot keep rows"):
        c.keep_rows(0, [2, 1])


def test_tree_forward_refused_on_transformers_cache():
    t = load_target("random:llama", vocab_size=64, seed=0)
    tree = DraftTree.chain(torch.tensor([1, 2]))
    with pytest.raises(ValueError, match="dense runtime"):
        t.forward(torch.tensor([[3, 1, 2]]), t.new_cache(), None, tree=(tree.positions(), tree.attention_mask()))


# -- the engine: greedy equality ----------------------------------------------------------------------

SPECS = [TreeSpec(8), TreeSpec(24), TreeSpec(20, (4, 2, 1)), TreeSpec(5, (2,))]


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.describe())
def test_tree_greedy_equals_ar_random_target(dense256, spec):
    prompt = list(range(1, 30))
    ref = Engine(dense256, None, "ar").generate(prompt, SamplingConfig(), 40).token_ids
    eng = Engine(dense256, random_proposer(dense256, "dspine", 8, seed=1), "dspine", tree=spec)
    res = eng.generate(prompt, SamplingConfig(), 40)
    assert res.token_ids == ref
    assert res.stats.tree_nodes and max(res.stats.tree_nodes) <= spec.budget
    assert res.stats.kernels["draft_tree"] == spec.describe()


@pytest.fixture
def smol_dense(smol):
    prev = smol.runtime_name
    smol.set_runtime("dense")
    yield smol
    smol.set_runtime(prev)


# slow (suite time): the default tree (sized per cycle, budget 16) is checked against ar on the real
# target by test_tree_sizer
@pytest.mark.parametrize("spec", [pytest.param(TreeSpec(32), marks=pytest.mark.slow), pytest.param(TreeSpec(44, (4, 2, 1, 1, 1, 1)), marks=pytest.mark.slow)],
                         ids=lambda s: s.describe() if isinstance(s, TreeSpec) else None)
def test_tree_greedy_equals_ar_real_target_shipped_drafter(smol_dense, spec):
    ids = smol_dense.encode_prompt("Write a Python function that reverses a string.", chat=True)
    ref = ar_continuation(smol_dense, ids, 48)
    drafter = load_drafter(default_drafter_path("smollm2-135m", "dspine"), smol_dense)
    chain_res = Engine(smol_dense, DrafterProposer(drafter), "dspine").generate(ids, SamplingConfig(), 48)
    res = Engine(smol_dense, DrafterProposer(drafter), "dspine", tree=spec).generate(ids, SamplingConfig(), 48)
    assert res.token_ids == ref == chain_res.token_ids
    assert res.stats.tree_nodes and res.stats.accepted_length_mean >= chain_res.stats.accepted_length_mean


def test_tree_falls_back_to_chains_where_it_cannot_run(tiny256):
    """transformers' forward (``--runtime hf``), a DFlash-style drafter (no tables) and a
    hybrid Gated-DeltaNet target verify chains, still equal to ``ar``, and say so."""
    prompt = list(range(1, 20))
    ref = Engine(tiny256, None, "ar").generate(prompt, SamplingConfig(), 24).token_ids
    for mode in ("dspine", "dflash"):
        eng = Engine(tiny256, random_proposer(tiny256, mode, 8, seed=1), mode, tree=TreeSpec(16))
        res = eng.generate(prompt, SamplingConfig(), 24)
        assert res.token_ids == ref and res.stats.tree_nodes == []
        assert res.stats.kernels["draft_tree"].startswith("chain (")
    hyb = load_target("random:qwen3_5", vocab_size=128, seed=0)
    hyb.eos_token_ids = frozenset()
    ref = Engine(hyb, None, "ar").generate(prompt, SamplingConfig(), 20).token_ids
    res = Engine(hyb, random_proposer(hyb, "dspine", 8, seed=1), "dspine", tree=TreeSpec(16)).generate(
        prompt, SamplingConfig(), 20)
    assert res.token_ids == ref and res.stats.tree_nodes == []


# -- the engine: sampled exactness on the tiny target ---------------------------------------------------

N_ENGINE = 1000
TREE_SHAPE = TreeSpec(10, (3, 2))  # the first cycle drafts depth 2: 3 siblings, 2 children each


def _broken_no_residual(tree, logits, sampling, gen):
    """BROKEN: siblings are checked against the node's p, never the residual after a rejection."""
    if sampling.greedy:
        return verify_tree_greedy(tree, logits)
    node, path = -1, []
    while True:
        p = filter_probs(logits[node + 1], sampling)
        acc = None
        for c in tree.children(node):
            y = int(tree.tokens[c])
            hit = (tree.q_ids[c] == y).nonzero()
            qy = float(tree.q_probs[c, int(hit[0])]) if hit.numel() else 0.0
            if qy > 0 and uniform(gen) < float(p[y]) / qy:
                acc = c
                break
        if acc is None:
            res = p.clone()
            for c in tree.children(node):
                res[tree.q_ids[c]] -= tree.q_probs[c]
            res = res.clamp_min(0)
            return TreeVerdict(path, sample_index(res if float(res.sum()) > 0 else p, uniform(gen)))
        path.append(acc)
        node = acc


@pytest.fixture(scope="module")
def tree_engine(tiny_dense):
    return Engine(tiny_dense, strong_bridge_drafter(tiny_dense, seed=3), "dspine", tree=TREE_SHAPE)


@pytest.mark.parametrize("name", ["t1.0", pytest.param("t0.7_k3", marks=pytest.mark.slow)])
def test_tree_sampling_matches_target(tiny_dense, tree_engine, monkeypatch, name):
    seen = {"later_sibling": 0, "depth2": 0}
    real = dspine.core.verify.verify_tree

    def recording(tree, logits, sampling, gen):
        v = real(tree, logits, sampling, gen)
        seen["later_sibling"] += int(bool(v.path) and v.path[0] != tree.children(-1)[0])
        seen["depth2"] += int(v.accepted >= 2)
        return v

    monkeypatch.setattr(dspine.core.verify, "verify_tree", recording)
    P = exact_distribution(tiny_dense, PROMPT, SETTINGS[name])
    counts = sample_counts(tree_engine, SETTINGS[name], N_ENGINE, tiny_dense.vocab_size)
    assert chi2_pvalue(counts, P) > ALPHA
    assert seen["later_sibling"] > N_ENGINE // 50 and seen["depth2"] > N_ENGINE // 50, seen


def test_tree_sampling_negative_control_fails(tiny_dense, tree_engine, monkeypatch):
    monkeypatch.setattr(dspine.core.verify, "verify_tree", _broken_no_residual)
    P = exact_distribution(tiny_dense, PROMPT, SETTINGS["t1.0"])
    counts = sample_counts(tree_engine, SETTINGS["t1.0"], N_ENGINE, tiny_dense.vocab_size)
    assert chi2_pvalue(counts, P) < ALPHA


# -- the copied continuation as one more branch (hybrid proposer) ----------------------------------------

def test_graft_merges_when_greedy_and_adds_point_masses_when_sampled():
    t = DraftTree(torch.tensor([5, 6, 7]), torch.tensor([-1, -1, 0]), torch.tensor([1, 1, 2]))
    g, added = graft(t, [5, 7, 9], merge=True)  # 5 -> 7 exist: only 9 is new, below node 2
    assert added == 1 and g.size == 4 and int(g.parent[3]) == 2 and int(g.depth[3]) == 3
    same, added = graft(t, [5, 7], merge=True)
    assert added == 0 and same is t
    T, cand = _tables(n=3, K=4, seed=5)
    s = static_tree(T, cand, 2, (2,), 10, SamplingConfig(temperature=1.0), make_generator(0))
    g, added = graft(s, [int(s.tokens[0]), 3], merge=False)  # a separate branch first, even where tokens match
    assert added == 2 and g.size == s.size + 2 and g.children(-1)[0] == 0 and g.children(0) == [1]
    assert g.q_probs[:2, 0].tolist() == [1.0, 1.0] and float(g.q_probs[:2, 1:].abs().sum()) == 0.0
    assert g.q_ids[:2, 0].tolist() == [int(s.tokens[0]), 3]
    assert g.tokens[2:].tolist() == s.tokens.tolist() and torch.equal(g.q_probs[2:], s.q_probs)
    assert [len(g.children(c + 2)) for c in range(s.size)] == [len(s.children(c)) for c in range(s.size)]


REPEAT_PROMPT = [1, 2, 5, 7, 1, 2]  # (2, 5) repeats when y1 = 5 (the likeliest): a copy is grafted


def test_hybrid_tree_greedy_equals_ar(dense256):
    from dspine.proposers import make_proposer
    prompt = [5, 6, 7, 8, 9, 10] * 4
    ref = Engine(dense256, None, "ar").generate(prompt, SamplingConfig(), 40).token_ids
    prop = make_proposer("hybrid", random_proposer(dense256, "dspine", 8, seed=1))
    res = Engine(dense256, prop, "dspine", tree=TreeSpec(8)).generate(prompt, SamplingConfig(), 40)
    assert res.token_ids == ref and res.stats.tree_nodes


class DraftFirstHybrid(HybridProposer):
    """The hybrid with a plan that always drafts (as the cost policy may pick), so every
    strong copy is grafted onto the drafter's tree."""

    def plan(self, state, anchor, n_max, pick=None):
        return super().plan(state, anchor, n_max, pick=lambda alts: alts[-1])


def test_hybrid_tree_sampling_matches_target(tiny_dense, monkeypatch):
    cfg = SETTINGS["t1.0"]
    prop = DraftFirstHybrid(strong_bridge_drafter(tiny_dense, seed=3))
    eng = Engine(tiny_dense, prop, "dspine", tree=TREE_SHAPE)
    seen = {"grafted": 0, "trees": 0}
    real = dspine.core.verify.verify_tree

    def recording(tree, logits, sampling, gen):
        seen["trees"] += 1
        seen["grafted"] += int(tree.size > 9)  # TREE_SHAPE gives at most 3 + 6 drafter nodes
        return real(tree, logits, sampling, gen)

    monkeypatch.setattr(dspine.core.verify, "verify_tree", recording)
    P = exact_distribution(tiny_dense, REPEAT_PROMPT, cfg)
    counts = np.zeros((tiny_dense.vocab_size,) * 3, dtype=np.int64)
    for s in range(N_ENGINE):
        ids = eng.generate(REPEAT_PROMPT, replace(cfg, seed=s), GEN_LEN).token_ids
        counts[tuple(ids[:3])] += 1
    assert chi2_pvalue(counts, P) > ALPHA
    assert seen["grafted"] > N_ENGINE // 5, seen  # (its acceptance is tested with the verifier above)


# -- the n-gram prior scored along each node's path ------------------------------------------------------

def _path_prior(scale: float = 4.0):
    """A prior that depends on the path: it favours the candidate equal to (last path token + 1) % 50
    (the root: favours 7), so a node's children differ with its path."""
    calls = []

    def prior(path: list[int], cand_d: torch.Tensor) -> torch.Tensor:
        calls.append(list(path))
        want = 7 if not path else (path[-1] + 1) % 50
        return (cand_d == want).float() * scale - 1.0
    return prior, calls


def test_trees_with_a_prior_score_each_row_along_its_path():
    T, cand = _tables(n=4, K=5, seed=3, scale=1.0)
    cand[0, 3], cand[1, 2], cand[2, 4] = 7, 8, 9  # the prior's favourites along one path
    prior, calls = _path_prior()
    sampling = SamplingConfig(temperature=1.0)
    # widths all 1 with a prior reproduce the chain with the same prior: tokens, q, draws
    for s in range(4):
        g1, g2 = make_generator(s), make_generator(s)
        ch = chain(T, cand, 4, sampling, g1, prior=lambda chosen, c: prior(chosen, c))
        tr = static_tree(T, cand, 4, (1, 1, 1, 1), 10, sampling, g2, prior=prior)
        assert torch.equal(tr.tokens, ch.tokens) and torch.allclose(tr.q_probs, ch.q_probs)
    gd = dynamic_tree(T, cand, 3, 6, prior=prior)
    assert gd.tokens[:3].tolist() == [7, 8, 9]  # the strong prior leads the best-first path
    assert [] in calls and [7, 8] in calls  # rows scored given the root and a depth-2 path
    plain = dynamic_tree(T, cand, 3, 6)
    assert not torch.equal(plain.tokens, gd.tokens)  # the prior changed the tree
    assert torch.equal(dynamic_tree(T, cand, 3, 6, prior=lambda p, c: torch.zeros(c.shape[0])).tokens,
                       plain.tokens)  # a zero prior is no prior


class _CountingTreePrior(DrafterProposer):
    changed = 0

    def propose_tree(self, state, anchor, anchor_pos, depth, spec, sampling, gen, trim=None):
        p = super().propose_tree(state, anchor, anchor_pos, depth, spec, sampling, gen, trim=trim)
        prior, self.prior = self.prior, None
        try:
            plain = super().propose_tree(state, anchor, anchor_pos, depth, spec, sampling, gen, trim=trim)
        finally:
            self.prior = prior
        _CountingTreePrior.changed += int(p is not None and not torch.equal(plain.tokens, p.tokens))
        return p


def test_tree_with_prior_greedy_equals_ar_real_target(smol_dense):
    from dspine.data.load import load_dataset
    from dspine.data.prior import committed_data_dir
    from dspine.drafter.ngram_prior import NgramPrior

    d = committed_data_dir("smollm2-135m")
    if d is None:
        pytest.skip("the repository's committed training data is not here")
    rows = load_dataset(d, smol_dense)[:1500]
    prior = NgramPrior.build((s.input_ids[:s.response_start], s.input_ids[s.response_start:]) for s in rows)
    drafter = load_drafter(default_drafter_path("smollm2-135m", "dspine"), smol_dense).float()
    ids = smol_dense.encode_prompt("Write a Python function that reverses a string.", chat=True)
    ref = Engine(smol_dense, None, "ar").generate(ids, SamplingConfig(), 40).token_ids
    _CountingTreePrior.changed = 0
    res = Engine(smol_dense, _CountingTreePrior(drafter, prior=prior), "dspine", tree=TreeSpec(16)).generate(
        ids, SamplingConfig(), 40)
    assert res.token_ids == ref
    assert _CountingTreePrior.changed > 0  # the prior really changed the trees


def _tiny_prior(V: int = 8):
    import random as _random

    from dspine.drafter.ngram_prior import NgramPrior

    rng = _random.Random(0)  # contexts that match often and favour tokens the drafter does not
    rows = [(PROMPT[:1], [rng.choice([1, 2, 3, 3, 5, 6, 6, 6]) % V for _ in range(40)]) for _ in range(30)]
    return NgramPrior.build(rows, weight=2.0)


class _ForgetsPriorInTrees(DrafterProposer):
    """BROKEN: draws the tree's children with the prior but reports the q of the rows without it."""

    def propose_tree(self, state, anchor, anchor_pos, depth, spec, sampling, gen, trim=None):
        prop = super().propose_tree(state, anchor, anchor_pos, depth, spec, sampling, gen, trim=trim)
        if prop is None or prop.tree.q_probs is None:
            return prop
        t = prop.tree
        cand, T = self._last
        qs = []
        for i in range(t.tokens.shape[0]):
            d, par = int(t.depth[i]) - 1, int(t.parent[i])
            j = 0 if par < 0 else int((cand[d - 1] == t.tokens[par]).nonzero()[0, 0])
            q = filter_probs(T[d, j].float(), sampling)
            sib = [c for c in t.children(par) if c < i]  # drawn before: removed, renormalized
            for c in sib:
                q = q.clone()
                q[int((cand[d] == t.tokens[c]).nonzero()[0, 0])] = 0.0
            qs.append(q / q.sum() if sib else q)
        t.q_probs = torch.stack(qs)
        prop.q_probs = t.q_probs
        return prop

    def _tables(self, out, a, n, copy=None, bonus=0.0):
        self._last = tuple(x.cpu() for x in super()._tables(out, a, n, copy, bonus))
        return self._last


def _prior_tree_engine(tiny_dense, cls=DrafterProposer):
    prop = strong_bridge_drafter(tiny_dense, seed=3)
    return Engine(tiny_dense, cls(prop.drafter, prior=_tiny_prior(), head_kernel="exact"), "dspine",
                  tree=TREE_SHAPE)


def test_tree_sampling_with_prior_matches_target(tiny_dense):
    P = exact_distribution(tiny_dense, PROMPT, SETTINGS["t1.0"])
    counts = sample_counts(_prior_tree_engine(tiny_dense), SETTINGS["t1.0"], N_ENGINE, tiny_dense.vocab_size)
    assert chi2_pvalue(counts, P) > ALPHA


def test_tree_sampling_with_prior_wrong_q_fails(tiny_dense):
    """Negative control: children drawn with the prior but verified with the q of the unscored rows."""
    P = exact_distribution(tiny_dense, PROMPT, SETTINGS["t1.0"])
    counts = sample_counts(_prior_tree_engine(tiny_dense, _ForgetsPriorInTrees), SETTINGS["t1.0"], N_ENGINE,
                           tiny_dense.vocab_size)
    assert chi2_pvalue(counts, P) < ALPHA
