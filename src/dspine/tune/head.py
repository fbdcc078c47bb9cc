"""The candidate pass's kernel, measured per row count on this machine (spec section 4).

Which coarse-pass kernel (:mod:`dspine.drafter.candidate_pass`: ``int8``, ``bfloat16``,
``exact``, ``blockq``) is fastest depends on the CPU (``torch._int_mm`` is fast with
VNNI/AMX and ~30-60x slower than float32 on AVX2-only CPUs), so ``--head-kernel auto``
times each per bucket of row counts and caches the choice per machine and shapes.
"""
from __future__ import annotations

import torch

from dspine.drafter.candidate_pass import (HEAD_KERNELS, ROW_BUCKETS, CandidatePass, blockq_head_unavailable,
                                           forced_candidate_pass, make_kernel)
from dspine.tune.choose import Choice, choose_fastest


def plan_candidate_pass(head: torch.Tensor, x_dtype: torch.dtype, kernel: str = "auto", *,
                        redo: bool = False, timer=None, progress: bool = True,
                        ids: torch.Tensor | None = None) -> CandidatePass:
    """The candidate pass for ``head`` [V, d] with inputs of ``x_dtype``.

    ``kernel``: ``auto`` (measure per row bucket, cached per machine and shapes) or one
    of :data:`HEAD_KERNELS` (forced for every bucket). ``ids``: a draft vocabulary [Vs]
    int64 (sorted target ids, :mod:`dspine.drafter.vocab`): the pass then scores only those
    rows of ``head`` (a copy of Vs rows) and :attr:`CandidatePass.ids` maps its columns
    back. ``timer`` is injected by tests.
    Raises:
        ValueError: unknown kernel name.
    """
    if kernel != "auto":
        return forced_candidate_pass(head, kernel, ids)
    if ids is not None:
        head = head.detach()[ids.to(head.device)].contiguous()  # [Vs, d]
    V, d = head.shape
    names = [n for n in HEAD_KERNELS if n != "blockq" or blockq_head_unavailable(head) is None]
    built = {n: make_kernel(n, head, owned=ids is not None) for n in names}
    g = torch.Generator(device="cpu").manual_seed(0)
    choices: dict[int, Choice] = {}
    sync = torch.cuda.synchronize if head.is_cuda else (lambda: None)
    for b in ROW_BUCKETS:
        x = torch.randn(b, d, generator=g).to(device=head.device, dtype=x_dtype)

        def run(k=None, x=x):
            k.scores(x)
            sync()
        alts = {n: (lambda k=built[n], x=x: run(k, x)) for n in names}
        key = f"head:V={V},d={d},x={str(x_dtype).replace('torch.', '')},dev={head.device.type},m={b}"
        if "blockq" in names:
            from dspine.runtime.blockq import source_version

            key += f",blockq={source_version()}"
        choices[b] = choose_fastest(key, alts, timer=timer, redo=redo, progress=progress,
                                    what=f"the drafter's candidate-pass kernels ({', '.join(names)}) at {b} rows",
                                    device=str(head.device))
    return CandidatePass(head, {b: c.chosen for b, c in choices.items()}, choices, kernels=built, ids=ids)
