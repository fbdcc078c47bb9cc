"""Fair comparisons: every mode of a bench run shares one setup (spec section 10).

:func:`check_fair` refuses records (mode -> dict of setup fields) that differ across
modes; :func:`check_rows_fair` applies it to result rows, per run and per request.
Shared by the harness (before running) and the summary (before summarizing), so
neither imports the other.
"""
from __future__ import annotations

import hashlib
import json


class BenchError(ValueError):
    """A benchmark setting the harness refuses (the message names it)."""


class UnfairComparisonError(BenchError):
    """Modes of one run differ in target, precision, device, threads or decoding settings."""


#: setup fields an external engine's mode may hold apart from dspine's modes: a peer such as
#: llama.cpp runs the same target from its own weights file (recorded in ``external_weights``)
EXTERNAL_FIELDS = ("weights", "dtype", "external_weights")


def check_fair(records: dict[str, dict], what: str = "setup") -> None:
    """Refuse a comparison whose modes differ in any field of ``records`` (mode -> dict).

    A record holding ``external_weights`` (an external engine's mode, e.g. llama.cpp on a
    GGUF of the target) is compared on :data:`EXTERNAL_FIELDS` only with the other external
    records; every other field (target, device, threads, decoding) must match all modes.

    Raises:
        UnfairComparisonError: naming the differing fields and the value per mode.
    """
    if len(records) < 2:
        return
    keys = sorted(set().union(*(r.keys() for r in records.values())))
    diffs = []
    for k in keys:
        groups = [records]
        if k in EXTERNAL_FIELDS:
            groups = [{m: r for m, r in records.items() if ("external_weights" in r) == ext} for ext in (False, True)]
        for grp in groups:
            vals = {m: json.dumps(r.get(k), sort_keys=True, default=str) for m, r in grp.items()}
            if len(set(vals.values())) > 1:
                diffs.append(f"{k} (" + ", ".join(f"{m}: {grp[m].get(k)!r}" for m in grp) + ")")
    if diffs:
        raise UnfairComparisonError(
            f"unfair comparison: {what} differs across modes in {'; '.join(diffs)}. Every mode of a "
            f"run must share one target checkpoint, dtype, device, threads, prompts and decoding settings")


def _prompt_hash(ids: list[int]) -> str:
    return hashlib.sha256(json.dumps(ids).encode()).hexdigest()[:16]


def check_rows_fair(rows: list[dict]) -> None:
    """Result rows of one comparison must share the setup, and per request the prompt and
    decoding settings, across modes (raises :class:`UnfairComparisonError`)."""
    rows = [r for r in rows if not r.get("warmup")]
    seen: set[str] = set()
    setups: dict[str, dict] = {}
    for r in rows:  # one entry per distinct setup (a mode seen twice with another setup too)
        js = json.dumps(r["setup"], sort_keys=True, default=str)
        if js not in seen:
            seen.add(js)
            label = r["mode"] if r["mode"] not in setups else f"{r['mode']} (run {r.get('run_id')})"
            setups[label] = r["setup"]
    check_fair(setups, "setup")
    groups: dict[tuple, dict] = {}
    for r in rows:
        key = (r["concurrency"], r["setting"], r["workload"], r["prompt_id"], r["repeat"])
        groups.setdefault(key, {})[r["mode"]] = {"prompt": r["prompt_hash"], "decoding": r["decoding"],
                                                 "seed": r["seed"], "workload": r["workload_version"]}
    for key, recs in groups.items():
        check_fair(recs, f"request {key[2]}/{key[3]} (setting {key[1]}, repeat {key[4]})")
