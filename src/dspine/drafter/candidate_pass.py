"""The drafter's candidate pass: the coarse-pass kernels and their dispatch per row count.

The final stage (spec section 4) scores every row's normed state against the whole
vocabulary head H [V, d] to keep the top ``coarse_k`` candidates, which the exact head
then rescores. The spec prescribes a quantized coarse pass (int8 here, FP8 on CUDA),
but which kernel is fastest depends on the CPU: ``torch._int_mm`` is fast with VNNI/AMX
and ~30-60x slower than float32 on AVX2-only CPUs, and a bfloat16 GEMV beats float32
there while a bfloat16 GEMM of 15 rows does not. So the kernel is chosen by measurement,
per bucket of row counts (:func:`dspine.tune.head.plan_candidate_pass`, where an engine is
built), among:

- ``int8``: :class:`dspine.drafter.final_stage.QuantizedHead` (row-scaled int8 copy, V*d bytes;
  FP8 on CUDA);
- ``bfloat16``: a bfloat16 copy of H (2*V*d bytes), scores in bfloat16;
- ``exact``: H itself in the drafter's dtype (no copy);
- ``blockq``: where H holds exact GGUF blocks (a float32 target converted from a GGUF, e.g.
  SmolLM2's Q8_0 embedding) and the blockq kernels build here: exact float32 scores on
  those blocks (``dspine.runtime.blockq``), ~1 byte per weight read, no copy beyond the
  blocks the target's own head already uses on ``--linear-backend blockq``.

Candidates only propose; they never decide the target's output, so every kernel keeps
decoding lossless. Kernels can differ in which tokens enter the coarse pool (int8
rounding), which can change tau slightly, never the output.
"""
from __future__ import annotations

import torch

from dspine.config import ConfigError
from dspine.drafter.final_stage import QuantizedHead

#: Measured in this order (the exact head first: it is never pathological, so a kernel
#: whose first call is many times slower is cut off early, :func:`choose_fastest`).
HEAD_KERNELS = ("exact", "bfloat16", "int8", "blockq")
#: Row counts the choice is measured at; a call with m rows uses the smallest bucket >= m.
ROW_BUCKETS = (1, 4, 16, 64)


class DenseHead:
    """A copy of H [V, d] in ``dtype`` for the coarse pass (2*V*d bytes in bfloat16)."""

    exact = False  # rounded scores: the candidates are rescored on H

    def __init__(self, head: torch.Tensor, dtype: torch.dtype):
        self.dtype = dtype
        self.w = head.detach().to(dtype).contiguous()  # [V, d]

    def nbytes(self) -> int:
        return self.w.numel() * self.w.element_size()

    def scores(self, x: torch.Tensor) -> torch.Tensor:
        """x [m, d] -> [m, V] float32."""
        return (x.to(self.dtype) @ self.w.T).float()


class ExactHead:
    """H itself (no copy; ``owned``: a copy only this kernel holds, e.g. the rows of a draft
    vocabulary, counted by :meth:`nbytes`): scores ``x @ H.T`` in x's dtype."""

    def __init__(self, head: torch.Tensor, owned: bool = False):
        self.w, self.owned = head, owned
        # float32 scores of a float32 H are the rescoring's own: no second pass
        self.exact = head.dtype == torch.float32

    def nbytes(self) -> int:
        return self.w.numel() * self.w.element_size() if self.owned else 0

    def scores(self, x: torch.Tensor) -> torch.Tensor:
        return (x @ self.w.to(x.dtype).T).float()


class BlockQHead:
    """Scores ``x @ H.T`` on H's exact blocks with the blockq kernels (float32 products and
    sums; row r's scores do not depend on the other rows). x of any dtype is scored in
    float32, at most the kernels' row limit per call.

    Raises:
        ConfigError: H is not stored in exact blocks, or the kernels cannot be built here
            (naming ``SpeculativeConfig.head_kernel`` blockq).
    """

    exact = True  # float32 products on H's own blocks: the exact scores (summed in another order)

    def __init__(self, head: torch.Tensor):
        from dspine.runtime import blockq

        why = blockq_head_unavailable(head)
        if why is not None:
            raise ConfigError(f"SpeculativeConfig.head_kernel blockq cannot run here: {why}", field="head_kernel")
        self.blocks = blockq._blocks_of(head.detach())
        self.mod = blockq.kernels(progress=False)
        self.rows = blockq.MAX_ROWS

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.blocks)

    def scores(self, x: torch.Tensor) -> torch.Tensor:
        x = x.float().contiguous()
        call = self.mod.q4_linear if len(self.blocks) == 3 else self.mod.q8_linear
        if x.shape[0] <= self.rows:
            return call(x, *self.blocks)
        return torch.cat([call(x[i:i + self.rows].contiguous(), *self.blocks) for i in range(0, x.shape[0], self.rows)])


def blockq_head_unavailable(head: torch.Tensor) -> str | None:
    """None when :class:`BlockQHead` can score with ``head`` [V, d], else why not."""
    from dspine.runtime import blockq

    if head.dtype != torch.float32 or head.device.type != "cpu":
        return "the head is not a float32 CPU tensor"
    if blockq.kernels(progress=False) is None:
        return f"the blockq kernels are not built here ({blockq.unavailable_reason()})"
    if blockq._blocks_of(head.detach()) is None:
        return "the head is not stored in exact GGUF blocks (Q8_0 / Q4_1)"
    return None


