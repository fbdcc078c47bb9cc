"""Resident memory footprint of a drafter (+ target), spec sections 2, 4 and 7.

:func:`estimate` computes the bytes each resident part needs from configurations
alone (nothing is allocated, so the release profile's 27B-target drafter can be
sized on any machine); ``dspine memory`` prints it. The report's rows, totals and
rendering are :mod:`dspine.drafter.memory_report`; what it reads from a target,
:mod:`dspine.drafter.target_spec`.

Parts (bytes; ``s`` = bytes per element of ``dtype``, V vocabulary, d hidden,
d_c code width, d_m message width, L_d drafter layers):

- drafter weights without the codebook (fusion, layers, bridge, norms, embeddings),
- token codebook ``E`` [V, d_c],
- greedy lookup tables [V, d_m] + [V, 2 d_m] (spec s.4: the head folded through
  ``W_L``, and ``G_p E``, ``V_p E``). The release keeps them; the dspine runtime
  does not (its greedy chain scores the exact conditional tables), so they count in
  the release layout only,
- quantized coarse head copy [V, d] at 1 byte (int8 / FP8) + per-row float32 scales,
- draft context K/V: ``2 L_d n_kv d_head s`` per position, for a full window, and
  for the retained context of each request in two layouts: *dense pool (release)*,
  which keeps every position, and *bounded ring buffer (dspine)*
  (:class:`dspine.proposers.draft_context.DraftContextCache`), which holds at most ``window``,
- with a target: its weights (parameter count from its config, instantiated on the
  ``meta`` device), its KV per position and for the context, and the recurrent and
  convolution state of linear-attention layers (recurrent state in float32, spec s.6).

The target's output head and input embedding are shared with the drafter and are
counted once, in the target weights.
"""
from __future__ import annotations

from pathlib import Path

import torch

from dspine.config import ConfigError, DSpineConfig
from dspine.drafter.memory_report import MemoryReport, Row
from dspine.drafter.target_spec import target_spec

RELEASE_CONTEXT = 131072  # retained positions in the spec's reference figure (s.7)
RING_MIN_CAPACITY = 64  # DraftContextCache allocates at least this many slots (below window)

_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def dtype_bytes(dtype: str | torch.dtype) -> int:
    """Bytes per element of ``float32|bfloat16|float16`` (or a torch dtype)."""
    if isinstance(dtype, torch.dtype):
        return torch.empty((), dtype=dtype).element_size()
    if dtype not in _DTYPE_BYTES:
        raise ValueError(f"dtype {dtype!r} is not supported; accepted: {sorted(_DTYPE_BYTES)}")
    return _DTYPE_BYTES[dtype]


# -- drafter -------------------------------------------------------------------------------
def drafter_param_counts(cfg: DSpineConfig) -> dict[str, int]:
    """Parameter counts of :class:`dspine.drafter.model.DSpineDrafter` by part (no allocation).

    Keys: ``fusion`` (W_fc + norm_ctx), ``layers`` (attention, MLP and norms of all
    layers), ``bridge`` (R_l, W_l, G_r, G_p, V_p, alpha), ``embeddings`` (mask and row
    embeddings, norm_f), ``codebook`` (E). The target's head/embedding are not included.
    """
    d, L, F = cfg.target_hidden, cfg.num_layers, len(cfg.feature_layers)
    h, kv, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    layer = (2 * d  # attn_norm, mlp_norm
             + (2 * hd if cfg.qk_norm else 0)  # q_norm, k_norm
             + d * h * hd + 2 * d * kv * hd + h * hd * d  # q, k, v, o
             + 3 * d * cfg.ffn)  # gate, up, down
    out = {
        "fusion": F * d * d + d,
        "layers": L * layer,
        "bridge": 0,
        "embeddings": d + (cfg.block_size * d if cfg.row_embedding else 0) + d,  # mask, rows, norm_f
        "codebook": 0,
    }
    if cfg.bridge:
        dc, dm = cfg.code_dim, cfg.msg_dim
        out["bridge"] = L * d * dc + L * dm * d + 3 * dc * dm + 1
        out["codebook"] = cfg.vocab_size * dc
    return out


def draft_kv_bytes_per_position(cfg: DSpineConfig, elem: int) -> int:
    """Draft context K/V bytes per retained position: 2 L_d n_kv d_head s (spec s.7)."""
    return 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * elem


def ring_buffer_positions(context: int, window: int) -> int:
    """Slots a :class:`DraftContextCache` holds after a prefill of ``context`` positions.

    ``min(window, max(context, 64))``; while a request grows by decoding, capacity
    doubles (at most ``min(window, 2 * positions)``) and never exceeds ``window``.
    """
    if context <= 0:
        return 0
    return min(window, max(context, RING_MIN_CAPACITY))


