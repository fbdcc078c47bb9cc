"""Exact block-quantized weights for the target's one-row linears (``--linear-backend blockq``).

A target converted from a GGUF (the default SmolLM2: Q4_1 layers, a Q8_0 embedding/head)
holds float32 weights that are, group by group of 32, exactly ``d * q + m`` (Q4_1) or
``d * q`` (Q8_0) with float16 ``d``/``m`` and small integers ``q``. :func:`pack_q4` /
:func:`pack_q8` recover those blocks from the float32 weights and keep them only when
every group rebuilds bitwise; the C++ kernels (``kernels/blockq.cpp``) then rebuild each
weight in registers and multiply in float32. A one-token step reads ~0.75 (Q4) or ~1.1
(Q8) bytes per weight instead of 4: the same float32 target (the same weights, float32
products and sums; only the order of the sums differs from PyTorch's GEMV, as between any
two linear backends), decoded with fewer bytes per token.

The kernels are compiled once per machine with ``torch.utils.cpp_extension`` (a C++
compiler and ninja; ``-march=native``, or the level ``DSPINE_CPU_ISA`` caps it to) into
``$DSPINE_HOME/kernels``; where that fails the backend is simply not offered (:func:`kernels`, :func:`unavailable_reason`).
Inputs of up to a measured row limit (:func:`choose_rows`; at most :data:`MAX_ROWS`: a
decode step, a verification) take the kernels, which sum every dot product in one order
whatever the number of rows (row r of a verification is bitwise row r alone); longer ones
(the prompt's prefill) use oneDNN on packed float32 weights as ``mixed`` does.
"""
from __future__ import annotations

import hashlib
import os
import sys
from pathlib import Path

import torch
from torch import nn

QK = 32  # weights per block (GGUF's Q4_1 / Q8_0)
MAX_ROWS = 32  # rows the kernels take at once (kernels/blockq.cpp)
STALE_LOCK_S = 600.0  # a build lock older than this was left by a killed build (a build takes ~1 min)
_SOURCE = Path(__file__).parent / "kernels" / "blockq.cpp"
_STATE: dict = {}


def source_version() -> str:
    """A short hash of the kernels' source: measurements made with other kernels (the backend
    choice, the cost curve) are keyed by it and redone when it changes."""
    return hashlib.sha256(_SOURCE.read_bytes()).hexdigest()[:10]


def shape_key(model: nn.Module) -> str:
    """``V=..,h=..,ffn=..,layers=..`` of ``model.config``: the shape a row-count measurement
    of its linears depends on (cache keys of :func:`dspine.tune.choose.cached_measurement`)."""
    cfg = getattr(model, "config", None)
    return ",".join(f"{k}={getattr(cfg, a, '?')}" for k, a in (
        ("V", "vocab_size"), ("h", "hidden_size"), ("ffn", "intermediate_size"), ("layers", "num_hidden_layers")))


def _build_key() -> str:
    """The compiled kernels' folder name: their source, this torch install, Python, the CPU
    and the compiler flags. Not the thread count: the same binary serves any (a run on a busy
    machine takes 1 thread, a quiet one 2, and each rebuilt the kernels before 2026-12-07)."""
    from dspine.tune.machine import machine_info, march

    h = hashlib.sha256(_SOURCE.read_bytes())
    # the build files name this torch's include/lib paths: one folder per torch install, so two
    # environments sharing $DSPINE_HOME do not rebuild each other's kernels
    cpu = {k: v for k, v in machine_info("cpu").items() if k != "threads"}
    h.update(f"{torch.__version__}|{Path(torch.__file__).resolve().parent}|{sys.version_info[:2]}|"
             f"{'|'.join(f'{k}={cpu[k]}' for k in sorted(cpu))}|{march()}".encode())
    # compiled from the folder's own copy of the source (see kernels()); older folders were
    # built from a checkout's path, and sharing one with them would rebuild both ways again
    h.update(b"|source copied into the build folder")
    return h.hexdigest()[:12]


def _source_in(build: Path) -> Path:
    """The kernel source, copied into ``build`` (written only when it differs, atomically).

    ``build`` is named by the source's content hash, so every checkout with this source
    shares it; compiling each checkout's own path instead made ninja rebuild whenever two
    checkouts took turns (``benchmarks/defaults_vs_ar.py --old``: ~40 s per process)."""
    src = build / _SOURCE.name
    data = _SOURCE.read_bytes()
    if not src.exists() or src.read_bytes() != data:
        tmp = build / f"{_SOURCE.name}.{os.getpid()}.tmp"
        tmp.write_bytes(data)
        os.replace(tmp, src)
    return src


