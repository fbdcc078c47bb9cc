"""Which forward runs the target: transformers' (``hf``) or the dense runtime (``dense``).

``--runtime auto`` (the default) takes ``dense`` wherever :mod:`dspine.runtime.dense`
supports the target (dense llama / qwen2 / qwen3 with full attention) and ``hf``
elsewhere (hybrid Gated-DeltaNet targets, sliding windows, other architectures). The
dense runtime runs the same modules and weights with less Python around them, so it is
not a kernel choice that depends on the CPU: its float32 logits are bit-identical to
transformers' on the tested targets (``tests/test_dense_runtime.py``) and it was faster
on every shape measured (``benchmarks/archive/target_runtime.py``).
"""
from __future__ import annotations

from dspine.config import ConfigError

RUNTIMES = ("hf", "dense")


def resolve_runtime(target, name: str) -> str:
    """``auto`` -> ``dense`` where supported, else ``hf``; other names are checked.

    Raises:
        ConfigError: an unknown name, or ``dense`` for a target it cannot run (naming
            ``SpeculativeConfig.runtime``).
    """
    from dspine.runtime.dense import runtime_support

    if name not in ("auto", *RUNTIMES):
        raise ConfigError(f"SpeculativeConfig.runtime {name!r} is unknown; accepted: auto, {', '.join(RUNTIMES)}",
                          field="runtime")
    if name == "auto":
        return "dense" if target.hybrid is None and runtime_support(target.model) is None else "hf"
    if name == "dense" and target.hybrid is not None:
        raise ConfigError("SpeculativeConfig.runtime dense cannot run this target: a hybrid (Gated-DeltaNet) target "
                          "keeps transformers' forward and its replay cache; use SpeculativeConfig.runtime='hf'",
                          field="runtime")
    return name


def apply_runtime(target, name: str) -> str:
    """Resolve ``name`` (:func:`resolve_runtime`) and set it on ``target``; returns it."""
    return target.set_runtime(resolve_runtime(target, name))
