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
:class:`HybridTargetError` (a ``ValueError``) naming the setting.
"""
from __future__ import annotations

import contextvars
import inspect
import math
import sys

import torch
import torch.nn.functional as F
from torch import nn

from dspine.target.cache import TargetCache
from dspine.target.registry import TargetError

#: model_type -> adapter family. Only these hybrid architectures are validated.
KNOWN_HYBRIDS = {"qwen3_5": "qwen3_5", "qwen3_5_text": "qwen3_5", "qwen3_next": "qwen3_next"}

#: config fields that would ask for a non-float32 recurrent state.
STATE_DTYPE_FIELDS = ("recurrent_state_dtype", "mamba_ssm_dtype", "mamba_ssm_cache_dtype", "ssm_state_dtype")

#: model types with recurrent / linear-attention state (refused unless in KNOWN_HYBRIDS).
_RECURRENT_MODEL_TYPES = {
    "mamba", "mamba2", "falcon_mamba", "falcon_h1", "jamba", "bamba", "zamba", "zamba2",
    "granitemoehybrid", "lfm2", "lfm2_moe", "lfm2_vl", "lfm3", "nemotron_h", "olmo_hybrid",
    "qwen3_5_moe", "qwen3_5_moe_text", "bailing_hybrid", "rwkv", "recurrent_gemma", "xlstm",
    "minimax", "plamo2",
}
_LINEAR_LAYER_TYPES = {"linear_attention", "conv", "mamba", "hybrid", "hybrid_sliding"}

_KERNELS = ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule")

#: replay of this many tokens or more uses the chunked kernel (fewer: the recurrent one)
REPLAY_CHUNK_FROM = 8


class HybridTargetError(TargetError):
    """A hybrid/recurrent target (or one of its settings) the adapter has not validated."""


# -- recognising hybrid targets ------------------------------------------------------------
def _text_config(config):
    get = getattr(config, "get_text_config", None)
    try:
        return get(decoder=True) if get is not None else config
    except TypeError:
        return get()


def hybrid_family(config) -> str | None:
    """``"qwen3_5"`` / ``"qwen3_next"`` for a supported hybrid, None for a dense target.

    Raises:
        HybridTargetError: a recurrent/hybrid architecture the adapter does not know, or a
            recurrent state dtype other than float32 (the message names the setting).
    """
    tc = _text_config(config)
    types = {getattr(config, "model_type", None), getattr(tc, "model_type", None)} - {None}
    layer_types = set(getattr(tc, "layer_types", None) or [])
    known = [KNOWN_HYBRIDS[t] for t in types if t in KNOWN_HYBRIDS]
    recurrent = bool(types & _RECURRENT_MODEL_TYPES) or bool(layer_types & _LINEAR_LAYER_TYPES)
    if not known and not recurrent:
        return None
    name = getattr(tc, "model_type", None) or getattr(config, "model_type", "?")
    if not known:
        raise HybridTargetError(
            f"target architecture {name!r} has recurrent/linear-attention state that the ReplaySSM "
            f"adapter does not know; supported hybrid architectures: {sorted(KNOWN_HYBRIDS)}")
    for cfg in (tc, config):
        for f in STATE_DTYPE_FIELDS:
            v = getattr(cfg, f, None)
            if v is not None and str(v).replace("torch.", "") not in ("float32", "fp32"):
                raise HybridTargetError(
                    f"target config sets {f}={str(v).replace('torch.', '')!r}: ReplaySSM needs the "
                    f"recurrent state in float32 (spec sections 6 and 8); set {f} to float32")
    bad = layer_types - {"linear_attention", "full_attention"}
    if bad:
        raise HybridTargetError(f"{name} target: layer types {sorted(bad)} are not supported by the "
                                f"ReplaySSM adapter (only linear_attention and full_attention)")
    return known[0]


def linear_layer_ids(config) -> list[int]:
    """Indices of the Gated-DeltaNet (linear-attention) layers."""
    lt = getattr(_text_config(config), "layer_types", None) or []
    return [i for i, t in enumerate(lt) if t == "linear_attention"]


# -- random hybrid targets (tests, debugging) ----------------------------------------------
_COMMON = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
               num_key_value_heads=2, head_dim=16, linear_conv_kernel_dim=4, linear_key_head_dim=16,
               linear_value_head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4)
_RANDOM_HYBRIDS = {
    "qwen3_5": ("qwen3_5_text", dict(_COMMON)),
    "qwen3_next": ("qwen3_next", dict(_COMMON, num_experts=4, num_experts_per_tok=2,
                                      moe_intermediate_size=32, shared_expert_intermediate_size=32)),
}


def default_layer_types(n: int) -> list[str]:
    """Linear attention everywhere except every 4th layer from layer 2 (4 layers: L L F L)."""
    return ["full_attention" if i % 4 == 2 else "linear_attention" for i in range(n)]


def build_random_hybrid(arch: str, vocab_size: int = 256, seed: int = 0, **overrides) -> nn.Module:
    """A tiny seeded random-weight hybrid causal LM (``qwen3_5`` text model or ``qwen3_next``).

    Default: hidden 64, 4 layers ``linear, linear, full, linear``, 2 key / 4 value heads of
    16 in the linear layers, conv kernel 4. The output head is sharpened (x8) as for
    dense random targets, and the Gated-DeltaNet decays are drawn slow (A in
    [0.02, 0.5] instead of [0.01, 16]) so the recurrent state carries information over
    many tokens and a wrong state shows up in the output.

    Raises:
        TargetError: ``arch`` is not one of ``qwen3_5``, ``qwen3_next``.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    if arch not in _RANDOM_HYBRIDS:
        raise TargetError(f"unknown random hybrid architecture {arch!r}; known: {sorted(_RANDOM_HYBRIDS)}")
    model_type, kw = _RANDOM_HYBRIDS[arch]
    kw = dict(kw)
    kw.update(overrides)
    kw.setdefault("layer_types", default_layer_types(kw["num_hidden_layers"]))
    cfg = AutoConfig.for_model(model_type, vocab_size=vocab_size, max_position_embeddings=4096,
                               tie_word_embeddings=False, bos_token_id=1, eos_token_id=0,
                               pad_token_id=0, **kw)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(cfg)
        with torch.no_grad():
            model.get_output_embeddings().weight.mul_(8.0)
            for mod in model.modules():
                if hasattr(mod, "A_log") and hasattr(mod, "dt_bias"):
                    mod.A_log.copy_(torch.empty_like(mod.A_log).uniform_(math.log(0.02), math.log(0.5)))
    return model


