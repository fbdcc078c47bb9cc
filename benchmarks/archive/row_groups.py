"""The blockq kernels' row grouping: this tree's ``kernels/blockq.cpp`` against the same file
at another git revision, side by side in one process.

Both sources are compiled here (``-O3 -march=native`` or the ``DSPINE_CPU_ISA`` level, as
dspine builds them) under distinct names, and one pass over a SmolLM2-135M-shaped set of
linears (30 layers of Q4_1 q/k/v/o/gate/up/down, a Q8_0 49152x576 head; random blocks, so
the weights stream from memory as in a real forward) is timed for each row count,
alternating the two builds, median of ``--repeats``. Rows are the tokens of a forward: 1 for
a decode step, n + 1 for a verification of n proposals, up to 17 for a 16-node tree.

    python benchmarks/archive/row_groups.py --base b6b46bb --out benchmarks/archive/row_groups_avx512.json
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SOURCE = Path(__file__).resolve().parents[2] / "src" / "dspine" / "runtime" / "kernels" / "blockq.cpp"
ROWS = (1, 2, 3, 4, 5, 6, 7, 8, 9, 12, 13, 16, 17)


def build(name: str, text: str, folder: Path):
    """Compile ``text`` as module ``name`` (its C++ classes renamed so two builds can load)."""
    from torch.utils.cpp_extension import load

    from dspine.tune.machine import march

    tag = name.upper()
    src = folder / f"{name}.cpp"
    src.write_text(f"#define LeanLlama LeanLlama{tag}\n#define LeanDrafter LeanDrafter{tag}\n#define Lin Lin{tag}\n"
                   + text)
    out = folder / f"build_{name}"
    out.mkdir(parents=True, exist_ok=True)
    return load(name=f"rowgroups_{name}", sources=[str(src)], build_directory=str(out),
                extra_cflags=["-O3", f"-march={march()}", "-fopenmp"], extra_ldflags=["-fopenmp"], verbose=False)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", required=True, help="git revision whose blockq.cpp is the baseline")
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()

    import torch

    from dspine.tune.machine import machine_info

    torch.set_num_threads(args.threads)
    rel = SOURCE.relative_to(SOURCE.parents[4])
    base_text = subprocess.run(["git", "show", f"{args.base}:{rel}"], capture_output=True, text=True,
                               cwd=SOURCE.parents[4], check=True).stdout
    with tempfile.TemporaryDirectory() as tmp:
        mods = {"base": build("base", base_text, Path(tmp)), "this": build("this", SOURCE.read_text(), Path(tmp))}
    g = torch.Generator().manual_seed(0)

    def q4(n: int, k: int):
        return (torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=g),
                torch.rand(n, k // 32, generator=g) * 0.01, torch.rand(n, k // 32, generator=g) * -0.005)

    layers = [[q4(576, 576), q4(192, 576), q4(192, 576), q4(576, 576), q4(1536, 576), q4(1536, 576),
               q4(576, 1536)] for _ in range(30)]
    head = (torch.randint(-127, 128, (49152, 576), dtype=torch.int8, generator=g), torch.rand(49152, 18, generator=g))

    def one_pass(mod, m: int) -> float:
        x, x2 = torch.randn(m, 576), torch.randn(m, 1536)
        t0 = time.perf_counter()
        for layer in layers:
            for i, (q, d, mm) in enumerate(layer):
                mod.q4_linear(x2 if i == 6 else x, q, d, mm)
        mod.q8_linear(x, *head)
        return time.perf_counter() - t0

    mi = machine_info("cpu")
    load0 = os.getloadavg()[0]
    times: dict = {}
    for rep in range(args.repeats + 1):  # the first round warms up
        for m in ROWS:
            for name in (("base", "this") if rep % 2 else ("this", "base")):
                dt = one_pass(mods[name], m)
                if rep:
                    times.setdefault(name, {}).setdefault(m, []).append(dt)
    rows = []
    for m in ROWS:
        b, t = statistics.median(times["base"][m]) * 1e3, statistics.median(times["this"][m]) * 1e3
        rows.append({"rows": m, "base_ms": round(b, 3), "this_ms": round(t, 3), "this_over_base": round(t / b, 3)})
        print(f"rows {m:2d}: base {b:6.2f} ms  this {t:6.2f} ms  this/base {t / b:.3f}", flush=True)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=SOURCE.parents[4]).stdout.strip()
    summary = {"what": "one pass over SmolLM2-135M-shaped blockq linears (30 layers Q4_1 + Q8_0 head) per row count, "
                       "this tree's kernels vs --base's, alternated in one process, median of repeats",
               "command": "python benchmarks/archive/row_groups.py " + " ".join(sys.argv[1:]), "machine": mi,
               "commit": commit, "base": args.base, "threads": args.threads, "load_avg_1m_start": round(load0, 2),
               "load_avg_1m_end": round(os.getloadavg()[0], 2), "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(summary, indent=1) + "\n")
    print(f"{mi.get('cpu_model')} ({mi.get('isa')}), {args.threads} threads, load {summary['load_avg_1m_start']} -> "
          f"{summary['load_avg_1m_end']}; -> {args.out}")


if __name__ == "__main__":
    main()
