"""Measure the cost curve of a decode cycle on this machine, once, and cache it.

:func:`measure_cost` times target forwards over n + 1 tokens and proposals of n tokens
(spec section 5) and stores the curve per machine (:mod:`dspine.tune.store`), keyed by the
target's and drafter's shapes, kernels and settings; :func:`flag_stale_curve` marks an
entry that decoding found far off, so the next quiet run measures it again. The curve
itself (:class:`dspine.control.cost_curve.CostCurve`) is what the controllers price with.
"""
from __future__ import annotations

import json
import statistics
import time

import torch

from dspine.control.cost_curve import CostCurve

_COST_CACHE: dict[tuple, CostCurve] = {}

def _isotonic(ys: list[float]) -> list[float]:
    """Least-squares non-decreasing fit (pool adjacent violators): timing noise must not
    make a longer verification look cheaper, and one slow outlier must not lift the rest."""
    blocks: list[list[float]] = []  # [mean, count]
    for y in ys:
        blocks.append([y, 1.0])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            m2, c2 = blocks.pop()
            m1, c1 = blocks.pop()
            blocks.append([(m1 * c1 + m2 * c2) / (c1 + c2), c1 + c2])
    out: list[float] = []
    for m, c in blocks:
        out += [m] * int(c)
    return out


def _interp(points: dict[int, float], n_max: int) -> list[float]:
    """Isotonic fit of the measured points, then piecewise-linear interpolation over 0..n_max."""
    xs = sorted(points)
    fit = dict(zip(xs, _isotonic([points[x] for x in xs])))
    out = []
    for n in range(n_max + 1):
        if n in fit:
            out.append(fit[n])
        else:
            hi = next(x for x in xs if x > n)
            lo = max(x for x in xs if x < n)
            out.append(fit[lo] + (fit[hi] - fit[lo]) * (n - lo) / (hi - lo))
    return out


