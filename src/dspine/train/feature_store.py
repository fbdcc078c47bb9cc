"""On-disk store of target features, shared by training runs (spec section 9).

Computing target features is most of the cost of a CPU training step (a 30-layer
target forward per sequence), and a DSpine run and its DFlash-style baseline read
the very same features. ``dspine train-features`` computes them once per data set
(sharded over processes: ``--shard k/N``, resumable) and ``dspine train
--feature-store DIR`` reads them through a memory map (the OS page cache shares them
between concurrent runs). Sequences missing from the store are still computed online.

Layout of DIR: ``store.json`` (target, feature layers, width, dtype, max_len and a
fingerprint of the token ids) and per shard ``shard-K.bin`` (raw bfloat16 rows
[tokens, F*d], sequences back to back) with ``shard-K.idx.jsonl`` (one
``{"i", "offset", "len", "h"}`` record per sequence, written after its rows: a crash
never leaves an indexed sequence half-written; ``h`` is :func:`seq_hash` of its ids).

Data grows (``dspine data build --resume``) and the fingerprint changes with it; a new
store built with ``reuse=[OLD_DIR]`` (``dspine train-features --reuse``) copies the rows
of every sequence whose ``h`` it finds in the old store instead of recomputing them.
"""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm


class FeatureStoreError(ValueError):
    """The store does not belong to this target / data / feature layers, or is corrupt."""


def data_fingerprint(seqs: list[tuple[list[int], int]], max_len: int) -> str:
    """sha256 over the (truncated) token ids of all sequences, in order."""
    h = hashlib.sha256()
    for s, _ in seqs:
        h.update(np.asarray(s[:max_len], dtype=np.int32).tobytes())
        h.update(b"|")
    return h.hexdigest()[:32]


def grown_from(seqs: list[tuple[list[int], int]], max_len: int, fingerprint: str) -> int | None:
    """The ``n`` for which the first ``n`` sequences have :func:`data_fingerprint`
    ``fingerprint``, or None: the size of the data a run trained on, when this data grew from
    it by rows appended at the end (``dspine data build --resume`` adds a shard after the
    others). One pass over the ids; the hash state is copied at each sequence boundary.
    """
    h = hashlib.sha256()
    for n, (s, _) in enumerate(seqs, start=1):
        h.update(np.asarray(s[:max_len], dtype=np.int32).tobytes())
        h.update(b"|")
        if h.copy().hexdigest()[:32] == fingerprint:
            return n
    return None


def seq_hash(ids: list[int], max_len: int) -> str:
    """Content key of one sequence: sha256 of its first ``max_len`` ids (int32), 20 hex."""
    return hashlib.sha256(np.asarray(ids[:max_len], dtype=np.int32).tobytes()).hexdigest()[:20]


def canonical_indices(seqs: list[tuple[list[int], int]], max_len: int) -> list[int]:
    """For each sequence, the first index with the same (truncated) token ids.

    A data directory listed twice in ``--data`` (to weight it) is stored once.
    """
    first: dict[bytes, int] = {}
    return [first.setdefault(np.asarray(s[:max_len], dtype=np.int32).tobytes(), i) for i, (s, _) in enumerate(seqs)]


def _meta(target, feature_layers, seqs, max_len: int) -> dict:
    return {"format": "dspine-features/1", "target": target.name, "feature_layers": list(feature_layers),
            "width": len(feature_layers) * target.hidden_size, "dtype": "bfloat16", "max_len": max_len,
            "n_seqs": len(seqs), "fingerprint": data_fingerprint(seqs, max_len)}


def _diff(have: dict, want: dict) -> str:
    return ", ".join(f"{k} {have.get(k)!r} != {want[k]!r}" for k in want if have.get(k) != want[k])


def _read_json(f: Path) -> dict:
    try:
        d = json.loads(f.read_text())
    except (OSError, ValueError) as e:
        raise FeatureStoreError(f"{f}: unreadable ({e}); the store is corrupt, rebuild it in a new directory") from None
    if not isinstance(d, dict):
        raise FeatureStoreError(f"{f}: not a store description (a JSON object); the store is corrupt, "
                                f"rebuild it in a new directory")
    return d


