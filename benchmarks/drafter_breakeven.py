"""What per-row acceptance a drafter needs to pay on this machine, from its measured cycle costs.

A cycle that verifies n drafted tokens costs ``C(n)`` (the target forward over n + 1
tokens plus proposing n tokens: the cost curve ``dspine tune`` measures and caches, the
one the cost policy starts from). With a drafter whose row k is accepted with probability
p given rows 1..k-1 were (the same p for every row), the expected tokens of that cycle are
``1 + p + ... + p^n`` (spec s.5), so its speed over plain decoding is

    max_n  (1 + p + ... + p^n) / C(n)  *  C(0).

This script reads the cost curves cached on this machine (run ``dspine tune`` or any
``dspine generate`` first; nothing is measured here) and prints, for each, that speed and
the best n at p = 0.3 .. 0.9, and the smallest p at which drafting beats plain decoding.
The machine's CPU class is stamped on the output.

    python benchmarks/drafter_breakeven.py --out benchmarks/drafter-diagnosis/breakeven-<cpu-class>-<date>.json
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path


def speed(cycle: list[float], p: float) -> tuple[float, int]:
    """(best speed over a plain step, its n) for per-row acceptance ``p``."""
    return max((sum(p ** j for j in range(n + 1)) / cycle[n] * cycle[0], n) for n in range(1, len(cycle)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=None, help="JSON to write (default: print only)")
    args = ap.parse_args()
    from dspine.tune import store
    from dspine.tune.conditions import untrusted_reason
    from dspine.tune.machine import describe, machine_info

    out = {"machine": machine_info(), "machine_line": describe(), "curves": {}}
    for key, e in sorted(store.load()["entries"].items()):
        c = e.get("curve") if isinstance(e, dict) else None
        if not key.startswith("cost:") or not isinstance(c, dict) or not c.get("propose_s"):
            continue  # only curves of a drafter (copies propose for free)
        v, ps = c["verify_s"], c["propose_s"]
        if not (isinstance(v, list) and isinstance(ps, list) and len(v) == len(ps) >= 4
                and all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in v + ps)):
            print(f"{key}: damaged (skipped; the next run measures it again)")
            continue
        cycle = [v[n] + (ps[n] if n else 0.0) for n in range(len(v))]
        rows = {f"{p:.1f}": dict(zip(("speed", "n"), speed(cycle, p))) for p in (0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)}
        p_even = next((p / 100 for p in range(1, 100) if speed(cycle, p / 100)[0] > 1.0), None)
        why = untrusted_reason(e)  # a busy machine's curve: slower steps, different ratios
        out["curves"][key] = {"measured_at": e.get("measured_at"), "loadavg_1m": e.get("loadavg_1m"),
                              "trusted": why is None, "untrusted_why": why, "label": e.get("label"),
                              "cycle_ms": [round(x * 1e3, 2) for x in cycle], "by_p": rows, "breakeven_p": p_even}
        print(f"{key} (measured {e.get('measured_at')}" + (f"; for {e['label']}" if e.get("label") else "")
              + f"): plain step {cycle[0] * 1e3:.1f} ms, "
              f"a cycle of 1 / 3 / 15 drafted {cycle[1] * 1e3:.1f} / {cycle[3] * 1e3:.1f} / {cycle[-1] * 1e3:.1f} ms")
        if why:
            print(f"  NOT TRUSTED: {why}; the figures below are not this machine's: run `dspine tune --redo` "
                  f"on an idle machine, then this script again")
        print("  p     " + "  ".join(f"{p:>5}" for p in rows))
        print("  speed " + "  ".join(f"{r['speed']:>4.2f}x" for r in rows.values()))
        print("  at n  " + "  ".join(f"{r['n']:>5}" for r in rows.values()))
        print(f"  drafting beats plain decoding from p = {p_even}")
    if not out["curves"]:
        print("no drafter cost curve is cached on this machine" + (" (DSPINE_TUNE is off: nothing is read from disk)"
              if not store.enabled() else "") + ": run `dspine generate` or `dspine tune` with a drafter first")
    print(out["machine_line"])
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
