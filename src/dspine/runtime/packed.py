"""The target's linear backends: PyTorch's own, column-major weights, oneDNN with
pre-packed weights, or both (``--linear-backend``, CPU).

PyTorch's default CPU linear (``aten``) runs a one-token step as GEMV and a short
verification (2-16 tokens) as a GEMM that re-reads and re-blocks the weight on every
call. On the 2-core AMD EPYC (AVX2) of this project a 2-token target forward cost ~1.5x
a one-token step and a 16-token one ~2x, which is what made verifying drafted tokens
expensive. oneDNN with the weight reordered once into its blocked layout
(``torch.ops.mkldnn._reorder_linear_weight`` and ``_linear_pointwise``, the kernels
inductor's CPU freezing pass emits) makes multi-token forwards much cheaper on such CPUs.
A one-token step is a GEMV, which oneDNN does not speed up; column-major weights do
(:mod:`dspine.runtime.layout`), and ``mixed`` uses them for one-row inputs and the packed
copy for more rows. Whether each pays depends on the CPU, so ``auto`` measures every
available backend on the loaded target (:func:`choose_linear_backend`).

Numerics: the same float32/bfloat16 products with another blocking, so logits differ
from ``aten`` by float rounding (~1e-5 relative in float32). Token-for-token equality
holds between modes that use the same backend (``ar`` and ``dspine`` both packed, as
``dspine generate`` does for every mode), as tested in ``tests/test_runtime.py``.

Memory: ``transposed`` costs nothing; for ``onednn``/``mixed`` the packed copy is a second copy of every linear weight (the original stays:
tied embeddings, the drafter's head binding and memory accounting read it): ~540 MB
more for SmolLM2-135M in float32.
"""
from __future__ import annotations

import time

import torch
from torch import nn

from dspine.config import ConfigError

LINEAR_BACKENDS = ("aten", "transposed", "onednn", "mixed", "blockq")
"""``aten``: PyTorch's own linear on row-major weights. ``transposed``: the same on
column-major weights (:mod:`dspine.runtime.layout`, no extra memory). ``onednn``: oneDNN
on weights packed once (a second copy). ``mixed``: column-major weights for one-row
inputs (a one-token step) and the packed copy for more rows (verification, batches).
``blockq``: the exact GGUF blocks of a target converted from Q4_1/Q8_0 for inputs of up
to 16 rows (:mod:`dspine.runtime.blockq`, C++ kernels built once per machine) and the
oneDNN packed copy for more (prefill, large trees)."""


def onednn_available() -> bool:
    """True when this torch build has the oneDNN linear ops (CPU builds usually do)."""
    return bool(torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")
                and hasattr(torch.ops.mkldnn, "_reorder_linear_weight"))


class PackedLinear(nn.Module):
    """``y = x W^T + b`` through oneDNN with W reordered once (CPU, float32/bfloat16).

    Keeps the original ``weight`` / ``bias`` parameters (shared with the wrapped layer,
    so ties and ``state_dict`` keys are unchanged) plus the packed copy ``packed``.
    x [..., in_features] -> [..., out_features] in the weight's dtype.
    """

    def __init__(self, lin: nn.Linear, batch_hint: int = 16, one_row_aten: bool = False):
        super().__init__()
        self.in_features, self.out_features = lin.in_features, lin.out_features
        self.weight, self.bias = lin.weight, lin.bias
        self.packed = torch.ops.mkldnn._reorder_linear_weight(lin.weight.detach().contiguous(), batch_hint)
        self.original = lin
        self.one_row_aten = one_row_aten  # ``mixed``: one-row inputs through F.linear on ``weight``

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.one_row_aten and x.numel() == self.in_features:
            return nn.functional.linear(x, self.weight, self.bias)
        b = None if self.bias is None else self.bias.detach()
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), self.packed, b, "none", [], "")

    def extra_repr(self) -> str:
        be = "mixed (one row: aten)" if self.one_row_aten else "onednn"
        return f"in_features={self.in_features}, out_features={self.out_features}, backend={be}"


