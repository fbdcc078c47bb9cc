"""Tests of dspine.drafter.memory (footprint, spec s.7) and of the bounded draft context cache.

- ``dspine memory --config release`` prints the reference figures of spec section 7;
- the estimate equals measured allocation for the real target + a drafter (tensor
  bytes of parameters, DraftContextCache.nbytes after a long prompt, TargetCache.nbytes,
  QuantizedHead.nbytes), and for hybrid targets (recurrent + conv state);
- the window bound does not change proposals or greedy output: a drafter whose draft
  cache is a ring buffer of ``window`` slots proposes exactly what a reference that
  recomputes the context K/V from scratch over *all* positions (mask limited to the
  window) proposes; draft memory is flat past the window.
"""
from __future__ import annotations

import json

import pytest
import torch

from dspine.config import DSpineConfig, SamplingConfig
from dspine.drafter.checkpoint import random_drafter
from dspine.proposers.draft_context import DraftContextCache
from dspine.proposers.drafter import DrafterProposer
from dspine.core.engine import Engine
from dspine.drafter.memory import drafter_param_counts, estimate, ring_buffer_positions, tensor_bytes
from dspine.drafter.memory_report import MiB, fmt_bytes
from dspine.drafter.target_spec import target_spec
from dspine.drafter.model import DSpineDrafter
from dspine.target.adapter import load_target


pytestmark = pytest.mark.usefixtures("one_thread")


# -- reference figures ------------------------------------------------------------------------
def test_fmt_bytes():
    assert fmt_bytes(20480) == "20 KiB"
    assert fmt_bytes(160 * MiB) == "160 MiB"
    assert fmt_bytes(2684354560) == "2.5 GiB"
    assert fmt_bytes(727.5 * MiB) == "727.5 MiB"
    assert fmt_bytes(512) == "512 B"


def test_release_reference_figures():
    rep = estimate(DSpineConfig.release(), dtype="bfloat16")
    assert rep.context == 131072
    assert rep["draft_kv_per_position"] == 20 * 1024
    assert rep["draft_kv_window"] == 160 * MiB
    assert rep["draft_kv_dense"] == int(2.5 * 1024 ** 3)
    assert rep["draft_kv_ring"] == 160 * MiB  # bounded at the 8192 window
    assert rep["codebook"] == 485 * MiB
    assert rep["greedy_tables"] == int(727.5 * MiB)
    assert rep["quantized_head"] == 248320 * 5120 and rep["quantized_head_scales"] == 248320 * 4
    assert rep.total("release") - rep.total("dspine") == rep["greedy_tables"] + rep["draft_kv_dense"] - rep["draft_kv_ring"]


def test_cli_memory_release_prints_reference_figures(capsys):
    from dspine.cli.main import main

    assert main(["memory", "--config", "release"]) == 0
    out = capsys.readouterr().out
    lines = {l.split("  ")[0].strip(): l for l in out.splitlines() if l.strip()}

    def fig(label_start: str) -> str:
        hit = [l for k, l in lines.items() if k.startswith(label_start)]
        assert len(hit) == 1, (label_start, out)
        return hit[0].split("  ", 1)[1].strip().split("  ")[0].strip()

    assert fig("draft K/V, one position") == "20 KiB"
    assert fig("draft K/V, full window (8192 positions)") == "160 MiB"
    assert fig("draft K/V, 131072 retained positions, dense pool (release)") == "2.5 GiB"
    assert fig("draft K/V, 131072 retained positions, bounded ring buffer (dspine)") == "160 MiB"
    assert fig("token codebook E [248320, 1024]") == "485 MiB"
    assert fig("greedy lookup tables [248320, 512] + [248320, 1024]") == "727.5 MiB"
    assert "bfloat16" in out.splitlines()[0]


