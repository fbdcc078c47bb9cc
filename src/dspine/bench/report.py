"""Summary, cost model, Markdown report and plots of a benchmark run.

Cost model (spec section 10): per mode, the measured time per output token after
prefill (sum of decode time / tokens after the first emission) is compared with

    model = (C + S + O) / tau,   C = (draft + final stage + verification time) per cycle,
                             tau = tokens emitted per cycle (pooled over cycles),
                             S = prefill stall per cycle (concurrency > 1: time a
                                 request's decoding waited for other requests' prefills),
                             O = overhead per cycle measured on the mode's last warm-up
                                 (run alone, so also used at concurrency > 1)

reported side by side with ``C / tau`` (the cost before scheduling overhead) and
flagged when model and measurement differ by more than 10%. For the transformers
modes the split is not observable: C is the mean interval between streamer puts
(overhead included) and O = 0.
"""
from __future__ import annotations

import json
import math
import statistics
from pathlib import Path

from dspine.bench.fairness import check_rows_fair

COST_MODEL_TOLERANCE = 0.10
PEER = "hf-pld"  # the external peer a user would pick instead (transformers prompt lookup)
LLAMA_PEER = "llama-cpp"  # llama.cpp's plain decoding (optional mode: dspine.bench.llama_cpp)


def _median(xs):
    xs = [x for x in xs if x is not None and not (isinstance(x, float) and math.isnan(x))]
    return statistics.median(xs) if xs else None


def _spread(xs: list[float]) -> dict | None:
    xs = [x for x in xs if x is not None and x > 0 and math.isfinite(x)]
    if not xs:
        return None
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "n": len(xs),
            "geomean": math.exp(sum(math.log(x) for x in xs) / len(xs))}


def _first_tokens(r: dict) -> int:
    return int(r.get("first_cycle_tokens", 1) or 1)


def _overheads(warm: list[dict]) -> dict:
    """(concurrency, setting, mode) -> overhead per cycle from the last warm-up run."""
    out = {}
    for r in warm:
        if r.get("split_measured") and r.get("cycles"):
            out[(r["concurrency"], r["setting"], r["mode"])] = r["overhead_s"] / r["cycles"]
    return out


def _ratios(ok: list[dict], ref_rows: dict) -> tuple[list[float], list[float], list[bool]]:
    """Per request of ``ok``, against the row of the same (prompt, repeat) in ``ref_rows``:
    output tok/s ratio, end-to-end time ratio (ref / this), greedy ids equal."""
    sp, e2e, match = [], [], []
    for r in ok:
        a = ref_rows.get((r["prompt_id"], r["repeat"]))
        if a is None or a.get("failed"):
            continue
        if r.get("tokens_per_second") and a.get("tokens_per_second"):
            sp.append(r["tokens_per_second"] / a["tokens_per_second"])
        if r.get("e2e_s") and a.get("e2e_s"):
            e2e.append(a["e2e_s"] / r["e2e_s"])
        if r["setting"] == "greedy":
            match.append(r["output_ids"] == a["output_ids"])
    return sp, e2e, match


