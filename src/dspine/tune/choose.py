"""Time alternatives on this machine and choose the fastest, with a cached result.

:func:`choose_fastest` is the one rule every tuned setting follows: each alternative is
timed (a warm-up call, then the median of ``repeats`` calls), the fastest is chosen,
and the table of times is stored (:mod:`dspine.tune.store`) so later runs reuse it. An
alternative whose warm-up alone is ``cutoff`` times slower than the best so far is not
timed further (an int8 ``_int_mm`` on an AVX2-only CPU takes seconds per call); one that
raises is recorded as unavailable. A kernel measured much slower than another is thus
never chosen. Tests inject ``timer`` to check the rule without depending on the CPU.

Each stored result carries the conditions it was measured under (time, load average, the
cores other processes kept busy, the spread of its rounds; :mod:`dspine.tune.conditions`).
A result measured on a busy machine, or whose rounds disagree (measured once more first),
is stored as provisional and measured again by the first later run on a quiet machine.
"""
from __future__ import annotations

import math
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Callable

from dspine.tune import store
from dspine.tune.conditions import MAX_SPREAD, LoadMeter, conditions, remeasure, spread_of


@dataclass
class Choice:
    """Outcome of one measured question.

    key: what was measured (shapes included). chosen: the alternative's name.
    times_ms: per alternative the median call time in milliseconds, or None when it
    failed (its error in ``errors``). reason: one human-readable line. cached: True when
    read from the tune cache rather than measured now.
    """

    key: str
    chosen: str
    times_ms: dict[str, float | None]
    reason: str
    cached: bool = False
    errors: dict[str, str] = field(default_factory=dict)

    def to_dict(self) -> dict:
        return asdict(self)


Timer = Callable[[str, Callable[[], object], int, float], float]


def _keeping() -> str:
    """How long a measurement is kept, for the progress line: on disk, or (``DSPINE_TUNE=off``)
    in this process only."""
    return "once; cached" if store.enabled() else "DSPINE_TUNE=off: kept in this process only"


def measure(name: str, fn: Callable[[], object], repeats: int = 3, cap_s: float = float("inf")) -> float:
    """Median seconds of ``repeats`` calls of ``fn`` after one warm-up call. When the
    warm-up alone takes longer than ``cap_s``, its time is returned without repeats."""
    t0 = time.perf_counter()
    fn()
    first = time.perf_counter() - t0
    if first > cap_s:
        return first
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def cached_choice(key: str, names, device="cpu") -> Choice | None:
    """The cached :class:`Choice` for ``key`` when it is well-formed (its choice one of
    ``names``, times numbers or None), else None (a damaged entry is measured again)."""
    hit = store.get(key, device)
    if hit is None or remeasure(hit):  # provisional or stale, and the machine is quiet now
        return None
    chosen, times = hit.get("chosen"), hit.get("times_ms", {})
    if not isinstance(chosen, str) or chosen not in names or not isinstance(times, dict) \
            or not all(v is None or (isinstance(v, (int, float)) and not isinstance(v, bool)) for v in times.values()):
        return None
    errors = hit.get("errors") if isinstance(hit.get("errors"), dict) else {}
    reason = hit.get("reason") if isinstance(hit.get("reason"), str) else ""
    return Choice(key, chosen, times, reason, True, errors)


