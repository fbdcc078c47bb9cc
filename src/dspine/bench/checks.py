"""Output checks of the benchmark workloads.

* :func:`run_humaneval` executes a completion against its HumanEval tests in a
  separate Python process (isolated mode, empty temp dir, CPU/memory limits, wall
  timeout) -> ``passed | failed | timeout``.
* :func:`check_tool_call` parses the output as one call or a list of calls (JSON
  ``{"name", "arguments"}``, optionally in code fences or ``<tool_call>`` tags, or
  Python call syntax ``f(a=1)``) and validates each against the offered BFCL schemas.
* :func:`check_multifile` looks for the expected file (or module) name in the answer.
"""
from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
import tempfile

from dspine.bench.workloads import HUMANEVAL_STOP


# -- HumanEval -----------------------------------------------------------------------------
def truncate_completion(text: str, stop: list[str] = HUMANEVAL_STOP) -> str:
    """Cut a completion before the first stop sequence."""
    cut = [text.find(s) for s in stop if s in text]
    return text[:min(cut)] if cut else text


def _limits():  # pragma: no cover - runs in the child
    import resource

    resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30))
    resource.setrlimit(resource.RLIMIT_CPU, (30, 30))
    resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))
    os.setsid()


def run_humaneval(prompt: str, completion: str, test: str, entry_point: str,
                  timeout_s: float = 10.0, stop: list[str] | None = None) -> dict:
    """Run ``prompt + completion`` (cut at the HumanEval stop sequences, or ``stop``)
    against ``test`` in a sandboxed subprocess.

    Returns ``{"result": "passed" | "failed" | "timeout", "error": str | None}``.
    """
    cut = truncate_completion(completion) if stop is None else truncate_completion(completion, stop)
    program = (prompt + cut + "\n\n" + test + "\n"
               + f"check({entry_point})\n")
    with tempfile.TemporaryDirectory(prefix="dspine-he-") as d:
        path = os.path.join(d, "program.py")
        with open(path, "w", encoding="utf-8") as f:
            f.write(program)
        env = {"PATH": "/usr/bin:/bin", "PYTHONDONTWRITEBYTECODE": "1", "PYTHONHASHSEED": "0"}
        try:
            p = subprocess.run([sys.executable, "-I", "-S", path], cwd=d, env=env, capture_output=True,
                               text=True, timeout=timeout_s, preexec_fn=_limits, stdin=subprocess.DEVNULL)
        except subprocess.TimeoutExpired:
            return {"result": "timeout", "error": f"exceeded {timeout_s}s"}
    if p.returncode == 0:
        return {"result": "passed", "error": None}
    lines = [l for l in (p.stderr or "").strip().splitlines() if l.strip()]
    return {"result": "failed", "error": (lines[-1] if lines else f"exit code {p.returncode}")[:300]}


# -- tool calls ------------------------------------------------------------------------------
_FENCE = re.compile(r"```(?:json|python|tool_call)?\s*(.*?)```", re.S)
_TAG = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.S)


def _calls_from_obj(obj) -> list[dict] | None:
    """Normalize a parsed JSON value to ``[{"name", "arguments"}]`` or None."""
    if isinstance(obj, dict):
        if "tool_calls" in obj and isinstance(obj["tool_calls"], list):
            return _calls_from_obj(obj["tool_calls"])
        if "function" in obj and isinstance(obj["function"], dict):
            obj = obj["function"]
        name = obj.get("name")
        args = obj.get("arguments", obj.get("parameters", {}))
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except json.JSONDecodeError:
                return None
        if isinstance(name, str):
            return [{"name": name, "arguments": args}]
        if len(obj) == 1:  # {"func": {args}} (BFCL's ground-truth style)
            (k, v), = obj.items()
            if isinstance(v, dict):
                return [{"name": k, "arguments": v}]
        return None
    if isinstance(obj, list) and obj:
        out = []
        for o in obj:
            c = _calls_from_obj(o)
            if c is None:
                return None
            out += c
        return out
    return None


def _calls_from_python(text: str) -> list[dict] | None:
    """``f(a=1)`` or ``[f(a=1), g(b=2)]`` with literal keyword arguments."""
    try:
        node = ast.parse(text.strip(), mode="eval").body
    except (SyntaxError, ValueError):
        return None
    nodes = node.elts if isinstance(node, (ast.List, ast.Tuple)) else [node]
    out = []
    for n in nodes:
        if not isinstance(n, ast.Call) or n.args:
            return None
        name = ast.unparse(n.func)
        try:
            args = {kw.arg: ast.literal_eval(kw.value) for kw in n.keywords if kw.arg}
        except (ValueError, SyntaxError, TypeError):
            return None
        out.append({"name": name, "arguments": args})
    return out or None


def parse_tool_calls(text: str) -> list[dict] | None:
    """The call(s) in a model output, or None when none parses."""
    candidates = [m.group(1) for m in _TAG.finditer(text)] + [m.group(1) for m in _FENCE.finditer(text)]
    candidates.append(text)
    dec = json.JSONDecoder()
    for c in candidates:
        c = c.strip()
        if not c:
            continue
        try:
            calls = _calls_from_obj(json.loads(c))
            if calls:
                return calls
        except json.JSONDecodeError:
            pass
        for i, ch in enumerate(c):  # first decodable JSON value inside the text
            if ch in "[{":
                try:
                    obj, _ = dec.raw_decode(c, i)
                except json.JSONDecodeError:
                    continue
                calls = _calls_from_obj(obj)
                if calls:
                    return calls
        calls = _calls_from_python(c)
        if calls:
            return calls
    return None