def estimate(cfg: DSpineConfig, target=None, *, context: int | None = None, concurrency: int = 1,
             dtype: str = "bfloat16", target_dtype: str | None = None,
             profile: str = "", head_kernels: tuple[str, ...] = ("int8",), tree_budget: int = 0,
             ngram_cache_tokens: int = 0, ngram_max: int = 4, draft_vocab: int = 0,
             ngram_prior: tuple[int, int] | None = None) -> MemoryReport:
    """Footprint of drafter ``cfg`` (+ ``target``) in ``dtype``.

    ``head_kernels``: the candidate-pass kernels a run keeps (:mod:`dspine.tune.head`;
    measured per machine, ``dspine tune`` shows them): ``int8`` holds a V x d int8 copy
    of the head plus scales (the spec's quantized pass), ``bfloat16`` a bf16 copy,
    ``exact`` none. ``draft_vocab`` > 0: the candidate pass scores only that many ids
    (:mod:`dspine.drafter.vocab`), so its copies hold that many head rows.

    Args:
        target: None, a name/path, a loaded Target or a :class:`~dspine.drafter.target_spec.TargetSpec`.
        context: retained positions per request (default: 131072, capped at the
            target's context window when a target is given).
        concurrency: requests held at once (per-request rows are multiplied in totals).
        dtype: drafter weights/activations/K-V dtype; ``target_dtype`` defaults to it.
        tree_budget: draft-tree nodes per cycle (:mod:`dspine.trees`); > 0 adds the
            per-request buffers of one tree verification (with a target).
        ngram_prior: ``(bytes, contexts)`` of the n-gram prior's table
            (:meth:`dspine.drafter.ngram_prior.NgramPrior.nbytes`, ``--ngram-prior``), shared by
            all requests; None: no prior. Its size depends on the data it was built from, so
            it is measured (``dspine memory --ngram-prior`` loads or builds it), not derived
            from configurations.
    Raises:
        ValueError: unknown dtype, context or concurrency < 1, tree_budget < 0.
    """
    s = dtype_bytes(dtype)
    ts = dtype_bytes(target_dtype or dtype)
    spec = target_spec(target) if target is not None else None
    if context is None:
        context = min(RELEASE_CONTEXT, spec.max_positions) if spec else RELEASE_CONTEXT
    if context < 1:
        raise ValueError(f"context must be >= 1, got {context}")
    if concurrency < 1:
        raise ValueError(f"concurrency must be >= 1, got {concurrency}")
    if tree_budget < 0:
        raise ValueError(f"tree_budget must be >= 0, got {tree_budget}")
    V, d, dc, dm = cfg.vocab_size, cfg.target_hidden, cfg.code_dim, cfg.msg_dim
    pc = drafter_param_counts(cfg)
    no_cb = sum(v for k, v in pc.items() if k != "codebook")
    rows = [Row("drafter_weights", "drafter weights (without codebook)", no_cb * s,
                f"{no_cb:,} params")]
    for k, lab in (("fusion", "context fusion W_fc + norm"), ("layers", f"{cfg.num_layers} drafter layers"),
                   ("bridge", "bridge R_l, W_l, G_r, G_p, V_p"), ("embeddings", "mask/row embeddings, norm_f")):
        rows.append(Row(f"drafter_weights.{k}", lab, pc[k] * s, f"{pc[k]:,} params", indent=1, in_total=False))
    if cfg.bridge:
        rows.append(Row("codebook", f"token codebook E [{V}, {dc}]", pc["codebook"] * s))
    if cfg.final_stage:
        rows.append(Row("greedy_tables", f"greedy lookup tables [{V}, {dm}] + [{V}, {2 * dm}]",
                        V * 3 * dm * s, "dspine scores exact conditional tables instead", layout="release"))
    # both modes: the candidate pass of the final stage / the DFlash-style argmax
    Vh = draft_vocab if 0 < draft_vocab < V else V  # rows the candidate pass scores
    sub = "" if Vh == V else f" (draft vocabulary: {Vh} of {V} ids)"
    if "int8" in head_kernels:
        rows.append(Row("quantized_head", f"quantized coarse head copy [{Vh}, {d}] int8/fp8", Vh * d,
                        "+ scales below" + sub))
        rows.append(Row("quantized_head_scales", f"coarse head row scales [{Vh}] float32", Vh * 4, indent=1))
    if "bfloat16" in head_kernels:
        rows.append(Row("bf16_head", f"bfloat16 coarse head copy [{Vh}, {d}]", Vh * d * 2,
                        "candidate pass measured fastest in bf16 at some row counts" + sub))
    if "exact" in head_kernels and Vh < V:
        rows.append(Row("draft_vocab_head", f"head rows of the draft vocabulary [{Vh}, {d}]", Vh * d * s,
                        "the exact candidate pass over the draft vocabulary scores a copy of those rows"))
    per = draft_kv_bytes_per_position(cfg, s)
    W = cfg.window
    ring = ring_buffer_positions(context, W)
    rows += [
        Row("draft_kv_per_position", "draft K/V, one position", per,
            f"2 x {cfg.num_layers} layers x {cfg.num_kv_heads} kv heads x {cfg.head_dim} x {s} B",
            in_total=False),
        Row("draft_kv_window", f"draft K/V, full window ({W} positions)", W * per, in_total=False),
        Row("draft_kv_dense", f"draft K/V, {context} retained positions, dense pool (release)",
            context * per, layout="release", scope="request"),
        Row("draft_kv_ring", f"draft K/V, {context} retained positions, bounded ring buffer (dspine)",
            ring * per, f"{ring} slots after a prefill (never above the window; below it the "
                        f"buffer grows by doubling)", layout="dspine", scope="request"),
    ]
    notes = []
    if spec is not None:
        if context > spec.max_positions:
            notes.append(f"context {context} exceeds the target's window of {spec.max_positions} positions")
        kv_el = spec.kv_elements(context)
        rows += [
            Row("target_weights", f"target weights ({spec.name})", spec.params * ts,
                f"{spec.params:,} params; output head/embedding shared with the drafter"),
            Row("target_kv_per_position", "target KV, one position",
                (spec.kv_per_position + sum(e for _, e in spec.sliding)) * ts, in_total=False),
            Row("target_kv", f"target KV, {context} positions", kv_el * ts, scope="request"),
        ]
        if tree_budget > 0:  # one tree verification: the nodes' K/V slots, float32 logits, features,
            n = tree_budget + 1  # the tree mask and one layer's attention scores over the context
            F = len(cfg.feature_layers) or 5
            per_node = spec.kv_per_position * ts + spec.vocab_size * 4 + F * spec.hidden_size * ts
            heads = getattr(spec, "num_heads", 0) or max(1, spec.hidden_size // 64)
            att = n * (context + n) * (1 + 4 * heads)  # bool mask + float32 scores per head
            rows.append(Row("tree_verify", f"draft tree verification, {tree_budget} nodes + anchor",
                            n * per_node + att,
                            f"per node: target K/V, float32 logits [{spec.vocab_size}], {F} feature layers; "
                            f"plus the [{n}, context + {n}] mask and one layer's attention scores "
                            f"(~{heads} heads); held during one cycle", scope="request"))
        if spec.state_fp32 or spec.conv_state:
            rows.append(Row("target_state", "target recurrent state (float32) + conv state",
                            spec.state_fp32 * 4 + spec.conv_state * ts, scope="request"))
    if ngram_cache_tokens > 0:  # serve --ngram-cache-tokens: shared by all requests (all tenants)
        from dspine.proposers.cache import BYTES_PER_SLOT, bytes_bound

        rows.append(Row("ngram_cache", f"cross-request output cache, {ngram_cache_tokens} tokens",
                        bytes_bound(ngram_cache_tokens, ngram_max),
                        f"upper bound: 8 B per token + {ngram_max} index slots x ~{BYTES_PER_SLOT} B "
                        f"(Python objects; serve --ngram-cache-tokens)"))
    if ngram_prior is not None:  # generate/serve --ngram-prior: one table per process
        nb, n_ctx = ngram_prior
        rows.append(Row("ngram_prior", "n-gram prior of the final stage's chain", int(nb),
                        f"{n_ctx:,} contexts (--ngram-prior; built from the target's regenerated answers)"))
    if concurrency > 8:
        notes.append(f"concurrency {concurrency} is above the validated limit 8 (the runtime refuses it)")
    return MemoryReport(profile=profile or cfg.mode, dtype=dtype if isinstance(dtype, str) else str(dtype),
                        context=context, concurrency=concurrency, window=W,
                        target=spec.name if spec else None, rows=rows, notes=notes)


def drafter_config(name: str, target=None) -> DSpineConfig:
    """``release`` | ``small`` | a config path (file or checkpoint directory).

    With a target, the release/small profiles are sized for it
    (:meth:`DSpineConfig.for_target`); a config path is checked against it.
    """
    from dspine.drafter.checkpoint import check_fits_target

    if name in ("release", "small"):
        if target is None:
            return DSpineConfig.release() if name == "release" else DSpineConfig.small()
        return DSpineConfig.for_target(target, profile=name)
    p = Path(name)
    if not p.exists():
        raise ConfigError(f"drafter config {name!r}: expected release, small, or a drafter config path")
    cfg = DSpineConfig.load(p)
    if target is not None:
        check_fits_target(cfg, target, where=f"drafter config {name}")
    return cfg


# -- measured allocation (for checks) -------------------------------------------------------------
def tensor_bytes(tensors) -> int:
    """Sum of ``numel * element_size`` over tensors (each storage once by data pointer)."""
    seen, total = set(), 0
    for t in tensors:
        key = (t.data_ptr(), t.numel(), t.dtype) if t.device.type != "meta" else id(t)
        if key in seen:
            continue
        seen.add(key)
        total += t.numel() * t.element_size()
    return total
