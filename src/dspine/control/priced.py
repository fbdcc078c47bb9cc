"""The tree budget of a priced controller: trees or chains, and each tree's verified prefix.

A controller that prices cycles with a measured cost curve (``cost`` set: the ``cost``
verification policy, per source or not) also owns, once bound to ``--tree-size cost``
(:meth:`PricedController.bind_trees`), the two tree decisions of a drafting cycle:

- :class:`~dspine.control.tree_gate.TreeGate`: a tree or a chain, per proposer source, by
  the measured tokens per second of each kind (learns from cycles that ran alone);
- :class:`~dspine.control.tree_sizer.TreeSizer`: how many nodes of a best-first tree to
  verify, by expected tokens per second under the same cost curve (greedy only).

Both read completed cycles only (non-anticipating, spec s.5), so exactness is untouched.
"""
from __future__ import annotations

from typing import Callable

from dspine.control.base import Controller
from dspine.control.batch_policy import BatchCostPolicy
from dspine.control.tree_gate import TreeGate
from dspine.control.tree_sizer import TreeSizer


class PricedController(Controller):
    """Base of the controllers that price cycles (:attr:`cost` is a
    :class:`~dspine.control.cost_curve.CostCurve`); see the module docstring.

    Attributes:
        sizer: the :class:`TreeSizer` once bound to ``--tree-size cost``, else None.
        gate: the :class:`TreeGate` (exists exactly when ``sizer`` does), else None.
    """

    sizer: TreeSizer | None = None
    gate: TreeGate | None = None
    _batch: BatchCostPolicy | None = None  # of batch_pricing

    def pricing_parts(self) -> tuple:
        """(the cost policy whose curve prices a batched forward, per source the policy whose
        statistics price a request of that source, or None)."""
        raise NotImplementedError

    def batch_pricing(self, max_batch: int) -> BatchCostPolicy:
        """One verification length per batched cycle of at most ``max_batch`` requests
        (:class:`BatchCostPolicy` over :meth:`pricing_parts`, kept while ``max_batch`` stays
        the same, so what it learned carries over between cycles)."""
        if self._batch is None or self._batch.max_batch != max_batch:
            policy, sources = self.pricing_parts()
            self._batch = BatchCostPolicy(policy, max_batch, sources=sources)
        return self._batch

    def bind_trees(self, spec) -> None:
        """Size and gate trees when ``spec`` asks for ``size == "cost"`` trees; once (a
        controller bound again keeps what it learned)."""
        if self.sizer is None and spec.enabled and spec.size == "cost" and self.cost is not None:
            self.sizer = TreeSizer(self.cost.verify_s)
            self.gate = TreeGate()

    @property
    def sizes_trees(self) -> bool:
        return self.sizer is not None

    def draft_tree(self, req) -> bool:
        return self.gate is None or self.gate.choose(req.source)

    def tree_trim(self) -> Callable | None:
        return self.sizer.trim if self.sizer is not None else None

    def observe_tree(self, tree, accepted_nodes: list[int], verify_s: float) -> None:
        if self.sizer is not None:
            self.sizer.observe(tree, accepted_nodes, verify_s)

    def observe_cycle(self, req) -> None:
        c = req.cycles[-1] if req.cycles else None
        if self.gate is not None and c is not None and c.n > 0:
            self.gate.observe(c.source, c.tree_nodes > 0, c.emitted, c.total_s)

    def describe(self) -> dict:
        return {"tree_gate": self.gate.describe()} if self.gate is not None else {}
