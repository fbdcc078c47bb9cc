"""ReplaySSM vs the naive rollback of a hybrid target (spec section 6).

After a verification pass over a block of B tokens with m accepted (m = a + 1: anchor
plus accepted proposals), the Gated-DeltaNet layers must end as if only those m tokens
had been fed. Methods timed (rollback only; the verification forward is timed apart):

* ``replay``           restore the committed state, re-apply the gated delta rule over
                       the m tokens from the captured per-token inputs, all linear
                       layers in one batched kernel call, recurrent kernel for m < 8 and
                       chunked kernel from 8 (what ``ReplayCache`` does by default);
* ``replay_recurrent`` / ``replay_chunk``: the same with one kernel for every m;
* ``replay_per_layer`` recurrent kernel, one call per linear layer;
* ``rerun``            the naive alternative: restore the committed state, cut K/V and
                       re-run the target over the m accepted tokens;
* m = B (everything accepted) needs no work at all (``commit``).

Every method runs the same token stream on its own cache; the final linear-layer
states of the methods are compared (max abs difference) to show they are all exact.
Also reported: the verification forward with the ReplayCache (capture on) vs with
transformers' plain DynamicCache (no capture), i.e. the capture overhead.

Usage: python benchmarks/archive/replay_vs_rerun.py [--reps 9] [--out benchmarks/archive/replay_vs_rerun.json]
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch
from transformers import DynamicCache

from dspine.target.random_hybrid import build_random_hybrid, default_layer_types
from dspine.target.replay_ssm import ReplayCache, rerun_rollback

SIZES = {
    # the test configuration: hidden 64, 4 layers (3 linear + 1 full)
    "tiny": dict(),
    # a larger (still CPU-sized) hybrid: hidden 512, 8 layers (6 linear + 2 full),
    # linear attention 4 key / 8 value heads of 64
    "medium": dict(hidden_size=512, intermediate_size=1024, num_hidden_layers=8, num_attention_heads=8,
                   num_key_value_heads=2, head_dim=64, linear_key_head_dim=64, linear_value_head_dim=64,
                   linear_num_key_heads=4, linear_num_value_heads=8,
                   layer_types=default_layer_types(8)),
}


METHODS = ("replay", "replay_recurrent", "replay_chunk", "replay_per_layer", "rerun")


def _ms(ts):
    return round(1000 * statistics.median(ts), 3)


def _min(ts):
    return round(1000 * min(ts), 3)


@torch.no_grad()
def bench(arch: str, size: str, context: int, block: int, ms: list[int], reps: int, vocab: int) -> list[dict]:
    model = build_random_hybrid(arch, vocab_size=vocab, seed=0, **SIZES[size]).eval()
    rows = []
    for m in ms:
        gen = torch.Generator().manual_seed(m)
        prompt = torch.randint(1, vocab, (1, context), generator=gen)
        blocks = [torch.randint(1, vocab, (1, block), generator=gen) for _ in range(reps + 1)]
        final = {}
        times = {}
        for method in METHODS:
            kernel = {"replay_recurrent": "recurrent", "replay_per_layer": "recurrent",
                      "replay_chunk": "chunk"}.get(method, "auto")
            cache = ReplayCache(model, batched=(method != "replay_per_layer"), kernel=kernel)
            model(input_ids=prompt, past_key_values=cache.kv, use_cache=True, logits_to_keep=1)
            cache.rollback(context)
            fwd, rb = [], []
            for i, blk in enumerate(blocks):
                t0 = time.perf_counter()
                model(input_ids=blk, past_key_values=cache.kv, use_cache=True)
                t1 = time.perf_counter()
                if method == "rerun" and m < block:
                    rerun_rollback(cache, model, blk, cache.length + m)
                else:
                    cache.rollback(cache.length + m)
                t2 = time.perf_counter()
                if i > 0:  # first rep is warm-up
                    fwd.append(t1 - t0)
                    rb.append(t2 - t1)
            times[method] = (fwd, rb)
            final[method] = [cache.linear_state(l) for l in cache.linear_layers]
        # plain transformers cache: the verification forward without capture
        plain = DynamicCache(config=model.config)
        model(input_ids=prompt, past_key_values=plain, use_cache=True, logits_to_keep=1)
        pf = []
        for i, blk in enumerate(blocks):
            t0 = time.perf_counter()
            model(input_ids=blk, past_key_values=plain, use_cache=True)
            if i > 0:
                pf.append(time.perf_counter() - t0)
        diff = 0.0
        for method in METHODS[1:]:
            for (r0, c0), (r1, c1) in zip(final["replay"], final[method]):
                diff = max(diff, (r0 - r1).abs().max().item(), (c0 - c1).abs().max().item())
        scale = max(r.abs().max().item() for r, _ in final["replay"])
        row = dict(arch=arch, size=size, context=context, block=block, accepted_m=m,
                   verify_forward_ms=_ms(times["replay"][0]), verify_forward_plain_cache_ms=_ms(pf),
                   **{f"{k}_ms": _ms(times[k][1]) for k in METHODS},
                   **{f"{k}_min_ms": _min(times[k][1]) for k in METHODS},
                   verify_forward_min_ms=_min(times["replay"][0]),
                   state_max_abs_diff=diff, recurrent_state_scale=scale,
                   linear_layers=len(cache.linear_layers), reps=reps)
        if m == block:
            row["note"] = "all accepted: no replay, no rerun (commit only)"
        rows.append(row)
        print(_fmt(row), flush=True)
    return rows


HEAD = (f"{'arch':10} {'size':6} {'m/B':>6} {'verify':>8} {'plain':>8} {'replay':>8} {'recur':>8} "
        f"{'chunk':>8} {'per-lay':>8} {'rerun':>8} {'rerun/replay':>12} {'max|diff|':>10}")


def _fmt(r: dict) -> str:
    ratio = r["rerun_ms"] / r["replay_ms"] if r["replay_ms"] > 0 else float("nan")
    return (f"{r['arch']:10} {r['size']:6} {str(r['accepted_m']) + '/' + str(r['block']):>6} "
            f"{r['verify_forward_ms']:8.2f} {r['verify_forward_plain_cache_ms']:8.2f} {r['replay_ms']:8.3f} "
            f"{r['replay_recurrent_ms']:8.3f} {r['replay_chunk_ms']:8.3f} {r['replay_per_layer_ms']:8.3f} "
            f"{r['rerun_ms']:8.2f} {ratio:12.1f} {r['state_max_abs_diff']:10.2e}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=11)
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--block", type=int, default=16)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=str(Path(__file__).with_suffix(".json")))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    ms = [1, 4, 8, args.block - 1, args.block]
    print("times in ms, median of reps (JSON also has the min: the machine is shared); verify = "
          "B-token forward with ReplayCache, plain = same with transformers' DynamicCache; "
          "rollback columns exclude the forward")
    print(HEAD)
    rows = []
    rows += bench("qwen3_5", "tiny", args.context, args.block, ms, args.reps, vocab=256)
    rows += bench("qwen3_next", "tiny", args.context, args.block, ms, args.reps, vocab=256)
    rows += bench("qwen3_5", "medium", args.context, args.block, ms, args.reps, vocab=4096)
    out = dict(
        benchmark="ReplaySSM rollback vs re-running the target over the accepted tokens",
        machine=dict(platform=platform.platform(), processor=platform.processor(),
                     torch=torch.__version__, threads=args.threads, device="cpu",
                     note="shared 2-core CPU box under load from other jobs; *_ms = median, "
                          "*_min_ms = min of reps after one warm-up"),
        dtype="float32", sizes={k: v for k, v in SIZES.items()}, results=rows)
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
