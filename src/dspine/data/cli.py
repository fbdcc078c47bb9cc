"""Command line of ``dspine data build|text|pack|vocab|head|info`` (the dataset code is in :mod:`.build`,
:mod:`.store` and :mod:`.load`)."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from dspine.argtypes import nonneg_int, positive_float, positive_int, thread_count
from dspine.data.build import build_dataset, parse_shard
from dspine.data.store import MANIFEST, _data_dir, head_dataset, pack_dataset, read_manifest, verify_packed


def _add_build_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", default="smollm2-135m", help="target name or path (default smollm2-135m)")
    p.add_argument("--prompts", nargs="+", required=True, metavar="SOURCE",
                   help="sharegpt, stdlib or JSONL paths (interleaved)")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--max-prompts", type=positive_int, default=None,
                   help="stop after N prompts (default: every prompt of the sources)")
    p.add_argument("--max-new-tokens", type=positive_int, default=256)
    p.add_argument("--batch-size", type=positive_int, default=None,
                   help="prompts generated together (default: 32 with --generator hf, 8 with engine)")
    p.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32", "float16"],
                   help="target dtype while generating; auto: float32 (the dtype dspine decodes the "
                        "target in, so the rows are its greedy answers), or the dtype of the rows "
                        "already in --out when resuming; bfloat16 is faster on some CPUs but changes "
                        "greedy answers")
    p.add_argument("--max-prompt-tokens", type=positive_int, default=384)
    p.add_argument("--threads", type=thread_count, default=None, help="torch CPU threads (default: one per core, less the cores other processes keep busy when it starts (measured for 0.3 s; OMP_NUM_THREADS also chooses))")
    p.add_argument("--resume", action="store_true", help="continue a directory, skipping done ids")
    p.add_argument("--shard", default="0/1",
                   help="k/N: build only prompts i %% N == k of the stream (N processes, N --out dirs)")
    p.add_argument("--device", default="cpu", help="cpu | cuda | cuda:N | auto (default: cpu)")
    p.add_argument("--time-limit", type=positive_float, default=None, metavar="SECONDS",
                   help="start no new batch after this many seconds (the run stays resumable)")
    p.add_argument("--generator", choices=["hf", "engine"], default="hf",
                   help="hf: transformers' forward in left-padded batches (default; the committed data's); "
                        "engine: dspine's own measured runtime, batched as `dspine serve` runs it (the lean "
                        "path, ~2x faster); --resume may switch generator once the new one reproduces the directory's last 8 rows")
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(func=_cmd_build)


def _cmd_build(args) -> int:
    from dspine.tune.threads import choose_threads

    if args.device in ("cpu", "auto"):  # a thread per core only where the other processes leave them free
        args.threads = choose_threads(args.threads or 0, progress=not args.no_progress)
    man = build_dataset(args.target, args.prompts, args.out, max_prompts=args.max_prompts,
                        max_new_tokens=args.max_new_tokens,
                        batch_size=args.batch_size or (8 if args.generator == "engine" else 32),
                        dtype=args.dtype, resume=args.resume, threads=args.threads,
                        max_prompt_tokens=args.max_prompt_tokens, shard=parse_shard(args.shard),
                        progress=not args.no_progress, device=args.device, time_limit=args.time_limit,
                        generator=args.generator)
    print(json.dumps({"out": str(args.out), "counts": man["counts"], "complete": man["complete"]}))
    return 0


def _cmd_pack(args) -> int:
    man = pack_dataset(args.dir)
    print(json.dumps({"dir": str(args.dir), "shards": man["shards"], "packed_bytes": man.get("packed_bytes"),
                      "counts": man.get("counts")}))
    return 0


def _cmd_head(args) -> int:
    man = head_dataset(args.dir, args.shards, args.out)
    print(json.dumps({"out": str(args.out), "shards": man["shards"], "counts": man["counts"]}))
    return 0


def _cmd_info(args) -> int:
    man = read_manifest(_data_dir(args.dir))
    if man is None:
        raise ValueError(f"{args.dir} has no {MANIFEST}: not a dspine data directory")
    verify_packed(args.dir, man)  # packed shards as committed (sha256), or a clear error
    print(json.dumps({k: man.get(k) for k in ("target", "counts", "complete", "sources", "sampling",
                                              "updated", "shards", "packed_bytes", "runs")}, indent=1))
    return 0


def _cmd_vocab(args) -> int:
    """Write a drafter checkpoint's ``draft_vocab.json`` from regenerated training data."""
    from dspine.drafter.checkpoint import DrafterError, check_fits_target
    from dspine.config import DSpineConfig
    from dspine.drafter.vocab import coverage, frequent_tokens, save_draft_vocab
    from dspine.target.adapter import load_target
    from dspine.data.load import load_dataset

    ck = Path(args.drafter)
    if not (ck / "config.json").is_file():
        raise DrafterError(f"--drafter {args.drafter}: no config.json (expected a drafter checkpoint directory)")
    cfg = DSpineConfig.load(ck)
    target = load_target(args.target)
    check_fits_target(cfg, target, where=f"--drafter {args.drafter}")
    if not cfg.head_topk <= args.size:
        raise ValueError(f"--size {args.size} is below the final stage's {cfg.head_topk} candidates per row")
    seqs = [(s.input_ids, s.response_start) for d in args.data for s in load_dataset(d, target)]
    ids = frequent_tokens(seqs, args.size, cfg.vocab_size)
    cov = coverage(ids, seqs)
    f = save_draft_vocab(ck, ids, {"source": f"dspine data vocab --size {args.size}: the most frequent response "
                                             f"tokens of {', '.join(str(d) for d in args.data)}",
                                   "rows": len(seqs), "coverage_of_training_responses": round(cov, 4)})
    print(json.dumps({"out": str(f), "size": int(ids.numel()), "rows": len(seqs), "coverage": round(cov, 4)}))
    return 0


