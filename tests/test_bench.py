"""Tests of dspine.bench: workloads, fairness checks, output checks, harness and CLI."""
from __future__ import annotations

import copy
import importlib.util
import json

import pytest
import torch

from dspine.bench import environment as ENV
from dspine.bench import fairness as FAIR
from dspine.bench import harness as H
from dspine.bench import report as R
from dspine.bench import run_config as RC
from dspine.bench import summary as SM
from dspine.bench import workloads as W
from dspine.bench import prompts as P
from dspine.bench.checks import check_multifile, check_tool_call, parse_tool_calls, run_humaneval
from dspine.bench.hf_runner import HFRunner
from dspine.bench.runners import EngineRunner
from dspine.cli.main import main
from dspine.config import SamplingConfig


@pytest.fixture(scope="module")
def tiny_target():
    """random:llama with the byte vocabulary (a private copy: tests here swap runners)."""
    from dspine.target.adapter import load_target

    return load_target("random:llama", vocab_size=256, seed=1)


def tiny_config(**over) -> RC.BenchConfig:
    base = dict(target="random:llama", modes=("ar", "dspine", "dflash", "hf", "hf-pld"),
                drafters={"dspine": "random", "dflash": "random"}, block_size=4, limit=1,
                max_new_tokens=6, context_tokens=1536, settings=(RC.GREEDY, RC.SAMPLED), repeats=1,
                warmup=1, warmup_tokens=3, threads=1, code_timeout_s=5.0,
                verify_policy="fixed")  # every cycle drafts: the harness's draft/final-stage columns are exercised
    base.update(over)
    return RC.BenchConfig(**base)


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    prev = torch.get_num_threads()
    out = tmp_path_factory.mktemp("bench")
    try:
        summary = H.run_bench(tiny_config(), out, progress=False)
    finally:
        torch.set_num_threads(prev)
    return out, summary, R.load_rows(out)


# -- workloads -----------------------------------------------------------------------------
def test_workloads_file_matches_rules():
    W.load_workloads.cache_clear()
    assert W.load_workloads() == json.loads(json.dumps(W.workload_set()))


def test_workloads_are_eval_only_and_versioned():
    from dspine.data.stdlib import is_heldout_module

    ws = W.load_workloads()["workloads"]
    assert set(ws) == set(W.WORKLOAD_NAMES)
    assert all(isinstance(w["version"], int) for w in ws.values())
    assert all(i.startswith("mtbench/") for i in ws["short"]["ids"] + ws["long"]["ids"])
    assert not set(ws["short"]["ids"]) & set(ws["long"]["ids"])
    assert all(i.startswith("HumanEval/") for i in ws["code"]["ids"])
    assert all(is_heldout_module(m) for e in ws["multifile"]["ids"] for m in e["modules"])
    assert W.workload_version("code") == "code/v1"
    with pytest.raises(W.WorkloadError, match="--workloads"):
        W.parse_workloads("short,nope")


def test_build_prompts_fit_context_and_carry_check_data(tiny_target):
    prompts, skipped = P.build_prompts(tiny_target, list(W.WORKLOAD_NAMES), limit=1, context_tokens=2500,
                                       max_new_tokens=8)
    by = {p.workload: p for p in prompts}
    assert set(by) | {s["workload"] for s in skipped} == set(W.WORKLOAD_NAMES)
    assert all(len(p.prompt_ids) + p.max_new_tokens <= 2500 for p in prompts)
    mf = by["multifile"]
    assert mf.meta["answer_file"] and mf.meta["symbol"]
    assert by["code"].stop == W.HUMANEVAL_STOP and "entry_point" in by["code"].meta


# -- checks ---------------------------------------------------------------------------------
FUNCS = [{"name": "area", "parameters": {"type": "dict", "required": ["base", "height"], "properties": {
    "base": {"type": "integer"}, "height": {"type": "float"},
    "unit": {"type": "string", "enum": ["cm", "m"]}, "tags": {"type": "array", "items": {"type": "string"}}}}},
    {"name": "math.sum", "parameters": {"type": "dict", "properties": {"xs": {"type": "array"}}, "required": ["xs"]}}]


