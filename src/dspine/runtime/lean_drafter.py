"""The lean drafter forward: a DSpine drafter's block rows in one C++ call.

With the drafter's linears on Q8_0 blocks (``--drafter-linears q8``,
:mod:`dspine.tune.drafter`) those products took ~0.75 ms of a 2-row block forward on a
2-core EPYC, yet the forward took ~3-7 ms: the rest was Python and per-operation dispatch
around ~150 small operations (norms, rotary embedding, attention over the draft context,
the MLP, the bridge's codes and messages). :class:`LeanDrafter` runs the whole block forward
of one request (``LeanDrafter`` in ``kernels/blockq.cpp``): the same weights, the same
float32 arithmetic in another order. The same object computes the projection of newly
committed target features into the draft context (:meth:`LeanDrafter.context_kv`) and the
final stage's conditional tables of one block (:meth:`LeanDrafter.conditional_tables`,
:func:`lean_tables`), which were ~25 more small operations per drafting cycle (a proposal of
1-4 tokens 14-26% cheaper on a 2-core AMX Xeon, docs/decisions.md, 2026-12-07). The drafter only proposes, so this never changes the
output (greedy equality with ``ar`` and the exact sampled distribution are tested on it,
``tests/test_lean_drafter.py``).

Applies to a block-causal DSpine drafter (bridge on, no q/k norms) on the CPU in float32
whose linears all hold Q8_0 blocks (:func:`lean_drafter_support` says why not otherwise;
``DSPINE_LEAN=0`` turns it off with the target's lean path). Batched proposals (the
server's ``propose_batch``) run it once per request (each request's own context, no padding).
"""
from __future__ import annotations

import torch

from dspine.drafter.model import BlockOutput
from dspine.runtime.blockq import BlockQLinear, kernels
from dspine.runtime.lean import lean_enabled

LAYER_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate", "up", "down")


def lean_drafter_support(drafter) -> str | None:
    """None when :class:`LeanDrafter` can run ``drafter`` (a :class:`~dspine.drafter.model.DSpineDrafter`), else why not."""
    if not lean_enabled():
        return "DSPINE_LEAN is off"
    cfg = drafter.cfg
    if not (cfg.bridge and cfg.block_causal):
        return "DSpine drafters (bridge, block-causal rows) only"
    if cfg.qk_norm:
        return "q/k norms"
    if drafter.fc.weight.dtype != torch.float32 or drafter.fc.weight.device.type != "cpu":
        return "float32 CPU drafters only"
    lins = [getattr(layer, n) for layer in drafter.layers for n in LAYER_LINEARS]
    lins += list(drafter.read) + list(drafter.write) + [drafter.g_r, drafter.g_p, drafter.v_p]
    if not all(isinstance(m, BlockQLinear) and m.kind == "q8" and m.bias is None for m in lins):
        return "linears on Q8_0 blocks only (--drafter-linears q8)"
    if kernels(progress=False) is None:
        return "the blockq kernels are not built here"
    return None


