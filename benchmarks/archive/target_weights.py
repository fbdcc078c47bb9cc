"""``--target-weights q8_0`` side by side (2026-12-03): what a target that
holds no 4/8-bit blocks gains from rounding its linears to Q8_0 blocks.

Configurations, each built as ``dspine generate`` builds it (``build_engine``, its own loaded
float32 target on the dense runtime): ``as-is/onednn ar`` (the default target's float32
weights on oneDNN's packed linears, the fastest backend a target without blocks gets),
``as-is/auto ar`` (the default: the GGUF's own Q4_1/Q8_0 blocks on the blockq kernels),
``q8_0/auto ar`` and ``q8_0/auto dspine`` (the linears rounded to Q8_0, then blockq and the
lean path by measurement; DSpine with its defaults). Interleaved rounds on held-out prompts,
greedy, EOS ignored; medians of output tokens/s after prefill and paired ratios. The q8_0
target is another model than the original: its DSpine ids must equal its own ``ar`` (checked),
and how many prompts keep the original's greedy ids is reported.

    python benchmarks/archive/target_weights.py --rounds 2 --tokens 96 --prompts 2 --out benchmarks/archive/target_weights_avx512.json
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
from pathlib import Path

import torch

from side_by_side import heldout_ids, interleaved_greedy, paired_ratio

from dspine.cli.main import DEFAULT_VERIFY_POLICY, build_engine
from dspine.tune.machine import describe, machine_info

CONFIGS = {  # label -> (target weights, linear backend, mode)
    "as-is/onednn ar": ("as-is", "onednn", "ar"),
    "as-is/auto ar": ("as-is", "auto", "ar"),
    "q8_0/auto ar": ("q8_0", "auto", "ar"),
    "q8_0/auto dspine": ("q8_0", "auto", "dspine"),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--prompts", type=int, default=2, help="held-out prompts per set (code, chat)")
    ap.add_argument("--out", default="benchmarks/target_weights.json")
    a = ap.parse_args()
    load0 = os.getloadavg()[0]
    engines, targets, kernels = {}, {}, {}
    for label, (weights, backend, mode) in CONFIGS.items():
        t, eng = build_engine("smollm2-135m", None, mode, verify_policy=DEFAULT_VERIFY_POLICY, runtime="dense",
                              linear_backend=backend, target_weights=weights, progress=False)
        engines[label], targets[label] = eng, t
        kernels[label] = {k: eng.kernel_info()[k] for k in ("linear_backend", "decode_path", "target_weights")}
    t0 = targets["as-is/auto ar"]
    eos = {lb: t.eos_token_ids for lb, t in targets.items()}
    for t in targets.values():  # every configuration emits the same count (interleaved_greedy does t0)
        t.eos_token_ids = frozenset()
    try:
        prompts = heldout_ids(t0, a.prompts)
        runs, ids_of = interleaved_greedy(t0, engines, prompts, a.rounds, a.tokens)
    finally:
        for lb, t in targets.items():
            t.eos_token_ids = eos[lb]
    keys = [(r, p) for r in range(a.rounds) for p in prompts]
    assert all(ids_of[(r, p, "q8_0/auto dspine")] == ids_of[(r, p, "q8_0/auto ar")] for r, p in keys), \
        "DSpine on the q8_0 target differs from its own ar"
    same_as_original = sum(ids_of[(0, p, "q8_0/auto ar")] == ids_of[(0, p, "as-is/auto ar")] for p in prompts)
    labels = list(CONFIGS)
    summary = {
        "machine": machine_info(), "machine_line": describe(), "threads": torch.get_num_threads(),
        "load_avg_1m_start": load0, "load_avg_1m_end": os.getloadavg()[0], "rounds": a.rounds, "tokens": a.tokens,
        "prompts_per_set": a.prompts, "kernels": kernels,
        "median_tokens_per_second": {lb: round(statistics.median(x["tokens_per_second"] for x in runs
                                                                 if x["config"] == lb), 1) for lb in labels},
        "ratios_median_min_max": {f"{lb} / as-is/onednn ar": paired_ratio(runs, lb, "as-is/onednn ar")
                                  for lb in labels[1:]},
        "q8_0_dspine_equals_its_ar": len(keys),
        "q8_0_greedy_ids_equal_to_original_prompts": f"{same_as_original}/{len(prompts)}",
        "runs": runs,
    }
    Path(a.out).write_text(json.dumps(summary, indent=1))
    print(json.dumps({k: v for k, v in summary.items() if k not in ("runs", "machine")}, indent=1))


if __name__ == "__main__":
    torch.set_grad_enabled(False)
    torch.set_num_threads(2)
    main()
