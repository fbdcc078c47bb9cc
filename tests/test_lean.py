"""The lean decode path (dspine.runtime.lean): every decoder layer of a few-row forward in
one C++ call, on the dense runtime with ``--linear-backend blockq``.

Proven like every other path: its logits and features agree with the Python path on the
same weights (float32 summation order only), for one row, several rows and a draft tree,
and a plan built with a wrong attention scale fails that comparison (negative control);
greedy decoding on the real target equals ``ar`` (both on the lean path); the sampled
distribution on a tiny block-exact target is exact (chi-square with a failing negative
control, ``test_blockq.py``, asserted to run on this path).
"""
from __future__ import annotations

import pytest
import torch
from torch import nn

from dspine.config import SamplingConfig
from dspine.core.engine import Engine
from dspine.runtime import blockq as B
from dspine.runtime import lean as L
from dspine.runtime.packed import apply_linear_backend

pytestmark = pytest.mark.usefixtures("one_thread")


def _kernels_or_skip():
    if B.kernels(progress=False) is None:
        pytest.skip(f"the blockq kernels cannot be built here: {B.unavailable_reason()}")


def _both_paths(t, ids, n, layers, tree=None, monkeypatch=None):
    """(lean output, Python-path output) of the last ``n`` ids after the rest as prefix."""
    rt = t.runtime
    plan = rt.lean_plan()
    outs = []
    for rows in (16, 0):  # 0: every forward takes the Python path
        plan.max_rows = rows
        c = t.new_cache()
        t.forward(ids[:, :-n], c, None, logits_to_keep=1)
        outs.append(t.forward(ids[:, -n:], c, layers, tree=tree))
    plan.max_rows = 16
    return outs


def _close(a, b, tol=2e-4) -> bool:
    return torch.allclose(a.logits, b.logits, atol=tol, rtol=0) and torch.allclose(a.features, b.features, atol=tol,
                                                                                     rtol=0)


def test_lean_agrees_with_the_python_path_and_a_wrong_plan_does_not(smol_lean):
    t = smol_lean
    ids = torch.tensor(t.encode_prompt("Write a Python function that merges two sorted lists.", chat=True))[None]
    layers = [1, 10, t.num_layers - 1]
    for n in (1, 3, 16):
        lean, py = _both_paths(t, ids, n, layers)
        assert lean.logits.shape == py.logits.shape == (1, n, t.vocab_size)
        assert _close(lean, py), (n, (lean.logits - py.logits).abs().max())
        assert torch.equal(lean.logits.argmax(-1), py.logits.argmax(-1))
    # a draft tree: root, two children of the root, one grandchild under the second
    offsets = torch.tensor([0, 1, 1, 2])
    mask = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 0, 1, 1]], dtype=torch.bool)
    lean, py = _both_paths(t, ids, 4, layers, tree=(offsets, mask))
    assert _close(lean, py)
    # negative control: the same plan with a 1% wrong attention scale must not pass
    rt = t.runtime
    good = rt.lean_plan()
    norms, blocks = [], []
    for layer in rt.layers:
        norms += [layer.input_layernorm.weight, layer.post_attention_layernorm.weight]
        for part, name in L.PROJ:
            lin = getattr(getattr(layer, part), name)
            blocks += [lin.b0, lin.b1, lin.b2 if lin.kind == "q4" else torch.empty(0)]
    bad = B.kernels().LeanLlama(norms, blocks, rt.n_heads, rt.n_kv, rt.head_dim,
                                float(rt.layers[0].input_layernorm.variance_epsilon), float(rt.scaling) * 1.01)
    impl, good.impl = good.impl, bad
    try:
        lean, py = _both_paths(t, ids, 3, layers)
        assert not _close(lean, py)
    finally:
        good.impl = impl


