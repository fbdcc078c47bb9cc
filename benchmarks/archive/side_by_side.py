"""Shared scaffolding of the side-by-side benchmark scripts (tree_size.py, tree_verification.py,
target_runtime.py): held-out prompts, interleaved greedy runs, paired ratios.

A speed claim here is a ratio of configurations run side by side in one process: every
round runs each configuration on each prompt once, in an order rotated per (round, prompt),
so drift of the machine's load hits every configuration alike.
"""
from __future__ import annotations

import statistics

from dspine.config import SamplingConfig
from dspine.data.sources import heldout_prompts
from dspine.data.tokenizer import encode_record


def load_smollm2_dense(linear_backend: str = "auto"):
    """The default target in float32 on the dense runtime with ``linear_backend`` applied,
    and the shipped DSpine drafter bound to it: (target, backend used, drafter)."""
    from dspine.build import DEFAULT_CHECKPOINTS
    from dspine.drafter.checkpoint import load_drafter
    from dspine.runtime.packed import apply_linear_backend
    from dspine.target.adapter import load_target

    t = load_target("smollm2-135m", dtype="float32")
    t.set_runtime("dense")
    backend = apply_linear_backend(t, linear_backend, progress=False)
    return t, backend, load_drafter(DEFAULT_CHECKPOINTS / "smollm2-135m-dspine", t)


def heldout_ids(t, per_set: int, sets=("code", "chat"), max_tokens: int = 768) -> dict[str, list[int]]:
    """``{"code0": ids, ...}``: the first ``per_set`` held-out prompts of each set (never
    trained on), encoded as the engine sees them, the last ``max_tokens`` tokens."""
    out = {}
    for s in sets:
        for k, rec in enumerate(heldout_prompts(s, per_set)):
            out[f"{s}{k}"] = encode_record(t, rec)[-max_tokens:]
    return out


def interleaved_greedy(t, configs: dict, prompts: dict, rounds: int, tokens: int, record=None):
    """Run every engine of ``configs`` on every prompt, ``rounds`` times, greedy, with EOS
    ignored (every configuration emits ``tokens`` tokens), after one warm-up generation each.

    ``record(result) -> dict``: extra fields per run. Returns (runs, ids_of) where ``runs``
    holds one dict per (round, prompt, config) with ``tokens``, ``tokens_per_second`` and
    ``tau``, and ``ids_of[(round, prompt, config)]`` the output ids.
    """
    labels = list(configs)
    warm = t.encode_prompt("Name three colours.", chat=True)
    for eng in configs.values():
        eng.generate(warm, SamplingConfig(), 32)
    t.eos_token_ids, eos = frozenset(), t.eos_token_ids
    runs, ids_of = [], {}
    try:
        for r in range(rounds):
            for k, (name, ids) in enumerate(prompts.items()):
                s = (r * len(prompts) + k) % len(labels)
                for label in labels[s:] + labels[:s]:
                    res = configs[label].generate(ids, SamplingConfig(), tokens)
                    st = res.stats
                    ids_of[(r, name, label)] = res.token_ids
                    runs.append({"round": r, "prompt": name, "config": label, "tokens": len(res.token_ids),
                                 "tokens_per_second": st.tokens_per_second, "tau": st.accepted_length_mean,
                                 **(record(res) if record else {})})
                print(r, name, {x["config"]: (round(x["tokens_per_second"], 1), round(x["tau"], 2))
                                for x in runs[-len(labels):]}, flush=True)
    finally:
        t.eos_token_ids = eos
    return runs, ids_of


def paired_ratio(runs: list[dict], l1: str, l2: str) -> tuple[float, float, float]:
    """Median, min and max over (round, prompt) of tokens/s of ``l1`` over ``l2``."""
    by = {(x["round"], x["prompt"], x["config"]): x["tokens_per_second"] for x in runs}
    rs = [by[(r, p, l1)] / by[(r, p, l2)] for (r, p, c) in by if c == l1 and (r, p, l2) in by]
    return round(statistics.median(rs), 3), round(min(rs), 3), round(max(rs), 3)
