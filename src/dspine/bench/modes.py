"""The benchmark's mode names: dspine's engine modes and the transformers peers.

:data:`ENGINE_MODES` run through :class:`dspine.core.engine.Engine`
(:class:`dspine.bench.runners.EngineRunner`), :data:`HF_MODES` through transformers'
``generate`` (:class:`dspine.bench.hf_runner.HFRunner`); :data:`FIXED_MODES` run one fixed
configuration whatever the run's settings. The llama.cpp peers are
:data:`dspine.bench.llama_cpp.LLAMA_MODES`.
"""
from __future__ import annotations

ENGINE_MODES = ("ar", "dflash", "dspine", "ngram", "dspine-drafter")  # ngram: our own prompt lookup (no drafter)
#: modes that run a fixed configuration whatever the run's --proposer / --verify-policy / tree:
#: the drafter alone (single chain, the whole block verified every cycle)
FIXED_MODES = {"dspine-drafter": dict(drafter="dspine", proposer="drafter", verify_policy="fixed")}

HF_MODES = ("hf", "hf-pld")
ALL_MODES = ENGINE_MODES + HF_MODES


def drafter_kind(mode: str) -> str:
    """The drafter a mode runs (``dspine`` / ``dflash``), ``mode`` itself for the others."""
    return FIXED_MODES.get(mode, {}).get("drafter", mode)
