"""A lean forward for dense Llama-family targets with a preallocated K/V cache.

transformers' eager forward spends much of a one-token step outside the matrix products:
cache-layer objects, mask construction, attention dispatch and per-module Python. On the
2-core AMD EPYC (AVX2) of this project that was ~20 ms of a ~95 ms SmolLM2-135M step
(measured interleaved in one process). :class:`DenseRuntime` runs the same modules'
weights with only the arithmetic a decoder step needs, on a :class:`DenseCache` whose
K/V buffers grow by doubling and roll back by length (no concatenation per token).

What it reuses from the loaded model, unchanged: the embedding, every linear layer as a
module (so ``--linear-backend`` still applies: :mod:`dspine.runtime.packed`), the RMSNorm
modules, the MLP modules and the rotary-embedding module (so every rope type transformers
supports for these architectures is computed the transformers way). Attention is
``scaled_dot_product_attention`` over the cached prefix with a causal mask for the new
positions.

Supported: ``model_type`` llama, qwen2, qwen3 with full attention on every layer (no
sliding window) on any device and dtype. Other targets (hybrids, sliding windows, other
architectures) keep transformers' forward: :func:`runtime_support` says why.

Numerics: in float32 the logits equal transformers' to float rounding (the same ops in
the same order, bit-identical on the tested CPUs); every mode of a process uses the same
runtime, so greedy equality between modes holds (``tests/test_dense_runtime.py``).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

SUPPORTED_TYPES = ("llama", "qwen2", "qwen3")


def runtime_support(model: nn.Module) -> str | None:
    """None when :class:`DenseRuntime` can run ``model``, else the reason it cannot."""
    cfg = getattr(model, "config", None)
    mt = getattr(cfg, "model_type", None)
    if mt not in SUPPORTED_TYPES:
        return f"architecture {mt!r} (the dense runtime runs {', '.join(SUPPORTED_TYPES)})"
    types = set(getattr(cfg, "layer_types", None) or ["full_attention"])
    if types != {"full_attention"} or getattr(cfg, "use_sliding_window", False):
        return "sliding-window attention layers"
    inner = getattr(model, "model", None)
    if inner is None or not hasattr(inner, "layers") or not hasattr(inner, "rotary_emb"):
        return "an unexpected module layout"
    return None


class DenseCache:
    """K/V of one request for :class:`DenseRuntime`, with commit/rollback by length.

    Same contract as :class:`dspine.target.cache.TargetCache`: ``length`` committed
    positions; a forward appends pending positions; :meth:`rollback` keeps a prefix.
    Buffers: keys and values [L, 1, n_kv_heads, capacity, head_dim] in the target dtype;
    the capacity doubles when a forward needs more (one copy, amortised), up to the
    target's ``max_position_embeddings``.
    """

    def __init__(self, runtime: "DenseRuntime", capacity: int = 256):
        self.rt = runtime
        self.k = self.v = None
        self._cap = 0
        self._stored = 0
        self.length = 0
        self._min_cap = capacity

    def _ensure(self, need: int) -> None:
        if need <= self._cap:
            return
        cap = max(self._min_cap, self._cap)
        while cap < need:
            cap *= 2
        cap = max(need, min(cap, self.rt.max_positions))  # never beyond the context window it can use
        rt = self.rt
        shape = (rt.num_layers, 1, rt.n_kv, cap, rt.head_dim)
        k = torch.empty(shape, dtype=rt.dtype, device=rt.device)
        v = torch.empty(shape, dtype=rt.dtype, device=rt.device)
        if self._stored:
            k[:, :, :, :self._stored] = self.k[:, :, :, :self._stored]
            v[:, :, :, :self._stored] = self.v[:, :, :, :self._stored]
        self.k, self.v, self._cap = k, v, cap

    def seq_length(self) -> int:
        """Positions currently stored (committed + pending)."""
        return self._stored

    def rollback(self, length: int) -> None:
        """Keep the first ``length`` positions and mark them committed.

        Raises:
            ValueError: ``length`` is negative or exceeds what the cache holds.
        """
        if not 0 <= length <= self._stored:
            raise ValueError(f"cannot commit {length} positions: cache holds {self._stored}")
        self._stored = length
        self.length = length

    def keep_rows(self, start: int, rows: list[int]) -> None:
        """After a tree forward from ``start``: move the K/V of inputs ``rows`` (increasing
        offsets from ``start``, e.g. the root and an accepted path) to slots
        start, start + 1, ..., and commit ``start + len(rows)`` positions.

        Raises:
            ValueError: rows not increasing, or beyond what the cache holds.
        """
        if any(b <= a for a, b in zip(rows, rows[1:])) or (rows and (rows[0] < 0 or start + rows[-1] >= self._stored)):
            raise ValueError(f"cannot keep rows {rows} after position {start}: cache holds {self._stored}")
        if rows != list(range(len(rows))):
            src = torch.tensor(rows, device=self.k.device) + start
            dst = slice(start, start + len(rows))
            self.k[:, :, :, dst] = self.k[:, :, :, src]
            self.v[:, :, :, dst] = self.v[:, :, :, src]
        self._stored = start + len(rows)
        self.rollback(start + len(rows))

    def kv_rows(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer (keys, values) [1, n_kv_heads, stored, head_dim] (views): what the
        batched engine copies into its slot cache."""
        n = self._stored
        return [(self.k[i, :, :, :n], self.v[i, :, :, :n]) for i in range(self.rt.num_layers)]

    def nbytes(self) -> int:
        """Bytes held by the K/V buffers (their capacity, not only the stored positions)."""
        return 0 if self.k is None else 2 * self.k.numel() * self.k.element_size()