_TYPES = {"string": (str,), "integer": (int,), "float": (int, float), "number": (int, float),
          "boolean": (bool,), "array": (list, tuple), "tuple": (list, tuple), "dict": (dict,),
          "object": (dict,)}


def _type_error(value, schema: dict, where: str) -> str | None:
    """None when ``value`` fits the (BFCL-flavoured) JSON schema, else the reason."""
    t = schema.get("type", "any")
    if t in ("any", None):
        return None
    want = _TYPES.get(t)
    if want is None:
        return None  # unknown type name: accept
    if isinstance(value, bool) and t != "boolean":
        return f"{where}: expected {t}, got boolean"
    if not isinstance(value, want):
        return f"{where}: expected {t}, got {type(value).__name__}"
    if "enum" in schema and value not in schema["enum"]:
        return f"{where}: {value!r} not in enum {schema['enum']}"
    if t in ("array", "tuple") and isinstance(schema.get("items"), dict):
        for i, v in enumerate(value):
            err = _type_error(v, schema["items"], f"{where}[{i}]")
            if err:
                return err
    if t in ("dict", "object") and isinstance(schema.get("properties"), dict):
        return _args_error(value, schema, where)
    return None


def _args_error(args: dict, params: dict, where: str) -> str | None:
    props = params.get("properties") or {}
    missing = [r for r in params.get("required") or [] if r not in args]
    if missing:
        return f"{where}: missing required {missing}"
    unknown = [a for a in args if a not in props]
    if unknown and props:
        return f"{where}: unknown arguments {unknown}"
    for a, v in args.items():
        if a in props:
            err = _type_error(v, props[a], f"{where}.{a}")
            if err:
                return err
    return None


def check_tool_call(text: str, functions: list[dict]) -> dict:
    """Validate an output against the offered functions.

    Returns ``{"result": "valid" | "parse_error" | "unknown_function" | "invalid_arguments",
    "calls": [...] | None, "error": str | None}``.
    """
    calls = parse_tool_calls(text)
    if not calls:
        return {"result": "parse_error", "calls": None, "error": "no JSON or Python call found"}
    offered = {f["name"]: f for f in functions}
    for c in calls:
        f = offered.get(c["name"])
        if f is None:
            return {"result": "unknown_function", "calls": calls,
                    "error": f"{c['name']!r} is not one of {sorted(offered)}"}
        if not isinstance(c["arguments"], dict):
            return {"result": "invalid_arguments", "calls": calls, "error": "arguments is not an object"}
        err = _args_error(c["arguments"], f.get("parameters") or {}, c["name"])
        if err:
            return {"result": "invalid_arguments", "calls": calls, "error": err}
    return {"result": "valid", "calls": calls, "error": None}


# -- multifile ----------------------------------------------------------------------------------
def check_multifile(text: str, meta: dict) -> dict:
    """``{"result": "correct" | "wrong" | "unchecked"}``: does the answer name the right file?"""
    if not meta.get("answer"):
        return {"result": "unchecked"}
    low = text.lower()
    keys = {meta["answer_file"].lower(), meta["answer"].lower() + ".py",
            meta["answer"].split(".")[-1].lower() + ".py"}
    return {"result": "correct" if any(k in low for k in keys) else "wrong"}


_CODE_BLOCK = re.compile(r"```(?:python|py)?[ \t]*\n(.*?)(?:```|$)", re.S)


def check_edit(text: str, meta: dict, timeout_s: float = 10.0) -> dict:
    """The ``edit`` workload's check: the first code block of the answer (or the whole
    answer without one) must define the task's function and pass its HumanEval tests.
    Returns ``{"result": "passed" | "failed" | "timeout", "error": str | None}``."""
    m = _CODE_BLOCK.search(text)
    code = m.group(1) if m else text
    if f"def {meta['entry_point']}" not in code:
        return {"result": "failed", "error": f"no `def {meta['entry_point']}` in the answer"}
    return run_humaneval("", code, meta["test"], meta["entry_point"], timeout_s, stop=[])


_YAML_BLOCK = re.compile(r"```(?:yaml|yml)?[ \t]*\n(.*?)(?:```|$)", re.S)


def check_convert(text: str, meta: dict) -> dict:
    """The ``convert`` workload's check: the first code block of the answer (or the whole
    answer without one) must load as YAML (``yaml.safe_load``) to the prompt's JSON
    document. Returns ``{"result": "equal" | "different" | "invalid", "error": str | None}``."""
    import yaml

    m = _YAML_BLOCK.search(text)
    try:
        got = yaml.safe_load(m.group(1) if m else text)
    except yaml.YAMLError as e:
        return {"result": "invalid", "error": str(e).splitlines()[0][:200]}
    if got == meta["document"]:
        return {"result": "equal", "error": None}
    return {"result": "different", "error": None}