def make_kernel(name: str, head: torch.Tensor, owned: bool = False):
    """Build one coarse-pass kernel by name (``owned``: ``head`` is a copy made for this pass,
    see :class:`ExactHead`). Raises ConfigError for an unknown name (naming
    ``SpeculativeConfig.head_kernel`` and the accepted values)."""
    if name == "int8":
        return QuantizedHead(head)
    if name == "bfloat16":
        return DenseHead(head, torch.bfloat16)
    if name == "exact":
        return ExactHead(head, owned)
    if name == "blockq":
        return BlockQHead(head)
    raise ConfigError(f"SpeculativeConfig.head_kernel {name!r} is unknown; accepted: {', '.join(HEAD_KERNELS)} "
                      f"(or auto where an engine is built: measured)", field="head_kernel")


def bucket(m: int) -> int:
    """The row bucket a call with ``m`` rows is dispatched by."""
    return next((b for b in ROW_BUCKETS if b >= m), ROW_BUCKETS[-1])


class CandidatePass:
    """Coarse scoring ``x @ H.T`` (approximate) with a kernel per row bucket.

    ``plan``: bucket -> kernel name; ``kernels``: name -> kernel object (only those the
    plan uses are kept, so an int8 copy that is never chosen costs no memory).
    ``choices``: the measured :class:`dspine.tune.choose.Choice` of each bucket (empty when
    the kernel was forced).
    ``ids``: the draft vocabulary [Vs] int64 (:mod:`dspine.drafter.vocab`) when ``head`` holds
    only those rows of the target's head (column j of :meth:`scores` is token ``ids[j]``),
    else None (column j is token j).
    """

    def __init__(self, head: torch.Tensor, plan: dict[int, str], choices: dict | None = None,
                 kernels: dict | None = None, ids: torch.Tensor | None = None):
        self.plan = {b: plan[b] for b in ROW_BUCKETS}
        kernels = kernels or {}
        self.kernels = {n: kernels.get(n) or make_kernel(n, head, owned=ids is not None)
                        for n in sorted(set(self.plan.values()))}
        self.choices = choices or {}
        self.device = head.device
        self.ids = None if ids is None else ids.to(head.device)

    def kernel_for(self, m: int) -> str:
        return self.plan[bucket(m)]

    def scores(self, x: torch.Tensor) -> torch.Tensor:
        """Approximate ``x @ H.T``: x [m, d] float -> [m, V] float32, by the kernel of m's bucket."""
        return self.kernels[self.kernel_for(x.shape[0])].scores(x)

    def exact_for(self, x: torch.Tensor) -> bool:
        """Whether :meth:`scores` of ``x`` [m, d] are H's exact float32 scores (``blockq`` on
        H's own blocks, or ``exact`` on a float32 H with float32 ``x``), so the final stage
        keeps its top candidates without rescoring them (:func:`dspine.drafter.final_stage.candidates`)."""
        return x.dtype == torch.float32 and bool(getattr(self.kernels[self.kernel_for(x.shape[0])], "exact", False))

    def nbytes(self) -> int:
        """Bytes of the kernels' own copies of H (the exact kernel adds none)."""
        return sum(k.nbytes() for k in self.kernels.values())

    def describe(self) -> dict:
        """``{"rows<=m": kernel}`` and why (for ``--json`` stats and ``dspine tune``)."""
        out = {"kernels": {f"rows<={b}": n for b, n in self.plan.items()}}
        if self.ids is not None:
            out["draft_vocab"] = int(self.ids.numel())
        if self.choices:
            out["measured_ms"] = {f"rows<={b}": c.times_ms for b, c in self.choices.items()}
        return out


def forced_candidate_pass(head: torch.Tensor, kernel: str, ids: torch.Tensor | None = None) -> CandidatePass:
    """The candidate pass for ``head`` [V, d] with ``kernel`` (one of :data:`HEAD_KERNELS`)
    for every row bucket, nothing measured. ``ids``: a draft vocabulary [Vs] int64 (sorted
    target ids): the pass scores only those rows of ``head``.

    Raises:
        ConfigError: unknown kernel name (naming ``SpeculativeConfig.head_kernel``).
    """
    if kernel == "auto":
        raise ConfigError(f"SpeculativeConfig.head_kernel auto is measured where an engine is built "
                          f"(dspine.tune.drafter.measured_proposer); forced here: one of {', '.join(HEAD_KERNELS)}",
                          field="head_kernel")
    if ids is not None:
        head = head.detach()[ids.to(head.device)].contiguous()  # [Vs, d]
    if kernel == "blockq":  # its blocks are the head's own (cached on it): build it once
        return CandidatePass(head, {b: kernel for b in ROW_BUCKETS}, kernels={"blockq": BlockQHead(head)}, ids=ids)
    make_kernel(kernel, head[:1])  # validates the name before building a full copy
    return CandidatePass(head, {b: kernel for b in ROW_BUCKETS}, ids=ids)