def test_greedy_equal_to_ar_on_the_lean_path(smol_lean):
    """ar, and DSpine verifying full chains (16 rows) and trees of 8 nodes every cycle, on the
    lean path: the same tokens, and the same as ar on the Python path."""
    from dspine.build import DEFAULT_CHECKPOINTS
    from dspine.drafter.checkpoint import load_drafter
    from dspine.proposers.drafter import DrafterProposer
    from dspine.trees import TreeSpec

    t = smol_lean
    ids = t.encode_prompt("Write a Python function that returns the n-th Fibonacci number.", chat=True)
    ref = Engine(t, None, "ar").generate(ids, SamplingConfig(), 40)
    assert ref.stats.kernels["decode_path"] == "lean"
    prop = DrafterProposer(load_drafter(DEFAULT_CHECKPOINTS / "smollm2-135m-dspine", t))
    for tree in (TreeSpec(0), TreeSpec(8)):
        got = Engine(t, prop, "dspine", tree=tree).generate(ids, SamplingConfig(), 40)
        assert got.token_ids == ref.token_ids and got.stats.accepted_length_mean > 1.0
    plan = t.runtime.lean_plan()
    plan.max_rows = 0
    try:
        assert Engine(t, None, "ar").generate(ids, SamplingConfig(), 40).token_ids == ref.token_ids
    finally:
        plan.max_rows = 16


def test_lean_support_names_what_it_cannot_run(tiny256, monkeypatch):
    _kernels_or_skip()
    from test_blockq import quantize_linears_

    from dspine.target.adapter import load_target

    t = load_target("random:llama", vocab_size=256, seed=3)
    t.set_runtime("dense")
    assert "without exact blocks" in L.lean_support(t.runtime)  # aten linears
    quantize_linears_(t.model)
    apply_linear_backend(t, "blockq", progress=False)
    assert L.lean_support(t.runtime) is None and t.runtime.decode_path == "lean"
    monkeypatch.setenv("DSPINE_LEAN", "0")
    t.runtime._lean = None
    assert L.lean_support(t.runtime) == "DSPINE_LEAN=0" and t.runtime.decode_path == "python"
    monkeypatch.delenv("DSPINE_LEAN")
    lin = t.runtime.layers[0].self_attn.q_proj
    lin.bias = nn.Parameter(torch.zeros(lin.out_features))
    assert L.lean_support(t.runtime) == "linear biases"
    with pytest.raises(ValueError, match="linear biases"):
        L.LeanDecode(t.runtime)
    apply_linear_backend(t, "aten", progress=False)
    assert t.runtime.decode_path == "python"  # the plan follows the layers


def test_lean_verification_is_bitwise_the_plain_loop(smol_lean):
    """A few-row forward on the lean path gives, row by row, bitwise the logits and features
    of one-token forwards over the same tokens (batch-invariant kernels, per-row attention and
    norms): greedy verification cannot flip a near-tie against ``ar``. Negative control: the
    Python path's 16-row forward (oneDNN's GEMM beyond the kernels' rows) is not bitwise."""
    t = smol_lean
    plan = t.runtime.lean_plan()
    ids = torch.tensor(t.encode_prompt("List three uses of a hash map, briefly.", chat=True))[None]
    layers = [1, 10, t.num_layers - 1]
    n = 16
    lins = [m for m in t.model.modules() if isinstance(m, B.BlockQLinear)]
    saved = [lin.rows for lin in lins]
    for lin in lins:  # the kernels for every row (a measurement may have set a lower limit here)
        lin.rows = B.MAX_ROWS
    plan.max_rows = n
    c = t.new_cache()
    t.forward(ids[:, :-n], c, None, logits_to_keep=1)
    one = [t.forward(ids[:, k:k + 1], c, layers) for k in range(ids.shape[1] - n, ids.shape[1])]
    for m in (n, 5, 2):
        c = t.new_cache()
        t.forward(ids[:, :-n], c, None, logits_to_keep=1)
        out = t.forward(ids[:, -n:][:, :m], c, layers)
        assert torch.equal(out.logits[0], torch.cat([o.logits[0] for o in one[:m]])), m
        assert torch.equal(out.features[0], torch.cat([o.features[0] for o in one[:m]])), m
    for lin in lins:
        lin.rows = 1  # the Python path, oneDNN for more than one row
    plan.max_rows = 1
    c = t.new_cache()
    t.forward(ids[:, :-n], c, None, logits_to_keep=1)
    py = t.forward(ids[:, -n:], c, layers)
    assert not torch.equal(py.logits[0], torch.cat([o.logits[0] for o in one]))
    for lin, r in zip(lins, saved):
        lin.rows = r
    plan.max_rows = t.model._dspine_lean_rows


