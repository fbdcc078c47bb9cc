"""``dspine bench --headline``: the README's results table, reproduced on this machine.

One run of the bench protocol (:mod:`dspine.bench.harness`: one process, one loaded
target, every mode warmed, the mode order rotated per request, greedy ids compared with
``ar``) over three held-out workloads that were never used for training or tuning:

* ``stdlib``: code continuation (held-out Python stdlib modules), raw completion;
* ``sharegpt``: open chat (held-out ShareGPT first turns), chat template;
* ``edit``: a copy-heavy code edit (HumanEval functions to return with type hints);

8 prompts each, 128 new tokens, 2 repeats, and these modes:

===================  ====================================================================
``ar``               the plain target loop (one token per forward)
``dspine``           the defaults of ``dspine generate``: copies + the DSpine drafter, cost policy, trees
``ngram``            copies alone (``--proposer ngram``)
``dspine-drafter``   the DSpine drafter alone: single chain, the whole block verified each cycle
``hf-pld``           transformers' ``generate(prompt_lookup_num_tokens=10)`` on the same weights
``llama-cpp``        llama.cpp's ``llama-server`` on the target's GGUF, when a build is found
                     (``--llama-cpp PATH`` or ``$DSPINE_LLAMA_CPP``)
===================  ====================================================================

Writes, beside the bench's own files (``results.jsonl``, ``summary.json``, ``report.md``,
plots): ``headline.md`` (the table with its stamp: CPU model and instruction-set class,
threads, load average before and after, torch, commit, date and the command),
``headline.json`` (the same numbers) and ``headline.png``. About 4-12 minutes on 2 cores (4.3 on a Zen 5 class EPYC, 2026-12-06)
once the first run's measurements are cached (the first run adds 2-4 minutes).
"""
from __future__ import annotations

import datetime as _dt
import json
import os
import shutil
from pathlib import Path

from dspine.bench.run_config import GREEDY, BenchConfig

HEADLINE_WORKLOADS = ("stdlib", "sharegpt", "edit")
HEADLINE_MODES = ("ar", "dspine", "ngram", "dspine-drafter", "hf-pld")
#: what each mode is called in the table
MODE_LABELS = {"ar": "`ar`", "dspine": "defaults", "ngram": "copies alone", "dspine-drafter": "drafter alone",
               "hf-pld": "HF prompt lookup", "llama-cpp": "llama.cpp"}
WORKLOAD_LABELS = {"stdlib": "code (held-out stdlib)", "sharegpt": "chat (held-out ShareGPT)",
                   "edit": "code edit (HumanEval, copy-heavy)"}
HEADLINE_COMMAND = "dspine bench --headline"


def find_llama_cpp(spec: str | None = None) -> str | None:
    """A llama.cpp build for the ``llama-cpp`` column: ``spec`` (``--llama-cpp``) or
    ``$DSPINE_LLAMA_CPP`` (either must hold a usable ``llama-server``: BenchError names it
    otherwise), else a ``llama-server`` on PATH; None when there is none (the column is
    then left out and the table says so)."""
    from dspine.bench.fairness import BenchError
    from dspine.bench.llama_cpp import find_llama_server

    if spec:
        return str(find_llama_server(spec))
    env = os.environ.get("DSPINE_LLAMA_CPP")
    if env:
        try:
            return str(find_llama_server(env))
        except BenchError as e:
            raise BenchError(f"DSPINE_LLAMA_CPP={env}: {str(e).split(': ', 1)[-1]}") from None
    return shutil.which("llama-server")


def headline_config(llama_cpp: str | None = None, **overrides) -> BenchConfig:
    """The headline run's :class:`BenchConfig` (module docstring); ``overrides`` replace
    fields (tests shrink it: ``limit``, ``max_new_tokens``, ``repeats``). A llama.cpp build
    is looked for only when the run's modes include ``llama-cpp`` (the default modes do
    when one is found).

    Raises:
        BenchError: modes without ``ar`` (every column is a ratio to it), settings without
            greedy, or a concurrency without 1 (the table is greedy, one request at a time).
    """
    from dspine.bench.fairness import BenchError

    if "modes" in overrides:
        server = find_llama_cpp(llama_cpp) if "llama-cpp" in overrides["modes"] else llama_cpp
    else:
        server = find_llama_cpp(llama_cpp)
        overrides["modes"] = HEADLINE_MODES + (("llama-cpp",) if server else ())
    if "ar" not in overrides["modes"]:
        raise BenchError(f"--headline --modes {','.join(overrides['modes'])}: the table gives every mode's ratio "
                         f"to ar; include ar")
    if GREEDY not in overrides.get("settings", (GREEDY,)):
        raise BenchError("--headline: the table is greedy (same ids checked against ar); include --settings greedy")
    if 1 not in overrides.get("concurrency", (1,)):
        raise BenchError("--headline: the table is measured one request at a time; include --concurrency 1")
    base = dict(workloads=HEADLINE_WORKLOADS, limit=8, max_new_tokens=128, settings=(GREEDY,),
                repeats=2, warmup=1, llama_cpp=server)
    base.update(overrides)
    return BenchConfig(**base)


