"""Batch-level verification length for the batched engine (spec sections 5 and 8).

In a batched cycle (:class:`dspine.core.batch.BatchEngine`) every running request shares
one target forward of width ``max_i n_i + 1``: b requests verifying n proposals each
cost a forward over ``b * (n + 1)`` tokens. On a CPU that cost grows about in
proportion to the tokens, so a verification length that pays off for one request
(the per-request ``--verify-policy cost`` prices a cycle by the *single-request*
curve) loses at 4 or 8 concurrent requests. :class:`BatchCostPolicy` therefore
chooses **one** n per batched cycle, maximizing the batch's expected tokens per
second::

    n* = argmax_n  sum_i E_i[tokens | min(n, n_max_i)]  /  T(b, n)

- ``E_i`` is request i's expected tokens per cycle, from the censored per-position
  acceptance statistics of the wrapped :class:`~dspine.control.policy.CostModelPolicy` (the
  request's own decayed cycles blended with the pooled statistics and a prior);
- ``T(b, n)`` is the whole batched cycle's cost (drafting, final stage, the shared
  forward, per-request verification and commit) at b running requests of which d draft
  with the drafter (the others copy, at no drafter cost): the decayed mean of observed
  cycle times at (b, d, n); for a cell not observed, a prior scaled by the
  observed/prior ratio at the nearest observed (b', d', n') (same b first). The prior
  prices the forward as the single-request curve at ``b * (n + 1)`` tokens (linearly
  extrapolated past the curve's end) plus d single-request proposals of n tokens.
- Exploration, as in the per-request policy (the same
  :func:`dspine.control.estimator.explore_length`): every ``explore_every`` cycles the
  longest n, reached step by step, whose estimated cost is at most
  :data:`~dspine.control.estimator.EXPLORE_COST_RATIO` times the chosen one (so a full
  16-token verification of 8 requests is not forced; none when even one more proposal
  would cost more), and half-way between, a plain batched step (n = 0) when none was
  observed at this b recently.
- With ``observe_costs=False`` on the wrapped policy, the prior alone prices the cycles.
- Hybrid proposers (:class:`~dspine.control.per_source.PerSourcePolicy`): each request's ``E_i`` comes
  from the policy of the source its proposer planned for this cycle (``request.source``, set
  before any draw): a request copying its prompt is accepted far more often than the
  drafter's block, and pricing it with the drafter's statistics kept the batch from
  verifying copies at all (2026-12-03).

A priced controller builds it (:meth:`dspine.control.base.Controller.batch_pricing`).

Non-anticipating (exactness, spec section 5): n depends on completed cycles, the cycle
counter and measured times only, never on this cycle's draws.
"""
from __future__ import annotations

import math

from dspine.control.estimator import DecayedCells, DecisionLog, best_rate, explore_length