def test_lean_rows_follow_a_measurement():
    _kernels_or_skip()
    from test_blockq import quantize_linears_

    from dspine.target.adapter import load_target

    t = load_target("random:llama", vocab_size=256, seed=5)
    quantize_linears_(t.model)
    t.set_runtime("dense")
    apply_linear_backend(t, "blockq", progress=False)
    rt = t.runtime
    for m in t.model.modules():
        if isinstance(m, B.BlockQLinear):
            m.rows = 4  # the kernels' own limit here
    plan = rt.lean_plan()
    kernel_rows = plan.first.rows
    assert kernel_rows == 4
    for fast, want in (({"lean": 1.0, "python": 2.0}, B.MAX_ROWS), ({"lean": 3.0, "python": 2.0}, kernel_rows)):
        del t.model._dspine_lean_rows
        got = L.choose_lean_rows(rt, plan, timer=lambda path, rows: fast[path])
        assert got == want == plan.rows == t.model._dspine_lean_rows
    assert L.choose_lean_rows(rt, plan, timer=lambda p, r: 1 / 0) == kernel_rows  # cached: not measured again


def test_malformed_plans_and_calls_are_refused(smol_lean, monkeypatch):
    """The C++ plan checks every layer's shapes and each call's start, cache and feature
    layers (clear errors, not out-of-bounds reads); DSPINE_LEAN accepts on/off words only."""
    t = smol_lean
    rt = t.runtime
    mod = B.kernels()
    norms, blocks = [], []
    for layer in rt.layers[:2]:
        norms += [layer.input_layernorm.weight, layer.post_attention_layernorm.weight]
        for part, name in L.PROJ:
            lin = getattr(getattr(layer, part), name)
            blocks += [lin.b0, lin.b1, lin.b2 if lin.kind == "q4" else torch.empty(0)]
    args = (rt.n_heads, rt.n_kv, rt.head_dim, 1e-5, float(rt.scaling))
    with pytest.raises(RuntimeError, match="at least one layer"):
        mod.LeanLlama([], [], *args)
    bad = list(blocks)
    bad[21 + 3: 21 + 6] = blocks[0:3]  # layer 1's k_proj replaced by a q_proj: wrong N
    with pytest.raises(RuntimeError, match="layer 1: linear shapes"):
        mod.LeanLlama(norms, bad, *args)
    bad_norms = list(norms)
    bad_norms[3] = norms[3][:7]
    with pytest.raises(RuntimeError, match="layer 1: norm weights"):
        mod.LeanLlama(bad_norms, blocks, *args)
    impl = mod.LeanLlama(norms, blocks, *args)
    c = t.new_cache()
    c._ensure(8)
    k, v = c.k[:2].contiguous(), c.v[:2].contiguous()
    x = torch.zeros(1, t.hidden_size)
    cs = torch.ones(1, rt.head_dim)
    with pytest.raises(RuntimeError, match="start must be >= 0"):
        impl.forward(x, k, v, -1, cs, cs, torch.empty(0, dtype=torch.bool), [])
    with pytest.raises(RuntimeError, match="feature layer 5"):
        impl.forward(x, k, v, 0, cs, cs, torch.empty(0, dtype=torch.bool), [5])
    with pytest.raises(RuntimeError, match="cache buffers"):
        impl.forward(x, k[:, :, :, :, :].reshape(2, 1, rt.n_kv, -1).contiguous(), v, 0, cs, cs,
                     torch.empty(0, dtype=torch.bool), [])
    for value, on in (("off", False), ("FALSE", False), ("on", True), ("1", True)):
        monkeypatch.setenv("DSPINE_LEAN", value)
        assert L.lean_enabled() is on
    monkeypatch.setenv("DSPINE_LEAN", "garbage")
    with pytest.raises(ValueError, match="DSPINE_LEAN='garbage'"):
        L.lean_enabled()
