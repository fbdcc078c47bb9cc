"""Two checkouts measured in alternating processes (shared by the old-vs-new benchmarks).

Each round runs the old and the new checkout once (the order flips every round, so a
machine that slows down or warms up over the run affects both alike); the caller's
``run(src)`` starts one measurement process with ``PYTHONPATH=src`` and returns its
result dict.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Callable


def commit_of(path: Path) -> str:
    """Short commit of the checkout at ``path``, noting uncommitted changes under ``src``."""
    def git(*c: str) -> str:
        return subprocess.run(["git", "-C", str(path), *c], capture_output=True, text=True).stdout.strip()

    return git("rev-parse", "--short", "HEAD") + (" (with local changes)" if git("status", "--porcelain", "src") else "")


def alternate(sides: dict[str, Path], rounds: int, run: Callable[[Path], dict],
              show: Callable[[dict], object] = lambda r: r) -> dict[str, list[dict]]:
    """``rounds`` alternating runs of ``sides`` (``{"old": path, "new": path}``): returns
    each side's results in order; each run is reported on stderr through ``show``."""
    runs: dict[str, list[dict]] = {k: [] for k in sides}
    for r in range(rounds):
        for k in (("old", "new") if r % 2 == 0 else ("new", "old")):
            runs[k].append(run(sides[k] / "src"))
            print(f"round {r + 1}/{rounds} {k}: {show(runs[k][-1])}", file=sys.stderr, flush=True)
    return runs


def run_json(name: str, code: str, src: Path, args: list[str] = (), env: dict | None = None) -> dict:
    """Run ``code`` in a new Python process with ``PYTHONPATH=src`` (plus ``env``) and the
    command-line ``args``; returns the JSON object its last stdout line holds.

    Raises:
        SystemExit: the process failed (its stderr's tail in the message, named by ``name``).
    """
    full = {**os.environ, "PYTHONPATH": str(src), **(env or {})}
    res = subprocess.run([sys.executable, "-c", code, *args], env=full, capture_output=True, text=True, check=False)
    if res.returncode:
        raise SystemExit(f"{name}: the run with {src} failed:\n{res.stderr[-2000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def report(result: dict, out: str | None) -> None:
    """Print ``result`` as JSON and write it to ``out`` (folders made) when given."""
    print(json.dumps(result, indent=2))
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps(result, indent=2) + "\n")
