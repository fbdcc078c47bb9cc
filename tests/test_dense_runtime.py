"""The dense target runtime (dspine.runtime.dense): logits and features against
transformers' forward (float32: bit-identical; bfloat16: within rounding), cache growth and
rollback, which targets it refuses and why, greedy equality with ``ar`` on the real target
(single and batched engine), and the exact sampled distribution by enumeration with a
negative control that must fail.
"""
from __future__ import annotations

import pytest
import torch

from dspine.config import ConfigError, SpeculativeConfig
from dspine.core.batch import BatchEngine
from dspine.config import SamplingConfig
from dspine.core.engine import Engine, EngineError
from dspine.runtime.dense import DenseCache, DenseRuntime, runtime_support
from dspine.runtime.packed import apply_linear_backend, onednn_available
from dspine.runtime.select import resolve_runtime
from dspine.target.adapter import load_target

pytestmark = pytest.mark.usefixtures("one_thread")


def _run(target, ids, chunks, layers, rollback_to=None):
    """Forward ``ids`` [1, T] in ``chunks`` on a fresh cache; optionally roll back and redo."""
    cache = target.new_cache()
    outs, pos = [], 0
    for c in chunks:
        outs.append(target.forward(ids[:, pos:pos + c], cache, layers))
        pos += c
    if rollback_to is not None:
        cache.rollback(rollback_to)
        outs.append(target.forward(ids[:, rollback_to:rollback_to + 3], cache, layers, logits_to_keep=2))
    return outs, cache


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_logits_and_features_match_transformers(arch, dtype):
    t = load_target(f"random:{arch}", dtype=dtype, seed=4)
    layers = list(range(t.num_layers))  # the last one is transformers' post-norm hidden state
    ids = torch.randint(1, t.vocab_size, (1, 300), generator=torch.Generator().manual_seed(0))
    chunks = [270, 1, 16, 13]  # crosses the initial 256-position capacity: the buffers grow
    ref, _ = _run(t, ids, chunks, layers, rollback_to=280)
    t.set_runtime("dense")
    try:
        got, cache = _run(t, ids, chunks, layers, rollback_to=280)
        assert isinstance(cache, DenseCache) and cache.length == 280 and cache.seq_length() == 283
        assert cache.nbytes() >= 2 * t.num_layers * 283 * t.hidden_size // 2
    finally:
        t.set_runtime("hf")
    for r, g in zip(ref, got):
        assert g.logits.shape == r.logits.shape and g.features.shape == r.features.shape
        if dtype == "float32":
            assert torch.equal(g.logits, r.logits) and torch.equal(g.features, r.features)
        else:
            assert torch.allclose(g.logits, r.logits, atol=0.1, rtol=0.05)
            assert torch.allclose(g.features.float(), r.features.float(), atol=0.1, rtol=0.05)


def test_cache_contract(tiny256):
    rt = DenseRuntime(tiny256.model)
    c = rt.new_cache()
    assert c.seq_length() == 0 and c.nbytes() == 0
    rt.forward(torch.tensor([[5, 6, 7, 8]]), c, None)
    c.rollback(2)
    assert c.length == 2 and c.seq_length() == 2
    rows = c.kv_rows()
    assert len(rows) == tiny256.num_layers and rows[0][0].shape[2] == 2
    with pytest.raises(ValueError, match="cannot commit 3 positions"):
        c.rollback(3)
    with pytest.raises(ValueError, match="cannot commit -1 positions"):
        c.rollback(-1)
    with pytest.raises(ValueError, match="batch of 2"):
        rt.forward(torch.tensor([[1], [2]]), c, None)
    rt.max_positions = 300  # the buffers never grow beyond the context window
    c2 = rt.new_cache()
    rt.forward(torch.arange(1, 271)[None] % 250 + 1, c2, None)
    assert c2.k.shape[3] == 300 and c2.seq_length() == 270


