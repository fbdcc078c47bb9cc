"""Hybrid targets (Gated-DeltaNet + full attention): ReplaySSM rollback (spec section 6).

transformers' ``qwen3_5`` (text model ``qwen3_5_text``) and ``qwen3_next`` mix
full-attention layers (a KV cache, cut back like a dense target's) with Gated-DeltaNet
linear-attention layers. A linear layer carries

* a recurrent state ``S`` [b, H_v, d_k, d_v] (float32), advanced per token t by the
  gated delta rule ``S <- exp(g_t) S;  S <- S + k_t (beta_t (v_t - S^T k_t))^T``
  (k_t L2-normalised), and
* a conv window: the last ``K`` (``linear_conv_kernel_dim``) pre-conv inputs of the
  depthwise causal convolution that produces q, k, v.

A verification pass advances both over all n+1 verified tokens. transformers' own
``DynamicCache.crop`` cannot undo that (it cuts attention K/V and, with past recording,
the conv window, but leaves the recurrent state at the end of the pass). ReplaySSM:

1. during a target forward, :class:`ReplayCache` keeps, per linear layer, the state of
   the last commit *by reference* (the forward writes the new state into a fresh
   buffer: no copy), the pre-conv inputs of every new token, and the per-token inputs
   of the recurrence (``k, v, g, beta`` after the convolution, exactly the tensors the
   model hands to its gated-delta-rule kernel; captured by a transparent wrapper around
   that kernel, active only while a :class:`ReplayCache` layer is being updated);
2. at :meth:`ReplayCache.rollback` to ``m`` of the pending tokens: if all pending
   tokens are kept, the forward's state is already exact (no work); otherwise the
   committed state is restored and the recurrence re-applied over the ``m`` accepted
   tokens only, all linear layers in one batched call of the model's own kernel
   (recurrent for m < 8, chunked from 8), and the conv window becomes the last ``K``
   pre-conv inputs of the accepted prefix. Full-attention K/V are cut as for dense targets.

The naive alternative (restore the committed state and re-run the target over the
accepted tokens, :func:`rerun_rollback`) is the baseline in
``benchmarks/archive/replay_vs_rerun.py``.

Guards (spec s.8): the recurrent state must be float32 (a config asking for another
dtype via ``recurrent_state_dtype`` / ``mamba_ssm_dtype`` / ``mamba_ssm_cache_dtype`` /
``ssm_state_dtype``, or a kernel returning another dtype, is refused); a recurrent or
hybrid architecture other than the ones above is refused. Both raise
:class:`~dspine.target.hybrid_arch.HybridTargetError` (a ``ValueError``) naming the
setting. Recognising hybrid targets: :mod:`dspine.target.hybrid_arch`; the kernel
wrappers of step 1: :mod:`dspine.target.replay_capture`; tiny random hybrids:
:mod:`dspine.target.random_hybrid`.
"""
from __future__ import annotations

import inspect

import torch
import torch.nn.functional as F
from torch import nn

from dspine.target.cache import TargetCache
from dspine.target.hybrid_arch import HybridTargetError, _text_config, hybrid_family, linear_layer_ids
from dspine.target.replay_capture import _CAPTURE, _KERNELS, _original, install_capture

#: replay of this many tokens or more uses the chunked kernel (fewer: the recurrent one)
REPLAY_CHUNK_FROM = 8


