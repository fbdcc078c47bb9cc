"""The lean decode path of the dense runtime: one C++ call per few-row forward.

On the dense runtime with ``--linear-backend blockq`` the matrix products of a one-token
step of SmolLM2-135M take ~6-7 ms on 2 cores, yet the step took ~20 ms: the rest was
Python and per-operation dispatch around ~30 operations per layer (RMSNorm, rotary
embedding, cache writes, attention, residuals, the MLP). For a forward of at most the
kernels' row limit (a decode step, a verification; :func:`dspine.runtime.blockq.choose_rows`)
:class:`LeanDecode` runs every decoder layer inside one call of the compiled extension
(``LeanLlama`` in ``kernels/blockq.cpp``): the same weights (the exact blocks), the same
float32 arithmetic in another order. Longer forwards (the prompt's prefill) keep the
Python path.

Applies to dense Llama-type targets (``model_type`` llama, qwen2, qwen3 as the dense
runtime) whose every layer linear holds exact blocks, without biases or q/k norms, with a
SiLU MLP, in float32 on the CPU: :func:`lean_support` says why not otherwise, and
``DSPINE_LEAN=0`` turns it off. Every mode of a process uses the same path for the same
number of rows, so greedy equality between modes holds as with any linear backend
(``tests/test_lean.py``).
"""
from __future__ import annotations

import os

import torch

from dspine.runtime.blockq import BlockQLinear, kernels

PROJ = (("self_attn", "q_proj"), ("self_attn", "k_proj"), ("self_attn", "v_proj"), ("self_attn", "o_proj"),
        ("mlp", "gate_proj"), ("mlp", "up_proj"), ("mlp", "down_proj"))


def lean_enabled() -> bool:
    """``DSPINE_LEAN``: unset, 1/on/true/yes = on; 0/off/false/no = off.

    Raises:
        ValueError: any other value (naming ``DSPINE_LEAN``).
    """
    v = os.environ.get("DSPINE_LEAN", "1").strip().lower()
    if v in ("", "1", "on", "true", "yes"):
        return True
    if v in ("0", "off", "false", "no"):
        return False
    raise ValueError(f"DSPINE_LEAN={os.environ['DSPINE_LEAN']!r} is not understood; use 0/off or 1/on")


def lean_support(rt) -> str | None:
    """None when :class:`LeanDecode` can run the dense runtime ``rt``'s model now, else why not."""
    if not lean_enabled():
        return f"DSPINE_LEAN={os.environ.get('DSPINE_LEAN')}"
    if rt.dtype != torch.float32 or rt.device.type != "cpu":
        return "float32 CPU targets only"
    if rt.qk_norm:
        return "q/k norms (qwen3)"
    cfg = rt.model.config
    if getattr(cfg, "hidden_act", "silu") != "silu":
        return f"activation {cfg.hidden_act!r} (SiLU only)"
    for layer in rt.layers:
        for part, name in PROJ:
            lin = getattr(getattr(layer, part), name)
            if not isinstance(lin, BlockQLinear):
                return "a linear layer without exact blocks (--linear-backend blockq on a GGUF-converted target)"
            if lin.bias is not None:
                return "linear biases"
    if kernels(progress=False) is None:
        return "the blockq kernels are not built here"
    return None