@torch.no_grad()
def measure_cost(target, proposer=None, n_max: int = 15, context: int = 64, repeats: int = 3,
                 use_cache: bool = True, progress: bool = False) -> CostCurve:
    """Measure the cycle cost curve of ``target`` (+ ``proposer``) once and cache it.

    Runs target forwards of n+1 tokens after a ``context``-token prefix at a few n, in
    interleaved rounds (the median of max(``repeats``, :data:`INTERLEAVED_ROUNDS`) after a
    warm-up round), and proposals of n tokens at the same n >= 1 (the median of ``repeats``
    after a warm-up; other n interpolated by a monotone fit). Cached in memory per loaded
    (target, drafter, device, dtype, n_max) and on disk (:mod:`dspine.tune.store`, per
    machine) for targets and drafters loaded by name, keyed by their shapes, the
    candidate-pass kernels and the settings, so a later run skips the measurement.
    ``progress``: say on stderr that a measurement is running.
    """
    drafter = getattr(proposer, "drafter", None)
    key = (id(target.model), target.name, str(target.device), str(target.dtype), n_max,
           id(drafter) if drafter is not None else id(proposer), context, getattr(target, "linear_backend", "aten"),
           getattr(target, "runtime_name", "hf"), getattr(getattr(target, "runtime", None), "decode_path", None))
    if use_cache and key in _COST_CACHE:
        return _marked(_COST_CACHE[key])
    disk_key = _disk_key(target, proposer, n_max, context, repeats) if use_cache else None
    if disk_key is not None:
        from dspine.tune import store

        from dspine.tune.conditions import remeasure

        hit = store.get(disk_key, str(target.device))
        if hit is not None and not remeasure(hit):  # provisional or stale on a now quiet machine: again
            try:
                curve = CostCurve.from_dict(hit["curve"])
                curve.on_stale = flag_stale_curve
                curve.meta = {**curve.meta, "cache_key": disk_key,
                              **{k: hit[k] for k in ("measured_at", "loadavg_1m", "others_cores", "spread",
                                                     "provisional", "stale") if k in hit}}
                _COST_CACHE[key] = curve
                return _marked(curve)
            except (KeyError, TypeError, ValueError):
                pass  # an unreadable entry is measured again
    t_start = time.perf_counter()
    if progress:
        import sys

        from dspine.tune import store

        store.first_use_note(str(target.device))
        print("dspine: measuring the cycle cost curve on this machine (once per target, drafter, dtype, "
              "runtime and linear backend; "
              "cached) ...", file=sys.stderr, flush=True)
    from dspine.tune.conditions import LoadMeter, conditions, spread_of

    meter = LoadMeter().__enter__()
    spreads: list[float] = []
    from dspine.config import SamplingConfig

    V = target.vocab_size
    layers = list(getattr(proposer, "feature_layers", [])) if proposer is not None else None
    ids = (torch.arange(1, context + 1) * 7919 % max(V - 1, 1) + 1).clamp_max(V - 1)[None].to(target.device)
    cache = target.new_cache()
    out = target.forward(ids, cache, layers, logits_to_keep=1)
    cache.rollback(context)
    pts = sorted({n for n in (0, 1, 2, 3, 4, 6, 8, 12, n_max) if 0 <= n <= n_max})
    meas: dict[int, float] = {}
    # the points are timed in interleaved rounds (0, 1, 2, ..., 15, 0, 1, ...), at least
    # INTERLEAVED_ROUNDS of them after a warm-up round, so that no point alone takes the state the
    # previous work left (the larger error of 2026-12-06, a plain step 18 ms where decoding
    # takes 13-14 on a 2-core AMX Xeon, came from measuring in the process that timed the linear
    # backends: marked provisional below)
    times: dict[int, list[float]] = {n: [] for n in pts}
    for r in range(max(repeats, INTERLEAVED_ROUNDS) + 1):
        for n in pts:
            t0 = time.perf_counter()
            target.forward(ids[:, : n + 1], cache, layers)
            if target.device.type == "cuda":
                torch.cuda.synchronize(target.device)
            dt = time.perf_counter() - t0
            cache.rollback(context)
            if r:  # the first round is a warm-up
                times[n].append(dt)
    for n in pts:
        meas[n] = statistics.median(times[n])
        spreads.append(spread_of(times[n]) or 1.0)
    draft_s = final_row = 0.0
    propose_s = None
    if proposer is not None and n_max > 0:
        state = proposer.new_state(ids[0].tolist())
        if out.features is not None:
            proposer.commit(state, out.features[0], 0)
        prop: dict[int, float] = {0: 0.0}
        for n in pts[1:]:
            d, f = [], []
            for r in range(repeats + 1):
                p = proposer.propose(state, int(ids[0, -1]), context, n, SamplingConfig(), None)
                if r:
                    d.append(p.draft_s)
                    f.append(p.final_s)
            prop[n] = statistics.median(d) + statistics.median(f)
        draft_s, final_row = statistics.median(d), statistics.median(f) / n_max  # n = n_max
        propose_s = _interp(prop, n_max)
    meter.__exit__(None, None, None)
    # a plain step's repeats decide "repeats disagree" (the median over n of each n's spread)
    cond = conditions(meter, statistics.median(spreads) if spreads else None)
    from dspine.runtime import packed

    if packed.BACKENDS_TIMED_HERE and not cond["provisional"]:  # a slower state than decoding's (packed.py)
        cond["provisional"] = True
        cond["provisional_why"] = ("measured in the process that also timed the target's linear backends, "
                                   "whose target runs slower than a later process's")
    curve = CostCurve(_interp(meas, n_max), draft_s, final_row,
                      meta={"context": context, "repeats": repeats, "measured_n": pts,
                            "device": str(target.device), "dtype": str(target.dtype)},
                      propose_s=propose_s, on_stale=flag_stale_curve)
    if progress:
        import sys

        flag = (f"; provisional: {cond['provisional_why']} (measured again on a quiet run; the cost policy "
                f"corrects it while decoding)" if cond["provisional"] else "")
        print(f"dspine: ... plain step {meas[0] * 1e3:.1f} ms, {n_max} drafted tokens {curve.cycle_s(n_max) * 1e3:.1f} ms "
              f"({time.perf_counter() - t_start:.1f} s{flag})", file=sys.stderr, flush=True)
    if use_cache:
        _COST_CACHE[key] = curve
        if disk_key is not None:
            from dspine.tune import store

            store.put(disk_key, {"curve": curve.to_dict(), "label": _label(target, proposer), **cond},
                      str(target.device))
            curve.meta = {**curve.meta, "cache_key": disk_key, **cond}
    return _marked(curve)


_STALE_WARNED: set[str] = set()
#: timed rounds over all points of the cost curve (at least; ``repeats`` when larger)
INTERLEAVED_ROUNDS = 7
# id(curve) -> (curve, load mark taken when the curve was handed to an engine): the window
# over which flag_stale_curve reads how busy other processes kept the machine
_LOAD_MARKS: dict[int, tuple[CostCurve, object]] = {}


