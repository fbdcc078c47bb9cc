"""The estimator every controller shares: decayed rates and costs, and the rate argmax.

Every online decision of the engine (how many proposals to verify, for one request or a
whole batch; copy or draft; tree or chain; how many tree nodes) has the same shape: pick
the option with the most expected tokens per second, from statistics of *completed*
cycles that forget at a half-life, now and then trying an option the estimate would not
pick so it keeps being measured. This module holds those parts once:

- :func:`decay_factor`: the per-observation factor of a half-life;
- :class:`DecayedCells`: decayed (sum, weight) cells under any key (cycle times per
  verification length, per (batch, drafted, length), tokens and seconds per tree kind,
  calibration counts per probability bin), with the nearest-observed-cell correction of a
  prior cost (:meth:`DecayedCells.corrected`);
- :class:`AcceptanceStats`: censored per-position acceptance counts (spec section 5);
- :func:`best_rate`: ``argmax_n value[n] / cost[n]``, the smallest n on ties;
- :func:`explore_length`: the longest option costing at most
  :data:`EXPLORE_COST_RATIO` times the chosen one;
- :class:`DecisionLog`: the bounded log of recent choices (a server runs for days).

Non-anticipating by construction: nothing here sees a cycle before it completed, so the
controllers built on it keep speculative sampling exact (spec section 5).
"""
from __future__ import annotations

import math
from typing import Callable, Hashable, Iterable, Sequence

#: an exploration verifies the longest option whose estimated cost is at most this times
#: the chosen option's (single requests and batches alike)
EXPLORE_COST_RATIO = 2.0


def decay_factor(half_life: float | None) -> float:
    """Factor applied to old observations per new one so that an observation's weight
    halves after ``half_life`` observations; 1.0 (no decay) for None, 0 or +infinity.

    Raises:
        ValueError: a negative (-infinity included) or NaN half-life.
    """
    if half_life is None or half_life == 0 or half_life == math.inf:
        return 1.0
    if not half_life > 0:
        raise ValueError(f"half_life must be > 0 (observations), got {half_life}")
    return 0.5 ** (1.0 / half_life)


class DecayedCells:
    """Decayed sums and weights under hashable keys.

    Each :meth:`add` first multiplies every cell by the decay factor (all cells age
    together: a key not seen for a while loses weight), then adds ``value`` to the key's
    sum and ``weight`` to its weight.

    Args:
        half_life: in observations (:func:`decay_factor`).
    """

    def __init__(self, half_life: float | None):
        self.decay = decay_factor(half_life)
        self.cells: dict[Hashable, list[float]] = {}

    def add(self, key: Hashable, value: float, weight: float = 1.0) -> None:
        if self.decay < 1.0:
            for c in self.cells.values():
                c[0] *= self.decay
                c[1] *= self.decay
        c = self.cells.setdefault(key, [0.0, 0.0])
        c[0] += float(value)
        c[1] += float(weight)

    def total(self, key: Hashable) -> float:
        """The decayed sum at ``key`` (0 when never observed)."""
        return self.cells.get(key, (0.0, 0.0))[0]

    def weight(self, key: Hashable) -> float:
        """The decayed weight (count) at ``key`` (0 when never observed)."""
        return self.cells.get(key, (0.0, 0.0))[1]

    def mean(self, key: Hashable, default: float = 0.0) -> float:
        """sum / weight at ``key``, or ``default`` when its weight is 0."""
        s, w = self.cells.get(key, (0.0, 0.0))
        return s / w if w > 0 else default

    def observed(self, min_weight: float = 0.5) -> list:
        """Keys whose weight is at least ``min_weight`` (half an observation by default:
        older ones have decayed away)."""
        return [k for k, c in self.cells.items() if c[1] >= min_weight]

    def corrected(self, key: Hashable, prior: Callable[[Hashable], float],
                  distance: Callable[[Hashable, Hashable], tuple], seen: list | None = None) -> float:
        """Estimated mean at ``key``: the observed mean where ``key`` was observed; else
        ``prior(key)`` times observed/prior at the nearest observed key (``distance``
        orders the candidates, ties broken by the tuple); the prior alone when nothing
        was observed. So a one-shot measurement follows the machine's load. ``seen``:
        :meth:`reference_keys`, when the caller has already found them."""
        if self.weight(key) >= 0.5:
            return self.mean(key)
        if seen is None:
            seen = self.reference_keys()
        p = prior(key)
        if not seen:
            return p
        near = min(seen, key=lambda k: distance(k, key))
        pn = prior(near)
        return p * self.mean(near) / pn if pn > 0 else p

    def reference_keys(self) -> list:
        """The keys :meth:`corrected` scales from: those observed (half an observation or
        more), else any with weight. Pass them to :meth:`corrected` when estimating many
        keys at once, so they are found once."""
        return self.observed() or [k for k, c in self.cells.items() if c[1] > 0]

    def scale(self, k: float) -> None:
        """Multiply every sum and weight by ``k`` (a loaded profile weighs a few cycles)."""
        for c in self.cells.values():
            c[0] *= k
            c[1] *= k