# -- capture of the recurrence inputs ------------------------------------------------------
# (cache, layer_idx) while a ReplayCache linear layer is between its conv update and its
# recurrent-state update; the kernel wrapper records k, v, g, beta for that layer.
_CAPTURE: contextvars.ContextVar = contextvars.ContextVar("dspine_replay_capture", default=None)
_ORIGINALS: dict[tuple[str, str], object] = {}


def _wrap_kernel(orig):
    def kernel(query, key, value, *args, **kwargs):
        sink = _CAPTURE.get()
        if sink is not None:
            _CAPTURE.set(None)  # one capture per layer update
            cache, layer_idx = sink
            if args or "g" not in kwargs or "beta" not in kwargs:
                raise HybridTargetError("ReplaySSM: unexpected gated-delta-rule call signature; "
                                        "cannot capture the recurrence inputs")
            cache._record_recurrence(layer_idx, key, value, kwargs["g"], kwargs["beta"])
        return orig(query, key, value, *args, **kwargs)

    kernel._dspine_original = orig
    kernel.__name__ = getattr(orig, "__name__", "gated_delta_rule")
    return kernel


def _modeling_module(model: nn.Module):
    """The transformers modeling module that defines the model's Gated-DeltaNet layers."""
    for mod in model.modules():
        if type(mod).__name__.endswith("GatedDeltaNet"):
            return sys.modules[type(mod).__module__]
    raise HybridTargetError(f"{type(model).__name__}: no Gated-DeltaNet layer found")


def install_capture(model: nn.Module):
    """Wrap the gated-delta-rule kernels of the model's modeling module (idempotent).

    The wrappers are transparent unless a :class:`ReplayCache` is updating a layer.
    Returns the modeling module.
    """
    m = _modeling_module(model)
    for name in _KERNELS:
        fn = getattr(m, name, None)
        if fn is None:
            raise HybridTargetError(f"{m.__name__} has no {name}; this transformers version is not "
                                    f"supported by the ReplaySSM adapter")
        if not hasattr(fn, "_dspine_original"):
            _ORIGINALS[(m.__name__, name)] = fn
            setattr(m, name, _wrap_kernel(fn))
    return m


def _original(module, name: str):
    return _ORIGINALS[(module.__name__, name)]


# -- the cache ---------------------------------------------------------------------------
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
