"""A data directory on disk: its shards, manifest and rows (``dspine data build`` /
``dspine data text`` write it, ``dspine data pack`` packs it, training reads it).

Layout::

    data-00000.jsonl ...  rows {id, source, kind, prompt_ids, response_ids, finished}
    data-00000.jsonl.gz   the same rows, packed (``dspine data pack``: gzip, sha256 in the
                          manifest) for committing to the repository; read like plain shards
    manifest.json         target, tokenizer fingerprint, template, settings, counts,
                          ``complete`` (true only after the whole prompt stream ran),
                          ``packed`` {shard name: {sha256, bytes, rows}}

Here: shard listing and reading, the torn-tail repair and row scan of ``--resume``, the
manifest (read, atomic write), row checks, the directory lock, packing and the check of
packed shards against their sha256.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

FORMAT = "dspine-data/1"
MANIFEST = "manifest.json"


def _shards(out: Path) -> list[Path]:
    """Plain (still growing) shards."""
    return sorted(out.glob("data-*.jsonl"))


def _packed(out: Path) -> list[Path]:
    """Packed shards (``dspine data pack``)."""
    return sorted(out.glob("data-*.jsonl.gz"))


def _index(shard: Path) -> int:
    """The shard number of ``data-NNNNN.jsonl[.gz]``.

    Raises:
        ValueError: a file named like a shard whose number is not an integer (names it).
    """
    num = shard.name.split(".")[0][len("data-"):]
    if not num.isdigit():
        raise ValueError(f"{shard} is not a shard name (data-NNNNN.jsonl or .jsonl.gz); move it out of "
                         f"{shard.parent}")
    return int(num)


def _all_shards(out: Path) -> list[Path]:
    """Packed and plain shards in row order (by shard number)."""
    return sorted(_packed(out) + _shards(out), key=_index)


def _shard_bytes(shard: Path) -> bytes:
    if shard.name.endswith(".gz"):
        import gzip

        try:
            return gzip.decompress(shard.read_bytes())
        except (OSError, EOFError) as e:
            raise ValueError(f"{shard} is damaged ({e}); restore it from the repository") from None
    return shard.read_bytes()


def _repair_and_scan(out: Path) -> tuple[set[str], dict]:
    """Cut torn trailing lines off every plain shard; return done ids and row/token counts
    over packed and plain shards (a row id seen twice counts once).

    Raises:
        ValueError: a packed shard missing, damaged or not listed in the manifest
            (:func:`verify_packed`), or a damaged row (naming shard and line).
    """
    verify_packed(out)  # a damaged, missing or unlisted packed shard: refused before hours of generation
    done: set[str] = set()
    counts = {"prompts": 0, "prompt_tokens": 0, "response_tokens": 0, "finished": 0}
    for shard in _all_shards(out):
        data = _shard_bytes(shard)
        keep = data.rfind(b"\n") + 1
        if keep != len(data) and not shard.name.endswith(".gz"):
            with open(shard, "r+b") as f:
                f.truncate(keep)
        for lineno, line in enumerate(data[:keep].splitlines(), 1):
            row = _parse_row(line, shard, lineno)
            if str(row["id"]) in done:
                continue
            done.add(str(row["id"]))
            counts["prompts"] += 1
            counts["prompt_tokens"] += len(row["prompt_ids"])
            counts["response_tokens"] += len(row["response_ids"])
            counts["finished"] += int(bool(row.get("finished")))
    return done, counts


def _write_json_atomic(path: Path, obj: dict) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=1) + "\n", encoding="utf-8")
    os.replace(tmp, path)


def read_manifest(out_dir: str | Path) -> dict | None:
    """The manifest of a data directory, or None when it has none.

    Raises:
        ValueError: the manifest is not valid JSON (names the file).
    """
    p = Path(out_dir) / MANIFEST
    if not p.exists():
        return None
    try:
        man = json.loads(p.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{p} is damaged (not valid JSON: {e}); rebuild the dataset or restore the file") from None
    if not isinstance(man, dict):
        raise ValueError(f"{p} is damaged (not a JSON object); rebuild the dataset or restore the file")
    return man


def _lock_dir(out: Path):
    """Take an exclusive lock on ``out/.lock`` so two builds never append to one directory.

    Returns the open lock file (the lock lasts while it is open). Raises ValueError
    naming ``--out`` when another process holds it. No-op where ``fcntl`` is missing.
    """
    try:
        import fcntl
    except ImportError:  # not POSIX: no lock
        return None
    f = open(out / ".lock", "a+")
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        f.close()
        raise ValueError(f"--out {out} is being written by another `dspine data build`; wait for it "
                         f"to finish (or stop it), then --resume, or use another --out") from None
    return f


def pack_dataset(data_dir: str | Path) -> dict:
    """Pack the plain shards of a data directory in place: each ``data-N.jsonl`` becomes
    ``data-N.jsonl.gz`` (gzip level 9, no timestamp, so the same rows give the same
    bytes), its sha256, size and row count go into the manifest's ``packed`` table, and
    the plain shard is removed. A later ``dspine data build --resume`` appends to a new
    plain shard; packing again packs only that one. Returns the manifest.

    Raises:
        ValueError: no manifest, or a damaged row (names the shard and line).
    """
    import gzip
    import hashlib

    d = _data_dir(data_dir)
    man = read_manifest(d)
    if man is None:
        raise ValueError(f"{d} has no {MANIFEST}: not a dspine data directory")
    lock = _lock_dir(d)  # not while a build writes here
    try:
        verify_packed(d, man)  # a damaged directory is refused before anything is written
        packed = man.setdefault("packed", {})
        todo = []
        for shard in _shards(d):  # check every plain shard before packing any
            _index(shard)
            dest = shard.with_name(shard.name + ".gz")
            if dest.exists():
                raise ValueError(f"{shard} and {dest.name} both exist: packing would overwrite the packed "
                                 f"rows; move one of them out of {d}")
            raw = shard.read_bytes()
            if raw and not raw.endswith(b"\n"):
                raise ValueError(f"{shard} ends without a newline (an interrupted write?): `dspine data build "
                                 f"... --resume` cuts a torn last line; or fix the file, then pack again")
            for lineno, line in enumerate(raw.splitlines(), 1):
                _parse_row(line, shard, lineno)
            todo.append((shard, dest, raw))
        for shard, dest, raw in todo:
            gz = gzip.compress(raw, compresslevel=9, mtime=0)
            tmp = dest.with_name(dest.name + ".tmp")
            tmp.write_bytes(gz)
            os.replace(tmp, dest)
            packed[dest.name] = {"sha256": hashlib.sha256(gz).hexdigest(), "bytes": len(gz),
                                 "rows": len(raw.splitlines()), "raw_bytes": len(raw)}
            man["shards"] = [p.name for p in _all_shards(d) if p != shard]
            _write_json_atomic(d / MANIFEST, man)
            shard.unlink()
        man["shards"] = [p.name for p in _all_shards(d)]
        man["packed_bytes"] = sum(v["bytes"] for v in packed.values())
        _write_json_atomic(d / MANIFEST, man)
        return man
    finally:
        if lock is not None:
            lock.close()


def _data_dir(path: str | Path) -> Path:
    """``path`` as an existing directory.

    Raises:
        ValueError: it does not exist or is not a directory (names it).
    """
    d = Path(path)
    if not d.exists():
        raise ValueError(f"{d} does not exist")
    if not d.is_dir():
        raise ValueError(f"{d} is not a directory (a data directory holds manifest.json and data-*.jsonl shards)")
    return d


def verify_packed(data_dir: str | Path, man: dict | None = None) -> None:
    """Check every packed shard against the sha256 in the manifest.

    Raises:
        ValueError: a packed shard listed in the manifest is missing or its bytes differ
            (names the file), or a packed shard is not listed.
    """
    import hashlib

    d = Path(data_dir)
    man = man if man is not None else (read_manifest(d) or {})
    table = man.get("packed", {})
    if table is None:
        table = {}
    if not isinstance(table, dict) or not all(isinstance(e, dict) for e in table.values()):
        raise ValueError(f"{d / MANIFEST} is damaged: 'packed' must map each packed shard to "
                         f'{{"sha256": ..., "rows": ...}}; restore the file from the repository or run `dspine data pack`')
    for shard in _packed(d):
        e = table.get(shard.name)
        if e is None:
            raise ValueError(f"{shard} is not listed in {d / MANIFEST} (packed shards are checked by sha256)")
        if hashlib.sha256(shard.read_bytes()).hexdigest() != e.get("sha256"):
            raise ValueError(f"{shard} differs from the sha256 in {d / MANIFEST}: the data is damaged; "
                             f"restore it from the repository")
    missing = sorted(set(table) - {p.name for p in _packed(d)})
    if missing:
        raise ValueError(f"{d}: packed shards {missing[:3]} listed in {MANIFEST} are missing")


def _ids_ok(v) -> bool:
    return isinstance(v, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in v)


def _parse_row(line: bytes, shard: Path, lineno: int) -> dict:
    """One data row, checked: an object with ``id`` and integer lists ``prompt_ids`` /
    ``response_ids``.

    Raises:
        ValueError: naming the shard file and line (damaged or hand-edited data).
    """
    try:
        row = json.loads(line)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{shard}, line {lineno}: not valid JSON ({e}); the data is damaged") from None
    if not isinstance(row, dict) or "id" not in row:
        raise ValueError(f"{shard}, line {lineno}: not a data row (an object with id, prompt_ids, response_ids)")
    for k in ("prompt_ids", "response_ids"):
        if not _ids_ok(row.get(k)):
            raise ValueError(f"{shard}, line {lineno}: {k} must be a list of integer token ids, got "
                             f"{str(row.get(k))[:40]!r}; the data is damaged")
    return row


def head_dataset(data_dir: str | Path, shards: int, out_dir: str | Path) -> dict:
    """Copy the first ``shards`` packed shards of a data directory into a new one.

    The copy is a prefix of the source's rows, so a `dspine train` run on it continues on the
    whole directory (`--resume` / `--continue-from` accept data grown by appended rows), and
    a feature store of the prefix (`dspine train-features --out ... --data OUT`) is a fraction
    of the whole one's size. The manifest is the source's with ``packed`` / ``shards`` cut to
    the copied shards, ``counts`` recounted over their rows (``prompts`` = rows, their prompt and response
    tokens, ``finished``),
    ``complete`` false and ``head_of`` naming the source and its counts.

    Raises:
        ValueError: the source is not a data directory, a packed shard is damaged, ``shards``
            is not in 1..(packed shards), a plain (unpacked) shard lies inside the prefix, or
            ``out_dir`` exists and is not empty (names the setting).
    """
    import shutil

    src = _data_dir(data_dir)
    man = read_manifest(src)
    if man is None:
        raise ValueError(f"{src} has no {MANIFEST}: not a dspine data directory")
    verify_packed(src, man)
    allsh = _all_shards(src)
    packed = [p for p in allsh if p.name.endswith(".gz")]
    if not 1 <= shards <= len(packed):
        raise ValueError(f"--shards {shards}: {src} has {len(packed)} packed shards (choose 1..{len(packed)})")
    head = allsh[:shards]
    plain = [p.name for p in head if not p.name.endswith(".gz")]
    if plain:
        raise ValueError(f"--shards {shards}: {plain[0]} in {src} is not packed; run `dspine data pack {src}` first")
    out = Path(out_dir)
    if out.exists() and any(out.iterdir()):
        raise ValueError(f"--out {out} exists and is not empty")
    out.mkdir(parents=True, exist_ok=True)
    counts = {"prompts": 0, "prompt_tokens": 0, "response_tokens": 0, "finished": 0}
    for p in head:
        shutil.copyfile(p, out / p.name)
        for lineno, line in enumerate(_shard_bytes(p).splitlines(), 1):
            row = _parse_row(line, p, lineno)
            counts["prompts"] += 1
            counts["prompt_tokens"] += len(row["prompt_ids"])
            counts["response_tokens"] += len(row["response_ids"])
            counts["finished"] += int(bool(row.get("finished", False)))
    new = dict(man)
    new["packed"] = {p.name: man["packed"][p.name] for p in head}
    new["shards"] = [p.name for p in head]
    new["packed_bytes"] = sum(v["bytes"] for v in new["packed"].values())
    new["complete"] = False
    new["counts"] = counts
    new["head_of"] = {"dir": str(src), "shards": shards, "of_shards": len(allsh), "counts": man.get("counts")}
    _write_json_atomic(out / MANIFEST, new)
    return new
