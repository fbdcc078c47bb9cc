"""The target's KV cache with commit/rollback by length (spec section 6).

Its own module so that cache variants (:mod:`dspine.target.replay_ssm`'s replay cache for
Gated-DeltaNet targets) build on it without importing :mod:`dspine.target.adapter`, which
loads them.
"""
from __future__ import annotations

import torch
from torch import nn


class TargetCache:
    """KV cache of one target with explicit commit/rollback (spec section 6).

    ``length`` is the number of committed positions. A forward appends pending
    positions; :meth:`rollback` cuts everything beyond the accepted length.
    """

    def __init__(self, model: nn.Module):
        from transformers import DynamicCache

        self.kv = DynamicCache(config=model.config)
        self.length = 0  # committed positions (tokens)

    def seq_length(self) -> int:
        """Positions currently stored (committed + pending)."""
        return self.kv.get_seq_length()

    def rollback(self, length: int) -> None:
        """Keep the first ``length`` positions, drop the rest, and mark them committed.

        Raises:
            ValueError: ``length`` is negative or exceeds what the cache holds.
        """
        have = self.seq_length()
        if not 0 <= length <= have:
            raise ValueError(f"cannot commit {length} positions: cache holds {have}")
        if length < have:
            self.kv.crop(length - have)  # transformers 5: negative = tokens to remove
        self.length = length

    def kv_rows(self) -> list[tuple[torch.Tensor, torch.Tensor]] | None:
        """Per layer (keys, values) [1, n_kv_heads, stored, head_dim] when every layer is a
        plain dynamic layer (what the batched engine can copy into its slots), else None."""
        from transformers.cache_utils import DynamicLayer

        layers = getattr(self.kv, "layers", [])
        if not layers or not all(type(l) is DynamicLayer for l in layers):
            return None
        return [(l.keys, l.values) for l in layers]

    def nbytes(self) -> int:
        """Bytes held by the cached key/value tensors."""
        total = 0
        for layer in getattr(self.kv, "layers", []):
            for name in ("keys", "values"):
                t = getattr(layer, name, None)
                if isinstance(t, torch.Tensor):
                    total += t.numel() * t.element_size()
        return total
