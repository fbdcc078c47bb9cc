"""Machine fingerprint for cached measurements: CPU model, ISA class, torch, threads.

A measurement is valid only on the machine (and software) it was taken on; the key
changes when any of these change, so a cache copied to another CPU is not reused.
"""
from __future__ import annotations

import hashlib
import os
import platform
from functools import lru_cache

import torch

#: CPU flags that change which kernels are fast (reported, and part of the key).
ISA_FLAGS = ("avx2", "fma", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16", "avx_vnni",
             "amx_tile", "amx_int8", "amx_bf16", "amx_fp16", "asimd", "sve", "i8mm", "bf16")

#: ``DSPINE_CPU_ISA`` values: the highest instruction set dspine's kernels may use here
#: (``native``: all the CPU has). A cap builds the blockq kernels for that level
#: (``-march``), hides the higher flags from the tune cache's key and from ``isa_class``,
#: and (set in :mod:`dspine` before torch is imported) caps PyTorch's and oneDNN's own
#: kernels the same way, so one machine can run, tune and measure as a CPU of a lower class
#: would (e.g. an AVX2-only CPU on an AVX-512 one), or build kernels that also run on
#: older machines of a cluster. It emulates the instruction set, not the micro-architecture.
ISA_CAPS = {"native": None, "avx2": "x86-64-v3", "avx512": "x86-64-v4"}
_CAP_DROPS = {"avx2": ("avx512", "amx"), "avx512": ("amx",)}
#: CPU flags a cap's ``-march`` level needs (x86-64-v3: AVX2 + FMA; v4: AVX-512 F + BW).
_CAP_NEEDS = {"avx2": ("avx2", "fma"), "avx512": ("avx512f", "avx512bw")}


def isa_cap() -> str:
    """The ``DSPINE_CPU_ISA`` setting (``native`` when unset).

    Raises:
        ValueError: a value other than those of :data:`ISA_CAPS`, or a level this CPU does
            not reach (e.g. ``avx512`` on an AVX2-only CPU, any cap off x86-64); the message
            names the variable.
    """
    cap = os.environ.get("DSPINE_CPU_ISA", "").strip().lower() or "native"
    if cap not in ISA_CAPS:
        raise ValueError(f"DSPINE_CPU_ISA={os.environ.get('DSPINE_CPU_ISA')!r}: use one of {', '.join(ISA_CAPS)}")
    missing = [f for f in _CAP_NEEDS.get(cap, ()) if f not in _raw_cpuinfo()[1]]
    if missing:  # kernels built for a level above the CPU's would die of an illegal instruction
        raise ValueError(f"DSPINE_CPU_ISA={cap}: this CPU lacks {', '.join(missing)}; the setting can only "
                         f"lower the instruction set (use native or a lower level)")
    return cap


def march() -> str:
    """The ``-march`` the C++ kernels are built with: ``native``, or the x86-64 level of the
    ``DSPINE_CPU_ISA`` cap (``x86-64-v3`` = AVX2+FMA, ``x86-64-v4`` = AVX-512 F/BW/CD/DQ/VL)."""
    return ISA_CAPS[isa_cap()] or "native"


def capped_flags(flags: tuple[str, ...], cap: str) -> tuple[str, ...]:
    """``flags`` without those above ``cap`` (a :data:`ISA_CAPS` key)."""
    drops = _CAP_DROPS.get(cap, ())
    return tuple(f for f in flags if not f.startswith(drops) and not (cap == "avx2" and f == "avx_vnni"))


@lru_cache(maxsize=1)
def _cpuinfo() -> tuple[str, tuple[str, ...]]:
    """(model name, sorted ISA flags of :data:`ISA_FLAGS` present, less those above the
    ``DSPINE_CPU_ISA`` cap)."""
    model, flags = _raw_cpuinfo()
    return model, capped_flags(tuple(sorted(f for f in ISA_FLAGS if f in flags)), isa_cap())