def _shard_indexes(d: Path) -> list[tuple[int, Path]]:
    """(shard number, index file) of ``d``'s ``shard-<K>.idx.jsonl`` files, by K; files
    that only look similar (``shard-x.idx.jsonl``) are not the store's and are ignored."""
    out = []
    for idx in d.glob("shard-*.idx.jsonl"):
        k = idx.name[len("shard-"):-len(".idx.jsonl")]
        if k.isdigit():
            out.append((int(k), idx))
    return sorted(out)


def read_index(idx: Path, n_seqs: int, lengths: list[int] | None = None) -> tuple[list[dict], int]:
    """Records of one shard index and the byte length of its intact part.

    A torn last line (a crash while appending) is ignored: the rows it describes are
    not indexed, so they are recomputed. Any other bad line, an ``i`` outside the data
    or a ``len`` different from the sequence's (truncated) length raises.

    Raises:
        FeatureStoreError: naming the file and line.
    """
    recs = []
    raw = idx.read_bytes()
    *complete, tail = raw.split(b"\n")  # a non-empty tail has no newline: a torn append
    for ln, line in enumerate(complete, 1):
        if not line.strip():
            continue
        try:
            r = json.loads(line)
            i, off, n = int(r["i"]), int(r["offset"]), int(r["len"])
        except (ValueError, KeyError, TypeError):
            raise FeatureStoreError(f"{idx}: line {ln} is not an index record (corrupt store)") from None
        if not 0 <= i < n_seqs or off < 0 or n <= 0:
            raise FeatureStoreError(f"{idx}: line {ln} indexes sequence {i} at offset {off}, length {n}; "
                                    f"the data has {n_seqs} sequences (corrupt store)")
        if lengths is not None and n != lengths[i]:
            raise FeatureStoreError(f"{idx}: line {ln}: sequence {i} has {lengths[i]} tokens, the index says "
                                    f"{n} (corrupt store)")
        recs.append({"i": i, "offset": off, "len": n, "h": r.get("h")})
    good = len(raw) - len(tail)
    return recs, good


class FeatureStore:
    """Read access to a feature store built for exactly these sequences.

    Raises:
        FeatureStoreError: missing or unreadable ``store.json``, a store built for
            another target, feature layers, max_len or data (fingerprint mismatch), or
            an index that does not fit its shard file or the data (corrupt store).
    """

    def __init__(self, path: str | Path, target, feature_layers, seqs, max_len: int):
        self.path = Path(path)
        f = self.path / "store.json"
        if not f.is_file():
            raise FeatureStoreError(f"--feature-store {path}: no store.json (build it with `dspine train-features`)")
        have = _read_json(f)
        want = _meta(target, feature_layers, seqs, max_len)
        if _diff(have, want):
            raise FeatureStoreError(f"--feature-store {path} was built for other settings: {_diff(have, want)}")
        self.width = want["width"]
        self.n_seqs = len(seqs)
        self.lengths = [min(len(s), max_len) for s, _ in seqs]
        self.index: dict[int, tuple[int, int, int]] = {}  # seq -> (shard, offset rows, len)
        self.maps: dict[int, np.memmap] = {}
        self.canon = canonical_indices(seqs, max_len)
        self.refresh()

    def refresh(self) -> None:
        """Re-read the shard indexes (picks up sequences written since)."""
        for k, idx in _shard_indexes(self.path):
            binf = self.path / f"shard-{k}.bin"
            rows = binf.stat().st_size // (2 * self.width) if binf.exists() else 0
            recs, _ = read_index(idx, self.n_seqs, self.lengths)
            for r in recs:
                if r["offset"] + r["len"] > rows:
                    raise FeatureStoreError(f"{binf}: index points past the end of the file (corrupt store)")
                self.index[r["i"]] = (k, r["offset"], r["len"])
            if rows:
                self.maps[k] = np.memmap(binf, dtype=np.int16, mode="r", shape=(rows, self.width))

    def __contains__(self, i: int) -> bool:
        return self.canon[i] in self.index

    def __len__(self) -> int:
        """Number of sequences of the data (duplicates included) whose features are stored."""
        return sum(c in self.index for c in self.canon)

    def get(self, i: int) -> torch.Tensor:
        """Features of sequence ``i`` [len, F*d] bfloat16 (a copy out of the map)."""
        k, off, n = self.index[self.canon[i]]
        a = np.array(self.maps[k][off:off + n])  # int16 bit pattern of bfloat16
        return torch.from_numpy(a).view(torch.bfloat16)