class BatchCostPolicy:
    """One verification length per batched cycle (see the module docstring).

    Args:
        policy: the per-request cost policy whose acceptance statistics and measured
            single-request cost curve (:class:`~dspine.control.cost_curve.CostCurve`) are used.
        max_batch: the most running requests (rows) the cost table must hold.
        cost_half_life: decay, in observed batched cycles, of the measured cycle times
            (default: the policy's ``cost_half_life``).
        explore_every: exploration period in batched cycles (default: the policy's;
            0 = never).
        sources: per proposer source, the cost policy whose acceptance statistics price
            a request of that source (a hybrid's :attr:`PerSourcePolicy.policies`); a
            request whose source has none is priced by ``policy``.
    Raises:
        ValueError: ``max_batch`` < 1, a non-positive half-life or a negative
            ``explore_every``.
    """

    MAX_DECISIONS = 4096  # ``decisions`` keeps between half and all of this many

    def __init__(self, policy, max_batch: int, cost_half_life: float | None = None,
                 explore_every: int | None = None, sources: dict | None = None):
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        if cost_half_life is not None and not float(cost_half_life) > 0:
            raise ValueError(f"cost_half_life must be > 0 (cycles), got {cost_half_life}")
        if explore_every is not None and int(explore_every) < 0:
            raise ValueError(f"explore_every must be >= 0, got {explore_every}")
        self.policy = policy
        self.sources = dict(sources or {})
        self.n_max = policy.cost.n_max
        self.times = DecayedCells(None)  # (b, d, n) -> decayed seconds and count
        self.times.decay = policy.times.decay if cost_half_life is None else DecayedCells(cost_half_life).decay
        self.explore_every = policy.explore_every if explore_every is None else int(explore_every)
        self.max_batch = int(max_batch)
        self.cycles = 0
        self.decisions = DecisionLog(self.MAX_DECISIONS)  # (b, n) of recent cycles

    # -- cost --------------------------------------------------------------------------
    def prior(self, b: int, n: int, d: int | None = None) -> float:
        """Prior cost (s) of a batched cycle of b requests verifying n proposals each, d of
        them drafted by the drafter (default: all b; copies cost no drafter forward): the
        single-request forward curve at ``b * (n + 1)`` tokens plus d proposals."""
        c = self.policy.cost
        v = c.verify_s  # v[k - 1]: forward over k tokens, k = 1 .. n_max + 1
        k = b * (n + 1)
        if k - 1 <= c.n_max:
            fwd = v[k - 1]
        else:
            mid = c.n_max // 2
            slope = max(0.0, (v[-1] - v[mid]) / (c.n_max - mid)) if c.n_max > mid else 0.0
            fwd = v[-1] + slope * (k - 1 - c.n_max)
        d = b if d is None else d
        prop = 0.0 if n == 0 else d * (c.cycle_s(n) - c.verify_s[min(n, c.n_max)])
        return fwd + prop

    def _key(self, b: int, n: int, d: int | None) -> tuple[int, int, int]:
        n = min(int(n), self.n_max)
        return (b, 0 if n == 0 else (b if d is None else min(max(int(d), 0), b)), n)

    def drafts(self, req) -> bool:
        """Whether ``req``'s proposals this cycle come from the drafter (the wrapped
        policy's source), not a copy."""
        return self.sources.get(getattr(req, "source", "") or "", self.policy) is self.policy

    def observe(self, b: int, n: int, seconds: float, d: int | None = None) -> None:
        """Add the measured wall time (s) of a batched cycle of b requests whose widest
        verification was n proposals, d of the requests drafted by the drafter (default
        b). Out-of-range or non-finite values are ignored, and so is everything when the
        wrapped policy keeps its curve as measured (``observe_costs=False``)."""
        if not self.policy.observe_costs:
            return
        if not (1 <= b <= self.max_batch and 0 <= n <= self.n_max and seconds > 0 and math.isfinite(seconds)):
            return
        self.times.add(self._key(b, n, d), seconds)

    def observed(self, b: int, n: int, d: int | None = None) -> float:
        """Decayed count of observed cycles at (b, n, d)."""
        return self.times.weight(self._key(b, n, d))

    def cycle_cost(self, b: int, n: int, d: int | None = None) -> float:
        """Estimated cost (s) of a batched cycle at (b, n, d): the observed decayed mean,
        or the prior times the observed/prior ratio at the nearest observed cell (nearest
        in b, then in drafted requests, then in n)."""
        return self.times.corrected(self._key(b, n, d), lambda k: self.prior(k[0], k[2], k[1]),
                                    lambda c, k: (abs(c[0] - k[0]), abs(c[1] - k[1]), abs(c[2] - k[2]),
                                                  c[2], c[0], c[1]))

    # -- choice ------------------------------------------------------------------------
    def expected(self, reqs, n_maxes: list[int]) -> list[list[float]]:
        """Per request, E[tokens | n] for n = 0..min(n_max_i, policy n_max), from the policy
        of the request's source (consumes the requests' completed cycles into the
        policies' statistics)."""
        pols = [self.sources.get(getattr(r, "source", "") or "", self.policy) for r in reqs]
        states = [p._state(r) for p, r in zip(pols, reqs)]  # all completed cycles pooled first
        out = []
        for pol, st, m in zip(pols, states, n_maxes):
            m = max(0, min(int(m), self.n_max, pol.cost.n_max))
            out.append(pol.expected_tokens(pol.confidence(st.stats, m)))
        return out

    def choose(self, reqs, n_maxes: list[int]) -> list[int]:
        """Verification length of each request for this cycle: ``min(n*, n_max_i)``.

        Args:
            reqs: the running requests (``cycles`` and ``source`` of each are read).
            n_maxes: the most each request may verify now (block size, remaining tokens).
        Returns:
            list of ints, one per request, each in ``0 .. n_maxes[i]``.
        """
        b = len(reqs)
        if b == 0:
            return []
        if b > self.max_batch:
            raise ValueError(f"{b} running requests exceed the policy's max_batch {self.max_batch}")
        es = self.expected(reqs, n_maxes)
        drafting = [self.drafts(r) for r in reqs]

        def cost(n: int) -> float:  # the cycle at n, priced with the requests that would draft
            return self.cycle_cost(b, n, sum(1 for dr, m in zip(drafting, n_maxes) if dr and min(n, m) > 0))

        top = max(len(e) - 1 for e in es)
        best = best_rate(range(top + 1), lambda n: sum(e[min(n, len(e) - 1)] for e in es), cost)
        n, k = best, self.explore_every
        if top > 0 and k and self.cycles % k == k - 1:  # explore longer n at a bounded cost
            n = explore_length(best, top, cost)
        elif top > 0 and k and self.cycles % k == k // 2 - 1 and self.observed(b, 0) < 0.5:
            n = 0  # probe a plain batched step at this b
        self.cycles += 1
        self.decisions.append((b, n))
        return [min(n, max(0, int(m))) for m in n_maxes]
