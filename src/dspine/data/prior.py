"""The DSpine final stage's n-gram prior (:mod:`dspine.drafter.ngram_prior`) built from a
``dspine data build`` directory: ``--ngram-prior off|auto|DIR``.

The table is built once per data (10-15 s for 12,896 rows on a 2-core CPU)
and cached as ``.npz`` under ``$DSPINE_HOME/ngram-prior``, keyed by the shards' sha256; a
damaged cache file is built again.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import tempfile
from pathlib import Path

import numpy as np

from dspine.argtypes import MAX_NGRAM_PRIOR_WEIGHT as MAX_WEIGHT
from dspine.data.store import MANIFEST, _parse_row, _shard_bytes, verify_packed
from dspine.drafter.ngram_prior import TOP, NgramPrior

FORMAT = "dspine-ngram-prior-2"  # 2: uint16 counts and totals, uint16 ids where they fit


def _check_vocab(ids: np.ndarray, vocab_size: int | None, d: Path) -> None:
    """Raise ValueError when a stored continuation lies outside the target's vocabulary."""
    if vocab_size is not None and ids.size and int(ids.max()) >= vocab_size:
        raise ValueError(f"{d} holds token ids up to {int(ids.max())}, outside the target's vocabulary of "
                         f"{vocab_size}: data of another tokenizer")


def prior_from_data(data_dir: str | Path, cache_dir: str | Path | None = None, vocab_size: int | None = None,
                    **kw) -> NgramPrior:
    """Built from a ``dspine data build`` directory (packed and plain shards), cached as
    ``.npz`` in ``cache_dir`` keyed by the shards' sha256 (rebuilt when the data changes,
    or when the cached file is unreadable).

    Raises:
        ValueError: ``data_dir`` holds no data shards or no rows, a damaged shard or row
            (naming the file and line), a packed shard missing, changed or not listed in its
            manifest (:func:`dspine.data.store.verify_packed`), or (with ``vocab_size``) a token id outside
            ``0 .. vocab_size - 1``.
    """
    d = Path(data_dir)
    shards = sorted(d.glob("data-*.jsonl.gz")) + sorted(d.glob("data-*.jsonl"))
    if not shards:
        raise ValueError(f"{d} holds no data shards (data-*.jsonl[.gz])")
    if (d / MANIFEST).is_file():
        verify_packed(d)  # a damaged, missing or unlisted packed shard, as training refuses it
    h = hashlib.sha256(f"{FORMAT} top={TOP}".encode())
    for sh in shards:
        h.update(sh.name.encode())
        h.update(hashlib.sha256(sh.read_bytes()).digest())
    tag = h.hexdigest()[:20]
    f = Path(cache_dir) / f"ngram-prior-{tag}.npz" if cache_dir is not None else None
    if f is not None and f.is_file():
        try:
            with np.load(f) as z:
                prior = NgramPrior(z["keys"], z["ids"], z["counts"], z["totals"], source=f"{d} ({tag})", **kw)
            _check_vocab(prior.ids, vocab_size, d)
            try:
                os.utime(f)  # most recently used: kept by prune_cache
            except OSError:
                pass
            prune_cache(f.parent, keep=f)
            return prior
        except (OSError, ValueError, KeyError, EOFError) as e:
            if isinstance(e, ValueError) and "outside" in str(e):
                raise
            f.unlink(missing_ok=True)  # an unreadable cache file: built again below

    def rows():
        for sh in shards:
            data = _shard_bytes(sh)  # ValueError naming a damaged packed shard
            for i, line in enumerate(data.splitlines(), 1):
                if line.strip():
                    r = _parse_row(line, sh, i)  # ValueError naming shard and line
                    yield r["prompt_ids"], r["response_ids"]

    prior = NgramPrior.build(rows(), source=f"{d} ({tag})", **kw)
    if prior.keys.shape[0] == 0:
        raise ValueError(f"{d} holds no answer tokens to count")
    _check_vocab(prior.ids, vocab_size, d)
    if f is not None:
        f.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=f.parent, prefix=f.stem + ".", suffix=".npz")  # private per process
        with os.fdopen(fd, "wb") as out:
            np.savez(out, keys=prior.keys, ids=prior.ids, counts=prior.counts, totals=prior.totals)
        os.replace(tmp, f)
        prune_cache(f.parent, keep=f)
    return prior


