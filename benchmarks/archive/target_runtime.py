"""Target runtime side by side: transformers' forward vs the dense runtime
(:mod:`dspine.runtime.dense`), each linear backend (:mod:`dspine.runtime.packed`), HF
transformers' own ``generate``, and DSpine (the default hybrid proposer with the shipped
drafter and the cost policy) on the old and the new default, in one process on one
loaded float32 target.

Interleaved: every round runs each configuration on each prompt once, in a rotating
order; the table gives medians over rounds and prompts of output tokens/s after prefill
(HF ``generate``: tokens over its whole call minus a separately timed prefill), and
ratios within the same round and prompt. Greedy: the ids of every configuration are
compared with ``ar`` on transformers' forward and PyTorch's linears (``hf/aten``), and
within each backend DSpine must equal ``ar`` (checked).

``-python`` backends: the same linears with the lean decode path off (:mod:`dspine.runtime.lean`).

Usage: python benchmarks/archive/target_runtime.py [--rounds 2] [--tokens 128] [--out benchmarks/archive/target_runtime.json]
       [--configs "hf/aten ar,dense/mixed ar,dense/blockq ar,hf-generate,dense/mixed dspine,dense/blockq dspine"]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch

from dspine.build import DEFAULT_CHECKPOINTS
from dspine.config import SamplingConfig
from dspine.drafter.checkpoint import load_drafter
from dspine.proposers.drafter import DrafterProposer
from dspine.core.engine import Engine
from dspine.tune.controller import make_policy
from dspine.proposers import make_proposer
from dspine.runtime.packed import apply_linear_backend
from dspine.target.adapter import load_target
from dspine.trees import TreeSpec
from dspine.tune.machine import describe, machine_info

PROMPTS = {  # held out of training and of the bench workloads (as benchmarks/archive/linear_backend.py)
    "code": "Write a Python function that merges two sorted lists into one sorted list.",
    "chat": "What are three good habits for staying focused while studying?",
    "code2": "Write a Python class Stack with push, pop and peek methods.",
    "chat2": "Explain what a hash table is to a beginner.",
}
# (label, runtime, linear backend, mode); "hf-generate" is transformers' generate on the raw model
CONFIGS = [
    ("hf/aten ar", "hf", "aten", "ar"),
    ("hf/onednn ar", "hf", "onednn", "ar"),
    ("dense/transposed ar", "dense", "transposed", "ar"),
    ("dense/mixed ar", "dense", "mixed", "ar"),
    ("dense/onednn ar", "dense", "onednn", "ar"),
    ("hf-generate", "hf", "aten", "hf-generate"),
    ("hf/onednn dspine", "hf", "onednn", "dspine"),
    ("dense/mixed dspine", "dense", "mixed", "dspine"),
    ("dense/blockq ar", "dense", "blockq", "ar"),  # 2026-12-02: exact Q4_1/Q8_0 blocks (runtime/blockq.py)
    ("dense/blockq dspine", "dense", "blockq", "dspine"),
    # 2026-12-02: blockq with the lean decode path off (runtime/lean.py): the Python layer loop
    ("dense/blockq-python ar", "dense", "blockq-python", "ar"),
    ("dense/blockq-python dspine", "dense", "blockq-python", "dspine"),
]


def hf_generate(t, ids: list[int], n: int) -> tuple[list[int], float]:
    """transformers' greedy ``generate`` (float32, eager, its own DynamicCache): ids and
    output tokens/s after prefill (prefill timed separately and subtracted)."""
    x = torch.tensor([ids])
    m = t.model
    t0 = time.perf_counter()
    m(input_ids=x, logits_to_keep=1)
    pre = time.perf_counter() - t0
    t0 = time.perf_counter()
    out = m.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=n,
                     min_new_tokens=n, pad_token_id=0)
    total = time.perf_counter() - t0
    toks = out[0, len(ids):].tolist()
    return toks, (len(toks) - 1) / max(total - pre, 1e-9)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--out", default="benchmarks/archive/target_runtime.json")
    ap.add_argument("--configs", default=None, help="comma list of configuration labels (default: all)")
    a = ap.parse_args()
    global CONFIGS
    if a.configs:
        want = [c.strip() for c in a.configs.split(",") if c.strip()]
        unknown = [w for w in want if w not in {c[0] for c in CONFIGS}]
        if unknown or "hf/aten ar" not in want:
            raise SystemExit(f"--configs: unknown {unknown} (or 'hf/aten ar', the reference, missing); "
                             f"known: {', '.join(c[0] for c in CONFIGS)}")
        CONFIGS = [c for c in CONFIGS if c[0] in want]
    labels = {c[0] for c in CONFIGS}
    t = load_target("smollm2-135m", dtype="float32")
    drafter = load_drafter(DEFAULT_CHECKPOINTS / "smollm2-135m-dspine", t)
    load0 = os.getloadavg()[0]

    def use(runtime: str, backend: str) -> None:
        t.set_runtime(runtime)
        apply_linear_backend(t, backend.replace("-python", ""), progress=False)
        plan = t.runtime.lean_plan() if t.runtime is not None else None
        if plan is not None and backend.endswith("-python"):
            plan.max_rows = 0  # every forward on the Python path

    engines = {}
    for label, rt, be, mode in CONFIGS:
        use(rt, be)
        if mode == "ar":
            engines[label] = Engine(t, None, "ar")
        elif mode == "dspine":
            prop = make_proposer("hybrid", DrafterProposer(drafter))
            engines[label] = Engine(t, prop, "dspine", verify_policy=make_policy("cost", t, prop),
                                    tree=TreeSpec(16, size="cost"))  # the defaults (trees since 2026-12-02 here)
    # warm-up: one short run per configuration (the cost policies' first exploration included)
    warm = t.encode_prompt("Name three colours.", chat=True)
    for label, rt, be, mode in CONFIGS:
        use(rt, be)
        if mode == "hf-generate":
            hf_generate(t, warm, 16)
        else:
            engines[label].generate(warm, SamplingConfig(), 32)
    # EOS does not stop a run: every configuration emits the same number of tokens
    t.eos_token_ids, eos = frozenset(), t.eos_token_ids
    runs, ids_of = [], {}
    for r in range(a.rounds):
        for k, (name, text) in enumerate(PROMPTS.items()):
            ids = t.encode_prompt(text, chat=True)
            s = (r * len(PROMPTS) + k) % len(CONFIGS)
            for label, rt, be, mode in CONFIGS[s:] + CONFIGS[:s]:
                use(rt, be)
                if mode == "hf-generate":
                    toks, tps = hf_generate(t, ids, a.tokens)
                    tau = None
                else:
                    res = engines[label].generate(ids, SamplingConfig(), a.tokens)
                    toks, tps, tau = res.token_ids, res.stats.tokens_per_second, res.stats.accepted_length_mean
                ids_of[(r, name, label)] = toks
                runs.append({"round": r, "prompt": name, "config": label, "tokens": len(toks),
                             "tokens_per_second": tps, "tau": tau})
            print(name, r, {x["config"]: round(x["tokens_per_second"], 1) for x in runs[-len(CONFIGS):]}, flush=True)
    t.eos_token_ids = eos
    same_as_ref, checks = {}, []
    for label, rt, be, mode in CONFIGS:
        same_as_ref[label] = sum(ids_of[(r, p, label)] == ids_of[(r, p, "hf/aten ar")]
                                 for r in range(a.rounds) for p in PROMPTS)
    for spec, ref in (("hf/onednn dspine", "hf/onednn ar"), ("dense/mixed dspine", "dense/mixed ar"),
                      ("dense/blockq dspine", "dense/blockq ar"),
                      ("dense/blockq-python dspine", "dense/blockq-python ar")):
        if spec not in labels or ref not in labels:
            continue
        for r in range(a.rounds):
            for p in PROMPTS:
                checks.append(ids_of[(r, p, spec)] == ids_of[(r, p, ref)])
    assert all(checks), "DSpine differs from ar on the same runtime and backend"

    def med(label):
        return round(statistics.median(x["tokens_per_second"] for x in runs if x["config"] == label), 2)

    def ratio(l1, l2):
        rs = []
        for r in range(a.rounds):
            for p in PROMPTS:
                x = next(x for x in runs if (x["round"], x["prompt"], x["config"]) == (r, p, l1))
                y = next(y for y in runs if (y["round"], y["prompt"], y["config"]) == (r, p, l2))
                rs.append(x["tokens_per_second"] / y["tokens_per_second"])
        return round(statistics.median(rs), 3), round(min(rs), 3), round(max(rs), 3)

    pairs = [("dense/transposed ar", "hf/aten ar"), ("dense/mixed ar", "hf/aten ar"),
             ("dense/mixed ar", "hf/onednn ar"), ("dense/transposed ar", "hf-generate"),
             ("dense/mixed ar", "hf-generate"), ("dense/mixed dspine", "dense/mixed ar"),
             ("dense/mixed dspine", "hf/onednn dspine"), ("dense/mixed dspine", "hf/aten ar"),
             ("hf/onednn dspine", "hf/onednn ar"), ("dense/blockq ar", "dense/mixed ar"),
             ("dense/blockq ar", "hf/aten ar"), ("dense/blockq ar", "hf-generate"),
             ("dense/blockq dspine", "dense/blockq ar"), ("dense/blockq dspine", "dense/mixed ar"),
             ("dense/blockq ar", "dense/blockq-python ar"), ("dense/blockq dspine", "dense/blockq-python dspine"),
             ("dense/blockq-python dspine", "dense/blockq-python ar"), ("dense/blockq dspine", "hf/aten ar")]
    pairs = [(x, y) for x, y in pairs if x in labels and y in labels]
    summary = {
        "machine": machine_info(), "machine_line": describe(), "load_avg_1m_start": load0,
        "load_avg_1m_end": os.getloadavg()[0], "rounds": a.rounds, "tokens": a.tokens,
        "dtype": "float32", "prompts": PROMPTS,
        "configs": [dict(zip(("label", "runtime", "linear_backend", "mode"), c)) for c in CONFIGS],
        "median_tokens_per_second": {c[0]: med(c[0]) for c in CONFIGS},
        "median_tau": {c[0]: round(statistics.median(x["tau"] for x in runs if x["config"] == c[0]), 3)
                       for c in CONFIGS if c[3] == "dspine"},
        "ratios_median_min_max": {f"{x} / {y}": ratio(x, y) for x, y in pairs},
        "greedy_runs_equal_to_hf_aten_ar": same_as_ref, "runs_per_config": a.rounds * len(PROMPTS),
        "runs": runs,
    }
    Path(a.out).write_text(json.dumps(summary, indent=1))
    print(json.dumps({k: summary[k] for k in ("machine_line", "median_tokens_per_second", "median_tau",
                                              "ratios_median_min_max", "greedy_runs_equal_to_hf_aten_ar")}, indent=1))


if __name__ == "__main__":
    torch.set_grad_enabled(False)
    torch.set_num_threads(2)
    main()
