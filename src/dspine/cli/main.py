"""Command-line entry ``dspine`` (generate, and the subcommands other modules add).

Contract of ``dspine generate``: streams text to stdout; ``--json`` prints
one JSON object with ``text``, ``token_ids``, ``mode`` and ``stats``. Bad settings
exit with code 2 and a one-line error naming the setting.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
from dataclasses import fields

from dspine.build import build_engine
from dspine.config import SpeculativeConfig
from dspine.argtypes import (DEFAULT_TREE_BUDGET, PROPOSER_NAMES, add_tree_args, nonneg_float, nonneg_int, positive_int,
                       seed_int, thread_count)

#: ``generate`` / ``serve`` / ``bench`` default: verify only as many drafted tokens as pay
#: off on this machine (plain target steps where none do), so the default never runs
#: far slower than ``--mode ar`` (docs/decisions.md).
DEFAULT_VERIFY_POLICY = SpeculativeConfig.verify_policy
#: ``generate`` / ``serve`` / ``bench`` default proposer (docs/decisions.md)
DEFAULT_PROPOSER = SpeculativeConfig.proposer


def add_target_runtime_args(p: argparse.ArgumentParser, default: str | None = "auto", every_mode: bool = False) -> None:
    """``--linear-backend`` and ``--runtime`` (the target's linears and forward;
    :mod:`dspine.runtime`) of ``generate``, ``serve`` and ``bench``."""
    who = " for every mode (hf and hf-pld included)" if every_mode else ""
    p.add_argument("--linear-backend", default=default, metavar="{auto,aten,transposed,onednn,mixed,blockq}",
                   help=f"the target's linear layers{who}: auto (default: the fastest measured on this machine, "
                        "cached) | aten (PyTorch's own) | transposed (column-major weights) | onednn (weights "
                        "pre-packed once) | mixed (column-major for one token, packed for more) | blockq "
                        "(float32 targets converted from a Q4_1/Q8_0 GGUF, e.g. the default: C++ kernels read "
                        "the exact 4/8-bit blocks; on the dense runtime decode steps and verifications also "
                        "run every layer in one C++ call, the lean decode path; DSPINE_LEAN=0 turns that off)")
    p.add_argument("--runtime", default=default, metavar="{auto,hf,dense}",
                   help="the target's forward: auto (default: dense where it supports the target) | hf "
                        "(transformers' forward) | dense (dspine's own llama/qwen2/qwen3 forward with a "
                        "preallocated K/V cache; same weights, bit-identical float32 logits on PyTorch's linears)"
                        + ("; hf and hf-pld always run transformers' generate" if every_mode else ""))


def add_target_weights_arg(p: argparse.ArgumentParser) -> None:
    """``--target-weights`` of ``generate`` and ``serve`` (:mod:`dspine.runtime.weights`)."""
    from dspine.runtime.weights import TARGET_WEIGHTS

    p.add_argument("--target-weights", default=SpeculativeConfig.target_weights, choices=TARGET_WEIGHTS,
                   help="as-is (default) | q8_0: round the target's linear layers to 8-bit Q8_0 blocks "
                        "(opt-in, for targets not converted from a GGUF: they then run on the blockq "
                        "kernels and the lean path); the output is then exactly that quantized target's "
                        "(compare with --mode ar --target-weights q8_0), not the original weights'")


def add_proposer_args(p: argparse.ArgumentParser) -> None:
    """``--proposer``, ``--ngram-max``, ``--ngram-min`` of ``generate`` and ``serve`` (``bench``
    and ``acceptance`` take ``--proposer`` alone and use the defaults of the other two)."""
    p.add_argument("--proposer", default=DEFAULT_PROPOSER, choices=list(PROPOSER_NAMES),
                   help="what proposes tokens: hybrid (the default: a copy of the request's own earlier "
                        "text where its last tokens repeat, the drafter elsewhere, chosen per cycle before "
                        "anything is drawn) | drafter (the drafter alone) | ngram (copies alone: prompt "
                        "lookup, no drafter)")
    p.add_argument("--ngram-max", type=positive_int, default=SpeculativeConfig.ngram_max,
                   help="longest suffix of the context the copy proposer matches (tokens)")
    p.add_argument("--ngram-min", type=positive_int, default=SpeculativeConfig.ngram_min,
                   help="shortest suffix match that offers a copy (tokens); the hybrid's cost policy "
                        "prices one-token matches apart from longer ones")
    p.add_argument("--copy-bonus", type=nonneg_float, default=None, metavar="B",
                   help="hybrid with a DSpine drafter: where a copy is on offer but the cycle drafts, fuse "
                        "the copied tokens into the final stage's candidates, following them scoring B more "
                        "(source 'fused'; exact); default off")
    from dspine.argtypes import add_ngram_prior_args

    add_ngram_prior_args(p, default=SpeculativeConfig.ngram_prior)


def config_from_args(args, **overrides) -> SpeculativeConfig:
    """The :class:`~dspine.config.SpeculativeConfig` of parsed flags: each field from the
    flag of the same name (``--verify-policy`` -> ``verify_policy``) where the command has
    it and it was given or has a default, else the field's own default; then
    ``overrides``. A tree budget not given is the command's default
    (:func:`dspine.argtypes.add_tree_args`).

    Raises:
        ConfigError: a value out of range, naming the field.
    """
    kw = {f.name: getattr(args, f.name) for f in fields(SpeculativeConfig) if getattr(args, f.name, None) is not None}
    if getattr(args, "tree_budget", None) is None and getattr(args, "tree_budget_default", None) is not None:
        kw["tree_budget"] = args.tree_budget_default
    kw.update(overrides)
    return SpeculativeConfig(**kw)


def add_draft_vocab_arg(p, default: str | None = "auto") -> None:
    """``--draft-vocab`` (generate, serve, bench, acceptance; :mod:`dspine.drafter.vocab`);
    ``default`` None lets the caller fill in its config's default (bench)."""
    from dspine.drafter.vocab import CHOICES

    p.add_argument("--draft-vocab", default=default, choices=CHOICES,
                   help="tokens the drafter's candidate pass scores: auto (the checkpoint's draft_vocab.json, "
                        "the ids it was trained on, when it has one; else all) | full (the whole vocabulary) | "
                        "subset (the checkpoint's; an error without one). Proposals only: the output is the "
                        "target's either way")


