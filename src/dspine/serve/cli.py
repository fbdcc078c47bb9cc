"""``dspine serve``: OpenAI-compatible HTTP server with batched speculative decoding.

Prints where it listens and what it serves, then serves until SIGINT/SIGTERM:
new connections stop, running requests get up to ``--shutdown-timeout`` seconds to
finish, the rest are cancelled and their state freed. Bad settings exit with code 2
and a one-line error naming the setting (``--max-running`` above the validated 8,
an unknown ``--mode``, a port that cannot be bound, ...).
"""
from __future__ import annotations

import os
import signal
import sys

from dspine.argtypes import nonneg_float, nonneg_int, port_number, seed_int, thread_count
from dspine.config import VERIFY_POLICIES


def cmd_serve(args) -> int:
    from dspine.core.batch import MAX_RUNNING_VALIDATED, BatchEngine
    from dspine.build import build_engine
    from dspine.core.engine import EngineError
    from dspine.serve.app import create_app
    from dspine.serve.server import bind_socket, make_server

    if not 1 <= args.max_running <= MAX_RUNNING_VALIDATED:
        raise EngineError(f"--max-running {args.max_running} is outside the validated range "
                          f"1..{MAX_RUNNING_VALIDATED} (at most {MAX_RUNNING_VALIDATED} concurrent requests "
                          f"are validated, spec section 8)")
    if args.max_queue < 0:
        raise EngineError(f"--max-queue must be >= 0, got {args.max_queue}")
    if args.shutdown_timeout < 0:
        raise EngineError(f"--shutdown-timeout must be >= 0, got {args.shutdown_timeout}")
    from dspine.tune.threads import choose_threads

    choose_threads(args.threads)
    from dspine.cli.main import DEFAULT_VERIFY_POLICY, config_from_args, proposer_notes, tree_notes

    notes = list(proposer_notes(args)) + tree_notes(args)
    if args.ngram_cache_scope != "key" and not args.ngram_cache_tokens:
        notes.append(f"--ngram-cache-scope {args.ngram_cache_scope} ignored: no output cache "
                     f"(--ngram-cache-tokens 0)")
    if args.ngram_cache_tokens:
        from dspine.proposers.cache import bytes_bound

        bound = bytes_bound(args.ngram_cache_tokens, args.ngram_max)
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") if hasattr(os, "sysconf") else 0
        if total and bound > total // 2:
            notes.append(f"--ngram-cache-tokens {args.ngram_cache_tokens} may hold up to ~{bound / 2**30:.1f} GiB, "
                         f"more than half of this machine's {total / 2**30:.1f} GiB (dspine memory "
                         f"--ngram-cache-tokens N shows the bound)")
    for note in notes:
        print(f"dspine serve: note: {note}", file=sys.stderr, flush=True)

    if args.mode == "ar" and args.verify_policy not in (None, "fixed"):
        print(f"dspine serve: note: --verify-policy {args.verify_policy} ignored: --mode ar verifies "
              f"no drafted tokens", file=sys.stderr, flush=True)
    args.verify_policy = DEFAULT_VERIFY_POLICY if args.verify_policy is None else args.verify_policy
    from dspine.serve.auth import APIKeys

    api_keys = APIKeys.from_settings(args.api_key, args.api_keys_file)
    sock = bind_socket(args.host, args.port)  # fail fast, before loading models
    target, engine = build_engine(config_from_args(args, concurrency=args.max_running, persist=True), progress=True)
    batch = BatchEngine(engine, args.max_running)
    name = args.served_model_name or args.target
    drafter = "-" if args.mode == "ar" or args.proposer == "ngram" else (args.drafter or "shipped default")  # copies need none
    policy = args.verify_policy if args.mode != "ar" else "-"
    info = {"mode": args.mode, "target": args.target, "drafter": drafter, "dtype": args.dtype,
            "verify_policy": policy, "proposer": args.proposer if args.mode != "ar" else "-",
            "draft_tree": engine.tree_info()}
    if args.ngram_cache_tokens:
        info["ngram_cache"] = f"{args.ngram_cache_tokens} tokens, scope {args.ngram_cache_scope}"
    app = create_app(batch, name, args.max_queue, info, cache_scope=args.ngram_cache_scope, api_keys=api_keys)
    port = sock.getsockname()[1]
    print(f"dspine serve: listening on http://{args.host}:{port}", flush=True)
    print(f"dspine serve: model '{name}' = target {args.target} ({target.num_layers} layers, vocab "
          f"{target.vocab_size}, context {engine.max_positions}), mode {args.mode}, drafter {drafter}, "
          f"proposer {info['proposer']}, "
          f"dtype {args.dtype}, verify policy {policy}, "
          f"batched {'verification' if args.mode != 'ar' else 'decoding'} of up to "
          f"{args.max_running} running requests, queue {args.max_queue}"
          + (f", output cache of {args.ngram_cache_tokens} tokens per --ngram-cache-scope "
             f"{args.ngram_cache_scope}" if args.ngram_cache_tokens else ""), flush=True)
    print("dspine serve: " + (f"/v1/* needs 'Authorization: Bearer <key>' ({len(api_keys)} key"
                              f"{'s' if len(api_keys) > 1 else ''}); /health and /metrics are open"
                              if api_keys else "no API key set: every client is served (--api-key KEY to require one)"),
          flush=True)
    print("dspine serve: endpoints POST /v1/completions, POST /v1/chat/completions, GET /v1/models, "
          "GET /health, GET /metrics; Ctrl-C or SIGTERM stops gracefully", flush=True)
    server = make_server(app, args.shutdown_timeout, args.log_level)
    # uvicorn installs its own handlers while serving and re-raises the signal afterwards:
    # make that re-raise a no-op so a graceful stop exits with code 0.
    prev = {s: signal.signal(s, lambda *_: None) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        server.run(sockets=[sock])
    finally:
        for s, h in prev.items():
            signal.signal(s, h)
    from dspine.cli.main import _save_profile

    _save_profile(engine)
    c = app.state.scheduler.counters()
    print(f"dspine serve: stopped ({c['cycles']} cycles; running {c['running']}, queued {c['queued']})",
          flush=True)
    return 0


def add_serve_parser(sub) -> None:
    p = sub.add_parser("serve", help="OpenAI-compatible server with batched speculative decoding")
    p.add_argument("--target", default="smollm2-135m", help="target name, HF dir, .gguf, or random:<arch>")
    p.add_argument("--drafter", default=None, help="drafter checkpoint dir, or 'random' (default: shipped)")
    p.add_argument("--mode", default="dspine", help="ar | dflash | dspine")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=port_number, default=8000, help="0 picks a free port")
    p.add_argument("--max-running", type=int, default=8, help="running requests batched per cycle (1..8)")
    p.add_argument("--max-queue", type=nonneg_int, default=64, help="waiting requests beyond which HTTP 429 is returned")
    p.add_argument("--dtype", default="float32", help="float32 | bfloat16")
    p.add_argument("--device", default="cpu", help="cpu | cuda | cuda:N | auto (CUDA when available)")
    p.add_argument("--block-size", type=int, default=None,
                   help="must equal the drafter checkpoint's (default: the checkpoint's; 16 for --drafter random)")
    p.add_argument("--seed", type=seed_int, default=0, help="seed of a random drafter")
    p.add_argument("--served-model-name", default=None, help="model id in the API (default: --target)")
    p.add_argument("--shutdown-timeout", type=nonneg_float, default=30.0,
                   help="seconds running requests get to finish on SIGINT/SIGTERM; those still "
                        "running then get a 503")
    p.add_argument("--verify-policy", default=None, choices=VERIFY_POLICIES,
                   help="cost (default: one verification length per batched cycle, priced at the number "
                        "of running requests; plain batched steps when drafting does not pay) | fixed "
                        "(verify the whole block)")
    from dspine.cli.main import add_proposer_args, add_target_runtime_args, add_target_weights_arg

    add_target_runtime_args(p)
    add_target_weights_arg(p)
    add_proposer_args(p)
    p.add_argument("--ngram-cache-tokens", type=nonneg_int, default=0,
                   help="copies may also come from earlier requests' outputs: keep up to N tokens of "
                        "them (all tenants together, oldest dropped first; ~0.6 KB per token at --ngram-max 4; default 0 = "
                        "off; needs --proposer hybrid or ngram)")
    from dspine.proposers.cache import SCOPES

    p.add_argument("--ngram-cache-scope", default="key", choices=list(SCOPES),
                   help="who shares those outputs: key (the default: requests with the same "
                        "Authorization header; requests without one share the tenant 'anonymous') | "
                        "global (every request: only when all clients may see each other's outputs)")
    from dspine.cli.main import add_drafter_kernel_args

    add_drafter_kernel_args(p)
    from dspine.argtypes import DEFAULT_SERVE_TREE_BUDGET, add_tree_args

    add_tree_args(p, DEFAULT_SERVE_TREE_BUDGET)  # batched trees run on the lean path (else chains)
    p.add_argument("--threads", type=thread_count, default=0,
                   help="torch CPU threads (default 0: one per core, less the cores other processes keep busy when it starts (measured for 0.3 s; OMP_NUM_THREADS also chooses))")
    p.add_argument("--api-key", action="append", default=None, metavar="KEY",
                   help="require 'Authorization: Bearer KEY' on /v1/* (repeatable; default: "
                        "$DSPINE_API_KEY, comma-separated, else no key); each key is its own tenant of the "
                        "output cache")
    p.add_argument("--api-keys-file", default=None, metavar="FILE",
                   help="keys to accept, one 'KEY [TENANT]' per line: keys naming the same TENANT share its "
                        "output cache")
    p.add_argument("--log-level", default="warning", choices=("critical", "error", "warning", "info", "debug", "trace"),
                   help="the HTTP server's log level (default: warning)")
    p.set_defaults(func=cmd_serve)


if __name__ == "__main__":  # pragma: no cover
    from dspine.cli.main import main
    sys.exit(main(["serve"] + sys.argv[1:]))
