"""The flattened draft tree and the tree settings.

A tree hangs below the root, the cycle's anchor x0 (row 0 of the target forward). Node
i (0-based) is row i + 1: token ``tokens[i]``, ``parent[i]`` (-1 = the root, else a
smaller node index, so parents come before children), ``depth[i]`` >= 1 (its position
is the anchor's + depth). A node's children are the nodes naming it as parent, in
*draw order* (increasing index): sampled verification examines siblings in that order.

For sampled trees each node also carries the exact distribution it was drawn from,
given everything drawn before it: sparse ``q_ids[i]`` [K] int64 / ``q_probs[i]`` [K]
float64. Siblings drawn without replacement have ``q_k`` = the node's conditional q with
the earlier siblings removed and renormalized (what :mod:`.verify` divides by).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from dspine.config import ConfigError

TREE_SHAPES = ("dynamic",)  # besides comma-separated widths such as "4,2,1"
from dspine.argtypes import DEFAULT_TREE_SIZE, TREE_SIZES  # noqa: E402 (--tree-size)
from dspine.argtypes import MAX_TREE_BUDGET  # noqa: E402 (the most nodes a tree may have)


def _check_widths(widths) -> tuple[int, ...]:
    if (not isinstance(widths, (tuple, list)) or not widths
            or any(isinstance(w, bool) or not isinstance(w, int) or w < 1 for w in widths)):
        raise ConfigError(f"SpeculativeConfig.tree_shape widths must be integers >= 1, got {widths!r}",
                          field="tree_shape")
    return tuple(widths)


def parse_tree_shape(text: str) -> tuple[int, ...] | None:
    """``dynamic`` -> None (best-first under the budget); ``"4,2,1"`` -> (4, 2, 1): each
    node at depth d-1 gets up to ``widths[d-1]`` children (1 past the last entry).

    Raises:
        ConfigError: not ``dynamic`` and not positive integers (naming ``SpeculativeConfig.tree_shape``).
    """
    text = str(text).strip()
    if text == "dynamic":
        return None
    parts = [x.strip() for x in text.split(",")]
    if not all(x.isascii() and x.isdigit() for x in parts) or min((int(x) for x in parts if x), default=0) < 1:
        raise ConfigError(f"SpeculativeConfig.tree_shape {text!r} must be 'dynamic' or comma-separated widths >= 1, "
                          f"e.g. 4,2,1", field="tree_shape")
    return tuple(int(x) for x in parts)


@dataclass(frozen=True)
class TreeSpec:
    """Tree settings of an engine.

    budget: most tree nodes per cycle (the anchor not counted; 0 = a single chain; at most
        :data:`MAX_TREE_BUDGET`); the hybrid's copied continuation may add up to its own
        length (:func:`dspine.trees.build.graft`).
    shape: widths per depth (see :func:`parse_tree_shape`) or None for best-first by path
        probability (greedy decoding; sampled decoding then uses ``sampled_shape``).
    sampled_shape: the static widths sampled decoding uses when ``shape`` is None.
    size: ``fixed`` (verify every node the budget allows) or ``cost`` (greedy best-first
        trees: verify the prefix that maximizes expected tokens per second,
        :class:`dspine.control.tree_sizer.TreeSizer`; needs the cost verification policy's curve).
    Raises:
        ConfigError: a size that is unknown (naming ``SpeculativeConfig.tree_size``), a budget
            that is not an integer in 0..MAX_TREE_BUDGET (``SpeculativeConfig.tree_budget``), or
            widths that are not integers >= 1 (``SpeculativeConfig.tree_shape``).
    """

    budget: int = 0
    shape: tuple[int, ...] | None = None
    sampled_shape: tuple[int, ...] = (4, 2, 1)
    size: str = "fixed"

    def __post_init__(self):
        if self.size not in TREE_SIZES:
            raise ConfigError(f"SpeculativeConfig.tree_size {self.size!r} is unknown; accepted: {', '.join(TREE_SIZES)}",
                              field="tree_size")
        b = self.budget
        if isinstance(b, bool) or not isinstance(b, int) or not 0 <= b <= MAX_TREE_BUDGET:
            raise ConfigError(f"SpeculativeConfig.tree_budget must be an integer in 0..{MAX_TREE_BUDGET}, got {b!r}",
                              field="tree_budget")
        if self.shape is not None:
            object.__setattr__(self, "shape", _check_widths(self.shape))
        object.__setattr__(self, "sampled_shape", _check_widths(self.sampled_shape))

    @property
    def enabled(self) -> bool:
        return self.budget > 0

    def describe(self) -> str:
        if not self.enabled:
            return "chain"
        shape = "dynamic" if self.shape is None else ",".join(map(str, self.shape))
        size = ""
        if self.size == "cost":  # sizing cuts greedy best-first trees; a static shape is verified whole
            size = ", size=cost" if self.shape is None else ", size=fixed: a static shape verifies all its nodes"
        return f"tree(budget={self.budget}, shape={shape}{size})"


@dataclass
class DraftTree:
    """A flattened draft tree (see the module docstring). All tensors on the CPU.

    tokens [N] int64, parent [N] int64, depth [N] int64; q_ids [N, K] int64 and
    q_probs [N, K] float64 for sampled trees, None for greedy ones. ``path_prob`` [N]
    float64 (best-first trees): the drafter's probability of each node's whole path, the
    product of the final stage's softmax along it, non-increasing in node order.
    """

    tokens: torch.Tensor
    parent: torch.Tensor
    depth: torch.Tensor
    q_ids: torch.Tensor | None = None
    q_probs: torch.Tensor | None = None
    _children: list | None = field(default=None, repr=False)
    path_prob: torch.Tensor | None = None

    def __post_init__(self):
        for name in ("tokens", "parent", "depth"):
            t = getattr(self, name)
            if not isinstance(t, torch.Tensor) or t.dim() != 1 or t.dtype != torch.long:
                raise ValueError(f"DraftTree.{name} must be a 1-D int64 tensor, got "
                                 f"{getattr(t, 'dtype', type(t).__name__)} {tuple(getattr(t, 'shape', ()))}")
        n = self.tokens.shape[0]
        if self.parent.shape[0] != n or self.depth.shape[0] != n:
            raise ValueError(f"DraftTree: {n} tokens but {self.parent.shape[0]} parents and {self.depth.shape[0]} depths")
        if (self.q_ids is None) != (self.q_probs is None):
            raise ValueError("DraftTree: q_ids and q_probs come together (sampled trees) or not at all")
        if self.q_ids is not None and (self.q_ids.dim() != 2 or self.q_ids.shape != self.q_probs.shape
                                       or self.q_ids.shape[0] != n):
            raise ValueError(f"DraftTree: q_ids {tuple(self.q_ids.shape)} and q_probs {tuple(self.q_probs.shape)} "
                             f"must both be [{n}, K]")
        if self.path_prob is not None and tuple(self.path_prob.shape) != (n,):
            raise ValueError(f"DraftTree.path_prob must be [{n}], got {tuple(self.path_prob.shape)}")
        par = self.parent.tolist()
        for i, p in enumerate(par):
            if not -1 <= p < i:
                raise ValueError(f"tree node {i} has parent {p}: parents must precede children")
        dep = self.depth.tolist()
        for i, p in enumerate(par):
            if dep[i] != (1 if p < 0 else dep[p] + 1):
                raise ValueError(f"tree node {i} has depth {dep[i]}, its parent {p} implies another")
        kids: list[list[int]] = [[] for _ in range(n + 1)]  # index 0 = the root
        for i, p in enumerate(par):
            kids[p + 1].append(i)
        self._children = kids

    def prefix(self, m: int) -> "DraftTree":
        """The tree of the first ``m`` nodes (parents precede children, so any prefix is a
        tree; for a best-first tree, its ``m`` most probable nodes).

        Raises:
            ValueError: ``m`` outside 1..size.
        """
        if not 1 <= m <= self.size:
            raise ValueError(f"a prefix of {m} nodes of a {self.size}-node tree")
        if m == self.size:
            return self
        cut = (lambda t: None if t is None else t[:m].clone())
        return DraftTree(self.tokens[:m].clone(), self.parent[:m].clone(), self.depth[:m].clone(),
                         cut(self.q_ids), cut(self.q_probs), path_prob=cut(self.path_prob))

    @property
    def size(self) -> int:
        """Number of nodes N (the anchor not counted)."""
        return int(self.tokens.shape[0])

    @property
    def max_depth(self) -> int:
        return int(self.depth.max()) if self.size else 0

    def children(self, node: int) -> list[int]:
        """Children of ``node`` (-1 = the root) in draw order."""
        return self._children[node + 1]

    def attention_mask(self) -> torch.Tensor:
        """[N+1, N+1] bool: row r sees column c iff c is r itself or an ancestor of r
        (row/column 0 is the root, node i is row i + 1)."""
        n = self.size
        m = torch.zeros(n + 1, n + 1, dtype=torch.bool)
        m[:, 0] = True
        m[0, 0] = True
        for i, p in enumerate(self.parent.tolist()):
            m[i + 1] = m[p + 1]
            m[i + 1, i + 1] = True
        return m

    def positions(self) -> torch.Tensor:
        """[N+1] int64 offsets from the anchor's position: 0 for the root, depth per node."""
        return torch.cat([torch.zeros(1, dtype=torch.long), self.depth])

    @classmethod
    def chain(cls, tokens: torch.Tensor, q_ids=None, q_probs=None) -> "DraftTree":
        """A tree that is a single chain (width 1 at every depth)."""
        n = tokens.shape[0]
        return cls(tokens, torch.arange(-1, n - 1), torch.arange(1, n + 1), q_ids, q_probs)


def tree_spec_from_args(args) -> TreeSpec:
    """The :class:`TreeSpec` of parsed ``--tree-budget`` / ``--tree-shape``
    (:func:`dspine.argtypes.add_tree_args`; a budget not given is the command's default)."""
    budget = getattr(args, "tree_budget", None)
    if budget is None:
        budget = getattr(args, "tree_budget_default", 0)
    return TreeSpec(budget, parse_tree_shape(getattr(args, "tree_shape", "dynamic")),
                    size=getattr(args, "tree_size", None) or DEFAULT_TREE_SIZE)
