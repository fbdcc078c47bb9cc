"""One cost policy per proposer source: the copy-or-draft hybrid's controller (spec section 5).

A copied continuation and a drafter's block are accepted at very different rates and
cost differently, so :class:`PerSourcePolicy` keeps a
:class:`~dspine.control.policy.CostModelPolicy` per source, asks the one of the source the
proposer planned (``request.source``), and picks the source with the higher expected
tokens per second (:meth:`PerSourcePolicy.pick`). Non-anticipating like its parts.
"""
from __future__ import annotations

from dspine.control.cost_curve import CostCurve
from dspine.control.policy import CostModelPolicy
from dspine.control.priced import PricedController


class PerSourcePolicy(PricedController):
    """One :class:`CostModelPolicy` per proposer source (the copy-or-draft hybrid).

    A copied continuation and a drafter's block are accepted at very different rates and
    cost differently (a copy needs no drafter forward), so each source keeps its own
    acceptance statistics, observed cycle costs and cost curve; the engine sets
    ``request.source`` from :meth:`Proposer.plan` (before any draw) and this policy asks
    that source's policy. Non-anticipating like its parts.

    Args:
        policies: source name -> its policy (each built with ``source=`` that name).
        default: the source asked when a request's source has no policy of its own; its
            policy's acceptance profile is the one persisted.
    """

    name = "cost"

    def __init__(self, policies: dict[str, CostModelPolicy], default: str):
        if default not in policies:
            raise ValueError(f"PerSourcePolicy default {default!r} is not among {sorted(policies)}")
        self.policies, self.default = dict(policies), default

    @property
    def profile_key(self) -> str | None:
        return self.policies[self.default].profile_key

    @property
    def cost(self) -> CostCurve:
        """The default source's measured cost curve (the drafter's)."""
        return self.policies[self.default].cost

    def profile(self) -> dict:
        """The default source's profile (:meth:`CostModelPolicy.profile`)."""
        return self.policies[self.default].profile()

    @property
    def decisions(self) -> list[int]:
        return [n for p in self.policies.values() for n in p.decisions]

    def __call__(self, req, n_max: int) -> int:
        src = getattr(req, "source", "") or self.default
        return self.policies.get(src, self.policies[self.default])(req, n_max)

    def rate(self, req, source: str, n_max: int) -> float:
        """Expected tokens per second of the best n in 1..``n_max`` for ``source``, from
        that source's statistics (this request's and the pooled ones) and cost; 0 for a
        source without a cost policy. n = 0 (a plain target step) is left out: it is the
        same step whichever source is chosen, so it must not decide between them (its
        observed cost differs between sources only by noise)."""
        pol = self.policies.get(source)
        if not isinstance(pol, CostModelPolicy) or n_max <= 0:
            return 0.0
        st = pol._state(req)
        n_max = min(n_max, pol.cost.n_max)
        e = pol.expected_tokens(pol.confidence(st.stats, n_max))
        return max((e[n] / c for n in range(1, n_max + 1) if (c := pol.cycle_cost(n)) > 0), default=0.0)

    def pricing_parts(self) -> tuple:
        """A batched forward is priced with the default (drafter's) curve, each request with
        its source's statistics."""
        return self.policies[self.default], self.policies

    def picker(self, req):
        """``pick(plans) -> plan`` for ``req``: :meth:`pick` (the controller chooses the source)."""
        return lambda plans: self.pick(req, plans)

    def pick(self, req, plans: list):
        """The plan (:class:`~dspine.proposers.base.Plan`) with the highest :meth:`rate`;
        the first on ties. Reads only completed cycles: non-anticipating."""
        return max(plans, key=lambda p: (self.rate(req, p.source, p.max_n), -plans.index(p)))
