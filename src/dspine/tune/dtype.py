"""The target's dtype for batched forwards, measured.

Data generation (``dspine data build``) and feature extraction (``dspine train
features`` / online training features) run the target on batches. bfloat16 halves the
bytes per weight, but a CPU without native bfloat16 arithmetic (AVX2-only) converts
every operand and ran data generation at 2-4 tok/s vs 33 tok/s in float32 on one such
machine. So ``auto`` times one batched forward of each dtype on this machine (cached per
machine, target and shape, :mod:`dspine.tune.store`) and picks the faster. The choice
changes speed only: stored features are bfloat16 either way, and generated token ids
are the target's greedy/sampled output in the dtype recorded in the manifest.
"""
from __future__ import annotations

import copy

import torch

from dspine.tune.choose import Choice, choose_fastest

FORWARD_DTYPES = ("float32", "bfloat16")


def _alternative(model, dtype: torch.dtype, ids: torch.Tensor, decode: bool):
    """A zero-argument callable running one batched forward of ``model`` in ``dtype``:
    a decode step after a prefill of ``ids`` (``decode``) or a full teacher-forced forward."""
    from dspine.data.generate import cpu_speed_patches

    m = model if next(model.parameters()).dtype == dtype else copy.deepcopy(model).to(dtype)
    if decode:
        with torch.no_grad(), cpu_speed_patches(m):
            out = m(input_ids=ids, use_cache=True, logits_to_keep=1)
        past, step = out.past_key_values, ids[:, -1:]
        L = ids.shape[1]

        def step_on(cache):
            with torch.no_grad(), cpu_speed_patches(m):
                m(input_ids=step, past_key_values=cache, use_cache=True, logits_to_keep=1,
                  position_ids=torch.full_like(step, L))

        try:
            step_on(past)
            past.crop(-1)  # back to the prefill: every timed step sees the same cache
        except RuntimeError:  # a recurrent (Gated-DeltaNet) layer cannot crop: step on a copy
            saved = copy.deepcopy(past)
            return lambda: step_on(copy.deepcopy(saved))  # the copy's time counts for both dtypes alike

        def run():
            step_on(past)
            past.crop(-1)
        return run

    def run():
        with torch.no_grad(), cpu_speed_patches(m):
            m(input_ids=ids, output_hidden_states=True, logits_to_keep=1)
    return run


def choose_forward_dtype(target, batch: int, length: int, decode: bool, *, redo: bool = False,
                         timer=None, progress: bool = True) -> Choice:
    """The faster of float32 / bfloat16 for a batched forward of ``target`` (a loaded
    :class:`dspine.target.adapter.Target`, any dtype): ``batch`` rows of ``length`` tokens,
    either a decode step after a ``length``-token prefill (``decode``, data generation)
    or a teacher-forced forward (feature extraction). CUDA always takes bfloat16 (its
    tensor cores; not measured). The target is left as it was; a temporary copy in the
    other dtype is made for the timing.
    """
    if target.device.type == "cuda":
        return Choice("cuda", "bfloat16", {}, "CUDA: bfloat16 tensor cores (not measured)")
    cfg = target.config
    key = (f"dtype:{'decode' if decode else 'forward'}:target={target.name},V={target.vocab_size},"
           f"h={getattr(cfg, 'hidden_size', '?')},layers={getattr(cfg, 'num_hidden_layers', '?')},"
           f"b={batch},L={length}")
    if not redo:
        from dspine.tune.choose import cached_choice

        hit = cached_choice(key, FORWARD_DTYPES)
        if hit is not None:
            return hit
    V = target.vocab_size
    ids = (torch.arange(batch * length).view(batch, length) * 7919 % max(V - 1, 1) + 1).clamp_max(V - 1)
    from dspine.runtime.packed import set_linear_backend

    backend = getattr(target, "linear_backend", "aten")  # batched work runs PyTorch's linears; packed
    repack = backend != "aten"                            # weights cannot be copied
    if repack:
        set_linear_backend(target.model, "aten")
    try:
        # each alternative's model copy is built before timing (a copy's build is not its speed)
        alts = {n: _alternative(target.model, getattr(torch, n), ids.to(target.device), decode)
                for n in FORWARD_DTYPES}
        return choose_fastest(key, alts, timer=timer, redo=True, progress=progress, repeats=2,
                              what=f"the target's dtype for batched {'decoding' if decode else 'forwards'} "
                                   f"({batch}x{length} tokens)")
    finally:
        if repack:
            set_linear_backend(target.model, backend)


def resolve_dtype(name: str, target, batch: int, length: int, decode: bool, progress: bool = True) -> str:
    """``name`` unless it is ``auto``; then the measured :func:`choose_forward_dtype`."""
    if name != "auto":
        return name
    return choose_forward_dtype(target, batch, length, decode, progress=progress).chosen
