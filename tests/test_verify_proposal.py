"""The engine's one verification entry point, ``dspine.core.verify.verify_proposal``.

A chain is verified by the token-wise chain verifiers (a fast path) and a draft tree by
the tree verifier; the engine treats both through the same function. Here: a chain and
the same chain as a one-path tree (``DraftTree.chain``) give the same outcome (accepted
count, emitted tokens, committed rows) for the same draws, greedy and sampled; nothing
proposed is the plain sampler's draw. The negative control shows the comparison can fail.
The distribution of what the engine emits through this function is tested end to end in
``tests/test_distribution.py`` and ``tests/test_trees.py`` (chi-square, negative controls).
"""
from __future__ import annotations

import pytest
import torch

from dspine.config import SamplingConfig
from dspine.core.sampling import make_generator, sample_token
from dspine.core.verify import Outcome, verify_proposal
from dspine.drafter.final_stage import chain
from dspine.proposers.base import Proposal
from dspine.trees import DraftTree

V = 50


def _case(seed: int, cfg: SamplingConfig, n: int = 5, K: int = 5):
    """A final-stage chain of n proposals over K candidates per position (as
    tests/test_trees.py) and target logits [n + 1, V] that favour its first ``seed % (n +
    1)`` proposals, so the cases reach every acceptance length."""
    g = torch.Generator().manual_seed(seed)
    T = torch.randn(n, K, K, generator=g) * 1.5
    T[0] = T[0, 0]
    cand = torch.stack([torch.randperm(V, generator=g)[:K] for _ in range(n)])
    ch = chain(T, cand, n, cfg, make_generator(seed))
    logits = torch.randn(n + 1, V, generator=g) * 2
    for k in range(seed % (n + 1)):
        logits[k, ch.tokens[k]] += 8.0
    return ch, logits


def _as_tree(p: Proposal) -> Proposal:
    return Proposal(p.tokens, tree=DraftTree.chain(p.tokens, p.q_ids, p.q_probs))


def _same(a: Outcome, b: Outcome) -> bool:
    return (a.accepted, a.tokens, a.rows, a.depth) == (b.accepted, b.tokens, b.rows, b.depth)


@pytest.mark.parametrize("cfg", [SamplingConfig(), SamplingConfig(temperature=1.0, top_p=0.95),
                                 SamplingConfig(temperature=0.7, top_k=20)], ids=["greedy", "top_p", "top_k"])
def test_a_chain_and_the_same_chain_as_a_tree_verify_alike(cfg):
    accepted = set()
    for seed in range(40):
        ch, logits = _case(seed, cfg)
        p = Proposal(ch.tokens, ch.q_ids, ch.q_probs)
        a = verify_proposal(p, logits, cfg, make_generator(1000 + seed))
        b = verify_proposal(_as_tree(p), logits, cfg, make_generator(1000 + seed))
        assert _same(a, b), seed
        assert a.nodes == 0 and b.nodes == 5
        assert a.rows == list(range(a.accepted + 1)) and len(a.tokens) == a.accepted + 1
        assert a.tokens[:a.accepted] == ch.tokens[:a.accepted].tolist()
        accepted.add(a.accepted)
    assert len(accepted) >= 3  # the cases reach several acceptance lengths, rejections included


def test_negative_control_a_tree_with_other_tokens_verifies_differently():
    """The comparison above is not vacuous: the same chain with its first two proposals
    swapped, as a tree, disagrees with the chain on some case."""
    cfg = SamplingConfig()
    differ = 0
    for seed in range(40):
        ch, logits = _case(seed, cfg)
        p = Proposal(ch.tokens, ch.q_ids, ch.q_probs)
        swapped = ch.tokens.clone()
        swapped[[0, 1]] = swapped[[1, 0]]
        bad = Proposal(swapped, tree=DraftTree.chain(swapped, ch.q_ids, ch.q_probs))
        differ += not _same(verify_proposal(p, logits, cfg, None), verify_proposal(bad, logits, cfg, None))
    assert differ > 0


@pytest.mark.parametrize("cfg", [SamplingConfig(), SamplingConfig(temperature=0.8)], ids=["greedy", "sampled"])
def test_nothing_proposed_is_the_plain_samplers_draw(cfg):
    for seed in range(20):
        logits = torch.randn(1, V, generator=torch.Generator().manual_seed(seed))
        o = verify_proposal(Proposal(torch.zeros(0, dtype=torch.long)), logits, cfg, make_generator(seed))
        assert o == Outcome(0, [sample_token(logits[0], cfg, make_generator(seed))], [0], 0)


def test_too_few_logit_rows_are_refused():
    p = Proposal(torch.tensor([1, 2, 3]))
    with pytest.raises(ValueError, match="4 rows|need 4"):
        verify_proposal(p, torch.zeros(3, V), SamplingConfig(), None)
