"""The benchmark protocol (spec section 10): one config, one target, every mode.

All modes of a run share one :class:`~dspine.bench.run_config.BenchConfig` (target, dtype,
device, threads, context length, decoding settings, prompts) and one loaded target
object; the runners then report what they actually use and
:func:`~dspine.bench.fairness.check_fair` refuses the run when any of it differs across
modes (:class:`~dspine.bench.fairness.UnfairComparisonError`).
:func:`~dspine.bench.fairness.check_rows_fair` applies the same rule to result rows (so a
summary is never built over mixed runs). Every row records the host
(:func:`dspine.bench.environment.environment`).

Protocol per concurrency level and decoding setting: every mode is warmed on the same
short prompt (``warmup`` times; the last warm-up calibrates the per-cycle overhead of
the cost model), then each prompt x repeat runs every mode back to back, the mode
order rotated per request so slow drift of a shared host does not favour one mode.
Sampled settings use seed ``seed + repeat`` for every mode.
"""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch

from dspine.bench.environment import environment, git_dirty
from dspine.bench.fairness import BenchError, UnfairComparisonError, _prompt_hash, check_fair
from dspine.bench.llama_cpp import LLAMA_MODES, LlamaCppRunner
from dspine.bench.modes import ENGINE_MODES
from dspine.bench.run_config import BenchConfig, DecodeSetting, parse_modes, require_batched_engine, resolve_drafters
from dspine.bench.runners import make_runner
from dspine.bench.prompts import build_prompts, warmup_prompt
from dspine.bench.workloads import parse_workloads, workload_version


def _sandbox_check(prompt, text: str, cfg: BenchConfig) -> dict:
    from dspine.bench.checks import check_convert, check_edit, check_multifile, check_tool_call, run_humaneval

    if prompt.workload == "code":
        m = prompt.meta
        r = run_humaneval(m["prompt"], text, m["test"], m["entry_point"], cfg.code_timeout_s)
        return {"check": r["result"], "check_error": r["error"]}
    if prompt.workload == "tools":
        r = check_tool_call(text, prompt.meta["functions"])
        return {"check": r["result"], "check_error": r["error"], "calls": r["calls"]}
    if prompt.workload == "multifile":
        return {"check": check_multifile(text, prompt.meta)["result"], "check_error": None}
    if prompt.workload == "edit":
        r = check_edit(text, prompt.meta, cfg.code_timeout_s)
        return {"check": r["result"], "check_error": r["error"]}
    if prompt.workload == "convert":
        r = check_convert(text, prompt.meta)
        return {"check": r["result"], "check_error": r["error"]}
    return {}


def progress_notes() -> bool:
    """One-time measurement notes on stderr (off under pytest's capture, harmless anyway)."""
    return True


