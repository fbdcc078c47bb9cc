"""``dspine bench``: compare ar, dflash, dspine, hf and hf-pld (and llama.cpp) under one setup (spec s.10).

The README's results table on this machine (4-12 minutes on 2 cores, by CPU; writes headline.md,
headline.json and headline.png beside the bench's files)::

    dspine bench --headline

Smoke (CI; under 3 minutes on 2 cores)::

    dspine bench --smoke --out benchmarks/smoke --overwrite

Full run (documented command; hours on a 2-core CPU, minutes on a GPU)::

    dspine bench --out benchmarks/full --modes all --workloads all \\
        --settings greedy,sampled --repeats 3 --warmup 2 \\
        [--drafter-dspine PATH --drafter-dflash PATH] [--dtype bfloat16 --device cuda]

With llama.cpp beside (a build of ``llama-server``; the GGUF defaults to the target's own)::

    dspine bench --modes ar,dspine,llama-cpp,llama-cpp-lookup --llama-cpp LLAMA_CPP_DIR \\
        [--gguf smollm2-f16.gguf] --out benchmarks/llama-cpp

Writes ``results.jsonl`` (one row per request, environment included), ``summary.json``,
``report.md`` and ``speedup.png``, ``acceptance.png``, ``cycle_split.png``.
"""
from __future__ import annotations

import argparse
import json
import sys

from dspine.argtypes import DEFAULT_TREE_BUDGET, DEFAULT_TREE_SIZE, PROPOSER_NAMES, TREE_SIZES, nonneg_int, positive_int, seed_int, thread_count, tree_budget, tree_shape
from dspine.bench.fairness import BenchError
from dspine.bench.harness import run_bench
from dspine.bench.run_config import GREEDY, SAMPLED, BenchConfig, DecodeSetting, parse_modes, smoke_config
from dspine.bench.workloads import parse_workloads


def _settings(args) -> tuple[DecodeSetting, ...]:
    out = []
    for name in [s.strip() for s in args.settings.split(",") if s.strip()]:
        if name == "greedy":
            out.append(GREEDY)
        elif name == "sampled":
            out.append(DecodeSetting("sampled", args.temperature, args.top_k, args.top_p, args.min_p))
        else:
            raise BenchError(f"--settings {name!r}: unknown; accepted: greedy, sampled")
    if not out:
        raise BenchError("--settings: give greedy, sampled or both")
    return tuple(out)


def _concurrency(spec: str) -> tuple[int, ...]:
    try:
        vals = tuple(int(x) for x in spec.split(",") if x.strip())
    except ValueError:
        raise BenchError(f"--concurrency {spec!r}: expected integers like 1 or 1,4") from None
    if not vals:
        raise BenchError("--concurrency: give at least one level")
    return vals


def config_from_args(args) -> BenchConfig:
    """The single :class:`BenchConfig` every mode of the run shares."""
    drafters = {}
    for mode in ("dspine", "dflash"):
        d = getattr(args, f"drafter_{mode}") or args.drafter
        if d is not None:
            drafters[mode] = d
    given = {k: v for k, v in dict(
        target=args.target, dtype=args.dtype, device=args.device, threads=args.threads,
        modes=parse_modes(args.modes) if args.modes else None, drafters=drafters or None,
        block_size=args.block_size, pld_tokens=args.pld_tokens, verify_policy=args.verify_policy,
        linear_backend=args.linear_backend, runtime=args.runtime, proposer=args.proposer,
        tree_budget=args.tree_budget, tree_shape=args.tree_shape, tree_size=args.tree_size,
        drafter_linears=args.drafter_linears, draft_vocab=args.draft_vocab, head_kernel=args.head_kernel,
        workloads=tuple(parse_workloads(args.workloads)) if args.workloads else None,
        limit=args.limit, max_new_tokens=args.max_new_tokens, context_tokens=args.context_tokens,
        settings=_settings(args) if args.settings else None, repeats=args.repeats, warmup=args.warmup,
        seed=args.seed, request_timeout_s=args.request_timeout, code_timeout_s=args.code_timeout,
        concurrency=_concurrency(args.concurrency) if args.concurrency else None,
        llama_cpp=args.llama_cpp, gguf=args.gguf).items() if v is not None}
    if args.smoke and args.headline:
        raise BenchError("--smoke and --headline: choose one preset")
    if args.headline:
        from dspine.bench.headline import headline_config

        return headline_config(**given)
    return smoke_config(**given) if args.smoke else BenchConfig(**given)