@lru_cache(maxsize=1)
def _raw_cpuinfo() -> tuple[str, frozenset[str]]:
    """(model name, every CPU flag) from /proc/cpuinfo (empty flags where it cannot be read)."""
    model, flags = platform.processor() or platform.machine(), set()
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                k, _, v = line.partition(":")
                k = k.strip().lower()
                if k == "model name" and model in ("", platform.machine(), platform.processor()):
                    model = v.strip()
                elif k in ("flags", "features") and not flags:
                    flags = set(v.split())
    except OSError:
        pass
    return model, frozenset(flags)


def isa_class(flags: tuple[str, ...] | None = None) -> str:
    """``AMX``, ``AVX-512`` (``+VNNI``/``+BF16`` noted), ``AVX2``, or torch's own word."""
    flags = _cpuinfo()[1] if flags is None else flags
    if "amx_tile" in flags:
        return "AMX"
    if "avx512f" in flags:
        extra = [n for f, n in (("avx512_vnni", "VNNI"), ("avx512_bf16", "BF16")) if f in flags]
        return "AVX-512" + "".join("+" + e for e in extra)
    if "avx2" in flags:
        return "AVX2" + ("+VNNI" if "avx_vnni" in flags else "")
    return torch.backends.cpu.get_cpu_capability()


def machine_info(device: str | torch.device = "cpu") -> dict:
    """Facts a measurement depends on. ``device``: where the kernels run (CUDA adds the
    GPU name). Threads are torch's current intra-op threads."""
    model, flags = _cpuinfo()
    info = {"cpu_model": model, "isa": isa_class(flags), "flags": list(flags),
            "torch_capability": torch.backends.cpu.get_cpu_capability(),
            "torch": torch.__version__, "threads": torch.get_num_threads(), "cores": os.cpu_count(),
            "device": str(device)}
    if isa_cap() != "native":
        info["isa_cap"] = isa_cap()
    if torch.device(device).type == "cuda" and torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(torch.device(device))
    return info


def machine_key(device: str | torch.device = "cpu") -> str:
    """Short stable hash of :func:`machine_info` (file name of the tune cache)."""
    info = machine_info(device)
    raw = "|".join(f"{k}={info[k]}" for k in sorted(info))
    return hashlib.sha256(raw.encode()).hexdigest()[:16]


def describe(device: str | torch.device = "cpu") -> str:
    """One line naming the machine, e.g. ``AMD EPYC (AVX2), 2 threads, torch 2.13.0+cpu``."""
    i = machine_info(device)
    gpu = f", {i['gpu']}" if "gpu" in i else ""
    cap = f" capped by DSPINE_CPU_ISA={i['isa_cap']}" if "isa_cap" in i else ""
    return f"{i['cpu_model']} ({i['isa']}{cap}), {i['threads']} threads, torch {i['torch']}{gpu}"


def others_cpu_load(interval_s: float = 0.3) -> float | None:
    """Cores kept busy by *other* processes over ``interval_s`` seconds (this process's own
    CPU time subtracted), from /proc/stat and /proc/self/stat; None where unavailable.
    A measurement taken while this is high is noted (it times a busy machine)."""
    import time

    def snap():
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:]]
        with open("/proc/self/stat") as f:
            st = f.read().rsplit(")", 1)[1].split()
        idle = v[3] + (v[4] if len(v) > 4 else 0)
        return sum(v), sum(v) - idle, int(st[11]) + int(st[12])
    try:
        t0, b0, s0 = snap()
        time.sleep(interval_s)
        t1, b1, s1 = snap()
    except (OSError, ValueError, IndexError):
        return None
    ncpu = os.cpu_count() or 1
    if t1 <= t0:
        return None
    return max(0.0, ((b1 - b0) - (s1 - s0)) / (t1 - t0) * ncpu)


def busy_note(threshold_cores: float = 0.5) -> str | None:
    """A warning line when other processes keep more than ``threshold_cores`` cores busy."""
    load = others_cpu_load()
    if load is None or load <= threshold_cores:
        return None
    return (f"dspine: note: other processes keep ~{load:.1f} of {os.cpu_count()} cores busy; this "
            f"measurement may be off (the cost policy corrects its curve while decoding; "
            f"`dspine tune --redo` on an idle machine measures again)")
