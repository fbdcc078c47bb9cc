"""Named, versioned benchmark workloads (spec section 10), built from packaged eval sets.

The selected ids live in ``workloads.json`` next to this file (committed; regenerate
with :func:`generate_workloads_file`, which applies the deterministic rules below).
Every source here is eval-only or held out (:mod:`dspine.data.sources`): never train
on them.

Workloads (``name``: source, default output budget):

* ``short``: MT-Bench first turns, 2 per category (16), 128 new tokens, chat template.
* ``long``: other MT-Bench first turns of the open-ended categories (writing, roleplay,
  stem, humanities; 8), 1024 new tokens.
* ``code``: HumanEval problems (every 4th task: 41), raw completion, 384 new tokens,
  Codex stop strings; completions are executed against the tests (pass@1).
* ``multifile``: 3 held-out stdlib modules per prompt, each cut to an equal share of
  the context budget (at line ends), plus a question about a name defined in one of
  them (8 groups), 256 new tokens; the answer is checked for the right file name.
* ``tools``: BFCL first turns with their function schemas in a system message
  (4 per category: 16), 256 new tokens; the output must parse as a call (or a list of
  calls) to an offered function with schema-valid arguments.
* ``edit``: a code edit (copy-heavy): a HumanEval function with its reference
  solution (every 4th task from the third: 41, none of them in ``code``), to be returned
  with type hints and otherwise unchanged, chat template, 320 new tokens; the function
  in the answer's code block must still pass the task's tests.
* ``convert``: a format conversion (copy-heavy): one BFCL function schema
  (JSON, indented) to be rewritten as YAML (4 per category from the second row on: 16,
  none of them in ``tools``), chat template, 384 new tokens; the answer's YAML must load to
  the same document.
* ``stdlib``: code continuation, cuts of held-out Python stdlib modules ending after a
  function header (:func:`dspine.data.sources.iter_stdlib_prompts`; held-out prompts 16-23:
  the first 16 tuned the trees and the copy bonus), raw completion, 128 new tokens. The
  cut's text comes from the running Python's stdlib: another Python version may lack a cut
  (skipped and reported).
* ``sharegpt``: open chat, held-out ShareGPT first turns (held-out prompts 16-23), chat
  template, 128 new tokens.

Prompts are tokenized with the target at run time (:func:`build_prompts`), so every
mode of a run gets the same token ids.
"""
from __future__ import annotations

import json
import random
import re
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

WORKLOADS_PATH = Path(__file__).with_name("workloads.json")
SET_FORMAT = "dspine-bench-workloads/1"
WORKLOAD_NAMES = ("short", "long", "code", "multifile", "tools", "edit", "convert", "stdlib", "sharegpt")
#: held-out prompts of the ``stdlib`` / ``sharegpt`` workloads: after the first 16 of each
#: set, which tuned the draft trees and the copy bonus
HELDOUT_OFFSET, HELDOUT_COUNT = 16, 8
# Codex / HumanEval stop sequences (a new top-level statement ends the completion).
HUMANEVAL_STOP = ["\ndef ", "\nclass ", "\nif __name__", "\nprint(", "\n#"]
WARMUP_PROMPT = "Say hello in five words."
TOOLS_SYSTEM = (
    "You are an assistant that answers by calling functions. Available functions "
    "(JSON schema):\n{functions}\n\nRespond with only the function call as JSON, no other "
    "text: {{\"name\": \"<function name>\", \"arguments\": {{\"<argument>\": <value>}}}}, "
    "or a JSON list of such objects when several calls are needed.")
MULTIFILE_HEAD = "Here are {k} Python source files (each may be truncated).\n\n"
MULTIFILE_FILE = "### File: {name}\n```python\n{text}\n```\n\n"
MULTIFILE_QUESTION = ("Question: in which of these files is `{symbol}` defined, and what does it "
                      "do? Start your answer with the file name.")
MULTIFILE_SUMMARY = "Question: summarize in a few sentences what each of these files does."
CONVERT_INSTRUCTION = ("Convert this JSON document to YAML. Reply with only the YAML in one ```yaml "
                       "code block.\n\n```json\n{document}\n```")