class _Reuse:
    """Rows of older stores by sequence hash (for ``build_feature_store(reuse=...)``)."""

    def __init__(self, dirs, meta: dict):
        self.rows: dict[str, tuple[np.memmap, int, int]] = {}  # h -> (map, offset, len)
        for d in dirs:
            d = Path(d)
            f = d / "store.json"
            if not f.is_file():
                raise FeatureStoreError(f"--reuse {d}: no store.json (not a feature store)")
            have = _read_json(f)
            keys = ("target", "feature_layers", "width", "dtype", "max_len")
            diff = _diff(have, {k: meta[k] for k in keys})
            if diff:
                raise FeatureStoreError(f"--reuse {d} was built for other settings: {diff}")
            for _, idx in _shard_indexes(d):
                binf = idx.with_name(idx.name.replace(".idx.jsonl", ".bin"))
                nrows = binf.stat().st_size // (2 * meta["width"]) if binf.exists() else 0
                recs, _ = read_index(idx, int(have.get("n_seqs", 0)))
                if any(r["h"] is None for r in recs):
                    raise FeatureStoreError(f"--reuse {d}: {idx.name} has no sequence hashes (a store "
                                            f"written before they were recorded); it cannot be reused")
                if not recs or not nrows:
                    continue
                m = np.memmap(binf, dtype=np.int16, mode="r", shape=(nrows, meta["width"]))
                for r in recs:
                    if r["offset"] + r["len"] > nrows:
                        raise FeatureStoreError(f"{binf}: index points past the end of the file (corrupt store)")
                    self.rows.setdefault(r["h"], (m, r["offset"], r["len"]))

    def get(self, h: str, n: int) -> np.ndarray | None:
        """int16 bit patterns [n, width] of the sequence with hash ``h``, or None."""
        hit = self.rows.get(h)
        if hit is None or hit[2] != n:
            return None
        m, off, _ = hit
        return np.asarray(m[off:off + n])