def _marked(curve: CostCurve) -> CostCurve:
    from dspine.tune.conditions import load_mark

    _LOAD_MARKS[id(curve)] = (curve, load_mark())
    return curve


def flag_stale_curve(cost: CostCurve, ratio: float) -> None:
    """Decoding observed cycles ``ratio`` times the cached curve's cost (median over
    :attr:`CostModelPolicy.STALE_CYCLES` cycles): warn once on stderr and mark the cache
    entry stale, so the next run on a quiet machine measures it again
    (:func:`dspine.tune.conditions.remeasure`). Not when cycles are slower while other
    processes keep the machine busy (:func:`dspine.tune.conditions.others_since` the curve
    was handed to the engine, above ``QUIET_CORES``; no pause) and the curve was measured quiet: the machine is slower then, not the
    curve wrong, so it is kept (and the note says why). The policy itself already decides on
    the observed times."""
    import sys

    key = str(cost.meta.get("cache_key") or "")
    if key in _STALE_WARNED:
        return
    _STALE_WARNED.add(key)
    when = cost.meta.get("measured_at")
    load = cost.meta.get("others_cores")
    how = (f" (measured {when}" + (f" while other processes kept ~{load:.1f} cores busy" if isinstance(load, (int, float)) else "")
           + ")") if when else ""
    from dspine.tune.conditions import QUIET_CORES, others_since

    # slower than measured: did other processes keep the machine busy while it decoded? (read
    # over the decoding so far, without pausing it)
    mark = _LOAD_MARKS.get(id(cost), (None, None))
    busy = others_since(mark[1] if mark[0] is cost else None) if ratio > 1.0 else None
    if busy is not None and busy > QUIET_CORES and not cost.meta.get("provisional"):
        # the curve was measured on a quiet machine; a busy one is slower, not the curve wrong
        print(f"dspine: note: cycles take {ratio:.2f}x the cached cost curve{how}: other processes keep "
              f"~{busy:.1f} cores busy now; the cost policy uses the observed times and the curve is kept",
              file=sys.stderr, flush=True)
        return
    marked = False
    if key:
        from dspine.tune import store

        marked = store.mark_stale(key, f"decoding observed cycles {ratio:.2f}x its cost", cost.meta.get("device", "cpu"))
    print(f"dspine: note: cycles take {ratio:.2f}x the cached cost curve{how}; the cost policy uses the observed "
          f"times, and " + ("the curve is measured again by the next run on a quiet machine" if marked else
                            "the curve was not cached")
          + "; `dspine tune --redo` on an idle machine measures every choice again", file=sys.stderr, flush=True)


def _label(target, proposer) -> str:
    """What a cached cost curve is for, in words (``dspine tune --show``): the target, its
    dtype, runtime and linear backend, and the drafter (or none: copies cost only the
    target's verification)."""
    drafter = getattr(proposer, "drafter", None)
    what = (f"drafter {drafter.cfg.mode} ({drafter.cfg.num_layers} layers, block {drafter.cfg.block_size})"
            if drafter is not None else "no drafter (copies, plain steps)")
    dtype = str(target.dtype).replace("torch.", "")
    return (f"{target.name} {dtype}, {getattr(target, 'runtime_name', 'hf')} runtime, "
            f"{getattr(target, 'linear_backend', 'aten')} linears; {what}")


def _disk_key(target, proposer, n_max: int, context: int, repeats: int) -> str | None:
    """Key of a cost curve in the per-machine tune cache, or None when the target or the
    proposer cannot be named by shape (a test's ad-hoc proposer: measure every time)."""
    import hashlib

    drafter = getattr(proposer, "drafter", None)
    if proposer is not None and drafter is None:
        return None
    cfg = getattr(target, "config", None)
    parts = [target.name, str(target.dtype), str(target.device), getattr(target, "linear_backend", "aten"),
             getattr(target, "runtime_name", "hf"), getattr(getattr(target, "runtime", None), "decode_path", None),
             n_max, context, repeats,
             getattr(cfg, "hidden_size", None), getattr(cfg, "num_hidden_layers", None), target.vocab_size]
    if getattr(target, "linear_backend", "aten") == "blockq":  # new kernels, new costs
        from dspine.runtime.blockq import source_version

        parts.append(source_version())
    if drafter is not None:
        parts += [drafter.cfg.to_json(), json.dumps(proposer.kernel_info(), sort_keys=True)
                  if hasattr(proposer, "kernel_info") else ""]
    return "cost:" + hashlib.sha256(repr(parts).encode()).hexdigest()[:20]