def add_drafter_kernel_args(p, default: str | None = "auto") -> None:
    """``--drafter-linears``, ``--draft-vocab`` and ``--head-kernel``: how the drafter runs
    (generate, serve, bench; :mod:`dspine.tune.drafter`, :mod:`dspine.drafter.vocab`,
    :mod:`dspine.tune.head`). None as ``default``: the caller's config fills it in."""
    p.add_argument("--drafter-linears", default=default, choices=("auto", "float32", "q8"),
                   help="the drafter's own linear layers: auto (the default: measured on this machine, cached) | "
                        "float32 (as trained) | q8 (a copy rounded to Q8_0 blocks on the blockq kernels; the "
                        "drafter only proposes, so the output is the target's either way)")
    add_draft_vocab_arg(p, default)
    p.add_argument("--head-kernel", default=default,
                   help="the drafter's candidate-pass kernel: auto (the default: measured on this machine, cached; "
                        "`dspine tune` shows the table) | int8 | bfloat16 | exact | blockq (exact scores on a GGUF "
                        "head's blocks)")


def cmd_generate(args) -> int:
    from dspine.config import SamplingConfig

    sampling = SamplingConfig(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                              min_p=args.min_p, seed=args.seed)  # validated before anything loads
    if args.prompt == "" and not args.chat:  # before anything loads (a chat template adds tokens)
        raise ValueError("the prompt is empty: give some text (or --chat, whose template adds the turn's tokens)")
    from dspine.target.adapter import check_prompt_text

    check_prompt_text(args.prompt)  # command-line bytes that are not UTF-8, before anything loads
    if args.stop is not None and any(s == "" for s in args.stop):  # before anything loads
        raise ValueError("--stop '' is empty: an empty stop string would match before any text; give a "
                         "non-empty string or leave --stop out")
    for note in ignored_settings(args, sampling):
        print(f"dspine: note: {note}", file=sys.stderr)
    from dspine.tune.threads import choose_threads

    choose_threads(args.threads, progress=not args.no_progress)
    target, engine = build_engine(config_from_args(args, persist=True), progress=not args.no_progress)
    ids = target.encode_prompt(args.prompt, chat=args.chat)
    stream = None if args.json else (lambda s: (sys.stdout.write(s), sys.stdout.flush()))
    bar = None
    if args.json and not args.no_progress:  # text mode streams; --json shows a bar on stderr
        from tqdm import tqdm

        bar = tqdm(total=args.max_new_tokens, desc=f"generate ({args.mode})", unit="tok", file=sys.stderr,
                   mininterval=1.0, leave=False, dynamic_ncols=True)

    def on_cycle(req):
        bar.update(len(req.out_ids) - bar.n)
    try:
        res = engine.generate(ids, sampling, args.max_new_tokens, stop=args.stop, on_text=stream,
                              on_cycle=on_cycle if bar is not None else None)
    finally:
        if bar is not None:
            bar.close()
    _save_profile(engine)
    if args.json:
        print(json.dumps({"text": res.text, "token_ids": res.token_ids, "mode": res.mode,
                          "finish_reason": res.finish_reason, "target": args.target,
                          "stats": res.stats.to_dict()}))
    else:
        sys.stdout.write("\n")
        st = res.stats
        print(f"[{res.mode}] {st.output_tokens} tokens, tau {st.accepted_length_mean:.2f}, "
              f"{st.tokens_per_second:.1f} tok/s, TTFT {st.ttft_s:.2f}s", file=sys.stderr)
    return 0