def choose_fastest(key: str, alternatives: dict[str, Callable[[], object]], *, repeats: int = 3,
                   cutoff: float = 4.0, timer: Timer | None = None, device="cpu", redo: bool = False,
                   progress: bool = False, what: str = "", rounds: int = 1) -> Choice:
    """Choose the fastest of ``alternatives`` (name -> zero-argument callable).

    Args:
        key: cache key (include every shape and dtype the timing depends on).
        alternatives: in order of preference on exact ties.
        repeats: timed calls per alternative (after a warm-up).
        cutoff: an alternative whose warm-up exceeds ``cutoff`` x the best time so far
            is not timed further.
        timer: ``timer(name, fn, repeats, cap_s) -> seconds`` (default :func:`measure`).
        redo: measure again even when cached.
        progress: print one line on stderr while measuring.
        what: words for that line (e.g. "drafter candidate pass, 15 rows").
        rounds: with more than 1, every alternative is timed once per round, in an order
            rotated per round, and its time is the median over rounds: a drift of the
            machine's load then hits every alternative alike (for close alternatives).
    Raises:
        ValueError: no alternatives, or every alternative failed.
    """
    if not alternatives:
        raise ValueError(f"tune {key}: no alternatives to choose from")
    if not isinstance(rounds, int) or isinstance(rounds, bool) or rounds < 1:
        raise ValueError(f"tune {key}: rounds must be an integer >= 1, got {rounds!r}")
    if not redo:
        hit = cached_choice(key, alternatives, device)
        if hit is not None:
            return hit
    if progress:
        store.first_use_note(device)
        print(f"dspine: measuring {what or key} on this machine ({_keeping()}) ...", file=sys.stderr, flush=True)
    timer = timer or measure
    t_start = time.perf_counter()
    choice, spread, meter = _measure_all(key, alternatives, repeats, cutoff, timer, rounds)
    if rounds > 1 and spread is not None and spread > MAX_SPREAD:  # the rounds disagree: once more
        choice, spread, meter = _measure_all(key, alternatives, repeats, cutoff, timer, rounds)
    cond = conditions(meter, spread)
    if progress:
        flag = f"; provisional: {cond['provisional_why']} (measured again on a quiet run)" if cond["provisional"] else ""
        print(f"dspine: ... {choice.reason} ({time.perf_counter() - t_start:.1f} s{flag})", file=sys.stderr,
              flush=True)
    store.put(key, {**{k: v for k, v in choice.to_dict().items() if k not in ("key", "cached")}, **cond}, device)
    return choice


def _measure_all(key, alternatives, repeats, cutoff, timer, rounds) -> tuple[Choice, float | None, LoadMeter]:
    """One measurement of every alternative (see :func:`choose_fastest`): the choice, the
    spread of the chosen alternative's rounds, and the load meter that ran beside it."""
    times: dict[str, float | None] = {}
    errors: dict[str, str] = {}
    best = float("inf")
    names = list(alternatives)
    per_round: dict[str, list[float]] = {n: [] for n in names}
    with LoadMeter() as meter:
        for r in range(max(1, int(rounds))):
            for name in names[r % len(names):] + names[:r % len(names)]:
                if name in errors:
                    continue
                try:
                    s = float(timer(name, alternatives[name], repeats, cutoff * best))
                    if not (s >= 0 and math.isfinite(s)):
                        raise ValueError(f"measured {s!r} s")
                except Exception as e:  # an unsupported kernel on this CPU/torch: not a choice
                    times[name], errors[name] = None, f"{type(e).__name__}: {e}"[:200]
                    continue
                per_round[name].append(s)
                times[name] = statistics.median(per_round[name]) * 1e3
                best = min(best, s)
    ok = {n: t for n, t in times.items() if t is not None}
    if not ok:
        raise ValueError(f"tune {key}: every alternative failed: {errors}")
    chosen = min(ok, key=lambda n: (ok[n], list(alternatives).index(n)))
    others = sorted((t / ok[chosen], n) for n, t in ok.items() if n != chosen)
    reason = f"{chosen} {ok[chosen]:.2f} ms" + (
        "; " + ", ".join(f"{n} {r:.1f}x slower" for r, n in others) if others else "")
    return Choice(key, chosen, times, reason, False, errors), spread_of(per_round[chosen]), meter


def cached_measurement(key: str, measure_fn: Callable[[], int], *, valid: Callable[[object], bool],
                       device="cpu", redo: bool = False, progress: bool = False, what: str = "") -> int:
    """A measured integer setting of this machine (e.g. how many rows a kernel takes),
    cached under ``key`` with the conditions it was measured under, like a :class:`Choice`:
    ``measure_fn()`` runs only when nothing usable is cached (none, damaged, ``valid``
    refuses it, or provisional/stale while the machine is quiet now) or with ``redo``.
    Returns the value.

    Raises:
        whatever ``measure_fn`` raises (nothing is cached then).
    """
    if not redo:
        hit = store.get(key, device)
        if hit is not None and not remeasure(hit) and isinstance(hit.get("value"), int) \
                and not isinstance(hit.get("value"), bool) and valid(hit["value"]):
            return hit["value"]
    if progress:
        store.first_use_note(device)
        print(f"dspine: measuring {what or key} on this machine ({_keeping()}) ...", file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    with LoadMeter() as meter:
        value = int(measure_fn())
    cond = conditions(meter, None)
    if progress:
        print(f"dspine: ... {value} ({time.perf_counter() - t0:.1f} s)", file=sys.stderr, flush=True)
    store.put(key, {"value": value, "reason": f"{what or key}: {value}", **cond}, device)
    return value