class LeanDrafter:
    """:meth:`DSpineDrafter.forward_blocks` of one block (b = nb = 1) in one C++ call.

    Raises:
        ValueError: :func:`lean_drafter_support` found a reason it cannot run.
    """

    def __init__(self, drafter):
        why = lean_drafter_support(drafter)
        if why is not None:
            raise ValueError(f"the lean drafter forward cannot run this drafter: {why}")
        cfg = drafter.cfg
        self.drafter, self.block_size = drafter, cfg.block_size
        norms, blocks = [], []
        for i, layer in enumerate(drafter.layers):
            norms += [layer.attn_norm.weight.detach().float().contiguous(),
                      layer.mlp_norm.weight.detach().float().contiguous()]
            for m in [getattr(layer, n) for n in LAYER_LINEARS] + [drafter.read[i], drafter.write[i]]:
                blocks += [m.b0, m.b1]
        for m in (drafter.g_r, drafter.g_p, drafter.v_p):
            blocks += [m.b0, m.b1]
        row = drafter.row_embed.detach().float().contiguous() if drafter.row_embed is not None else torch.empty(0)
        self.impl = kernels(progress=False).LeanDrafter(
            norms, blocks, drafter.mask_embed.detach().float().contiguous(), row,
            drafter.codebook.weight.detach().float().contiguous(), float(drafter.alpha.detach()), cfg.num_heads,
            cfg.num_kv_heads, cfg.head_dim, cfg.rms_eps, cfg.rope_theta, cfg.window)
        # the context projection and the final stage's tables in the same object, where W_fc is
        # on Q8_0 blocks and the head is a float32 CPU tensor (else the PyTorch ones run)
        fc, head = drafter.fc, drafter._target_head
        self.has_context = (isinstance(fc, BlockQLinear) and fc.kind == "q8" and fc.bias is None
                            and isinstance(head, torch.Tensor) and head.dtype == torch.float32
                            and head.device.type == "cpu" and head.is_contiguous())
        self._head = head  # the head the tables were built with (lean_tables checks it is still bound)
        if self.has_context:
            self.impl.set_context(fc.b0, fc.b1, drafter.norm_ctx.weight.detach().float().contiguous(),
                                  drafter.norm_f.weight.detach().float().contiguous(), head)

    def forward_blocks(self, anchors: torch.Tensor, anchor_pos: torch.Tensor,
                       ctx_kv: list[tuple[torch.Tensor, torch.Tensor]], ctx_pos: torch.Tensor,
                       ctx_valid: torch.Tensor, rows: int | None = None) -> BlockOutput:
        """As :meth:`DSpineDrafter.forward_blocks` for anchors [1, 1]: ctx_kv per layer
        (k, v) [1, kv, cap, hd], ctx_pos [1, cap] int64, ctx_valid [1, cap] bool. Returns
        h, h_pre [1, 1, R, d], r [1, 1, R, 1], c [1, 1, R, d_c] (float32).

        Raises:
            ValueError: more than one block, or ``rows`` outside 1..block size.
        """
        if anchors.shape != (1, 1):
            raise ValueError(f"the lean drafter forward runs one block, got anchors {tuple(anchors.shape)}")
        R = self.block_size if rows is None else int(rows)
        if not 1 <= R <= self.block_size:
            raise ValueError(f"rows must be in 1..{self.block_size}, got {rows}")
        a = int(anchors[0, 0])
        e0 = self.drafter.embed(anchors[0, 0]).float().contiguous()
        h, h_pre, r, c = self.impl.forward(e0, a, int(anchor_pos[0, 0]), R,
                                           [k[0].contiguous() for k, _ in ctx_kv], [v[0].contiguous() for _, v in ctx_kv],
                                           ctx_pos[0].contiguous(), ctx_valid[0].contiguous())
        return BlockOutput(h=h[None, None], h_pre=h_pre[None, None], r=r[None, None], c=c[None, None])

    def context_kv(self, feats: torch.Tensor, pos: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """As :meth:`DSpineDrafter.context_kv` for one request: feats [1, n, F*d] float32, pos
        [1, n] int64 -> per layer (k, v) [1, kv, n, hd] (k with the rotary embedding applied).
        Raises RuntimeError when :attr:`has_context` is False, ValueError for a batch other than 1."""
        if not self.has_context:
            raise RuntimeError("the lean drafter has no context projection here (W_fc not on Q8_0 blocks)")
        if feats.dim() != 3 or feats.shape[0] != 1 or pos.shape[0] != 1:
            raise ValueError(f"the lean context projection takes one request: feats [1, n, F*d], pos [1, n]; "
                             f"got {tuple(feats.shape)} and {tuple(pos.shape)}")
        out = self.impl.project(feats[0].float().contiguous(), pos[0].contiguous())
        return [(out[2 * l][None], out[2 * l + 1][None]) for l in range(len(out) // 2)]

    def conditional_tables(self, h_pre: torch.Tensor, r: torch.Tensor, c: torch.Tensor, anchor: torch.Tensor,
                           cand: torch.Tensor) -> torch.Tensor:
        """As :func:`dspine.drafter.final_stage.conditional_tables` for one block (b = 1):
        h_pre [1, n+1, d], r [1, n+1, 1], c [1, n+1, dc] float32, anchor [1], cand [1, n, K]
        int64 -> T [1, n, K, K] float32. Raises RuntimeError when :attr:`has_context` is False,
        ValueError for a batch other than 1."""
        if not self.has_context:
            raise RuntimeError("the lean drafter has no final-stage tables here (W_fc not on Q8_0 blocks)")
        if any(t.shape[0] != 1 for t in (h_pre, r, c, anchor, cand)):
            raise ValueError("the lean final-stage tables take one block: h_pre, r, c, anchor and cand of batch 1")
        return self.impl.tables(h_pre[0], r[0], c[0], int(anchor[0]), cand[0].contiguous())[None]


def lean_tables(drafter, h_pre: torch.Tensor, cand: torch.Tensor, *others: torch.Tensor):
    """The drafter's :class:`LeanDrafter` when it can compute the final stage's tables of
    ``cand`` [b, n, K] (one block, float32 CPU states, int64 ids, n >= 1, the head it was
    built with still bound; ``others``, e.g. r and c, float32 too), else None (the PyTorch
    path runs)."""
    lean = getattr(drafter, "_lean", None)
    if lean is None or not lean.has_context or cand.shape[0] != 1 or cand.shape[1] < 1 or h_pre.shape[0] != 1 \
            or h_pre.dtype != torch.float32 or cand.dtype != torch.int64 or h_pre.device.type != "cpu" \
            or any(t.dtype != torch.float32 for t in others) \
            or lean._head is not drafter._target_head:  # rebound to another target: the PyTorch path
        return None
    return lean


def block_forward(drafter):
    """The fastest block forward for one request: the drafter's :class:`LeanDrafter`
    (attached by :func:`dspine.drafter.q8.quantize_drafter` where it runs), else
    :meth:`DSpineDrafter.forward_blocks`."""
    lean = getattr(drafter, "_lean", None)
    return lean.forward_blocks if lean is not None else drafter.forward_blocks