def _save_profile(engine) -> None:
    """Save the cost policy's acceptance profile for the next run (when it has a key)."""
    pol = getattr(engine, "verify_policy", None)
    key = getattr(pol, "profile_key", None)
    if key is not None:
        from dspine.tune.controller import save_profile

        try:
            save_profile(pol, key, str(engine.target.device))
        except OSError as e:  # a read-only cache must not fail a finished generation
            print(f"dspine: note: could not save the acceptance profile ({e})", file=sys.stderr)


def proposer_notes(args) -> list[str]:
    """Notes for proposer options that have no effect with the others given (generate, serve)."""
    notes = []
    prop = getattr(args, "proposer", DEFAULT_PROPOSER)
    ngram_set = (getattr(args, "ngram_max", 4), getattr(args, "ngram_min", 1)) != (4, 1)
    prior = getattr(args, "ngram_prior", "off")
    prior_set = prior != "off" or getattr(args, "ngram_prior_weight", 0.5) != 0.5
    if prior_set and (args.mode == "ar" or prop == "ngram"):
        notes.append("--ngram-prior / --ngram-prior-weight ignored: "
                     + ("--mode ar drafts nothing" if args.mode == "ar" else "--proposer ngram runs no drafter"))
    elif prior == "off" and prior_set:
        notes.append("--ngram-prior-weight ignored: --ngram-prior is off")
    if args.mode == "ar":
        if prop != DEFAULT_PROPOSER or ngram_set:
            notes.append("--proposer / --ngram-max / --ngram-min ignored: --mode ar proposes nothing")
        return notes
    if prop == "ngram" and args.drafter is not None:
        notes.append(f"--drafter {args.drafter} ignored: --proposer ngram proposes copies, no drafter runs")
    if prop == "ngram" and args.mode != "dspine":
        notes.append(f"--mode {args.mode} ignored: --proposer ngram runs no drafter")
    if prop == "drafter" and ngram_set:
        notes.append("--ngram-max / --ngram-min ignored: --proposer drafter makes no copies")
    if getattr(args, "copy_bonus", None) is not None and prop == "hybrid" and args.mode == "dflash":
        notes.append("--copy-bonus ignored: the DFlash-style drafter has no final stage to fuse copies into")
    return notes


def ignored_settings(args, sampling) -> list[str]:
    """Notes for options that have no effect with the others given (as HF generate warns)."""
    notes = []
    if sampling.greedy:
        set_ = [f"--{k.replace('_', '-')} {getattr(args, k)}" for k, off in (("top_k", 0), ("top_p", 1.0), ("min_p", 0.0))
                if getattr(args, k) != off]
        if set_:
            notes.append(f"{', '.join(set_)} ignored: --temperature 0 is greedy decoding")
    if args.mode == "ar" and (args.drafter is not None or args.block_size is not None):
        notes.append("--drafter / --block-size ignored: --mode ar runs the target alone")
    notes += proposer_notes(args)
    if args.mode == "ar" and getattr(args, "verify_policy", None) not in (None, "fixed"):
        notes.append(f"--verify-policy {args.verify_policy} ignored: --mode ar verifies no drafted tokens")
    return notes + tree_notes(args)