def pack_linears(model: nn.Module, batch_hint: int = 16, one_row_aten: bool = False) -> int:
    """Replace every ``nn.Linear`` of ``model`` (CPU, float32/bfloat16) by a
    :class:`PackedLinear` in place; returns how many were replaced. ``one_row_aten``:
    one-row inputs keep PyTorch's linear on the original weight (``mixed``).

    Raises:
        ConfigError: the model is not on the CPU, this torch has no oneDNN linear, or this
            CPU cannot run it in the weights' dtype (bfloat16 needs AVX-512 or
            AVX-NE-CONVERT); named ``SpeculativeConfig.linear_backend``, nothing is left half-packed.
    """
    if not onednn_available():
        raise ConfigError("SpeculativeConfig.linear_backend onednn: this torch build has no oneDNN linear ops; "
                          "use SpeculativeConfig.linear_backend='aten'", field="linear_backend")
    n = 0
    for mod in list(model.modules()):
        for name, ch in list(mod.named_children()):
            if type(ch) is nn.Linear:
                if ch.weight.device.type != "cpu" or ch.weight.dtype not in (torch.float32, torch.bfloat16):
                    raise ConfigError(f"SpeculativeConfig.linear_backend onednn: layer {name} is {ch.weight.dtype} "
                                      f"on {ch.weight.device}; only CPU float32/bfloat16 layers can be packed",
                                      field="linear_backend")
                try:
                    packed = PackedLinear(ch, batch_hint, one_row_aten)
                except RuntimeError as e:  # e.g. bf16 reorder on a CPU without AVX-512/AVX-NE-CONVERT
                    unpack_linears(model)
                    raise ConfigError(f"SpeculativeConfig.linear_backend onednn: this CPU/torch cannot run oneDNN "
                                      f"{str(ch.weight.dtype).replace('torch.', '')} linears "
                                      f"({str(e).splitlines()[0]}); use SpeculativeConfig.linear_backend='aten'",
                                      field="linear_backend") from None
                setattr(mod, name, packed)
                n += 1
    return n


def unpack_linears(model: nn.Module) -> int:
    """Undo :func:`pack_linears` (the original layers come back); returns how many."""
    n = 0
    for mod in list(model.modules()):
        for name, ch in list(mod.named_children()):
            if isinstance(ch, PackedLinear):
                setattr(mod, name, ch.original)
                n += 1
    return n


def packed_bytes(model: nn.Module) -> int:
    """Bytes of the packed weight copies held by ``model``'s :class:`PackedLinear` layers."""
    return sum(m.weight.numel() * m.weight.element_size() for m in model.modules() if isinstance(m, PackedLinear))


def is_packed(model: nn.Module) -> bool:
    return any(isinstance(m, PackedLinear) for m in model.modules())


