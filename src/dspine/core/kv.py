"""The batched target KV cache: one buffer per layer, one row per running request.

:class:`SlotKV`: ``[rows, kv_heads, cap, head_dim]`` per target layer. Row ``i`` holds
request ``i``'s committed positions left-aligned in columns ``0 .. L_i-1``, so *column ==
absolute position*, exactly the layout of a single-request cache. A verification writes
the padded block ``[anchor, y_1..y_n, pad..]`` (width ``N = max n_i + 1``) of row ``i``
into columns ``L_i .. L_i+N-1`` (per-row offsets, in place), with explicit position ids
``L_i + j`` and a 4-D mask ``column <= L_i + j`` per row and query: a query sees its
row's committed prefix and the block up to itself, never a stale column. Commit is
``L_i += kept rows``; rejected and pad columns are simply overwritten by the next cycle,
so there are no holes and nothing to compact. A draft tree's accepted path moves to
consecutive columns (:meth:`SlotKV.keep_rows`). Rows of running requests are kept
contiguous (``0 .. b-1``, a leaving row is replaced by the last one), so the forward
reads views of the buffers, not copies. Buffers grow by doubling and are freed when the
batch empties.
"""
from __future__ import annotations

import torch


class _SlotLayer:
    """One target layer's view of :class:`SlotKV` (the transformers cache-layer protocol)."""

    is_sliding = False
    is_compileable = False
    is_croppable = False
    is_initialized = True

    def __init__(self, owner: "SlotKV", idx: int):
        self.owner, self.idx = owner, idx

    @property
    def keys(self):
        return self.owner.k[self.idx]

    @property
    def values(self):
        return self.owner.v[self.idx]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Write new K/V [b, kv, N, hd] at per-row columns; return views [b, kv, K, hd]."""
        o = self.owner
        b, kv, n, hd = key_states.shape
        idx = o._cols[:, None, :, None].expand(b, kv, n, hd)
        k, v = o.k[self.idx], o.v[self.idx]
        k[:b].scatter_(2, idx, key_states.to(k.dtype))
        v[:b].scatter_(2, idx, value_states.to(v.dtype))
        return k[:b, :, : o._kv_len], v[:b, :, : o._kv_len]

    def get_seq_length(self) -> int:
        return self.owner._kv_len

    def get_mask_sizes(self, query_length: int):
        return self.owner._kv_len, 0

    def get_max_length(self) -> int:
        return -1


def _make_cache_class():
    from transformers.cache_utils import Cache

    class _SlotCache(Cache):
        """transformers Cache facade over :class:`SlotKV` for one batched forward."""

        def __init__(self, owner: "SlotKV"):
            super().__init__(layers=[_SlotLayer(owner, l) for l in range(owner.num_layers)])
            self.owner = owner

        def get_seq_length(self, layer_idx: int = 0) -> int:
            return self.owner._kv_len

        def get_mask_sizes(self, query_length: int, layer_idx: int = 0):
            return self.owner._kv_len, 0

    return _SlotCache


class SlotKV:
    """Ragged batched target KV cache: rows of left-aligned committed positions.

    Attributes:
        lengths: committed positions per active row (row i belongs to ``rows[i]``).
    """

    def __init__(self, num_layers: int, max_rows: int):
        self.num_layers, self.max_rows = num_layers, max_rows
        self.k: list[torch.Tensor] = []
        self.v: list[torch.Tensor] = []
        self.lengths: list[int] = []
        self._cols: torch.Tensor | None = None
        self._kv_len = 0
        self._cache = None

    @property
    def rows(self) -> int:
        return len(self.lengths)

    @property
    def capacity(self) -> int:
        return self.k[0].shape[2] if self.k else 0

    def nbytes(self) -> int:
        """Bytes allocated by the K/V buffers."""
        return sum(t.numel() * t.element_size() for t in self.k + self.v)

    def used_bytes(self) -> int:
        """Bytes of committed positions (what the running requests hold)."""
        if not self.k:
            return 0
        per_pos = sum(t[0, :, 0].numel() * t.element_size() for t in self.k + self.v)
        return per_pos * sum(self.lengths)

    def _ensure(self, cap: int, like: list[tuple[torch.Tensor, torch.Tensor]] | None = None) -> None:
        """Grow the column capacity to >= cap (doubling; allocates from ``like`` shapes)."""
        have = self.capacity
        if self.k and cap <= have:
            return
        new = max(cap, 2 * have, 64)
        if not self.k:
            assert like is not None
            for kk, vv in like:
                _, kvh, _, hd = kk.shape
                self.k.append(kk.new_zeros(self.max_rows, kvh, new, hd))
                self.v.append(vv.new_zeros(self.max_rows, vv.shape[1], new, vv.shape[-1]))
            return
        for lst in (self.k, self.v):
            for l, t in enumerate(lst):
                nt = t.new_zeros(t.shape[0], t.shape[1], new, t.shape[3])
                nt[:, :, :have] = t
                lst[l] = nt

    def add_row(self, kv: list[tuple[torch.Tensor, torch.Tensor]], length: int) -> int:
        """Copy one request's K/V (per layer [1, kv, >=length, hd]) into a new row."""
        if self.rows >= self.max_rows:
            raise RuntimeError("no free KV row")
        self._ensure(length + 1, kv)
        r = self.rows
        for l, (kk, vv) in enumerate(kv):
            self.k[l][r, :, :length] = kk[0, :, :length]
            self.v[l][r, :, :length] = vv[0, :, :length]
        self.lengths.append(length)
        return r

    def remove_row(self, r: int) -> int | None:
        """Drop row r; the last row moves into r. Returns the moved row's old index or None."""
        last = self.rows - 1
        moved = None
        if r != last:
            n = self.lengths[last]
            for lst in (self.k, self.v):
                for t in lst:
                    t[r, :, :n] = t[last, :, :n]
            self.lengths[r] = n
            moved = last
        self.lengths.pop()
        if not self.lengths:  # empty batch: give the memory back
            self.k, self.v, self._cache = [], [], None
        return moved

    def keep_rows(self, r: int, start: int, rows: list[int]) -> None:
        """After a draft tree's forward into row ``r`` from column ``start``: move the K/V of
        its inputs ``rows`` (increasing, the anchor's 0 first: the accepted path) to columns
        ``start, start + 1, ...`` of every layer and set the row's length past them."""
        idx = torch.tensor(rows, dtype=torch.long, device=self.k[0].device) + start
        for lst in (self.k, self.v):
            for t in lst:
                t[r, :, start:start + len(rows)] = t[r, :, idx]  # the index copies first
        self.lengths[r] = start + len(rows)

    def prepare(self, width: int, max_position: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Set up a forward of ``width`` new columns per row.

        Returns (position_ids [b, width], allowed [b, 1, width, K] bool) where
        ``allowed[i, 0, j, c] = c <= L_i + j``. Column ``L_i + j`` holds position
        ``L_i + j``; only pad slots (never seen by a real query) can have their position
        id clamped to ``max_position``.
        """
        L = torch.tensor(self.lengths, dtype=torch.long)
        dev = self.k[0].device
        cols_new = (L[:, None] + torch.arange(width)[None]).to(dev)  # [b, width]
        kv_len = max(self.lengths) + width
        self._ensure(kv_len)
        self._cols, self._kv_len = cols_new, kv_len
        cols = torch.arange(kv_len, device=dev)
        allowed = cols[None, None, None, :] <= cols_new[:, None, :, None]  # [b, 1, width, K]
        if self._cache is None:
            self._cache = _make_cache_class()(self)
        pos = cols_new if max_position is None else cols_new.clamp_max(max_position)
        return pos, allowed


class RowCache:
    """Stand-in for a request's :class:`TargetCache` once its KV lives in a :class:`SlotKV` row."""

    def __init__(self, length: int):
        self.length = length

    def seq_length(self) -> int:
        return self.length

    def nbytes(self) -> int:
        return 0