EDIT_INSTRUCTION = ("Add type hints to this Python function. Reply with the whole function in one "
                    "```python code block, otherwise unchanged.\n\n```python\n{code}```")


class WorkloadError(ValueError):
    """Unknown workload name or an unusable workload file."""


@dataclass
class BenchPrompt:
    """One tokenized benchmark request.

    ``meta`` carries what the workload's check needs (HumanEval test, BFCL functions,
    the expected file of a multifile question).
    """

    workload: str
    id: str
    prompt_ids: list[int]
    max_new_tokens: int
    stop: list[str] = field(default_factory=list)
    meta: dict = field(default_factory=dict)


# -- selection rules (used to write workloads.json) --------------------------------------
def _select_short_long() -> tuple[list[str], list[str]]:
    from dspine.data.sources import load_mtbench

    by_cat: dict[str, list[int]] = {}
    for r in load_mtbench():
        by_cat.setdefault(r["category"], []).append(int(r["question_id"]))
    short, long = [], []
    for cat in sorted(by_cat):
        ids = sorted(by_cat[cat])
        short += [f"mtbench/{i}" for i in ids[:2]]
        if cat in ("writing", "roleplay", "stem", "humanities"):
            long += [f"mtbench/{i}" for i in ids[2:4]]
    return short, long


def _select_code() -> list[str]:
    from dspine.data.sources import load_humaneval

    return [r["task_id"] for r in load_humaneval()][::4]


def _select_edit() -> list[str]:
    from dspine.data.sources import load_humaneval

    return [r["task_id"] for r in load_humaneval()][2::4]


def _multifile_candidates() -> list[str]:
    from dspine.data.sources import _module_path, load_splits

    out = []
    for m in sorted(load_splits()["stdlib_heldout_modules"]):
        if m.startswith("_") or any(p.startswith("_") for p in m.split(".")):
            continue
        try:
            src = _module_path(m).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        if 3000 <= len(src) and len(_top_level_names(src)) >= 3:
            out.append(m)
    return out


def _select_multifile(groups: int = 8, k: int = 3) -> list[dict]:
    mods = _multifile_candidates()
    rng = random.Random("dspine-bench-multifile/1")
    out = []
    for g in range(groups):
        pick = rng.sample(mods, k)
        out.append({"id": f"multifile/{g:02d}", "modules": pick, "answer": pick[g % k]})
    return out