class DenseRuntime:
    """Forward of a dense Llama-family HF model (see module docstring).

    Raises:
        ConfigError: the model is not supported (:func:`runtime_support`), naming
            ``SpeculativeConfig.runtime``.
    """

    def __init__(self, model: nn.Module):
        why = runtime_support(model)
        if why is not None:
            from dspine.config import ConfigError

            raise ConfigError(f"SpeculativeConfig.runtime dense cannot run this target: {why}; use "
                              f"SpeculativeConfig.runtime='hf'", field="runtime")
        self.model = model
        cfg = model.config
        self.inner = model.model
        self.layers = list(self.inner.layers)
        self.num_layers = len(self.layers)
        att = self.layers[0].self_attn
        self.head_dim = att.head_dim
        self.n_heads = cfg.num_attention_heads
        self.n_kv = cfg.num_key_value_heads
        self.scaling = att.scaling
        self.max_positions = int(getattr(cfg, "max_position_embeddings", None) or 1 << 30)
        self.qk_norm = hasattr(att, "q_norm")
        p = next(model.parameters())
        self.dtype, self.device = p.dtype, p.device
        self._lean = None  # (probe modules, LeanDecode or None): see lean_plan()

    def lean_plan(self):
        """The :class:`dspine.runtime.lean.LeanDecode` of the model's current linear layers,
        or None where it cannot run (rebuilt when the linear backend changes the layers)."""
        from dspine.runtime.blockq import BlockQLinear

        probe = (self.layers[0].self_attn.q_proj, self.layers[-1].mlp.down_proj)
        if self._lean is not None and self._lean[0][0] is probe[0] and self._lean[0][1] is probe[1]:
            return self._lean[1]
        plan = None
        if isinstance(probe[0], BlockQLinear):
            from dspine.runtime.lean import LeanDecode, lean_support

            if lean_support(self) is None:
                plan = LeanDecode(self)
        self._lean = (probe, plan)
        if plan is not None:
            from dspine.runtime.lean import choose_lean_rows

            choose_lean_rows(self, plan)  # measured once per model
        return plan

    @property
    def decode_path(self) -> str:
        """``lean`` when few-row forwards run in one C++ call (:mod:`dspine.runtime.lean`), else ``python``."""
        return "lean" if self.lean_plan() is not None else "python"

    def new_cache(self) -> DenseCache:
        return DenseCache(self)

    @torch.no_grad()
    def forward(self, input_ids: torch.Tensor, cache: DenseCache, feature_layers: list[int] | None,
                logits_to_keep: int = 0, tree: tuple[torch.Tensor, torch.Tensor] | None = None
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Run ``input_ids`` [1, n] (int64) after the cache's stored positions.

        ``tree``: optional (offsets [n] int64, mask [n, n] bool) for a flattened draft tree
        (:meth:`dspine.trees.DraftTree.positions` / ``attention_mask``): input i is at
        position start + offsets[i] and sees the stored prefix and the inputs its mask
        row allows (its ancestors and itself) instead of all earlier inputs. Its K/V are
        stored at slots start + i; keep an accepted path with :meth:`DenseCache.keep_rows`.

        Returns:
            logits [1, k, V] in the target dtype (k = n, or ``logits_to_keep`` > 0) and
            features [1, n, F * d] (the outputs of ``feature_layers``, concatenated, as
            transformers' ``hidden_states[l + 1]``: the last layer's after the final norm)
            or None.
        Raises:
            ValueError: a batch of more than one row (the batched engine has its own path).
        """
        b, n = input_ids.shape
        if b != 1:
            raise ValueError(f"the dense runtime runs one request per forward, got a batch of {b}")
        start = cache.seq_length()
        end = start + n
        cache._ensure(end)
        lean = self.lean_plan()  # an identity check once built (a prefill builds it at the latest)
        if lean is not None and 1 <= n <= lean.rows:
            x, by = lean.forward(self, input_ids, cache, start, list(feature_layers or ()), tree)
            cache._stored = end
            return self._finish(x, by, feature_layers, logits_to_keep)
        x = self.inner.embed_tokens(input_ids)
        if tree is None:
            pos = torch.arange(start, end, device=self.device)[None]
        else:
            pos = (start + tree[0].to(self.device))[None]
        cos, sin = self.inner.rotary_emb(x, pos)  # [1, n, hd] each, the target dtype
        cos, sin = cos[:, None], sin[:, None]
        half = self.head_dim // 2
        mask = None
        if tree is not None:  # new input i sees the prefix and its tree ancestors
            mask = torch.cat([torch.ones(n, start, dtype=torch.bool, device=self.device),
                              tree[1].to(self.device)], dim=1)
        elif n > 1:  # new position i sees the prefix and new positions <= i
            mask = torch.ones(n, end, dtype=torch.bool, device=self.device).tril(start)
        want = set(feature_layers or ())
        feats = []
        H, KV, hd = self.n_heads, self.n_kv, self.head_dim
        for i, layer in enumerate(self.layers):
            att = layer.self_attn
            h = layer.input_layernorm(x)
            q = att.q_proj(h).view(b, n, H, hd)
            k = att.k_proj(h).view(b, n, KV, hd)
            v = att.v_proj(h).view(b, n, KV, hd).transpose(1, 2)
            if self.qk_norm:
                q, k = att.q_norm(q), att.k_norm(k)
            q, k = q.transpose(1, 2), k.transpose(1, 2)
            q = q * cos + torch.cat((-q[..., half:], q[..., :half]), -1) * sin  # rotate_half
            k = k * cos + torch.cat((-k[..., half:], k[..., :half]), -1) * sin
            cache.k[i, :, :, start:end] = k
            cache.v[i, :, :, start:end] = v
            o = F.scaled_dot_product_attention(q, cache.k[i, :, :, :end], cache.v[i, :, :, :end],
                                               attn_mask=mask, scale=self.scaling, enable_gqa=KV != H)
            x = x + att.o_proj(o.transpose(1, 2).reshape(b, n, H * hd))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
            if i in want:
                feats.append((i, x))
        cache._stored = end
        return self._finish(x, dict(feats), feature_layers, logits_to_keep)

    def _finish(self, x: torch.Tensor, by: dict, feature_layers, logits_to_keep: int):
        """Final norm, logits and features from the last layer's output ``x`` [1, n, D] and
        ``by`` {layer: output} of the feature layers (see :meth:`forward`)."""
        last = self.num_layers - 1
        if last in by:  # transformers' hidden_states[L] is the final norm's output
            normed = self.inner.norm(x)
            by[last] = normed
            keep = normed if logits_to_keep <= 0 else normed[:, -logits_to_keep:]
        else:
            keep = self.inner.norm(x if logits_to_keep <= 0 else x[:, -logits_to_keep:])
        logits = self.model.lm_head(keep.contiguous())
        features = None
        if feature_layers:
            features = torch.cat([by[l] for l in feature_layers], dim=-1)
        return logits, features
