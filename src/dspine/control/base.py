"""The controller interface: what the engine asks before each cycle (spec section 5).

A controller decides, per request and cycle, from completed cycles only (so sampling
stays exact for every choice):

- the **source** of the proposal when the proposer offers alternatives (a copy or the
  drafter, :meth:`Controller.picker`);
- the **verification length** n, ``0 <= n <= n_max`` (:meth:`Controller.__call__`;
  n = 0 is a plain target step);
- whether the cycle is **priced**: :attr:`Controller.cost` is the measured cost curve
  when the controller chooses by expected tokens per second, None for fixed settings; a
  priced controller also chooses one length for a whole batched cycle
  (:meth:`Controller.batch_pricing`, :mod:`dspine.control.batch_policy`);
- the **tree budget** of a drafting cycle that can draft a tree: whether it drafts one
  (:meth:`Controller.draft_tree`) and how many of its nodes are verified
  (:meth:`Controller.tree_trim`). A priced controller bound to ``--tree-size cost``
  (:meth:`Controller.bind_trees`) answers both from the measured rates of trees and
  chains (:mod:`dspine.control.tree_gate`) and the expected tokens per second of each
  prefix of a best-first tree (:mod:`dspine.control.tree_sizer`); otherwise every such
  cycle drafts the tree spec's static tree.

It observes each cycle's outcome (:meth:`Controller.observe_tree`,
:meth:`Controller.observe_cycle`); the verification-length statistics are read from the
request's completed cycles (``req.cycles``) when the next length is chosen. Every method is
defined here, so the engine calls them without probing.
"""
from __future__ import annotations

from typing import Callable


class Controller:
    """Base of the controllers (:class:`FixedPolicy`, :class:`dspine.control.policy.CostModelPolicy`,
    :class:`dspine.control.per_source.PerSourcePolicy`).

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

    def batch_pricing(self, max_batch: int):
        """A :class:`~dspine.control.batch_policy.BatchCostPolicy` choosing one verification
        length per batched cycle of at most ``max_batch`` requests, or None: each request's
        own length (base)."""
        return None

    # -- the tree budget --------------------------------------------------------------------
    def bind_trees(self, spec) -> None:
        """Called once by the engine with its :class:`~dspine.trees.tree.TreeSpec`; a
        controller that sizes and gates trees sets itself up here (base: nothing)."""

    @property
    def sizes_trees(self) -> bool:
        """Whether this controller chooses each tree's verified prefix (``--tree-size cost``)."""
        return False

    def draft_tree(self, req) -> bool:
        """Whether ``req``'s drafting cycle drafts a tree (asked only where the proposer,
        the target pass and the tree spec allow one); base: always."""
        return True

    def tree_trim(self) -> Callable | None:
        """``trim(tree, draft_s) -> tree``: the verified prefix of a best-first tree, or None
        (the spec's static size)."""
        return None

    def observe_tree(self, tree, accepted_nodes: list[int], verify_s: float) -> None:
        """A verified draft tree: the node indices on the accepted path and the target
        forward's seconds (0.0 when the forward was shared by a batch); base: nothing."""

    def observe_cycle(self, req) -> None:
        """``req``'s last cycle (``req.cycles[-1]``) completed alone (its own time); base: nothing."""

    def describe(self) -> dict:
        """What this controller learned so far, for ``stats.kernels`` (base: nothing)."""
        return {}


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
