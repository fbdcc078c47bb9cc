"""Under what conditions a measurement was taken, and whether it can be trusted.

Every cached measurement (:mod:`dspine.tune.store`) carries the conditions it was taken
under: when (``measured_at``, UTC ISO 8601), the 1-minute load average
(``loadavg_1m``), the cores kept busy by *other* processes while it ran
(``others_cores``, from /proc/stat minus this process's own CPU time) and the spread of
its repeats (``spread``: slowest / fastest repeat of the chosen alternative, 1.0 = all
equal). A measurement taken while other processes kept more than :data:`QUIET_CORES`
cores busy, or whose repeats disagree by more than :data:`MAX_SPREAD`, is *provisional*:
it is used, but re-measured by the first later run that finds the machine quiet (so is an
entry without recorded conditions, from an older cache). An entry
is *stale* when decoding observed cycle times far from it
(:class:`dspine.control.policy.CostModelPolicy`); it too is re-measured by the next quiet run.
``dspine tune --show`` prints all of this.
"""
from __future__ import annotations

import os
import time
from datetime import datetime, timezone

QUIET_CORES = 0.5  # other processes may keep at most this many cores busy during a measurement
MAX_SPREAD = 2.0  # slowest / fastest repeat above this: the repeats disagree


def _snap() -> tuple[int, int, int] | None:
    """(total jiffies, busy jiffies of all CPUs, this process's user+system jiffies)."""
    try:
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:]]
        with open("/proc/self/stat") as f:
            st = f.read().rsplit(")", 1)[1].split()
    except (OSError, ValueError, IndexError):
        return None
    idle = v[3] + (v[4] if len(v) > 4 else 0)
    return sum(v), sum(v) - idle, int(st[11]) + int(st[12])


class LoadMeter:
    """Context manager: the cores other processes kept busy between enter and exit
    (``others_cores``, None where /proc is unavailable or too little time passed)."""

    def __enter__(self) -> "LoadMeter":
        self.s0, self.s1 = _snap(), None
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        self.s1 = _snap()
        self.elapsed_s = time.perf_counter() - self.t0

    @property
    def others_cores(self) -> float | None:
        if self.s0 is None or self.s1 is None or self.s1[0] <= self.s0[0]:
            return None
        (t0, b0, m0), (t1, b1, m1) = self.s0, self.s1
        return max(0.0, ((b1 - b0) - (m1 - m0)) / (t1 - t0) * (os.cpu_count() or 1))


def others_now(interval_s: float = 0.3) -> float | None:
    """Cores kept busy by other processes over the next ``interval_s`` seconds (blocks)."""
    with LoadMeter() as m:
        time.sleep(interval_s)
    return m.others_cores


def load_mark() -> LoadMeter:
    """A started :class:`LoadMeter` for :func:`others_since` (nothing is waited for)."""
    return LoadMeter().__enter__()


def others_since(mark: LoadMeter | None, min_s: float = 0.2) -> float | None:
    """Cores kept busy by other processes since ``mark`` (:func:`load_mark`), without
    waiting; :func:`others_now` (a 0.3 s sample) when there is no mark or less than
    ``min_s`` seconds passed since it."""
    if mark is None or time.perf_counter() - mark.t0 < min_s:
        return others_now()
    m = LoadMeter()
    m.s0, m.t0 = mark.s0, mark.t0
    m.__exit__(None, None, None)
    return m.others_cores


def conditions(meter: LoadMeter | None, spread: float | None) -> dict:
    """The fields stored with a measurement (module docstring), ``provisional`` included."""
    try:
        la = round(os.getloadavg()[0], 2)
    except OSError:
        la = None
    others = meter.others_cores if meter is not None else None
    out = {"measured_at": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"), "loadavg_1m": la,
           "others_cores": None if others is None else round(others, 2),
           "spread": None if spread is None else round(float(spread), 3)}
    why = untrusted_reason(out)
    out["provisional"] = why is not None
    if why:
        out["provisional_why"] = why
    return out


def untrusted_reason(entry: dict) -> str | None:
    """Why the measurement ``entry`` describes is not to be trusted, or None."""
    if "measured_at" not in entry and not entry.get("stale"):
        return "its conditions were not recorded (an older cache)"
    if entry.get("stale"):
        return str(entry.get("stale_why") or "decoding observed times far from it")
    others, spread = entry.get("others_cores"), entry.get("spread")
    if isinstance(others, (int, float)) and others > QUIET_CORES:
        return f"other processes kept ~{others:.1f} cores busy while it ran"
    if isinstance(spread, (int, float)) and spread > MAX_SPREAD:
        return f"its repeats disagree (slowest {spread:.1f}x the fastest)"
    if entry.get("provisional") and entry.get("provisional_why"):  # a reason its measurer gave
        return str(entry["provisional_why"])
    return None


def remeasure(entry: dict, quiet_now=None) -> bool:
    """True when a cached ``entry`` should be measured again now: it is provisional or
    stale, and the machine is quiet now (``quiet_now()``: default :func:`others_now` <=
    :data:`QUIET_CORES`). A trusted entry, or an untrusted one on a still-busy machine, is
    used as it is (measuring again under the same load would not be better)."""
    if not (entry.get("provisional") or entry.get("stale") or "measured_at" not in entry):
        return False  # trusted (an entry without conditions predates them: measured again once)
    if quiet_now is not None:
        return bool(quiet_now())
    o = others_now()
    return o is not None and o <= QUIET_CORES


def spread_of(times) -> float | None:
    """Slowest / fastest of ``times`` (seconds), None for fewer than two or a zero time."""
    ts = [float(t) for t in times if t is not None]
    if len(ts) < 2 or min(ts) <= 0:
        return None
    return max(ts) / min(ts)
