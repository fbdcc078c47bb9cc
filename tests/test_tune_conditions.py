"""Cached measurements carry their conditions and cannot stay wrong (dspine.tune.conditions).

A measurement taken under load, or whose rounds disagree, is provisional and measured
again by the first quiet run; a cost curve that decoding finds far off (a stale cache, e.g.
measured while the machine was busy) is flagged on stderr and marked stale, then measured
again. ``dspine tune --show`` lists all of it.
"""
from __future__ import annotations

import json

import pytest

from dspine.control.cost_curve import CostCurve
from dspine.control.policy import CostModelPolicy
from dspine.tune.cost import _COST_CACHE, _disk_key, measure_cost
from dspine.target.adapter import load_target
from dspine.tune import conditions, store
from dspine.tune.choose import cached_choice, choose_fastest

pytestmark = pytest.mark.usefixtures("one_thread")

QUIET = {"measured_at": "2026-12-04T00:00:00Z", "loadavg_1m": 0.1, "others_cores": 0.0, "spread": 1.0,
         "provisional": False}


def _timer(times):
    return lambda name, fn, repeats, cap: times[name] / 1e3


@pytest.fixture
def load(monkeypatch):
    """Set the cores other processes keep busy, as the load meter and ``others_now`` see it."""
    state = {"cores": 0.0}
    monkeypatch.setattr(conditions.LoadMeter, "others_cores", property(lambda self: state["cores"]))
    monkeypatch.setattr(conditions, "others_now", lambda interval_s=0.3: state["cores"])
    monkeypatch.setattr(conditions, "others_since", lambda mark, min_s=0.2: state["cores"])
    return state


def test_a_measurement_under_load_is_provisional_and_redone_when_quiet(load):
    load["cores"] = 1.6
    c = choose_fastest("t:busy", {"a": None, "b": None}, timer=_timer({"a": 5.0, "b": 9.0}), redo=True)
    e = store.get("t:busy")
    assert c.chosen == "a" and e["provisional"] and "1.6 cores" in e["provisional_why"]
    assert e["others_cores"] == 1.6 and e["measured_at"].endswith("Z")
    assert cached_choice("t:busy", ["a", "b"]) is not None  # still busy: used as it is
    load["cores"] = 0.1
    assert cached_choice("t:busy", ["a", "b"]) is None  # quiet now: measured again
    c = choose_fastest("t:busy", {"a": None, "b": None}, timer=_timer({"a": 9.0, "b": 2.0}))
    assert c.chosen == "b" and not c.cached and not store.get("t:busy")["provisional"]
    # a trusted entry is reused, and an entry without conditions (an older cache) is not trusted
    assert cached_choice("t:busy", ["a", "b"]).cached
    store.put("t:old", {"chosen": "a", "times_ms": {"a": 1.0}, "reason": ""})
    assert cached_choice("t:old", ["a"]) is None


def test_a_measured_setting_is_cached_and_redone_when_provisional_or_refused(load):
    """cached_measurement (the row counts of the blockq kernels and the lean path): measured
    once, then read from the cache; an entry measured under load is redone on a quiet run;
    a cached value the caller no longer accepts is measured again."""
    from dspine.tune.choose import cached_measurement

    calls = []

    def measure(v):
        calls.append(v)
        return v

    load["cores"] = 1.4
    assert cached_measurement("t:rows", lambda: measure(17), valid=lambda v: v in (4, 17, 32)) == 17
    assert store.get("t:rows")["provisional"] and store.get("t:rows")["value"] == 17
    assert cached_measurement("t:rows", lambda: measure(4), valid=lambda v: v in (4, 17, 32)) == 17  # busy: kept
    load["cores"] = 0.0
    assert cached_measurement("t:rows", lambda: measure(32), valid=lambda v: v in (4, 17, 32)) == 32  # redone
    assert cached_measurement("t:rows", lambda: measure(4), valid=lambda v: v in (4, 17, 32)) == 32  # trusted
    assert calls == [17, 32]
    assert cached_measurement("t:rows", lambda: measure(8), valid=lambda v: v in (8, 16)) == 8  # refused: redone
    store.put("t:bad", {"value": "32", **QUIET})  # damaged: measured again
    assert cached_measurement("t:bad", lambda: measure(4), valid=lambda v: True) == 4
    assert calls == [17, 32, 8, 4]


