"""CPU speed by default check, as a user runs it: the default ``dspine generate`` against the same
command with ``--mode ar``, on held-out code and chat prompts never used for training or
tuning, greedy, side by side.

Every (round, prompt) runs both commands as separate processes, in an order that
alternates per (round, prompt), so drift of the machine's load hits both alike; the
figure per run is the command's own ``stats.tokens_per_second`` (decode only: the 5-10 s
of loading are not counted for either). Output ids of the two must be equal (greedy is
lossless). The tuned-on held-out prompts (the first 16 of each set: trees, copy bonus) are
skipped with ``--offset``.

Writes a JSON file with the machine line (CPU model, instruction-set class, threads),
the load average at start and end, every run, the paired ratio per prompt (median over
rounds) and the medians per set, and prints a table.

    python benchmarks/defaults_vs_ar.py --n 4 --rounds 2 --out benchmarks/defaults-vs-ar/avx512-2026-12-03-early.json

``--old DIR`` (a checkout of another commit) adds a third command per (round, prompt): the
default ``dspine generate`` of that checkout (``PYTHONPATH=DIR/src``), in the same rotation,
and reports this checkout's default over the old one's (a refactor's "not slower" check).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path


def prompts(sets: list[str], n: int, offset: int) -> list[tuple[str, str, bool]]:
    """(name, prompt text, chat?) for ``n`` held-out prompts of each set after ``offset``."""
    from dspine.data.sources import heldout_prompts

    out = []
    for s in sets:
        for k, rec in enumerate(heldout_prompts(s, offset + n)[offset:]):
            if "prompt" not in rec:
                raise SystemExit(f"--sets: {s} records carry messages, not a prompt string")
            out.append((f"{s}{offset + k}", rec["prompt"], rec.get("kind") != "code"))
    return out


def run(prompt: str, chat: bool, mode: str | None, args, src: Path | None = None) -> dict:
    cmd = [sys.executable, "-m", "dspine.cli", "generate", prompt, "--json", "--no-progress",
           "--max-new-tokens", str(args.max_new_tokens), "--threads", str(args.threads)]
    if chat:
        cmd.append("--chat")
    if mode:
        cmd += ["--mode", mode]
    env = dict(os.environ)
    if src is not None:  # another checkout's code
        env["PYTHONPATH"] = str(src)
    p = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if p.returncode:
        raise SystemExit(f"{' '.join(cmd[:4])} ... exited {p.returncode}: {p.stderr[-2000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sets", nargs="+", default=["code", "chat"])
    ap.add_argument("--n", type=int, default=4, help="prompts per set")
    ap.add_argument("--offset", type=int, default=16, help="skip the first OFFSET prompts of each set (tuned on)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--old", type=Path, default=None, metavar="DIR",
                    help="a checkout of another commit: its default command runs beside (config 'old')")
    args = ap.parse_args()
    if args.old is not None and not (args.old / "src" / "dspine").is_dir():
        raise SystemExit(f"--old {args.old}: no src/dspine there (a dspine checkout is expected)")
    old_commit = subprocess.run(["git", "-C", str(args.old), "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True).stdout.strip() if args.old else None

    from dspine.tune.machine import machine_info

    mi = machine_info("cpu")
    ps = prompts(args.sets, args.n, args.offset)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    load0 = os.getloadavg()[0]
    t_start = time.time()
    runs = []
    for r in range(args.rounds):
        for k, (name, text, chat) in enumerate(ps):
            labels = ["default", "ar"] + (["old"] if args.old else [])
            shift = (r + k) % len(labels)
            order = labels[shift:] + labels[:shift]
            got = {}
            for label in order:
                res = run(text, chat, "ar" if label == "ar" else None, args,
                          args.old.resolve() / "src" if label == "old" else None)
                st = res["stats"]
                got[label] = res
                runs.append({"round": r, "prompt": name, "config": label, "tokens": st["output_tokens"],
                             "tokens_per_second": st["tokens_per_second"], "tau": st["accepted_length_mean"],
                             "token_ids": res["token_ids"], "kernels": st.get("kernels", {}),
                             "sources": st.get("sources", {})})
            same = all(g["token_ids"] == got["ar"]["token_ids"] for g in got.values())
            for x in runs[-len(labels):]:
                x["same_ids"] = same
            old = f", old default {got['old']['stats']['tokens_per_second']:.1f} tok/s" if "old" in got else ""
            print(f"round {r} {name}: default {got['default']['stats']['tokens_per_second']:.1f} tok/s "
                  f"(tau {got['default']['stats']['accepted_length_mean']:.2f}), ar "
                  f"{got['ar']['stats']['tokens_per_second']:.1f} tok/s{old}, same ids: {same}", flush=True)

    by = {(x["round"], x["prompt"], x["config"]): x for x in runs}
    per_prompt = {}
    for name, _, _ in ps:
        rs = [by[(r, name, "default")]["tokens_per_second"] / by[(r, name, "ar")]["tokens_per_second"]
              for r in range(args.rounds)]
        per_prompt[name] = round(statistics.median(rs), 3)
    per_set = {s: round(statistics.median([v for k, v in per_prompt.items() if k.startswith(s)]), 3)
               for s in args.sets}
    med = lambda label, s: round(statistics.median(x["tokens_per_second"] for x in runs  # noqa: E731
                                                   if x["config"] == label and x["prompt"].startswith(s)), 2)
    tau = lambda s: round(statistics.mean(x["tau"] for x in runs  # noqa: E731
                                          if x["config"] == "default" and x["prompt"].startswith(s)), 3)
    summary = {
        "what": "default `dspine generate` vs `--mode ar`, greedy, held-out prompts, separate processes, "
                "order alternated per (round, prompt)",
        "command": "python benchmarks/defaults_vs_ar.py " + " ".join(sys.argv[1:]),
        "machine": mi, "commit": commit, "load_avg_1m_start": round(load0, 2),
        "load_avg_1m_end": round(os.getloadavg()[0], 2), "wall_s": round(time.time() - t_start, 1),
        "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "kernels_default": runs[0]["kernels"] if runs[0]["config"] == "default" else runs[1]["kernels"],
        "median_tokens_per_second": {s: {"default": med("default", s), "ar": med("ar", s)} for s in args.sets},
        "tau_default_mean": {s: tau(s) for s in args.sets},
        "ratio_default_over_ar_per_prompt": per_prompt,
        "ratio_default_over_ar_median_per_set": per_set,
        "ratio_default_over_ar_median_all": round(statistics.median(per_prompt.values()), 3),
        "same_ids": f"{sum(x['same_ids'] for x in runs if x['config'] == 'ar')}/{len(runs) // (3 if args.old else 2)}",
        "runs": runs,
    }
    if args.old:
        po = {name: round(statistics.median(by[(r, name, "default")]["tokens_per_second"]
                                            / by[(r, name, "old")]["tokens_per_second"] for r in range(args.rounds)), 3)
              for name, _, _ in ps}
        summary["old_commit"] = old_commit
        summary["ratio_default_over_old_per_prompt"] = po
        summary["ratio_default_over_old_median_per_set"] = {
            s: round(statistics.median([v for k, v in po.items() if k.startswith(s)]), 3) for s in args.sets}
        summary["ratio_default_over_old_median_all"] = round(statistics.median(po.values()), 3)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(summary, indent=1) + "\n")
    print(f"\n{mi.get('cpu_model')} ({mi.get('isa')}), {args.threads} threads, load {summary['load_avg_1m_start']}"
          f" -> {summary['load_avg_1m_end']}, commit {commit}")
    print("set   | default tok/s | ar tok/s | default/ar (median of per-prompt medians) | tau default")
    for s in args.sets:
        m = summary["median_tokens_per_second"][s]
        print(f"{s:5} | {m['default']:13} | {m['ar']:8} | {per_set[s]:.3f}x | {summary['tau_default_mean'][s]}")
    print(f"all: {summary['ratio_default_over_ar_median_all']:.3f}x; same ids {summary['same_ids']}; -> {args.out}")
    if args.old:
        print(f"this checkout ({commit}) over {old_commit}, default command: "
              f"{summary['ratio_default_over_old_median_per_set']} (all {summary['ratio_default_over_old_median_all']}x)")


if __name__ == "__main__":
    main()