class LeanDecode:
    """Every decoder layer of ``rt`` (a :class:`dspine.runtime.dense.DenseRuntime`) in one
    C++ call, for forwards of at most :attr:`rows` rows.

    Raises:
        ValueError: :func:`lean_support` found a reason it cannot run.
    """

    def __init__(self, rt):
        why = lean_support(rt)
        if why is not None:
            raise ValueError(f"the lean decode path cannot run this target: {why}")
        self.key = self.identity(rt)
        norms, blocks = [], []
        empty = torch.empty(0)
        for layer in rt.layers:
            norms += [layer.input_layernorm.weight.detach().float().contiguous(),
                      layer.post_attention_layernorm.weight.detach().float().contiguous()]
            for part, name in PROJ:
                lin = getattr(getattr(layer, part), name)
                blocks += [lin.b0, lin.b1, lin.b2 if lin.kind == "q4" else empty]
        eps = float(rt.layers[0].input_layernorm.variance_epsilon)
        self.impl = kernels(progress=False).LeanLlama(norms, blocks, rt.n_heads, rt.n_kv, rt.head_dim, eps,
                                                      float(rt.scaling))
        self.first = rt.layers[0].self_attn.q_proj
        self.max_rows = None  # set by choose_lean_rows (None: the kernels' own row limit)

    @staticmethod
    def identity(rt) -> tuple:
        """What the plan was built from: the layer modules (a new linear backend makes new ones)."""
        return tuple(id(getattr(getattr(layer, part), name)) for layer in rt.layers for part, name in PROJ)

    @property
    def rows(self) -> int:
        """The most rows a forward takes this path: :func:`choose_lean_rows`' measurement,
        else the kernels' own row limit (where both paths run the same kernels)."""
        return self.max_rows if self.max_rows is not None else self.first.rows

    def forward(self, rt, input_ids: torch.Tensor, cache, start: int, want: list[int],
                tree: tuple[torch.Tensor, torch.Tensor] | None) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """Layers over ``input_ids`` [1, n] after ``start`` cached positions (the cache already
        holds room for them). Returns the last layer's output [1, n, D] (before the final
        norm) and ``{layer: output [1, n, D]}`` for the layers in ``want``."""
        n = input_ids.shape[1]
        x = rt.inner.embed_tokens(input_ids)[0].contiguous()
        if tree is None:
            pos = torch.arange(start, start + n, device=rt.device)[None]
        else:
            pos = (start + tree[0].to(rt.device))[None]
        cos, sin = rt.inner.rotary_emb(x[None], pos)
        if tree is None:
            mask = torch.empty(0, dtype=torch.bool)
        else:
            mask = torch.cat([torch.ones(n, start, dtype=torch.bool), tree[1].to(torch.bool)], dim=1).contiguous()
        want = sorted(set(want))
        feats = self.impl.forward(x, cache.k, cache.v, start, cos[0].float().contiguous(),
                                  sin[0].float().contiguous(), mask, want)
        return x[None], {i: f[None] for i, f in zip(want, feats)}

    def forward_ragged(self, rt, ids: torch.Tensor, rows: torch.Tensor, pos: torch.Tensor, ks: list[torch.Tensor],
                       vs: list[torch.Tensor], want: list[int], tree: tuple[torch.Tensor, torch.Tensor, torch.Tensor]
                       | None = None) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """Several requests' new tokens in one call (the batched engine, :mod:`dspine.core.batch`):
        ``ids`` [M] int64 (at most :attr:`rows`), ``rows`` [M] int64 the slot-cache row of each,
        ``pos`` [M] int64 its slot (the cache has room for it); ``ks`` / ``vs`` per layer
        [slots, kv, cap, hd] float32 (contiguous). Token m attends to slots 0..pos[m] of its
        own row, at rotary position pos[m].

        ``tree``: (rotary positions [M] int64, base [M] int64, mask [M, W] bool) for draft
        trees (:meth:`dspine.trees.DraftTree.attention_mask`): token m then sits at its rotary
        position, sees the slots before ``base[m]`` (its request's anchor slot) and the slots
        ``base[m] + c`` with ``mask[m, c]``. Returns the last layer's output [1, M, D] and
        ``{layer: [1, M, D]}`` as :meth:`forward`; each token's values are bitwise those of a
        one-request :meth:`forward` of the same tokens, chain or tree (the kernels are
        batch-invariant). Raises RuntimeError (from the kernel) when a tree's rows fall
        outside their mask."""
        x = rt.inner.embed_tokens(ids[None])[0].contiguous()
        rope, base, mask = (pos, torch.empty(0, dtype=torch.long), torch.empty(0, 0, dtype=torch.bool)) \
            if tree is None else tree
        cos, sin = rt.inner.rotary_emb(x[None], rope[None])
        want = sorted(set(want))
        feats = self.impl.forward_ragged(x, ks, vs, rows.contiguous(), pos.contiguous(), cos[0].float().contiguous(),
                                         sin[0].float().contiguous(), want, base.contiguous(), mask.contiguous())
        return x[None], {i: f[None] for i, f in zip(want, feats)}


def choose_lean_rows(rt, plan: LeanDecode, sizes: tuple[int, ...] = (32, 17, 8), context: int = 32,
                     repeats: int = 3, timer=None) -> int:
    """Set (and return) the most rows ``plan`` takes: the largest of ``sizes`` at which a
    whole forward on the lean path ran no slower than on the Python path (whose linears
    take the kernels up to their own limit and oneDNN beyond), else that limit. Measured
    once per machine and model shape (best of ``repeats``, ~1 s on 2 cores) and cached in
    the tune store with its conditions (:func:`dspine.tune.choose.cached_measurement`; a
    provisional entry is measured again on a quiet run), and on the model.

    ``timer(path, rows) -> seconds`` replaces the measurement (tests).
    """
    import time

    model = rt.model
    cached = getattr(model, "_dspine_lean_rows", None)
    if cached is not None:
        plan.max_rows = cached
        return cached
    V = model.config.vocab_size
    ids = (torch.arange(1, context + max(sizes) + 1) * 7919 % max(V - 1, 1) + 1)[None]

    def measure(path: str, rows: int) -> float:
        best = float("inf")
        plan.max_rows = rows if path == "lean" else 0
        with torch.no_grad():
            cache = rt.new_cache()
            rt.forward(ids[:, :context], cache, None, logits_to_keep=1)
            for _ in range(repeats + 1):
                t0 = time.perf_counter()
                rt.forward(ids[:, context:context + rows], cache, None)
                best = min(best, time.perf_counter() - t0)
                cache.rollback(context)
        return best

    def largest() -> int:  # the largest of ``sizes`` that paid, else the plan's first layer's limit
        rows = None
        try:
            for r in sorted(sizes, reverse=True):
                if r <= plan.first.rows:
                    break
                if (timer or measure)("lean", r) <= (timer or measure)("python", r):
                    rows = r
                    break
        finally:
            plan.max_rows = rows
        return rows or plan.first.rows

    if timer is None:  # measured once per machine and model shape (cached with its conditions)
        from dspine.runtime.blockq import shape_key, source_version
        from dspine.tune.choose import cached_measurement

        best = cached_measurement(
            f"lean-rows:{shape_key(model)},sizes={'/'.join(map(str, sizes))},first={plan.first.rows},kernels={source_version()}",
            largest, valid=lambda v: v == plan.first.rows or v in sizes,
            what="how many rows the lean decode path takes")
    else:
        best = largest()
    plan.max_rows = best
    model._dspine_lean_rows = plan.rows
    plan.max_rows = plan.rows
    return plan.rows