def _group_stats(rows: list[dict], ar_rows: dict, overhead: float | None,
                 peer_rows: dict | None = None, llama_rows: dict | None = None) -> dict:
    ok = [r for r in rows if not r.get("failed")]
    g: dict = {"n": len(rows), "failures": sum(1 for r in rows if r.get("failed")),
               "timeouts": sum(1 for r in rows if r.get("finish_reason") == "timeout"),
               "errors": sum(1 for r in rows if r.get("finish_reason") == "error")}
    g["mode_info"] = rows[0].get("mode_info", {})
    g["block_size"] = g["mode_info"].get("block_size")
    g["output_tokens_mean"] = statistics.mean(r["output_tokens"] for r in rows) if rows else 0
    g["ttft_s_median"] = _median([r.get("ttft_s") for r in ok])
    g["tokens_per_second_median"] = _median([r.get("tokens_per_second") for r in ok])
    g["e2e_s_median"] = _median([r.get("e2e_s") for r in ok])
    g["peak_memory_bytes_max"] = max((r.get("peak_memory_bytes") or 0 for r in rows), default=0)
    g["peak_memory_kind"] = rows[0].get("peak_memory_kind")
    # speedup over ar (and over the prompt-lookup peer) on the same request (prompt, repeat)
    sp, e2e, match = _ratios(ok, ar_rows)
    g["speedup"] = _spread(sp)
    g["e2e_speedup"] = _spread(e2e)
    g["speedup_vs_peer"] = _spread(_ratios(ok, peer_rows or {})[0])
    g["speedup_vs_llama_cpp"] = _spread(_ratios(ok, llama_rows or {})[0])
    g["greedy_matches_ar"] = (sum(match) / len(match)) if match else None
    g["greedy_matches_ar_count"] = [sum(match), len(match)] if match else None
    # acceptance
    cyc = sum(r.get("cycles") or 0 for r in ok)
    emitted = sum(r.get("emitted_sum") or 0 for r in ok)
    taus = [r["tau"] for r in ok if r.get("cycles")]
    g["cycles"] = cyc
    g["tau_mean"] = statistics.mean(taus) if taus else None
    g["tau_pooled"] = emitted / cyc if cyc else None
    L = max((len(r.get("drafted_counts") or []) for r in ok), default=0)
    dr = [sum((r.get("drafted_counts") or [])[k] for r in ok if len(r.get("drafted_counts") or []) > k) for k in range(L)]
    ac = [sum((r.get("accepted_counts") or [])[k] for r in ok if len(r.get("accepted_counts") or []) > k) for k in range(L)]
    g["acceptance_per_position"] = [a / d if d else None for a, d in zip(ac, dr)]
    srcs: dict = {}
    for r in ok:  # proposals and acceptance per proposer source (hybrid: draft vs ngram)
        for k, d in (r.get("sources") or {}).items():
            a = srcs.setdefault(k, {"cycles": 0, "proposed": 0, "accepted": 0, "emitted": 0})
            for f in a:
                a[f] += d.get(f, 0)
    for a in srcs.values():
        a["tau"] = a["emitted"] / a["cycles"] if a["cycles"] else None
    g["sources"] = srcs
    vl = [n for r in ok for n in (r.get("verification_lengths") or [])]
    g["verification_length_mean"] = statistics.mean(vl) if vl else None
    tn = [n for r in ok for n in (r.get("tree_nodes") or [])]
    g["tree_nodes_mean"] = statistics.mean(tn) if tn else None  # None: every cycle verified a chain
    # cycle split and cost model
    split = all(r.get("split_measured") for r in ok) and bool(ok)
    dec = sum(r.get("decode_s") or 0 for r in ok)
    toks = sum(max(0, r["output_tokens"] - _first_tokens(r)) for r in ok)
    cm: dict = {"measured_s_per_token": dec / toks if toks else None, "split_measured": split}
    if cyc:
        if split:
            d = sum(r["draft_s"] for r in ok) / cyc
            f = sum(r["final_stage_s"] for r in ok) / cyc
            v = sum(r["verify_s"] for r in ok) / cyc
            S = sum(r.get("prefill_stall_s") or 0.0 for r in ok) / cyc
            o_run = sum(r["overhead_s"] for r in ok) / cyc - S
            g["cycle_split_s"] = {"draft": d, "final_stage": f, "verify": v, "overhead": o_run}
            if any("prefill_stall_s" in r for r in ok):
                g["cycle_split_s"]["prefill_stall"] = S
            C = d + f + v
            O = overhead if overhead is not None else 0.0
        else:
            C = sum(r.get("cycle_s") or 0 for r in ok) / cyc
            g["cycle_split_s"] = {"cycle_unsplit": C}
            S = O = 0.0
        tau = g["tau_pooled"]
        cm.update(cycle_cost_s=C, prefill_stall_per_cycle_s=S, overhead_per_cycle_s=O, tau=tau,
                  cost_before_overhead_s_per_token=C / tau, stall_s_per_token=S / tau,
                  overhead_s_per_token=O / tau, model_s_per_token=(C + S + O) / tau)
        if cm["measured_s_per_token"]:
            err = cm["model_s_per_token"] / cm["measured_s_per_token"] - 1
            cm["error"] = err
            cm["flag"] = abs(err) > COST_MODEL_TOLERANCE
    g["cost_model"] = cm
    # workload checks
    checks = [r.get("check") for r in rows if r.get("check")]
    if checks:
        counts: dict = {}
        for c in checks:
            counts[c] = counts.get(c, 0) + 1
        g["check_counts"] = counts
        wl = rows[0]["workload"]
        if wl == "code":
            passed = counts.get("passed", 0)
            g["pass_at_1"] = passed / len(rows)
            g["e2e_s_per_correct_task"] = (sum(r.get("e2e_s") or 0 for r in rows) / passed) if passed else None
        elif wl == "tools":
            g["valid_call_rate"] = counts.get("valid", 0) / len(rows)
            g["tool_failures"] = len(rows) - counts.get("valid", 0)
        elif wl == "convert":
            g["equal_rate"] = counts.get("equal", 0) / len(rows)
        elif wl == "multifile":
            checked = sum(v for k, v in counts.items() if k != "unchecked")
            g["answer_rate"] = counts.get("correct", 0) / checked if checked else None
    return g


