"""The target's linears through oneDNN with pre-packed weights (dspine.runtime.packed):
numerics against nn.Linear, the measured backend choice (injected timings), and
exactness with the packed target: greedy equality with ``ar`` on the real target and the
shipped drafter, and the exact sampled distribution (enumeration, chi-square) with a
negative control that must fail.
"""
from __future__ import annotations

import contextlib

import pytest
import torch
from torch import nn

from dspine.config import SpeculativeConfig
from dspine.build import DEFAULT_CHECKPOINTS
from dspine.config import SamplingConfig
from dspine.drafter.checkpoint import load_drafter
from dspine.proposers.drafter import DrafterProposer
from dspine.core.engine import Engine
from dspine.control.base import FixedPolicy
from dspine.tune.controller import make_policy
from dspine.runtime.layout import is_column_major, model_is_column_major, set_column_major
from dspine.runtime.packed import (LINEAR_BACKENDS, PackedLinear, apply_linear_backend, available_backends,
                                   choose_linear_backend,
                                   is_packed, onednn_available, pack_linears, packed_bytes, set_linear_backend,
                                   unpack_linears)

pytestmark = [pytest.mark.usefixtures("one_thread"),
              pytest.mark.skipif(not onednn_available(), reason="this torch build has no oneDNN linear ops")]


@contextlib.contextmanager
def packed(target, backend="onednn"):
    """``target`` with ``backend`` linears for the duration (shared fixtures are restored)."""
    apply_linear_backend(target, backend)
    try:
        yield target
    finally:
        apply_linear_backend(target, "aten")


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.bfloat16, 3e-2)])
@pytest.mark.parametrize("shape", [(1, 1), (1, 7), (3, 16)])
def test_packed_linear_matches_linear(dtype, tol, shape):
    torch.manual_seed(0)
    lin = nn.Linear(96, 160, bias=True).to(dtype)
    holder = nn.Sequential(lin)
    try:
        pack_linears(holder)
    except ValueError as e:  # bf16 on a CPU without AVX-512 / AVX-NE-CONVERT: a clear refusal
        assert dtype == torch.bfloat16 and "SpeculativeConfig.linear_backend onednn" in str(e) \
            and "use SpeculativeConfig.linear_backend='aten'" in str(e)
        assert type(holder[0]) is nn.Linear  # nothing left half-packed
        return
    p = holder[0]
    assert isinstance(p, PackedLinear)
    x = torch.randn(*shape, 96).to(dtype)
    ref = lin(x)
    got = p(x)
    assert got.dtype == dtype and got.shape == ref.shape
    assert torch.allclose(got.float(), ref.float(), atol=tol, rtol=tol)
    assert torch.allclose(p(x[:, ::1].transpose(0, 1).transpose(0, 1)).float(), ref.float(), atol=tol, rtol=tol)


def test_pack_unpack_keeps_parameters_and_ties(tiny256):
    m = tiny256.model
    names = {n: p for n, p in m.named_parameters()}
    head = tiny256.output_head()
    try:
        n = pack_linears(m)
        assert n > 0 and is_packed(m) and packed_bytes(m) > 0
        assert tiny256.output_head() is head  # the drafter's head binding is unchanged
        assert {k: v for k, v in m.named_parameters()}.keys() >= names.keys()
    finally:
        assert unpack_linears(m) == n
    assert not is_packed(m) and all(type(x) is not PackedLinear for x in m.modules())


def test_column_major_layout_keeps_values_identity_and_ties(tiny256):
    m = tiny256.model
    ref = {n: p.detach().clone() for n, p in m.named_parameters()}
    ids = {n: id(p) for n, p in m.named_parameters()}
    head = tiny256.output_head()
    x = torch.tensor([[3, 4, 5, 6, 7]])
    with torch.no_grad():
        before = m(input_ids=x).logits
    try:
        assert set_column_major(m, True) > 0 and model_is_column_major(m)
        assert set_column_major(m, True) == 0  # already so
        assert tiny256.output_head() is head and is_column_major(head)
        for n, p in m.named_parameters():
            assert id(p) == ids[n] and torch.equal(p, ref[n]), n
        with torch.no_grad():
            after = m(input_ids=x).logits
        assert torch.allclose(after, before, atol=1e-5, rtol=1e-5)
    finally:
        set_column_major(m, False)
    assert not model_is_column_major(m) and all(p.is_contiguous() for p in m.parameters())


@pytest.mark.parametrize("rows", [1, 2, 5])
def test_mixed_linear_matches_linear(rows):
    torch.manual_seed(0)
    lin = nn.Linear(96, 160, bias=True)
    holder = nn.Sequential(lin)
    x = torch.randn(1, rows, 96)
    ref = lin(x)
    set_linear_backend(holder, "mixed")
    p = holder[0]
    assert isinstance(p, PackedLinear) and p.one_row_aten and is_column_major(p.weight)
    assert torch.allclose(p(x), ref, atol=1e-5, rtol=1e-5)
    set_linear_backend(holder, "onednn")  # switching re-packs without the one-row path, row-major again
    assert not holder[0].one_row_aten and holder[0].weight.is_contiguous()
    set_linear_backend(holder, "aten")
    assert type(holder[0]) is nn.Linear and holder[0].weight.is_contiguous()
    with pytest.raises(ValueError, match="SpeculativeConfig.linear_backend 'fast'"):
        set_linear_backend(holder, "fast")


