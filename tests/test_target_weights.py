"""Opt-in Q8_0 weights of the target (``--target-weights q8_0``, dspine.runtime.weights).

Rounding makes every linear of a target that holds no blocks (here a random llama) exact
Q8_0 blocks: blockq then packs all of them (negative control: the target as loaded packs
none), the head tied to the embeddings rounds once, and speculative decoding is lossless
relative to the quantized target: greedy DSpine equals greedy ``ar`` on the same weights,
both on the lean path where the kernels build. Bad settings are refused by name.
"""
from __future__ import annotations

import pytest
import torch
from torch import nn

from conftest import random_proposer
from dspine.config import SpeculativeConfig
from dspine.config import SamplingConfig
from dspine.core.engine import Engine
from dspine.runtime import blockq
from dspine.runtime.weights import quantize_target
from dspine.target.adapter import load_target
from dspine.drafter.q8 import q8_round

pytestmark = pytest.mark.usefixtures("one_thread")


def _linears(t):
    return [m for m in t.model.modules() if isinstance(m, nn.Linear) and m.in_features % 32 == 0]


def _random(vocab: int = 256):
    return load_target("random:llama", vocab_size=vocab, seed=0)


def test_q8_0_rounds_every_linear_to_exact_blocks():
    t = _random()
    before = [m.weight.clone() for m in _linears(t)]
    assert blockq.kernels(progress=False) is None or all(blockq.pack_q8(w) is None for w in before)
    n = quantize_target(t, "q8_0")
    lins = _linears(t)
    assert n == len({id(m.weight) for m in lins}) and t.name.endswith("+q8_0") and t.weights_format == "q8_0"
    for m, w0 in zip(lins, before):
        assert torch.equal(m.weight, q8_round(m.weight))  # idempotent: already blocks
        assert (m.weight - w0).abs().max() <= w0.abs().max() / 127  # at most one step of its block
    if t.model.lm_head.weight is t.model.get_input_embeddings().weight:
        assert torch.equal(t.model.get_input_embeddings().weight, t.model.lm_head.weight)
    if blockq.kernels(progress=False) is not None:
        assert all(blockq.pack_q8(m.weight.data) is not None for m in lins)


def test_as_is_changes_nothing_and_bad_settings_are_refused():
    t = _random()
    w = _linears(t)[0].weight.clone()
    assert quantize_target(t, "as-is") == 0 and torch.equal(_linears(t)[0].weight, w) and "+" not in t.name
    with pytest.raises(ValueError, match="SpeculativeConfig.target_weights 'int3'"):
        quantize_target(t, "int3")
    from dspine.build import build_engine
    from dspine.config import ConfigError

    with pytest.raises(ConfigError, match="SpeculativeConfig.target_weights 'int3' is unknown"):
        build_engine(SpeculativeConfig(target="random:llama", drafter="random", mode="dspine",
                                       target_weights="int3", verify_policy="fixed", proposer="drafter",
                                       linear_backend="aten", tree_budget=0))


def test_greedy_dspine_equals_ar_on_the_quantized_target():
    t = _random()
    quantize_target(t, "q8_0")
    t.set_runtime("dense")
    if blockq.kernels(progress=False) is not None:
        from dspine.runtime.packed import apply_linear_backend

        apply_linear_backend(t, "blockq", progress=False)  # exact blocks: the backend now takes them
        assert t.runtime.decode_path == "lean"
    prompt = list(range(1, 40))
    ref = Engine(t, None, "ar").generate(prompt, SamplingConfig(), 40).token_ids
    got = Engine(t, random_proposer(t, "dspine", 8, seed=1), "dspine").generate(prompt, SamplingConfig(), 40)
    assert got.token_ids == ref and got.stats.kernels["target_weights"] == "q8_0"


def test_blockq_is_offered_for_the_quantized_target_only():
    from dspine.runtime.packed import available_backends

    if blockq.kernels(progress=False) is None:
        pytest.skip(f"the blockq kernels cannot be built here: {blockq.unavailable_reason()}")
    t = _random()
    assert "blockq" not in available_backends(t, progress=False)  # control: no blocks as loaded
    quantize_target(t, "q8_0")
    assert "blockq" in available_backends(t, progress=False)
