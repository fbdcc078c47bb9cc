"""``dspine tune``: measure (or show the cached) hardware-dependent choices of this machine.

Prints the machine (CPU model and instruction-set class, threads, torch), then for the
target and drafter given: the candidate-pass kernel per row bucket with every kernel's
time, the target's dtype for batched decoding and feature extraction, and the
verification cost curve the cost policy starts from. ``--redo`` measures everything again;
``--show`` prints what is cached, when and under what load, and measures nothing
(:mod:`dspine.tune.conditions`); ``--json`` prints one JSON object.
"""
from __future__ import annotations

import json
import os
import sys

from dspine.argtypes import positive_int, thread_count


def _fmt(times: dict) -> str:
    return ", ".join(f"{k} {f'{v:.2f} ms' if isinstance(v, (int, float)) else 'failed'}" for k, v in times.items())


def _profile_line(e: dict) -> str:
    """One line for a saved acceptance profile (:func:`dspine.tune.controller.save_profile`)."""
    try:
        risk, acc = [float(x) for x in e["risk"]], [float(x) for x in e["acc"]]
        rows = ", ".join(f"{a / r:.2f}" for a, r in zip(acc[:4], risk[:4]) if r > 0)
        return f"acceptance profile: {risk[0]:.1f} drafted cycles pooled (decayed); row acceptance {rows or '-'}"
    except (KeyError, TypeError, ValueError, IndexError):
        return "acceptance profile: unreadable (ignored; the next run learns a new one)"


def _other_thread_counts(device: str) -> list[tuple[int, int]]:
    """(threads, measurements) of this machine's cache files for other thread counts (the
    cache is keyed by the machine's facts, threads included)."""
    from dspine.tune import store
    from dspine.tune.machine import machine_info

    here = machine_info(device)
    same = {k: v for k, v in here.items() if k != "threads"}
    out = []
    try:
        files = sorted(store.path(device).parent.glob("*.json"))
    except (OSError, ValueError):
        return []
    for f in files:
        try:
            data = json.loads(f.read_text())
            m = data["machine"]
            if {k: v for k, v in m.items() if k != "threads"} == same and m["threads"] != here["threads"]:
                out.append((int(m["threads"]), len(data.get("entries") or {})))
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            continue  # not a cache file of this machine
    return sorted(out)


def show(device: str = "cpu", as_json: bool = False) -> int:
    """``dspine tune --show``: what this machine's cache holds, measured when and under what
    load, and which entries are provisional or stale (re-measured by the next quiet run).
    Loads no model and measures nothing."""
    from dspine.tune import store
    from dspine.tune.conditions import untrusted_reason
    from dspine.tune.machine import describe

    data = store.load(device)
    entries = data.get("entries", {})
    if as_json:
        print(json.dumps({"machine": data.get("machine"), "cache": str(store.path(device)), "entries": entries},
                         default=str))
        return 0
    print(f"machine: {describe(device)}")
    if not store.enabled():  # the file is neither read nor written: its path and count would mislead
        print(f"cache:   off (DSPINE_TUNE={os.environ.get('DSPINE_TUNE')}): this process's {len(entries)} "
              f"measurements only; the file {store.path(device)} is not read")
    else:
        print(f"cache:   {store.path(device)} ({len(entries)} measurements)")
        for threads, n in _other_thread_counts(device):
            print(f"         also cached here for {threads} thread{'s' if threads != 1 else ''}: {n} measurements "
                  f"(`dspine tune --show --threads {threads}`; dspine runs on fewer threads when other "
                  f"processes keep cores busy)")
    for key in sorted(entries):
        e = entries[key]
        if not isinstance(e, dict):
            continue
        if "curve" in e and isinstance(e["curve"], dict):
            v, ps = e["curve"].get("verify_s"), e["curve"].get("propose_s")
            if isinstance(v, list) and v and all(isinstance(x, (int, float)) for x in v):
                # a whole cycle (proposing + verifying), as the first run and drafter_breakeven.py print it
                full = v[-1] + (ps[-1] if isinstance(ps, list) and len(ps) == len(v)
                                and isinstance(ps[-1], (int, float)) else 0.0)
                what = (f"cost curve: plain step {v[0] * 1e3:.1f} ms, {len(v) - 1} drafted tokens {full * 1e3:.1f} ms"
                        + (f" ({v[-1] * 1e3:.1f} ms of it verifying)" if full > v[-1] else ""))
                if e.get("label"):  # what it is for (entries written before 2026-12-06 have no label)
                    what = f"{what}\n  for {e['label']}"
            else:  # a damaged entry: shown, never trusted (the next run measures it again)
                what = "cost curve: unreadable (measured again by the next run)"
        elif key.startswith("profile:"):  # what the cost policy learned: acceptance, not a timing
            print(f"\n{key}\n  {_profile_line(e)}\n  saved {e.get('measured_at') or '(time not recorded)'}, load "
                  f"average {e.get('loadavg_1m', '?')} (acceptance does not depend on load; the few cycle "
                  f"costs it holds are relearned within a request)")
            continue
        else:
            what = str(e.get("reason") or e.get("chosen"))
        when = e.get("measured_at") or "time not recorded"
        load = e.get("others_cores")
        cond = f"{when}, load average {e.get('loadavg_1m', '?')}" + (
            f", other processes ~{load:.1f} cores" if isinstance(load, (int, float)) else "")
        why = untrusted_reason(e)
        old = _older_kernels(key)
        print(f"\n{key}\n  {what}\n  measured {cond}" + (f"\n  NOT TRUSTED: {why} (measured again by the next "
                                                          f"run on a quiet machine)" if why else "")
              + (f"\n  not used: {old}" if old else ""))
    return 0