def preset_changes(cfg: dict) -> dict:
    """The settings a run changed from the headline preset (named in the table's stamp)."""
    keys = ("target", "dtype", "device", "modes", "drafters", "workloads", "limit", "max_new_tokens",
            "repeats", "warmup", "proposer", "verify_policy", "tree_budget", "linear_backend", "runtime",
            "drafter_linears", "draft_vocab", "head_kernel", "context_tokens")
    preset = BenchConfig(workloads=HEADLINE_WORKLOADS, limit=8, max_new_tokens=128, settings=(GREEDY,),
                         repeats=2, warmup=1).to_dict()
    out = {}
    for k in keys:
        if k not in cfg:
            continue
        v, p = cfg[k], preset.get(k)
        if k == "modes":
            p = list(HEADLINE_MODES) + (["llama-cpp"] if "llama-cpp" in v else [])
        norm = lambda x: list(x) if isinstance(x, tuple) else x  # noqa: E731
        if norm(v) != norm(p):
            out[k] = v
    return out


def _cell(g: dict | None) -> dict | None:
    if g is None:
        return None
    sp = g.get("speedup") or {}
    src = g.get("sources") or {}
    acc = {k: v.get("accepted", 0) for k, v in src.items()}
    total = sum(acc.values())
    return {"tokens_per_second": g.get("tokens_per_second_median"), "vs_ar_median": sp.get("median"),
            "vs_ar_min": sp.get("min"), "vs_ar_max": sp.get("max"), "tau": g.get("tau_pooled"),
            "same_ids": g.get("greedy_matches_ar_count"), "n": g.get("n"), "failures": g.get("failures"),
            "drafter_share_of_accepted": (acc.get("draft", 0) / total) if total else None}


def headline_table(summary: dict) -> dict:
    """``{workload: {mode: cell}}`` from a bench summary (greedy, concurrency 1): per mode
    the median tokens/s, the median and range of the per-request ratio to ``ar`` (same
    prompt and repeat), τ (tokens per cycle, pooled), greedy ids equal to ``ar`` (count,
    total) and, for the defaults, the drafter's share of the accepted proposals."""
    out: dict = {}
    for g in summary["results"]:
        if g.get("concurrency", 1) != 1 or g.get("setting") != "greedy":
            continue
        out.setdefault(g["workload"], {})[g["mode"]] = _cell(g)
    return out


def stamp(summary: dict, load_end: float | None, date: str | None = None) -> dict:
    """Where and when the table was measured (the machine line every committed figure carries)."""
    env = summary.get("env") or {}
    commit = (env.get("git_commit") or "")[:7] or None
    return {"cpu": env.get("cpu"), "isa": env.get("isa"), "threads": env.get("torch_threads"),
            "cores": env.get("cpu_count"), "load_avg_1m_start": env.get("load_avg_1m"),
            "others_cores_at_start": env.get("others_cores_at_start"),
            "load_avg_1m_end": load_end, "torch": env.get("torch"), "commit": commit,
            "dirty": env.get("git_dirty"), "date": date or _dt.date.today().isoformat(),
            "command": HEADLINE_COMMAND, "changed_from_preset": preset_changes(summary.get("config") or {}),
            "wall_s": summary.get("wall_s")}


def _x(v, fmt="{:.2f}x") -> str:
    return "–" if v is None else fmt.format(v)


