"""Resuming a data directory with the other generator, after checking it writes the same rows.

``dspine data build --generator hf`` (transformers' forward, left-padded batches) and
``--generator engine`` (dspine's own runtime, batched) both write the target's greedy
float32 answers; they differ in speed (on a 2-core AMX Xeon, 2 threads: 130 vs 77 new
tokens/s on the same 29 prompts, all 29 answers identical). A directory may switch between
them on ``--resume`` only when this run's generator reproduces the directory's own last rows
id for id; otherwise the rows would mix two targets' worth of answers and the switch is
refused (:func:`check_switch`).
"""
from __future__ import annotations

from pathlib import Path

from dspine.data.store import _all_shards, _parse_row, _shard_bytes

SWITCH_CHECK_ROWS = 8  # rows regenerated before a directory changes generator (one engine batch)


def last_rows(out: Path, n: int) -> list[dict]:
    """The last ``n`` rows of a data directory (packed and plain shards, in row order)."""
    rows: list[dict] = []
    for shard in reversed(_all_shards(out)):
        data = _shard_bytes(shard)
        lines = data[:data.rfind(b"\n") + 1].splitlines()
        rows[:0] = [_parse_row(line, shard, i + 1) for i, line in enumerate(lines)][-(n - len(rows)):]
        if len(rows) >= n:
            break
    return rows


def check_switch(out: Path, old: str, new: str, generate, max_new_tokens: int,
                 rows: int = SWITCH_CHECK_ROWS) -> dict:
    """Regenerate the directory's last ``rows`` rows with this run's generator and compare.

    Args:
        out: the data directory (its rows were made with ``old``).
        old, new: the directory's generator and this run's (``hf`` / ``engine``).
        generate: ``f(prompts: list[list[int]]) -> list[(response ids, finished)]`` with this
            run's generator, ``max_new_tokens`` and EOS ids.
        max_new_tokens: this run's ``--max-new-tokens`` (equal to the directory's, checked
            before).
    Returns:
        ``{"against": old, "rows": k, "same": k}``, recorded in the run's manifest entry.
    Raises:
        ValueError: naming the first row whose answer differs (its id and first differing
            token), and both generators.
    """
    sample = last_rows(out, rows)
    outs = generate([r["prompt_ids"] for r in sample])
    for row, (resp, fin) in zip(sample, outs):
        want = list(row["response_ids"])  # the whole stored answer: a longer one is not reproduced either
        if list(resp) != want or bool(fin) != bool(row.get("finished")):
            j = next((i for i, (a, b) in enumerate(zip(resp, want)) if a != b), min(len(resp), len(want)))
            how = (f"differently from token {j} on ({len(resp)} vs {len(want)} tokens)" if list(resp) != want else
                   f"with finished={bool(fin)}, the row says {bool(row.get('finished'))}")
            raise ValueError(
                f"{out} was built with --generator {old!r}; this run's --generator {new!r} answers its row "
                f"{row['id']!r} {how}: resuming would mix rows of two different decoders; resume with "
                f"--generator {old!r} or use another --out")
    return {"against": old, "rows": len(sample), "same": len(sample)}
