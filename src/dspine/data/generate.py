"""Batched greedy generation for the data build (spec section 9), on the target's device.

:func:`generate_batch` gives the same tokens as transformers' ``model.generate``
(greedy, left padding, positions from the attention mask) but drops finished rows
from the batch and its KV cache. :func:`cpu_speed_patches` are two measured CPU
fixes applied around a build. :func:`batch_engine` / :func:`generate_engine` generate with
dspine's own batched engine instead (``--generator engine``).
"""
from __future__ import annotations

import contextlib
from typing import Iterable

import torch

# -- CPU speed patches -------------------------------------------------------------------
_F32_ATTN = "dspine_f32_sdpa"


def _register_f32_attention() -> None:
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    def f32_sdpa(module, query, key, value, attention_mask, **kw):
        out, w = sdpa_attention_forward(module, query.float(), key.float(), value.float(),
                                        attention_mask, **kw)
        return out.to(query.dtype), w

    AttentionInterface.register(_F32_ATTN, f32_sdpa)
    AttentionMaskInterface.register(_F32_ATTN, sdpa_mask)


@contextlib.contextmanager
def cpu_speed_patches(model):
    """Temporary patches for fast batched CPU generation (measured on 1 core, bf16).

    * the output head gets a contiguous input: with ``logits_to_keep=1`` the sliced
      hidden state is non-contiguous and ``F.linear`` broadcasts (copies) the whole
      [V, d] head per batch row (1.7 s of a 2.4 s prefill at batch 8);
    * bf16/fp16 attention computed by SDPA in float32 (the bf16 CPU flash kernel took
      ~70% of a decode step; decode 2.4x faster); CPU only, CUDA keeps its bf16 kernels.
    """
    head = model.get_output_embeddings()
    handle = head.register_forward_pre_hook(lambda mod, args: (args[0].contiguous(),) + args[1:])
    old_impl = getattr(model.config, "_attn_implementation", None)
    switched = False
    w = next(model.parameters())
    if w.device.type == "cpu" and w.dtype in (torch.bfloat16, torch.float16) and old_impl == "sdpa":
        try:
            _register_f32_attention()
            model.set_attn_implementation(_F32_ATTN)
            switched = True
        except Exception:  # older/newer transformers without the interface: keep sdpa
            switched = False
    try:
        yield "sdpa (float32 compute)" if switched else str(old_impl)
    finally:
        handle.remove()
        if switched:
            model.set_attn_implementation(old_impl)


# -- generation -------------------------------------------------------------------------
def _left_pad(prompts: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p, dtype=torch.long)
        mask[i, width - len(p):] = 1
    return ids, mask


def _cut_at_eos(row: list[int], eos: set[int]) -> tuple[list[int], bool]:
    cut = next((k for k, t in enumerate(row) if t in eos), None)
    return (row[:cut + 1], True) if cut is not None else (row, False)


@torch.inference_mode()
def generate_batch_hf(model, prompts: list[list[int]], max_new_tokens: int, eos_ids: Iterable[int],
                      pad_id: int) -> list[tuple[list[int], bool]]:
    """Reference: the same greedy continuations through transformers' ``model.generate``."""
    eos = sorted(set(int(e) for e in eos_ids))
    ids, mask = _left_pad(prompts, pad_id)
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens,
                         do_sample=False, temperature=None, top_p=None, top_k=None,
                         pad_token_id=pad_id, eos_token_id=eos or None)
    return [_cut_at_eos(r, set(eos)) for r in out[:, ids.shape[1]:].tolist()]


@torch.inference_mode()
def generate_batch(model, prompts: list[list[int]], max_new_tokens: int, eos_ids: Iterable[int],
                   pad_id: int) -> list[tuple[list[int], bool]]:
    """Greedy continuations of left-padded ``prompts``: (response ids, finished) each.

    A response ends with (and includes) its first EOS token; ``finished`` says one came.
    Same tokens as ``model.generate`` (greedy, left padding, positions from the mask), but
    rows that finished are dropped from the batch and its KV cache (``model.generate``
    keeps computing them until the last row ends); caches without batch selection
    (e.g. recurrent layers) keep the rows and just ignore them.
    """
    from transformers import DynamicCache

    eos = set(int(e) for e in eos_ids)
    dev = next(model.parameters()).device
    ids, mask = _left_pad(prompts, pad_id)
    ids, mask = ids.to(dev), mask.to(dev)
    n = len(prompts)
    cache = DynamicCache(config=model.config)
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    out = model(input_ids=ids, attention_mask=mask, position_ids=pos, past_key_values=cache,
                use_cache=True, logits_to_keep=1)
    nxt = out.logits[:, -1].argmax(-1)
    rows = list(range(n))  # batch slot -> prompt index
    results: list[list[int]] = [[] for _ in range(n)]
    done = [False] * n
    can_select = True
    last_pos = pos[:, -1]
    for step in range(max_new_tokens):
        toks = nxt.tolist()
        for slot, r in enumerate(rows):
            if not done[r]:
                results[r].append(toks[slot])
                done[r] = toks[slot] in eos
        if step == max_new_tokens - 1 or all(done[r] for r in rows):
            break
        keep = [slot for slot, r in enumerate(rows) if not done[r]]
        if can_select and len(keep) < len(rows):
            try:
                cache.batch_select_indices(torch.tensor(keep, device=dev))
            except (AttributeError, NotImplementedError, TypeError):
                can_select = False
            else:
                sel = torch.tensor(keep, device=dev)
                rows = [rows[k] for k in keep]
                nxt, mask, last_pos = nxt[sel], mask[sel], last_pos[sel]
        mask = torch.cat([mask, mask.new_ones((mask.shape[0], 1))], dim=1)
        last_pos = last_pos + 1
        step_ids = torch.where(torch.tensor([done[r] for r in rows], device=dev), pad_id, nxt)
        out = model(input_ids=step_ids[:, None], attention_mask=mask, position_ids=last_pos[:, None],
                    past_key_values=cache, use_cache=True)
        nxt = out.logits[:, -1].argmax(-1)
    return [(r, done[i]) for i, r in enumerate(results)]


# -- dspine's own engine (--generator engine) ------------------------------------------
def batch_engine(target, max_running: int, progress: bool = False):
    """dspine's plain target loop (``ar``) over its measured runtime, batched: what
    ``--generator engine`` generates with (:func:`dspine.data.build.build_dataset`)."""
    from dspine.core.batch import BatchEngine
    from dspine.core.engine import Engine
    from dspine.runtime.packed import apply_linear_backend
    from dspine.runtime.select import apply_runtime

    apply_runtime(target, "auto")
    apply_linear_backend(target, "auto", progress=progress)
    return BatchEngine(Engine(target, None, "ar"), max_running=max_running)


def generate_engine(engine, prompts: list[list[int]], max_new_tokens: int, eos_ids) -> list[tuple[list[int], bool]]:
    """Greedy continuations with a :func:`batch_engine`: (response ids, finished) each, the
    response ending with (and including) its first EOS token, as :func:`generate_batch`."""
    from dspine.config import SamplingConfig

    eos = set(int(e) for e in eos_ids)
    res = engine.generate_many([list(p) for p in prompts], SamplingConfig(), max_new_tokens)
    return [(list(r.token_ids), bool(r.token_ids) and r.token_ids[-1] in eos) for r in res]