def test_refusals_name_the_setting():
    hyb = load_target("random:qwen3_5")
    assert runtime_support(hyb.model) is not None
    assert resolve_runtime(hyb, "auto") == "hf"
    with pytest.raises(ValueError, match="SpeculativeConfig.runtime dense cannot run this target"):
        resolve_runtime(hyb, "dense")
    with pytest.raises(ValueError, match="SpeculativeConfig.runtime 'fast' is unknown"):
        resolve_runtime(hyb, "fast")
    sw = load_target("random:qwen2", use_sliding_window=True, sliding_window=8, max_window_layers=0)
    assert "sliding" in (runtime_support(sw.model) or "")
    with pytest.raises(ValueError, match="SpeculativeConfig.runtime dense cannot run this target"):
        sw.set_runtime("dense")
    from dspine.build import build_engine
    with pytest.raises(ConfigError, match="SpeculativeConfig.runtime 'fast' is unknown"):
        build_engine(SpeculativeConfig(target="random:llama", drafter=None, mode="ar", runtime="fast",
                                       verify_policy="fixed", proposer="drafter", linear_backend="aten",
                                       tree_budget=0))
    t, eng = build_engine(SpeculativeConfig(target="random:llama", drafter=None, mode="ar",
                                            verify_policy="fixed", proposer="drafter", linear_backend="aten",
                                            tree_budget=0))
    assert t.runtime_name == "dense" and eng.kernel_info()["target_runtime"] == "dense"


PROMPTS = ["Write a Python function that returns the n-th Fibonacci number.",
           "Explain in two sentences why the sky is blue."]


def test_greedy_equal_to_ar_on_real_target_single_and_batched(smol):
    """float32, the shipped DSpine drafter, the default hybrid proposer and cost policy, all
    on the dense runtime: the engine and the batched engine give ``ar``'s ids (``ar`` on
    transformers' forward as the reference)."""
    from dspine.build import DEFAULT_CHECKPOINTS
    from dspine.drafter.checkpoint import load_drafter
    from dspine.proposers.drafter import DrafterProposer
    from dspine.tune.controller import make_policy
    from dspine.proposers import make_proposer

    prompts = [smol.encode_prompt(p, chat=True) for p in PROMPTS]
    refs = [Engine(smol, None, "ar").generate(p, SamplingConfig(), 40).token_ids for p in prompts]
    drafter = load_drafter(DEFAULT_CHECKPOINTS / "smollm2-135m-dspine", smol)
    smol.set_runtime("dense")
    try:
        prop = make_proposer("hybrid", DrafterProposer(drafter))
        eng = Engine(smol, prop, "dspine", verify_policy=make_policy("cost", smol, prop))
        for p, r in zip(prompts, refs):
            got = eng.generate(p, SamplingConfig(), 40)
            assert got.token_ids == r and got.stats.kernels["target_runtime"] == "dense"
        be = BatchEngine(eng, 4)
        for g, r in zip(be.generate_many(prompts, max_new_tokens=[40, 40]), refs):
            assert g.token_ids == r
        assert be.batched  # the dense caches moved into the batched slots
        assert Engine(smol, None, "ar").generate(prompts[0], SamplingConfig(), 40).token_ids == refs[0]
    finally:
        smol.set_runtime("hf")


@pytest.mark.parametrize("backend", ["mixed" if onednn_available() else "transposed"])  # this CPU's default
def test_sampled_distribution_exact_on_dense_runtime(tiny, monkeypatch, backend):
    """Chi-square against the exact distribution (enumerated with the same runtime and
    linear backend), DSpine drafter with sparse q on the dense runtime; the negative
    control (residual without q) must fail on the same runtime."""
    import test_distribution as TD

    tiny.set_runtime("dense")
    apply_linear_backend(tiny, backend)
    try:
        TD.check_exact_with_negative_control(tiny, monkeypatch)
    finally:
        tiny.set_runtime("hf")
        apply_linear_backend(tiny, "aten")
