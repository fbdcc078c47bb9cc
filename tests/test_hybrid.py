"""Hybrid targets (Gated-DeltaNet + full attention) and ReplaySSM (spec section 6).

Tiny random float32 ``qwen3_5`` (text) and ``qwen3_next`` targets: hidden 64, 4 layers
``linear, linear, full, linear``. The reference for every state check is the same
target fed only the accepted tokens, one token per forward, with transformers' own
``DynamicCache`` (single-token conv update and recurrent kernel).
"""
from __future__ import annotations

import json
import math

import pytest
import torch
from transformers import AutoConfig, DynamicCache

from conftest import KnownContinuation
from dspine.cli import main as cli
from dspine.config import SamplingConfig
from dspine.drafter.checkpoint import random_drafter
from dspine.proposers.drafter import DrafterProposer
from dspine.core.engine import Engine
from dspine.target.hybrid_arch import HybridTargetError, hybrid_family
from dspine.target.random_hybrid import build_random_hybrid
from dspine.target.replay_ssm import ReplayCache, rerun_rollback
from dspine.core.sampling import filter_probs
from dspine.target.adapter import ByteTokenizer, Target, TargetCache, load_target

ARCHS = ("qwen3_5", "qwen3_next")
PROMPT = [5, 17, 33, 2, 90, 64, 7, 11]
M = 20  # new tokens per greedy run
AR_LEN = 44  # reference continuation (the cache-level tests run past M)
VOCAB = 128


pytestmark = pytest.mark.usefixtures("one_thread")


_TARGETS: dict = {}


def hybrid(arch: str, vocab: int = VOCAB, **kw) -> Target:
    key = (arch, vocab, repr(sorted(kw.items())))
    if key not in _TARGETS:
        t = load_target(f"random:{arch}", vocab_size=vocab, seed=0, **kw)
        t.eos_token_ids = frozenset()  # every run has the requested length
        _TARGETS[key] = t
    return _TARGETS[key]


# -- reference: accepted tokens fed one by one ------------------------------------------------
class Reference:
    """States of ``target`` after each prefix of ``tokens`` (fed one token per forward)."""

    def __init__(self, target: Target, tokens: list[int]):
        self.tokens = list(tokens)
        cfg = target.model.config
        self.lin = [i for i, t in enumerate(cfg.layer_types) if t == "linear_attention"]
        self.full = [i for i, t in enumerate(cfg.layer_types) if t == "full_attention"]
        cache = DynamicCache(config=cfg)
        self.states = [None]  # states[n]: {layer: (recurrent, conv)} after n tokens
        with torch.no_grad():
            for x in self.tokens:
                target.model(input_ids=torch.tensor([[x]]), past_key_values=cache, use_cache=True)
                self.states.append({l: (cache.layers[l].recurrent_states[0].clone(),
                                        cache.layers[l].conv_states[0].clone()) for l in self.lin})
        self.keys = {l: cache.layers[l].keys for l in self.full}
        self.values = {l: cache.layers[l].values for l in self.full}

    def check(self, cache: ReplayCache, tokens: list[int]) -> None:
        """Assert ``cache`` (committed ``tokens``) holds the reference state (tight tolerance)."""
        n = cache.length
        assert cache.seq_length() == n and tokens[:n] == self.tokens[:n]
        for l in self.lin:
            rec, conv = cache.linear_state(l)
            want_rec, want_conv = self.states[n][l]
            assert rec.dtype == torch.float32
            _close(rec, want_rec, f"recurrent state of layer {l} after {n} tokens")
            _close(conv, want_conv, f"conv state of layer {l} after {n} tokens")
        for l in self.full:
            _close(cache.kv.layers[l].keys, self.keys[l][:, :, :n], f"keys of layer {l}")
            _close(cache.kv.layers[l].values, self.values[l][:, :, :n], f"values of layer {l}")


