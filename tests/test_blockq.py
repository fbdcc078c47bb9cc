"""``--linear-backend blockq`` (dspine.runtime.blockq): exact Q4_1/Q8_0 blocks of the
target's float32 weights, C++ kernels for up to 16 rows.

Exactness is proven like every other backend: packing rebuilds the weights bitwise (with
negative controls that must not pack), the kernels equal ``F.linear`` on the same
weights up to float32 summation order, greedy decoding on the real target is token for
token ``ar``'s, and the sampled distribution is exact on a tiny target whose weights were
rounded to Q4_1 blocks (chi-square, with the negative control failing).
"""
from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
from torch import nn

from dspine.config import SamplingConfig
from dspine.core.engine import Engine
from dspine.runtime import blockq as B
from dspine.runtime.packed import apply_linear_backend, available_backends, set_linear_backend

pytestmark = pytest.mark.usefixtures("one_thread")


def _kernels_or_skip():
    if B.kernels(progress=False) is None:
        pytest.skip(f"the blockq kernels cannot be built here: {B.unavailable_reason()}")


def q4_weight(N: int, K: int, seed: int = 0) -> torch.Tensor:
    """A float32 [N, K] weight made of Q4_1 blocks (float16 d, m; each block uses q = 0 and 15)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (N, K // 32, 32), generator=g).float()
    q[..., 0], q[..., 1] = 0, 15
    d = (torch.rand(N, K // 32, 1, generator=g) * 0.02 + 1e-3).half().float()
    m = (torch.randn(N, K // 32, 1, generator=g) * 0.1).half().float()
    return (d * q + m).reshape(N, K)


def q8_weight(N: int, K: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(-127, 128, (N, K // 32, 32), generator=g).float()
    q[..., 0] = 127
    d = (torch.rand(N, K // 32, 1, generator=g) * 0.01 + 1e-4).half().float()
    return (d * q).reshape(N, K)


def quantize_linears_(model: nn.Module) -> None:
    """Round every linear weight of ``model`` to Q4_1 blocks in place (a new, block-exact target)."""
    for mod in model.modules():
        if isinstance(mod, nn.Linear):
            w = mod.weight.data
            g = w.reshape(w.shape[0], -1, 32)
            m = g.amin(-1, keepdim=True).half().float()
            d = ((g.amax(-1, keepdim=True) - m) / 15).half().float()
            q = torch.round((g - m) / d).clamp(0, 15)
            q[..., 0], q[..., 1] = 0, 15  # keep both ends in every block (as GGUF's quantizer does)
            w.copy_((d * q + m).reshape_as(w))


# -- packing ----------------------------------------------------------------------------------------
def test_pack_rebuilds_weights_bitwise():
    w4, w8 = q4_weight(48, 96), q8_weight(40, 64)
    q, d, m = B.pack_q4(w4)
    lo, hi = (q & 15).float(), (q >> 4).float()
    qq = torch.cat([lo.reshape(48, 3, 16), hi.reshape(48, 3, 16)], -1)  # byte j: q[j] | q[j+16] << 4
    assert torch.equal(d[..., None] * qq + m[..., None], w4.reshape(48, 3, 32))
    q8, d8 = B.pack_q8(w8)
    assert torch.equal(d8[..., None] * q8.float().reshape(40, 2, 32), w8.reshape(40, 2, 32))
    z = torch.zeros(4, 32)  # constant blocks (d = 0) pack too
    assert B.pack_q4(z) is not None and B.pack_q8(z) is not None


def test_pack_refuses_weights_that_are_not_blocks():
    w = q4_weight(8, 64)
    w[3, 17] = torch.nextafter(w[3, 17], torch.tensor(1.0))  # one float32 ulp off: no longer d*q+m
    assert B.pack_q4(w) is None
    assert B.pack_q4(torch.randn(8, 64)) is None and B.pack_q8(torch.randn(8, 64)) is None
    assert B.pack_q4(q4_weight(8, 64)[:, :48]) is None  # K not a multiple of 32
    assert B.pack_q4(q4_weight(8, 64).double()) is None  # float32 only


# -- kernels --------------------------------------------------------------------------------------
@pytest.mark.parametrize("rows", [1, 3, 5, 16, 32])
def test_kernels_equal_linear_on_the_same_weights(rows):
    _kernels_or_skip()
    mod = B.kernels()
    x = torch.randn(rows, 96)
    w4, w8 = q4_weight(80, 96, 1), q8_weight(80, 96, 2)
    for w, p, call in ((w4, B.pack_q4(w4), lambda x, p: mod.q4_linear(x, *p)),
                       (w8, B.pack_q8(w8), lambda x, p: mod.q8_linear(x, *p))):
        ref = x @ w.T
        y = call(x, p)
        assert y.shape == ref.shape
        torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())
        assert not torch.allclose(call(x + 1e-2, p), ref, rtol=1e-5, atol=1e-6)  # negative control


@pytest.mark.parametrize("kind", ["q4", "q8"])
def test_kernel_rows_are_batch_invariant(kind):
    """Row r of an M-row call is bitwise row r computed alone, for every M up to the row
    limit (one summation order per dot product, whatever the row group): a verification's
    logits are the plain loop's. Negative control: PyTorch's GEMM on the same weights sums
    in another order, and the comparison sees it."""
    _kernels_or_skip()
    mod = B.kernels()
    w = q4_weight(70, 160, 4) if kind == "q4" else q8_weight(70, 160, 5)
    p = B.pack_q4(w) if kind == "q4" else B.pack_q8(w)
    call = (lambda x: mod.q4_linear(x, *p)) if kind == "q4" else (lambda x: mod.q8_linear(x, *p))
    x = torch.randn(B.MAX_ROWS, 160, generator=torch.Generator().manual_seed(6))
    alone = torch.cat([call(x[r:r + 1].contiguous()) for r in range(B.MAX_ROWS)])
    for m in range(1, B.MAX_ROWS + 1):
        assert torch.equal(call(x[:m].contiguous()), alone[:m]), m
    assert not torch.equal(x @ w.T, alone)  # negative control: another order, other bits


def test_blockq_linear_falls_back_beyond_its_rows_and_keeps_bias():
    _kernels_or_skip()
    lin = nn.Linear(64, 40)
    lin.weight.data.copy_(q4_weight(40, 64, 3))
    bq = B.BlockQLinear(lin, B.pack_q4(lin.weight), rows=B.MAX_ROWS)
    for shape in ((1, 64), (2, 5, 64), (B.MAX_ROWS + 1, 64), (3, 11, 64)):
        x = torch.randn(*shape)
        torch.testing.assert_close(bq(x), lin(x), rtol=1e-5, atol=1e-5)
    assert bq.weight is lin.weight and bq.bias is lin.bias


# -- the backend on targets -------------------------------------------------------------------------
def test_blockq_is_offered_only_for_block_exact_targets(tiny256, monkeypatch):
    assert "blockq" not in available_backends(tiny256)  # random float32 weights: no blocks
    with pytest.raises(ValueError, match="SpeculativeConfig.linear_backend blockq: no linear layer"):
        set_linear_backend(tiny256.model, "blockq")
    assert not any(isinstance(m, B.BlockQLinear) for m in tiny256.model.modules())
    monkeypatch.setattr(B, "_STATE", {"mod": None, "why": "no C++ compiler"})
    with pytest.raises(ValueError, match="could not be built here.*no C\\+\\+ compiler"):
        set_linear_backend(tiny256.model, "blockq")


def test_a_failed_build_is_remembered(tmp_path, monkeypatch):
    monkeypatch.setenv("DSPINE_HOME", str(tmp_path))
    monkeypatch.setattr(B, "_STATE", {})
    d = tmp_path / "kernels" / f"blockq-{B._build_key()}"
    d.mkdir(parents=True)
    (d / "FAILED").write_text("CalledProcessError: no compiler\n")
    assert B.kernels(progress=False) is None
    assert "no compiler" in B.unavailable_reason() and "to retry" in B.unavailable_reason()


def test_other_backends_never_build_the_kernels(tiny256, monkeypatch):
    def boom(progress=True):
        raise AssertionError("blockq kernels built for another backend")

    monkeypatch.setattr(B, "kernels", boom)
    apply_linear_backend(tiny256, "mixed")
    apply_linear_backend(tiny256, "aten")


def test_kernel_rows_follow_a_measurement(monkeypatch):
    _kernels_or_skip()
    model = nn.Sequential(nn.Linear(64, 96), nn.Linear(96, 64))
    for lin in model:
        lin.weight.data.copy_(q4_weight(lin.out_features, lin.in_features))
    B.pack_blocks(model, rows=B.MAX_ROWS)
    assert B.choose_rows(model) in (B.MAX_ROWS, 17, 4, 1)  # one of the measured sizes, or one-row steps
    assert len({m.rows for m in model.modules() if isinstance(m, B.BlockQLinear)}) == 1

    def slow_kernel(self, x):  # a kernel slower than the inner layer at every size: one-row steps only
        time.sleep(0.002)
        return self.inner(x)

    monkeypatch.setattr(B.BlockQLinear, "forward", slow_kernel)
    assert B.choose_rows(model) == 1


def test_switching_backends_reuses_blocks_and_measured_rows(monkeypatch):
    """Measuring the linear backend switches back and forth: blockq rescans no weight and
    measures its rows once per model; a weight modified in place is packed again."""
    _kernels_or_skip()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 96), nn.Linear(96, 64))
    for lin in model:
        lin.weight.data.copy_(q4_weight(lin.out_features, lin.in_features))
    calls = {"scan": 0, "rows": 0}
    real_q4, real_rows = B.pack_q4, B.choose_rows

    def counted_q4(w):
        calls["scan"] += 1
        return real_q4(w)

    def counted_rows(m, *a, **k):
        calls["rows"] += 1
        return real_rows(m, *a, **k)
    monkeypatch.setattr(B, "pack_q4", counted_q4)
    monkeypatch.setattr(B, "choose_rows", counted_rows)
    x = torch.randn(1, 64)
    set_linear_backend(model, "blockq")
    y = model(x)
    set_linear_backend(model, "blockq")  # already on it
    set_linear_backend(model, "onednn")
    set_linear_backend(model, "blockq")
    assert calls == {"scan": 2, "rows": 1}
    assert all(isinstance(m, B.BlockQLinear) for m in model) and torch.equal(model(x), y)
    set_linear_backend(model, "aten")
    with torch.no_grad():
        model[0].weight.copy_(q4_weight(96, 64, seed=1))
    set_linear_backend(model, "blockq")
    assert calls == {"scan": 3, "rows": 1}
    ref = model[1].inner(torch.nn.functional.linear(x, model[0].weight, model[0].bias))
    assert torch.allclose(model(x), ref, atol=1e-5, rtol=1e-5)
    set_linear_backend(model, "aten")


def test_real_target_packs_exactly_and_decodes_as_ar(smol):
    """The default target (from a Q4_1/Q8_0 GGUF): every linear packs; ar with blockq equals
    ar with PyTorch's linears, and the shipped DSpine drafter (cost policy, trees) equals ar
    on blockq, token for token, float32; switching back restores the layers."""
    _kernels_or_skip()
    from dspine.build import DEFAULT_CHECKPOINTS
    from dspine.drafter.checkpoint import load_drafter
    from dspine.proposers.drafter import DrafterProposer
    from dspine.tune.controller import make_policy
    from dspine.trees import TreeSpec

    assert "blockq" in available_backends(smol)
    prompts = ["Write a Python function that returns the n-th Fibonacci number.",
               "List three uses of a hash map, one line each."]
    ids = [smol.encode_prompt(p, chat=True) for p in prompts]
    refs = [Engine(smol, None, "ar").generate(i, SamplingConfig(), 40).token_ids for i in ids]  # PyTorch linears
    prop = DrafterProposer(load_drafter(DEFAULT_CHECKPOINTS / "smollm2-135m-dspine", smol))
    apply_linear_backend(smol, "blockq")
    try:
        n = {k: sum(isinstance(m, B.BlockQLinear) and m.kind == k for m in smol.model.modules()) for k in ("q4", "q8")}
        assert n["q4"] == 7 * smol.config.num_hidden_layers and n["q8"] == 1  # the layers and the tied head
        for i, ref in zip(ids, refs):
            assert Engine(smol, None, "ar").generate(i, SamplingConfig(), 40).token_ids == ref
            eng = Engine(smol, prop, "dspine", verify_policy=make_policy("cost", smol, prop), tree=TreeSpec(16))
            got = eng.generate(i, SamplingConfig(), 40)
            assert got.token_ids == ref and got.stats.kernels["linear_backend"] == "blockq"
    finally:
        apply_linear_backend(smol, "aten")
    assert not any(isinstance(m, (B.BlockQLinear,)) for m in smol.model.modules())


def test_sampled_distribution_exact_on_a_blockq_target(monkeypatch):
    """Chi-square against the exact distribution of a tiny target rounded to Q4_1 blocks
    (enumerated on blockq itself); the negative control (residual without q) fails."""
    _kernels_or_skip()
    import test_distribution as TD
    from conftest import TINY_SEED, TINY_VOCAB
    from dspine.target.adapter import load_target

    t = load_target("random:llama", vocab_size=TINY_VOCAB, seed=TINY_SEED)
    t.eos_token_ids = frozenset()
    quantize_linears_(t.model)
    t.set_runtime("dense")
    t.model._dspine_lean_rows = 16  # every verification on the lean path (not a timing)
    apply_linear_backend(t, "blockq")
    assert sum(isinstance(m, B.BlockQLinear) for m in t.model.modules()) > 0
    assert t.runtime.decode_path == "lean"  # dspine.runtime.lean: every layer in one C++ call
    TD.check_exact_with_negative_control(t, monkeypatch)


def test_the_kernels_build_key_does_not_depend_on_the_thread_count():
    """One compiled binary serves any thread count: a busy machine's 1-thread run and a quiet
    machine's 2-thread run share it (each used to compile the kernels again, ~40 s)."""
    import torch

    from dspine.runtime.blockq import _build_key

    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = _build_key()
        torch.set_num_threads(2)
        assert _build_key() == one
    finally:
        torch.set_num_threads(before)


def test_two_checkouts_compile_the_same_source_path(tmp_path, monkeypatch):
    """Checkouts with the same kernel source share one build folder; each compiling its own
    path made ninja rebuild whenever they took turns (~40 s per process in
    ``benchmarks/defaults_vs_ar.py --old``). The folder's own copy is what is compiled."""
    import shutil

    import torch.utils.cpp_extension as ext

    monkeypatch.setenv("DSPINE_HOME", str(tmp_path / "home"))
    built = []
    monkeypatch.setattr(ext, "load", lambda name, sources, build_directory, **kw: built.append(
        (name, list(sources), build_directory)) or object())
    original = B._SOURCE
    for checkout in ("a", "b"):
        copy = tmp_path / checkout / original.name
        copy.parent.mkdir()
        shutil.copyfile(original, copy)
        monkeypatch.setattr(B, "_SOURCE", copy)
        monkeypatch.setattr(B, "_STATE", {})
        assert B.kernels(progress=False) is not None
    (name_a, src_a, dir_a), (name_b, src_b, dir_b) = built
    assert (name_a, src_a, dir_a) == (name_b, src_b, dir_b)
    assert Path(src_a[0]).parent == Path(dir_a) and Path(src_a[0]).read_bytes() == original.read_bytes()