def kernels(progress: bool = True):
    """The compiled kernel module (built on first use, then loaded from the cache).

    Returns None when it cannot be built here; :func:`unavailable_reason` says why.
    """
    if "mod" in _STATE:
        return _STATE["mod"]
    from dspine.target.assets import dspine_home

    key = _build_key()
    build = dspine_home() / "kernels" / f"blockq-{key}"
    build.mkdir(parents=True, exist_ok=True)
    failed = build / "FAILED"
    if failed.exists():  # a failed build is not retried on every run (delete the folder to retry)
        _STATE["mod"], _STATE["why"] = None, failed.read_text().strip() + f" (delete {build} to retry)"
        return None
    lock = build / "lock"  # torch's build lock; one left by a killed build would block every run
    import time

    if lock.exists() and time.time() - lock.stat().st_mtime > STALE_LOCK_S:
        lock.unlink(missing_ok=True)
    first = not any(build.glob("*.so"))
    if first and progress:
        from dspine.tune.store import first_use_note

        first_use_note()
        print("dspine: compiling the blockq linear kernels for this machine and torch install (once; "
              "~40 s-1 min)", file=sys.stderr, flush=True)
    try:
        from torch.utils.cpp_extension import load
        from dspine.tune.machine import march

        mod = load(name=f"dspine_blockq_{key}", sources=[str(_source_in(build))], build_directory=str(build),
                   extra_cflags=["-O3", f"-march={march()}", "-fopenmp"], extra_ldflags=["-fopenmp"], verbose=False)
        _STATE["mod"], _STATE["why"] = mod, None
    except Exception as e:  # no compiler, no ninja, headers missing: the backend is not offered
        _STATE["mod"], _STATE["why"] = None, f"{type(e).__name__}: {str(e).strip().splitlines()[-1][:200] if str(e).strip() else ''}"
        try:
            failed.write_text(_STATE["why"] + "\n")
        except OSError:
            pass
        if progress:
            print(f"dspine: note: the blockq kernels could not be built here ({_STATE['why']})",
                  file=sys.stderr, flush=True)
    return _STATE["mod"]


def unavailable_reason() -> str | None:
    """Why :func:`kernels` returned None (None when they loaded or were not tried)."""
    return _STATE.get("why")


