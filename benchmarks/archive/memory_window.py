"""Draft context memory vs context length: dense pool (release) vs ring buffer (dspine).

Spec section 7: the release keeps a dense draft pool (the attention window limits what
is read, not what is kept); dspine's :class:`dspine.drafter.checkpoint.DraftContextCache` is a ring
buffer bounded at ``window`` positions, so draft memory is flat past the window.

One request is simulated with the small-profile drafter for SmolLM2-135M (shapes of
the real drafter; random weights and random target features, since memory does not
depend on their values): a prefill of ``--prefill`` positions, then decode cycles that
commit 1..``--block`` accepted positions each (seeded), up to ``--context`` positions.
After each commit the measured ``nbytes()`` of both layouts is recorded next to the
estimate of :func:`dspine.drafter.memory.estimate`. Writes ``memory_window.json`` and
``memory_window.png`` next to this script (or into ``--out``).

    python benchmarks/archive/memory_window.py [--context 8192] [--dtype bfloat16]
"""
from __future__ import annotations

import argparse
import json
import platform
import random
import time
from pathlib import Path

import torch

from dspine.config import DSpineConfig
from dspine.proposers.drafter import DraftContextCache
from dspine.drafter.memory import estimate
from dspine.drafter.memory_report import fmt_bytes
from dspine.drafter.model import DSpineDrafter


def run(context: int, prefill: int, block: int, dtype: str, seed: int, every: int) -> dict:
    cfg = DSpineConfig.small()  # SmolLM2-135M drafter shapes: window 2048
    dt = getattr(torch, dtype)
    torch.manual_seed(seed)
    drafter = DSpineDrafter(cfg).to(dt).eval()
    F = len(cfg.feature_layers) * cfg.target_hidden
    ring = DraftContextCache(cfg.num_layers, cfg.window)
    dense = DraftContextCache(cfg.num_layers, window=1 << 40)  # never overwrites: the dense pool
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    per = estimate(cfg, context=1, dtype=dtype)["draft_kv_per_position"]
    rows, p, t0 = [], 0, time.perf_counter()
    while p < context:
        n = prefill if p == 0 else min(rng.randint(1, block), context - p)
        pos = torch.arange(p, p + n)
        with torch.no_grad():
            kv = drafter.context_kv(torch.randn(1, n, F, generator=g).to(dt), pos[None])
        ring.append(kv, pos)
        dense.append(kv, pos)
        p += n
        if p == n or p >= context or p // every != (p - n) // every:
            est = estimate(cfg, context=p, dtype=dtype)
            rows.append({"context": p, "ring_bytes": ring.nbytes(), "ring_slots": int(ring.pos.shape[0]),
                         "ring_estimate": est["draft_kv_ring"],
                         "dense_bytes": int(dense.valid.sum()) * per,  # K/V the dense pool retains
                         "dense_alloc_bytes": dense.nbytes(),  # its buffer here (grows by doubling)
                         "dense_estimate": est["draft_kv_dense"]})
    rel = estimate(DSpineConfig.release(), dtype="bfloat16")
    return {
        "what": "draft context K/V bytes of one request vs context length",
        "drafter": {"profile": "small (SmolLM2-135M shapes)", "num_layers": cfg.num_layers,
                    "num_kv_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim, "window": cfg.window,
                    "dtype": dtype, "bytes_per_position": per},
        "simulation": {"prefill": prefill, "decode_commit_max": block, "seed": seed, "context": context,
                       "seconds": round(time.perf_counter() - t0, 2)},
        "rows": rows,
        "summary": {
            "ring_bytes_at_window": next((r["ring_bytes"] for r in rows if r["context"] >= cfg.window), None),
            "ring_bytes_at_end": rows[-1]["ring_bytes"], "dense_bytes_at_end": rows[-1]["dense_bytes"],
            "ring_flat_past_window": len({r["ring_bytes"] for r in rows if r["context"] >= cfg.window}) == 1,
            "ring_bytes_max": max(r["ring_bytes"] for r in rows),
            "ring_matches_estimate_past_window": all(r["ring_bytes"] == r["ring_estimate"]
                                                     for r in rows if r["context"] >= cfg.window),
            "dense_matches_estimate": all(r["dense_bytes"] == r["dense_estimate"] for r in rows),
        },
        "release_profile_bf16": {"per_position": rel["draft_kv_per_position"],
                                 "window_8192": rel["draft_kv_window"],
                                 "dense_131072": rel["draft_kv_dense"], "ring_131072": rel["draft_kv_ring"]},
        "env": {"torch": torch.__version__, "python": platform.python_version(), "machine": platform.machine()},
    }


def plot(res: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = res["rows"]
    x = [r["context"] for r in rows]
    fig, ax = plt.subplots(figsize=(7, 4.2))
    ax.plot(x, [r["dense_bytes"] / 2 ** 20 for r in rows], label="dense pool (release)", color="tab:red")
    ax.plot(x, [r["dense_alloc_bytes"] / 2 ** 20 for r in rows], label="dense pool, buffer grown by doubling",
            color="tab:red", ls=":", lw=1)
    ax.plot(x, [r["ring_bytes"] / 2 ** 20 for r in rows], label="bounded ring buffer (dspine)", color="tab:blue")
    w = res["drafter"]["window"]
    ax.axvline(w, color="gray", ls="--", lw=1)
    ax.text(w, ax.get_ylim()[1] * 0.5, f" window = {w}", color="gray")
    ax.set_xlabel("context positions of the request")
    ax.set_ylabel("draft context K/V (MiB)")
    d = res["drafter"]
    ax.set_title(f"Draft K/V memory, small drafter ({d['num_layers']} layers x {d['num_kv_heads']} kv x "
                 f"{d['head_dim']}, {d['dtype']})", fontsize=10)
    ax.legend(loc="upper left", fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--prefill", type=int, default=512)
    ap.add_argument("--block", type=int, default=16, help="max positions committed per decode cycle")
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    ap.add_argument("--every", type=int, default=128, help="record a row every this many positions")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=Path(__file__).parent)
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    res = run(a.context, a.prefill, a.block, a.dtype, a.seed, a.every)
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "memory_window.json").write_text(json.dumps(res, indent=1))
    plot(res, a.out / "memory_window.png")
    s = res["summary"]
    print(f"ring buffer: {fmt_bytes(s['ring_bytes_at_window'] or 0)} at the window, {fmt_bytes(s['ring_bytes_at_end'])} "
          f"at {a.context} positions (flat past the window: {s['ring_flat_past_window']}); dense pool: "
          f"{fmt_bytes(s['dense_bytes_at_end'])}; estimates match: ring {s['ring_matches_estimate_past_window']}, "
          f"dense {s['dense_matches_estimate']}")
    print(f"wrote {a.out / 'memory_window.json'} and {a.out / 'memory_window.png'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