def test_disagreeing_rounds_are_measured_again_then_provisional(load):
    calls = []

    def timer(name, fn, repeats, cap):
        calls.append(name)
        return (1.0 if len(calls) % 2 else 5.0) / 1e3  # every round disagrees with the last
    choose_fastest("t:noisy", {"a": None}, timer=timer, redo=True, rounds=2)
    e = store.get("t:noisy")
    assert len(calls) == 4 and e["provisional"] and "disagree" in e["provisional_why"]


def _stale_cost_fixture(target, scale):
    """Cache a trusted cost curve for ``target`` ``scale`` times its real cost (4 drafted)."""
    _COST_CACHE.clear()
    real = measure_cost(target, None, n_max=4, use_cache=False)
    key = _disk_key(target, None, 4, 64, 3)
    fed = CostCurve([v * scale for v in real.verify_s], meta={"device": "cpu"})
    store.put(key, {"curve": fed.to_dict(), **QUIET})
    _COST_CACHE.clear()
    return key, real, fed


def test_a_stale_cost_curve_is_caught_while_decoding_and_measured_again(load, capsys):
    """A cache whose curve is 5x the real cost: the policy sees the observed cycles disagree,
    warns naming `dspine tune --redo`, marks the entry stale; the next quiet run re-measures."""
    target = load_target("random:llama")
    key, real, fed = _stale_cost_fixture(target, 5.0)
    cached = measure_cost(target, None, n_max=4)
    assert cached.verify_s == fed.verify_s and cached.meta["cache_key"] == key  # trusted: read as is
    pol = CostModelPolicy(cached)
    pol.STALE_MIN_S = 0.0  # the random target's steps are far below the real-target threshold
    for _ in range(CostModelPolicy.STALE_CYCLES - 1):
        pol.observe(0, real.verify_s[0])
    assert pol.stale_ratio is None and not store.get(key).get("stale")  # not yet: too few cycles
    pol.observe(0, real.verify_s[0])
    assert pol.stale_ratio == pytest.approx(0.2)
    err = capsys.readouterr().err
    assert "0.20x the cached cost curve" in err and "dspine tune --redo" in err
    assert store.get(key)["stale"]
    _COST_CACHE.clear()
    load["cores"] = 1.5  # still busy: the stale curve is kept (measuring now would be no better)
    assert measure_cost(target, None, n_max=4).verify_s == fed.verify_s
    _COST_CACHE.clear()
    load["cores"] = 0.0
    again = measure_cost(target, None, n_max=4)
    assert again.verify_s[0] < fed.verify_s[0] / 2  # measured anew
    assert not store.get(key).get("stale")


def test_a_right_curve_is_not_flagged(load, capsys):
    """Negative control: observed times within 2x of the curve never mark it."""
    target = load_target("random:llama")
    key, real, fed = _stale_cost_fixture(target, 1.0)
    pol = CostModelPolicy(measure_cost(target, None, n_max=4))
    pol.STALE_MIN_S = 0.0
    for i in range(3 * CostModelPolicy.STALE_CYCLES):
        pol.observe(0, real.verify_s[0] * (1.6 if i % 2 else 0.7))
    assert pol.stale_ratio is None and not store.get(key).get("stale")
    assert "cost curve" not in capsys.readouterr().err


