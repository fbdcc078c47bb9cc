"""Run vLLM (CPU build) on token-id prompts, plain and with an exported DFlash drafter.

Runs in vLLM's own virtual environment (not dspine's): called by ``run.py``.
Input: ``--prompts FILE`` (JSON list of token-id lists). Output: one JSON object on
``--out``: per setting the greedy output ids per prompt, wall time, and the
speculative-decoding counters vLLM exports (drafts, drafted and accepted tokens, accepted
per position).
"""
from __future__ import annotations

import argparse
import json
import os
import time


def counters(llm) -> dict:
    out = {"drafts": 0, "draft_tokens": 0, "accepted_tokens": 0, "accepted_per_pos": []}
    for m in llm.get_metrics():
        name = m.name.removeprefix("vllm:")
        if name == "spec_decode_num_drafts":
            out["drafts"] = int(m.value)
        elif name == "spec_decode_num_draft_tokens":
            out["draft_tokens"] = int(m.value)
        elif name == "spec_decode_num_accepted_tokens":
            out["accepted_tokens"] = int(m.value)
        elif name == "spec_decode_num_accepted_tokens_per_pos":
            out["accepted_per_pos"] = [int(v) for v in m.values]
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", required=True)
    ap.add_argument("--drafter", default=None)
    ap.add_argument("--prompts", required=True)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--spec-tokens", type=int, default=15)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--mem-fraction", type=float, default=0.25,
                    help="share of CPU memory vLLM reserves (its gpu_memory_utilization on CPU)")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    os.environ.setdefault("OMP_NUM_THREADS", str(a.threads))
    import torch
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    torch.set_num_threads(a.threads)
    prompts = json.load(open(a.prompts))
    kw = dict(model=a.target, dtype="float32", max_model_len=2048, enforce_eager=True, seed=0,
              gpu_memory_utilization=a.mem_fraction,
              disable_log_stats=False, max_num_seqs=1)
    if a.drafter:
        kw["speculative_config"] = {"method": "dflash", "model": a.drafter, "num_speculative_tokens": a.spec_tokens}
    t0 = time.time()
    llm = LLM(**kw)
    load_s = time.time() - t0
    sp = SamplingParams(temperature=0.0, max_tokens=a.max_tokens, ignore_eos=False)
    llm.generate([TokensPrompt(prompt_token_ids=prompts[0])], sp, use_tqdm=False)  # warm-up
    base = counters(llm)
    outs, walls = [], []
    for p in prompts:  # one at a time: batch 1, as dspine and llama-server run here
        t0 = time.time()
        r = llm.generate([TokensPrompt(prompt_token_ids=p)], sp, use_tqdm=False)[0]
        walls.append(time.time() - t0)
        outs.append(list(r.outputs[0].token_ids))
    c = counters(llm)
    spec = {k: (c[k] - base[k] if k != "accepted_per_pos" else
                [x - y for x, y in zip(c[k], base[k] or [0] * len(c[k]))]) for k in c}
    import vllm

    json.dump({"engine": "vllm", "version": vllm.__version__, "torch": torch.__version__,
               "threads": a.threads, "drafter": a.drafter, "load_s": load_s, "outputs": outs,
               "wall_s": walls, "spec": spec if a.drafter else None}, open(a.out, "w"))


if __name__ == "__main__":
    main()
