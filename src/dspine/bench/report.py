"""The Markdown report of a benchmark run and the files it writes.

:func:`render_markdown` turns the summary (:func:`dspine.bench.summary.summarize`) into
``report.md``; :func:`write_report` writes ``summary.json``, the plots
(:func:`dspine.bench.plots.make_plots`) and ``report.md``; :func:`load_rows` reads a run's
``results.jsonl`` back.
"""
from __future__ import annotations

import json
from pathlib import Path

from dspine.bench.plots import make_plots
from dspine.bench.summary import COST_MODEL_TOLERANCE, LLAMA_PEER, PEER


def _f(x, fmt="{:.2f}", none="–"):
    return none if x is None else fmt.format(x)


def _sp(s: dict | None) -> str:
    if not s:
        return "–"
    return f"{s['median']:.2f}x ({s['min']:.2f}–{s['max']:.2f}, n={s['n']})"


def _check_cell(g: dict) -> str:
    if "pass_at_1" in g:
        t = _f(g.get("e2e_s_per_correct_task"), "{:.1f}s")
        return f"pass@1 {100 * g['pass_at_1']:.0f}%, {t}/correct"
    if "valid_call_rate" in g:
        return f"valid {100 * g['valid_call_rate']:.0f}% ({g['tool_failures']} failed)"
    if g.get("answer_rate") is not None:
        return f"right file {100 * g['answer_rate']:.0f}%"
    return "–"


def _glance(res: list[dict]) -> list[str]:
    """Lines of the at-a-glance table: each speculative mode vs ar and vs the peer, per
    workload (median per-request tok/s ratio, with min–max)."""
    spec = [g for g in res if g["mode"] in ("dspine", "dflash")]
    if not spec:
        return []
    llama = any(g["mode"] == LLAMA_PEER for g in res)
    L = ["", f"## At a glance: speculative modes vs `ar` and vs the peer (`{PEER}`"
             + (f", `{LLAMA_PEER}`" if llama else "") + ")", "",
         "Output tokens/s after prefill, median of per-request ratios (min–max); the same "
         "requests in every mode.", "",
         f"| concurrency | setting | workload | mode | tau pooled | vs ar | vs {PEER} |"
         + (f" vs {LLAMA_PEER} |" if llama else ""), "|---|---|---|---|---|---|---|" + ("---|" if llama else "")]
    for g in spec:
        L.append(f"| {g['concurrency']} | {g['setting']} | {g['workload']} | {g['mode']} "
                 f"| {_f(g['tau_pooled'])} | {_sp(g['speedup'])} | {_sp(g.get('speedup_vs_peer'))} |"
                 + (f" {_sp(g.get('speedup_vs_llama_cpp'))} |" if llama else ""))
    return L