def tree_notes(args) -> list[str]:
    """Notes for tree settings (``--tree-budget``, ``--tree-shape``, ``--tree-size``) that have
    no effect with the others given (``generate``, ``serve``)."""
    notes = []
    budget = getattr(args, "tree_budget", None)  # None: not given (the default budget applies silently)
    if budget and args.mode in ("ar", "dflash"):
        notes.append(f"--tree-budget {budget} ignored: --mode {args.mode} has no final-stage tables to build a tree from")
    elif budget and getattr(args, "runtime", None) == "hf":
        notes.append(f"--tree-budget {budget} ignored: trees need the dense runtime (--runtime auto or dense)")
    elif budget and getattr(args, "proposer", None) == "ngram":
        notes.append(f"--tree-budget {budget} ignored: --proposer ngram copies chains (no drafter tables)")
    if budget == 0 and getattr(args, "tree_shape", "dynamic") != "dynamic":
        notes.append(f"--tree-shape {args.tree_shape} ignored: --tree-budget is 0 (a chain)")
    if getattr(args, "tree_size", None) == "cost":  # given explicitly (the default applies silently)
        if budget == 0:
            notes.append("--tree-size cost ignored: --tree-budget is 0 (a chain)")
        elif getattr(args, "verify_policy", None) == "fixed":
            notes.append("--tree-size cost ignored: it needs the cost policy's measured costs (--verify-policy cost)")
        elif getattr(args, "tree_shape", "dynamic") != "dynamic":
            notes.append(f"--tree-size cost ignored: --tree-shape {args.tree_shape} is static (cost sizes best-first trees)")
    return notes


def add_generate_parser(sub) -> None:
    p = sub.add_parser("generate", help="generate text with speculative decoding",
                       description="Generate text for one prompt with speculative decoding; greedy output is "
                                   "the target's own, sampled output distributed as its sampler. The common "
                                   "options come first; the advanced groups change speed only.")
    p.add_argument("prompt")
    g = p.add_argument_group("what to generate")
    g.add_argument("--target", default="smollm2-135m", help="target name, HF dir, .gguf, or random:<arch>")
    g.add_argument("--chat", action="store_true", help="apply the target's chat template")
    g.add_argument("--max-new-tokens", type=positive_int, default=128)
    g.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    g = p.add_argument_group("sampling (the default is greedy)")
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    g.add_argument("--top-k", type=int, default=0, help="0 = off")
    g.add_argument("--top-p", type=float, default=1.0, help="1 = off")
    g.add_argument("--min-p", type=float, default=0.0, help="0 = off")
    g.add_argument("--seed", type=seed_int, default=0, help="seed of the request's sampler (0 .. 2**63-1); the same seed repeats its sample under --verify-policy fixed (the cost policy's lengths follow measured times)")
    g = p.add_argument_group("speculation")
    g.add_argument("--mode", default="dspine", help="ar (the target alone) | dflash | dspine")
    g.add_argument("--drafter", default=None, help="drafter checkpoint dir, or 'random' (default: shipped)")
    g.add_argument("--verify-policy", default=None,
                   help="cost (default: choose n per cycle by measured cost and past acceptance, down to "
                        "plain target steps when drafting does not pay on this machine; non-anticipating, "
                        "so sampling stays exact) | fixed (verify the whole block every cycle)")
    add_proposer_args(g)
    g.add_argument("--block-size", type=int, default=None,
                   help="must equal the drafter checkpoint's (default: the checkpoint's; 16 for --drafter random)")
    g = p.add_argument_group("output")
    g.add_argument("--json", action="store_true", help="print one JSON object with text, ids and stats")
    g.add_argument("--no-progress", action="store_true",
                   help="no progress bar or measurement notes on stderr")
    g = p.add_argument_group("advanced: device, dtype, kernels and tuning (speed only; measured per machine "
                             "by default, `dspine tune` shows the choices)")
    g.add_argument("--dtype", default="float32", help="float32 | bfloat16")
    g.add_argument("--device", default="cpu", help="cpu | cuda | cuda:N | auto (CUDA when available)")
    g.add_argument("--threads", type=thread_count, default=0,
                   help="torch CPU threads (default 0: one per core, less the cores other processes keep busy when it starts (measured for 0.3 s; OMP_NUM_THREADS also chooses))")
    add_drafter_kernel_args(g)
    add_target_runtime_args(g)
    add_target_weights_arg(g)
    add_tree_args(p.add_argument_group("advanced: draft trees"), DEFAULT_TREE_BUDGET)
    p.set_defaults(func=cmd_generate)


def _optional_parsers(sub) -> None:
    """Subcommands contributed by other modules (added when present)."""
    import importlib

    for mod, fn in (("dspine.data.cli", "add_data_parser"), ("dspine.train.cli", "add_train_parser"),
                    ("dspine.bench.cli", "add_bench_parser"), ("dspine.serve.cli", "add_serve_parser"),
                    ("dspine.cli.memory", "add_memory_parser"), ("dspine.tune.cli", "add_tune_parser"),
                    ("dspine.export.cli", "add_export_parser")):
        try:
            m = importlib.import_module(mod)
        except ModuleNotFoundError as e:
            if e.name and (e.name == mod or mod.startswith(e.name + ".") or e.name.startswith(mod)):
                continue
            raise
        getattr(m, fn)(sub)