def test_cli_memory_json_with_target(capsys):
    from dspine.cli.main import main

    assert main(["memory", "--config", "small", "--target", "random:llama", "--context", "300",
                 "--concurrency", "3", "--dtype", "float32", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    keys = {r["key"] for r in d["rows"]}
    assert {"drafter_weights", "codebook", "greedy_tables", "quantized_head", "draft_kv_dense", "draft_kv_ring",
            "target_weights", "target_kv"} <= keys
    rows = {r["key"]: r for r in d["rows"]}
    assert rows["target_kv"]["bytes"] == 300 * 2 * 4 * 2 * 16 * 4  # L * (k, v) * kv heads * head_dim * fp32
    per_req = sum(rows[k]["bytes"] for k in ("draft_kv_ring", "target_kv"))
    shared = sum(rows[k]["bytes"] for k in ("drafter_weights", "codebook", "quantized_head",
                                             "quantized_head_scales", "target_weights"))
    assert d["totals"]["dspine"] == shared + 3 * per_req
    assert main(["memory", "--config", "/nonexistent/cfg"]) == 2
    assert main(["memory", "--dtype", "int4"]) == 2
    # the output cache's bounds are serve's: a cache serve would refuse is not priced
    assert main(["memory", "--ngram-cache-tokens", "1"]) == 2
    assert main(["memory", "--ngram-cache-tokens", "8", "--ngram-max", "1"]) == 2
    assert "must be 0 (off) or >= 2" in capsys.readouterr().err
    assert main(["memory", "--ngram-cache-tokens", "2"]) == 0


def test_cli_memory_counts_the_ngram_prior(tmp_path, monkeypatch, capsys):
    """``--ngram-prior DIR`` adds the table that generate/serve would load, at its measured size,
    once per process; settings it cannot price are refused naming the setting."""
    from dspine.cli.main import main
    from dspine.data.prior import resolve_prior

    from dspine.data.tokenizer import tokenizer_fingerprint

    monkeypatch.setenv("DSPINE_HOME", str(tmp_path / "home"))
    d = tmp_path / "data"
    d.mkdir()  # a manifest as `dspine data build` writes it: the target and its tokenizer
    tok = tokenizer_fingerprint(load_target("random:llama").tokenizer)
    (d / "manifest.json").write_text(json.dumps({"target": "random:llama", "tokenizer": tok}))
    (d / "data-00000.jsonl").write_text(json.dumps({"id": "a", "prompt_ids": [1], "response_ids": [2, 3, 2, 4, 5]}) + "\n")
    base = ["memory", "--config", "small", "--target", "random:llama", "--concurrency", "2", "--json"]
    assert main(base) == 0
    without = json.loads(capsys.readouterr().out)
    assert main(base + ["--ngram-prior", str(d)]) == 0
    rep = json.loads(capsys.readouterr().out)
    prior = resolve_prior(str(d), load_target("random:llama"))
    row = {r["key"]: r for r in rep["rows"]}["ngram_prior"]
    assert row["bytes"] == prior.nbytes() > 0 and f"{prior.keys.shape[0]:,} contexts" in row["detail"]
    assert rep["totals"]["dspine"] == without["totals"]["dspine"] + prior.nbytes()  # shared, not per request
    assert main(["memory", "--config", "small", "--ngram-prior", str(d)]) == 2
    assert "--ngram-prior" in (err := capsys.readouterr().err) and "needs --target" in err
    assert main(["memory", "--config", "small", "--target", "random:llama", "--ngram-prior", str(tmp_path)]) == 2
    assert "no manifest.json" in capsys.readouterr().err
    # data generate would refuse (an id outside the target's vocabulary) is refused here too
    (d / "data-00000.jsonl").write_text(json.dumps({"id": "a", "prompt_ids": [1], "response_ids": [2, 99999]}) + "\n")
    assert main(base + ["--ngram-prior", str(d)]) == 2
    assert "--ngram-prior" in capsys.readouterr().err
    # where generate runs without a prior (no committed data for auto), a note and no row
    assert main(base + ["--ngram-prior", "auto"]) == 0
    out = capsys.readouterr()
    assert "is off" in out.err and "ngram_prior" not in {r["key"] for r in json.loads(out.out)["rows"]}
    assert main(["memory", "--concurrency", "0"]) == 2 and "--concurrency" in capsys.readouterr().err


@pytest.mark.parametrize("over", [dict(), dict(mode="dflash"), dict(row_embedding=False, num_layers=3),
                                  dict(mode="dflash", qk_norm=True, row_embedding=False),
                                  dict(profile="release", num_layers=1, ffn=64, target_hidden=64,
                                       num_heads=4, num_kv_heads=2, head_dim=16, code_dim=32, msg_dim=16)])
def test_param_counts_match_model(over, tiny256):
    over = dict(over)
    profile, mode = over.pop("profile", "small"), over.pop("mode", "dspine")
    cfg = DSpineConfig.for_target(tiny256, profile=profile, mode=mode, **over)
    counts = drafter_param_counts(cfg)
    m = DSpineDrafter(cfg)
    assert sum(counts.values()) == m.num_parameters()
    assert counts["codebook"] == (m.codebook.weight.numel() if cfg.bridge else 0)


# -- estimate vs measured allocation ----------------------------------------------------------------
@pytest.mark.slow  # long CLI / subprocess run; the default suite stays under ~15 min on 2 cores
def test_estimate_matches_measured_real_target():
    """SmolLM2-135M (float32) + a random small-profile drafter with window 96; a
    160-token prompt, then a few cycles."""
    smol = load_target("smollm2-135m", dtype="float32")
    drafter = random_drafter(smol, window=96, dtype=torch.float32)
    prop = DrafterProposer(drafter, head_kernel="int8")  # the estimate's default plan
    prompt = (smol.tokenizer.encode("The quick brown fox jumps over the lazy dog. ", add_special_tokens=False) * 20)[:160]
    assert len(prompt) == 160
    eng = Engine(smol, prop, "dspine")
    req = eng.start(prompt, SamplingConfig(), max_new_tokens=6)
    spec = target_spec(smol)  # from the config alone (meta-device instantiation)
    rep = estimate(drafter.cfg, spec, context=len(prompt), dtype="float32")
    # drafter weights (codebook apart) and the codebook: sum of parameter tensor bytes
    cb = drafter.codebook.weight
    assert tensor_bytes(p for p in drafter.parameters() if p is not cb) == rep["drafter_weights"]
    assert cb.numel() * cb.element_size() == rep["codebook"]
    # quantized coarse head copy + scales
    assert prop.qhead.nbytes() == rep["quantized_head"] + rep["quantized_head_scales"]
    # draft context K/V after the long prompt: ring buffer bounded at the window (commits are
    # lazy: the pending features count until the drafter next reads its context)
    assert req.draft_state.nbytes() > req.draft_state.kv_bytes() == 0
    req.draft_state.flush()
    assert req.draft_state.nbytes() == rep["draft_kv_ring"] == 96 * rep["draft_kv_per_position"]
    # dense pool: the same features kept for every position
    feats = smol.forward(torch.tensor([prompt]), None, prop.feature_layers).features[0]
    dense = DraftContextCache(drafter.cfg.num_layers, window=1 << 30)
    pos = torch.arange(len(prompt))
    dense.append(drafter.context_kv(feats[None], pos[None]), pos)
    assert dense.nbytes() == rep["draft_kv_dense"] == 160 * rep["draft_kv_per_position"]
    # target: weights (tied head counted once) and KV of the prompt
    assert tensor_bytes(smol.model.parameters()) == rep["target_weights"]
    assert req.cache.nbytes() == rep["target_kv"]
    while not req.finished:
        eng.step(req)
        rep2 = estimate(drafter.cfg, spec, context=req.position, dtype="float32")
        assert req.cache.nbytes() == rep2["target_kv"]
        req.draft_state.flush()
        assert req.draft_state.nbytes() == rep2["draft_kv_ring"]  # flat past the window
    # bf16 halves every dtype-sized part; the quantized head stays 1 byte per element
    half = estimate(drafter.cfg, spec, context=160, dtype="bfloat16")
    assert half["drafter_weights"] * 2 == rep["drafter_weights"] and half["target_kv"] * 2 == rep["target_kv"]
    assert half["quantized_head"] == rep["quantized_head"]


@pytest.mark.parametrize("arch", ["qwen3_next", "qwen3_5"])
def test_estimate_matches_measured_hybrid_state(arch):
    pytest.importorskip("dspine.target.replay_ssm")
    t = load_target(f"random:{arch}")
    cache = t.new_cache()
    t.forward(torch.arange(1, 38)[None], cache, None)
    cache.rollback(37)
    spec = target_spec(t)
    assert spec.state_fp32 > 0 and spec.conv_state > 0
    rep = estimate(DSpineConfig.for_target(t), t, context=37, dtype="float32")
    assert cache.nbytes() == rep["target_kv"] + rep["target_state"]
    assert tensor_bytes(t.model.parameters()) == rep["target_weights"]


# -- bounded draft cache ---------------------------------------------------------------------------
def test_ring_buffer_memory_flat_past_window(tiny256):
    d = random_drafter(tiny256, window=48)
    per = 2 * d.cfg.num_layers * d.cfg.num_kv_heads * d.cfg.head_dim * 4
    cache = DraftContextCache(d.cfg.num_layers, d.cfg.window)
    F = len(d.cfg.feature_layers) * tiny256.hidden_size
    g = torch.Generator().manual_seed(0)
    sizes = []
    p = 0
    for n in [5, 3, 7, 1, 20, 2, 9, 30, 4, 11, 1, 1, 60]:
        pos = torch.arange(p, p + n)
        with torch.no_grad():
            cache.append(d.context_kv(torch.randn(1, n, F, generator=g), pos[None]), pos)
        p += n
        sizes.append(cache.nbytes())
        assert cache.nbytes() <= 48 * per
        # the newest min(p, window) positions are held, nothing older
        held = sorted(cache.pos[cache.valid].tolist())
        assert held == list(range(max(0, p - 48), p))
    assert sizes[-1] == 48 * per and p > 3 * 48
    assert ring_buffer_positions(10, 48) == 48 and ring_buffer_positions(1000, 48) == 48
    assert ring_buffer_positions(100, 4096) == 100


class WindowCheckProposer(DrafterProposer):
    """Ring-buffer proposals, each checked against a from-scratch reference.

    The reference keeps every committed feature, recomputes the context K/V of *all*
    positions at each proposal (a dense, unbounded cache) and relies on the drafter's
    attention mask alone to limit attention to the window. A control drafter with the
    same weights and an unlimited window shows that positions outside the window would
    change the block states (so the comparison is sensitive).
    """

    def __init__(self, drafter, control):
        super().__init__(drafter)
        self.control = control
        self.records: list[dict] = []

    def new_state(self, prompt_ids):
        return {"ring": super().new_state(prompt_ids), "feats": []}

    def commit(self, state, features, start_pos):
        super().commit(state["ring"], features, start_pos)
        state["feats"].append(features.detach().clone())

    def _full_cache(self, model, feats):
        full = DraftContextCache(model.cfg.num_layers, window=1 << 30)
        pos = torch.arange(feats.shape[0])
        full.append(model.context_kv(feats[None], pos[None]), pos)
        return full

    @torch.no_grad()
    def propose(self, state, anchor, anchor_pos, n, sampling, gen):
        feats = torch.cat(state["feats"])  # positions 0 .. anchor_pos-1
        assert feats.shape[0] == anchor_pos
        g_ref = None
        if gen is not None:
            g_ref = torch.Generator()
            g_ref.set_state(gen.get_state())
        full = self._full_cache(self.drafter, feats)
        ref = DrafterProposer.propose(self, full, anchor, anchor_pos, n, sampling, g_ref)
        ring = state["ring"]
        got = super().propose(ring, anchor, anchor_pos, n, sampling, gen)
        a = torch.tensor([[anchor]])
        ap = torch.tensor([[anchor_pos]])
        h_ring = self.drafter.forward_blocks(a, ap, *ring.as_batch()).h
        h_full = self.drafter.forward_blocks(a, ap, *full.as_batch()).h
        cfull = self._full_cache(self.control, feats)
        h_ctrl = self.control.forward_blocks(a, ap, *cfull.as_batch()).h
        self.records.append(dict(
            pos=anchor_pos, wrapped=ring.written > ring.pos.shape[0],
            same_tokens=torch.equal(got.tokens, ref.tokens),
            q_diff=0.0 if got.q_probs is None else float((got.q_probs - ref.q_probs).abs().max()),
            same_ids=got.q_ids is None or torch.equal(got.q_ids, ref.q_ids),
            h_diff=float((h_ring - h_full).abs().max()), ctrl_diff=float((h_ctrl - h_full).abs().max())))
        return got


def _window_check(tiny256, sampling: SamplingConfig, max_new: int):
    d = random_drafter(tiny256, block_size=8, window=16, seed=3)
    ctrl_cfg = DSpineConfig.for_target(tiny256, block_size=8, window=1 << 20)
    ctrl = DSpineDrafter(ctrl_cfg)
    ctrl.load_state_dict(d.state_dict())
    ctrl.bind_target(tiny256.input_embeddings(), tiny256.output_head()).eval()
    prop = WindowCheckProposer(d, ctrl)
    prompt = [(7 * i + 3) % 250 + 1 for i in range(40)]
    saved = tiny256.eos_token_ids
    tiny256.eos_token_ids = frozenset()
    try:
        res = Engine(tiny256, prop, "dspine").generate(prompt, sampling, max_new)
        ar = Engine(tiny256, None, "ar").generate(prompt, sampling, max_new) if sampling.greedy else None
    finally:
        tiny256.eos_token_ids = saved
    return prop.records, res, ar


def test_window_bound_keeps_greedy_proposals_and_output(tiny256):
    recs, res, ar = _window_check(tiny256, SamplingConfig(), 40)
    assert len(recs) >= 5 and sum(r["wrapped"] for r in recs) >= len(recs) - 1  # ring overwritten
    assert all(r["same_tokens"] for r in recs)
    assert max(r["h_diff"] for r in recs) < 1e-5
    assert max(r["ctrl_diff"] for r in recs) > 1e-3  # positions beyond the window would matter
    assert res.token_ids == ar.token_ids


def test_window_bound_keeps_sampled_proposals(tiny256):
    recs, res, _ = _window_check(tiny256, SamplingConfig(temperature=1.0, seed=5), 24)
    assert len(recs) >= 4
    assert all(r["same_tokens"] and r["same_ids"] for r in recs)
    assert max(r["q_diff"] for r in recs) < 1e-6
    assert len(res.token_ids) == 24


def test_memory_window_benchmark_runs(tmp_path):
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "archive" / "memory_window.py"
    spec = importlib.util.spec_from_file_location("memory_window", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    res = mod.run(context=700, prefill=100, block=16, dtype="float32", seed=0, every=50)
    cfg_window = res["drafter"]["window"]
    assert res["rows"][-1]["context"] == 700 and cfg_window == 2048
    assert res["summary"]["dense_matches_estimate"]
    assert all(r["ring_bytes"] <= cfg_window * res["drafter"]["bytes_per_position"] for r in res["rows"])
    mod.plot(res, tmp_path / "m.png")
    assert (tmp_path / "m.png").stat().st_size > 1000


def test_tree_budget_adds_one_verification_of_buffers():
    from dspine.drafter.memory import drafter_config, estimate
    from dspine.drafter.target_spec import target_spec
    spec = target_spec("random:llama")
    cfg = drafter_config("small", spec)
    base = estimate(cfg, spec, context=256, dtype="float32")
    rep = estimate(cfg, spec, context=256, dtype="float32", tree_budget=31)
    row = next(r for r in rep.rows if r.key == "tree_verify")
    F = len(cfg.feature_layers)
    heads = max(1, spec.hidden_size // 64)
    assert row.bytes == (32 * (spec.kv_per_position * 4 + spec.vocab_size * 4 + F * spec.hidden_size * 4)
                         + 32 * (256 + 32) * (1 + 4 * heads))  # mask + one layer's scores
    assert rep.total("dspine") == base.total("dspine") + row.bytes
    assert not any(r.key == "tree_verify" for r in base.rows)
    with pytest.raises(ValueError, match="tree_budget must be >= 0"):
        estimate(cfg, spec, tree_budget=-1)