def render_markdown(summary: dict, plots: list[str]) -> str:
    env, cfg = summary.get("env") or {}, summary.get("config") or {}
    L = ["# dspine bench report", ""]
    L.append(f"Run `{summary.get('run_id')}`, {summary['requests']} recorded requests "
             f"(+{summary['warmup_requests']} warm-up), wall {summary.get('wall_s', '?')} s."
             + (" **Smoke run** (tiny; not a measurement)." if cfg.get("smoke") else ""))
    L += ["", "## Setup shared by every mode", "",
          "| field | value |", "|---|---|"]
    settings = ", ".join(f"{s['name']} (T={s['temperature']}, top-k {s['top_k']}, top-p {s['top_p']}, "
                         f"min-p {s['min_p']})" for s in cfg.get("settings", []))
    for k, v in [("target", f"{env.get('target')} ({env.get('target_path')})"),
                 ("weights fingerprint", (summary.get("setup") or {}).get("weights")),
                 ("dtype / device", f"{env.get('dtype')} / {env.get('device')} ({env.get('device_name')}"
                                    f"{', ' + env['isa'] if env.get('isa') else ''})"),
                 ("target linear backend", env.get("linear_backend", "aten")),
                 ("target runtime", env.get("target_runtime", "hf")),
                 ("threads", f"{env.get('torch_threads')} torch ({env.get('cpu_count')} CPUs)"
                             + (f", load average {env['load_avg_1m']:.2f} at start"
                                if env.get("load_avg_1m") is not None else "")),
                 ("build", f"dspine {env.get('dspine')} @ {str(env.get('git_commit'))[:10]}"
                           f"{' (dirty)' if env.get('git_dirty') else ''}, torch {env.get('torch')}, "
                           f"transformers {env.get('transformers')}, Python {env.get('python')}"),
                 ("context tokens", cfg.get("context_tokens")), ("decoding settings", settings),
                 ("repeats / warm-up", f"{cfg.get('repeats')} / {cfg.get('warmup')} per mode and setting"),
                 ("concurrency", ", ".join(str(c) for c in cfg.get("concurrency", [1])))]:
        L.append(f"| {k} | {v} |")
    L += ["", "| mode | drafter | block size | details |", "|---|---|---|---|"]
    for m, info in (summary.get("mode_info") or {}).items():
        info = info or {}
        det = ", ".join(f"{k}={info[k]}" for k in ("bridge", "final_stage", "block_causal", "prompt_lookup_num_tokens",
                                                  "max_matching_ngram_size", "drafter_dtype", "engine", "build",
                                                  "gguf", "gguf_ftype", "server_args") if k in info)
        pc = info.get("policy_cycle_ms")
        if pc:  # what the cost policy believed a cycle costs when verifying n proposals
            det += (", " if det else "") + "cost-policy cycle ms at n=" + "/".join(
                str(n) for n in (0, 1, 2, 4, 8, len(pc) - 1) if n < len(pc)) + ": " + "/".join(
                f"{pc[n]:.0f}" for n in (0, 1, 2, 4, 8, len(pc) - 1) if n < len(pc))
        who = info.get("drafter") or "–"
        extra = ", ".join(x for x in (f"{info['drafter_steps']} training steps" if info.get("drafter_steps") else "",
                                      f"sha256 {info['drafter_sha256']}" if info.get("drafter_sha256") else "") if x)
        L.append(f"| {m} | {who}{f' ({extra})' if extra else ''} | {info.get('block_size', '–')} | {det or '–'} |")
    if summary.get("skipped_prompts"):
        L += ["", f"Skipped prompts: {len(summary['skipped_prompts'])} "
                  f"({'; '.join(s['id'] + ': ' + s['reason'] for s in summary['skipped_prompts'][:5])})"]
    res = summary["results"]
    keys = list(dict.fromkeys((g["concurrency"], g["setting"], g["workload"]) for g in res))
    L += _glance(res)
    for c, s, w in keys:
        gs = [g for g in res if (g["concurrency"], g["setting"], g["workload"]) == (c, s, w)]
        L += ["", f"## {w} ({gs[0]['workload_version']}), {s}, concurrency {c}", "",
              "| mode | n | out tok | TTFT s | tok/s | e2e s | speedup tok/s vs ar (min–max) | e2e speedup "
              "| tau mean / pooled | verif. len | greedy ids = ar | peak MB | failed | check |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for g in gs:
            same = g.get("greedy_matches_ar_count")
            peak = g["peak_memory_bytes_max"]
            L.append(f"| {g['mode']} | {g['n']} | {g['output_tokens_mean']:.0f} | {_f(g['ttft_s_median'], '{:.3f}')} "
                     f"| {_f(g['tokens_per_second_median'])} | {_f(g['e2e_s_median'])} | {_sp(g['speedup'])} "
                     f"| {_sp(g['e2e_speedup'])} | {_f(g['tau_mean'])} / {_f(g['tau_pooled'])} "
                     f"| {_f(g['verification_length_mean'], '{:.1f}')} | {f'{same[0]}/{same[1]}' if same else '–'} "
                     f"| {_f(peak / 2**20 if peak else None, '{:.0f}')} "
                     f"| {g['failures']} ({g['timeouts']} timeouts) | {_check_cell(g)} |")
    src_rows = [(g, k, a) for g in res for k, a in sorted((g.get("sources") or {}).items()) if k != "none"]
    if src_rows:
        L += ["", "## Proposals per source", "",
              "Each cycle's proposals come from one source, chosen from the context before anything is drawn: "
              "`draft` (the drafter), `ngram` (a copy of the request's own earlier text).", "",
              "| concurrency | setting | workload | mode | source | cycles | share | proposed | accepted "
              "| accepted / proposed | tau |", "|---|---|---|---|---|---|---|---|---|---|---|"]
        for g, k, a in src_rows:
            tot = sum(x["cycles"] for x in g["sources"].values()) or 1
            L.append(f"| {g['concurrency']} | {g['setting']} | {g['workload']} | {g['mode']} | {k} | {a['cycles']} "
                     f"| {a['cycles'] / tot:.0%} | {a['proposed']} | {a['accepted']} "
                     f"| {_f(a['accepted'] / a['proposed'] if a['proposed'] else None)} | {_f(a['tau'])} |")
    L += ["", "## Cost model (s per output token after prefill)", "",
          "C = draft + final stage + verification per cycle, S = prefill stall per cycle (concurrency > 1: "
          "the request's decoding waited while other requests were prefilled; prefill is not chunked), "
          "O = overhead per cycle (warm-up), "
          f"tau pooled; flagged when model and measurement differ by more than {100 * COST_MODEL_TOLERANCE:.0f}%.", "",
          "| concurrency | setting | workload | mode | measured | C/tau | S/tau | O/tau | model (C+S+O)/tau | error "
          "| split ms/cycle |",
          "|---|---|---|---|---|---|---|---|---|---|---|"]
    for g in res:
        cm = g["cost_model"]
        split = " / ".join(f"{k} {1000 * v:.1f}" for k, v in (g.get("cycle_split_s") or {}).items())
        flag = " **FLAG**" if cm.get("flag") else ""
        L.append(f"| {g['concurrency']} | {g['setting']} | {g['workload']} | {g['mode']} "
                 f"| {_f(cm.get('measured_s_per_token'), '{:.4f}')} | {_f(cm.get('cost_before_overhead_s_per_token'), '{:.4f}')} "
                 f"| {_f(cm.get('stall_s_per_token'), '{:.4f}')} "
                 f"| {_f(cm.get('overhead_s_per_token'), '{:.4f}')} | {_f(cm.get('model_s_per_token'), '{:.4f}')} "
                 f"| {_f(cm.get('error'), '{:+.1%}')}{flag} | {split or '–'} |")
    if plots:
        L += ["", "## Plots", ""] + [f"![{p}]({p})" for p in plots]
    if summary.get("notes"):
        L += ["", "## Notes", ""] + [f"- {n}" for n in summary["notes"]]
    L.append("")
    return "\n".join(L)


def write_report(summary: dict, out_dir: str | Path, plots: bool = True) -> None:
    """Write ``summary.json``, the PNG plots and ``report.md`` into ``out_dir``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    files = make_plots(summary, out) if plots else []
    (out / "summary.json").write_text(json.dumps(summary, indent=1, default=str) + "\n", encoding="utf-8")
    (out / "report.md").write_text(render_markdown(summary, files), encoding="utf-8")


def load_rows(path: str | Path) -> list[dict]:
    """Rows of a ``results.jsonl`` file (or of the one inside a directory)."""
    p = Path(path)
    if p.is_dir():
        p = p / "results.jsonl"
    return [json.loads(l) for l in p.read_text(encoding="utf-8").splitlines() if l.strip()]
