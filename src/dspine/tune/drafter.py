"""The drafter's own linear layers: float32, or rounded to Q8_0 blocks (measured, 2026-12-02).

On the lean target path a drafting cycle cost ~11 ms beside a ~7 ms plain target step, ~5
ms of it in the drafter's float32 linears (~8.7M weights, 35 MB read per forward). The
drafter only proposes: the target verifies every token, so its numerics never change the
output (greedy equality and exact sampling hold for any proposer). ``q8`` therefore runs
a copy on Q8_0 blocks (:mod:`dspine.drafter.q8`): ~1.1 bytes per weight instead of 4. Measured on a 2-core
AVX-512 EPYC: a 3-token proposal 8.9-11.8 -> 4.9-5.1 ms, τ unchanged on the prompts tried
(docs/decisions.md, 2026-12-02). ``auto`` times one drafter forward of each on this machine
(cached per machine and drafter shape) and takes the faster.
"""
from __future__ import annotations

import torch

from dspine.config import ConfigError
from dspine.drafter.q8 import DRAFTER_LINEARS, forced_linears, q8_unavailable, quantize_drafter
from dspine.tune.choose import Choice, choose_fastest

def _forward(drafter, rows: int = 4, context: int = 64):
    """A zero-argument callable: one block forward of ``rows`` rows over ``context`` positions.

    ``rows`` is capped at the drafter's block size: a block-2 drafter is timed on the 2 rows
    it can draft, never on a shape it cannot run.
    """
    cfg = drafter.cfg
    rows = max(1, min(int(rows), int(cfg.block_size)))
    g = torch.Generator().manual_seed(0)
    feats = torch.randn(1, context, len(cfg.feature_layers) * cfg.target_hidden, generator=g)
    pos = torch.arange(context)[None]
    with torch.no_grad():
        kv = drafter.context_kv(feats, pos)
    anchor = torch.tensor([[1]])
    apos = torch.tensor([[context]])
    valid = torch.ones(1, context, dtype=torch.bool)

    from dspine.runtime.lean_drafter import block_forward

    forward = block_forward(drafter)

    def run():
        with torch.no_grad():
            forward(anchor, apos, kv, pos, valid, rows=rows if cfg.block_causal else None)
    return run


def plan_drafter_linears(drafter, kind: str = "auto", *, redo: bool = False, timer=None,
                         progress: bool = True) -> tuple[object, Choice | None]:
    """(the drafter to propose with, the measured :class:`Choice` or None when forced).

    ``kind``: ``auto`` (``q8`` where it runs and measures faster here, cached per machine and
    drafter shape), ``float32`` (the drafter as trained) or ``q8`` (forced).

    Raises:
        ConfigError: unknown ``kind`` or a forced ``q8`` that cannot run (naming
            ``SpeculativeConfig.drafter_linears``).
    """
    if kind not in ("auto", *DRAFTER_LINEARS):
        raise ConfigError(f"SpeculativeConfig.drafter_linears {kind!r} is unknown; accepted: auto, "
                          f"{', '.join(DRAFTER_LINEARS)}", field="drafter_linears")
    if kind != "auto":
        return forced_linears(drafter, kind), None
    if q8_unavailable(drafter) is not None:
        return drafter, None
    from dspine.runtime.blockq import source_version

    q8 = quantize_drafter(drafter)
    cfg = drafter.cfg
    key = (f"drafter-linears:lean={getattr(q8, '_lean', None) is not None},d={cfg.target_hidden},L={cfg.num_layers},ffn={cfg.ffn},F={len(cfg.feature_layers)},"
           f"bridge={cfg.bridge},rows={min(4, cfg.block_size)},blockq={source_version()}")
    choice = choose_fastest(key, {"float32": _forward(drafter), "q8": _forward(q8)}, timer=timer, redo=redo,
                            progress=progress, rounds=3, what="the drafter's linear layers (float32 vs q8 blocks)")
    return (q8 if choice.chosen == "q8" else drafter), choice


def measured_proposer(drafter, *, head_kernel: str = "auto", linears: str = "auto", vocab=None,
                      use_quantized_head: bool = True, progress: bool = True, prior=None):
    """A :class:`~dspine.proposers.drafter.DrafterProposer` for ``drafter`` with its
    machine-dependent choices made here, where an engine is built: the drafter's linears
    (:func:`plan_drafter_linears`) and the candidate pass's kernel per row count
    (:func:`dspine.tune.head.plan_candidate_pass`), each ``auto`` (measured once per
    machine and shape, cached) or forced by name. ``prior``: an n-gram prior for the final
    stage (:mod:`dspine.drafter.ngram_prior`), or None.

    Raises:
        ValueError: an unknown ``head_kernel`` or ``linears`` (naming the flag), a forced
            ``q8`` that cannot run here, or a draft vocabulary without the coarse pass.
    """
    from dspine.proposers.drafter import DrafterProposer
    from dspine.tune.head import plan_candidate_pass

    planned, choice = plan_drafter_linears(drafter.eval(), linears, progress=progress)
    cp = (plan_candidate_pass(planned.head, planned.fc.weight.dtype, head_kernel, ids=vocab, progress=progress)
          if use_quantized_head else None)
    return DrafterProposer(planned, use_quantized_head, cp, vocab=vocab, linears_choice=choice,  # checks vocab
                           prior=prior)
