"""The speculative decoding loop in its plainest form: read this first.

One request, one proposer, the whole block verified every cycle; no cost policy, no
copies-or-draft choice, no draft trees, no stop strings, no batching. It calls the same
functions the engine calls (the target's forward and cache, :func:`dspine.core.sampling.sample_token`,
:func:`dspine.core.verify.verify`), so for a fixed verification length the engine
(:class:`dspine.core.engine.Engine` with ``verify_policy=None`` and no tree) emits the same
tokens for greedy decoding and the same tokens for a seeded sampler (the same random draws
in the same order): ``tests/test_reference.py`` checks both.

One cycle (spec s.5), with ``a`` the anchor (the last emitted token, not yet seen by the
target) at position ``pos``::

    y_1..y_n   = proposer.propose(state, a, pos, n)          # a draft, with its q
    logits     = target.forward([a, y_1..y_n])             # one pass: p_1..p_{n+1}
    k, t       = verify(y, q, logits)                       # accepted prefix + one token
    emit         y_1..y_k, t
    cache      = first 1 + k positions (a, y_1..y_k) ; t is the next anchor
    proposer   <- features and ids of those 1 + k positions
"""
from __future__ import annotations

import torch

from dspine.config import SamplingConfig
from dspine.core.sampling import make_generator, sample_token
from dspine.core.verify import verify


def _features(out, k: int) -> torch.Tensor:
    """Features [k, F*d] of the first ``k`` positions ([k, 0] when none were captured)."""
    return out.features[0, :k] if out.features is not None else torch.zeros(k, 0)


@torch.no_grad()
def reference_generate(target, proposer, prompt_ids: list[int], sampling: SamplingConfig | None = None,
                       max_new_tokens: int = 64) -> list[int]:
    """Generate up to ``max_new_tokens`` ids (ending early at the target's EOS).

    Args:
        target: a loaded :class:`dspine.target.adapter.Target`.
        proposer: a :class:`dspine.proposers.base.Proposer` (its ``feature_layers`` say
            which target layers it reads), or None for the plain target loop.
        prompt_ids: the prompt's token ids (non-empty).
        sampling: greedy by default; a sampler draws from ``make_generator(sampling.seed)``.
    Returns:
        The emitted token ids (list of int).
    """
    sampling = sampling or SamplingConfig()
    gen = make_generator(sampling.seed)
    # the target layers the proposer reads (captured only when its commit needs features)
    fl = list(proposer.feature_layers) if proposer is not None else []
    layers = fl if fl and proposer.needs_features else None
    cache = target.new_cache()
    state = proposer.new_state(prompt_ids) if proposer else None

    # prefill: the prompt enters the target (and the drafter's context); the first token
    out = target.forward(torch.tensor([prompt_ids], device=target.device), cache, layers, logits_to_keep=1)
    cache.rollback(len(prompt_ids))
    if proposer:
        proposer.commit(state, _features(out, len(prompt_ids)), 0)
        proposer.observe(state, list(prompt_ids), 0)
    out_ids = [sample_token(out.logits[0, -1], sampling, gen)]

    while len(out_ids) < max_new_tokens and out_ids[-1] not in target.eos_token_ids:
        anchor, pos = out_ids[-1], cache.length
        # draft: as many proposals as the block holds and the budget allows
        n = 0 if proposer is None else max(0, min(proposer.block_size - 1, max_new_tokens - len(out_ids) - 1))
        if n > 0:
            prop = proposer.propose(state, anchor, pos, n, sampling, gen)
            tokens, q_probs, q_ids = prop.tokens.cpu(), prop.q_probs, prop.q_ids
        else:
            tokens, q_probs, q_ids = torch.zeros(0, dtype=torch.long), None, None
        # verify: one target pass over the anchor and the proposals
        ids = torch.cat([torch.tensor([anchor]), tokens])[None].to(target.device)
        out = target.forward(ids, cache, layers)  # logits [1, n+1, V]
        if n > 0:
            verdict = verify(tokens, q_probs, q_ids, out.logits[0], sampling, gen)
            k, token = verdict.accepted, verdict.token
        else:
            k, token = 0, sample_token(out.logits[0, 0], sampling, gen)
        new = [int(t) for t in tokens[:k]] + [token]
        # an EOS among the accepted tokens ends the output there; so does the budget
        eos = next((i for i, t in enumerate(new) if t in target.eos_token_ids), None)
        new = new[: (eos + 1 if eos is not None else len(new))][: max_new_tokens - len(out_ids)]
        out_ids += new
        # commit: the anchor and the emitted accepted proposals stay cached, nothing else
        keep = 1 + min(k, len(new) - 1)
        cache.rollback(pos + keep)
        if proposer:
            proposer.commit(state, _features(out, keep), pos)
            proposer.observe(state, ids[0, :keep].tolist(), pos)
    return out_ids
