"""Column-major storage of the target's linear weights (``--linear-backend transposed``).

A one-token target step multiplies a row by every weight matrix: a GEMV that reads each
weight once. PyTorch's CPU ``F.linear(x, W)`` with W stored row-major ([out, in],
contiguous, as checkpoints hold it) ran that GEMV at ~7 GB/s on the 2-core AMD EPYC
(AVX2) of this project, while the same product with W stored column-major
(``W.t()`` contiguous, so ``F.linear`` calls ``addmm(x, W^T)`` on a contiguous
[in, out] matrix) ran at ~10-12 GB/s: the whole SmolLM2-135M step went from ~110-120 ms
to ~75 ms (``benchmarks/archive/linear_backend.py``). Whether it pays depends on the CPU and
BLAS, so ``--linear-backend auto`` measures it (:mod:`dspine.runtime.packed`).

The change is in place and costs no memory: each weight ``Parameter`` keeps its shape
[out, in], its identity (ties with the input embedding and the drafter's head binding
stay) and its values; only its strides change. Numerics: the same float32 products in
another blocking, so logits may differ from the row-major layout by float rounding;
every mode of a process uses the same layout, so greedy equality between modes holds
(``tests/test_runtime.py``).
"""
from __future__ import annotations

import torch
from torch import nn


def _linear_weights(model: nn.Module) -> list[nn.Parameter]:
    """The unique weight parameters of ``model``'s linear layers (tied ones once; a
    :class:`dspine.runtime.packed.PackedLinear` holds its original layer as a submodule)."""
    seen, out = set(), []
    for mod in model.modules():
        if isinstance(mod, nn.Linear) and id(mod.weight) not in seen:
            seen.add(id(mod.weight))
            out.append(mod.weight)
    return out


def is_column_major(w: torch.Tensor) -> bool:
    """True when the 2-D ``w`` [out, in] is stored column-major (``w.t()`` contiguous)."""
    return w.dim() == 2 and w.shape[0] > 1 and w.shape[1] > 1 and w.t().is_contiguous()


def set_column_major(model: nn.Module, on: bool) -> int:
    """Store every linear weight of ``model`` column-major (``on``) or row-major (off),
    in place (values, shapes and parameter identities unchanged); returns how many
    weights were re-laid out (0 when already so).
    """
    n = 0
    with torch.no_grad():
        for w in _linear_weights(model):
            if w.dim() != 2 or is_column_major(w) == on:
                continue
            w.data = w.data.t().contiguous().t() if on else w.data.contiguous()
            n += 1
    return n


def model_is_column_major(model: nn.Module) -> bool:
    """True when every linear weight of ``model`` is stored column-major."""
    ws = [w for w in _linear_weights(model) if w.dim() == 2]
    return bool(ws) and all(is_column_major(w) for w in ws)
