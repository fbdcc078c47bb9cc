"""The controller interface: what the engine asks before each cycle (spec section 5).

A controller decides, per request and cycle, from completed cycles only (so sampling
stays exact for every choice):

- the **source** of the proposal when the proposer offers alternatives (a copy or the
  drafter, :meth:`Controller.picker`);
- the **verification length** n, ``0 <= n <= n_max`` (:meth:`Controller.__call__`;
  n = 0 is a plain target step);
- whether the cycle is **priced**: :attr:`Controller.cost` is the measured cost curve
  when the controller chooses by expected tokens per second (then the engine also sizes
  draft trees and gates trees against chains with it, :mod:`dspine.control.tree_sizer`,
  :mod:`dspine.control.tree_gate`; a batch is priced by
  :func:`dspine.control.batch_policy.batch_controller`), None for fixed settings.

Every method is defined here, so the engine calls them without probing.
"""
from __future__ import annotations

from typing import Callable


class Controller:
    """Base of the controllers (:class:`FixedPolicy`, :class:`dspine.control.policy.CostModelPolicy`,
    :class:`dspine.control.policy.PerSourcePolicy`).

    ``req`` below is a :class:`dspine.core.engine.Request` (``cycles``, ``source``,
    ``drafted_at``, ``accepted_at`` are read).
    """

    name = "base"
    #: the measured :class:`~dspine.control.cost_curve.CostCurve` when this controller
    #: prices cycles, else None
    cost = None

    def __call__(self, req, n_max: int) -> int:
        """The verification length for ``req``'s next cycle, ``0 <= n <= n_max``, chosen
        before anything is drafted."""
        raise NotImplementedError

    def picker(self, req) -> Callable | None:
        """``pick(plans) -> plan`` choosing ``req``'s source among a proposer's
        alternatives (:class:`dspine.proposers.base.Plan`), or None: the proposer's own
        rule decides."""
        return None


class FixedPolicy(Controller):
    """Verify ``n`` proposals per cycle (``None``: all the block allows, ``n_max``).

    Raises:
        ValueError: a negative ``n``.
    """

    name = "fixed"

    def __init__(self, n: int | None = None):
        if n is not None and n < 0:
            raise ValueError(f"FixedPolicy n must be >= 0, got {n}")
        self.n = n

    def __call__(self, req, n_max: int) -> int:
        return n_max if self.n is None else min(self.n, n_max)
