"""The batched engine on the lean decode path (``dspine serve``'s cycles; dspine.batch).

Several requests' verification tokens run in one C++ call over the batched slot cache
(``LeanLlama.forward_ragged``), packed without padding. The kernels are batch-invariant, so
every request's logits and features must be bitwise those of its own one-request forward
(a wrong row mapping must not be); and the batched engine's greedy output must equal the
single-request engine's, token for token, on the real target.
"""
from __future__ import annotations

import pytest
import torch

from dspine.batch import BatchEngine, SlotKV
from dspine.config import SamplingConfig
from dspine.engine import Engine
from dspine.runtime import blockq as B

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPTS = ["def fibonacci(n):", "The capital of France is", "import numpy as np\n\nx ="]


def test_ragged_forward_is_bitwise_each_requests_own_forward(smol_lean, monkeypatch):
    t, rt = smol_lean, smol_lean.runtime
    plan, layers = rt.lean_plan(), [1, 8, t.num_layers - 1]
    # every forward below on the kernels, whatever row limits this machine measured (the
    # engine packs at most that many tokens per call: BatchEngine._lean_chunk)
    monkeypatch.setattr(plan, "max_rows", B.MAX_ROWS)
    monkeypatch.setattr(t.model.lm_head, "rows", B.MAX_ROWS)
    prompts = [t.encode_prompt(p) for p in PROMPTS]
    new = [torch.tensor([11, 22, 33]), torch.tensor([44]), torch.tensor([55, 66, 77, 88, 99])]
    kv = SlotKV(t.num_layers, 4)
    want_logits, want_feats = [], []
    for p, n in zip(prompts, new):  # each request alone: prefill, then its new tokens
        cache = rt.new_cache()
        rt.forward(torch.tensor([p]), cache, None)
        kv.add_row(cache.kv_rows(), len(p))
        lg, ft = rt.forward(n[None], cache, layers)
        want_logits.append(lg[0])
        want_feats.append(ft[0])
    kv._ensure(max(len(p) + len(n) for p, n in zip(prompts, new)))
    tok = torch.cat(new)
    rows = torch.cat([torch.full((len(n),), i) for i, n in enumerate(new)])
    pos = torch.cat([torch.arange(len(p), len(p) + len(n)) for p, n in zip(prompts, new)])
    assert tok.numel() <= plan.rows
    x, by = plan.forward_ragged(rt, tok, rows, pos, kv.k, kv.v, layers)
    logits, feats = rt._finish(x, by, layers, 0)
    o = 0
    for lg, ft in zip(want_logits, want_feats):
        n = lg.shape[0]
        assert torch.equal(logits[0, o:o + n], lg) and torch.equal(feats[0, o:o + n], ft)
        o += n
    # negative control: the same tokens read against another request's cache row differ
    x, by = plan.forward_ragged(rt, tok, rows.flip(0), pos, kv.k, kv.v, layers)
    wrong, _ = rt._finish(x, by, layers, 0)
    assert not torch.equal(wrong[0, :3], want_logits[0])
    with pytest.raises(RuntimeError, match="outside the cache"):
        plan.forward_ragged(rt, tok, rows + 5, pos, kv.k, kv.v, layers)


@pytest.mark.parametrize("mode", ["ar", "dspine"])
def test_batched_greedy_on_the_lean_path_equals_the_single_request_engine(smol_lean, mode, monkeypatch):
    from dspine.draft import DrafterProposer, load_drafter
    from dspine.cli import default_drafter_path
    from dspine.proposers import make_proposer

    t = smol_lean
    prop = None
    if mode == "dspine":
        d = load_drafter(default_drafter_path("smollm2-135m", "dspine"), t)
        prop = make_proposer("hybrid", DrafterProposer(d, linears="q8"))
    eng = Engine(t, prop, mode)
    prompts = [t.encode_prompt(p) for p in PROMPTS]
    want = [eng.generate(p, SamplingConfig(), 24).token_ids for p in prompts]
    calls = []
    real = BatchEngine._lean_forward
    monkeypatch.setattr(BatchEngine, "_lean_forward", lambda self, *a: calls.append(1) or real(self, *a))
    got = BatchEngine(eng, 3).generate_many(prompts, max_new_tokens=24)
    assert [g.token_ids for g in got] == want
    assert calls  # the batched cycles ran on the lean path