def default_out(args) -> str:
    """``--out`` when not given: benchmarks/smoke, benchmarks/headline/<isa>-<date> or benchmarks/run."""
    if args.smoke:
        return "benchmarks/smoke"
    if args.headline:
        import datetime

        from dspine.tune.machine import isa_class

        isa = isa_class().split("+")[0].lower().replace("-", "")
        return f"benchmarks/headline/{isa}-{datetime.date.today().isoformat()}"
    return "benchmarks/run"


def cmd_bench(args) -> int:
    cfg = config_from_args(args)
    out = args.out or default_out(args)
    summary = run_bench(cfg, out, progress=not args.no_progress, plots=not args.no_plots,
                        overwrite=args.overwrite)
    if args.headline:
        from dspine.bench.headline import render, write_headline

        doc = write_headline(summary, out, plots=not args.no_plots)
        print(render(doc["table"], doc["stamp"], doc["modes"]), file=sys.stderr)
    brief = [{k: g.get(k) for k in ("workload", "setting", "mode", "n", "failures")}
             | {"speedup_median": (g.get("speedup") or {}).get("median"), "tau_pooled": g.get("tau_pooled"),
                "tokens_per_second": g.get("tokens_per_second_median")}
             for g in summary["results"]]
    print(json.dumps({"out": str(out), "wall_s": summary.get("wall_s"), "requests": summary["requests"],
                      "results": brief, "notes": summary["notes"]}, default=str))
    failed = sum(int(g.get("failures") or 0) for g in summary["results"])
    if failed:  # errors / timeouts are in the report; the exit status says so too
        print(f"dspine bench: {failed} request(s) failed (error or timeout); see {out}/report.md",
              file=sys.stderr)
        return 1
    return 0


