"""Real decoding speed of the drafter at a fixed verification length against `ar`, the
defaults and the drafter with the cost policy (one process, engine API, held-out prompts,
the order rotated per prompt, every output checked equal to `ar`'s).

    python benchmarks/drafter_fixed_n.py chat 8 > result.json

Prints per-prompt tokens/s on stderr and the median speed over `ar` per setting as JSON.
Run it on an otherwise idle machine: it is a timing.
"""
import sys, time, statistics, json, torch
from dspine.build import build_engine
from dspine.config import SpeculativeConfig, SamplingConfig
from dspine.control.base import FixedPolicy
from dspine.core.engine import Engine
from dspine.data.sources import heldout_prompts
kind, nprompts = sys.argv[1], int(sys.argv[2])
t, e_def = build_engine(SpeculativeConfig())
_, e_ar = build_engine(SpeculativeConfig(mode="ar"))
_, e_dc = build_engine(SpeculativeConfig(proposer="drafter"))
prop = e_dc.proposer
engines = {"ar": e_ar, "defaults": e_def, "drafter+cost": e_dc}
for n in (1, 2, 3, 4):
    engines[f"drafter+fixed{n}"] = Engine(t, prop, "dspine", verify_policy=FixedPolicy(n))
ps = heldout_prompts(kind, nprompts)
res = {k: [] for k in engines}
shares = {}
for i, p in enumerate(ps):
    ids = t.encode_prompt(p["prompt"], chat=(kind == "chat"))
    names = list(engines)
    names = names[i % len(names):] + names[:i % len(names)]
    out = {}
    for name in names:
        r = engines[name].generate(ids, SamplingConfig(), 128)
        out[name] = r
        res[name].append(r.stats.tokens_per_second)
    ref = out["ar"].token_ids
    assert all(o.token_ids == ref for o in out.values()), "not lossless!"
    print(i, {k: round(out[k].stats.tokens_per_second, 1) for k in engines}, file=sys.stderr, flush=True)
ar = res["ar"]
summary = {k: round(statistics.median(v[j] / ar[j] for j in range(len(ar))), 3) for k, v in res.items()}
from dspine.tune.machine import describe
print(json.dumps({"kind": kind, "n": nprompts, "max_new_tokens": 128, "machine": describe("cpu"), "median_speed_over_ar": summary}))
