"""Benchmark harness (``dspine bench``, spec section 10).

Every mode (``ar``, ``dflash``, ``dspine``, transformers ``hf`` and ``hf-pld``) runs on the
same loaded target, precision, device, threads, prompts, context budget and decoding
settings; :func:`check_fair` refuses a run where any of it differs. See
:mod:`dspine.bench.harness` (protocol), :mod:`dspine.bench.run_config` (the run's
configuration), :mod:`dspine.bench.workloads` (prompt sets), :mod:`dspine.bench.checks`
(pass@1, tool-call validity), :mod:`dspine.bench.summary` (summary, cost model),
:mod:`dspine.bench.report` (Markdown) and :mod:`dspine.bench.plots` (plots).
"""
from dspine.bench.fairness import BenchError, UnfairComparisonError, check_fair, check_rows_fair
from dspine.bench.harness import Harness, run_bench
from dspine.bench.run_config import GREEDY, SAMPLED, BenchConfig, DecodeSetting, require_batched_engine, smoke_config

__all__ = ["GREEDY", "SAMPLED", "BenchConfig", "BenchError", "DecodeSetting", "Harness",
           "UnfairComparisonError", "check_fair", "check_rows_fair", "require_batched_engine",
           "run_bench", "smoke_config"]
