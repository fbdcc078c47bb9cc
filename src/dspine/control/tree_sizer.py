"""How many nodes of a best-first draft tree to verify, per cycle.

A best-first tree (:func:`dspine.trees.build.dynamic_tree`) lists its nodes by decreasing
path probability, so each prefix of ``m`` nodes is a tree and the most promising one of its
size. Verifying more nodes costs a longer target forward; it pays only while the extra
nodes add expected accepted tokens faster than they add time. :class:`TreeSizer` picks

    m* = argmax_m  (1 + sum_{i<m} a(p_i)) / (D + V(m + 1)),    1 <= m <= N,

where ``p_i`` is node i's path probability under the drafter, ``a(p)`` the probability
that a node with that estimate lies on the accepted path (calibrated online, below),
``D`` this cycle's drafting time (spent already; it sets the scale of the rate) and
``V(t)`` the target forward's time over ``t`` tokens (the anchor and the nodes). For greedy
verification the expected accepted length is exactly ``sum_i P(node i accepted)``: a node
is accepted iff its whole path matches the target's argmaxes, and at most one path is.

Calibration ``a(p)``: the drafter's softmax over its 16 candidates is not a probability
of acceptance, so verified nodes are binned by ``p`` and each bin keeps a decayed count of
nodes and of accepted ones, with a prior of ``prior_scale * p`` worth ``prior_weight`` nodes.

Cost ``V(t)``: the measured cost curve of the verification policy (a target forward over
1..16 tokens, :func:`dspine.tune.cost.measure_cost`), extended linearly beyond its end with
the slope of its upper half, times the ratio of observed to predicted times of completed
tree cycles (decayed), so the machine's load is followed.

Greedy decoding only: the prefix is chosen from the drafter's probabilities of this very
cycle, which sampled decoding could not allow (the verified set would depend on the
draws); sampled trees keep their static shape. Greedy output is the target's argmax chain
whatever is verified, so exactness is untouched (``tests/test_tree_sizer.py`` checks
greedy equality with ``ar`` on the real target).
"""
from __future__ import annotations

import math

import torch

from dspine.control.estimator import DecayedCells, DecisionLog, best_rate, decay_factor
from dspine.trees.tree import DraftTree

BIN_EDGES = (0.0, 0.02, 0.05, 0.1, 0.2, 0.35, 0.5, 0.7, 0.85, 1.0)


