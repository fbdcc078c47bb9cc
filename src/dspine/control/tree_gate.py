"""Tree or chain, per proposer source, by the measured rate of each (2026-12-03).

A draft tree raises τ over a chain (more candidates verified), but its cycle costs more: a
wider target forward, the tree's bookkeeping, the candidate tables' best-first search.
Which wins depends on the machine (2026-12-02, AVX2 EPYC: trees sized per cycle 1.04x the
chains; 2026-12-03, AVX-512 EPYC with the lean drafter: chains 1.10x the trees), on the
drafter and on the text, so ``--tree-size cost`` does not fix it: :class:`TreeGate`
keeps, per proposer source, decayed sums of the tokens emitted and the seconds spent by
completed drafting cycles of each kind, and drafts a tree when the trees' tokens per
second are the higher (each kind first gets ``warmup`` cycles; every ``explore_every``-th
decision of a source takes the other kind, so a kind that lost keeps being measured).

Non-anticipating (exactness): a decision reads completed cycles and a counter only, never
this cycle's draws, so greedy output stays the target's and sampled output keeps the
target's distribution (both kinds are exact; tests in ``tests/test_tree_gate.py``).
"""
from __future__ import annotations

import math

from dspine.control.estimator import DecayedCells


class TreeGate:
    """Chooses between a draft tree and a chain for a drafting cycle (module docstring).

    Args:
        half_life: decay of each kind's sums, in observed cycles of that source.
        warmup: cycles of each kind observed before the rates decide.
        explore_every: every this many decisions of a source take the losing kind
            (0 = never).
    Raises:
        ValueError: a non-positive half-life, or a negative warmup or period.
    """

    def __init__(self, half_life: float = 64.0, warmup: int = 4, explore_every: int = 8):
        if not half_life > 0 or warmup < 0 or explore_every < 0:
            raise ValueError("TreeGate: half_life > 0, warmup >= 0 and explore_every >= 0")
        self.half_life = half_life
        self.warmup, self.explore_every = int(warmup), int(explore_every)
        # source -> (kind -> decayed tokens and seconds), decaying with the source's cycles
        self.sums: dict[str, DecayedCells] = {}
        self.counts: dict[tuple[str, str], int] = {}  # (source, kind) -> cycles observed
        self.decisions: dict[str, int] = {}  # source -> decisions taken
        self.trees = self.chains = 0  # drafting cycles observed of each kind

    def rate(self, source: str, kind: str) -> float:
        """Observed tokens per second of ``kind`` cycles of ``source`` (0 when none): the
        decayed tokens over the decayed seconds."""
        cells = self.sums.get(source)
        return cells.mean(kind) if cells is not None else 0.0

    def choose(self, source: str) -> bool:
        """Whether this drafting cycle of ``source`` should draft a tree."""
        k = self.decisions.get(source, 0)
        self.decisions[source] = k + 1
        if self.counts.get((source, "tree"), 0) < self.warmup:
            tree = True
        elif self.counts.get((source, "chain"), 0) < self.warmup:
            tree = False
        else:
            tree = self.rate(source, "tree") > self.rate(source, "chain")
            if self.explore_every and k % self.explore_every == self.explore_every - 1:
                tree = not tree
        return tree

    def observe(self, source: str, tree: bool, tokens: int, seconds: float) -> None:
        """A completed drafting cycle of ``source``: a tree or a chain, ``tokens`` emitted
        (accepted proposals and the bonus token) in ``seconds``. Non-finite or
        non-positive times are ignored."""
        if not (seconds > 0 and math.isfinite(seconds)):
            return
        kind = "tree" if tree else "chain"
        if tree:
            self.trees += 1
        else:
            self.chains += 1
        self.sums.setdefault(source, DecayedCells(self.half_life)).add(kind, float(tokens), float(seconds))
        self.counts[(source, kind)] = self.counts.get((source, kind), 0) + 1

    def describe(self) -> dict:
        """Per source, the observed tokens per second of each kind, and the cycles of each."""
        return {"tree_cycles": self.trees, "chain_cycles": self.chains,
                "tokens_per_second": {src: {k: round(self.rate(src, k), 1) for k in ("tree", "chain")}
                                      for src in self.sums}}