def summarize(rows: list[dict], cfg: dict | None = None, skipped: list | None = None,
              drafters: dict | None = None) -> dict:
    """Aggregate result rows (after :func:`check_rows_fair`) into the summary dict."""
    check_rows_fair(rows)
    rec = [r for r in rows if not r.get("warmup")]
    warm = [r for r in rows if r.get("warmup")]
    ovh = _overheads(warm)
    groups: dict[tuple, list[dict]] = {}
    for r in rec:
        groups.setdefault((r["concurrency"], r["setting"], r["workload"], r["mode"]), []).append(r)
    results = []
    for (c, s, w, m), rs in groups.items():
        ar = {(r["prompt_id"], r["repeat"]): r for r in groups.get((c, s, w, "ar"), [])}
        peer = {(r["prompt_id"], r["repeat"]): r for r in groups.get((c, s, w, PEER), [])}
        llama = {(r["prompt_id"], r["repeat"]): r for r in groups.get((c, s, w, LLAMA_PEER), [])}
        # warm-ups run alone (concurrency 1): their per-cycle overhead is O at every concurrency
        o = ovh.get((c, s, m), ovh.get((1, s, m)))
        g = _group_stats(rs, ar if m != "ar" else {}, o, peer if m != PEER else {},
                         llama if m != LLAMA_PEER else {})
        if m == "ar":
            g["speedup"] = g["e2e_speedup"] = None
        if m == PEER:
            g["speedup_vs_peer"] = None
        if m == LLAMA_PEER:
            g["speedup_vs_llama_cpp"] = None
        g.update(concurrency=c, setting=s, workload=w, mode=m, workload_version=rs[0]["workload_version"])
        if c > 1 and "phase_wall_s" in rs[0]:
            g["throughput_tokens_per_s"] = sum(r["output_tokens"] for r in rs) / rs[0]["phase_wall_s"]
        results.append(g)
    modes = list(dict.fromkeys(r["mode"] for r in rows))
    order = {m: i for i, m in enumerate(modes)}
    wls = {w: i for i, w in enumerate(dict.fromkeys(r["workload"] for r in rec))}
    sets = {s: i for i, s in enumerate(dict.fromkeys(r["setting"] for r in rec))}
    results.sort(key=lambda g: (g["concurrency"], sets[g["setting"]], wls[g["workload"]], order[g["mode"]]))
    notes = []
    if drafters and any(v == "random" for v in drafters.values()):
        notes.append("Untrained (random) drafters: speculative speed and acceptance numbers only "
                     "exercise the harness; they say nothing about DSpine vs DFlash.")
    cards = {m: r.get("mode_info", {}).get("card") for m, r in ((r["mode"], r) for r in rec)
             if r.get("mode_info", {}).get("card")}
    if len(cards) == 2:
        keys = ("data", "steps", "tokens", "train_data", "train_steps")
        a, b = cards.get("dspine", {}), cards.get("dflash", {})
        diff = [k for k in keys if k in a and k in b and a[k] != b[k]]
        if diff:
            notes.append(f"The dspine and dflash drafters were trained differently ({', '.join(diff)}); "
                         f"spec s.10 compares them only after equal data, steps and compute.")
    peers = [m for m in modes if m in ("hf", "hf-pld", "llama-cpp", "llama-cpp-lookup")]
    if cfg and any(c > 1 for c in cfg.get("concurrency", [1])) and peers:
        notes.append(f"{', '.join(peers)}: measured at concurrency 1 only (transformers' generate and "
                     f"llama.cpp's one server slot serve one sequence at a time).")
    for g in results:
        if g["cost_model"].get("flag"):
            notes.append(f"Cost model off by {100 * g['cost_model']['error']:+.0f}% for {g['mode']} on "
                         f"{g['workload']} ({g['setting']}, concurrency {g['concurrency']}).")
        ext = (g.get("mode_info") or {}).get("engine")
        if g.get("greedy_matches_ar") is not None and g["greedy_matches_ar"] < 1:
            why = (f"{ext} computes with its own kernels on a {g['mode_info'].get('gguf_ftype')} GGUF: the same "
                   f"model, other rounding" if ext else "float reduction order or a bug")
            notes.append(f"{g['mode']} on {g['workload']}: {100 * (1 - g['greedy_matches_ar']):.0f}% of greedy "
                         f"outputs differ from ar ({why}).")
    ext_modes = [m for m in modes if any((r.get("mode_info") or {}).get("engine") for r in rec if r["mode"] == m)]
    if ext_modes:
        notes.append(f"{', '.join(ext_modes)}: an external engine's server process; its prefill and decode times "
                     f"are the server's own timings, end-to-end time the client's (HTTP included); its memory "
                     f"is not sampled (peak MB –). Measured at concurrency 1.")
    first = rec[0] if rec else (rows[0] if rows else {})
    return {"format": "dspine-bench-summary/1", "run_id": first.get("run_id"), "env": first.get("env"),
            "setup": first.get("setup"), "config": cfg, "drafters": drafters, "modes": modes,
            "mode_info": {r["mode"]: r.get("mode_info") for r in rec},
            "skipped_prompts": skipped or [], "results": results, "notes": notes,
            "requests": len(rec), "warmup_requests": len(warm)}