class TreeSizer:
    """Chooses the verified prefix of best-first trees (module docstring).

    Args:
        verify_s: target forward seconds over t = 1, 2, ... tokens (``verify_s[t - 1]``,
            e.g. :attr:`dspine.control.cost_curve.CostCurve.verify_s`); at least one value.
        prior_scale, prior_weight: the calibration prior ``a(p) = prior_scale * p`` worth
            ``prior_weight`` nodes per bin.
        half_life: decay of the calibration counts and of the observed/predicted time
            ratio, in tree cycles.
        min_nodes: the smallest prefix considered.
    Raises:
        ValueError: an empty or non-finite cost curve, or settings out of range.
    """

    def __init__(self, verify_s: list[float], prior_scale: float = 0.6, prior_weight: float = 4.0,
                 half_life: float = 256.0, min_nodes: int = 1):
        vs = [float(x) for x in verify_s]
        if not vs or any(not (math.isfinite(x) and x > 0) for x in vs):
            raise ValueError(f"TreeSizer needs positive, finite verification costs, got {verify_s!r}")
        if not 0.0 <= prior_scale <= 1.0 or prior_weight < 0 or not half_life > 0 or min_nodes < 1:
            raise ValueError("TreeSizer: prior_scale in [0, 1], prior_weight >= 0, half_life > 0, min_nodes >= 1")
        self.verify_s = vs
        half = len(vs) // 2
        self.slope = max(0.0, (vs[-1] - vs[half]) / (len(vs) - 1 - half)) if len(vs) - 1 > half else 0.0
        self.prior_scale, self.prior_weight = prior_scale, prior_weight
        self.decay = decay_factor(half_life)
        self.calibration = DecayedCells(half_life)  # bin -> decayed accepted nodes and verified nodes
        self.time_obs = self.time_pred = 0.0  # decayed observed / predicted verification seconds
        self.min_nodes = min_nodes
        self.chosen = DecisionLog(4096)  # recent choices (for stats)

    # model ---------------------------------------------------------------------------------
    @staticmethod
    def _bin(p: float) -> int:
        for b in range(len(BIN_EDGES) - 2, -1, -1):
            if p >= BIN_EDGES[b]:
                return b
        return 0

    def accept_prob(self, p: float) -> float:
        """Calibrated probability that a node of path probability ``p`` is accepted."""
        if not math.isfinite(p):
            return 0.0
        p = min(max(p, 0.0), 1.0)
        b = self._bin(p)
        w, n = self.prior_weight, self.calibration.weight(b)
        return (self.calibration.total(b) + w * self.prior_scale * p) / (n + w) if n + w > 0 else 0.0

    def predicted_verify_s(self, tokens: int) -> float:
        """The measured curve at ``tokens`` (linear beyond its end), before the load ratio."""
        t = max(1, int(tokens))
        vs = self.verify_s
        return vs[t - 1] if t <= len(vs) else vs[-1] + self.slope * (t - len(vs))

    def verify_cost(self, tokens: int) -> float:
        """Estimated seconds of a target forward over ``tokens`` tokens on this machine now."""
        ratio = self.time_obs / self.time_pred if self.time_pred > 0 and self.time_obs > 0 else 1.0
        return self.predicted_verify_s(tokens) * ratio

    # decisions ------------------------------------------------------------------------------
    def choose(self, tree: DraftTree, draft_s: float = 0.0) -> int:
        """The number of leading nodes of ``tree`` to verify (all of them when the tree has
        no ``path_prob``: not a best-first tree)."""
        N = tree.size
        if tree.path_prob is None or N <= self.min_nodes:
            return N
        expected = prefix_tokens_expected(tree, self).tolist()
        best = best_rate(range(self.min_nodes, N + 1), lambda m: expected[m - 1],
                         lambda m: max(draft_s, 0.0) + self.verify_cost(m + 1), default=N)
        self.chosen.append(best)
        return best

    def trim(self, tree: DraftTree, draft_s: float = 0.0) -> DraftTree:
        """``tree`` cut to :meth:`choose`'s prefix."""
        return tree.prefix(self.choose(tree, draft_s))

    def observe(self, tree: DraftTree, accepted_path: list[int], verify_s: float) -> None:
        """After verification: update the calibration with every node of ``tree`` that has a
        drafter estimate (accepted iff on ``accepted_path``, the verified nodes' indices)
        and the time model with the forward's measured ``verify_s`` seconds."""
        d = self.decay
        self.calibration.scale(d)  # one decay per observed tree, however many nodes it has
        if tree.path_prob is not None:
            on_path = set(int(i) for i in accepted_path)
            cal = self.calibration.cells
            for i, p in enumerate(tree.path_prob.tolist()):
                if not math.isfinite(p):
                    continue  # a copied node (no drafter estimate)
                c = cal.setdefault(self._bin(min(max(p, 0.0), 1.0)), [0.0, 0.0])
                c[0] += float(i in on_path)
                c[1] += 1.0
        if verify_s > 0 and math.isfinite(verify_s):
            self.time_obs = self.time_obs * d + verify_s
            self.time_pred = self.time_pred * d + self.predicted_verify_s(tree.size + 1)

    def describe(self) -> dict:
        """Calibration per bin and recent choices, for ``--json`` stats."""
        recent = self.chosen[-256:]
        return {"mean_nodes": round(sum(recent) / len(recent), 2) if recent else None,
                "accept_by_path_prob": {f"{BIN_EDGES[b]:.2f}-{BIN_EDGES[b + 1]:.2f}":
                                        round(self.accept_prob((BIN_EDGES[b] + BIN_EDGES[b + 1]) / 2), 3)
                                        for b in range(len(BIN_EDGES) - 1)}}


def prefix_tokens_expected(tree: DraftTree, sizer: TreeSizer) -> torch.Tensor:
    """Expected accepted tokens (bonus included) of every prefix m = 1..N of ``tree``
    under ``sizer``'s calibration, [N] float64 (what :meth:`TreeSizer.choose` weighs)."""
    a = torch.tensor([sizer.accept_prob(p) for p in tree.path_prob.tolist()], dtype=torch.float64)
    return 1.0 + torch.cumsum(a, 0)