def add_data_parser(subparsers) -> argparse.ArgumentParser:
    """Register ``dspine data build|info`` on an argparse subparsers object (sets ``func``)."""
    p = subparsers.add_parser("data", help="build and inspect drafter training data")
    sub = p.add_subparsers(dest="data_cmd", required=True)
    _add_build_args(sub.add_parser("build", help="regenerate target responses for prompt sources"))
    from dspine.data.text import add_text_args, cmd_text

    text = sub.add_parser("text", help="teacher-forcing sequences from existing text (fast, EAGLE-style)")
    add_text_args(text)
    text.set_defaults(func=cmd_text)
    pack_help = ("gzip a data directory's shards in place, sha256 in the manifest "
                 "(to commit them; build --resume appends new shards afterwards)")
    pack = sub.add_parser("pack", help=pack_help, description=pack_help[0].upper() + pack_help[1:] + ".")
    pack.add_argument("dir", help="a `dspine data build` directory (with manifest.json)")
    pack.set_defaults(func=_cmd_pack)
    vocab = sub.add_parser("vocab", help="write a drafter's draft vocabulary (draft_vocab.json: the most "
                                         "frequent response tokens of training data; --draft-vocab)")
    vocab.add_argument("--data", nargs="+", required=True, help="`dspine data build` directories (training data only)")
    vocab.add_argument("--drafter", required=True, help="checkpoint directory to write draft_vocab.json into")
    vocab.add_argument("--size", type=positive_int, default=8192, help="ids to keep (default: 8192, as "
                                                                       "`dspine train --vocab-subset`)")
    vocab.add_argument("--target", default="smollm2-135m")
    vocab.set_defaults(func=_cmd_vocab)
    head_help = ("copy the first N packed shards into a new data directory (a prefix of the rows: a "
                 "training run on it continues on the whole directory with --resume / --continue-from)")
    head = sub.add_parser("head", help=head_help, description=head_help[0].upper() + head_help[1:] + ".")
    head.add_argument("dir", help="a packed `dspine data build` directory")
    head.add_argument("--shards", type=positive_int, required=True, help="packed shards to copy, from the first")
    head.add_argument("--out", required=True, help="new directory (must not exist or be empty)")
    head.set_defaults(func=_cmd_head)
    info = sub.add_parser("info", help="print a data directory's manifest summary")
    info.add_argument("dir")
    info.set_defaults(func=_cmd_info)
    return p


def main(argv: list[str] | None = None) -> int:
    """``python -m dspine.data ...``: same options as ``dspine data build``."""
    p = argparse.ArgumentParser(prog="python -m dspine.data", description="dspine data build: responses regenerated by the target itself")
    _add_build_args(p)
    args = p.parse_args(argv)
    try:
        return args.func(args)
    except ValueError as e:
        from dspine.cli.main import flag_message

        print(f"error: {flag_message(e, 'data')}", file=sys.stderr)
        return 2