# -- packing -------------------------------------------------------------------------------------
def pack_q4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """Q4_1 blocks of a float32 weight ``w`` [N, K] when every group of 32 is exactly
    ``d * q + m`` (float16 d, m; q in 0..15), else None.

    Returns:
        (q [N, K/2] uint8: byte j of a block = q[j] | q[j+16] << 4, d [N, K/32] float32,
        m [N, K/32] float32).
    """
    if w.dim() != 2 or w.dtype != torch.float32 or w.shape[1] % QK:
        return None
    N, K = w.shape
    g = w.detach().reshape(N, K // QK, QK)
    m = g.amin(-1, keepdim=True)
    d = ((g.amax(-1, keepdim=True) - m) / 15).half().float()
    if not torch.equal(m.half().float(), m) or not torch.isfinite(d).all():
        return None
    q = torch.where(d > 0, torch.round((g - m) / torch.where(d > 0, d, 1.0)), 0.0).clamp_(0, 15)
    if not torch.equal(d * q + m, g):
        return None
    q = q.to(torch.uint8)
    packed = (q[..., :16] | (q[..., 16:] << 4)).reshape(N, K // 2).contiguous()
    return packed, d.reshape(N, K // QK).contiguous(), m.reshape(N, K // QK).contiguous()


def pack_q8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Q8_0 blocks of a float32 weight ``w`` [N, K] when every group of 32 is exactly
    ``d * q`` (float16 d; q in -127..127), else None.

    Returns:
        (q [N, K] int8, d [N, K/32] float32).
    """
    if w.dim() != 2 or w.dtype != torch.float32 or w.shape[1] % QK:
        return None
    N, K = w.shape
    g = w.detach().reshape(N, K // QK, QK)
    d = (g.abs().amax(-1, keepdim=True) / 127).half().float()
    if not torch.isfinite(d).all():
        return None
    q = torch.where(d > 0, torch.round(g / torch.where(d > 0, d, 1.0)), 0.0).clamp_(-127, 127)
    if not torch.equal(d * q, g):
        return None
    return q.to(torch.int8).reshape(N, K).contiguous(), d.reshape(N, K // QK).contiguous()


class BlockQLinear(nn.Module):
    """A linear whose one-row (up to ``rows``-row) float32 inputs run on exact blocks.

    Wraps ``inner`` (the layer used for other inputs: a :class:`~dspine.runtime.packed.PackedLinear`
    or ``nn.Linear``); ``weight``/``bias`` stay the inner layer's (ties, state_dict, memory
    accounting unchanged). x [..., K] float32 -> [..., N] float32.
    """

    def __init__(self, inner: nn.Module, blocks: tuple, rows: int = 1):
        super().__init__()
        self.inner, self.rows = inner, int(rows)
        self.in_features, self.out_features = inner.in_features, inner.out_features
        self.weight, self.bias = inner.weight, inner.bias
        self.kind = "q4" if len(blocks) == 3 else "q8"
        for i, t in enumerate(blocks):
            self.register_buffer(f"b{i}", t, persistent=False)
        self._mod = kernels(progress=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // self.in_features
        if not 1 <= rows <= self.rows or x.dtype != torch.float32 or self._mod is None:
            return self.inner(x)
        x2 = x.reshape(rows, self.in_features).contiguous()
        y = (self._mod.q4_linear(x2, self.b0, self.b1, self.b2) if self.kind == "q4"
             else self._mod.q8_linear(x2, self.b0, self.b1))
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*x.shape[:-1], self.out_features)

    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers())

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, blocks={self.kind}, rows<={self.rows}"


def _blocks_of(w: torch.Tensor):
    """:func:`pack_q4` or else :func:`pack_q8` of ``w``, remembered on ``w`` itself until it
    is modified in place (its ``_version`` moves), so switching backends does not rescan."""
    hit = getattr(w, "_dspine_blocks", None)
    if hit is not None and hit[0] == w._version:
        return hit[1]
    blocks = pack_q4(w) or pack_q8(w)
    try:
        w._dspine_blocks = (w._version, blocks)
    except (AttributeError, RuntimeError):
        pass
    return blocks


def pack_blocks(model: nn.Module, rows: int = 1, wrap: tuple[type, ...] = (nn.Linear,)) -> dict:
    """Wrap every linear of ``model`` (a module of exactly one of the ``wrap`` types, e.g. also
    :class:`~dspine.runtime.packed.PackedLinear`) whose weight packs exactly (:func:`pack_q4`,
    then :func:`pack_q8`) in a :class:`BlockQLinear`; returns counts ``{"q4": n, "q8": n,
    "kept": n}`` (kept: linears left as they were). Tied weights are packed once; layers
    inside a wrapped layer (its ``inner`` / ``original``) are not the model's and stay."""
    counts = {"q4": 0, "q8": 0, "kept": 0}
    seen: dict = {}
    for mod in list(model.modules()):
        if type(mod) in wrap or isinstance(mod, BlockQLinear):  # their inner layers are not the model's
            continue
        for name, ch in list(mod.named_children()):
            if type(ch) not in wrap:
                continue
            key = ch.weight.data_ptr()
            if key not in seen:
                seen[key] = _blocks_of(ch.weight)
            blocks = seen[key]
            if blocks is None:
                counts["kept"] += 1
                continue
            setattr(mod, name, BlockQLinear(ch, blocks, rows))
            counts["q4" if len(blocks) == 3 else "q8"] += 1
    return counts


def choose_rows(model: nn.Module, sizes: tuple[int, ...] = (MAX_ROWS, 17, 4), repeats: int = 2) -> int:
    """Set (and return) the most rows the kernels take in ``model``'s :class:`BlockQLinear`
    layers: the largest of ``sizes`` at which one pass over all those layers ran faster on the
    kernels than on the inner layers (oneDNN on packed float32 weights), measured here with
    the weights streaming from memory as in a real forward (best of ``repeats``; ~0.3-1 s on
    2 cores). A one-token step always takes the kernels. Where oneDNN's GEMM is faster (more
    cores, AVX-512), verifications stay on it. Measures every time it is called:
    :func:`dspine.runtime.packed.set_linear_backend` caches its result per machine."""
    import time

    layers = [m for m in model.modules() if isinstance(m, BlockQLinear)]
    if not layers:
        return 0
    seen, uniq = set(), []
    for m in layers:  # a tied layer once
        if m.b0.data_ptr() not in seen:
            seen.add(m.b0.data_ptr())
            uniq.append(m)

    def best_s(fn):
        ts = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t0)
        return min(ts)

    rows = 1
    with torch.no_grad():
        for r in sorted(sizes, reverse=True):
            xs = {k: torch.randn(r, k) for k in {m.in_features for m in uniq}}
            for m in uniq:
                m.rows = r
            kern = best_s(lambda: [m(xs[m.in_features]) for m in uniq])
            inner = best_s(lambda: [m.inner(xs[m.in_features]) for m in uniq])
            if kern <= inner:
                rows = r
                break
    for layer in layers:
        layer.rows = rows
    return rows


def unpack_blocks(model: nn.Module) -> int:
    """Undo :func:`pack_blocks` (the inner layers come back); returns how many."""
    n = 0
    for mod in list(model.modules()):
        for name, ch in list(mod.named_children()):
            if isinstance(ch, BlockQLinear):
                setattr(mod, name, ch.inner)
                n += 1
    return n


def blocks_bytes(model: nn.Module) -> int:
    """Bytes of the block copies held by ``model``'s :class:`BlockQLinear` layers (tied ones once)."""
    seen, n = set(), 0
    for m in model.modules():
        if isinstance(m, BlockQLinear) and m.b0.data_ptr() not in seen:
            seen.add(m.b0.data_ptr())
            n += m.nbytes()
    return n
