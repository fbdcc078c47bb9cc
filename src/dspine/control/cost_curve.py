"""The measured cost of a decode cycle on this machine (spec section 5).

:class:`CostCurve` is what the controllers price a cycle with before they have observed
any (:mod:`dspine.control.policy`, :mod:`dspine.control.batch_policy`,
:mod:`dspine.control.tree_sizer`); it is measured once per machine, target and drafter by
:func:`dspine.tune.cost.measure_cost` and corrected online by the observed cycle times
(:class:`dspine.control.estimator.DecayedCells`).
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Callable


@dataclass
class CostCurve:
    """Measured cycle cost on this machine, seconds.

    verify_s[n]: target forward over n+1 tokens (anchor + n proposals), n = 0..n_max.
    draft_s: drafter forward of a full block (n = n_max).
    final_per_row_s: final stage cost of a full block divided by n_max.
    propose_s[n]: measured cost of proposing n tokens (draft forward + final stage),
        n = 0..n_max with propose_s[0] = 0, or None. A block-causal drafter runs only
        n + 1 rows and its final stage n serial steps, so this grows with n; the
        candidate pass has a fixed part. When None (synthetic curves), a proposal costs
        ``draft_s + final_per_row_s * n``.
    """

    verify_s: list[float]
    draft_s: float = 0.0
    final_per_row_s: float = 0.0
    meta: dict = field(default_factory=dict)
    propose_s: list[float] | None = None
    #: ``on_stale(curve, ratio)``: called by a controller that finds decoding's observed
    #: cycles ``ratio`` times this curve's cost (set where the curve was measured and cached,
    #: :func:`dspine.tune.cost.flag_stale_curve`); not saved
    on_stale: Callable[["CostCurve", float], None] | None = field(default=None, compare=False, repr=False)

    def __post_init__(self):
        """Raises ValueError: an empty curve, or a cost that is negative or not finite
        (a curve loaded with :meth:`from_dict` must not make some n look free)."""
        if not self.verify_s:
            raise ValueError("CostCurve.verify_s is empty (need the cost of n = 0)")
        vals = list(self.verify_s) + [self.draft_s, self.final_per_row_s] + list(self.propose_s or [])
        bad = [v for v in vals if not (math.isfinite(v) and v >= 0)]
        if bad:
            raise ValueError(f"CostCurve costs must be finite and >= 0 seconds, got {bad[0]!r}")
        if self.propose_s is not None and len(self.propose_s) != len(self.verify_s):
            raise ValueError(f"CostCurve.propose_s has {len(self.propose_s)} values, verify_s {len(self.verify_s)}")

    @property
    def n_max(self) -> int:
        return len(self.verify_s) - 1

    def cycle_s(self, n: int) -> float:
        """Cost of a cycle verifying n proposals (n = 0: plain autoregressive step; beyond
        ``n_max``: the cost at ``n_max``).

        Raises:
            ValueError: a negative n.
        """
        if n < 0:
            raise ValueError(f"CostCurve.cycle_s: n must be >= 0, got {n}")
        n = min(n, self.n_max)
        c = self.verify_s[n]
        if n > 0:
            c += self.propose_s[n] if self.propose_s else self.draft_s + self.final_per_row_s * n
        return c

    def to_dict(self) -> dict:
        d = asdict(self)
        d.pop("on_stale", None)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "CostCurve":
        return cls(**d)



def copy_cost(curve: CostCurve) -> CostCurve:
    """``curve`` for a proposer that drafts for free (copies): the target's verification
    only; the cost of looking a match up is in the observed cycle times."""
    return CostCurve(list(curve.verify_s), 0.0, 0.0, meta={**curve.meta, "proposer": "copy"},
                     propose_s=[0.0] * len(curve.verify_s), on_stale=curve.on_stale)

