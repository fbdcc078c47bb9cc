"""The batched engine on the lean decode path (``dspine serve``'s cycles; dspine.core.batch).

Several requests' verification tokens run in one C++ call over the batched slot cache
(``LeanLlama.forward_ragged``), packed without padding. The kernels are batch-invariant, so
every request's logits and features must be bitwise those of its own one-request forward
(a wrong row mapping must not be); and the batched engine's greedy output must equal the
single-request engine's, token for token, on the real target.
"""
from __future__ import annotations

import pytest
import torch

from dspine.core.batch import BatchEngine
from dspine.core.kv import SlotKV
from dspine.config import SamplingConfig
from dspine.core.engine import Engine
from dspine.runtime import blockq as B

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPTS = ["def fibonacci(n):", "The capital of France is", "import numpy as np\n\nx ="]


def test_ragged_forward_is_bitwise_each_requests_own_forward(smol_lean, monkeypatch):
    t, rt = smol_lean, smol_lean.runtime
    plan, layers = rt.lean_plan(), [1, 8, t.num_layers - 1]
    # every forward below on the kernels, whatever row limits this machine measured (the
    # engine packs at most that many tokens per call: BatchEngine._lean_chunk)
    monkeypatch.setattr(plan, "max_rows", B.MAX_ROWS)
    monkeypatch.setattr(t.model.lm_head, "rows", B.MAX_ROWS)
    prompts = [t.encode_prompt(p) for p in PROMPTS]
    new = [torch.tensor([11, 22, 33]), torch.tensor([44]), torch.tensor([55, 66, 77, 88, 99])]
    kv = SlotKV(t.num_layers, 4)
    want_logits, want_feats = [], []
    for p, n in zip(prompts, new):  # each request alone: prefill, then its new tokens
        cache = rt.new_cache()
        rt.forward(torch.tensor([p]), cache, None)
        kv.add_row(cache.kv_rows(), len(p))
        lg, ft = rt.forward(n[None], cache, layers)
        want_logits.append(lg[0])
        want_feats.append(ft[0])
    kv._ensure(max(len(p) + len(n) for p, n in zip(prompts, new)))
    tok = torch.cat(new)
    rows = torch.cat([torch.full((len(n),), i) for i, n in enumerate(new)])
    pos = torch.cat([torch.arange(len(p), len(p) + len(n)) for p, n in zip(prompts, new)])
    assert tok.numel() <= plan.rows
    x, by = plan.forward_ragged(rt, tok, rows, pos, kv.k, kv.v, layers)
    logits, feats = rt._finish(x, by, layers, 0)
    o = 0
    for lg, ft in zip(want_logits, want_feats):
        n = lg.shape[0]
        assert torch.equal(logits[0, o:o + n], lg) and torch.equal(feats[0, o:o + n], ft)
        o += n
    # negative control: the same tokens read against another request's cache row differ
    x, by = plan.forward_ragged(rt, tok, rows.flip(0), pos, kv.k, kv.v, layers)
    wrong, _ = rt._finish(x, by, layers, 0)
    assert not torch.equal(wrong[0, :3], want_logits[0])
    with pytest.raises(RuntimeError, match="outside the cache"):
        plan.forward_ragged(rt, tok, rows + 5, pos, kv.k, kv.v, layers)


@pytest.mark.parametrize("mode", ["ar", "dspine"])
def test_batched_greedy_on_the_lean_path_equals_the_single_request_engine(smol_lean, mode, monkeypatch):
    from dspine.drafter.checkpoint import load_drafter
    from dspine.proposers.drafter import DrafterProposer
    from dspine.build import default_drafter_path
    from dspine.proposers import make_proposer

    t = smol_lean
    prop = None
    if mode == "dspine":
        d = load_drafter(default_drafter_path("smollm2-135m", "dspine"), t)
        prop = make_proposer("hybrid", DrafterProposer(d, linears="q8"))
    eng = Engine(t, prop, mode)
    prompts = [t.encode_prompt(p) for p in PROMPTS]
    want = [eng.generate(p, SamplingConfig(), 24).token_ids for p in prompts]
    calls = []
    import dspine.core.forward as forward_mod

    real = forward_mod.lean_forward
    monkeypatch.setattr(forward_mod, "lean_forward", lambda *a: calls.append(1) or real(*a))
    got = BatchEngine(eng, 3).generate_many(prompts, max_new_tokens=24)
    assert [g.token_ids for g in got] == want
    assert calls  # the batched cycles ran on the lean path