def _older_kernels(key: str) -> str | None:
    """Why an entry keyed by another version of the blockq kernels' source (``kernels=HASH``)
    is not used now (a cost curve's key is a digest and is not judged here), or None."""
    import re

    m = re.search(r"kernels=([0-9a-f]{6,})", key)
    if not m:
        return None
    try:
        from dspine.runtime.blockq import source_version
    except Exception:  # noqa: BLE001 (a listing never fails on this)
        return None
    cur = source_version()
    return None if m.group(1) == cur else f"measured with other kernels ({m.group(1)}; this install's are {cur})"


def cmd_tune(args) -> int:
    import torch

    from dspine.guards import resolve_device

    args.device = str(resolve_device(args.device))  # ValueError naming --device (tpu, ...) before anything runs
    if args.threads:  # the cache is per thread count: --show --threads N shows that one
        torch.set_num_threads(args.threads)
    if args.show:
        return show(args.device, args.json)

    from dspine.build import build_engine, check_installed_choices, check_drafter_setting
    from dspine.config import SpeculativeConfig
    from dspine.tune.cost import measure_cost
    from dspine.tune import store
    from dspine.tune.choose import choose_fastest
    from dspine.tune.dtype import choose_forward_dtype
    from dspine.tune.head import plan_candidate_pass
    from dspine.tune.machine import describe, machine_info

    if args.threads:
        torch.set_num_threads(args.threads)
    config = SpeculativeConfig(target=args.target, drafter=args.drafter, mode=args.mode, dtype=args.dtype,
                               device=args.device, proposer="drafter", verify_policy="fixed", linear_backend="aten",
                               head_kernel="exact", tree_budget=0)  # each choice is measured below, in the table
    report: dict = {"machine": machine_info(args.device), "cache": str(store.path(args.device))}
    check_installed_choices(config)  # settings refused before --redo forgets anything
    check_drafter_setting(config)
    before = json.loads(json.dumps(store.load(args.device)["entries"])) if args.redo else {}
    if args.redo:
        store.clear(args.device)
    say = (lambda *a: print(*a, file=sys.stderr, flush=True)) if args.json else print
    say(f"machine: {describe(args.device)}")
    say(f"cache:   {report['cache']}")
    try:
        target, eng = build_engine(config, progress=not args.json)
    except Exception:  # a setting refused while loading (dtype, target, checkpoint): --redo forgets nothing
        store.restore(before, args.device)
        raise

    prop = eng.proposer
    from dspine.runtime.packed import apply_linear_backend, choose_linear_backend

    report["target_runtime"] = target.runtime_name  # build_engine's --runtime auto (dspine.runtime.select)
    say(f"\ntarget runtime (--runtime auto): {target.runtime_name}"
        + ("" if target.runtime_name == "dense" else " (dspine's dense runtime does not support this target)"))
    lb = choose_linear_backend(target, redo=args.redo, progress=not args.json)
    apply_linear_backend(target, lb.chosen, progress=False)
    report["linear_backend"] = lb.to_dict()
    say("\ntarget linear layers (one-token step + 16-token verification; --linear-backend auto):")
    say(f"  -> {lb.chosen:<9} ({_fmt(lb.times_ms) or lb.reason}){' [cached]' if lb.cached else ''}")
    from dspine.runtime.blockq import unavailable_reason

    if "blockq" not in (lb.times_ms or {}):  # say why the exact-block kernels were not measured
        why = unavailable_reason() or ("this target's weights are not exact Q4_1/Q8_0 blocks (only targets "
                                       "converted from such a GGUF are), or it is not a float32 CPU target")
        report["blockq_unavailable"] = why
        say(f"  (blockq not offered: {why})")
    rt = getattr(target, "runtime", None)
    if rt is not None and hasattr(rt, "decode_path"):  # dspine.runtime.lean: few-row forwards in one C++ call
        from dspine.runtime.lean import lean_support

        plan = rt.lean_plan()
        report["decode_path"] = rt.decode_path
        say(f"  decode path: {rt.decode_path}" + (f" (every layer in one C++ call for forwards of up to {plan.rows} "
                                                  f"rows, measured)" if plan is not None
                                                  else f" (lean path not used: {lean_support(rt)})"))
    if prop is not None:
        ids = getattr(prop.qhead, "ids", None)  # the checkpoint's draft vocabulary (--draft-vocab auto)
        cp = plan_candidate_pass(prop.drafter.head, prop.drafter.fc.weight.dtype, "auto", progress=not args.json,
                                 redo=args.redo, ids=ids)
        prop.qhead = cp
        report["candidate_pass"] = {f"rows<={b}": c.to_dict() for b, c in cp.choices.items()}
        scored = "all vocabulary tokens" if ids is None else f"the {ids.numel()} ids of its draft vocabulary"
        say(f"\ncandidate pass (the drafter scores {scored} to pick its candidates; "
            "kernel per number of rows scored at once; --head-kernel auto):")
        for b, c in cp.choices.items():
            say(f"  rows<={b:<3} -> {c.chosen:<9} ({_fmt(c.times_ms)}){' [cached]' if c.cached else ''}")
        c = prop.linears_choice
        say("\ndrafter linear layers (one 4-row block forward; --drafter-linears auto; q8 = a copy on Q8_0 "
            "blocks, the output stays the target's):")
        if c is not None:
            report["drafter_linears"] = c.to_dict()
            say(f"  -> {c.chosen:<9} ({_fmt(c.times_ms)}){' [cached]' if c.cached else ''}")
        else:
            from dspine.drafter.q8 import q8_unavailable

            report["drafter_linears"] = {"chosen": prop.linears}
            say(f"  -> {prop.linears:<9} (q8 not offered: {q8_unavailable(prop.drafter) or 'forced'})")
        fwd = prop.kernel_info()["drafter_forward"]
        report["drafter_forward"] = fwd
        say(f"  block forward: {fwd} ({'one C++ call per block' if fwd == 'lean' else 'PyTorch operations'})")
    say("\ntarget dtype for batched work (`dspine data build --dtype auto`, `dspine train features "
        "--compute-dtype auto`; decoding itself stays float32 unless --dtype says otherwise):")
    report["batched_dtype"] = {}
    for name, b, L, dec in (("data build decode step", args.data_batch, 64, True),
                            ("feature extraction forward", 4, 128, False)):
        c = choose_forward_dtype(target, b, L, dec, redo=args.redo, progress=not args.json)
        report["batched_dtype"][name] = c.to_dict()
        say(f"  {name} ({b}x{L}) -> {c.chosen:<8} ({_fmt(c.times_ms)}){' [cached]' if c.cached else ''}")
    if prop is not None:
        curve = measure_cost(target, prop, n_max=prop.block_size - 1, progress=not args.json)
        report["cost_curve_ms"] = {"verify": [round(v * 1e3, 2) for v in curve.verify_s],
                                   "propose": [round(v * 1e3, 2) for v in (curve.propose_s or [])]}
        say("\ncycle cost curve in ms (n = drafted tokens verified per cycle; n = 0 is a plain target "
            "step; the default --verify-policy cost starts from it):")
        say("  n       " + " ".join(f"{n:>4}" for n in range(curve.n_max + 1)))
        say("  verify  " + " ".join(f"{v * 1e3:>4.0f}" for v in curve.verify_s))
        say("  draft   " + " ".join(f"{v * 1e3:>4.0f}" for v in (curve.propose_s or [])))
        ratio = curve.cycle_s(curve.n_max) / max(curve.cycle_s(0), 1e-12)
        say(f"  a full block ({curve.n_max} drafted) costs {ratio:.2f} plain steps: it pays when the "
            f"drafter's tau (tokens per cycle) exceeds that")
        report["full_block_in_plain_steps"] = round(ratio, 3)
    if args.json:
        print(json.dumps(report, default=str))
    return 0


def add_tune_parser(sub) -> None:
    p = sub.add_parser("tune", help="measure / show this machine's kernel and dtype choices (cached)",
                       description=__doc__)
    p.add_argument("--target", default="smollm2-135m", help="target name, HF dir, .gguf, or random:<arch>")
    p.add_argument("--drafter", default=None, help="drafter checkpoint dir, or 'random' (default: shipped)")
    p.add_argument("--mode", default="dspine", help="ar | dflash | dspine")
    p.add_argument("--dtype", default="float32", help="float32 | bfloat16 (the decoding dtype to measure)")
    p.add_argument("--device", default="cpu", help="cpu | cuda | cuda:N")
    p.add_argument("--threads", type=thread_count, default=0, help="torch CPU threads (0 = torch's own default)")
    p.add_argument("--data-batch", type=positive_int, default=32, help="batch of `dspine data build` to measure at")
    p.add_argument("--redo", action="store_true", help="forget this machine's cached choices and measure again")
    p.add_argument("--show", action="store_true",
                   help="print what is cached (when, under what load, which entries are provisional or stale) "
                        "and exit; measures nothing")
    p.add_argument("--json", action="store_true", help="print one JSON object (the table goes to stderr)")
    p.set_defaults(func=cmd_tune)
