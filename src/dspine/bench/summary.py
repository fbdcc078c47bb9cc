"""The summary of a benchmark run: per-group statistics, speedups and the cost model.

:func:`summarize` aggregates result rows (``results.jsonl``) into the summary dict that
:mod:`dspine.bench.report` renders and :mod:`dspine.bench.plots` draws.

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

import math
import statistics

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