def test_ragged_tree_forward_is_bitwise_each_requests_own_tree_forward(smol_lean, monkeypatch):
    """Draft trees in the batch: a tree request's nodes sit at their depths
    and see only their ancestors, packed beside a chain request, split over calls of a few
    rows; each request's logits and features are bitwise its own one-request forward (chain,
    or tree with the tree mask). Negative control: the tree read causally differs."""
    from dspine.core.batch_lean import Inputs, lean_forward
    from dspine.trees.tree import DraftTree

    t, rt = smol_lean, smol_lean.runtime
    plan, layers = rt.lean_plan(), [1, 8, t.num_layers - 1]
    monkeypatch.setattr(plan, "max_rows", B.MAX_ROWS)
    monkeypatch.setattr(t.model.lm_head, "rows", B.MAX_ROWS)
    prompts = [t.encode_prompt(p) for p in PROMPTS[:2]]
    tree = DraftTree(torch.tensor([11, 12, 13, 21, 22, 31]), torch.tensor([-1, -1, -1, 0, 0, 3]),
                     torch.tensor([1, 1, 1, 2, 2, 3]))
    anchor = 7
    tree_in = Inputs(torch.cat([torch.tensor([anchor]), tree.tokens]), tree.positions(), tree.attention_mask())
    chain_in = Inputs(torch.tensor([anchor, 44, 45, 46]))
    kv, want = SlotKV(t.num_layers, 2), []
    for p, q in zip(prompts, (tree_in, chain_in)):
        cache = rt.new_cache()
        rt.forward(torch.tensor([p]), cache, None)
        kv.add_row(cache.kv_rows(), len(p))
        tr = (q.offsets, q.mask) if q.mask is not None else None
        lg, ft = rt.forward(q.tokens[None], cache, layers, tree=tr)
        want.append((lg[0], ft[0]))
    starts = [len(p) for p in prompts]
    for chunk in (B.MAX_ROWS, 3):  # all in one call; a request's inputs split over calls
        monkeypatch.setattr(plan, "max_rows", chunk)
        logits, feats = lean_forward(t, plan, kv, [tree_in, chain_in], starts, layers)
        for (lg, ft), got_lg, got_ft in zip(want, logits, feats):
            assert torch.equal(got_lg, lg) and torch.equal(got_ft, ft)
    causal = Inputs(tree_in.tokens)  # the same nodes as a chain: ancestors ignored
    logits, _ = lean_forward(t, plan, kv, [causal, chain_in], starts, layers)
    assert not torch.equal(logits[0], want[0][0])
    # a mask narrower than the tree: refused in Python, and by the kernel
    with pytest.raises(ValueError, match="mask"):
        Inputs(tree_in.tokens, tree_in.offsets, tree_in.mask[:, :3])
    n, s0 = len(tree_in), starts[0]  # the kernel's own check, past the Python one
    with pytest.raises(RuntimeError, match="not within its tree"):
        plan.forward_ragged(rt, tree_in.tokens, torch.zeros(n, dtype=torch.long), torch.arange(s0, s0 + n), kv.k,
                            kv.v, layers, (s0 + tree_in.offsets, torch.full((n,), s0), tree_in.mask[:, :3].contiguous()))


def _tree_engine(t):
    from dspine.build import default_drafter_path
    from dspine.drafter.checkpoint import load_drafter
    from dspine.proposers.drafter import DrafterProposer
    from dspine.proposers import make_proposer
    from dspine.trees.tree import TreeSpec

    d = load_drafter(default_drafter_path("smollm2-135m", "dspine"), t)
    prop = make_proposer("hybrid", DrafterProposer(d, linears="q8"))
    return Engine(t, prop, "dspine", tree=TreeSpec(8, None, size="fixed"))


@pytest.mark.parametrize("sampling", [SamplingConfig(), SamplingConfig(temperature=0.8, top_k=20, seed=3)],
                         ids=["greedy", "sampled"])
def test_batched_trees_equal_the_single_request_engine(smol_lean, sampling, monkeypatch):
    """`dspine serve`'s batched cycles verify draft trees: greedy and sampled outputs are
    token for token the single-request engine's (the same logits, bitwise, and the same
    draws of each request's own generator; the single-request tree paths are proven exact
    in tests/test_trees*.py), and greedy equals `ar`. Negative control: a batch that keeps
    the rejected nodes' K/V (no compaction of the accepted path) diverges."""
    t = smol_lean
    plan = t.runtime.lean_plan()
    monkeypatch.setattr(plan, "max_rows", B.MAX_ROWS)  # the one-request trees run lean too
    monkeypatch.setattr(t.model.lm_head, "rows", B.MAX_ROWS)
    eng = _tree_engine(t)
    prompts = [t.encode_prompt(p) for p in PROMPTS]
    want = [eng.generate(p, sampling, 24) for p in prompts]
    assert any(n > 0 for w in want for n in w.stats.tree_nodes)  # trees were verified
    got = BatchEngine(eng, 3).generate_many(prompts, sampling, max_new_tokens=24)
    assert [g.token_ids for g in got] == [w.token_ids for w in want]
    assert any(n > 0 for g in got for n in g.stats.tree_nodes)  # ... in the batch too
    if sampling.greedy:
        ar = Engine(t, None, "ar")
        assert [g.token_ids for g in got] == [ar.generate(p, sampling, 24).token_ids for p in prompts]
    monkeypatch.setattr(SlotKV, "keep_rows", lambda self, r, start, rows: self.lengths.__setitem__(r, start + len(rows)))
    broken = BatchEngine(eng, 3).generate_many(prompts, sampling, max_new_tokens=24)
    assert [g.token_ids for g in broken] != [w.token_ids for w in want]


def test_batched_trees_fall_back_to_chains_off_the_lean_path(smol):
    """On transformers' batched forward (no tree masks there) a tree budget drafts chains:
    no cycle verifies a tree and greedy output still equals `ar`."""
    eng = _tree_engine(smol)
    prompts = [smol.encode_prompt(p) for p in PROMPTS[:2]]
    be = BatchEngine(eng, 2)
    got = be.generate_many(prompts, max_new_tokens=12)
    assert be.batched and be.cycle.target_pass.lean_plan() is None
    assert all(n == 0 for g in got for n in g.stats.tree_nodes)
    ar = Engine(smol, None, "ar")
    assert [g.token_ids for g in got] == [ar.generate(p, SamplingConfig(), 12).token_ids for p in prompts]
