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
- Exploration, as in the per-request policy but bounded for batches: every
  ``explore_every`` cycles the longest n whose estimated cost is at most twice the
  chosen one (so a full 16-token verification of 8 requests is not forced; none when even
  one more proposal would cost more), and half-way between, a plain batched step (n = 0)
  when none was observed at this b recently.
- With ``observe_costs=False`` on the wrapped policy, the prior alone prices the cycles.
- Hybrid proposers (:class:`~dspine.control.policy.PerSourcePolicy`): each request's ``E_i`` comes
  from the policy of the source its proposer planned for this cycle (``request.source``, set
  before any draw): a request copying its prompt is accepted far more often than the
  drafter's block, and pricing it with the drafter's statistics kept the batch from
  verifying copies at all (2026-12-03).

Non-anticipating (exactness, spec section 5): n depends on completed cycles, the cycle
counter and measured times only, never on this cycle's draws.
"""
from __future__ import annotations

import math

from dspine.control.policy import CostModelPolicy


class BatchCostPolicy:
    """One verification length per batched cycle (see the module docstring).

    Args:
        policy: the per-request cost policy whose acceptance statistics and measured
            single-request cost curve (:class:`~dspine.control.policy.CostCurve`) are used.
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

    def __init__(self, policy: CostModelPolicy, max_batch: int, cost_half_life: float | None = None,
                 explore_every: int | None = None, sources: dict[str, CostModelPolicy] | None = None):
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        if cost_half_life is not None and not float(cost_half_life) > 0:
            raise ValueError(f"cost_half_life must be > 0 (cycles), got {cost_half_life}")
        if explore_every is not None and int(explore_every) < 0:
            raise ValueError(f"explore_every must be >= 0, got {explore_every}")
        self.policy = policy
        self.sources = {k: v for k, v in (sources or {}).items() if isinstance(v, CostModelPolicy)}
        self.n_max = policy.cost.n_max
        if cost_half_life is None:
            self.decay = policy.cost_decay
        else:
            hl = float(cost_half_life)
            self.decay = 0.5 ** (1.0 / hl) if math.isfinite(hl) else 1.0
        self.explore_every = policy.explore_every if explore_every is None else int(explore_every)
        self.max_batch = int(max_batch)
        self.obs: dict[tuple[int, int, int], list[float]] = {}  # (b, d, n) -> [decayed seconds, decayed count]
        self.cycles = 0
        self.decisions: list[tuple[int, int]] = []  # (b, n) of recent cycles, bounded

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
        if self.decay < 1.0:
            for cell in self.obs.values():
                cell[0] *= self.decay
                cell[1] *= self.decay
        cell = self.obs.setdefault(self._key(b, n, d), [0.0, 0.0])
        cell[0] += seconds
        cell[1] += 1.0

    def observed(self, b: int, n: int, d: int | None = None) -> float:
        """Decayed count of observed cycles at (b, n, d)."""
        return self.obs.get(self._key(b, n, d), (0.0, 0.0))[1]

    def cycle_cost(self, b: int, n: int, d: int | None = None) -> float:
        """Estimated cost (s) of a batched cycle at (b, n, d): the observed decayed mean,
        or the prior times the observed/prior ratio at the nearest observed cell (nearest
        in b, then in drafted requests, then in n)."""
        key = self._key(b, n, d)
        cell = self.obs.get(key)
        if cell is not None and cell[1] >= 0.5:
            return cell[0] / cell[1]
        cells = [k for k, c in self.obs.items() if c[1] >= 0.5]
        b, d, n = key
        if not cells:
            return self.prior(b, n, d)
        bb, dd, nn = min(cells, key=lambda c: (abs(c[0] - b), abs(c[1] - d), abs(c[2] - n), c[2], c[0], c[1]))
        p = self.prior(bb, nn, dd)
        mean = self.obs[(bb, dd, nn)][0] / self.obs[(bb, dd, nn)][1]
        return self.prior(b, n, d) * mean / p if p > 0 else self.prior(b, n, d)

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
        best, best_rate = 0, -1.0
        for n in range(top + 1):
            tokens = sum(e[min(n, len(e) - 1)] for e in es)
            c = cost(n)
            rate = tokens / c if c > 0 else float("inf")
            if rate > best_rate * (1 + 1e-9):
                best, best_rate = n, rate
        n, k = best, self.explore_every
        if top > 0 and k and self.cycles % k == k - 1:  # explore longer n, at most 2x the cost
            limit = 2.0 * cost(best)
            n = max(m for m in range(best, top + 1) if m == best or cost(m) <= limit)
        elif top > 0 and k and self.cycles % k == k // 2 - 1 and self.observed(b, 0) < 0.5:
            n = 0  # probe a plain batched step at this b
        self.cycles += 1
        self.decisions.append((b, n))
        if len(self.decisions) > self.MAX_DECISIONS:
            del self.decisions[: len(self.decisions) - self.MAX_DECISIONS // 2]
        return [min(n, max(0, int(m))) for m in n_maxes]
