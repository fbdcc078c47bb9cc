"""The package has no import circles (each module one concern, layered).

Every import counts, those inside functions too: a lazy import that closes a circle
still ties two modules to each other. Fails on the tree before 2026-12-01 (target <->
hybrid, data build <-> cli <-> text, bench harness <-> report).
"""
from __future__ import annotations

import ast
from pathlib import Path

import dspine

ROOT = Path(dspine.__file__).parent


def import_graph(root: Path = ROOT) -> dict[str, set[str]]:
    """Module name -> the package modules it imports (relative and absolute, anywhere)."""
    mods = {}
    for path in root.rglob("*.py"):
        rel = path.relative_to(root.parent).with_suffix("")
        name = ".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts)
        mods[name] = path
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for m, path in mods.items():
        pkg = m if path.name == "__init__.py" else m.rsplit(".", 1)[0]
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    base = pkg.split(".")[: len(pkg.split(".")) - (node.level - 1)]
                    tgt = ".".join(base + ([node.module] if node.module else []))
                else:
                    tgt = node.module or ""
                cands = [tgt] + [f"{tgt}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                cands = [a.name for a in node.names]
            else:
                continue
            graph[m].update(c for c in cands if c in mods and c != m)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_cycle_finder_finds_a_circle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_import_circles():
    assert cycles(import_graph()) == []


def test_proposers_have_a_home():
    g = import_graph()
    assert {"dspine.proposers.base", "dspine.proposers.drafter", "dspine.proposers.ngram",
            "dspine.proposers.copy_or_draft"} <= set(g)
    assert "dspine.core.engine" not in g["dspine.proposers.base"]  # the interface does not know the engine


# -- the layout: folders that show the architecture --------------------------------------
APPS = ("cli", "tune", "serve", "bench", "train", "data", "export")  # what runs things, measures or builds


def top(module: str) -> str:
    """``dspine.core.engine`` -> ``core``; a root module names itself."""
    return module.split(".")[1] if module.count(".") else ""


def layering_violations(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
    """(importer, imported) pairs that break docs/architecture.md's rules: the decode cycle
    (``core``), the proposers, drafter, target and controllers import no application
    package (cli, tune, serve, bench, train, data, export): machine measurements are made
    where an engine is built (``build``, ``tune``) and passed in."""
    out = []
    for m, deps in graph.items():
        if top(m) not in ("core", "proposers", "drafter", "target", "control", "trees"):
            continue
        for d in deps:
            if top(d) in APPS:
                out.append((m, d))
    return sorted(out)


def test_layering_rules_hold():
    assert layering_violations(import_graph()) == []


def test_layering_check_catches_a_violation():
    g = {"dspine.core.engine": {"dspine.cli.main"}, "dspine.cli.main": set(),
         "dspine.bench.cli": {"dspine.core.engine"}}
    assert layering_violations(g) == [("dspine.core.engine", "dspine.cli.main")]


def test_few_modules_at_the_root():
    """The root holds the package's shared vocabulary only; every capability has a folder."""
    root = sorted(p.name for p in ROOT.glob("*.py"))
    assert root == ["__init__.py", "argtypes.py", "build.py", "config.py", "guards.py"], root