def render(table: dict, st: dict, modes: list[str]) -> str:
    """The Markdown table (ratios to ``ar``, median per request) with its stamp."""
    peers = [m for m in modes if m != "ar"]
    head = ["text", "`ar` tok/s"] + [MODE_LABELS.get(m, m) for m in peers] + ["τ defaults / drafter alone",
                                                                               "drafter's share", "same ids"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for w, cells in table.items():
        ar = cells.get("ar") or {}
        row = [WORKLOAD_LABELS.get(w, w), _x(ar.get("tokens_per_second"), "{:.1f}")]
        for m in peers:
            c = cells.get(m)
            row.append("–" if c is None else (f"**{_x(c['vs_ar_median'])}**" if m == "dspine" else _x(c["vs_ar_median"])))
        d, a = cells.get("dspine") or {}, cells.get("dspine-drafter") or {}
        row.append(f"{_x(d.get('tau'), '{:.2f}')} / {_x(a.get('tau'), '{:.2f}')}")
        row.append(_x(d.get("drafter_share_of_accepted"), "{:.0%}"))
        same = [c["same_ids"] for m, c in cells.items() if m != "ar" and c and c.get("same_ids")
                and not m.startswith("llama")]
        row.append(f"{sum(s[0] for s in same)}/{sum(s[1] for s in same)}" if same else "–")
        lines.append("| " + " | ".join(row) + " |")
    load = f"load average {st['load_avg_1m_start']:.2f} -> {st['load_avg_1m_end']:.2f}" if (
        st.get("load_avg_1m_start") is not None and st.get("load_avg_1m_end") is not None) else "load average unknown"
    others = st.get("others_cores_at_start")
    if isinstance(others, (int, float)):
        load += (f", other processes ~{others:.1f} cores busy at start"
                 + (" (**measured under load**: not comparable to a quiet run)" if others > 0.5 else ""))
    lines += ["", f"Machine: {st['cpu']} ({st['isa']}), {st['threads']} thread{'s' if st['threads'] != 1 else ''} of {st['cores']} cores, {load}; "
                  f"torch {st['torch']}; commit {st['commit']}{' (with local changes)' if st.get('dirty') else ''}, "
                  f"{st['date']}; `{st['command']}` ({st['wall_s']:.0f} s)"
                  + (f", changed from the preset: {', '.join(f'{k}={v}' for k, v in st['changed_from_preset'].items())}"
                     if st.get("changed_from_preset") else "") + ".",
              "Columns after `ar` tok/s: tokens/s of each mode over `ar`'s on the same request, median over "
              "prompts x repeats; τ: tokens per cycle; drafter's share: the share of the defaults' accepted "
              "proposals that the drafter (not a copy) proposed; same ids: greedy outputs equal to `ar`'s "
              "(every dspine mode and HF prompt lookup)."]
    if "llama-cpp" not in modes:
        lines.append("llama.cpp: not installed here (give `--llama-cpp PATH` or set `DSPINE_LLAMA_CPP` to a "
                     "`llama-server` build to add its column).")
    return "\n".join(lines) + "\n"


def plot(table: dict, modes: list[str], path: Path, title: str | None = None) -> None:
    """Grouped bars: each mode's median ratio to ``ar`` per workload (``title``: the machine)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    peers = [m for m in modes if m != "ar"]
    fig, ax = plt.subplots(figsize=(8, 3.6))
    width = 0.8 / max(1, len(peers))
    for i, m in enumerate(peers):
        ys = [((table[w].get(m) or {}).get("vs_ar_median") or 0.0) for w in table]
        ax.bar([k + i * width for k in range(len(table))], ys, width, label=MODE_LABELS.get(m, m))
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_xticks([k + 0.4 - width / 2 for k in range(len(table))])
    ax.set_xticklabels([WORKLOAD_LABELS.get(w, w) for w in table], fontsize=8)
    ax.set_ylabel("tokens/s over ar (median)")
    ax.legend(fontsize=7, ncol=3)
    if title:
        ax.set_title(title, fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_headline(summary: dict, out_dir: str | Path, plots: bool = True) -> dict:
    """Write ``headline.md`` / ``headline.json`` (and ``headline.png``) into ``out_dir``;
    returns the JSON document."""
    out = Path(out_dir)
    modes = list(summary.get("modes") or [])
    table = headline_table(summary)
    st = stamp(summary, os.getloadavg()[0] if hasattr(os, "getloadavg") else None)
    doc = {"format": "dspine-headline/1", "stamp": st, "modes": modes, "table": table}
    (out / "headline.json").write_text(json.dumps(doc, indent=1) + "\n", encoding="utf-8")
    (out / "headline.md").write_text(render(table, st, modes), encoding="utf-8")
    if plots:
        plot(table, modes, out / "headline.png",
             title=f"{st['cpu']} ({st['isa']}), {st['threads']} threads, commit {st['commit']}, {st['date']}")
    return doc