def _close(got: torch.Tensor, want: torch.Tensor, what: str, rel: float = 1e-4) -> None:
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    err = (got.float() - want.float()).abs().max().item()
    scale = want.float().abs().max().item()
    assert err <= rel * scale + 1e-9, f"{what}: max error {err:.3g} (scale {scale:.3g})"


_AR: dict = {}


def ar_tokens(target: Target, n: int = AR_LEN) -> list[int]:
    """Greedy continuation of PROMPT by the plain ``ar`` engine."""
    if id(target) not in _AR:
        _AR[id(target)] = Engine(target, None, "ar").generate(PROMPT, SamplingConfig(), n).token_ids
    return _AR[id(target)]


_REF: dict = {}


def reference(target: Target) -> Reference:
    if id(target) not in _REF:
        _REF[id(target)] = Reference(target, PROMPT + ar_tokens(target))
    return _REF[id(target)]


# -- proposers ------------------------------------------------------------------------------
def oracle(target: Target, block_size: int, wrong=None) -> KnownContinuation:
    """The target's own greedy continuation of PROMPT; ``wrong`` corrupts it per cycle."""
    return KnownContinuation({tuple(PROMPT): ar_tokens(target)}, block_size, target.vocab_size, wrong,
                             needs_features=False)


PROPOSERS = {"oracle": lambda t, b: oracle(t, b),  # every proposal accepted
             "wrong": lambda t, b: oracle(t, b, lambda c, pos, n: "all"),  # rejected at the first position
             "alternating": lambda t, b: oracle(t, b, lambda c, pos, n: "all" if c % 2 else None)}


def run_checked(target: Target, engine: Engine, ref: Reference):
    """Greedy run of M tokens; the cache state is checked after the prefill and every cycle."""
    req = engine.start(PROMPT, SamplingConfig(), M)
    assert isinstance(req.cache, ReplayCache)
    ref.check(req.cache, req.prompt_ids + req.out_ids)
    while not req.finished:
        engine.step(req)
        ref.check(req.cache, req.prompt_ids + req.out_ids)
    return req


# -- greedy losslessness and exact states -------------------------------------------------------
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("block_size", [2, 16])
@pytest.mark.parametrize("kind", list(PROPOSERS))
def test_scripted_proposers_equal_ar_with_exact_states(arch, block_size, kind):
    t = hybrid(arch)
    ref = reference(t)
    want = ar_tokens(t)[:M]
    for mode in ("dspine", "dflash"):
        prop = PROPOSERS[kind](t, block_size)
        req = run_checked(t, Engine(t, prop, mode), ref)
        assert req.out_ids == want, (mode, kind)
        acc = [c.emitted - 1 for c in req.cycles]
        full = [c.emitted - 1 == c.n for c in req.cycles]
        if kind == "oracle":
            assert all(full) and max(acc) == min(block_size - 1, M - 2)
        elif kind == "wrong":
            assert all(a == 0 for a in acc) and len(req.cycles) == M - 1
        else:
            assert any(a == 0 and c.n > 0 for a, c in zip(acc, req.cycles)) and any(a > 0 for a in acc)
            assert all(full[::2])
    # replay happened exactly when something was rejected
    rejected = sum(c.emitted - 1 < c.n for c in req.cycles)
    assert req.cache.replays == rejected


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("block_size", [2, 16])
@pytest.mark.parametrize("mode", ["dspine", "dflash"])
def test_random_drafter_equals_ar_with_exact_states(arch, block_size, mode):
    t = hybrid(arch)
    prop = DrafterProposer(random_drafter(t, mode=mode, block_size=block_size, seed=1))
    assert prop.feature_layers and all(l < t.num_layers for l in prop.feature_layers)
    req = run_checked(t, Engine(t, prop, mode), reference(t))
    assert req.out_ids == ar_tokens(t)[:M]
    # the drafter's context holds one feature row per committed position, nothing more
    req.draft_state.flush()  # (commits are projected lazily, when the drafter next drafts)
    assert req.draft_state.written == req.cache.length


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("kernel,batched", [("auto", True), ("recurrent", False), ("chunk", True)])
def test_rollback_every_acceptance_length(arch, kernel, batched):
    """Cache level: verify blocks of 6 or 12 tokens and keep m of them (m = 0 .. 12,
    recurrent and chunked replay kernels, batched over layers or not)."""
    t = hybrid(arch)
    ref = reference(t)
    toks = ref.tokens
    cache = ReplayCache(t.model, batched=batched, kernel=kernel)
    t.forward(torch.tensor([PROMPT]), cache, None)
    cache.rollback(len(PROMPT))
    ref.check(cache, toks)
    for block, m in ((6, 0), (6, 3), (6, 6), (12, 9), (6, 1), (12, 11), (6, 5), (6, 2), (6, 0)):
        pos = cache.length
        t.forward(torch.tensor([toks[pos:pos + block]]), cache, None)
        assert cache.seq_length() == pos + block
        cache.rollback(pos + m)
        ref.check(cache, toks)
    assert cache.replays == 6 and cache.replayed_tokens == 31  # m = 0 and m = block need none
    with pytest.raises(ValueError, match="last commit"):
        cache.rollback(cache.length - 1)
    with pytest.raises(ValueError, match="cannot commit"):
        cache.rollback(cache.length + 1)


