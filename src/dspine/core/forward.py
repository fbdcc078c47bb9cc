"""The target forward of one decode cycle, over whichever KV layout holds the requests.

A cycle (:mod:`dspine.core.cycle`) hands every request's inputs (the anchor, then a
chain or a flattened draft tree: :class:`dspine.core.batch_lean.Inputs`) to a *target
pass* and gets back, per request, the logits [T, V] and target features [T, F*d] of its
T inputs. After verification it commits the accepted rows through the same pass. Two
passes exist; the cycle is the same over both:

* :class:`OwnCachePass`: each request's own :class:`~dspine.target.adapter.TargetCache`
  (one target forward per request; any target, hybrid Gated-DeltaNet caches with replay
  rollback included; trees where the cache supports them, i.e. the dense runtime).
* :class:`SharedRowsPass`: the rows of one :class:`~dspine.core.kv.SlotKV`, every
  request in **one** forward: packed without padding on the lean decode path
  (:func:`dspine.core.batch_lean.lean_forward`, chains and trees), else transformers'
  forward over the padded block with a 4-D mask (chains only).
"""
from __future__ import annotations

import torch

from dspine.core.batch_lean import Inputs, lean_forward
from dspine.core.kv import SlotKV


class OwnCachePass:
    """Requests whose target K/V live in their own caches (``req.cache``).

    Args:
        target: the loaded :class:`~dspine.target.adapter.Target`.
        feature_layers: the target layers whose outputs the proposer reads, or None.
    """

    shared = False  # each request's forward is its own (its cycle times are its own)

    def __init__(self, target, feature_layers: list[int] | None):
        self.target, self.feature_layers = target, feature_layers

    def starts(self, reqs) -> list[int]:
        """Committed positions of each request (= its anchor's position)."""
        return [r.cache.length for r in reqs]

    def takes_tree(self, req) -> bool:
        """Whether ``req``'s cache can verify a draft tree (the dense runtime's caches)."""
        return self.target.supports_tree(req.cache)

    def forward(self, reqs, inputs: list[Inputs]) -> tuple[list[torch.Tensor], list[torch.Tensor | None]]:
        """One target forward per request; returns per request logits [T, V] and features
        [T, F*d] (None when no feature layers are captured)."""
        logits, feats = [], []
        for r, q in zip(reqs, inputs):
            ids = q.tokens[None].to(self.target.device)
            tree = (q.offsets, q.mask) if q.mask is not None else None
            out = self.target.forward(ids, r.cache, self.feature_layers, tree=tree)
            logits.append(out.logits[0])
            feats.append(out.features[0] if out.features is not None else None)
        return logits, feats

    def commit(self, i: int, req, start: int, rows: list[int]) -> None:
        """Keep the K/V of input ``rows`` (increasing, the anchor's 0 first) at positions
        ``start, start + 1, ...``: a chain's prefix rolls the cache back (recurrent layers
        replay, :mod:`dspine.target.replay_ssm`), a tree's path moves to consecutive slots."""
        if rows == list(range(len(rows))):
            req.cache.rollback(start + len(rows))
        else:
            req.cache.keep_rows(start, rows)


class SharedRowsPass:
    """Running requests whose target K/V are the rows of one :class:`SlotKV`, row ``i`` =
    ``reqs[i]`` (:class:`dspine.core.batch.BatchEngine` keeps them in that order).

    Args:
        target: the loaded target (a full-attention cache; ``sdpa`` or ``eager``).
        kv: the slot cache.
        feature_layers: as :class:`OwnCachePass`.
        max_position: the largest position id a pad slot may carry (context window - 1).
    """

    shared = True  # one forward for every request: a request's times are the batch's

    def __init__(self, target, kv: SlotKV, feature_layers: list[int] | None, max_position: int):
        self.target, self.kv, self.feature_layers = target, kv, feature_layers
        self.max_position = int(max_position)
        cfg = target.model.config
        self.attn = getattr(cfg, "_attn_implementation", "sdpa") or "sdpa"

    def starts(self, reqs) -> list[int]:
        return list(self.kv.lengths)

    def lean_plan(self):
        """The target's lean decode plan (:mod:`dspine.runtime.lean`) when this batch's
        forwards can take it: a dense-runtime target with a lean plan, K/V in float32;
        else None (transformers' batched forward, chains only)."""
        rt = getattr(self.target, "runtime", None)
        plan = rt.lean_plan() if rt is not None and hasattr(rt, "lean_plan") else None
        if plan is None or not self.kv.k or self.kv.k[0].dtype != torch.float32:
            return None
        return plan

    def takes_tree(self, req) -> bool:
        return self.lean_plan() is not None

    def forward(self, reqs, inputs: list[Inputs]) -> tuple[list[torch.Tensor], list[torch.Tensor] | None]:
        """Every request in one forward (module docstring); per request logits [T_i, V]
        and features [T_i, F*d] (None without feature layers)."""
        fl, starts = self.feature_layers, list(self.kv.lengths)
        plan = self.lean_plan()
        if plan is not None:
            return lean_forward(self.target, plan, self.kv, inputs, starts, fl)
        ns = [len(q) - 1 for q in inputs]
        width = max(ns) + 1
        ids = torch.zeros(len(inputs), width, dtype=torch.long)
        for i, q in enumerate(inputs):
            if q.mask is not None:
                raise ValueError("draft trees need the lean decode path (SharedRowsPass.takes_tree)")
            ids[i, :len(q)] = q.tokens
        pos, allowed = self.kv.prepare(width, self.max_position)
        if self.attn == "sdpa":
            mask = allowed
        else:  # eager & co. add the mask to the scores
            mask = torch.zeros(allowed.shape, dtype=self.target.dtype, device=allowed.device)
            mask.masked_fill_(~allowed, torch.finfo(self.target.dtype).min)
        res = self.target.model(input_ids=ids.to(self.target.device), attention_mask=mask, position_ids=pos,
                                past_key_values=self.kv._cache, use_cache=True, output_hidden_states=fl is not None)
        lg = res.logits.float()  # [b, width, V]
        logits = [lg[i, :n + 1] for i, n in enumerate(ns)]
        if fl is None:
            return logits, None
        f = torch.cat([res.hidden_states[l + 1] for l in fl], dim=-1)
        return logits, [f[i, :n + 1] for i, n in enumerate(ns)]

    def commit(self, i: int, req, start: int, rows: list[int]) -> None:
        """Row ``i`` keeps the K/V of input ``rows`` at columns ``start, start + 1, ...``."""
        if rows != list(range(len(rows))):
            self.kv.keep_rows(i, start, rows)
        else:
            self.kv.lengths[i] = start + len(rows)
        req.cache.length = start + len(rows)