class Harness:
    """Loads the target once, builds every mode's runner over it, checks fairness,
    runs the protocol and writes rows (see module docstring)."""

    def __init__(self, cfg: BenchConfig, target=None):
        from dspine.target.adapter import load_target

        self.cfg = cfg
        parse_modes(list(cfg.modes))
        parse_workloads(list(cfg.workloads))
        for c in cfg.concurrency:
            require_batched_engine(c)
        if cfg.repeats < 1 or cfg.warmup < 0:
            raise BenchError(f"--repeats must be >= 1 and --warmup >= 0 (got {cfg.repeats}, {cfg.warmup})")
        if not cfg.settings:
            raise BenchError("--settings: give at least one decoding setting")
        from dspine.guards import validate_runtime

        # the same guards as generate/serve, before anything is loaded (GuardError names the setting)
        validate_runtime(None, None, dtype=cfg.dtype, device=cfg.device, concurrency=max(cfg.concurrency),
                         verify_policy=cfg.verify_policy)
        from dspine.proposers import PROPOSERS

        if cfg.proposer not in PROPOSERS:
            raise BenchError(f"--proposer {cfg.proposer!r} is unknown; accepted: {', '.join(PROPOSERS)}")
        if cfg.proposer == "ngram" and {"dflash", "dspine"} & set(cfg.modes):
            raise BenchError("--proposer ngram with --modes dflash/dspine: copies alone are the `ngram` mode; "
                             "use --modes ngram (or --proposer hybrid / drafter for the drafter modes)")
        if cfg.threads:
            torch.set_num_threads(int(cfg.threads))
        self.drafters = resolve_drafters(cfg)
        if target is not None and (target.name != cfg.target
                                   or str(target.dtype).replace("torch.", "") != cfg.dtype):
            raise UnfairComparisonError(f"the preloaded target ({target.name}, {target.dtype}) is not the "
                                        f"configured one ({cfg.target}, {cfg.dtype})")
        from dspine.runtime.packed import LINEAR_BACKENDS, apply_linear_backend

        if cfg.linear_backend not in ("auto", *LINEAR_BACKENDS):
            raise BenchError(f"--linear-backend {cfg.linear_backend!r} is unknown; accepted: auto, "
                             f"{', '.join(LINEAR_BACKENDS)}")
        from dspine.runtime.select import RUNTIMES, apply_runtime

        if cfg.runtime not in ("auto", *RUNTIMES):
            raise BenchError(f"--runtime {cfg.runtime!r} is unknown; accepted: auto, {', '.join(RUNTIMES)}")
        self.target = target if target is not None else load_target(cfg.target, dtype=cfg.dtype, device=cfg.device)
        if target is None or cfg.runtime != "auto":  # one forward for every mode (a fair run)
            try:
                apply_runtime(self.target, cfg.runtime)
            except ValueError as e:
                raise BenchError(str(e)) from None
        if target is None or cfg.linear_backend != "auto":  # one backend for every mode (a fair run)
            apply_linear_backend(self.target, cfg.linear_backend, progress=progress_notes())
        from dspine.trees.tree import TreeSpec, parse_tree_shape

        try:
            tree = TreeSpec(cfg.tree_budget, parse_tree_shape(cfg.tree_shape), size=cfg.tree_size)
        except ValueError as e:
            raise BenchError(str(e)) from None
        peers = [m for m in cfg.modes if m not in ENGINE_MODES]
        if peers and 1 not in cfg.concurrency:
            raise BenchError(f"--modes {','.join(peers)} run at concurrency 1 only (one sequence at a time); "
                             f"add 1 to --concurrency {','.join(map(str, cfg.concurrency))} or drop them")
        if (cfg.llama_cpp or cfg.gguf) and not set(LLAMA_MODES) & set(cfg.modes):
            raise BenchError(f"--llama-cpp / --gguf are for --modes {' / '.join(LLAMA_MODES)}, which this run "
                             f"does not measure ({', '.join(cfg.modes)})")
        self.runners = {}
        try:
            for m in cfg.modes:
                if m in LLAMA_MODES:
                    self.runners[m] = LlamaCppRunner(self.target, m, cfg.llama_cpp, cfg.gguf,
                                                     threads=torch.get_num_threads(), ctx=cfg.context_tokens)
                else:
                    self.runners[m] = make_runner(self.target, m, self.drafters, cfg.block_size, cfg.seed,
                                                  cfg.pld_tokens, cfg.verify_policy, cfg.proposer, tree=tree,
                                                  drafter_linears=cfg.drafter_linears,
                                                  draft_vocab=cfg.draft_vocab, head_kernel=cfg.head_kernel)
            self.check_setup()
        except BaseException:
            self.close()
            raise
        self.env = environment(self.target, cfg)
        self.prompts, self.skipped = build_prompts(self.target, list(cfg.workloads), cfg.limit,
                                                   cfg.context_tokens, cfg.max_new_tokens)
        if not self.prompts:
            raise BenchError("no prompt fits: raise --context-tokens or lower --max-new-tokens")
        self.warm = warmup_prompt(self.target, cfg.warmup_tokens)

    def close(self) -> None:
        """Stop what runners started outside this process (llama.cpp's server)."""
        for r in getattr(self, "runners", {}).values():
            if hasattr(r, "close"):
                r.close()

    def check_setup(self) -> None:
        """Refuse the run unless every runner uses the same target/dtype/device/threads and
        applies the same decoding settings for each configured setting."""
        check_fair({m: r.identity() for m, r in self.runners.items()}, "setup")
        for s in self.cfg.settings:
            check_fair({m: r.decoding(s.sampling(self.cfg.seed), 16, ["\n#"]) for m, r in self.runners.items()},
                       f"decoding setting {s.name!r}")

    def _order(self, k: int) -> list[str]:
        modes = list(self.cfg.modes)
        r = k % len(modes)
        return modes[r:] + modes[:r]

    def _row(self, mode: str, prompt, setting: DecodeSetting, repeat: int, seed: int, concurrency: int,
             res: dict, warmup: bool = False) -> dict:
        runner = self.runners[mode]
        row = {
            "run_id": self.run_id, "mode": mode, "workload": prompt.workload,
            "workload_version": workload_version(prompt.workload) if prompt.workload != "warmup" else "warmup",
            "prompt_id": prompt.id, "prompt_hash": _prompt_hash(prompt.prompt_ids), "repeat": repeat,
            "setting": setting.name, "seed": seed, "concurrency": concurrency, "warmup": warmup,
            "decoding": runner.decoding(setting.sampling(seed), prompt.max_new_tokens, prompt.stop),
            "setup": runner.identity(), "mode_info": runner.info(),
            "context_tokens": self.cfg.context_tokens,
        }
        row.update(res)
        row["failed"] = res["finish_reason"] in ("timeout", "error")
        if not warmup:
            row.update(_sandbox_check(prompt, res.get("text", ""), self.cfg))
        row["env"] = self.env
        return row

    def _run_one(self, mode: str, prompt, setting: DecodeSetting, seed: int) -> dict:
        try:
            return self.runners[mode].run(prompt.prompt_ids, setting.sampling(seed), prompt.max_new_tokens,
                                          prompt.stop, self.cfg.request_timeout_s)
        except (RuntimeError, MemoryError) as e:  # a crashed request is a failure, not a crash
            return {"output_ids": [], "text": "", "finish_reason": "error", "error": f"{type(e).__name__}: {e}",
                    "prompt_tokens": len(prompt.prompt_ids), "output_tokens": 0}

    def run(self, out_dir: str | Path, progress: bool = True) -> list[dict]:
        """Run the protocol, appending rows to ``out_dir/results.jsonl``; returns the rows."""
        from tqdm.auto import tqdm

        cfg = self.cfg
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        self.env["git_dirty"] = git_dirty(exclude=out)  # the results this run replaces do not count
        self.run_id = time.strftime("%Y%m%dT%H%M%S") + f"-{os.getpid()}"
        rows: list[dict] = []
        n_req = len(self.prompts) * cfg.repeats * len(cfg.settings)
        total = 0
        for c in cfg.concurrency:
            modes_c = [m for m in cfg.modes if c == 1 or m in ENGINE_MODES]
            total += (len(modes_c) * cfg.warmup if c == 1 else 0) * len(cfg.settings) + n_req * len(modes_c)
        bar = tqdm(total=total, desc="dspine bench", unit="req", disable=not progress, dynamic_ncols=True,
                   mininterval=0.5 if sys.stderr.isatty() else 10.0)
        with open(out / "results.jsonl", "w", encoding="utf-8") as f:
            def emit(row: dict) -> None:
                rows.append(row)
                f.write(json.dumps(row, default=str) + "\n")
                f.flush()

            for c in cfg.concurrency:
                for setting in cfg.settings:
                    if c == 1:
                        for mode in cfg.modes:
                            for w in range(cfg.warmup):
                                bar.set_postfix_str(f"warm-up {mode}")
                                res = self._run_one(mode, self.warm, setting, cfg.seed)
                                emit(self._row(mode, self.warm, setting, w, cfg.seed, c, res, warmup=True))
                                bar.update(1)
                        k = 0
                        for p in self.prompts:
                            for rep in range(cfg.repeats):
                                for mode in self._order(k):
                                    bar.set_postfix_str(f"{setting.name} {p.workload} {mode}")
                                    seed = cfg.seed + rep
                                    emit(self._row(mode, p, setting, rep, seed, c,
                                                   self._run_one(mode, p, setting, seed)))
                                    bar.update(1)
                                k += 1
                    else:
                        self._run_concurrent(c, setting, emit, bar)
        bar.close()
        return rows

    def _run_concurrent(self, c: int, setting: DecodeSetting, emit, bar) -> None:
        from dspine.core.batch import BatchEngine

        for mode in self.cfg.modes:
            if mode not in ENGINE_MODES:
                continue  # the peers (transformers' generate, llama.cpp's one slot) run at concurrency 1 only
            runner = self.runners[mode]
            for wl in self.cfg.workloads:
                items = [(p, rep) for p in self.prompts if p.workload == wl for rep in range(self.cfg.repeats)]
                if not items:
                    continue
                be = BatchEngine(runner.engine, max_running=c)
                t0 = time.perf_counter()
                rows = runner.concurrent(be, items, lambda rep: setting.sampling(self.cfg.seed + rep),
                                         self.cfg.request_timeout_s)
                wall = time.perf_counter() - t0
                for (p, rep), res in zip(items, rows):
                    row = self._row(mode, p, setting, rep, self.cfg.seed + rep, c, res)
                    row["phase_wall_s"] = wall
                    emit(row)
                    bar.update(1)