def test_tune_show_lists_conditions(load, capsys):
    from dspine.cli.main import main

    load["cores"] = 1.2
    choose_fastest("t:show", {"a": None}, timer=_timer({"a": 3.0}), redo=True)
    assert main(["tune", "--show"]) == 0
    out = capsys.readouterr().out
    assert "t:show" in out and "other processes ~1.2 cores" in out and "NOT TRUSTED" in out
    assert main(["tune", "--show", "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["entries"]["t:show"]["provisional"] is True


def test_tune_show_an_acceptance_profile_is_not_an_untrusted_timing(load, capsys):
    """A saved acceptance profile is listed with its row acceptance and when it was saved,
    never as an untrusted measurement; a damaged one says so (negative control)."""
    from dspine.cli.main import main
    from dspine.tune.controller import save_profile

    class _Pol:  # what CostModelPolicy.profile() returns
        def profile(self):
            return {"risk": [10.0, 4.0], "acc": [4.0, 1.0], "obs_sum": [0.1, 0.2], "obs_w": [1.0, 1.0]}

    save_profile(_Pol(), "profile:test")
    store.put("profile:broken", {"risk": "x"})
    assert main(["tune", "--show"]) == 0
    out = capsys.readouterr().out
    shown = out[out.index("profile:test"):].split("\n\n")[0]
    assert "row acceptance 0.40, 0.25" in shown and "saved 20" in shown and "NOT TRUSTED" not in shown
    broken = out[out.index("profile:broken"):].split("\n\n")[0]
    assert "unreadable" in broken and "NOT TRUSTED" not in broken


@pytest.mark.slow  # long CLI / subprocess run; the default suite stays under ~15 min on 2 cores
def test_first_run_says_what_it_does_and_json_stays_clean(tmp_path):
    """A fresh DSPINE_HOME (tuning on, kernels shared with the usual home so none is rebuilt):
    stderr names the first run and each measurement with its time; stdout is one JSON object."""
    import os
    import subprocess
    import sys

    from dspine.target.assets import dspine_home

    home = tmp_path / "home"
    home.mkdir()
    (dspine_home() / "kernels").mkdir(parents=True, exist_ok=True)
    (home / "kernels").symlink_to(dspine_home() / "kernels")
    env = {**os.environ, "DSPINE_HOME": str(home), "DSPINE_TUNE": "on"}
    p = subprocess.run([sys.executable, "-m", "dspine.cli", "generate", "def f(x):", "--target", "random:llama",
                        "--drafter", "random", "--max-new-tokens", "4", "--json", "--threads", "1"],
                       capture_output=True, text=True, env=env, timeout=600)
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)  # the whole of stdout: one object
    assert out["mode"] == "dspine" and len(out["token_ids"]) == 4
    assert "first run on this machine" in p.stderr and "dspine tune --show" in p.stderr
    assert "dspine: measuring" in p.stderr and " s)" in p.stderr  # each measurement closes with its time
    again = subprocess.run(p.args, capture_output=True, text=True, env=env, timeout=600)
    assert "first run on this machine" not in again.stderr  # the cache exists now


def test_tune_show_says_what_a_cost_curve_is_for(load, capsys):
    """Cost curves are keyed by a hash; ``--show`` names their target and drafter (none here:
    the target alone), and an entry without a label still shows (negative control)."""
    from dspine.cli.main import main

    _COST_CACHE.clear()
    store.clear()
    target = load_target("random:llama")
    measure_cost(target, None, n_max=4)
    key = _disk_key(target, None, 4, 64, 3)
    assert main(["tune", "--show"]) == 0
    shown = capsys.readouterr().out
    entry = shown[shown.index(key):].split("\n\n")[0]
    assert "for random:llama float32" in entry and "no drafter" in entry, entry
    store.put(key, {k: v for k, v in store.get(key).items() if k != "label"})
    assert main(["tune", "--show"]) == 0
    entry = capsys.readouterr().out
    entry = entry[entry.index(key):].split("\n\n")[0]
    assert "cost curve: plain step" in entry and "for " not in entry


@pytest.mark.parametrize("busy", [True, False])
def test_slower_cycles_on_a_busy_machine_keep_a_quiet_curve(load, capsys, busy):
    """Cycles 3x slower than a curve measured on a quiet machine: while other processes keep
    the machine busy the curve is kept (the note says why); on a quiet machine the same
    observation marks it stale (the negative control)."""
    from dspine.tune.cost import _STALE_WARNED

    _STALE_WARNED.clear()  # warned once per entry and process
    target = load_target("random:llama")
    key, real, fed = _stale_cost_fixture(target, 1.0 / 3.0)
    pol = CostModelPolicy(measure_cost(target, None, n_max=4))
    pol.STALE_MIN_S = 0.0
    load["cores"] = 1.5 if busy else 0.0
    for _ in range(CostModelPolicy.STALE_CYCLES):
        pol.observe(0, real.verify_s[0])
    assert pol.stale_ratio == pytest.approx(3.0)
    err = capsys.readouterr().err
    assert "3.00x the cached cost curve" in err
    if busy:
        assert "the curve is kept" in err and not store.get(key).get("stale")
    else:
        assert "measured again by the next run" in err and store.get(key)["stale"]


def test_others_since_reads_the_window_without_waiting(monkeypatch):
    """The stale-curve check reads how busy other processes kept the machine since the
    curve was handed to the engine, without pausing decoding; with no mark (or a mark too
    recent) it falls back to a 0.3 s sample."""
    import time as _time

    mark = conditions.load_mark()
    mark.t0 -= 1.0  # as if the engine had decoded for a second
    t0 = _time.perf_counter()
    got = conditions.others_since(mark)
    assert _time.perf_counter() - t0 < 0.1
    assert got is None or got >= 0.0
    calls = []
    monkeypatch.setattr(conditions, "others_now", lambda interval_s=0.3: calls.append(1) or 0.25)
    assert conditions.others_since(None) == 0.25 and conditions.others_since(conditions.load_mark()) == 0.25
    assert len(calls) == 2


def test_tune_show_points_to_the_caches_of_other_thread_counts(load, capsys, monkeypatch, tmp_path):
    """The cache is per thread count, and dspine runs on fewer threads while other processes
    keep cores busy: `--show` names the other counts cached on this machine, and `--show
    --threads N` shows that one's entries."""
    import torch

    from dspine.cli.main import main

    monkeypatch.setenv("DSPINE_HOME", str(tmp_path))  # a cache file on disk, in a fresh home
    monkeypatch.setenv("DSPINE_TUNE", "on")
    prev = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        store.put("t:two", {"chosen": "a"})
        torch.set_num_threads(1)
        store.put("t:one", {"chosen": "b"})
        assert main(["tune", "--show", "--threads", "2"]) == 0
        out = capsys.readouterr().out
        assert "t:two" in out and "t:one" not in out
        assert "also cached here for 1 thread: " in out and "dspine tune --show --threads 1" in out
        assert main(["tune", "--show", "--threads", "1"]) == 0
        out = capsys.readouterr().out
        assert "t:one" in out and "also cached here for 2 threads" in out
    finally:
        torch.set_num_threads(prev)


def test_a_cost_curve_measured_beside_the_backend_timing_is_provisional(load, monkeypatch):
    """The process that timed the target's linear backends runs its target slower than a
    later one: a cost curve it measures is cached as provisional (re-measured by the next
    quiet run); one measured in a process that read the backend choice is trusted."""
    from dspine.runtime import packed
    from dspine.tune.cost import measure_cost

    target = load_target("random:llama", vocab_size=64, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1)
    from dspine.tune import cost as cost_mod
    from dspine.tune.conditions import untrusted_reason

    for timed_here in (True, False):
        monkeypatch.setattr(packed, "BACKENDS_TIMED_HERE", timed_here)
        cost_mod._COST_CACHE.clear()
        store.clear()
        c = measure_cost(target, None, n_max=3, context=8, repeats=1)  # cached: carries its conditions
        assert c.meta["provisional"] is timed_here
        entry = store.get(c.meta["cache_key"])
        assert entry["provisional"] is timed_here
        assert (untrusted_reason(entry) or "").startswith("measured in the process that also timed") == timed_here


def test_tune_show_says_which_entries_other_kernels_measured():
    """Entries keyed by another version of the kernels' source are listed as not used (they
    read like current measurements before); current ones and unkeyed ones are not flagged."""
    from dspine.runtime.blockq import source_version
    from dspine.tune.cli import _older_kernels

    cur = source_version()
    assert _older_kernels(f"blockq-rows:V=8,max=32,kernels={cur}") is None
    assert _older_kernels("cost:0123456789abcdef0123") is None
    why = _older_kernels("blockq-rows:V=8,max=32,kernels=0000000000")
    assert why and "0000000000" in why and cur in why
