"""The DSpine drafter (spec section 3) and its DFlash-style baseline (flags off).

Shapes: ``b`` batch (requests or training sequences), ``nb`` blocks per batch
element (1 at inference, many anchors in training), ``B`` block rows, ``d`` hidden
(= target hidden), ``T`` context positions, ``F`` feature layers.

Per layer (pre-norm): ``u = h + Attn(norm(h), ctx)``, ``h = u + MLP(norm(u))``, then
the bridge (spec section 3): ``r = rms(h)``, ``c = R_l(h / r)``, ``c_0 = alpha E[x0]``,
``m_i = sigmoid(G_r c_i + G_p c_{i-1}) * V_p c_{i-1}``, ``h_i += r_i W_l m_i`` (i >= 1).
The target's input embedding and output head are shared and frozen; they are bound
at run time with :meth:`DSpineDrafter.bind_target` and never saved in a checkpoint.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as Fn
from torch import nn

from dspine.config import DSpineConfig


class RMSNorm(nn.Module):
    """Learned RMSNorm: ``x / sqrt(mean(x^2) + eps) * w`` over the last dim."""

    def __init__(self, d: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (y * self.weight.float()).to(x.dtype)


def rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    """``sqrt(mean_k x_k^2 + eps)`` over the last dim, keepdim. [..., d] -> [..., 1]."""
    return torch.sqrt(x.float().pow(2).mean(-1, keepdim=True) + eps).to(x.dtype)


def rope(x: torch.Tensor, pos: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotary embedding (half-split). x [b, h, n, hd], pos [b, n] int64 -> same shape as x."""
    hd = x.shape[-1]
    inv = 1.0 / (theta ** (torch.arange(0, hd, 2, device=x.device, dtype=torch.float32) / hd))  # [hd/2]
    ang = pos.to(torch.float32)[:, None, :, None] * inv  # [b, 1, n, hd/2]
    cos, sin = ang.cos().to(x.dtype), ang.sin().to(x.dtype)
    x1, x2 = x[..., : hd // 2], x[..., hd // 2:]
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


class DraftLayer(nn.Module):
    """Pre-norm transformer layer with GQA attention over [context ; block] and SwiGLU."""

    def __init__(self, cfg: DSpineConfig):
        super().__init__()
        d, h, kv, hd = cfg.target_hidden, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.cfg = cfg
        self.attn_norm = RMSNorm(d, cfg.rms_eps)
        self.q_proj = nn.Linear(d, h * hd, bias=False)
        self.k_proj = nn.Linear(d, kv * hd, bias=False)
        self.v_proj = nn.Linear(d, kv * hd, bias=False)
        self.o_proj = nn.Linear(h * hd, d, bias=False)
        # per-head RMSNorm of queries and keys before RoPE (Qwen3 / z-lab DFlash), weight [hd]
        self.q_norm = RMSNorm(hd, cfg.rms_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(hd, cfg.rms_eps) if cfg.qk_norm else None
        self.mlp_norm = RMSNorm(d, cfg.rms_eps)
        self.gate = nn.Linear(d, cfg.ffn, bias=False)
        self.up = nn.Linear(d, cfg.ffn, bias=False)
        self.down = nn.Linear(cfg.ffn, d, bias=False)

    def context_kv(self, f: torch.Tensor, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Draft context K/V of fused features f [b, T, d] at positions pos [b, T].

        Returns k, v: [b, kv, T, hd] (k with RoPE applied).
        """
        b, T, _ = f.shape
        kv, hd = self.cfg.num_kv_heads, self.cfg.head_dim
        k = self._norm_k(self.k_proj(f).view(b, T, kv, hd)).transpose(1, 2)
        v = self.v_proj(f).view(b, T, kv, hd).transpose(1, 2)
        return rope(k, pos, self.cfg.rope_theta), v

    def _norm_q(self, q: torch.Tensor) -> torch.Tensor:
        """Per-head q norm ([..., H, hd] -> same) when ``cfg.qk_norm``, else q unchanged."""
        return q if self.q_norm is None else self.q_norm(q)

    def _norm_k(self, k: torch.Tensor) -> torch.Tensor:
        """Per-head k norm ([..., kv, hd] -> same) when ``cfg.qk_norm``, else k unchanged."""
        return k if self.k_norm is None else self.k_norm(k)

    def forward(self, h: torch.Tensor, pos: torch.Tensor, ctx_k: torch.Tensor, ctx_v: torch.Tensor,
                mask: torch.Tensor) -> torch.Tensor:
        """h [b, Q, d] block rows (Q = nb*B), pos [b, Q]; ctx_k/v [b, kv, T, hd];
        mask [b, Q, T + Q] bool (True = may attend). Returns [b, Q, d]."""
        b, Q, _ = h.shape
        H, kv, hd = self.cfg.num_heads, self.cfg.num_kv_heads, self.cfg.head_dim
        x = self.attn_norm(h)
        q = rope(self._norm_q(self.q_proj(x).view(b, Q, H, hd)).transpose(1, 2), pos, self.cfg.rope_theta)
        k = rope(self._norm_k(self.k_proj(x).view(b, Q, kv, hd)).transpose(1, 2), pos, self.cfg.rope_theta)
        v = self.v_proj(x).view(b, Q, kv, hd).transpose(1, 2)
        k = torch.cat([ctx_k, k], dim=2)  # [b, kv, T+Q, hd]
        v = torch.cat([ctx_v, v], dim=2)
        rep = H // kv
        if rep > 1:
            k = k.repeat_interleave(rep, dim=1)
            v = v.repeat_interleave(rep, dim=1)
        a = Fn.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None])  # [b, H, Q, hd]
        u = h + self.o_proj(a.transpose(1, 2).reshape(b, Q, H * hd))
        y = self.mlp_norm(u)
        return u + self.down(Fn.silu(self.gate(y)) * self.up(y))


@dataclass
class BlockOutput:
    """Drafter outputs for blocks of shape [b, nb, B, ...].

    h:     [b, nb, B, d] residual after the last layer (and its bridge write).
    h_pre: [b, nb, B, d] last layer's post-MLP residual before its write (final stage).
    r:     [b, nb, B, 1] its RMS; c: [b, nb, B, d_c] its codes (row 0 = alpha E[x0]).
    """

    h: torch.Tensor
    h_pre: torch.Tensor
    r: torch.Tensor | None
    c: torch.Tensor | None


class DSpineDrafter(nn.Module):
    """DSpine drafter (spec sections 3-4); DFlash-style when ``cfg.bridge`` is off.

    Call :meth:`bind_target` before use so the frozen target embedding/head are known.
    """

    def __init__(self, cfg: DSpineConfig):
        super().__init__()
        self.cfg = cfg
        d, L, F = cfg.target_hidden, cfg.num_layers, len(cfg.feature_layers)
        self.fc = nn.Linear(F * d, d, bias=False)  # context fusion
        self.norm_ctx = RMSNorm(d, cfg.rms_eps)
        self.mask_embed = nn.Parameter(torch.zeros(d))
        self.row_embed = nn.Parameter(torch.zeros(cfg.block_size, d)) if cfg.row_embedding else None
        self.layers = nn.ModuleList([DraftLayer(cfg) for _ in range(L)])
        self.norm_f = RMSNorm(d, cfg.rms_eps)
        if cfg.bridge:
            dc, dm = cfg.code_dim, cfg.msg_dim
            self.read = nn.ModuleList([nn.Linear(d, dc, bias=False) for _ in range(L)])  # R_l [dc, d]
            self.write = nn.ModuleList([nn.Linear(dm, d, bias=False) for _ in range(L)])  # W_l [d, dm]
            self.g_r = nn.Linear(dc, dm, bias=False)  # G_r [dm, dc]
            self.g_p = nn.Linear(dc, dm, bias=False)  # G_p [dm, dc]
            self.v_p = nn.Linear(dc, dm, bias=False)  # V_p [dm, dc]
            self.codebook = nn.Embedding(cfg.vocab_size, dc)  # E [V, dc]
            self.alpha = nn.Parameter(torch.ones(()))
        object.__setattr__(self, "_target_embed", None)
        object.__setattr__(self, "_target_head", None)
        self.reset_parameters()

    def reset_parameters(self, std: float = 0.02) -> None:
        """Normal(0, std) linears, codebook N(0, 1/sqrt(d_c)), unit norms, alpha = 1."""
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, std=std)
            elif isinstance(m, RMSNorm):
                nn.init.ones_(m.weight)
        nn.init.normal_(self.mask_embed, std=std)
        if self.row_embed is not None:
            nn.init.normal_(self.row_embed, std=std)
        if self.cfg.bridge:
            nn.init.normal_(self.codebook.weight, std=1.0 / math.sqrt(self.cfg.code_dim))
            nn.init.ones_(self.alpha)

    # -- binding to the target ---------------------------------------------------------
    def bind_target(self, embed: nn.Embedding, head: torch.Tensor) -> "DSpineDrafter":
        """Share the target's frozen input embedding [V, d] and output head H [V, d].

        Raises:
            ValueError: hidden or vocabulary size differs from the config.
        """
        V, d = head.shape
        if d != self.cfg.target_hidden or V != self.cfg.vocab_size:
            raise ValueError(f"drafter expects target hidden {self.cfg.target_hidden} and vocab "
                             f"{self.cfg.vocab_size}, target has hidden {d} and vocab {V}")
        # plain attributes (not registered): the target's tensors are never trained or saved
        object.__setattr__(self, "_target_embed", embed)
        object.__setattr__(self, "_target_head", head)
        return self

    @property
    def head(self) -> torch.Tensor:
        if self._target_head is None:
            raise RuntimeError("drafter is not bound to a target: call bind_target()")
        return self._target_head

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """Target input embedding of ids (any shape) -> [..., d] in the drafter dtype."""
        if self._target_embed is None:
            raise RuntimeError("drafter is not bound to a target: call bind_target()")
        return self._target_embed(ids).to(self.fc.weight.dtype)

    # -- context ----------------------------------------------------------------------
    def fuse(self, feats: torch.Tensor) -> torch.Tensor:
        """Context fusion: [b, T, F*d] target features -> norm_ctx(W_fc feats) [b, T, d]."""
        return self.norm_ctx(self.fc(feats.to(self.fc.weight.dtype)))

    def context_kv(self, feats: torch.Tensor, pos: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per-layer draft context K/V for target features [b, T, F*d] at pos [b, T]."""
        f = self.fuse(feats)
        return [layer.context_kv(f, pos) for layer in self.layers]

    # -- block forward ----------------------------------------------------------------
    def block_input(self, anchors: torch.Tensor, rows: int | None = None) -> torch.Tensor:
        """Row 0 = target embedding of the anchor, rows 1..R-1 = mask embedding.

        anchors [b, nb] int64 -> [b, nb, R, d] with R = ``rows`` (default: block size B).
        """
        B = rows or self.cfg.block_size
        e0 = self.embed(anchors)  # [b, nb, d]
        h = self.mask_embed.to(e0.dtype).expand(*anchors.shape, B, e0.shape[-1]).clone()
        h[:, :, 0] = e0
        if self.row_embed is not None:
            h = h + self.row_embed[:B].to(e0.dtype)
        return h

    def block_mask(self, anchor_pos: torch.Tensor, ctx_pos: torch.Tensor, ctx_valid: torch.Tensor,
                   rows: int | None = None) -> torch.Tensor:
        """Attention mask [b, nb*R, T + nb*R] (True = attend), R = ``rows`` (default B).

        Context key t is visible to a block whose anchor sits at position a when
        ``ctx_valid`` and ``a - window <= pos_t < a``; inside a block, row i sees rows
        <= i (causal, DSpine) or all rows (DFlash); blocks never see each other.
        anchor_pos [b, nb], ctx_pos [b, T], ctx_valid [b, T] bool.
        """
        b, nb = anchor_pos.shape
        B, W = rows or self.cfg.block_size, self.cfg.window
        a = anchor_pos[:, :, None]  # [b, nb, 1]
        t = ctx_pos[:, None, :]  # [b, 1, T]
        cm = ctx_valid[:, None, :] & (t < a) & (t >= a - W)  # [b, nb, T]
        cm = cm[:, :, None, :].expand(b, nb, B, -1).reshape(b, nb * B, -1)
        inner = torch.ones(B, B, dtype=torch.bool, device=anchor_pos.device)
        if self.cfg.block_causal:
            inner = torch.tril(inner)
        bm = torch.block_diag(*([inner] * nb)) if nb > 1 else inner  # [nb*B, nb*B]
        return torch.cat([cm, bm.expand(b, -1, -1)], dim=-1)

    def bridge(self, l: int, h: torch.Tensor, anchors: torch.Tensor):
        """Bridge of layer l on h [b, nb, B, d]; returns (h_new, h_pre, r, c)."""
        r = rms(h, self.cfg.rms_eps)  # [b, nb, B, 1]
        c = self.read[l](h / r)  # [b, nb, B, dc]
        c = torch.cat([self.alpha * self.codebook(anchors)[:, :, None].to(c.dtype), c[:, :, 1:]], dim=2)
        cp = c[:, :, :-1]  # predecessor codes for receivers 1..B-1
        m = torch.sigmoid(self.g_r(c[:, :, 1:]) + self.g_p(cp)) * self.v_p(cp)  # [b, nb, B-1, dm]
        w = r[:, :, 1:] * self.write[l](m)  # [b, nb, B-1, d]; zero write at row 0
        h_new = torch.cat([h[:, :, :1], h[:, :, 1:] + w], dim=2)
        return h_new, h, r, c

    def forward_blocks(self, anchors: torch.Tensor, anchor_pos: torch.Tensor,
                       ctx_kv: list[tuple[torch.Tensor, torch.Tensor]], ctx_pos: torch.Tensor,
                       ctx_valid: torch.Tensor, rows: int | None = None) -> BlockOutput:
        """Run all layers over blocks.

        anchors, anchor_pos: [b, nb] int64 (anchor token and its absolute position);
        ctx_kv: per layer (k, v) [b, kv, T, hd]; ctx_pos [b, T]; ctx_valid [b, T] bool.
        ``rows``: run only the first R <= B rows of each block (outputs [b, nb, R, ...]).
        In a block-causal drafter (DSpine) rows never read later rows (causal attention,
        the bridge passes messages from row i-1 to row i only), so these R rows equal the
        first R rows of the full block; a drafter with a bidirectional block (DFlash-style)
        must run all B rows.

        Raises:
            ValueError: ``rows`` outside 1..B, or R < B for a bidirectional block.
        """
        b, nb = anchors.shape
        B = self.cfg.block_size if rows is None else int(rows)
        if not 1 <= B <= self.cfg.block_size:
            raise ValueError(f"rows must be in 1..{self.cfg.block_size}, got {rows}")
        if B < self.cfg.block_size and not self.cfg.block_causal:
            raise ValueError("a bidirectional block (DFlash-style) reads every row: it cannot run "
                             f"{B} of {self.cfg.block_size} rows")
        h = self.block_input(anchors, B)  # [b, nb, B, d]
        pos = (anchor_pos[:, :, None] + torch.arange(B, device=anchors.device)).reshape(b, nb * B)
        mask = self.block_mask(anchor_pos, ctx_pos, ctx_valid, B)
        h_pre, r, c = h, None, None
        for l, layer in enumerate(self.layers):
            h = layer(h.reshape(b, nb * B, -1), pos, ctx_kv[l][0], ctx_kv[l][1], mask).reshape(b, nb, B, -1)
            if self.cfg.bridge:
                h, h_pre, r, c = self.bridge(l, h, anchors)
            else:
                h_pre = h
        return BlockOutput(h=h, h_pre=h_pre, r=r, c=c)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """Continuous logits z = H . norm_f(h): [..., d] -> [..., V]."""
        return self.norm_f(h) @ self.head.to(h.dtype).T

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())