@torch.no_grad()
def build_feature_store(target, feature_layers, seqs, max_len: int, out: str | Path, shard: int = 0,
                        num_shards: int = 1, batch_size: int = 4, progress: bool = True,
                        reuse: list[str | Path] | None = None, compute_dtype: str = "auto") -> int:
    """Compute features of the sequences ``i % num_shards == shard`` into ``out``.

    Resumable: sequences already indexed in any shard are skipped (so the shard count
    may change between runs); a torn index tail or rows written after the last indexed
    sequence are dropped. Returns the number of sequences written now (computed or
    reused). The target runs in ``compute_dtype`` (``auto``: the faster of float32 /
    bfloat16 measured on this machine, :mod:`dspine.tune.dtype`) with the same forward
    as online training features (teacher forcing, ``hidden_states[l + 1]`` of each
    feature layer); rows are stored in bfloat16 either way.
    ``reuse``: older store directories (same target, layers, width, max_len); rows of a
    sequence with the same token ids (:func:`seq_hash`) are copied, not recomputed.

    Raises:
        ValueError: ``max_len`` < 4, ``batch_size`` < 1, bad shard, or ``out`` is a file.
        FeatureStoreError: ``out`` holds a store for other settings, or a corrupt one
            (an index pointing past the end of its shard file); a ``reuse`` store for
            other settings or without sequence hashes.
    """
    from dspine.data.generate import cpu_speed_patches
    from dspine.train.losses import collate

    if max_len < 4:
        raise ValueError(f"--max-len must be >= 4, got {max_len}")
    if batch_size < 1:
        raise ValueError(f"--batch-size must be >= 1, got {batch_size}")
    if not (num_shards >= 1 and 0 <= shard < num_shards):
        raise ValueError(f"--shard must be k/N with 0 <= k < N, got {shard}/{num_shards}")
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out} is a file, not a directory")
    meta = _meta(target, feature_layers, seqs, max_len)
    old = _Reuse(reuse, meta) if reuse else None  # check --reuse before writing anything
    out.mkdir(parents=True, exist_ok=True)
    sf = out / "store.json"
    if sf.exists():
        have = _read_json(sf)
        if have != meta:
            raise FeatureStoreError(f"{out} holds a store for other settings ({_diff(have, meta)}); "
                                    f"use a new directory")
    else:
        tmp = out / f"store.json.{os.getpid()}.tmp"  # shards may start at once: no shared tmp name
        tmp.write_text(json.dumps(meta, indent=1))
        tmp.replace(sf)
    lengths = [min(len(s), max_len) for s, _ in seqs]
    done = set()
    for k, other in _shard_indexes(out):
        if k != shard:
            done |= {r["i"] for r in read_index(other, len(seqs), lengths)[0]}
    idxf, binf = out / f"shard-{shard}.idx.jsonl", out / f"shard-{shard}.bin"
    rows = 0
    if idxf.exists():
        recs, good = read_index(idxf, len(seqs), lengths)
        if good < idxf.stat().st_size:
            with open(idxf, "r+b") as f:  # drop a torn tail
                f.truncate(good)
        done |= {r["i"] for r in recs}
        rows = max([r["offset"] + r["len"] for r in recs], default=0)
    have_bytes = binf.stat().st_size if binf.exists() else 0
    if have_bytes < rows * 2 * meta["width"]:
        raise FeatureStoreError(f"{binf} is shorter ({have_bytes} bytes) than its index says "
                                f"({rows * 2 * meta['width']} bytes): corrupt store, rebuild it in a new directory")
    if have_bytes > rows * 2 * meta["width"]:
        with open(binf, "r+b") as f:  # drop rows written after the last indexed sequence
            f.truncate(rows * 2 * meta["width"])
    canon = canonical_indices(seqs, max_len)
    todo = [i for i in range(len(seqs)) if i % num_shards == shard and canon[i] == i and i not in done]
    todo.sort(key=lambda i: len(seqs[i][0]))  # similar lengths per batch: less padding
    copied = 0
    if compute_dtype == "auto" and todo:
        from dspine.tune.dtype import resolve_dtype

        compute_dtype = resolve_dtype("auto", target, batch_size, min(max_len, 128), False, progress=progress)
    cdt = getattr(torch, compute_dtype) if compute_dtype != "auto" else target.dtype
    if target.dtype != cdt:
        target.model.to(cdt)
        target.dtype = cdt
    bar = tqdm(total=len(todo), desc=f"features shard {shard}/{num_shards}", disable=not progress)
    with open(binf, "ab") as fb, open(idxf, "a") as fi, cpu_speed_patches(target.model):
        if old is not None:
            left = []
            for i in todo:
                h = seq_hash(seqs[i][0], max_len)
                a = old.get(h, lengths[i])
                if a is None:
                    left.append(i)
                    continue
                fb.write(a.tobytes())
                fb.flush()
                fi.write(json.dumps({"i": i, "offset": rows, "len": lengths[i], "h": h}) + "\n")
                rows += lengths[i]
                copied += 1
                bar.update(1)
            fi.flush()
            todo = left
            bar.set_postfix(reused=copied)
        for s in range(0, len(todo), batch_size):
            chunk = todo[s:s + batch_size]
            batch = collate([seqs[i] for i in chunk], max_len)
            o = target.model(input_ids=batch.ids.to(target.device), attention_mask=batch.valid.long().to(target.device),
                             output_hidden_states=True, logits_to_keep=1)
            f = torch.cat([o.hidden_states[l + 1] for l in feature_layers], -1).to(torch.bfloat16).cpu()
            recs = []
            for k, i in enumerate(chunk):
                n = int(batch.valid[k].sum())
                fb.write(f[k, :n].contiguous().view(torch.int16).numpy().tobytes())
                recs.append({"i": i, "offset": rows, "len": n, "h": seq_hash(seqs[i][0], max_len)})
                rows += n
            fb.flush()
            fi.write("".join(json.dumps(r) + "\n" for r in recs))
            fi.flush()
            bar.update(len(chunk))
    bar.close()
    return len(todo) + copied
