"""The drafter's context K/V of one request: the target features of committed positions,
projected by the drafter's context layers (spec section 3), kept for at most ``window``
positions, projected lazily (commits are deferred until the drafter next reads them).
"""
from __future__ import annotations

import torch


class DraftContextCache:
    """Draft context K/V of one request, bounded to ``window`` positions (ring buffer).

    Holds per layer k, v [kv, cap, hd] (RoPE applied), absolute positions [cap] and a
    valid mask; ``cap`` grows by doubling up to ``window``, after which the oldest
    positions are overwritten (memory stays flat past the window, spec section 7).

    Commits are lazy when ``project`` is given (``project(features [1, n, F*d], pos [1, n])``
    -> per layer (k, v) [1, kv, n, hd], the drafter's context projection): :meth:`defer`
    only keeps the features, and :meth:`flush` (called by :meth:`as_batch`, i.e. before the
    drafter reads its context) projects everything pending in one call. Cycles in which
    nothing is drafted (the cost policy's plain target steps, copies) then cost no drafter
    work at all; the K/V of a position depends on its own features and position only, so
    this equals committing position by position up to the float rounding of a larger
    matrix product.
    """

    def __init__(self, num_layers: int, window: int, project=None):
        self.L, self.window = num_layers, window
        self.k: list[torch.Tensor] = []
        self.v: list[torch.Tensor] = []
        self.pos: torch.Tensor | None = None  # [cap] int64
        self.valid: torch.Tensor | None = None  # [cap] bool
        self.written = 0  # positions ever appended (pending ones not yet)
        self.pending: list[tuple[torch.Tensor, int]] = []  # (features [n, F*d], first position)
        self._pending_n = 0  # positions in ``pending``
        self._project = project
        self.tail: list[int] = []  # the last committed token ids (DrafterProposer.observe; its n-gram prior)

    def defer(self, features: torch.Tensor, start_pos: int) -> None:
        """Keep ``features`` [n, F*d] of positions ``start_pos ..`` for the next :meth:`flush`
        (a copy: the caller's buffer may be reused); only the last ``window`` pending
        positions are kept (no others can ever be read)."""
        if features.shape[0] == 0:
            return
        self.pending.append((features.detach().clone(), int(start_pos)))
        self._pending_n += features.shape[0]
        while self._pending_n - self.pending[0][0].shape[0] >= self.window:
            self._pending_n -= self.pending.pop(0)[0].shape[0]

    def pending_items(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(features [n, F*d], positions [n]) pending, at most the last ``window``; clears them."""
        if not self.pending:
            return None
        feats = torch.cat([f for f, _ in self.pending])
        pos = torch.cat([torch.arange(p, p + f.shape[0], device=f.device) for f, p in self.pending])
        self.pending, self._pending_n = [], 0
        return feats[-self.window:], pos[-self.window:]

    def flush(self) -> int:
        """Project and append whatever :meth:`defer` kept (no-op when nothing is pending).
        Returns the number of positions projected."""
        items = self.pending_items()
        if items is None:
            return 0
        feats, pos = items
        self.append(self._project(feats[None], pos[None]), pos)
        return int(pos.shape[0])

    def _grow(self, need: int, like: torch.Tensor) -> None:
        cap = 0 if self.pos is None else self.pos.shape[0]
        if need <= cap:
            return
        new = min(self.window, max(need, 2 * cap, 64))
        kv, hd = like.shape[0], like.shape[-1]  # like: [kv, n, hd]
        for lst in (self.k, self.v):
            for l in range(len(lst)):
                t = lst[l].new_zeros(kv, new, hd)
                t[:, :cap] = lst[l]
                lst[l] = t
            if not lst:
                lst.extend(like.new_zeros(kv, new, hd) for _ in range(self.L))
        pos = torch.full((new,), -1, dtype=torch.long, device=like.device)
        valid = torch.zeros(new, dtype=torch.bool, device=like.device)
        if cap:
            pos[:cap], valid[:cap] = self.pos, self.valid
        self.pos, self.valid = pos, valid

    def append(self, kv: list[tuple[torch.Tensor, torch.Tensor]], pos: torch.Tensor) -> None:
        """Commit K/V of accepted positions: per layer (k, v) [1, kv, n, hd]; pos [n]."""
        n = pos.shape[0]
        if n == 0:
            return
        if n > self.window:  # only the last `window` positions can ever be read
            kv = [(k[:, :, -self.window:], v[:, :, -self.window:]) for k, v in kv]
            pos, n = pos[-self.window:], self.window
        self._grow(min(self.window, self.written + n), kv[0][0][0])
        cap = self.pos.shape[0]
        idx = (self.written + torch.arange(n, device=pos.device)) % cap  # [n]
        for l, (k, v) in enumerate(kv):
            self.k[l][:, idx] = k[0].to(self.k[l].dtype)
            self.v[l][:, idx] = v[0].to(self.v[l].dtype)
        self.pos[idx] = pos
        self.valid[idx] = True
        self.written += n

    def nbytes(self) -> int:
        """Bytes of the K/V buffers plus the features of pending commits (nothing is projected:
        the server reads this after every cycle)."""
        return sum(f.numel() * f.element_size() for f, _ in self.pending) + self.kv_bytes()

    def kv_bytes(self) -> int:
        """Bytes of the K/V buffers alone."""
        return sum(t.numel() * t.element_size() for t in self.k + self.v)

    def as_batch(self) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], torch.Tensor, torch.Tensor]:
        """(per-layer (k, v) [1, kv, cap, hd], pos [1, cap], valid [1, cap]), pending commits
        flushed first."""
        self.flush()
        return ([(k[None], v[None]) for k, v in zip(self.k, self.v)], self.pos[None], self.valid[None])