# -- rendering ----------------------------------------------------------------------------------
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


def make_plots(summary: dict, out_dir: Path) -> list[str]:
    """speedup.png, acceptance.png (concurrency 1), cycle_split.png (a bar per mode and
    concurrency); returns file names."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    res = [g for g in summary["results"] if g["concurrency"] == 1]
    if not res:
        return []
    settings = list(dict.fromkeys(g["setting"] for g in res))
    workloads = list(dict.fromkeys(g["workload"] for g in res))
    modes = [m for m in summary["modes"] if m != "ar"]
    files = []
    # 1. speedup per workload and mode
    fig, axes = plt.subplots(1, len(settings), figsize=(max(6, 1.6 * len(workloads)) * len(settings), 4), squeeze=False)
    for ax, s in zip(axes[0], settings):
        width = 0.8 / max(1, len(modes))
        for i, m in enumerate(modes):
            xs, ys, lo, hi = [], [], [], []
            for j, w in enumerate(workloads):
                g = next((g for g in res if (g["setting"], g["workload"], g["mode"]) == (s, w, m)), None)
                if g and g.get("speedup"):
                    sp = g["speedup"]
                    xs.append(j + (i - (len(modes) - 1) / 2) * width)
                    ys.append(sp["median"])
                    lo.append(sp["median"] - sp["min"])
                    hi.append(sp["max"] - sp["median"])
            if xs:
                ax.bar(xs, ys, width, yerr=[lo, hi], capsize=3, label=m)
        ax.axhline(1.0, color="k", lw=0.8, ls="--")
        ax.set_xticks(range(len(workloads)), workloads)
        ax.set_ylabel("speedup over ar (tok/s, median, min–max)")
        ax.set_title(f"speedup ({s})")
        if ax.get_legend_handles_labels()[0]:  # a run without `ar` has no speedup bars
            ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out_dir / "speedup.png", dpi=100)
    plt.close(fig)
    files.append("speedup.png")
    # 2. per-position acceptance (pooled over workloads)
    fig, ax = plt.subplots(figsize=(6, 4))
    drew = False
    for s in settings:
        for m in modes:
            gs = [g for g in res if g["setting"] == s and g["mode"] == m and g.get("acceptance_per_position")]
            if not gs:
                continue
            L = max(len(g["acceptance_per_position"]) for g in gs)
            ys = []
            for k in range(L):
                vals = [g["acceptance_per_position"][k] for g in gs
                        if len(g["acceptance_per_position"]) > k and g["acceptance_per_position"][k] is not None]
                ys.append(statistics.mean(vals) if vals else float("nan"))
            ax.plot(range(1, L + 1), ys, marker="o", label=f"{m} ({s})")
            drew = True
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("draft position k")
    ax.set_ylabel("P(position k accepted | drafted)")
    ax.set_ylim(-0.03, 1.05)
    ax.set_title("per-position acceptance (mean over workloads)")
    if drew:
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out_dir / "acceptance.png", dpi=100)
    plt.close(fig)
    files.append("acceptance.png")
    # 3. cycle-time split per output token (mean over workloads, first setting; one bar
    #    per mode and concurrency)
    res = summary["results"]
    concs = sorted({g["concurrency"] for g in res})
    bars = [(m, c) for c in concs for m in summary["modes"]]
    fig, ax = plt.subplots(figsize=(max(5, 1.2 * len(bars)), 4))
    parts = ["draft", "final_stage", "verify", "prefill_stall", "overhead", "cycle_unsplit"]
    colors = dict(zip(parts, ["#4c72b0", "#dd8452", "#55a868", "#937860", "#8c8c8c", "#c44e52"]))
    s0 = settings[0]
    for i, (m, conc) in enumerate(bars):
        gs = [g for g in res if g["setting"] == s0 and g["mode"] == m and g["concurrency"] == conc
              and g.get("cycle_split_s") and g.get("tau_pooled")]
        if not gs:
            continue
        bottom = 0.0
        for p in parts:
            vals = [1000 * g["cycle_split_s"][p] / g["tau_pooled"] for g in gs if p in g["cycle_split_s"]]
            if not vals:
                continue
            v = statistics.mean(vals)
            ax.bar(i, v, bottom=bottom, color=colors[p], label=p)
            bottom += v
    ax.set_xticks(range(len(bars)), [m if len(concs) == 1 else f"{m}\nc={c}" for m, c in bars])
    ax.set_ylabel("ms per output token (cycle time / tau)")
    ax.set_title(f"cycle-time split ({s0}, mean over workloads)")
    handles, labels = ax.get_legend_handles_labels()
    uniq = dict(zip(labels, handles))
    ax.legend(uniq.values(), uniq.keys(), fontsize=8)
    fig.tight_layout()
    fig.savefig(out_dir / "cycle_split.png", dpi=100)
    plt.close(fig)
    files.append("cycle_split.png")
    return files


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
