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
  function header (:func:`dspine.data.stdlib.iter_stdlib_prompts`; held-out prompts 16-23:
  the first 16 tuned the trees and the copy bonus), raw completion, 128 new tokens. The
  cut's text comes from the running Python's stdlib: another Python version may lack a cut
  (skipped and reported).
* ``sharegpt``: open chat, held-out ShareGPT first turns (held-out prompts 16-23), chat
  template, 128 new tokens.

Prompts are tokenized with the target at run time (:func:`dspine.bench.prompts.build_prompts`), so every
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
    from dspine.data.splits import load_splits
    from dspine.data.stdlib import module_path

    out = []
    for m in sorted(load_splits()["stdlib_heldout_modules"]):
        if m.startswith("_") or any(p.startswith("_") for p in m.split(".")):
            continue
        try:
            src = module_path(m).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        if 3000 <= len(src) and len(top_level_names(src)) >= 3:
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


def heldout_rows(kind: str, ids: list[str]) -> dict[str, dict]:
    """The held-out prompt records of ``kind`` (``code`` / ``chat``) with these ids."""
    from dspine.data.sources import iter_sharegpt
    from dspine.data.stdlib import iter_stdlib_prompts

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


_DEF_RE = re.compile(r"^(?:async\s+)?(?:def|class)\s+([A-Za-z]\w*)", re.M)


def top_level_names(src: str) -> list[str]:
    """Names of the top-level functions and classes of Python source ``src``."""
    return [m.group(1) for m in _DEF_RE.finditer(src)]