#: prior tables kept in the cache (the newest by use); each is ~100+ MB for the committed data
CACHE_KEEP = 2


def prune_cache(cache_dir: str | Path, keep: Path | None = None, n: int = CACHE_KEEP) -> list[Path]:
    """Remove all but the ``n`` most recently used prior tables (``ngram-prior-*.npz``) from
    ``cache_dir``, never ``keep``; a table is rebuilt from its data when needed again (10-15 s).
    Data that grows writes a new table each time, so without this the cache grows by ~100 MB
    per change. Returns the removed files."""
    files = sorted(Path(cache_dir).glob("ngram-prior-*.npz"), key=lambda q: q.stat().st_mtime, reverse=True)
    survivors = [keep] if keep is not None else []
    gone = []
    for q in files:
        if q == keep:
            continue
        if len(survivors) < n:
            survivors.append(q)
            continue
        try:
            q.unlink()
            gone.append(q)
        except OSError:
            pass  # another process's file, or already gone
    return gone


def committed_data_dir(target_name: str) -> Path | None:
    """The repository's committed training data for ``target_name`` (``training-data/*/``
    whose manifest names that target), or None (an installed package without the repository's
    data, or another target)."""
    root = Path(__file__).resolve().parents[3] / "training-data"
    for man in sorted(root.glob("*/manifest.json")):
        try:
            if json.loads(man.read_text()).get("target") == target_name:
                return man.parent
        except (OSError, ValueError):
            continue
    return None


def resolve_prior(setting: str, target, weight: float = 0.5) -> NgramPrior | None:
    """``--ngram-prior``: ``off`` (None), ``auto`` (the committed training data of the
    target, None where there is none) or a ``dspine data build`` directory of that target
    (``target``: a loaded :class:`~dspine.target.adapter.Target`, whose name or path and
    tokenizer must match the data's manifest, or a target name, checked by name only).
    Built once per data and cached under ``$DSPINE_HOME/ngram-prior``.

    Raises:
        ValueError: naming ``--ngram-prior``: a directory without data shards or rows, of
            another target or tokenizer, with a damaged manifest or shard, or a weight out of
            range.
    """
    from dspine.target.assets import dspine_home

    name = target if isinstance(target, str) else target.name
    if setting == "off":
        return None
    if not (isinstance(weight, (int, float)) and not isinstance(weight, bool) and math.isfinite(weight)
            and 0 <= weight <= MAX_WEIGHT):
        raise ValueError(f"--ngram-prior-weight must be in 0..{MAX_WEIGHT:g}, got {weight!r}")
    d = committed_data_dir(name) if setting == "auto" else Path(setting).expanduser()
    if d is None:
        return None
    man_f = d / "manifest.json"
    if not man_f.is_file():
        raise ValueError(f"--ngram-prior {setting}: not a `dspine data build` directory (no manifest.json); "
                         f"accepted: off, auto or such a directory")
    try:
        man = json.loads(man_f.read_text())
        if not isinstance(man, dict):
            raise ValueError("not a JSON object")
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise ValueError(f"--ngram-prior {setting}: {man_f} is damaged ({e})") from None
    if man.get("kind") == "text":
        raise ValueError(f"--ngram-prior {setting}: a `dspine data text` directory (human text); the prior counts "
                         f"the target's own answers: give a `dspine data build` directory")
    if not isinstance(target, str) and not isinstance(man.get("tokenizer"), dict):
        raise ValueError(f"--ngram-prior {setting}: {man_f} names no tokenizer fingerprint ('tokenizer'), so its "
                         f"rows cannot be checked against target {name!r}; rebuild it with `dspine data build`")
    if isinstance(target, str):
        same = man.get("target") == name
    else:
        from dspine.data.tokenizer import _same_target, tokenizer_fingerprint

        same = _same_target(man, target, tokenizer_fingerprint(target.tokenizer))
    if not same:
        raise ValueError(f"--ngram-prior {setting}: its rows are the answers of target {man.get('target')!r} "
                         f"(its tokenizer), not of {name!r}")
    try:
        return prior_from_data(d, dspine_home() / "ngram-prior", weight=weight,
                                    vocab_size=None if isinstance(target, str) else int(target.vocab_size))
    except OSError as e:
        raise ValueError(f"--ngram-prior {setting}: {e}") from None
    except ValueError as e:
        raise ValueError(f"--ngram-prior {setting}: {e}") from None