def test_backend_choice_follows_measurement_and_restores_aten(tiny256):
    def timer(ms):
        def t(name, fn, repeats, cap):
            fn()
            return ms[name] / 1e3
        return t
    ms = {"aten": 10.0, "transposed": 8.0, "onednn": 4.0, "mixed": 5.0}
    c = choose_linear_backend(tiny256, redo=True, progress=False, timer=timer(ms))
    assert c.chosen == "onednn" and not is_packed(tiny256.model)  # left on aten
    assert not model_is_column_major(tiny256.model)
    c = choose_linear_backend(tiny256, redo=True, progress=False, timer=timer(dict(ms, mixed=3.0)))
    assert c.chosen == "mixed" and not is_packed(tiny256.model) and not model_is_column_major(tiny256.model)
    c = choose_linear_backend(tiny256, redo=True, progress=False, timer=timer(dict(ms, aten=2.0)))
    assert c.chosen == "aten"
    with pytest.raises(ValueError, match="SpeculativeConfig.linear_backend 'mkl'"):
        apply_linear_backend(tiny256, "mkl")


def test_real_measurement_runs(tiny256):
    c = choose_linear_backend(tiny256, redo=True, progress=False)
    assert c.chosen in LINEAR_BACKENDS and set(c.times_ms) == set(available_backends(tiny256))
    assert "blockq" not in c.times_ms  # random weights hold no exact blocks
    assert not is_packed(tiny256.model) and not model_is_column_major(tiny256.model)


def test_build_engine_reports_the_backend():
    from dspine.build import build_engine
    t, eng = build_engine(SpeculativeConfig(target="random:llama", drafter="random", mode="dspine",
                                            linear_backend="onednn", block_size=4, verify_policy="fixed",
                                            proposer="drafter", tree_budget=0))
    res = eng.generate([3, 4, 5, 6], SamplingConfig(), 8)
    assert res.stats.kernels["linear_backend"] == "onednn" and is_packed(t.model)
    ref = Engine(t, None, "ar").generate([3, 4, 5, 6], SamplingConfig(), 8)
    assert res.token_ids == ref.token_ids


PROMPTS = ["Write a Python function that returns the n-th Fibonacci number.",
           "Explain in two sentences why the sky is blue."]


@pytest.mark.parametrize("mode,backend,runtime", [  # all slow: the default (mixed, dense) runs in the default
    # suite through test_dense_runtime / test_shipped_drafters / test_proposers (suite time)
    pytest.param("dspine", "onednn", "hf", marks=pytest.mark.slow),
    pytest.param("dflash", "mixed", "dense", marks=pytest.mark.slow),
    pytest.param("dspine", "transposed", "dense", marks=pytest.mark.slow)])
def test_greedy_equal_to_ar_with_packed_real_target(smol, mode, backend, runtime):
    """float32, the shipped drafter, fixed full blocks and the cost policy: token for token,
    with each linear backend (and the dense runtime, :mod:`dspine.runtime.dense`)."""
    drafter = load_drafter(DEFAULT_CHECKPOINTS / f"smollm2-135m-{mode}", smol)
    smol.set_runtime(runtime)
    try:
        with packed(smol, backend):
            assert model_is_column_major(smol.model) == (backend in ("transposed", "mixed"))
            prop = DrafterProposer(drafter)
            for text in PROMPTS:
                ids = smol.encode_prompt(text, chat=True)
                ref = Engine(smol, None, "ar").generate(ids, SamplingConfig(), 48).token_ids
                for pol in (FixedPolicy(), make_policy("cost", smol, prop)):
                    got = Engine(smol, prop, mode, verify_policy=pol).generate(ids, SamplingConfig(), 48)
                    assert got.token_ids == ref, (mode, backend, pol.name, text)
                    assert got.stats.kernels["linear_backend"] == backend
                    assert got.stats.kernels["target_runtime"] == runtime
    finally:
        smol.set_runtime("hf")
    assert not model_is_column_major(smol.model) and not is_packed(smol.model)


@pytest.mark.slow  # the default suite runs the same test on the dense runtime with `mixed` linears
def test_sampled_distribution_exact_with_packed_target(tiny, monkeypatch):
    """Chi-square against the exact distribution of the packed target (enumerated with the
    packed target itself), DSpine drafter with sparse q; the negative control (residual
    without q) must fail on the same packed target."""
    import test_distribution as TD

    with packed(tiny):
        TD.check_exact_with_negative_control(tiny, monkeypatch)
