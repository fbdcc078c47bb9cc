"""``dspine memory``: print the resident footprint :func:`dspine.drafter.memory.estimate` computes.

The command lives with the other applications (it may load data: ``--ngram-prior`` sizes
the prior's table by loading or building it with :mod:`dspine.data.prior`); the estimate
itself stays in :mod:`dspine.drafter.memory`, computed from configurations.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

from dspine.config import ConfigError
from dspine.drafter.memory import drafter_config, estimate
from dspine.drafter.target_spec import target_spec


def _prior_size(setting: str, target: str | None, cfg) -> tuple[int, int] | None:
    """(bytes, contexts) of the ``--ngram-prior`` table ``generate --target TARGET`` would
    load, or None where generate runs without one (and says why, as it does: a DFlash-style
    drafter, no committed data for ``auto``). The target is loaded so that the data is
    checked as generate checks it (target name or path, tokenizer, token ids).

    Raises:
        ConfigError: naming ``--ngram-prior``: no ``--target``, or data generate refuses.
    """
    from dspine.data.prior import resolve_prior
    from dspine.target.adapter import load_target

    if not target:
        raise ConfigError(f"--ngram-prior {setting} needs --target (the prior holds one target's answers)")
    if not cfg.final_stage:
        print(f"dspine memory: note: --ngram-prior {setting} is off: the DFlash-style drafter has no final stage "
              f"to score", file=sys.stderr, flush=True)
        return None
    try:
        prior = resolve_prior(setting, load_target(target, dtype="float32"))
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if prior is None:
        print(f"dspine memory: note: --ngram-prior {setting} is off: no committed training data for target "
              f"{target!r} (give a `dspine data build` directory)", file=sys.stderr, flush=True)
        return None
    return prior.nbytes(), int(prior.keys.shape[0])


def cmd_memory(args) -> int:
    if args.ngram_cache_tokens:  # the bounds serve enforces (dspine.proposers.check_copy_settings)
        from dspine.proposers.cache import MIN_TOKENS

        if args.ngram_cache_tokens < MIN_TOKENS:
            raise ConfigError(f"--ngram-cache-tokens must be 0 (off) or >= {MIN_TOKENS}, got {args.ngram_cache_tokens}")
        if args.ngram_max < 2:
            raise ConfigError(f"--ngram-cache-tokens needs --ngram-max >= 2 (the cache proposes on matches of 2+ "
                              f"tokens), got --ngram-max {args.ngram_max}")
    spec = target_spec(args.target) if args.target else None
    cfg = drafter_config(args.config, spec)
    profile = args.config if args.config in ("release", "small") else Path(args.config).name
    vocab = 0
    if args.config not in ("release", "small") and Path(args.config).is_dir():  # a checkpoint's draft vocabulary
        from dspine.drafter.vocab import load_draft_vocab

        ids = load_draft_vocab(args.config, cfg.vocab_size, cfg.head_topk)
        vocab = 0 if ids is None else int(ids.numel())
    prior = None
    if args.ngram_prior != "off":
        prior = _prior_size(args.ngram_prior, args.target, cfg)
    rep = estimate(cfg, spec, context=args.context, concurrency=args.concurrency, dtype=args.dtype,
                   profile=profile, tree_budget=args.tree_budget, ngram_cache_tokens=args.ngram_cache_tokens,
                   ngram_max=args.ngram_max, draft_vocab=vocab, ngram_prior=prior)
    if args.json:
        print(json.dumps(rep.to_dict(), indent=2))
    else:
        print(rep.render())
    return 0


def add_memory_parser(sub) -> None:
    """Register ``dspine memory`` (called from :func:`dspine.cli.main._optional_parsers`)."""
    p = sub.add_parser("memory", help="resident memory footprint of a drafter (+ target)",
                       description="Resident footprint: drafter weights, draft context K/V (dense pool "
                                   "vs bounded ring buffer), codebook, greedy tables, quantized head, "
                                   "and target weights/KV/state when a target is named.")
    p.add_argument("--config", default="release", help="release | small | drafter config path (default release)")
    p.add_argument("--target", default=None, help="target name, HF dir, .gguf, or random:<arch> (a named target or .gguf is fetched "
                        "and converted once on its first use, as generate does; no weights are loaded)")
    from dspine.argtypes import ngram_prior_setting, nonneg_int, positive_int, tree_budget

    p.add_argument("--context", type=positive_int, default=None,
                   help="retained positions per request (default 131072, capped at the target's window)")
    p.add_argument("--concurrency", type=positive_int, default=1)
    p.add_argument("--dtype", default="bfloat16", help="float32 | bfloat16 | float16 (default bfloat16)")

    p.add_argument("--tree-budget", type=tree_budget, default=0,
                   help="draft-tree nodes per cycle (generate --tree-budget): adds one tree verification's buffers")
    p.add_argument("--ngram-cache-tokens", type=nonneg_int, default=0,
                   help="serve --ngram-cache-tokens: adds the cross-request output cache's bound")
    p.add_argument("--ngram-max", type=positive_int, default=4,
                   help="serve --ngram-max (index slots per cached token)")
    p.add_argument("--ngram-prior", type=ngram_prior_setting, default="off", metavar="off|auto|DIR",
                   help="generate/serve --ngram-prior: adds the prior's table, loaded from its cache or built "
                        "(needs --target; off: none)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.set_defaults(func=cmd_memory)


if __name__ == "__main__":  # python -m dspine.cli.memory ...: the same command and errors as `dspine memory`
    from dspine.cli.main import main

    sys.exit(main(["memory", *sys.argv[1:]]))