# files a run writes into --out (plots only without --no-plots)
RESULT_FILES = ("results.jsonl", "summary.json", "report.md", "speedup.png", "acceptance.png",
                "cycle_split.png", "headline.md", "headline.json", "headline.png")


def run_bench(cfg: BenchConfig, out_dir: str | Path, progress: bool = True, plots: bool = True,
              target=None, overwrite: bool = False) -> dict:
    """Run the benchmark and write ``results.jsonl``, ``summary.json``, ``report.md`` and
    the plots into ``out_dir``. Returns the summary.

    Raises:
        BenchError: ``out_dir`` is a file, or holds an earlier run's files
            (:data:`RESULT_FILES`) and ``overwrite`` is False (checked before any model is
            loaded; nothing is written). With ``overwrite`` those files are removed first.
    """
    from dspine.bench.report import write_report
    from dspine.bench.summary import summarize

    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise BenchError(f"--out {out_dir} is a file, not a directory")
    prev = [out / f for f in RESULT_FILES if (out / f).exists()]
    if prev and not overwrite:
        raise BenchError(f"--out {out_dir} already holds the results of an earlier run "
                         f"({', '.join(p.name for p in prev)}); pass --overwrite to replace them "
                         f"or choose another --out")
    t0 = time.perf_counter()
    h = Harness(cfg, target=target)  # every setting is checked before the earlier run's files go
    for p in prev:  # --overwrite: no file of the earlier run survives beside the new ones
        p.unlink()
    try:
        rows = h.run(out_dir, progress=progress)
    finally:
        h.close()
    summary = summarize(rows, cfg=cfg.to_dict(), skipped=h.skipped, drafters=h.drafters)
    summary["wall_s"] = round(time.perf_counter() - t0, 2)
    write_report(summary, out_dir, plots=plots)
    return summary


__all__ = ["Harness", "RESULT_FILES", "run_bench"]
