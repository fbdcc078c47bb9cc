"""Verification-length policies: how many drafted tokens to verify per cycle (spec section 5).

The engine asks ``policy(request, n_max) -> n`` at the start of every cycle, *before*
the drafter proposes (``Engine.verification_length``), so a policy can only use what
is known before the tokens it covers are drawn: statistics of earlier cycles, the
measured cost curve, the settings. That makes every policy here *non-anticipating*:
the choice of n is independent of this cycle's random draws, so speculative sampling
stays exact for every n (proved by the distribution test in ``tests/test_policy.py``,
where an anticipating rule that cuts the block after looking at a sampled token fails).

Policies:

- :class:`dspine.control.base.FixedPolicy` (``fixed``; the library default when no policy is given, while ``dspine generate`` and ``serve`` default to ``cost``): always ``n_max`` (or a set n).
- :class:`CostModelPolicy` (``cost``): chooses n maximizing expected tokens per second,
  ``E[tokens | n] / C(n)``, where

  * ``E[tokens | n] = 1 + sum_{k<=n} S_k`` with ``S_k = prod_{j<=k} c_j`` the chance
    that the first k proposals are all accepted, and ``c_j`` the draft's confidence at
    position j: the acceptance rate of position j among earlier cycles that verified it
    with positions < j accepted (a censored, Kaplan-Meier style estimate, so positions
    cut by a short n are not counted as rejections). This request's cycles
    (exponentially decayed, ``half_life``) are blended with the statistics of all
    requests this policy has seen (the workload's profile) and a prior ``prior_accept``;
  * ``C(n)`` is the cycle cost measured once on this machine (:func:`dspine.tune.cost.measure_cost`,
    cached per target/drafter/device/dtype): the target forward over n+1 tokens plus,
    for n >= 1, the cost of proposing n tokens (a block-causal drafter runs n+1 rows
    and n serial final-stage steps, so a short verification also drafts cheaply). n = 0
    is a plain autoregressive step (no drafting). The one-shot measurement (a 64-token
    context, whatever else the machine was doing then) is corrected online: every
    completed cycle's measured time (draft + final stage + verification) updates a
    decayed mean per n, which replaces the curve's value once observed; an n not
    observed is the curve scaled by the observed/measured ratio at the nearest observed
    n, and a plain step (n = 0) is probed now and then so the comparison with ``ar``
    stays real.

Per proposer source: :class:`dspine.control.per_source.PerSourcePolicy`; built by name (the
cost curve measured once per machine): :func:`dspine.tune.controller.make_policy`.

A policy that *truncates the block after looking at which token was sampled* (e.g.
dropping the first proposal equal to some token) is anticipating: the verified
proposal at that position is then drawn from q conditioned on not being that token
while the verifier still divides by q, which biases the output.
"""
from __future__ import annotations

import math
import statistics

from dspine.control.cost_curve import CostCurve
from dspine.control.estimator import (EXPLORE_COST_RATIO, AcceptanceStats, DecayedCells, DecisionLog,
                                      best_rate, decay_factor, expected_tokens, explore_length)
from dspine.control.priced import PricedController


class _RequestState:
    __slots__ = ("stats", "seen", "last_explore")

    def __init__(self, half_life: float):
        self.stats = AcceptanceStats(half_life)
        self.seen = 0  # req.cycles consumed
        self.last_explore = 0  # req.cycles consumed when a longer n was last explored


