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
``{"i", "offset", "len"}`` record per sequence, written after its rows: a crash
never leaves an indexed sequence half-written).
"""
from __future__ import annotations

import hashlib
import json
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


class FeatureStore:
    """Read access to a feature store built for exactly these sequences.

    Raises:
        FeatureStoreError: missing ``store.json``, or a store built for another
            target, feature layers, max_len or data (fingerprint mismatch).
    """

    def __init__(self, path: str | Path, target, feature_layers, seqs, max_len: int):
        self.path = Path(path)
        f = self.path / "store.json"
        if not f.is_file():
            raise FeatureStoreError(f"--feature-store {path}: no store.json (build it with `dspine train-features`)")
        have = json.loads(f.read_text())
        want = _meta(target, feature_layers, seqs, max_len)
        diff = [k for k in want if have.get(k) != want[k]]
        if diff:
            raise FeatureStoreError(f"--feature-store {path} was built for other settings: "
                                    + ", ".join(f"{k} {have.get(k)!r} != {want[k]!r}" for k in diff))
        self.width = want["width"]
        self.index: dict[int, tuple[int, int, int]] = {}  # seq -> (shard, offset rows, len)
        self.maps: dict[int, np.memmap] = {}
        self.canon = canonical_indices(seqs, max_len)
        self.refresh()

    def refresh(self) -> None:
        """Re-read the shard indexes (picks up sequences written since)."""
        for idx in sorted(self.path.glob("shard-*.idx.jsonl")):
            k = int(idx.name.split("-")[1].split(".")[0])
            binf = self.path / f"shard-{k}.bin"
            rows = binf.stat().st_size // (2 * self.width) if binf.exists() else 0
            for line in idx.read_text().splitlines():
                if not line.strip():
                    continue
                r = json.loads(line)
                if r["offset"] + r["len"] > rows:
                    raise FeatureStoreError(f"{binf}: index points past the end of the file (corrupt store)")
                self.index[r["i"]] = (k, r["offset"], r["len"])
            if rows:
                self.maps[k] = np.memmap(binf, dtype=np.int16, mode="r", shape=(rows, self.width))

    def __contains__(self, i: int) -> bool:
        return self.canon[i] in self.index

    def __len__(self) -> int:
        return len(self.index)

    def get(self, i: int) -> torch.Tensor:
        """Features of sequence ``i`` [len, F*d] bfloat16 (a copy out of the map)."""
        k, off, n = self.index[self.canon[i]]
        a = np.array(self.maps[k][off:off + n])  # int16 bit pattern of bfloat16
        return torch.from_numpy(a).view(torch.bfloat16)


@torch.no_grad()
def build_feature_store(target, feature_layers, seqs, max_len: int, out: str | Path, shard: int = 0,
                        num_shards: int = 1, batch_size: int = 4, progress: bool = True) -> int:
    """Compute features of the sequences ``i % num_shards == shard`` into ``out``.

    Resumable: sequences already indexed are skipped. Returns the number written now.
    The target runs in bfloat16 with the same forward as online training features
    (teacher forcing, ``hidden_states[l + 1]`` of each feature layer).
    """
    from ..data.build import cpu_speed_patches
    from .losses import collate

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    meta = _meta(target, feature_layers, seqs, max_len)
    sf = out / "store.json"
    if sf.exists():
        have = json.loads(sf.read_text())
        if have != meta:
            raise FeatureStoreError(f"{out}: holds a store for other settings; use a new directory")
    else:
        tmp = out / "store.json.tmp"
        tmp.write_text(json.dumps(meta, indent=1))
        tmp.replace(sf)
    idxf, binf = out / f"shard-{shard}.idx.jsonl", out / f"shard-{shard}.bin"
    done, rows = set(), 0
    if idxf.exists():
        for line in idxf.read_text().splitlines():
            if line.strip():
                r = json.loads(line)
                done.add(r["i"])
                rows = max(rows, r["offset"] + r["len"])
    if binf.exists() and binf.stat().st_size != rows * 2 * meta["width"]:
        with open(binf, "r+b") as f:  # drop rows written after the last indexed sequence
            f.truncate(rows * 2 * meta["width"])
    canon = canonical_indices(seqs, max_len)
    todo = [i for i in range(len(seqs)) if i % num_shards == shard and canon[i] == i and i not in done]
    todo.sort(key=lambda i: len(seqs[i][0]))  # similar lengths per batch: less padding
    if target.dtype != torch.bfloat16:
        target.model.to(torch.bfloat16)
        target.dtype = torch.bfloat16
    bar = tqdm(total=len(todo), desc=f"features shard {shard}/{num_shards}", disable=not progress)
    with open(binf, "ab") as fb, open(idxf, "a") as fi, cpu_speed_patches(target.model):
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
                recs.append({"i": i, "offset": rows, "len": n})
                rows += n
            fb.flush()
            fi.write("".join(json.dumps(r) + "\n" for r in recs))
            fi.flush()
            bar.update(len(chunk))
    bar.close()
    return len(todo)