def _select_tools(per_category: int = 4) -> list[str]:
    from dspine.data.sources import BFCL_DEFAULT, load_bfcl

    out = []
    for cat in BFCL_DEFAULT:
        rows = [r["id"] for r in load_bfcl([cat])]
        step = max(1, len(rows) // per_category)
        out += rows[::step][:per_category]
    return out


def _select_convert(per_category: int = 4) -> list[str]:
    """BFCL rows of the tools categories from the second row on (the ``tools`` ids are
    every ``step``-th row from the first, so the two sets share no row)."""
    from dspine.data.sources import BFCL_DEFAULT, load_bfcl

    tools = set(_select_tools())
    out = []
    for cat in BFCL_DEFAULT:
        rows = [r["id"] for r in load_bfcl([cat])]
        step = max(2, len(rows) // per_category)
        out += [i for i in rows[1::step] if i not in tools][:per_category]
    return out


def _select_heldout(kind: str) -> list[str]:
    from dspine.data.sources import heldout_prompts

    return [r["id"] for r in heldout_prompts(kind, HELDOUT_OFFSET + HELDOUT_COUNT)[HELDOUT_OFFSET:]]


def _heldout_rows(kind: str, ids: list[str]) -> dict[str, dict]:
    """The held-out prompt records of ``kind`` (``code`` / ``chat``) with these ids."""
    from dspine.data.sources import iter_sharegpt, iter_stdlib_prompts

    want = set(ids)
    if kind == "code":  # ids are module:offset; read each module once
        mods = sorted({i.rsplit(":", 1)[0] for i in ids})
        return {r["id"]: r for m in mods for r in iter_stdlib_prompts(modules=[m]) if r["id"] in want}
    out = {}
    for r in iter_sharegpt():
        if r["id"] in want:
            out[r["id"]] = r
            if len(out) == len(want):
                break
    return out


def convert_document(row: dict) -> dict:
    """The JSON document a ``convert`` prompt asks to rewrite: the row's first function schema."""
    return row["functions"][0]


def workload_set() -> dict:
    """The workload set the rules produce (what ``workloads.json`` holds)."""
    short, long = _select_short_long()
    return {
        "format": SET_FORMAT,
        "note": "Eval-only prompt sets: never train on them (dspine.data.sources).",
        "warmup": {"prompt": WARMUP_PROMPT, "max_new_tokens": 8},
        "workloads": {
            "short": {"version": 1, "source": "mtbench", "template": "chat", "max_new_tokens": 128,
                      "ids": short},
            "long": {"version": 1, "source": "mtbench", "template": "chat", "max_new_tokens": 1024,
                     "ids": long},
            "code": {"version": 1, "source": "humaneval", "template": "raw", "max_new_tokens": 384,
                     "stop": HUMANEVAL_STOP, "ids": _select_code()},
            "multifile": {"version": 1, "source": "stdlib-heldout", "template": "chat",
                          "max_new_tokens": 256, "files_per_prompt": 3, "ids": _select_multifile()},
            "tools": {"version": 1, "source": "bfcl", "template": "chat", "max_new_tokens": 256,
                      "ids": _select_tools()},
            "edit": {"version": 1, "source": "humaneval", "template": "chat", "max_new_tokens": 320,
                     "ids": _select_edit()},
            "convert": {"version": 1, "source": "bfcl", "template": "chat", "max_new_tokens": 384,
                        "ids": _select_convert()},
            "stdlib": {"version": 1, "source": "stdlib-heldout", "template": "raw", "max_new_tokens": 128,
                       "ids": _select_heldout("code")},
            "sharegpt": {"version": 1, "source": "sharegpt-heldout", "template": "chat", "max_new_tokens": 128,
                         "ids": _select_heldout("chat")},
        },
    }


def generate_workloads_file(path: Path = WORKLOADS_PATH) -> dict:
    """Rewrite ``workloads.json`` from the rules (maintainers; the file is committed)."""
    data = workload_set()
    path.write_text(json.dumps(data, indent=1) + "\n", encoding="utf-8")
    load_workloads.cache_clear()
    return data


@lru_cache(maxsize=1)
def load_workloads() -> dict:
    """The committed workload set (rules applied in memory when the file is missing)."""
    if WORKLOADS_PATH.exists():
        data = json.loads(WORKLOADS_PATH.read_text(encoding="utf-8"))
        if data.get("format") != SET_FORMAT:
            raise WorkloadError(f"{WORKLOADS_PATH}: format {data.get('format')!r}, expected {SET_FORMAT}")
        return data
    return workload_set()


def workload_version(name: str) -> str:
    """``"<name>/v<version>"`` of a workload (recorded in every result row)."""
    return f"{name}/v{load_workloads()['workloads'][name]['version']}"


def parse_workloads(spec: str | list[str]) -> list[str]:
    """Validate a comma list of workload names (``all`` = every workload)."""
    names = spec.split(",") if isinstance(spec, str) else list(spec)
    names = [n.strip() for n in names if n.strip()]
    if names == ["all"]:
        return list(WORKLOAD_NAMES)
    bad = [n for n in names if n not in WORKLOAD_NAMES]
    if bad or not names:
        raise WorkloadError(f"--workloads {','.join(bad) or '(empty)'}: unknown; accepted: "
                            f"{', '.join(WORKLOAD_NAMES)} or all")
    if len(set(names)) < len(names):
        raise WorkloadError(f"--workloads {','.join(names)}: a workload is listed twice")
    return names


# -- prompt construction ------------------------------------------------------------------
_DEF_RE = re.compile(r"^(?:async\s+)?(?:def|class)\s+([A-Za-z]\w*)", re.M)


def _top_level_names(src: str) -> list[str]:
    return [m.group(1) for m in _DEF_RE.finditer(src)]


def _strip_module_docstring(src: str) -> str:
    """Source without its module docstring (more code fits the context budget)."""
    import ast

    try:
        body = ast.parse(src).body
    except (SyntaxError, ValueError):
        return src
    if body and isinstance(body[0], ast.Expr) and isinstance(getattr(body[0], "value", None), ast.Constant) \
            and isinstance(body[0].value.value, str):
        lines = src.splitlines(keepends=True)
        return "".join(lines[:body[0].lineno - 1] + lines[body[0].end_lineno:]).lstrip("\n")
    return src


def _encode_chat(target, messages: list[dict]) -> list[int]:
    from dspine.data.tokenizer import encode_record

    return encode_record(target, {"kind": "chat", "messages": messages})


def _tool_messages(row: dict) -> list[dict]:
    system = TOOLS_SYSTEM.format(functions=json.dumps(row["functions"], ensure_ascii=False))
    msgs = [dict(m) for m in row["messages"]]
    extra = [m["content"] for m in msgs if m.get("role") == "system" and m.get("content")]
    msgs = [m for m in msgs if m.get("role") != "system"]
    return [{"role": "system", "content": "\n\n".join([system] + extra)}] + msgs


def _truncate_lines(target, text: str, max_tokens: int) -> str:
    """The longest line-aligned head of ``text`` within ``max_tokens`` tokens."""
    tok = target.tokenizer
    ids = tok.encode(text, add_special_tokens=False)
    if len(ids) <= max_tokens:
        return text
    head = tok.decode(ids[:max(max_tokens, 0)], skip_special_tokens=True)
    nl = head.rfind("\n")
    return head[:nl + 1] if nl >= 0 else ""


def _multifile_prompt(target, entry: dict, budget: int) -> tuple[list[int], dict] | None:
    from dspine.data.sources import _module_path

    files = []
    for m in entry["modules"]:
        try:
            files.append((m, _strip_module_docstring(_module_path(m).read_text(encoding="utf-8"))))
        except (OSError, UnicodeDecodeError):
            continue
    if not files:
        return None
    k = len(files)

    def render(texts: list[str]) -> tuple[str, str | None, str | None]:
        body = MULTIFILE_HEAD.format(k=k) + "".join(
            MULTIFILE_FILE.format(name=f"{m.replace('.', '/')}.py", text=t.rstrip("\n"))
            for (m, _), t in zip(files, texts))
        # the question names a public top-level symbol of the answer file's kept text
        order = [entry["answer"]] + [m for m, _ in files if m != entry["answer"]]
        for m in order:
            if m not in dict(files):
                continue
            t = texts[[x for x, _ in files].index(m)]
            names = [n for n in _top_level_names(t) if not n.startswith("_")]
            if names:
                return body + MULTIFILE_QUESTION.format(symbol=names[-1]), m, names[-1]
        return body + MULTIFILE_SUMMARY, None, None

    overhead = len(_encode_chat(target, [{"role": "user", "content": render([""] * k)[0]}]))
    share = max(0, (budget - overhead) // k)
    for _ in range(20):  # shrink until the whole prompt fits (token merges at the seams)
        texts = [_truncate_lines(target, src, share) for _, src in files]
        text, answer, symbol = render(texts)
        ids = _encode_chat(target, [{"role": "user", "content": text}])
        if len(ids) <= budget:
            return ids, {"modules": [m for m, _ in files], "answer": answer, "symbol": symbol,
                         "answer_file": f"{answer.replace('.', '/')}.py" if answer else None}
        share = int(share * 0.9)
    return None


def build_prompts(target, names: list[str], limit: int | None = None, context_tokens: int = 2048,
                  max_new_tokens: int | None = None) -> tuple[list[BenchPrompt], list[dict]]:
    """Tokenized prompts of the workloads ``names`` for ``target``.

    Args:
        limit: at most this many prompts per workload (the first ones of the set).
        context_tokens: prompt + output budget per request; multifile prompts are built
            to fit, other prompts that do not fit are skipped (and reported).
        max_new_tokens: overrides every workload's output budget (smoke runs).
    Returns:
        (prompts, skipped) where ``skipped`` lists ``{"workload", "id", "reason"}``.
    """
    from dspine.data.sources import load_bfcl, load_humaneval, load_mtbench

    ws = load_workloads()["workloads"]
    prompts: list[BenchPrompt] = []
    skipped: list[dict] = []
    for name in parse_workloads(names):
        w = ws[name]
        mnt = int(max_new_tokens or w["max_new_tokens"])
        budget = context_tokens - mnt
        ids_wanted = w["ids"][:limit] if limit is not None else w["ids"]
        made: list[BenchPrompt] = []
        if name in ("short", "long"):
            rows = {f"mtbench/{r['question_id']}": r for r in load_mtbench()}
            for rid in ids_wanted:
                r = rows[rid]
                ids = _encode_chat(target, [{"role": "user", "content": r["turns"][0]}])
                made.append(BenchPrompt(name, rid, ids, mnt, [], {"category": r["category"]}))
        elif name == "code":
            rows = {r["task_id"]: r for r in load_humaneval()}
            for rid in ids_wanted:
                r = rows[rid]
                ids = target.encode_prompt(r["prompt"], chat=False)
                made.append(BenchPrompt(name, rid, ids, mnt, list(w.get("stop", HUMANEVAL_STOP)),
                                        {"prompt": r["prompt"], "test": r["test"],
                                         "entry_point": r["entry_point"]}))
        elif name == "multifile":
            for entry in ids_wanted:
                built = _multifile_prompt(target, entry, budget)
                if built is None:
                    skipped.append({"workload": name, "id": entry["id"], "reason": "modules unavailable"})
                    continue
                made.append(BenchPrompt(name, entry["id"], built[0], mnt, [], built[1]))
        elif name == "tools":
            rows = {r["id"]: r for r in load_bfcl()}
            for rid in ids_wanted:
                r = rows[rid]
                ids = _encode_chat(target, _tool_messages(r))
                made.append(BenchPrompt(name, rid, ids, mnt, [],
                                        {"functions": r["functions"], "category": r["category"]}))
        elif name == "edit":
            rows = {r["task_id"]: r for r in load_humaneval()}
            for rid in ids_wanted:
                r = rows[rid]
                code = r["prompt"] + r["canonical_solution"]
                ids = _encode_chat(target, [{"role": "user", "content": EDIT_INSTRUCTION.format(code=code)}])
                made.append(BenchPrompt(name, rid, ids, mnt, [], {"test": r["test"], "entry_point": r["entry_point"]}))
        elif name == "convert":
            rows = {r["id"]: r for r in load_bfcl()}
            for rid in ids_wanted:
                doc = convert_document(rows[rid])
                text = CONVERT_INSTRUCTION.format(document=json.dumps(doc, indent=2, ensure_ascii=False))
                ids = _encode_chat(target, [{"role": "user", "content": text}])
                made.append(BenchPrompt(name, rid, ids, mnt, [], {"document": doc}))
        elif name in ("stdlib", "sharegpt"):
            rows = _heldout_rows("code" if name == "stdlib" else "chat", ids_wanted)
            for rid in ids_wanted:
                r = rows.get(rid)
                if r is None:
                    skipped.append({"workload": name, "id": rid, "reason": "prompt unavailable (another "
                                                                          "Python's stdlib?)"})
                    continue
                ids = (target.encode_prompt(r["prompt"], chat=False) if name == "stdlib"
                       else _encode_chat(target, [{"role": "user", "content": r["prompt"]}]))
                made.append(BenchPrompt(name, rid, ids, mnt, [], {}))
        for p in made:
            if len(p.prompt_ids) > budget:
                skipped.append({"workload": name, "id": p.id,
                                "reason": f"prompt {len(p.prompt_ids)} tokens > budget {budget} "
                                          f"(--context-tokens {context_tokens} - {mnt} new)"})
            else:
                prompts.append(p)
    return prompts, skipped


def warmup_prompt(target, max_new_tokens: int | None = None) -> BenchPrompt:
    """The short prompt every mode is warmed on before recording."""
    w = load_workloads()["warmup"]
    ids = _encode_chat(target, [{"role": "user", "content": w["prompt"]}])
    return BenchPrompt("warmup", "warmup", ids, int(max_new_tokens or w["max_new_tokens"]))