@pytest.mark.parametrize("arch", ARCHS)
def test_rerun_baseline_matches_replay(arch):
    """The naive rollback (restore + re-run the accepted tokens) lands on the same states."""
    t = hybrid(arch)
    ref = reference(t)
    toks = ref.tokens
    cache = t.new_cache()
    t.forward(torch.tensor([PROMPT]), cache, None)
    cache.rollback(len(PROMPT))
    for m in (2, 0, 5):
        pos = cache.length
        block = torch.tensor([toks[pos:pos + 5]])
        t.forward(block, cache, None)
        rerun_rollback(cache, t.model, block, pos + m)
        ref.check(cache, toks)


@pytest.mark.parametrize("arch", ARCHS)
def test_transformers_crop_is_not_exact(arch):
    """Why ReplaySSM exists: DynamicCache.crop (with past recording) restores the conv
    window but leaves the recurrent state advanced over the rejected tokens."""
    t = hybrid(arch)
    ref = reference(t)
    cfg = t.model.config
    cache = DynamicCache(config=cfg)
    cache.activate_past_recording()
    P = len(PROMPT)
    with torch.no_grad():
        t.model(input_ids=torch.tensor([PROMPT]), past_key_values=cache, use_cache=True)
        t.model(input_ids=torch.tensor([ref.tokens[P:P + 5]]), past_key_values=cache, use_cache=True)
    cache.crop(-4)  # keep 1 of the 5
    l = ref.lin[0]
    rec_err = (cache.layers[l].recurrent_states[0] - ref.states[P + 1][l][0]).abs().max().item()
    conv_err = (cache.layers[l].conv_states[0] - ref.states[P + 1][l][1]).abs().max().item()
    scale = ref.states[P + 1][l][0].abs().max().item()
    assert conv_err <= 1e-5 and rec_err > 1e-2 * scale


# -- features, bf16, CLI -----------------------------------------------------------------------
@pytest.mark.parametrize("arch", ARCHS)
def test_features_from_hybrid_target(arch):
    t = hybrid(arch)
    fl = t.default_feature_layers()
    ids = torch.tensor([PROMPT + [1, 2, 3]])
    full = t.forward(ids, None, fl)
    assert full.features.shape == (1, ids.shape[1], len(fl) * t.hidden_size)
    cache = t.new_cache()
    a = t.forward(ids[:, :8], cache, fl)
    cache.rollback(8)
    b = t.forward(ids[:, 8:], cache, fl)
    inc = torch.cat([a.features, b.features], dim=1)
    _close(inc, full.features, "features (cached vs full forward)")
    _close(b.logits, full.logits[:, 8:], "logits (cached vs full forward)")


