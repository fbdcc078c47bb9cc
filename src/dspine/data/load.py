"""Reading a built data directory into training sequences (:func:`load_dataset`), after
checking that it belongs to the target and that its packed shards are intact.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

from dspine.data.store import MANIFEST, _all_shards, _parse_row, _shard_bytes, read_manifest, verify_packed
from dspine.data.tokenizer import _same_target, tokenizer_fingerprint


@dataclass
class Sequence:
    """One training sequence: ``input_ids`` = prompt + response; response from ``response_start``."""

    id: str
    input_ids: list[int]
    response_start: int
    finished: bool
    source: str
    kind: str


def load_dataset(data_dir: str | Path, target) -> list[Sequence]:
    """Sequences of a built data directory, after checking it belongs to ``target``.

    Args:
        target: a loaded ``Target`` or a target name (loaded to fingerprint its tokenizer).
    Raises:
        ValueError: no manifest, the manifest's target/tokenizer differs (names both), a
            damaged row (names the shard file and line), or a row id that appears twice (a
            copied or hand-edited shard: it would be trained on twice; names both places).
    """
    from dspine.target.adapter import Target, load_target

    d = Path(data_dir)
    man = read_manifest(d)
    if man is None:
        raise ValueError(f"{d} has no {MANIFEST}: not a dspine data directory")
    tgt = target if isinstance(target, Target) else load_target(target)
    fp = tokenizer_fingerprint(tgt.tokenizer)
    if not _same_target(man, tgt, fp):
        tok = man.get("tokenizer") if isinstance(man.get("tokenizer"), dict) else {}
        theirs = str(tok.get("vocab_sha256") or "none recorded")[:12]
        why = ("" if theirs != fp["vocab_sha256"][:12] else
               "; the tokenizers agree, so the target's name or path differs")
        raise ValueError(f"data in {d} was built for target {man.get('target')!r} (tokenizer "
                         f"{theirs}), not for target {tgt.name!r} (tokenizer {fp['vocab_sha256'][:12]}){why}")
    if not man.get("complete", False):
        counts = man.get("counts") if isinstance(man.get("counts"), dict) else {}
        runs = man.get("runs") if isinstance(man.get("runs"), list) else []
        last = runs[-1] if runs and isinstance(runs[-1], dict) else {}
        why = f"; its last run stopped at {last['stopped']}" if last.get("stopped") else ""
        print(f"note: {d} is a partial build ({counts.get('prompts', '?')} rows of its prompt stream{why}); "
              f"using the rows written (extend it with `dspine data build ... --resume`)", file=sys.stderr)
    verify_packed(d, man)
    seqs = []
    where: dict[str, str] = {}  # row id -> "shard, line N" of its first occurrence
    for shard in _all_shards(d):
        data = _shard_bytes(shard)
        for lineno, line in enumerate(data.splitlines(keepends=True), 1):
            if not line.endswith(b"\n"):
                break  # torn tail of an interrupted run
            row = _parse_row(line, shard, lineno)
            rid, here = str(row["id"]), f"{shard.name}, line {lineno}"
            if rid in where:
                raise ValueError(f"{d}: row id {rid!r} appears twice ({where[rid]} and {here}); a copied or "
                                 f"hand-edited shard? Each prompt's answer must be trained on once")
            where[rid] = here
            p, r = row["prompt_ids"], row["response_ids"]
            seqs.append(Sequence(str(row["id"]), p + r, len(p), bool(row.get("finished", False)),
                                 str(row.get("source", "?")), row.get("kind", "chat")))
    return seqs
