"""Capture of the recurrence inputs of a hybrid target's Gated-DeltaNet layers (ReplaySSM).

:func:`install_capture` wraps the gated-delta-rule kernels of the model's transformers
modeling module (idempotent). The wrappers are transparent unless a
:class:`dspine.target.replay_ssm.ReplayCache` is updating a linear layer (``_CAPTURE``
set): then they hand the layer's ``k, v, g, beta`` to that cache. :func:`_original`
gives the unwrapped kernel (what replay calls).
"""
from __future__ import annotations

import contextvars
import sys

from torch import nn

from dspine.target.hybrid_arch import HybridTargetError

_KERNELS = ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule")

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