def test_bfloat16_hybrid_generates():
    t = load_target("random:qwen3_5", dtype="bfloat16", vocab_size=VOCAB, seed=0)
    t.eos_token_ids = frozenset()
    ar = Engine(t, None, "ar").generate(PROMPT, SamplingConfig(), 8).token_ids
    prop = DrafterProposer(random_drafter(t, mode="dspine", block_size=4, dtype=torch.bfloat16))
    eng = Engine(t, prop, "dspine")
    req = eng.start(PROMPT, SamplingConfig(), 8)
    while not req.finished:
        eng.step(req)
        for l in req.cache.linear_layers:
            assert req.cache.linear_state(l)[0].dtype == torch.float32  # state stays fp32
    assert len(req.out_ids) == 8 and len(ar) == 8


@pytest.mark.parametrize("arch", ARCHS)
def test_cli_generate_every_mode(arch, capsys):
    outs = {}
    for mode in ("ar", "dflash", "dspine"):
        extra = [] if mode == "ar" else ["--drafter", "random", "--block-size", "4"]
        rc = cli.main(["generate", "hello hybrid", "--target", f"random:{arch}", "--mode", mode,
                       "--max-new-tokens", "6", "--json", *extra])
        assert rc == 0
        res = json.loads(capsys.readouterr().out)
        assert res["mode"] == mode and 1 <= len(res["token_ids"]) <= 6
        outs[mode] = res["token_ids"]
    assert outs["ar"] == outs["dflash"] == outs["dspine"]


# -- refusals -----------------------------------------------------------------------------------
@pytest.mark.parametrize("field", ["recurrent_state_dtype", "mamba_ssm_dtype"])
def test_non_float32_recurrent_state_refused(field):
    with pytest.raises(HybridTargetError, match=field) as e:
        load_target("random:qwen3_5", vocab_size=64, **{field: "bfloat16"})
    assert isinstance(e.value, ValueError) and "float32" in str(e.value)
    # float32 is accepted
    assert load_target("random:qwen3_5", vocab_size=64, recurrent_state_dtype="float32").hybrid == "qwen3_5"


def test_non_float32_state_from_kernel_refused():
    t = hybrid("qwen3_5")
    cache = t.new_cache()
    l = cache.linear_layers[0]
    with pytest.raises(HybridTargetError, match="float32"):
        cache._update_recurrent(l, torch.zeros(1, 4, 16, 16, dtype=torch.bfloat16))


@pytest.mark.parametrize("model_type", ["qwen3_5_moe_text", "falcon_h1", "lfm2", "mamba"])
def test_unknown_hybrid_refused(model_type):
    cfg = AutoConfig.for_model(model_type)
    with pytest.raises(HybridTargetError, match=model_type) as e:
        hybrid_family(cfg)
    assert isinstance(e.value, ValueError)


def test_unknown_hybrid_model_refused_by_target():
    from transformers import AutoModelForCausalLM

    cfg = AutoConfig.for_model("qwen3_5_moe_text", vocab_size=64, hidden_size=32, intermediate_size=64,
                               num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                               head_dim=16, linear_key_head_dim=8, linear_value_head_dim=8,
                               linear_num_key_heads=1, linear_num_value_heads=2, num_experts=2,
                               num_experts_per_tok=1, moe_intermediate_size=16,
                               shared_expert_intermediate_size=16,
                               layer_types=["linear_attention", "full_attention"])
    model = AutoModelForCausalLM.from_config(cfg)
    with pytest.raises(HybridTargetError, match="qwen3_5_moe"):
        Target(model, ByteTokenizer(64), name="moe-hybrid")


def test_dense_targets_unchanged():
    assert hybrid_family(AutoConfig.for_model("llama")) is None
    t = load_target("random:llama", vocab_size=64)
    assert t.hybrid is None and type(t.new_cache()) is TargetCache
    assert build_random_hybrid("qwen3_5", vocab_size=64).config.layer_types == [
        "linear_attention", "linear_attention", "full_attention", "linear_attention"]