def add_bench_parser(subparsers) -> argparse.ArgumentParser:
    """Register ``dspine bench`` (sets ``func``). Exit status: 0, 1 when any request
    failed (error or timeout; counted in the report), 2 for bad settings."""
    p = subparsers.add_parser("bench", help="benchmark every mode under one setup (spec s.10)",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--headline", action="store_true",
                   help="the README's results table on this machine: held-out code, chat and code-edit prompts; "
                        "ar, the defaults, copies alone, the drafter alone, HF prompt lookup (and llama.cpp when "
                        "found); writes headline.md/.json/.png (4-12 min on 2 cores, by CPU)")
    p.add_argument("--smoke", action="store_true",
                   help="tiny run: 1 prompt per workload, 16 new tokens, greedy, ar+dspine+dflash+hf-pld")
    p.add_argument("--out", default=None, help="output directory (default benchmarks/smoke, "
                                                "benchmarks/headline/<isa>-<date> or benchmarks/run)")
    p.add_argument("--overwrite", action="store_true",
                   help="replace the results of an earlier run in --out (refused without it)")
    p.add_argument("--target", default=None, help="target name or path (default smollm2-135m)")
    p.add_argument("--dtype", default=None, help="float32 (default) | bfloat16, for every mode (others are refused by the guards)")
    p.add_argument("--device", default=None, help="cpu (default) | cuda")
    p.add_argument("--threads", type=thread_count, default=None, help="torch CPU threads (default: torch's own, every core; smoke 1)")
    p.add_argument("--modes", default=None,
                   help="comma list of ar,dflash,dspine,ngram,dspine-drafter,hf,hf-pld,llama-cpp,llama-cpp-lookup or all "
                        "(default all: every mode but the llama.cpp peers, which need a llama.cpp build); ngram is "
                        "dspine's own prompt lookup (copies, no drafter); dspine-drafter the DSpine drafter alone "
                        "(single chain, whole blocks verified, whatever --proposer / --verify-policy say)")
    p.add_argument("--llama-cpp", default=None, metavar="PATH",
                   help="llama-server binary or a llama.cpp tree with build/bin/llama-server, for --modes "
                        "llama-cpp / llama-cpp-lookup (default $DSPINE_LLAMA_CPP)")
    p.add_argument("--gguf", default=None, metavar="PATH",
                   help="the GGUF of the target llama.cpp serves (default: the target's own source GGUF, e.g. "
                        "SmolLM2's Q4_1 file; `dspine export --format target-gguf --dtype float16|float32` writes others)")
    p.add_argument("--proposer", default=None, choices=list(PROPOSER_NAMES),
                   help="what dflash/dspine propose with: hybrid (default, as generate and serve: copies where "
                        "the context repeats, the drafter elsewhere) | drafter (the drafter alone) | ngram")
    p.add_argument("--drafter", default=None, help="drafter for both speculative modes: 'random' or a directory")
    p.add_argument("--drafter-dspine", default=None, help="dspine checkpoint dir or 'random' (default: shipped)")
    p.add_argument("--drafter-dflash", default=None, help="dflash checkpoint dir or 'random' (default: shipped)")
    p.add_argument("--verify-policy", default=None, choices=["fixed", "cost"],
                   help="verification-length policy of dflash/dspine (default cost, as generate and serve)")
    from dspine.cli.main import add_target_runtime_args

    add_target_runtime_args(p, default=None, every_mode=True)
    p.add_argument("--tree-budget", type=tree_budget, default=None, metavar="N",
                   help=f"dspine verifies a draft tree of up to N nodes per cycle (default {DEFAULT_TREE_BUDGET}, as "
                        "generate; 0 = a chain; DSpine drafters on the dense runtime)")
    p.add_argument("--tree-shape", type=tree_shape, default=None, metavar="{dynamic,W1,W2,...}",
                   help="dynamic (default) | widths per depth, e.g. 4,2,1")
    p.add_argument("--tree-size", choices=list(TREE_SIZES), default=None,
                   help=f"fixed | cost: the verified prefix of best-first trees chosen per cycle "
                        f"(default {DEFAULT_TREE_SIZE}, as generate)")
    from dspine.cli.main import add_drafter_kernel_args

    add_drafter_kernel_args(p, default=None)  # default: BenchConfig's, as generate ("auto")
    p.add_argument("--block-size", type=int, default=None, help="block size of random drafters (default 16); a checkpoint runs at its own")
    p.add_argument("--pld-tokens", type=positive_int, default=None, help="hf-pld prompt_lookup_num_tokens (default 10)")
    p.add_argument("--workloads", default=None, help="comma list of short,long,code,multifile,tools,edit,convert,stdlib,sharegpt or all (default all)")
    p.add_argument("--limit", type=positive_int, default=None, help="at most N prompts per workload (default: all; smoke 1)")
    p.add_argument("--max-new-tokens", type=positive_int, default=None, help="override every workload's output budget (default: each workload's own; smoke 16)")
    p.add_argument("--context-tokens", type=positive_int, default=None, help="prompt + output budget (default 2048; smoke 512)")
    p.add_argument("--settings", default=None, help="greedy,sampled (default both; smoke greedy)")
    p.add_argument("--temperature", type=float, default=SAMPLED.temperature)
    p.add_argument("--top-k", type=int, default=SAMPLED.top_k)
    p.add_argument("--top-p", type=float, default=SAMPLED.top_p)
    p.add_argument("--min-p", type=float, default=SAMPLED.min_p)
    p.add_argument("--repeats", type=positive_int, default=None, help="repeats per prompt (default 3; smoke 1)")
    p.add_argument("--warmup", type=nonneg_int, default=None, help="warm-up runs per mode and setting (default 1)")
    p.add_argument("--seed", type=seed_int, default=None, help="seed of the sampled settings and of random drafters; repeat r uses seed + r (default 0)")
    p.add_argument("--request-timeout", type=float, default=None, help="seconds per request (default 600; smoke 300)")
    p.add_argument("--code-timeout", type=float, default=None, help="seconds per HumanEval test run (default 10)")
    p.add_argument("--concurrency", default=None,
                   help="levels like 1 or 1,4 (default 1; above 1 needs the batched engine dspine.core.batch)")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--no-plots", action="store_true")
    p.set_defaults(func=cmd_bench)
    return p


def main(argv: list[str] | None = None) -> int:
    """``python -m dspine.bench.cli ...``: same options as ``dspine bench``."""
    parser = argparse.ArgumentParser(prog="dspine")
    add_bench_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["bench", *(sys.argv[1:] if argv is None else argv)])
    try:
        return args.func(args)
    except ValueError as e:
        from dspine.cli.main import flag_message

        print(f"dspine bench: error: {flag_message(e, 'bench')}".splitlines()[0], file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
