"""``dspine train``, ``dspine train-features`` and ``dspine acceptance`` commands.

``dspine train --target T --data DIR --config small|PATH --mode dspine|dflash --out DIR``
trains a drafter (see :mod:`dspine.train.loop`), then exports ``DIR/final`` with a
model card (:mod:`dspine.train.card`). ``dspine acceptance --drafter DIR --sets code chat``
measures held-out acceptance length tau with the real engine loop, greedy, float32 by
default (:mod:`dspine.train.acceptance`).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from dspine.argtypes import _int, PROPOSER_NAMES, add_tree_args, nonneg_float, nonneg_int, positive_float, positive_int, seed_int, unit_float, thread_count
from dspine.config import MAX_BLOCK_SIZE
from dspine.train.acceptance import measure_acceptance
from dspine.train.card import _data_summary, _hardware, _warm_start_fields, write_model_card


def _block_size(text: str) -> int:
    """argparse type of ``--block-size``: checked before the target loads."""
    v = _int(text)
    if not 2 <= v <= MAX_BLOCK_SIZE:
        raise argparse.ArgumentTypeError(f"must be 2..{MAX_BLOCK_SIZE} (the anchor and at least one "
                                         f"proposal), got {v}")
    return v


def _drafter_config(args, target):
    from dspine.config import DSpineConfig, dflash_flags, engine_compatible_flags

    compat = getattr(args, "engine_compatible", False)
    if compat and args.mode != "dflash":
        raise ValueError("--engine-compatible makes a DFlash-style drafter in the z-lab format that vLLM "
                         "and llama.cpp run; it needs --mode dflash (a DSpine drafter's bridge and final "
                         "stage have no counterpart there)")
    extra = engine_compatible_flags() if compat else {}
    if args.config in ("small", "release"):
        return DSpineConfig.for_target(target, profile=args.config, mode=args.mode,
                                       block_size=args.block_size, **extra)
    cfg = DSpineConfig.load(args.config)
    d = json.loads(cfg.to_json())
    d.update(dflash_flags() if args.mode == "dflash" else {"bridge": True, "final_stage": True,
                                                             "block_causal": True, "mode": "dspine"})
    d.update(extra)
    return DSpineConfig.from_dict(d)


def cmd_train(args) -> int:
    from dspine.drafter.checkpoint import save_drafter
    from dspine.target.adapter import load_target
    from dspine.guards import resolve_device
    from dspine.train.loop import TrainConfig, Trainer, init_distributed

    if args.engine_compatible and args.mode != "dflash":  # before loading anything
        _drafter_config(args, None)
    if args.continue_from is not None:
        from dspine.train.portable import read_state

        if args.init_from:
            raise ValueError("--continue-from continues an exported run (its weights and schedule); --init-from "
                             "starts a new one from a drafter's weights: give one of the two")
        if not str(args.continue_from).strip():
            raise ValueError("--continue-from '' names no directory")
        if not Path(args.continue_from).is_dir():
            raise ValueError(f"--continue-from {args.continue_from}: no such directory")
        resumable = args.resume and (Path(args.out) / "ckpt" / "trainer.pt").exists()
        if not resumable:
            read_state(args.continue_from)  # a missing or damaged state, before the target loads
    elif args.rebuild_moments is not None:
        raise ValueError("--rebuild-moments applies to --continue-from only (it rebuilds the optimizer "
                         "state of a continued run)")
    if args.row1_weight is not None and not args.row1_anchors:
        raise ValueError("--row1-weight applies to the dense row-1 term only: add --row1-anchors N (e.g. 96) "
                         "or drop --row1-weight")
    if args.row1_anchors and args.mode != "dspine":
        raise ValueError(f"--row1-anchors trains two-row blocks, which a --mode {args.mode} drafter (bidirectional "
                         f"block) cannot run: use --mode dspine or leave it out")
    if args.soft_weight is not None and not args.soft_labels:
        raise ValueError("--soft-weight applies to soft labels only: add --soft-labels K (e.g. 8) or drop --soft-weight")
    device = resolve_device(args.device)
    rank, world = init_distributed(device)
    if world == 1 and device.type == "cpu":  # one process: leave out the cores others keep busy
        from dspine.tune.threads import choose_threads

        choose_threads(args.threads)
    elif args.threads:
        torch.set_num_threads(args.threads)
    out = Path(args.out)
    if not args.resume and ((out / "ckpt").exists() or (out / "final").exists()):
        raise ValueError(f"--out {out} already holds a training run; pass --resume to continue it "
                         f"or choose a new --out")
    target = load_target(args.target, dtype="float32", device=str(device))
    seqs = _training_seqs(args.data, target, args.max_len)
    cfg = _drafter_config(args, target)
    if args.feature_dtype == "auto":  # a feature store holds bfloat16 features
        from dspine.tune.dtype import resolve_dtype

        args.feature_dtype = "bfloat16" if args.feature_store else resolve_dtype(
            "auto", target, args.batch_size, min(args.max_len, 128), False, progress=rank == 0)
        if rank == 0:
            print(f"--feature-dtype auto -> {args.feature_dtype}", file=sys.stderr, flush=True)
    tc = TrainConfig(steps=args.steps, batch_size=args.batch_size, anchors_per_seq=args.anchors,
                     max_len=args.max_len, lr=args.lr, min_lr_ratio=args.min_lr_ratio, warmup=args.warmup,
                     lr_schedule=args.lr_schedule,
                     seed=args.seed, save_every=args.save_every,
                     eval_every=args.eval_every, eval_prompts=args.eval_prompts, vocab_subset=args.vocab_subset,
                     feature_dtype=args.feature_dtype,
                     autocast_bf16=device.type == "cuda" if args.bf16_autocast is None else args.bf16_autocast,
                     memo_features=not args.no_memo_features, device=str(device),
                     soft_topk=args.soft_labels, soft_weight=0.5 if args.soft_weight is None else args.soft_weight,
                     time_limit=args.time_limit or 0.0, gamma=args.gamma, row1_anchors=args.row1_anchors,
                     row1_weight=1.0 if args.row1_weight is None else args.row1_weight)

    def eval_fn(model):  # periodic signal: the target is in --feature-dtype while training
        return measure_acceptance(target, model, n=tc.eval_prompts, max_new_tokens=tc.eval_max_new_tokens)

    store = None
    if args.feature_store:
        from dspine.train.feature_store import FeatureStore

        if tc.feature_dtype != "bfloat16":
            raise ValueError(f"--feature-store holds bfloat16 features; --feature-dtype {tc.feature_dtype} "
                             f"cannot apply to them (drop one of the two options)")
        store = FeatureStore(args.feature_store, target, cfg.feature_layers, seqs, tc.max_len)
        if rank == 0:
            print(f"feature store {args.feature_store}: {len(store)}/{len(seqs)} sequences precomputed")
    tr = Trainer(target, cfg, seqs, out, tc, eval_fn=eval_fn, feature_store=store)
    t0 = time.time()
    tr.run(resume=args.resume, init_from=args.init_from, continue_from=args.continue_from,
           rebuild_steps=64 if args.rebuild_moments is None else args.rebuild_moments)
    if rank == 0:
        final = out / "final"
        save_drafter(tr.model, final, dtype=torch.bfloat16)
        from dspine.train.portable import write_state

        write_state(tr, final)  # with the weights: what --continue-from needs on another machine
        if tr.subset is not None:  # the ids the CE pushed: the candidate pass scores only these
            from dspine.drafter.vocab import coverage, save_draft_vocab

            sub = tr.subset.cpu()
            save_draft_vocab(final, sub, {"source": "dspine train --vocab-subset (the CE's token ids)",
                                          "coverage_of_training_responses": round(coverage(sub, seqs), 4)})
        # training ran the target in --feature-dtype; casting it back would keep rounded
        # weights, so the held-out measurement loads the float32 target afresh
        del target
        tr.target, tr.memo = None, {}
        target = load_target(args.target, dtype="float32", device=str(device))
        tr.model.to(torch.float32).bind_target(target.input_embeddings(), target.output_head())
        if args.eval_prompts:  # minutes on a small CPU: show progress on stderr
            print(f"held-out acceptance of the final drafter ({args.eval_prompts} prompts per set) ...",
                  file=sys.stderr, flush=True)
        acc = measure_acceptance(target, tr.model, n=args.eval_prompts, max_new_tokens=64, progress=True,
                                 vocab=None if tr.subset is None else tr.subset.cpu()) if args.eval_prompts else {}
        card = {"target": args.target, "mode": cfg.mode, "data": [str(d) for d in args.data],
                "data_summary": _data_summary(args.data),
                "data_sequences": len(seqs), "data_response_tokens": sum(len(s) - r for s, r in seqs),
                **({"data_history": tr.data_history} if len(tr.data_history) > 1 else {}),
                "steps": tr.step, **({"stopped_by_time_limit": True} if tr.stopped_early else {}),
                "train_config": json.loads(json.dumps(tc.__dict__)),
                "wall_time_s": round(tr.wall, 1), "world_size": world,
                "hardware": _hardware(device),
                "heldout_acceptance_greedy_fp32": acc,
                **_warm_start_fields(tr.init_source, tr.step, tr.wall),
                **({"continued_from": tr.continued_from} if tr.continued_from else {}),
                **({"init_adapted": tr.init_adapted} if tr.init_adapted else {}),
                "created": time.strftime("%Y-%m-%d %H:%M:%S")}
        (final / "card.json").write_text(json.dumps(card, indent=2))
        write_model_card(final)
        print(json.dumps({"final": str(final), **acc}))
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    return 0


def _training_seqs(data_dirs, target, max_len: int | None = None):
    """(token ids, response start) pairs of the data directories.

    Keeps sequences with a response of >= 2 tokens. With ``max_len``, each row becomes its
    training window (:func:`dspine.train.losses.fit_window`: the prompt is cut from the
    left, never the response), so the response tokens counted are those trained on.

    Raises:
        ValueError: no usable sequence (names --data and --max-len), or a token id outside
            the target vocabulary (names the --data directory and row).
    """
    from dspine.data.load import load_dataset

    data = []
    V = target.vocab_size
    for d in data_dirs:
        rows = load_dataset(d, target)
        for k, s in enumerate(rows):
            if s.input_ids and not 0 <= min(s.input_ids) <= max(s.input_ids) < V:
                bad = next(t for t in s.input_ids if not 0 <= t < V)
                raise ValueError(f"--data {d}: row {k} holds token id {bad}, outside the vocabulary of "
                                 f"target {target.name!r} (size {V}); the data is damaged or from another "
                                 f"tokenizer")
        data += rows
    seqs = [(s.input_ids, s.response_start) for s in data if len(s.input_ids) - s.response_start >= 2]
    if seqs and len(seqs) < len(data):  # an empty or one-token answer holds no block to train on
        print(f"note: --data: {len(data) - len(seqs)} of {len(data)} rows have an answer of fewer than 2 "
              f"tokens and are not trained on", file=sys.stderr, flush=True)
    if not seqs:
        raise ValueError(f"--data {data_dirs}: no usable sequences (need responses of >= 2 tokens)")
    if max_len is not None:
        from dspine.train.losses import fit_window

        if max_len < 4:
            raise ValueError(f"--max-len {max_len} must be at least 4")
        cut = sum(1 for s, _ in seqs if len(s) > max_len)
        long_resp = sum(1 for s, r in seqs if len(s) - r > max_len - 1)
        seqs = [fit_window(s, r, max_len) for s, r in seqs]
        if cut:
            print(f"note: {cut} of {len(seqs)} sequences are longer than --max-len {max_len}; their prompts "
                  f"were cut from the left" + (f", and {long_resp} responses longer than the window keep "
                                               f"their first {max_len - 1} tokens" if long_resp else
                                               " (every response kept whole)"), file=sys.stderr)
    return seqs


def cmd_train_features(args) -> int:
    from dspine.target.adapter import load_target
    from dspine.data.build import parse_shard
    from dspine.train.feature_store import build_feature_store

    from dspine.guards import resolve_device

    k, n = parse_shard(args.shard)
    if args.threads:
        torch.set_num_threads(args.threads)
    target = load_target(args.target, dtype="float32", device=str(resolve_device(args.device)))
    layers = args.feature_layers or target.default_feature_layers(5)
    bad = [l for l in layers if not 0 <= l < target.num_layers]
    if bad:
        raise ValueError(f"--feature-layers {bad} do not exist in target {target.name!r} ({target.num_layers} layers)")
    seqs = _training_seqs(args.data, target, args.max_len)  # the same windows `dspine train` uses
    wrote = build_feature_store(target, layers, seqs, args.max_len, args.out, k, n, args.batch_size,
                                reuse=args.reuse, compute_dtype=args.compute_dtype)
    print(json.dumps({"out": args.out, "shard": args.shard, "written": wrote, "sequences": len(seqs)}))
    return 0


def cmd_acceptance(args) -> int:
    from dspine.drafter.checkpoint import DrafterError, load_drafter, random_drafter
    from dspine.target.adapter import load_target
    from dspine.guards import resolve_device, validate_runtime

    from dspine.data.sources import HELDOUT_KINDS

    bad = [k for k in args.sets if k not in HELDOUT_KINDS]
    if bad:  # before minutes of loading and of the sets before it
        raise ValueError(f"--sets {bad[0]!r} is unknown; accepted: {', '.join(HELDOUT_KINDS)}")
    device = str(resolve_device(args.device))
    validate_runtime(None, None, dtype=args.dtype, device=device)  # as `generate`, before loading
    from dspine.tune.threads import choose_threads

    choose_threads(args.threads)  # τ does not depend on them; a busy machine's free cores do
    target = load_target(args.target, dtype=args.dtype, device=device)
    if args.drafter == "random":  # untrained baseline (tau of a drafter that knows nothing)
        model = random_drafter(target, mode=args.mode or "dspine", dtype=target.dtype)
    else:
        model = load_drafter(args.drafter, target, dtype=target.dtype)
        if args.mode and args.mode != model.cfg.mode:
            raise DrafterError(f"--mode {args.mode} does not match drafter {args.drafter} "
                               f"(trained as {model.cfg.mode}); leave --mode out for a checkpoint")
    from dspine.trees.tree import tree_spec_from_args
    from dspine.runtime.select import apply_runtime

    spec = tree_spec_from_args(args)
    if args.copy_bonus is not None and (args.proposer != "hybrid" or not model.cfg.final_stage):
        if args.proposer != "hybrid":
            raise DrafterError(f"--copy-bonus needs --proposer hybrid (it fuses copies into the drafter's chain), "
                               f"not {args.proposer}")
        print("dspine acceptance: note: --copy-bonus ignored: the DFlash-style drafter has no final stage "
              "to fuse copies into", file=sys.stderr, flush=True)
    from dspine.drafter.vocab import resolve

    vocab = resolve(args.draft_vocab, None if args.drafter == "random" else args.drafter, model.cfg.vocab_size,
                    model.cfg.head_topk)
    from dspine.data.prior import resolve_prior

    prior = None
    if args.ngram_prior != "off":  # said, not silently dropped or shown as used
        why = ("the DFlash-style drafter has no final stage to score" if not model.cfg.final_stage else
               "--proposer ngram runs no drafter" if args.proposer == "ngram" else
               "--ngram-prior-weight 0" if args.ngram_prior_weight <= 0 else None)
        if why is None:  # loaded (or built) only where it is used
            prior = resolve_prior(args.ngram_prior, target, args.ngram_prior_weight)
            why = "no committed training data for the target" if prior is None else None
        if why:
            print(f"dspine acceptance: note: --ngram-prior {args.ngram_prior} "
                  f"is off: "
                  f"{why}", file=sys.stderr, flush=True)
    apply_runtime(target, "auto")  # the dense runtime where supported (bit-identical float32; trees need it)
    res = measure_acceptance(target, model, sets=args.sets, n=args.n, max_new_tokens=args.max_new_tokens,
                             progress=True, proposer=args.proposer, tree=spec, copy_bonus=args.copy_bonus,
                             vocab=vocab, prior=prior)
    print(json.dumps({"drafter": args.drafter, "mode": model.cfg.mode, "proposer": args.proposer,
                      "draft_vocab": 0 if vocab is None else int(vocab.numel()),
                      "ngram_prior": None if prior is None else {"source": prior.source, "weight": prior.weight},
                      **res}))
    return 0


def add_train_parser(sub) -> None:
    p = sub.add_parser("train", help="train a DSpine or DFlash-style drafter for a target")
    p.add_argument("--target", default="smollm2-135m")
    p.add_argument("--data", required=True, nargs="+",
                   help="directories built by `dspine data build` / `dspine data text`")
    p.add_argument("--config", default="small", help="small | release | path to a drafter config.json")
    p.add_argument("--mode", default="dspine", choices=["dspine", "dflash"])
    p.add_argument("--engine-compatible", action="store_true",
                   help="with --mode dflash: the z-lab DFlash architecture (per-head q/k RMSNorm, no "
                        "per-row embedding) that vLLM and llama.cpp serve after `dspine export`")
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=positive_int, default=1000)
    p.add_argument("--batch-size", type=positive_int, default=8, help="global sequences per step")
    p.add_argument("--anchors", type=positive_int, default=32, help="random anchors (blocks) per sequence")
    p.add_argument("--block-size", type=_block_size, default=16,
                   help=f"rows of a block, anchor included: 2..{MAX_BLOCK_SIZE} (default 16; a --config "
                        f"file or checkpoint keeps its own block size)")
    p.add_argument("--gamma", type=positive_float, default=7.0,
                   help="row k of a block weighs exp(-(k-1)/gamma) in the loss (spec s.9); a small gamma "
                        "puts the weight on the first rows, those a CPU's cost policy verifies")
    p.add_argument("--max-len", type=positive_int, default=384)
    p.add_argument("--lr", type=positive_float, default=1e-3)
    p.add_argument("--min-lr-ratio", type=unit_float, default=0.1,
                   help="the cosine schedule ends at this fraction of --lr (0 = decay to zero)")
    p.add_argument("--lr-schedule", default="cosine", choices=["cosine", "constant"],
                   help="after --warmup: cosine decay to --min-lr-ratio x --lr at --steps (default), or "
                        "constant --lr, for a run extended period after period with --resume --steps "
                        "(no step's rate depends on where the run will end)")
    p.add_argument("--warmup", type=nonneg_int, default=50)
    p.add_argument("--vocab-subset", type=nonneg_int, default=8192, help="CE over the N most frequent tokens (0 = all)")
    p.add_argument("--time-limit", type=positive_float, default=None, metavar="SECONDS",
                   help="save and stop after this many seconds of training even before --steps "
                        "(the final export and held-out measurement still run; --resume continues)")
    p.add_argument("--soft-labels", type=nonneg_int, default=0, metavar="K",
                   help="also train on the target's own next-token distribution (its top K "
                        "probabilities from the feature forward); 0 = hard labels only (default)")
    p.add_argument("--soft-weight", type=unit_float, default=None,
                   help="share of the soft-label CE in each row's CE with --soft-labels (default: 0.5)")
    p.add_argument("--row1-anchors", type=nonneg_int, default=0, metavar="N",
                   help="DSpine only: N more anchors per sequence trained on row 1 alone, a dense row-1 "
                        "term (docs/decisions.md, 'A dense row-1 term'); 0 = off (default)")
    p.add_argument("--row1-weight", type=nonneg_float, default=None,
                   help="weight of the dense row-1 term with --row1-anchors (default: 1.0)")
    p.add_argument("--feature-dtype", default="auto", choices=["auto", "bfloat16", "float32"],
                   help="dtype the target computes training features in; auto: bfloat16 with "
                        "--feature-store, else the faster of the two measured on this machine (cached)")
    p.add_argument("--no-memo-features", action="store_true",
                   help="recompute target features every time (default: keep them in RAM once computed)")
    p.add_argument("--bf16-autocast", action=argparse.BooleanOptionalAction, default=None,
                   help="bf16 autocast for the drafter (default: on for CUDA, off on CPU)")
    p.add_argument("--device", default="auto",
                   help="auto (CUDA when available, under torchrun cuda:LOCAL_RANK) | cpu | cuda | cuda:N")
    p.add_argument("--seed", type=seed_int, default=0)
    p.add_argument("--save-every", type=positive_int, default=100)
    p.add_argument("--eval-every", type=nonneg_int, default=0)
    p.add_argument("--eval-prompts", type=nonneg_int, default=4)
    p.add_argument("--threads", type=thread_count, default=0,
                   help="torch CPU threads of a one-process CPU run (default 0: one per core, less the cores other processes keep busy when it starts (measured for 0.3 s; OMP_NUM_THREADS also chooses))")
    p.add_argument("--resume", action="store_true")
    p.add_argument("--init-from", default=None,
                   help="warm-start weights from a drafter checkpoint dir (same config, or one that differs "
                        "only in --engine-compatible's q/k norm and row embedding: tensors are copied by "
                        "name, new ones start at their init); ignored on --resume")
    p.add_argument("--continue-from", default=None, metavar="DIR",
                   help="continue the run that exported the drafter in DIR (its trainer.json: step, "
                        "schedule, data; e.g. a committed checkpoint, on another machine), with the "
                        "optimizer's moments rebuilt; the same settings and data (or data grown by "
                        "appended rows) are required; ignored on --resume when --out holds a checkpoint")
    p.add_argument("--rebuild-moments", type=nonneg_int, default=None, metavar="K",
                   help="with --continue-from: rebuild AdamW's moments from the gradients of the K "
                        "steps before the saved one (default 64)")
    p.add_argument("--feature-store", default=None,
                   help="precomputed target features (`dspine train-features`) for exactly this --data/--max-len")
    p.set_defaults(func=cmd_train)

    f = sub.add_parser("train-features", help="precompute target features of a training set (shared by runs)")
    f.add_argument("--target", default="smollm2-135m")
    f.add_argument("--data", required=True, nargs="+", help="same --data list as the `dspine train` runs")
    f.add_argument("--out", required=True)
    f.add_argument("--max-len", type=positive_int, default=384)
    f.add_argument("--feature-layers", type=int, nargs="+", default=None,
                   help="default: the target's default feature layers (as `dspine train --config small`)")
    f.add_argument("--shard", default="0/1", help="k/N: this process computes sequences i %% N == k")
    f.add_argument("--batch-size", type=positive_int, default=4)
    f.add_argument("--reuse", nargs="+", default=None, metavar="STORE",
                   help="older feature stores of the same target/layers/max-len: copy the rows of "
                        "sequences they hold instead of recomputing (after growing the data)")
    f.add_argument("--threads", type=thread_count, default=0)
    f.add_argument("--compute-dtype", default="auto", choices=["auto", "bfloat16", "float32"],
                   help="dtype the target runs in (rows are stored in bfloat16 either way); auto: the "
                        "faster of the two measured on this machine (cached)")
    f.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    f.set_defaults(func=cmd_train_features)

    a = sub.add_parser("acceptance", help="held-out acceptance length of a drafter (engine loop)")
    a.add_argument("--target", default="smollm2-135m")
    a.add_argument("--drafter", required=True, help="checkpoint directory, or 'random' (untrained baseline)")
    a.add_argument("--mode", default=None, choices=["dspine", "dflash"],
                   help="mode of a random drafter (default dspine); a checkpoint runs as trained")
    a.add_argument("--sets", nargs="+", default=["code", "chat"])
    a.add_argument("--n", type=positive_int, default=16)
    a.add_argument("--max-new-tokens", type=positive_int, default=96)
    a.add_argument("--dtype", default="float32")
    a.add_argument("--device", default="cpu", help="cpu | cuda | cuda:N | auto")
    a.add_argument("--threads", type=thread_count, default=0,
                   help="torch CPU threads (default 0: one per core, less the cores other processes keep busy; "
                        "τ does not depend on it)")
    a.add_argument("--proposer", default="drafter", choices=list(PROPOSER_NAMES),
                   help="drafter (the default here: the drafter's own tau) | ngram (copies of the request's "
                        "own text) | hybrid (copies where the context repeats, the drafter elsewhere)")
    a.add_argument("--copy-bonus", type=nonneg_float, default=None, metavar="B",
                   help="with --proposer hybrid: fuse copies into the DSpine final stage's chain (score bonus B)")
    from dspine.argtypes import add_ngram_prior_args

    add_ngram_prior_args(a, default="off")
    add_tree_args(a)
    from dspine.cli.main import add_draft_vocab_arg

    add_draft_vocab_arg(a)
    a.set_defaults(func=cmd_acceptance)