# -- sampling distribution on a hybrid target ----------------------------------------------------
DIST_VOCAB, DIST_LEN, DIST_N, ALPHA = 8, 3, 400, 1e-3
DIST_SAMPLING = dict(temperature=1.0, top_k=5)
# 3 layers (linear, full, linear) to keep 400 engine runs affordable on a 2-core CPU
DIST_TARGET = dict(num_hidden_layers=3, layer_types=["linear_attention", "full_attention", "linear_attention"])


def exact_sequence_probs(t: Target, prompt: list[int], sampling: SamplingConfig) -> dict:
    """p(x_1..x_L | prompt) for every sequence over the vocabulary (plain sampler filters)."""
    V = t.vocab_size
    seqs, probs = [()], torch.ones(1, dtype=torch.float64)
    for _ in range(DIST_LEN):
        ids = torch.tensor([prompt + list(s) for s in seqs])
        logits = t.forward(ids, None, None, logits_to_keep=1).logits[:, -1]  # [S, V]
        # top-k keep/drop must not hinge on float noise between this batched forward
        # and the engine's cached one (a check on the test itself)
        top = torch.sort(logits.double() / sampling.temperature, dim=-1, descending=True).values
        assert (top[:, sampling.top_k - 1] - top[:, sampling.top_k]).min() > 1e-4
        p = filter_probs(logits, sampling)
        probs = (probs[:, None] * p).reshape(-1)
        seqs = [s + (v,) for s in seqs for v in range(V)]
    return {s: float(q) for s, q in zip(seqs, probs)}


def chi_square_pvalue(counts: dict, probs: dict, n: int) -> tuple[float, int]:
    """Pearson chi-square over sequences; cells with expected count < 5 pooled into one."""
    from scipy.stats import chi2

    obs, exp, rest_o, rest_e = [], [], 0, 0.0
    for s, p in probs.items():
        if n * p >= 5:
            obs.append(counts.get(s, 0))
            exp.append(n * p)
        else:
            rest_o += counts.get(s, 0)
            rest_e += n * p
    if rest_e > 0:
        obs.append(rest_o)
        exp.append(rest_e)
    stat = sum((o - e) ** 2 / e for o, e in zip(obs, exp))
    return float(chi2.sf(stat, len(obs) - 1)), len(obs)


def test_sampling_distribution_on_hybrid_target():
    """Sequences of 3 tokens sampled through dspine (random drafter, block 2: one proposal
    per cycle, so a rejection replays one token and the next token is drawn from the
    replayed state) vs the exact enumeration; chi-square at alpha = 1e-3, and sequences
    of probability 0 (top-k) never appear."""
    t = hybrid("qwen3_5", vocab=DIST_VOCAB, **DIST_TARGET)
    prompt = [3, 1, 4, 1, 5]
    sampling = SamplingConfig(**DIST_SAMPLING)
    probs = exact_sequence_probs(t, prompt, sampling)
    assert math.isclose(sum(probs.values()), 1.0, rel_tol=1e-9)
    eng = Engine(t, DrafterProposer(random_drafter(t, mode="dspine", block_size=2, seed=3)), "dspine")
    counts: dict = {}
    replays = 0
    for seed in range(DIST_N):
        req = eng.start(prompt, SamplingConfig(**DIST_SAMPLING, seed=seed), DIST_LEN)
        while not req.finished:
            eng.step(req)
        replays += req.cache.replays
        s = tuple(req.out_ids)
        counts[s] = counts.get(s, 0) + 1
    assert all(probs[s] > 0 for s in counts), "a sequence the target's sampler cannot produce"
    assert replays > DIST_N // 10  # rejections (hence replays) were exercised
    pval, cells = chi_square_pvalue(counts, probs, DIST_N)
    assert cells >= 5
    assert pval > ALPHA, f"chi-square p-value {pval:.2g} over {cells} cells"