@pytest.mark.parametrize("text,result", [
    ('{"name": "area", "arguments": {"base": 3, "height": 2.5}}', "valid"),
    ('Sure! ```json\n{"name": "area", "arguments": {"base": 3, "height": 2, "unit": "m"}}\n```', "valid"),
    ('<tool_call>{"name": "math.sum", "arguments": {"xs": [1, 2]}}</tool_call>', "valid"),
    ('[area(base=1, height=2.0), math.sum(xs=[1])]', "valid"),
    ('[{"name": "area", "arguments": {"base": 1, "height": 1}}, {"name": "math.sum", "arguments": {"xs": []}}]', "valid"),
    ('{"name": "volume", "arguments": {}}', "unknown_function"),
    ('{"name": "area", "arguments": {"base": 3}}', "invalid_arguments"),
    ('{"name": "area", "arguments": {"base": "3", "height": 1}}', "invalid_arguments"),
    ('{"name": "area", "arguments": {"base": true, "height": 1}}', "invalid_arguments"),
    ('{"name": "area", "arguments": {"base": 3, "height": 1, "unit": "km"}}', "invalid_arguments"),
    ('{"name": "area", "arguments": {"base": 3, "height": 1, "color": "red"}}', "invalid_arguments"),
    ('{"name": "area", "arguments": {"base": 3, "height": 1, "tags": [1]}}', "invalid_arguments"),
    ("The area is base times height over two.", "parse_error"),
])
def test_tool_call_check(text, result):
    assert check_tool_call(text, FUNCS)["result"] == result


def test_parse_tool_calls_string_arguments():
    assert parse_tool_calls('{"name": "area", "arguments": "{\\"base\\": 1}"}') == [
        {"name": "area", "arguments": {"base": 1}}]


def test_humaneval_sandbox_pass_fail_timeout():
    prompt = "def add(a, b):\n    \"\"\"Add.\"\"\"\n"
    test = "def check(candidate):\n    assert candidate(2, 3) == 5\n"
    assert run_humaneval(prompt, "    return a + b\n\ndef junk():\n    pass\n", test, "add")["result"] == "passed"
    bad = run_humaneval(prompt, "    return a - b\n", test, "add")
    assert bad["result"] == "failed" and "AssertionError" in bad["error"]
    assert run_humaneval(prompt, "    while True:\n        pass\n", test, "add", timeout_s=2)["result"] == "timeout"


def test_multifile_check():
    meta = {"answer": "email.errors", "answer_file": "email/errors.py"}
    assert check_multifile("It is in email/errors.py: ...", meta)["result"] == "correct"
    assert check_multifile("It is in typing.py", meta)["result"] == "wrong"
    assert check_multifile("anything", {"answer": None})["result"] == "unchecked"


# -- fairness -------------------------------------------------------------------------------
def test_check_fair_names_the_difference():
    same = {"target": "t", "dtype": "float32"}
    H.check_fair({"ar": same, "dspine": dict(same)})
    with pytest.raises(H.UnfairComparisonError, match=r"dtype \(ar: 'float32', hf: 'bfloat16'\)"):
        H.check_fair({"ar": same, "hf": {"target": "t", "dtype": "bfloat16"}})


def test_harness_refuses_unfair_runners(tiny_target, one_thread):
    from dspine.target.adapter import load_target

    h = H.Harness(tiny_config(modes=("ar", "hf")), target=tiny_target)
    h.check_setup()
    # another dtype (a separately loaded bf16 copy of the target) for one mode
    h.runners["hf"] = HFRunner(load_target("random:llama", dtype="bfloat16", seed=1), "hf")
    with pytest.raises(H.UnfairComparisonError, match="dtype"):
        h.check_setup()
    # another target checkpoint
    h.runners["hf"] = HFRunner(load_target("random:llama", seed=2), "hf")
    with pytest.raises(H.UnfairComparisonError, match="weights"):
        h.check_setup()

    # a runner that would decode with other settings than the shared ones
    class HotHF(HFRunner):
        def generation_config(self, sampling, max_new_tokens, timeout_s=None):
            return super().generation_config(SamplingConfig(temperature=1.3), max_new_tokens, timeout_s)

    h.runners["hf"] = HotHF(tiny_target, "hf")
    with pytest.raises(H.UnfairComparisonError, match="decoding setting 'greedy'.*sampling"):
        h.check_setup()


