"""The host record of a benchmark run: versions, threads, dtype, device, CPU and git state.

:func:`environment` is stored in every result row; :func:`git_dirty` says whether the
dspine checkout differs from its commit (a run's own ``--out`` excluded).
"""
from __future__ import annotations

import os
import platform
import subprocess
from pathlib import Path

import torch

from dspine.bench.run_config import BenchConfig


def _git(*args: str, root: Path | None = None) -> str | None:
    root = root or Path(__file__).resolve().parents[3]
    try:
        p = subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return p.stdout.strip() if p.returncode == 0 else None


def git_dirty(exclude: str | Path | None = None, root: Path | None = None) -> bool | None:
    """Whether tracked files of the dspine checkout (or of ``root``) differ from its
    commit (None: not a git checkout). ``exclude``: a directory whose changes do not
    count (a benchmark's own ``--out``, whose committed results the run replaces)."""
    root = Path(root).resolve() if root is not None else Path(__file__).resolve().parents[3]
    args = ["status", "--porcelain", "--untracked-files=no"]
    if exclude is not None:
        try:
            args += ["--", ".", f":(exclude){Path(exclude).resolve().relative_to(root)}"]
        except ValueError:  # outside the checkout: nothing to exclude
            pass
    status = _git(*args, root=root)
    return bool(status) if status is not None else None


def environment(target, cfg: BenchConfig) -> dict:
    """Versions, threads, dtype, device, host and git commit of this run."""
    import transformers

    from dspine import __version__ as dspine_version
    from dspine.tune.machine import isa_class

    cpu = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((l.split(":", 1)[1].strip() for l in f if l.startswith("model name")), cpu)
    except OSError:
        pass
    dev = str(target.device)
    env = {
        "python": platform.python_version(), "torch": torch.__version__,
        "transformers": transformers.__version__, "dspine": dspine_version,
        "platform": platform.platform(), "cpu": cpu, "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(), "torch_interop_threads": torch.get_num_interop_threads(),
        "dtype": str(target.dtype).replace("torch.", ""), "device": dev,
        "device_name": torch.cuda.get_device_name(target.device) if target.device.type == "cuda" else cpu,
        "git_commit": _git("rev-parse", "HEAD"), "git_dirty": git_dirty(),
        "target": target.name, "target_path": target.path,
        "isa": isa_class(), "linear_backend": getattr(target, "linear_backend", "aten"),
        "target_runtime": getattr(target, "runtime_name", "hf"),
        "load_avg_1m": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
        # cores other processes kept busy over 0.3 s before the first request (the load average
        # also counts this run's own threads); above QUIET_CORES the timings are not trustworthy
        "others_cores_at_start": _others_cores(),
    }
    return env


def _others_cores() -> float | None:
    """Cores kept busy by other processes now (0.3 s sample); warns on stderr when the
    machine is busy, since every figure of the run would then be measured under load."""
    import sys

    from dspine.tune.conditions import QUIET_CORES, others_now

    o = others_now()
    if o is not None and o > QUIET_CORES:
        print(f"dspine bench: warning: other processes keep ~{o:.1f} cores busy: the timings of this run are "
              f"measured under load and not comparable to a quiet run's (the report says so)",
              file=sys.stderr, flush=True)
    return None if o is None else round(o, 2)
