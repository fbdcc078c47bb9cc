"""Code prompts cut from the running Python's standard library (offline, held-out by module).

About 10% of the stdlib modules (``sha256(module) % 10 == 0``, listed explicitly in
``splits.json``, :mod:`dspine.data.sources`) are held out for evaluation; a prompt is a
module cut after a function header, the target then continues the code.
"""
from __future__ import annotations

import ast
import hashlib
import random
import sysconfig
from functools import lru_cache
from pathlib import Path
from typing import Iterable, Iterator

from dspine.data.splits import load_splits

_STDLIB_SKIP_PARTS = {"test", "tests", "idle_test", "site-packages", "dist-packages",
                      "__pycache__", "__phello__", "pydoc_data", "encodings"}


def stdlib_root() -> Path:
    """Directory of the running Python's standard library sources."""
    return Path(sysconfig.get_paths()["stdlib"])


@lru_cache(maxsize=1)
def stdlib_modules() -> tuple[str, ...]:
    """Sorted dotted names of the stdlib ``.py`` modules, excluding tests and data trees."""
    root = stdlib_root()
    names = []
    for p in root.rglob("*.py"):
        parts = p.relative_to(root).parts
        if set(parts[:-1]) & _STDLIB_SKIP_PARTS or any("-" in x for x in parts[:-1]):
            continue
        mod = list(parts[:-1]) + ([] if parts[-1] == "__init__.py" else [parts[-1][:-3]])
        if mod:
            names.append(".".join(mod))
    return tuple(sorted(set(names)))


def module_path(module: str) -> Path:
    """The source file of stdlib ``module`` (dotted name)."""
    base = stdlib_root().joinpath(*module.split("."))
    return base / "__init__.py" if base.is_dir() else base.with_suffix(".py")


def is_heldout_module(module: str) -> bool:
    """The held-out rule: listed in splits.json, or (for other Python versions) hash rule."""
    return module in load_splits()["stdlib_heldout_modules"] or _hash_heldout(module)


def _hash_heldout(module: str) -> bool:
    return int(hashlib.sha256(module.encode()).hexdigest()[:8], 16) % 10 == 0


def _walk_statements(tree: ast.AST) -> Iterator[ast.stmt]:
    """All statements of a module (descending statement bodies only; much faster than
    ``ast.walk``, which visits every expression node)."""
    stack = list(getattr(tree, "body", []))
    while stack:
        node = stack.pop()
        yield node
        for field in ("body", "orelse", "finalbody", "handlers", "cases"):
            for child in getattr(node, field, None) or ():
                if isinstance(child, (ast.stmt, ast.excepthandler, ast.match_case)):
                    stack.append(child)


def _code_cuts(source: str) -> list[int]:
    """Char offsets just after each function header (and docstring), at line starts."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return []
    line_starts = [0]
    for line in source.splitlines(keepends=True):
        line_starts.append(line_starts[-1] + len(line))
    cuts = set()
    for node in _walk_statements(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if (isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant)
                    and isinstance(first.value.value, str)):
                if len(node.body) == 1:
                    continue  # docstring-only function: nothing to continue
                line = first.end_lineno  # cut after the docstring
            else:
                line = first.lineno - 1  # cut before the first body line
            if first.lineno == node.lineno:
                continue  # one-liner ``def f(): return x``
            if 0 < line < len(line_starts):
                cuts.add(line_starts[line])
    return sorted(cuts)


def iter_stdlib_prompts(modules: Iterable[str] | None = None, seed: int = 0,
                        context_chars: int = 1200, per_module: int | None = None,
                        exclude_heldout: bool = False) -> Iterator[dict]:
    """Code-completion prompts cut from stdlib sources at function-body boundaries.

    Each prompt is up to ``context_chars`` of source (starting at a line start) ending
    after a function header (and its docstring), without the final newline (BPE
    tokenizers merge it with the next line's indentation), so the model writes the body.
    Modules are visited round-robin in seeded order, one cut per module per round,
    cuts in seeded order, at most ``per_module`` per module.

    Yields ``{"id": "module:offset", "source": "stdlib", "kind": "code", "prompt",
    "module"}``.
    """
    mods = sorted(set(modules)) if modules is not None else list(stdlib_modules())
    if exclude_heldout:
        mods = [m for m in mods if not is_heldout_module(m)]
    random.Random(seed).shuffle(mods)

    def one(mod: str) -> Iterator[dict]:
        try:
            src = module_path(mod).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            return
        cuts = _code_cuts(src)
        random.Random(f"{seed}:{mod}").shuffle(cuts)
        for cut in cuts[:per_module]:
            start = max(0, cut - context_chars)
            if start > 0:
                nl = src.find("\n", start, cut)
                start = nl + 1 if nl >= 0 else cut
            # end before the newline: tokenizers merge "\n" with the next line's indent
            text = src[start:cut].rstrip("\r\n")
            if text.strip():
                yield {"id": f"{mod}:{cut}", "source": "stdlib", "kind": "code",
                       "prompt": text, "module": mod}

    yield from interleave([one(m) for m in mods])


def interleave(iters: Iterable[Iterator[dict]]) -> Iterator[dict]:
    """Round-robin over iterators until all are exhausted (the modules' cuts here, the
    prompt sources of a data build, :mod:`dspine.data.build`)."""
    active = list(iters)
    while active:
        nxt = []
        for it in active:
            rec = next(it, None)
            if rec is not None:
                yield rec
                nxt.append(it)
        active = nxt