def test_check_rows_fair_refuses_mixed_rows(tiny_run):
    _, _, rows = tiny_run
    FAIR.check_rows_fair(rows)
    bad = copy.deepcopy(rows)
    r = next(r for r in bad if r["mode"] == "dspine" and not r["warmup"])
    r["decoding"]["sampling"]["temperature"] = 0.9
    with pytest.raises(H.UnfairComparisonError, match="decoding"):
        FAIR.check_rows_fair(bad)
    bad = copy.deepcopy(rows)
    for r in bad:
        if r["mode"] == "hf":
            r["setup"]["dtype"] = "bfloat16"
    with pytest.raises(H.UnfairComparisonError, match="dtype"):
        SM.summarize(bad)


def test_concurrency_refused_without_batched_engine(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "dspine.core.batch" else real(name, *a))
    with pytest.raises(H.BenchError, match="--concurrency 4: this build has no batched engine"):
        RC.require_batched_engine(4)
    RC.require_batched_engine(1)
    assert main(["bench", "--concurrency", "1,4", "--target", "random:llama", "--drafter", "random"]) == 2


def test_cli_rejects_bad_settings(capsys):
    assert main(["bench", "--modes", "ar,turbo", "--target", "random:llama"]) == 2
    assert "--modes turbo" in capsys.readouterr().err
    assert main(["bench", "--target", "random:llama", "--modes", "ar", "--settings", "beam"]) == 2


def test_earlier_results_are_not_overwritten_without_flag(tmp_path, capsys, monkeypatch):
    prev = tmp_path / "report.md"  # any file of an earlier run counts
    prev.write_text("earlier")
    assert main(["bench", "--target", "random:llama", "--modes", "ar", "--out", str(tmp_path)]) == 2
    assert "--overwrite" in capsys.readouterr().err and prev.read_text() == "earlier"
    assert main(["bench", "--target", "random:llama", "--modes", "ar", "--out", str(prev)]) == 2
    assert "is a file" in capsys.readouterr().err
    (tmp_path / "speedup.png").write_bytes(b"old plot")

    class Started(Exception):
        pass

    class Refused(Exception):
        pass

    def refusing(cfg, target=None):  # a setting refused while the harness is built
        raise Refused

    monkeypatch.setattr(H, "Harness", refusing)
    with pytest.raises(Refused):  # nothing of the earlier run is deleted before the settings passed
        H.run_bench(RC.BenchConfig(modes=("ar",), target="random:llama"), tmp_path, overwrite=True)
    assert prev.exists() and (tmp_path / "speedup.png").exists()

    class Accepted:
        def __init__(self, cfg, target=None):
            pass

        def run(self, out, progress=True):
            raise Started

        def close(self):
            pass

    monkeypatch.setattr(H, "Harness", Accepted)
    with pytest.raises(Started):  # with --overwrite the check passes and the run starts
        H.run_bench(RC.BenchConfig(modes=("ar",), target="random:llama"), tmp_path, overwrite=True)
    assert not prev.exists() and not (tmp_path / "speedup.png").exists()  # no stale file of the earlier run


def test_exit_status_is_1_when_requests_failed(tmp_path, monkeypatch, capsys):
    import dspine.bench.cli as bc

    def fake(cfg, out, **kw):
        return {"results": [{"workload": "short", "mode": "ar", "failures": failures}], "requests": 2,
                "notes": [], "wall_s": 0.1}

    monkeypatch.setattr(bc, "run_bench", fake)
    argv = ["bench", "--target", "random:llama", "--modes", "ar", "--out", str(tmp_path)]
    failures = 0
    assert main(argv) == 0
    failures = 2
    assert main(argv) == 1 and "2 request(s) failed" in capsys.readouterr().err


def test_full_run_needs_drafters(monkeypatch):
    import dspine.build

    monkeypatch.setattr(dspine.build, "default_drafter_path", lambda t, m: None)
    with pytest.raises(H.BenchError, match="--drafter-dspine PATH"):
        RC.resolve_drafters(RC.BenchConfig(modes=("ar", "dspine")))
    assert RC.resolve_drafters(RC.smoke_config())["dspine"] == "random"