def _dynamic_cache_cls():
    from transformers import DynamicCache

    class ReplayKV(DynamicCache):
        """DynamicCache whose linear layers keep the last commit and log per-token inputs."""

        def __init__(self, config, owner: "ReplayCache"):
            super().__init__(config=config)
            self.owner = owner

        def is_recording_past(self, layer_idx: int) -> bool:
            # routes every linear-layer forward (also single-token steps) through
            # update_conv_state, so the pre-conv inputs are always seen here
            return layer_idx in self.owner._lin_pos or super().is_recording_past(layer_idx)

        def update_conv_state(self, conv_states, layer_idx, state_idx=0, conv_kernel_size=None, **kwargs):
            if layer_idx not in self.owner._lin_pos or state_idx != 0:
                return super().update_conv_state(conv_states, layer_idx, state_idx,
                                                 conv_kernel_size=conv_kernel_size, **kwargs)
            return self.owner._update_conv(layer_idx, conv_states, conv_kernel_size)

        def update_recurrent_state(self, recurrent_states, layer_idx, state_idx=0, **kwargs):
            if layer_idx not in self.owner._lin_pos or state_idx != 0:
                return super().update_recurrent_state(recurrent_states, layer_idx, state_idx, **kwargs)
            return self.owner._update_recurrent(layer_idx, recurrent_states)

        def crop(self, tokens_to_remove: int) -> None:
            raise RuntimeError("ReplayKV: use ReplayCache.rollback (linear-attention state needs replay)")

    return ReplayKV


class _LinState:
    """Per linear layer: committed state (by reference) and the pending per-token inputs."""

    __slots__ = ("rec", "conv", "x", "kvgb")

    def __init__(self):
        self.rec: torch.Tensor | None = None   # [b, Hv, dk, dv] float32 at the last commit
        self.conv: torch.Tensor | None = None  # [b, C, K] pre-conv window at the last commit
        self.x: list[torch.Tensor] = []        # pending pre-conv inputs, each [b, C, s]
        self.kvgb: list[tuple] = []            # pending (k, v, g, beta), each [b, s, ...]


