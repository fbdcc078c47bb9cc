"""Draft trees: several candidate continuations verified in one target forward.

- :mod:`.tree`: the :class:`DraftTree` (flattened nodes, parents, depths, the q each node
  was drawn from) and the tree settings (:class:`TreeSpec`, ``--tree-budget`` /
  ``--tree-shape``);
- :mod:`.build`: trees from the final stage's candidate tables (static widths per depth,
  or best-first under a node budget, EAGLE-2 style);
- :mod:`.verify`: greedy longest-path verification and lossless multi-candidate
  speculative sampling (recursive rejection over siblings, SpecInfer / EAGLE).

The target forward over a flattened tree (tree attention mask, positions by depth) lives
in :mod:`dspine.runtime.dense`; the cycle that ties them together in :mod:`dspine.core.engine`.
"""
from dspine.trees.tree import DraftTree, TreeSpec, parse_tree_shape

__all__ = ["DraftTree", "TreeSpec", "parse_tree_shape"]