class CostModelPolicy(PricedController):
    """Choose n maximizing expected tokens per second (see the module docstring).

    Args:
        cost: the measured :class:`CostCurve` (:func:`dspine.tune.cost.measure_cost`).
        prior_accept: prior per-position acceptance rate c_j before any statistics.
        prior_weight: pseudo-cycles of that prior.
        half_life: decay (cycles) of a request's own statistics.
        global_half_life: decay of the statistics pooled over requests.
        global_weight_cap: at most this many pseudo-cycles of pooled statistics act as
            the prior of a request (so a request's own behaviour takes over quickly).
        explore_every: every this many cycles of a request (times the cost ratio of the
            explored cycle to the chosen one, :meth:`explore_period`), verify a longer n
            than the estimate chooses, the longest costing at most twice the chosen n
            (:meth:`explore_length`), so positions a short n never reaches keep being
            measured (0: never); half-way between, a plain step (n = 0) when its observed
            cost has decayed away. The choice depends on the cycle count and on completed
            cycles only: non-anticipating.
        observe_costs: correct the measured cost curve with the measured times of
            completed single-request cycles (see the module docstring; a batched cycle's
            shared forward is not one request's cost); False keeps the curve as measured.
        cost_half_life: decay, in observed cycles, of those measured times.
        source: count only cycles of this proposer source (``CycleRecord.source``); None
            counts every cycle. :class:`PerSourcePolicy` keeps one policy per source. The
            time of a plain step (n = 0) is observed from every source's cycles: it is the
            same target step whichever source planned it.
        depth_prior: the prior of position j > 1 is the estimate at position j - 1
            (:meth:`confidence`); False (the default): ``prior_accept`` at every position.
            Measured on 2026-12-04 and not adopted: 0.91-1.10x the default over three runs,
            edits slower in all three (``benchmarks/archive/contested_copies.py``, docs/decisions.md).
    """

    name = "cost"
    MAX_DECISIONS = 4096  # ``decisions`` (recent choices of n) keeps between half and all of this many
    STALE_CYCLES = 32  # observed cycles whose median time, against the curve's, decides staleness
    STALE_RATIO = 2.0  # observed / measured beyond this (or below its inverse): the curve is stale
    STALE_MIN_S = 0.002  # curve values below this are not judged (Python overhead dominates them)

    def __init__(self, cost: CostCurve, prior_accept: float = 0.6, prior_weight: float = 2.0,
                 half_life: float = 64.0, global_half_life: float = 1024.0, global_weight_cap: float = 16.0,
                 explore_every: int = 16, observe_costs: bool = True, cost_half_life: float = 64.0,
                 source: str | None = None, depth_prior: bool = False):
        if not 0.0 <= prior_accept <= 1.0:
            raise ValueError(f"prior_accept must be in [0, 1], got {prior_accept}")
        if explore_every < 0:
            raise ValueError(f"explore_every must be >= 0, got {explore_every}")
        if not cost_half_life > 0:
            raise ValueError(f"cost_half_life must be > 0 (cycles), got {cost_half_life}")
        if not isinstance(cost, CostCurve):
            raise ValueError(f"cost must be a measured CostCurve, got {type(cost).__name__}")
        if not (prior_weight >= 0 and math.isfinite(prior_weight)):
            raise ValueError(f"prior_weight must be a finite number >= 0 (pseudo-cycles), got {prior_weight}")
        if not (global_weight_cap >= 0 and math.isfinite(global_weight_cap)):
            raise ValueError(f"global_weight_cap must be a finite number >= 0 (pseudo-cycles), got {global_weight_cap}")
        if isinstance(explore_every, bool) or int(explore_every) != explore_every:
            raise ValueError(f"explore_every must be a whole number of cycles, got {explore_every}")
        decay_factor(half_life)  # ValueError for a negative or NaN half-life, now rather than at the first request
        self.times = DecayedCells(cost_half_life)  # n -> decayed measured cycle seconds and count
        self.cost = cost
        self.prior_accept, self.prior_weight = prior_accept, prior_weight
        self.half_life, self.global_weight_cap = half_life, global_weight_cap
        self.explore_every = explore_every
        self.pooled = AcceptanceStats(global_half_life)
        self.decisions = DecisionLog(self.MAX_DECISIONS)
        self.observe_costs = observe_costs
        self._costs: list[float] | None = None  # cycle_cost for every n, until an observation changes
        self.profile_key: str | None = None  # set by make_policy(persist=True)
        self.source = source  # only cycles of this proposer source count (None: every cycle)
        self.depth_prior = bool(depth_prior)
        self._ratios: list[float] = []  # observed / measured of the last STALE_CYCLES judged cycles
        self.stale_ratio: float | None = None  # set once the curve was found stale

    # cycle cost ----------------------------------------------------------------------------
    def observe(self, n: int, seconds: float) -> None:
        """Add the measured time of a completed cycle that verified ``n`` proposals."""
        if not (0 <= n <= self.cost.n_max and seconds > 0 and math.isfinite(seconds)):
            return
        self.times.add(n, seconds)
        self._costs = None
        measured = self.cost.cycle_s(n)
        if self.stale_ratio is None and measured >= self.STALE_MIN_S:
            self._ratios.append(seconds / measured)
            del self._ratios[:-self.STALE_CYCLES]
            if len(self._ratios) == self.STALE_CYCLES:
                r = statistics.median(self._ratios)
                if r > self.STALE_RATIO or r < 1.0 / self.STALE_RATIO:
                    self.stale_ratio = r
                    if self.cost.on_stale is not None:  # e.g. mark the tune cache entry (tune/cost.py)
                        self.cost.on_stale(self.cost, r)

    def cycle_cost(self, n: int) -> float:
        """Estimated cost (s) of a cycle verifying n proposals: the decayed mean of the
        observed times at n; for an n not observed (yet, or decayed below half a cycle),
        the measured curve times the observed/measured ratio at the nearest observed n.
        Computed for every n at once and reused until an observation changes (a decision
        asks for every n, and at ~8 ms per target step the policy's own time counts)."""
        if self._costs is None:  # cleared by every write of the observations
            self._costs = self._cycle_costs()
        return self._costs[min(n, self.cost.n_max)]

    def _cycle_costs(self) -> list[float]:
        """:meth:`cycle_cost` of every n = 0..n_max (:meth:`DecayedCells.corrected`: the
        observed mean, or the curve scaled by observed/measured at the nearest observed n)."""
        curve = [self.cost.cycle_s(n) for n in range(self.cost.n_max + 1)]
        if not self.observe_costs:
            return curve
        seen = self.times.reference_keys()  # once for every n
        return [self.times.corrected(n, lambda k: curve[k], lambda k, m: (abs(k - m), k), seen)
                for n in range(len(curve))]

    # statistics ----------------------------------------------------------------------------
    def _state(self, req) -> _RequestState:
        states = req.control_state  # one state per policy object, so a policy swapped out and
        st = states.get(self)  # back in does not count the same cycles twice
        if st is None:
            st = states[self] = _RequestState(self.half_life)
        for c in req.cycles[st.seen:]:  # completed cycles only: never this cycle's draws
            t = [getattr(c, f, None) for f in ("draft_s", "final_s", "verify_s")]
            timed = self.observe_costs and None not in t and not getattr(c, "batched", False)
            if self.source is not None and getattr(c, "source", self.source) != self.source:
                # another source's cycle (PerSourcePolicy): its own policy counts it, except the
                # cost of a plain step, which is the same step whichever source planned it. A
                # source that mostly verifies (a one-token copy on chat) otherwise priced n = 0
                # as the curve scaled by its own n = 1 overhead and took copies that lose
                if timed and int(c.n) == 0:
                    self.observe(0, float(sum(t)))
                continue
            # a drafting cycle's time includes projecting the draft context of the positions
            # committed since the last one (lazy commits; ``c.context_s``): charging only one
            # position's share of it made the defaults 0.95x / 0.98x (code / chat) on a Zen 4
            # EPYC, drafting more where the drafter does not pay (docs/decisions.md)
            a = max(0, int(c.emitted) - 1)
            st.stats.update(int(c.n), a)
            self.pooled.update(int(c.n), a)
            if timed:
                self.observe(int(c.n), float(sum(t)))
        st.seen = len(req.cycles)
        return st

    def confidence(self, stats: AcceptanceStats, n_max: int) -> list[float]:
        """Estimated acceptance rate c_j for positions j = 1..n_max.

        Each position's counts (this request's, then the pooled ones) are shrunk towards a
        prior of ``prior_weight`` pseudo-cycles: ``prior_accept`` at every position or, with
        ``depth_prior``, at position 1 only and the estimate of position j - 1 at position
        j > 1, so positions rarely verified inherit what the shallower ones showed (a copy
        accepted 19 times in 20 at positions 1-3 is then priced as likely right at position
        4, where the flat prior keeps it at 3-token verifications; not the default: no
        consistent gain in time, docs/decisions.md, 2026-12-04)."""
        out = []
        prior, pw, depth_prior = self.prior_accept, self.prior_weight, self.depth_prior
        cap = max(self.global_weight_cap, pw)
        g_acc, g_risk, r_acc, r_risk = self.pooled.acc, self.pooled.risk, stats.acc, stats.risk
        for k in range(n_max):  # AcceptanceStats.counts, inlined: this runs every cycle
            ga, gr = (g_acc[k], g_risk[k]) if k < len(g_risk) else (0.0, 0.0)
            m = (ga + pw * prior) / (gr + pw)
            w = min(gr + pw, cap)
            ra, rr = (r_acc[k], r_risk[k]) if k < len(r_risk) else (0.0, 0.0)
            out.append((ra + w * m) / (rr + w))
            if depth_prior:
                prior = out[-1]
        return out

    @staticmethod
    def expected_tokens(conf: list[float]) -> list[float]:
        """E[tokens emitted | n] for n = 0..len(conf) (:func:`dspine.control.estimator.expected_tokens`)."""
        return expected_tokens(conf)

    def choose(self, conf: list[float], n_max: int) -> int:
        """argmax_n E[tokens | n] / C(n) over 0..n_max (smallest n on ties)."""
        n_max = min(n_max, self.cost.n_max)
        e = expected_tokens(conf[:n_max])
        return best_rate(range(n_max + 1), e.__getitem__, self.cycle_cost)

    # persisted profile ---------------------------------------------------------------------
    PROFILE_CYCLES = 64.0  # a loaded profile weighs at most this many cycles

    def restore_profile(self, e: dict | None) -> bool:
        """Start from the pooled acceptance statistics and observed cycle costs of ``e``, a
        profile an earlier run of the same target and drafter on this machine saved
        (:meth:`profile`; stored by :mod:`dspine.tune.controller`), scaled down to at most
        :attr:`PROFILE_CYCLES` cycles, so a new process does not pay again to learn what
        drafting is worth here. Returns True when it was restored; a missing or damaged
        entry is ignored (False)."""
        try:
            risk, acc = [float(x) for x in e["risk"]], [float(x) for x in e["acc"]]
            obs_sum, obs_w = [float(x) for x in e["obs_sum"]], [float(x) for x in e["obs_w"]]
            n_cells = self.cost.n_max + 1
        except (TypeError, KeyError, ValueError):
            return False
        if len(risk) != len(acc) or len(obs_sum) != n_cells or len(obs_w) != n_cells \
                or any(not (math.isfinite(v) and v >= 0) for v in risk + acc + obs_sum + obs_w) \
                or any(a > r + 1e-9 for a, r in zip(acc, risk)):
            return False
        k = min(1.0, self.PROFILE_CYCLES / max(risk[0] if risk else 0.0, 1e-9))
        self.pooled.risk, self.pooled.acc = [r * k for r in risk], [a * k for a in acc]
        kw = min(1.0, 8.0 / max(max(obs_w, default=0.0), 1e-9))  # costs: a few cycles' weight
        self.times.cells = {n: [x * kw, w * kw] for n, (x, w) in enumerate(zip(obs_sum, obs_w)) if w > 0}
        self._costs = None
        return True

    def profile(self) -> dict:
        """The pooled acceptance statistics and observed cycle costs, to be saved for the next
        run (JSON-ready; :meth:`restore_profile`)."""
        ns = range(self.cost.n_max + 1)
        return {"risk": self.pooled.risk, "acc": self.pooled.acc,
                "obs_sum": [self.times.total(n) for n in ns], "obs_w": [self.times.weight(n) for n in ns],
                "cycles": self.pooled.cycles}

    #: an exploration verifies the longest n whose estimated cycle costs at most this times
    #: the chosen n's (single requests and batches alike, :mod:`dspine.control.estimator`)
    EXPLORE_COST_RATIO = EXPLORE_COST_RATIO

    def explore_length(self, chosen: int, n_max: int) -> int:
        """The n an exploration verifies (:func:`dspine.control.estimator.explore_length`):
        the longest n <= ``n_max`` whose estimated cycle cost is at most
        :attr:`EXPLORE_COST_RATIO` times the chosen n's. Exploring the whole ``n_max``
        instead cost up to ~3.5 plain steps per exploration on the lean path (a 7-token
        copy, 25 ms vs 7 ms) for positions rarely reached on chat."""
        return explore_length(chosen, min(n_max, self.cost.n_max), self.cycle_cost, self.EXPLORE_COST_RATIO)

    def explore_period(self, chosen: int, explored: int) -> int:
        """Cycles between explorations: ``explore_every`` times the cost ratio of the
        ``explored`` cycle to the chosen one, so exploring stays a bounded share of the
        decode time however expensive verification is on this machine."""
        c = self.cycle_cost(chosen)
        ratio = self.cycle_cost(explored) / c if c > 0 else 1.0
        return max(self.explore_every, math.ceil(self.explore_every * max(1.0, ratio)))

    def pricing_parts(self) -> tuple:
        """A batch is priced with this policy's curve and statistics alone."""
        return self, None

    def __call__(self, req, n_max: int) -> int:
        st = self._state(req)
        e = self.explore_every
        n = self.choose(self.confidence(st.stats, n_max), n_max)
        nx = self.explore_length(n, n_max) if e and n < n_max else n
        if nx > n and st.seen - st.last_explore >= self.explore_period(n, nx):
            n = nx
            st.last_explore = st.seen
        elif e and st.seen % e == e // 2 - 1 and self.times.cells and self.times.weight(0) < 0.5:
            n = 0  # probe a plain step: its observed cost decayed away (or was never seen)
        self.decisions.append(n)  # bounded: a server runs for days
        return n