# -- the harness end to end (random:llama) ----------------------------------------------------
def test_harness_outputs(tiny_run):
    out, summary, rows = tiny_run
    for f in ("results.jsonl", "summary.json", "report.md", "speedup.png", "acceptance.png", "cycle_split.png"):
        assert (out / f).stat().st_size > 0, f
    rec = [r for r in rows if not r["warmup"]]
    assert len(rec) == len(W.WORKLOAD_NAMES) * 5 * 2  # workloads x modes x settings (1 prompt, 1 repeat)
    assert sum(r["warmup"] for r in rows) == 5 * 2
    env = rec[0]["env"]
    for k in ("torch", "transformers", "python", "torch_threads", "dtype", "device", "git_commit"):
        assert k in env
    for r in rec:
        assert r["output_tokens"] >= 1 and r["ttft_s"] > 0 and r["e2e_s"] >= r["ttft_s"]
        assert r["peak_memory_bytes"] > 0 and not r["failed"]
        assert r["mode_info"]["block_size"] == {"ar": 1, "hf": 1, "hf-pld": 11}.get(r["mode"], 4)
    # greedy is lossless: every mode emits ar's tokens
    greedy = {}
    for r in rec:
        if r["setting"] == "greedy":
            greedy.setdefault(r["prompt_id"], {})[r["mode"]] = r["output_ids"]
    for pid, outs in greedy.items():
        assert all(o == outs["ar"] for o in outs.values()), pid
    code = [r for r in rec if r["workload"] == "code"]
    assert all(r["check"] in ("passed", "failed", "timeout") for r in code)
    assert all(r["check"] in ("valid", "parse_error", "unknown_function", "invalid_arguments")
               for r in rec if r["workload"] == "tools")
    spec = [r for r in rec if r["mode"] in ("dspine", "dflash")]
    assert all(r["draft_s"] > 0 and r["verify_s"] > 0 and r["verification_lengths"] for r in spec)
    # the final stage runs whenever the drafter proposed (copies alone may fill a copy-heavy request)
    assert all(r["final_stage_s"] > 0 for r in spec
               if r["mode"] == "dspine" and r["sources"].get("draft", {}).get("proposed", 0) > 0)
    assert any(r["final_stage_s"] > 0 for r in spec if r["mode"] == "dspine")


def test_summary_and_report(tiny_run):
    out, summary, _ = tiny_run
    res = summary["results"]
    assert {(g["workload"], g["mode"]) for g in res} == {(w, m) for w in W.WORKLOAD_NAMES for m in tiny_config().modes}
    for g in res:
        cm = g["cost_model"]
        assert cm["measured_s_per_token"] and cm["model_s_per_token"] and "flag" in cm
        assert (g["speedup"] is None) == (g["mode"] == "ar")
        if g["mode"] in ("dspine", "dflash"):
            assert set(g["cycle_split_s"]) == {"draft", "final_stage", "verify", "overhead"}
            assert g["tau_pooled"] >= 1 and g["acceptance_per_position"]
    assert any("pass_at_1" in g for g in res) and any("valid_call_rate" in g for g in res)
    md = (out / "report.md").read_text()
    for w in W.WORKLOAD_NAMES:
        assert f"## {w} ({w}/v1), greedy, concurrency 1" in md
    assert "## Cost model" in md and "Untrained (random) drafters" in md
    assert json.loads((out / "summary.json").read_text())["results"]


def test_cost_model_flags_a_mismatch(tiny_run):
    _, _, rows = tiny_run
    base = {(g["setting"], g["workload"]): g["cost_model"]["error"]
            for g in SM.summarize(rows)["results"] if g["mode"] == "dspine"}
    bad = copy.deepcopy(rows)
    for r in bad:
        if r["mode"] == "dspine" and not r["warmup"]:
            r["decode_s"] *= 3.0  # time the cycle components do not explain
    s = SM.summarize(bad)
    ds = [g for g in s["results"] if g["mode"] == "dspine"]
    assert ds and len(ds) == len(base)
    for g in ds:  # model / measured drops 3x whatever the (timing-noisy) error was before
        err = g["cost_model"]["error"]
        assert err == pytest.approx((1 + base[(g["setting"], g["workload"])]) / 3 - 1)
        assert g["cost_model"]["flag"] == (abs(err) > SM.COST_MODEL_TOLERANCE)
    assert any(g["cost_model"]["flag"] for g in ds)
    assert any(n.startswith("Cost model off") and "for dspine" in n for n in s["notes"])