def set_linear_backend(model: nn.Module, backend: str) -> None:
    """Put ``model``'s linears on ``backend`` (one of :data:`LINEAR_BACKENDS`), undoing
    whatever backend they were on; only what differs is redone.

    Raises:
        ConfigError: unknown backend (naming ``SpeculativeConfig.linear_backend``), or a oneDNN
            backend where it cannot run (:func:`pack_linears`); the model is then left on ``aten``.
    """
    from dspine.runtime.blockq import MAX_ROWS, BlockQLinear, choose_rows, pack_blocks, unpack_blocks
    from dspine.runtime.layout import set_column_major

    if backend not in LINEAR_BACKENDS:
        raise ConfigError(f"SpeculativeConfig.linear_backend {backend!r} is unknown; accepted: auto, "
                          f"{', '.join(LINEAR_BACKENDS)}", field="linear_backend")
    if backend == "blockq" and any(isinstance(m, BlockQLinear) for m in model.modules()):
        return  # already on it (switching back and forth while measuring costs nothing)
    unpack_blocks(model)  # blockq wraps the packed layers; rebuilt below when asked for again
    want_packed = backend in ("onednn", "mixed", "blockq")
    packs = [m for m in model.modules() if isinstance(m, PackedLinear)]
    if packs and (not want_packed or any(m.one_row_aten != (backend == "mixed") for m in packs)):
        unpack_linears(model)
        packs = []
    set_column_major(model, backend in ("transposed", "mixed"))
    if want_packed and not packs:
        try:
            pack_linears(model, one_row_aten=backend == "mixed")
        except ValueError as e:
            set_column_major(model, False)
            key = "SpeculativeConfig.linear_backend"
            raise ConfigError(str(e).replace(f"{key} onednn", f"{key} {backend}"), field="linear_backend") from None
    if backend == "blockq":
        from dspine.runtime.blockq import kernels, unavailable_reason

        if kernels() is None:
            set_linear_backend(model, "aten")
            raise ConfigError(f"SpeculativeConfig.linear_backend blockq: its kernels could not be built here "
                              f"({unavailable_reason()}); use another backend", field="linear_backend")
        counts = pack_blocks(model, rows=MAX_ROWS, wrap=(nn.Linear, PackedLinear))
        if not counts["q4"] + counts["q8"]:
            set_linear_backend(model, "aten")
            raise ConfigError("SpeculativeConfig.linear_backend blockq: no linear layer of this target holds exact "
                              "Q4_1/Q8_0 blocks (only targets converted from such a GGUF do); use another backend",
                              field="linear_backend")
        rows = getattr(model, "_dspine_blockq_rows", None)
        if rows is None:  # how many rows the kernels take here (more go to oneDNN): measured once per machine
            from dspine.runtime.blockq import shape_key, source_version
            from dspine.tune.choose import cached_measurement

            key = f"blockq-rows:{shape_key(model)},max={MAX_ROWS},kernels={source_version()}"
            rows = model._dspine_blockq_rows = cached_measurement(
                key, lambda: choose_rows(model), valid=lambda v: 0 <= v <= MAX_ROWS,
                what="how many rows the blockq kernels take in the target's linears")
        for m in model.modules():
            if isinstance(m, BlockQLinear):
                m.rows = rows


def available_backends(target, blockq: bool = True, progress: bool = True) -> tuple[str, ...]:
    """The backends that can run ``target`` here: the four PyTorch/oneDNN ones for a dense CPU
    float32/bfloat16 target on a torch with oneDNN, and ``blockq`` too where
    :func:`blockq_available` (``blockq=False``: not asked, so its kernels are neither built
    nor loaded); ``aten``/``transposed`` without oneDNN; only ``aten`` for CUDA and hybrid
    (Gated-DeltaNet) targets."""
    if target.device.type != "cpu" or target.dtype not in (torch.float32, torch.bfloat16) \
            or target.hybrid is not None:
        return ("aten",)
    if not onednn_available():
        return ("aten", "transposed")
    if blockq and blockq_available(target, progress=progress):
        return LINEAR_BACKENDS
    return tuple(b for b in LINEAR_BACKENDS if b != "blockq")


def blockq_available(target, progress: bool = True) -> bool:
    """``blockq`` can run ``target``: float32 on the CPU, its first linear layer holds
    exact Q4_1/Q8_0 blocks, and the kernels build here (compiled on the first call)."""
    from dspine.runtime.blockq import kernels, pack_q4, pack_q8

    if target.dtype != torch.float32 or target.device.type != "cpu":
        return False
    lin = next((m for m in target.model.modules() if isinstance(m, (nn.Linear, PackedLinear))), None)
    if lin is None or (pack_q8(lin.weight) is None and pack_q4(lin.weight) is None):
        return False
    return kernels(progress=progress) is not None


#: True once this process timed the linear backends against each other: its target then ran
#: slower than in a later process that reads the choice (a plain step 15-16 ms instead of 13 on
#: a 2-core AMX Xeon, 2026-12-06), so a cost curve measured here is kept as provisional
#: (:func:`dspine.tune.cost.measure_cost`) and measured again by the next run
BACKENDS_TIMED_HERE = False