class AcceptanceStats:
    """Exponentially decayed, censored per-position acceptance counts (spec section 5).

    ``risk[k]``: cycles that verified position k+1 with positions <= k accepted;
    ``acc[k]``: those of them that accepted position k+1. A position cut by a short
    verification is not counted as a rejection (Kaplan-Meier style).
    """

    def __init__(self, half_life: float | None):
        self.decay = decay_factor(half_life)
        self.risk: list[float] = []
        self.acc: list[float] = []
        self.cycles = 0

    def update(self, n: int, accepted: int) -> None:
        """Add one cycle that verified ``n`` proposals and accepted ``accepted``."""
        if n <= 0:
            return
        if self.decay < 1.0:
            self.risk = [r * self.decay for r in self.risk]
            self.acc = [a * self.decay for a in self.acc]
        while len(self.risk) < n:
            self.risk.append(0.0)
            self.acc.append(0.0)
        for k in range(min(n, accepted + 1)):  # positions 1..min(n, a+1) were at risk
            self.risk[k] += 1.0
            if k < accepted:
                self.acc[k] += 1.0
        self.cycles += 1

    def counts(self, k: int) -> tuple[float, float]:
        """(accepted, at risk) for position k+1 (zeros when never verified)."""
        return (self.acc[k], self.risk[k]) if k < len(self.risk) else (0.0, 0.0)


def expected_tokens(conf: Sequence[float]) -> list[float]:
    """E[tokens emitted | n] for n = 0..len(conf) given per-position acceptance rates
    ``conf`` (c_1..c_N): ``1 + sum_{k<=n} prod_{j<=k} c_j`` (the bonus token included;
    spec section 5)."""
    e, s, out = 1.0, 1.0, [1.0]
    for c in conf:
        s *= c
        e += s
        out.append(e)
    return out


def best_rate(options: Iterable[int], value: Callable[[int], float], cost: Callable[[int], float],
              default: int = 0) -> int:
    """The option with the highest ``value(o) / cost(o)`` (a free option wins), the first
    in ``options`` on ties (within a relative 1e-9); ``default`` when there is none. An
    option whose cost or value is not a number (NaN) is never chosen: an unknown cost is not
    a free one."""
    best, best_rate_ = default, -1.0
    for o in options:
        c, v = cost(o), value(o)
        if math.isnan(c) or math.isnan(v):
            continue
        r = v / c if c > 0 else math.inf
        if r > best_rate_ * (1 + 1e-9):
            best, best_rate_ = o, r
    return best


def explore_length(chosen: int, top: int, cost: Callable[[int], float],
                   ratio: float = EXPLORE_COST_RATIO) -> int:
    """The longest n in ``chosen..top``, reached step by step from ``chosen``, whose cost
    is at most ``ratio`` times ``cost(chosen)`` (``chosen`` when even one more costs
    more). Longer options are then reached once the explored ones prove worth it."""
    limit = ratio * cost(chosen)
    n = chosen
    for k in range(chosen + 1, top + 1):
        if cost(k) > limit:
            break
        n = k
    return n


class DecisionLog(list):
    """A list of recent decisions that keeps between half and all of ``limit`` entries."""

    def __init__(self, limit: int = 4096):
        super().__init__()
        self.limit = int(limit)

    def append(self, item) -> None:  # noqa: D102
        super().append(item)
        if len(self) > self.limit:
            del self[: len(self) - self.limit // 2]
