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
from dspine.data.store import _parse_row, _shard_bytes
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
            (naming the file and line), or (with ``vocab_size``) a token id outside
            ``0 .. vocab_size - 1``.
    """
    d = Path(data_dir)
    shards = sorted(d.glob("data-*.jsonl.gz")) + sorted(d.glob("data-*.jsonl"))
    if not shards:
        raise ValueError(f"{d} holds no data shards (data-*.jsonl[.gz])")
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
    return prior


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