def choose_linear_backend(target, *, redo: bool = False, timer=None, progress: bool = True, context: int = 64):
    """Measure the target's forward with each available backend (:func:`available_backends`)
    on this machine and return the :class:`dspine.tune.choose.Choice` (cached per machine,
    target shape and dtype). The time of an alternative is a one-token step plus a
    16-token verification after a ``context``-token prefix: the two forwards speculative
    decoding alternates between; the median of 3 rounds that each time every backend in a
    rotated order (the margins can be ~10%, so a drift of the load must not decide). The
    target is left with ``aten`` linears.
    """
    from dspine.tune.choose import Choice, choose_fastest
    from dspine.runtime.blockq import source_version

    names = available_backends(target, progress=progress)
    if len(names) == 1:
        return Choice("linear", "aten", {}, "only dense CPU float32/bfloat16 targets change linear backend")
    cfg = target.config
    key = (f"linear4:target={target.name},dtype={str(target.dtype).replace('torch.', '')},V={target.vocab_size},"
           f"h={getattr(cfg, 'hidden_size', '?')},layers={getattr(cfg, 'num_hidden_layers', '?')},"
           f"backends={'/'.join(names)},runtime={getattr(target, 'runtime_name', 'hf')}"
           + (f",kernels={source_version()}" if "blockq" in names else ""))
    V = target.vocab_size
    ids = (torch.arange(1, context + 17) * 7919 % max(V - 1, 1) + 1).clamp_max(V - 1)[None]

    def run(backend: str):
        def call():
            set_linear_backend(target.model, backend)
            with torch.no_grad():
                cache = target.new_cache()
                target.forward(ids[:, :context], cache, None, logits_to_keep=1)
                t0 = time.perf_counter()
                target.forward(ids[:, context:context + 1], cache, None)
                cache.rollback(context)
                target.forward(ids[:, context:context + 16], cache, None)
                return time.perf_counter() - t0
        return call

    def timed(name, fn, repeats, cap):  # time only the two decode-side forwards, not the prefill
        fn()
        ts = sorted(fn() for _ in range(repeats))
        return ts[len(ts) // 2]

    try:
        choice = choose_fastest(key, {b: run(b) for b in names}, timer=timer or timed, redo=redo,
                                repeats=3, rounds=3, progress=progress,
                                what="the target's linear backend (" + " vs ".join(names) + ")")
        if not choice.cached:
            global BACKENDS_TIMED_HERE
            BACKENDS_TIMED_HERE = True
        return choice
    finally:
        set_linear_backend(target.model, "aten")


def apply_linear_backend(target, backend: str, progress: bool = True) -> str:
    """Put ``target``'s linears on ``backend`` (``auto``: :func:`choose_linear_backend`)
    and record it as ``target.linear_backend``; returns the backend used.

    Raises:
        ConfigError: unknown backend (naming ``SpeculativeConfig.linear_backend``), or one that
            cannot run this target here (:func:`available_backends`, :func:`pack_linears`).
    """
    if backend not in ("auto", *LINEAR_BACKENDS):
        raise ConfigError(f"SpeculativeConfig.linear_backend {backend!r} is unknown; accepted: auto, "
                          f"{', '.join(LINEAR_BACKENDS)}", field="linear_backend")
    if backend == "auto":
        backend = choose_linear_backend(target, progress=progress).chosen
    elif backend not in available_backends(target, blockq=backend == "blockq", progress=progress):
        avail = available_backends(target, blockq=backend == "blockq", progress=False)
        why = ""
        if backend == "blockq" and (target.dtype != torch.float32 or target.device.type != "cpu"):
            why = "; blockq runs float32 targets on the CPU only"
        elif backend == "blockq":
            from dspine.runtime.blockq import unavailable_reason

            why = (f"; its kernels could not be built: {unavailable_reason()}" if unavailable_reason() else
                   "; this target's weights hold no exact Q4_1/Q8_0 blocks (only targets converted from "
                   "such a GGUF do)")
        raise ConfigError(f"SpeculativeConfig.linear_backend {backend}: not available for this target here (a "
                          f"{str(target.dtype).replace('torch.', '')} {target.device.type} "
                          f"{'hybrid ' if target.hybrid else ''}target{why}; available: {', '.join(avail)})",
                          field="linear_backend")
    set_linear_backend(target.model, backend)
    target.linear_backend = backend
    rt = getattr(target, "runtime", None)
    if rt is not None and hasattr(rt, "lean_plan"):
        rt.lean_plan()  # build (and measure) the lean decode path now, not inside the first decode
    return backend