def _show_defaults(parser: argparse.ArgumentParser) -> None:
    """Append ``default: X`` to the ``--help`` text of every option (of every subcommand)
    that has a non-trivial default and does not state it already."""
    for a in parser._actions:
        if isinstance(a, argparse._SubParsersAction):
            for p in dict.fromkeys(a.choices.values()):  # aliases map to the same parser
                _show_defaults(p)
            continue
        if not a.option_strings or a.help == argparse.SUPPRESS or a.default is None or a.default is False \
                or a.default == argparse.SUPPRESS:
            continue
        if "default" in (a.help or "").lower():
            continue
        a.help = f"{a.help} (default: %(default)s)" if a.help else "default: %(default)s"


#: flags not spelled ``--`` + the field's name with ``-``: ``(command, field) -> flag``
#: (``serve`` runs ``concurrency`` requests as ``--max-running``)
FLAG_SPELLINGS = {("serve", "concurrency"): "--max-running"}


def flag_message(error, command: str | None = None) -> str:
    """The text of ``error`` (an exception or a message) for the command line: the library
    names :class:`~dspine.config.SpeculativeConfig` fields, the command line its flags.

    ``SpeculativeConfig.tree_budget -1`` becomes ``--tree-budget -1`` and a suggested value
    ``SpeculativeConfig.linear_backend='aten'`` becomes ``--linear-backend aten`` (the flag is
    ``--`` + the field's name with ``-``, or :data:`FLAG_SPELLINGS`'s for ``command``). Every
    command's error path uses it, whatever the exception's class: wrappers such as
    ``EngineError(str(e))`` keep the field's name in their text.
    """
    def flag(m: re.Match) -> str:
        name = m.group(1)
        f = FLAG_SPELLINGS.get((command, name), "--" + name.replace("_", "-"))
        return f if m.group(2) is None else f"{f} {m.group(2)}"

    return re.sub(r"SpeculativeConfig\.([a-z_]+)(?:='([^']*)')?", flag, str(error))


class _Parser(argparse.ArgumentParser):
    """argparse parser whose usage errors become one ``dspine: error:`` line (exit 2)."""

    def error(self, message):
        raise ValueError(f"{message} (see `{self.prog} --help`)")


class Terminated(KeyboardInterrupt):
    """SIGTERM, turned into an interruption so long commands stop as cleanly as on Ctrl-C."""


def _on_sigterm(signum, frame):
    raise Terminated()


def main(argv: list[str] | None = None) -> int:
    """Entry point. Returns the exit code (2 for bad settings, 130 when interrupted by
    SIGINT, 143 by SIGTERM; either way what was saved is kept, as on Ctrl-C: a
    ``kill PID`` of a background ``data build`` / ``train`` is a clean stop too)."""
    import signal
    import threading

    from dspine import __version__

    parser = _Parser(prog="dspine", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"dspine {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    add_generate_parser(sub)
    _optional_parsers(sub)
    _show_defaults(parser)
    prev, args = None, None
    if threading.current_thread() is threading.main_thread() and \
            signal.getsignal(signal.SIGTERM) == signal.SIG_DFL:  # `serve` installs its own while serving
        prev = signal.signal(signal.SIGTERM, _on_sigterm)
    try:
        args = parser.parse_args(argv)
        return int(args.func(args) or 0)
    except (ValueError, FileNotFoundError, NotADirectoryError, FileExistsError) as e:
        # our errors subclass ValueError; the library names fields, the command its flags
        msg = flag_message(e, getattr(args, "command", None))
        print(f"dspine: error: {msg}".splitlines()[0], file=sys.stderr)
        return 2
    except BrokenPipeError:  # output piped into e.g. `head`, which closed early
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except KeyboardInterrupt as e:
        print(f"dspine: {'terminated' if isinstance(e, Terminated) else 'interrupted'}; what was saved is "
              f"kept (resumable commands continue with --resume)", file=sys.stderr)
        return 143 if isinstance(e, Terminated) else 130
    finally:
        if prev is not None:
            signal.signal(signal.SIGTERM, prev)


if __name__ == "__main__":
    sys.exit(main())
