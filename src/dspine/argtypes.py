"""argparse value types shared by the ``dspine`` commands.

Each raises :class:`argparse.ArgumentTypeError`, so argparse prints
``argument --NAME: <message>`` and exits with status 2 (the setting is named).
"""
from __future__ import annotations

import argparse

#: ``--proposer`` values (here, free of torch, so that parsers list them without importing
#: the proposers): the drafter alone, copies alone, or the per-cycle hybrid (dspine.proposers)
PROPOSER_NAMES = ("drafter", "ngram", "hybrid")
#: draft-tree nodes per cycle of ``generate`` and ``bench`` by default (dspine.trees), an upper
#: bound for the per-cycle size (``--tree-size cost``): the budget that was fastest with the default
#: proposer and cost policy in benchmarks/archive/tree_size.json (AVX2 AMD EPYC; docs/decisions.md
#: "Per-cycle tree size"); ``acceptance`` defaults to chains (0)
MAX_NGRAM_PRIOR_WEIGHT = 100.0  # --ngram-prior-weight (dspine.drafter.ngram_prior: log P >= log 0.001)
DEFAULT_TREE_BUDGET = 16
DEFAULT_SERVE_TREE_BUDGET = 16  # `dspine serve` (measured: docs/decisions.md, 2026-12-03)
#: ``--tree-size``: ``fixed`` verifies every node the budget allows; ``cost`` the best-first
#: prefix with the most expected tokens per second (dspine.control.tree_sizer)
TREE_SIZES = ("fixed", "cost")
DEFAULT_TREE_SIZE = "cost"
#: the most draft-tree nodes per cycle: one target forward holds an (N+1) x (context+N+1) mask
#: and attention scores, and far past the final stage's useful paths a tree only costs time
MAX_TREE_BUDGET = 256


def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None


def positive_int(text: str) -> int:
    """An integer >= 1 (counts, sizes, token budgets)."""
    v = _int(text)
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}")
    return v


def nonneg_int(text: str) -> int:
    """An integer >= 0 (0 keeps a documented default, e.g. ``--threads 0``)."""
    v = _int(text)
    if v < 0:
        raise argparse.ArgumentTypeError(f"must be an integer >= 0, got {text!r}")
    return v


#: ``--threads`` above this many per CPU core is refused (a mistyped huge count makes the
#: OpenMP/BLAS runtimes try to start that many threads and crash the process).
MAX_THREADS_PER_CORE = 4


def thread_count(text: str) -> int:
    """``--threads``: 0 (the library's own default) .. 4 x the CPU cores."""
    import os

    v = nonneg_int(text)
    cap = MAX_THREADS_PER_CORE * (os.cpu_count() or 1)
    if v > cap:
        raise argparse.ArgumentTypeError(f"must be 0 .. {cap} ({MAX_THREADS_PER_CORE} x the {os.cpu_count()} "
                                         f"CPU cores), got {text!r}")
    return v


def seed_int(text: str) -> int:
    """A random seed 0 .. 2**63 - 1 (what ``torch.Generator.manual_seed`` takes without wrapping)."""
    v = _int(text)
    if not 0 <= v <= 2**63 - 1:
        raise argparse.ArgumentTypeError(f"must be an integer in 0 .. 2**63 - 1, got {text!r}")
    return v


def port_number(text: str) -> int:
    """A TCP port 0..65535 (0 picks a free port)."""
    v = _int(text)
    if not 0 <= v <= 65535:
        raise argparse.ArgumentTypeError(f"must be a TCP port 0..65535, got {text!r}")
    return v


def nonneg_float(text: str) -> float:
    """A finite number >= 0 (timeouts in seconds)."""
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not (v >= 0 and v != float("inf")):
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text!r}")
    return v


def positive_float(text: str) -> float:
    """A finite number > 0 (learning rates, scales)."""
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not (v > 0 and v != float("inf")):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text!r}")
    return v