class ReplayCache(TargetCache):
    """Rollback-able cache of a hybrid target (ReplaySSM, spec section 6).

    Same contract as :class:`dspine.target.adapter.TargetCache` (``kv``, ``length``,
    :meth:`seq_length`, :meth:`rollback`, :meth:`nbytes`), except that ``rollback``
    may only cut positions added since the last rollback (the pending ones).

    Args:
        model: the hybrid target model (``qwen3_5`` / ``qwen3_next``).
        batched: replay all linear layers in one kernel call (default) or layer by layer.
        kernel: ``recurrent`` (the model's token-by-token kernel), ``chunk`` (its chunked
            kernel) or ``auto``: recurrent up to :data:`REPLAY_CHUNK_FROM` - 1 tokens,
            chunked from there (measured in ``benchmarks/archive/replay_vs_rerun.py``).
    Raises:
        HybridTargetError: the model is not a supported hybrid.
    """

    def __init__(self, model: nn.Module, batched: bool = True, kernel: str = "auto"):
        # TargetCache.__init__ is not called: it would build a plain DynamicCache
        fam = hybrid_family(model.config)
        if fam is None:
            raise HybridTargetError(f"{getattr(model.config, 'model_type', '?')} is not a hybrid target")
        self.family = fam
        self._module = install_capture(model)
        self.linear_layers = linear_layer_ids(model.config)
        self._lin_pos = {l: i for i, l in enumerate(self.linear_layers)}
        self._lin = [_LinState() for _ in self.linear_layers]
        self.kernel_size = int(_text_config(model.config).linear_conv_kernel_dim)
        self.kv = _dynamic_cache_cls()(model.config, self)
        self.length = 0  # committed positions
        if kernel not in ("auto", "recurrent", "chunk"):
            raise ValueError(f"ReplayCache kernel {kernel!r}: expected auto, recurrent or chunk")
        self.batched, self.kernel = batched, kernel
        self.replayed_tokens = 0  # statistics: tokens re-applied by replay
        self.replays = 0

    # -- hooks called by the model (through ReplayKV) ---------------------------------
    def _update_conv(self, layer_idx: int, x: torch.Tensor, kernel_size: int | None) -> torch.Tensor:
        st, layer = self._lin[self._lin_pos[layer_idx]], self.kv.layers[layer_idx]
        K = int(kernel_size or self.kernel_size)
        cur = layer.conv_states[0] if layer.has_previous_state[0] else None
        full = x if cur is None else torch.cat([cur, x], dim=-1)  # [b, C, (K +) s]
        st.x.append(x)
        # new window in a fresh tensor: the committed window stays valid by reference
        layer.conv_states[0] = _window(full, K)
        layer.conv_kernel_size[0] = K
        layer.is_conv_states_initialized[0] = True
        layer.has_previous_state[0] = True
        if layer.device is None:
            layer.dtype, layer.device = x.dtype, x.device
        _CAPTURE.set((self, layer_idx))
        return full

    def _record_recurrence(self, layer_idx: int, k, v, g, beta) -> None:
        self._lin[self._lin_pos[layer_idx]].kvgb.append((k, v, g, beta))

    def _update_recurrent(self, layer_idx: int, state: torch.Tensor) -> torch.Tensor:
        _CAPTURE.set(None)
        st = self._lin[self._lin_pos[layer_idx]]
        if state.dtype != torch.float32:
            raise HybridTargetError(f"layer {layer_idx}: the gated-delta-rule kernel returned a "
                                    f"{state.dtype} recurrent state; ReplaySSM needs float32")
        if len(st.kvgb) != len(st.x):
            raise HybridTargetError(f"layer {layer_idx}: the recurrence inputs were not captured (the "
                                    f"model did not call {self._module.__name__}'s gated-delta-rule "
                                    f"kernels); refusing to run without exact rollback")
        layer = self.kv.layers[layer_idx]
        layer.recurrent_states[0] = state  # assign, not copy_: the committed state stays intact
        layer.is_recurrent_states_initialized[0] = True
        return state

    # -- TargetCache interface ----------------------------------------------------------
    def seq_length(self) -> int:
        """Positions currently stored (committed + pending)."""
        return self.kv.get_seq_length()

    def rollback(self, length: int) -> None:
        """Keep the first ``length`` positions (ReplaySSM for linear layers) and commit them.

        Raises:
            ValueError: ``length`` beyond what is stored, or before the last commit.
        """
        have = self.seq_length()
        if length > have:
            raise ValueError(f"cannot commit {length} positions: cache holds {have}")
        if length < self.length:
            raise ValueError(f"cannot roll a hybrid target back to {length} positions: ReplaySSM keeps "
                             f"the state of the last commit ({self.length} positions) only")
        m = length - self.length          # accepted pending tokens
        drop = have - length
        for i, layer in enumerate(self.kv.layers):
            if i not in self._lin_pos and drop:
                layer.crop(-drop)
        if drop:
            self._restore_and_replay(m)
        for st, l in zip(self._lin, self.linear_layers):
            layer = self.kv.layers[l]
            st.rec = layer.recurrent_states[0] if layer.has_previous_state[0] else None
            st.conv = layer.conv_states[0] if layer.has_previous_state[0] else None
            st.x.clear()
            st.kvgb.clear()
        self.length = length

    def _restore_and_replay(self, m: int) -> None:
        """Linear layers: state of the last commit + the first ``m`` pending tokens."""
        K = self.kernel_size
        todo = []
        for st, l in zip(self._lin, self.linear_layers):
            layer = self.kv.layers[l]
            if not st.x:  # layer saw nothing new
                continue
            x = _cat(st.x, -1)[..., :m]
            if st.conv is None and m == 0:
                layer.has_previous_state[0] = False
                layer.conv_states[0] = torch.zeros_like(layer.conv_states[0])
                layer.recurrent_states[0] = torch.zeros_like(layer.recurrent_states[0])
                continue
            base = st.conv if st.conv is not None else x.new_zeros(*x.shape[:-1], K)
            layer.conv_states[0] = _window(torch.cat([base, x], dim=-1), K)
            rec0 = st.rec if st.rec is not None else torch.zeros_like(layer.recurrent_states[0])
            if m == 0:
                layer.recurrent_states[0] = rec0
                continue
            k, v, g, beta = (_cat(t, 1)[:, :m] for t in zip(*st.kvgb))
            todo.append((layer, rec0, k, v, g, beta))
        if not todo:
            return
        self.replays += 1
        self.replayed_tokens += m
        chunked = self.kernel == "chunk" or (self.kernel == "auto" and m >= REPLAY_CHUNK_FROM)
        fn = _original(self._module, _KERNELS[0] if chunked else _KERNELS[1])
        if self.batched and len(todo) > 1:
            b = todo[0][1].shape[0]
            rec0, k, v, g, beta = (torch.cat([t[j] for t in todo], dim=0) for j in range(1, 6))
            new = _replay(fn, rec0, k, v, g, beta)
            for j, t in enumerate(todo):
                t[0].recurrent_states[0] = new[j * b:(j + 1) * b]
        else:
            for layer, rec0, k, v, g, beta in todo:
                layer.recurrent_states[0] = _replay(fn, rec0, k, v, g, beta)

    def nbytes(self) -> int:
        """Bytes of attention K/V plus the linear layers' recurrent and conv states."""
        total = 0
        for i, layer in enumerate(self.kv.layers):
            if i in self._lin_pos:
                ts = [layer.recurrent_states[0], layer.conv_states[0]]
            else:
                ts = [getattr(layer, "keys", None), getattr(layer, "values", None)]
            total += sum(t.numel() * t.element_size() for t in ts if isinstance(t, torch.Tensor))
        return total

    # -- inspection (tests, benchmark) ---------------------------------------------------
    def linear_state(self, layer_idx: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(recurrent state [b, Hv, dk, dv] float32, conv window [b, C, K]) of a linear layer,
        None before the first token."""
        layer = self.kv.layers[layer_idx]
        if not layer.has_previous_state[0]:
            return None, None
        return layer.recurrent_states[0], layer.conv_states[0]


def _cat(ts, dim: int) -> torch.Tensor:
    return ts[0] if len(ts) == 1 else torch.cat(list(ts), dim=dim)


def _window(full: torch.Tensor, K: int) -> torch.Tensor:
    """The last ``K`` columns of ``full`` [b, C, s], zero-padded on the left when s < K (new tensor)."""
    s = full.shape[-1]
    if s >= K:
        return full[..., s - K:].clone()
    return F.pad(full, (K - s, 0))


def _replay(fn, rec0, k, v, g, beta) -> torch.Tensor:
    """Gated delta rule over the given tokens from ``rec0``; the final state (float32).

    Calls one of the model's own kernels (recurrent or chunked), with the query slot
    filled by ``k`` (the outputs are discarded; the state does not depend on q). The
    torch reference chunked kernel pads to its chunk size (64 by default); replay
    passes the smallest power of two >= the token count (at least 16) instead.
    """
    kw = {}
    if "chunk_size" in _params(fn):
        kw["chunk_size"] = max(16, 1 << (k.shape[1] - 1).bit_length())
    _, state = fn(k, k, v, g=g, beta=beta, initial_state=rec0, output_final_state=True,
                  use_qk_l2norm_in_kernel=True, **kw)
    return state


_PARAMS: dict = {}


def _params(fn) -> tuple:
    if fn not in _PARAMS:
        try:
            _PARAMS[fn] = tuple(inspect.signature(fn).parameters)
        except (TypeError, ValueError):
            _PARAMS[fn] = ()
    return _PARAMS[fn]


def rerun_rollback(cache: ReplayCache, model: nn.Module, input_ids: torch.Tensor, length: int) -> None:
    """The naive alternative to replay (benchmark baseline): restore the committed state, cut
    K/V, and re-run the target over the accepted pending tokens ``input_ids[:, :length - cache.length]``
    (the ids of the last forward), then commit.
    """
    m = length - cache.length
    cache.rollback(cache.length)  # restore: replay of zero tokens
    if m > 0:
        with torch.no_grad():
            model(input_ids=input_ids[:, :m], past_key_values=cache.kv, use_cache=True, logits_to_keep=1)
    cache.rollback(length)
