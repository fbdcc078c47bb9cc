"""JSON cache of measured choices under ``$DSPINE_HOME/tune/<machine key>.json``.

One file per machine fingerprint (:func:`dspine.tune.machine.machine_key`); inside,
one entry per measured question (e.g. ``head:V=49152,d=576,dtype=float32,m=15``)
holding the times of every alternative and the choice. Writes are atomic (temp file
+ rename), so a killed process never leaves a half-written cache. ``DSPINE_TUNE=off``
keeps everything in memory (nothing read or written; tests use it for isolation).
"""
from __future__ import annotations

import json
import os
import threading
from pathlib import Path

from dspine.tune.machine import machine_info, machine_key

_LOCK = threading.Lock()
_MEMORY: dict[str, dict] = {}  # path -> entries, when the disk cache is off


def enabled() -> bool:
    """False when ``DSPINE_TUNE=off`` (measure every time, keep results in memory only)."""
    return os.environ.get("DSPINE_TUNE", "on").lower() not in ("off", "0", "no", "false")


_WARNED: set[str] = set()


def _note(msg: str) -> None:
    """One stderr note per distinct message (a cache that cannot be written is not fatal)."""
    import sys

    if msg not in _WARNED:
        _WARNED.add(msg)
        print(f"dspine: note: {msg}", file=sys.stderr, flush=True)


def path(device="cpu") -> Path:
    """The cache file of this machine (not created). Raises OSError / ValueError when
    ``$DSPINE_HOME`` cannot be created."""
    from dspine.target.assets import dspine_home

    return dspine_home() / "tune" / f"{machine_key(device)}.json"


def load(device="cpu") -> dict:
    """All entries of this machine's cache: ``{"machine": {...}, "entries": {key: entry}}``.
    A missing or unreadable file gives an empty cache (it is re-measured, not an error)."""
    if not enabled():
        return _MEMORY.setdefault(str(machine_key(device)), {"machine": machine_info(device), "entries": {}})
    try:
        p = path(device)
        data = json.loads(p.read_text())
        if isinstance(data, dict) and isinstance(data.get("entries"), dict):
            return data
        _set_aside(p, "it is not a dspine tune cache")
    except (json.JSONDecodeError, UnicodeDecodeError) as e:  # a damaged file
        _set_aside(path(device), f"it is not valid JSON ({e})")
    except (OSError, ValueError):  # none yet or unreadable, or a $DSPINE_HOME that cannot be created
        pass  # measured again, kept in memory
    return _MEMORY.setdefault("disk:" + machine_key(device), {"machine": machine_info(device), "entries": {}})


def _set_aside(p: Path, why: str) -> None:
    """Rename a damaged cache file to ``<name>.damaged-<UTC time>`` (so the next write does
    not overwrite what a user may want to repair) and say so once on stderr."""
    import time

    dest = p.with_name(f"{p.stem}.damaged-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}{p.suffix}")
    try:
        p.replace(dest)
        _note(f"the tune cache {p} was set aside as {dest.name}: {why}; choices are measured again")
    except OSError as e:
        _note(f"the tune cache {p} is damaged ({why}) and could not be set aside ({e}); choices are measured again")


def get(key: str, device="cpu") -> dict | None:
    """The cached entry for ``key`` on this machine, or None (also for an entry that is
    not a JSON object: a damaged cache is measured again, never trusted)."""
    e = load(device)["entries"].get(key)
    return e if isinstance(e, dict) else None


def put(key: str, entry: dict, device="cpu") -> None:
    """Store ``entry`` under ``key`` (atomic write; concurrent writers keep both keys)."""
    with _LOCK:
        data = load(device)
        data["machine"] = machine_info(device)
        data["entries"][key] = entry
        if not enabled():
            return
        _write(data, device)


def _write(data: dict, device) -> None:
    """Atomic write of the cache file; a cache that cannot be written (read-only
    ``$DSPINE_HOME``, a file in the way) leaves the result in memory for this process
    and says so once on stderr."""
    try:
        p = path(device)
        p.parent.mkdir(parents=True, exist_ok=True)
        tmp = p.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps(data, indent=1, sort_keys=True))
        tmp.replace(p)
    except (OSError, ValueError) as e:
        _MEMORY["disk:" + machine_key(device)] = data
        _note(f"measured choices are not cached on disk ({type(e).__name__}: {e}); "
              f"set DSPINE_HOME to a writable folder to keep them")


def mark_stale(key: str, why: str, device="cpu") -> bool:
    """Mark the cached entry ``key`` stale (re-measured by the next run on a quiet machine,
    :func:`dspine.tune.conditions.remeasure`); False when there is no such entry."""
    with _LOCK:
        data = load(device)
        e = data["entries"].get(key)
        if not isinstance(e, dict):
            return False
        e["stale"], e["stale_why"] = True, why
        if enabled():
            _write(data, device)
        return True


_FIRST_NOTED: set[str] = set()


def first_use_note(device="cpu") -> None:
    """Once per process, when this machine has no measurement cached yet: say on stderr
    what the first run does and about how long it takes."""
    from dspine.tune.machine import describe

    if str(device) in _FIRST_NOTED:
        return
    _FIRST_NOTED.add(str(device))
    try:
        fresh = enabled() and not path(device).exists()
    except (OSError, ValueError):
        fresh = False
    if fresh:
        import sys

        print(f"dspine: first run on this machine ({describe(device)}): compiling kernels and measuring which "
              f"kernels and settings are fastest here, once (~1-3 min on 2 idle cores, several times that on a "
              f"busy machine); later runs reuse the results (`dspine tune --show` lists them)",
              file=sys.stderr, flush=True)


def restore(entries: dict, device="cpu") -> None:
    """Put back ``entries`` (key -> entry, e.g. what :func:`load` held before a :func:`clear`)
    that the cache does not hold now."""
    with _LOCK:
        data = load(device)
        back = {k: v for k, v in entries.items() if k not in data["entries"]}
        data["entries"].update(back)
        if enabled() and back:
            _write(data, device)


def clear(device="cpu", prefix: str = "") -> int:
    """Forget the entries whose key starts with ``prefix`` (all by default); returns how many."""
    with _LOCK:
        data = load(device)
        gone = [k for k in data["entries"] if k.startswith(prefix)]
        for k in gone:
            del data["entries"][k]
        if enabled() and gone:
            _write(data, device)
        return len(gone)