def unit_float(text: str) -> float:
    """A number in [0, 1] (ratios, fractions)."""
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not 0.0 <= v <= 1.0:  # also refuses nan
        raise argparse.ArgumentTypeError(f"must be a number in [0, 1], got {text!r}")
    return v


def tree_shape(text: str) -> str:
    """``dynamic`` or comma-separated widths >= 1 (``--tree-shape``, :mod:`dspine.trees`)."""
    if text.strip() == "dynamic":
        return "dynamic"
    parts = [x.strip() for x in text.split(",")]
    widths = [int(x) for x in parts if x.isascii() and x.isdigit()]
    if len(widths) != len(parts) or min(widths) < 1:
        raise argparse.ArgumentTypeError(f"must be 'dynamic' or comma-separated widths >= 1 such as 4,2,1, got {text!r}")
    return text.strip()


def tree_budget(text: str) -> int:
    """Draft-tree nodes per cycle: an integer in 0..MAX_TREE_BUDGET (``--tree-budget``)."""
    v = nonneg_int(text)
    if v > MAX_TREE_BUDGET:
        raise argparse.ArgumentTypeError(f"must be at most {MAX_TREE_BUDGET} nodes, got {text!r}")
    return v


def add_tree_args(p: argparse.ArgumentParser, default_budget: int = 0) -> None:
    """``--tree-budget`` and ``--tree-shape`` (draft trees, :mod:`dspine.trees`)."""
    p.set_defaults(tree_budget_default=default_budget)
    p.add_argument("--tree-budget", type=tree_budget, default=None, metavar="N",
                   help=f"verify a draft tree of up to N nodes per cycle built from the final stage's "
                        f"candidate tables instead of a single chain (0 = a chain; default {default_budget}; "
                        f"a copied continuation of the hybrid proposer may add its own nodes); "
                        "DSpine drafters on the dense runtime, other cycles keep chains")
    p.add_argument("--tree-shape", type=tree_shape, default="dynamic", metavar="{dynamic,W1,W2,...}",
                   help="dynamic (default: the N most probable nodes by path probability when greedy; "
                        "widths 4,2,1 when sampling) | widths per depth, e.g. 4,2,1,1")
    p.add_argument("--tree-size", choices=TREE_SIZES, default=None,
                   help=f"fixed: verify every node the budget allows | cost: verify the most probable nodes "
                        f"while they add expected tokens faster than time (greedy dynamic trees, with "
                        f"--verify-policy cost) (default {DEFAULT_TREE_SIZE})")



def ngram_prior_setting(text: str) -> str:
    """``--ngram-prior``: ``off``, ``auto`` or a directory (checked when the engine is built)."""
    if not text:
        raise argparse.ArgumentTypeError("must be off, auto or a `dspine data build` directory")
    return text


def add_ngram_prior_args(p, default: str = "off") -> None:
    """``--ngram-prior`` and ``--ngram-prior-weight`` (:mod:`dspine.drafter.ngram_prior`)."""
    p.add_argument("--ngram-prior", type=ngram_prior_setting, default=default, metavar="off|auto|DIR",
                   help="DSpine drafters: score the final stage's chain with counts of what the target wrote "
                        "after the same 1-6 tokens in its regenerated training answers (auto: the repository's "
                        f"committed data for the target; DIR: a `dspine data build` directory); default {default}")
    p.add_argument("--ngram-prior-weight", type=prior_weight, default=0.5, metavar="W",
                   help="weight of the prior's log-probability in the chain's scores (0..100, default 0.5; 0: the prior is off)")


def prior_weight(text: str) -> float:
    """``--ngram-prior-weight``: a number in 0..100."""
    v = nonneg_float(text)
    if v > MAX_NGRAM_PRIOR_WEIGHT:
        raise argparse.ArgumentTypeError(f"must be at most {MAX_NGRAM_PRIOR_WEIGHT:g}, got {text}")
    return v