def test_speedup_vs_peer_is_per_request_ratio(tiny_run):
    _, _, rows = tiny_run
    rec = [r for r in rows if not r["warmup"]]
    s = SM.summarize(rows)
    for g in s["results"]:
        if g["mode"] == "hf-pld":
            assert g["speedup_vs_peer"] is None
            continue
        key = (g["concurrency"], g["setting"], g["workload"])
        peer = {(r["prompt_id"], r["repeat"]): r for r in rec
                if (r["concurrency"], r["setting"], r["workload"], r["mode"]) == key + ("hf-pld",)}
        mine = [r for r in rec if (r["concurrency"], r["setting"], r["workload"], r["mode"]) == key + (g["mode"],)]
        want = sorted(r["tokens_per_second"] / peer[(r["prompt_id"], r["repeat"])]["tokens_per_second"]
                      for r in mine)
        assert g["speedup_vs_peer"]["n"] == len(want)
        assert g["speedup_vs_peer"]["median"] == pytest.approx(want[len(want) // 2] if len(want) % 2 else
                                                               (want[len(want) // 2 - 1] + want[len(want) // 2]) / 2)
    md = R.render_markdown(s, [])
    assert "## At a glance" in md and "| vs hf-pld |" in md
    # slowing the peer down by 2x doubles every speculative mode's ratio against it
    slow = copy.deepcopy(rows)
    for r in slow:
        if r["mode"] == "hf-pld":
            r["tokens_per_second"] /= 2
    s2 = SM.summarize(slow)
    for g, g2 in zip(s["results"], s2["results"]):
        if g["speedup_vs_peer"]:
            assert g2["speedup_vs_peer"]["median"] == pytest.approx(2 * g["speedup_vs_peer"]["median"])


@pytest.mark.skipif(importlib.util.find_spec("dspine.core.batch") is None, reason="no batched engine")
def test_concurrency_with_batched_engine(tmp_path, tiny_target, one_thread):
    cfg = tiny_config(modes=("ar", "dspine", "hf"), workloads=("short",), limit=2, settings=(RC.GREEDY,),
                      concurrency=(1, 2), warmup=1)
    s = H.run_bench(cfg, tmp_path, progress=False, plots=False, target=tiny_target)
    rows = R.load_rows(tmp_path)
    c2 = [r for r in rows if r["concurrency"] == 2]
    assert {r["mode"] for r in c2} == {"ar", "dspine"} and len(c2) == 4
    g = next(g for g in s["results"] if g["concurrency"] == 2 and g["mode"] == "dspine")
    assert g["throughput_tokens_per_s"] > 0
    # the first request decodes while the second is prefilled: that wait is its prefill stall,
    # a term of the cost model (C + S + O) / tau beside the cycle split
    first = next(r for r in c2 if r["mode"] == "dspine")
    assert 0 < first["prefill_stall_s"] <= first["overhead_s"]
    cm = g["cost_model"]
    assert cm["prefill_stall_per_cycle_s"] > 0
    assert g["cycle_split_s"]["prefill_stall"] == pytest.approx(cm["prefill_stall_per_cycle_s"])
    assert cm["model_s_per_token"] == pytest.approx(
        (cm["cycle_cost_s"] + cm["prefill_stall_per_cycle_s"] + cm["overhead_per_cycle_s"]) / cm["tau"])
    assert all("prefill_stall_s" not in r for r in rows if r["concurrency"] == 1)


@pytest.mark.slow  # long CLI / subprocess run; the default suite stays under ~15 min on 2 cores
def test_smoke_cli(tmp_path):
    """``dspine bench --smoke`` on the real default target and shipped drafters (in CI, as
    the benchmark asks; its wall time is recorded in summary.json, not asserted here). Two
    threads (the smoke's default is one) halve this test's ~2.3 min on a 2-core CPU."""
    assert main(["bench", "--smoke", "--out", str(tmp_path), "--no-progress", "--threads", "2"]) == 0
    s = json.loads((tmp_path / "summary.json").read_text())
    assert s["modes"] == ["ar", "dspine", "dflash", "ngram", "hf-pld"] and s["requests"] == len(W.WORKLOAD_NAMES) * 5
    assert s["mode_info"]["dspine"]["proposer"] == "hybrid" and s["mode_info"]["ngram"]["proposer"] == "ngram"
    assert all(g["failures"] == 0 for g in s["results"])
    assert (tmp_path / "report.md").exists() and (tmp_path / "speedup.png").exists()
    import hashlib
    from dspine.drafter.checkpoint import read_card
    from dspine.build import default_drafter_path
    for m in ("dspine", "dflash"):  # the report names which weights ran, not only their path
        d = default_drafter_path("smollm2-135m", m)
        sha = hashlib.sha256((d / "model.safetensors").read_bytes()).hexdigest()[:16]
        steps = read_card(d)["total_steps"]
        assert s["mode_info"][m]["drafter_sha256"] == sha and s["mode_info"][m]["drafter_steps"] == steps
        assert f"{steps} training steps, sha256 {sha}" in (tmp_path / "report.md").read_text()
    assert s["wall_s"] > 0 and all(g["greedy_matches_ar"] in (None, 1.0) for g in s["results"]
                                   if g["mode"] in ("dspine", "dflash"))


def test_verify_policy_reaches_the_drafter_modes(tmp_path, one_thread):
    """--verify-policy cost is applied to dflash/dspine (not ar) and recorded per row."""
    import json

    out = tmp_path / "pol"
    assert main(["bench", "--target", "random:llama", "--drafter", "random", "--modes", "ar,dspine",
                 "--workloads", "short", "--limit", "1", "--max-new-tokens", "6", "--settings", "greedy",
                 "--repeats", "1", "--warmup", "1", "--threads", "1", "--out", str(out), "--no-progress",
                 "--no-plots", "--verify-policy", "cost"]) == 0
    rows = [json.loads(l) for l in (out / "results.jsonl").read_text().splitlines()]
    pol = {r["mode"]: r["mode_info"]["verify_policy"] for r in rows}
    assert pol == {"ar": "fixed", "dspine": "cost"}
    curve = next(r["mode_info"]["policy_cycle_ms"] for r in rows if r["mode"] == "dspine")
    assert len(curve) == 16 and all(c > 0 for c in curve)  # n = 0..15 proposals
    assert curve[0] <= curve[1] and curve[1:] == sorted(curve[1:])  # monotone fits; n = 0 drafts nothing
    assert "ar" not in {r["mode"] for r in rows if "policy_cycle_ms" in r["mode_info"]}
    assert "cost-policy cycle ms at n=0/1/2/4/8/15: " in (out / "report.md").read_text()
    ar_ids = [r["output_ids"] for r in rows if r["mode"] == "ar" and not r["warmup"]]
    sp_ids = [r["output_ids"] for r in rows if r["mode"] == "dspine" and not r["warmup"]]
    assert ar_ids == sp_ids  # still lossless with the dynamic verification length


def test_drafter_modes_run_as_generate_builds_them(tiny_target, one_thread):
    """The bench's drafter modes get generate's engine: the cost policy and the draft tree
    are given when the engine is built, so a tree sized by the cost curve and the tree gate
    exist (assigned afterwards, as before 2026-12-04, both were silently off), and the
    drafter settings reach the drafter and the mode's info."""
    from dspine.bench.runners import make_runner
    from dspine.trees.tree import TreeSpec

    tree = TreeSpec(16, None, size="cost")
    r = make_runner(tiny_target, "dspine", {"dspine": "random"}, 4, 0, 10, "cost", "hybrid", tree=tree,
                    drafter_linears="float32", draft_vocab="full", head_kernel="exact")
    ctl = r.engine.verify_policy
    assert ctl.sizer is not None and ctl.gate is not None
    info = r.info()
    assert info["verify_policy"] == "cost" and info["drafter_linears"] == "float32"
    assert info["draft_vocab"] == tiny_target.vocab_size and info["head_kernel"] == "exact"
    assert info["drafter_forward"] in ("lean", "pytorch") and "candidate_pass" in info
    fixed = make_runner(tiny_target, "dspine", {"dspine": "random"}, 4, 0, 10, "fixed", "hybrid", tree=tree)
    assert not fixed.engine.verify_policy.sizes_trees  # no cost curve: fixed size, no gate


def test_bad_drafter_setting_is_a_clean_error(capsys):
    assert main(["bench", "--target", "random:llama", "--drafter", "random", "--modes", "ar,dspine",
                 "--head-kernel", "turbo", "--limit", "1", "--settings", "greedy", "--no-progress"]) == 2
    assert "--head-kernel" in capsys.readouterr().err


def test_git_dirty_ignores_the_runs_own_out_dir(tmp_path):
    """A rerun replaces the committed results in --out; only other changes make the
    report's build line say "(dirty)"."""
    import subprocess

    def git(*a):
        subprocess.run(["git", "-C", str(tmp_path), *a], check=True, capture_output=True)

    git("init", "-q")
    git("config", "user.email", "t@t")
    git("config", "user.name", "t")
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "report.md").write_text("old\n")
    (tmp_path / "code.py").write_text("x = 1\n")
    git("add", "-A")
    git("commit", "-qm", "c")
    assert ENV.git_dirty(root=tmp_path) is False
    (tmp_path / "out" / "report.md").write_text("new\n")
    assert ENV.git_dirty(root=tmp_path) is True
    assert ENV.git_dirty(exclude=tmp_path / "out", root=tmp_path) is False
    (tmp_path / "code.py").write_text("x = 2\n")
    assert ENV.git_dirty(exclude=tmp_path / "out", root=tmp_path) is True
    assert ENV.git_dirty(exclude="/elsewhere", root=tmp_path) is True


def test_edit_workload_check():
    """The copy-heavy ``edit`` workload: the reference solution passes its check, a wrong
    body and an answer without the function fail."""
    from dspine.bench.checks import check_edit
    from dspine.data.sources import load_humaneval

    ids = W.load_workloads()["workloads"]["edit"]["ids"]
    assert len(ids) >= 8 and not set(ids) & set(W.load_workloads()["workloads"]["code"]["ids"])
    r = {x["task_id"]: x for x in load_humaneval()}[ids[0]]
    meta = {"test": r["test"], "entry_point": r["entry_point"]}
    assert check_edit(f"Here it is:\n```python\n{r['prompt']}{r['canonical_solution']}```", meta)["result"] == "passed"
    assert check_edit(f"```python\ndef {r['entry_point']}(*a):\n    return None\n```", meta)["result"] == "failed"
    assert check_edit("I cannot do that.", meta)["result"] == "failed"


def test_convert_workload_check(tiny_target):
    """The copy-heavy ``convert`` workload: rows disjoint from ``tools``, the
    prompt carries its JSON document, and the check accepts YAML (or JSON, a YAML subset)
    of the same document and rejects another document and unparseable text."""
    import yaml

    from dspine.bench.checks import check_convert

    ws = W.load_workloads()["workloads"]
    assert len(ws["convert"]["ids"]) == 16 and not set(ws["convert"]["ids"]) & set(ws["tools"]["ids"])
    (p,), skipped = P.build_prompts(tiny_target, ["convert"], limit=1, context_tokens=4096, max_new_tokens=8)
    doc = p.meta["document"]
    assert not skipped and doc["name"] and json.dumps(doc["name"]) in tiny_target.tokenizer.decode(p.prompt_ids)
    meta = {"document": doc}
    assert check_convert(f"Sure:\n```yaml\n{yaml.safe_dump(doc, sort_keys=False)}```", meta)["result"] == "equal"
    assert check_convert(json.dumps(doc, indent=2), meta)["result"] == "equal"
    other = {**doc, "name": doc["name"] + "_x"}
    assert check_convert(f"```yaml\n{yaml.safe_dump(other)}```", meta)["result"] == "different"
    assert check_convert("```yaml\nname: [unclosed\n```", meta)["result"] == "invalid"
