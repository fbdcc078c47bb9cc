"""The drafter's reduced draft vocabulary (EAGLE-3's ``d2t`` idea).

Training pushes the drafter's scores only over the most frequent response tokens
(``dspine train --vocab-subset``, 8,192 of SmolLM2's 49,152 by default), yet the final
stage's candidate pass scored the whole vocabulary every cycle (spec section 4, step 1):
on a 2-core CPU that pass is the largest part of drafting one token. With a draft
vocabulary the coarse pass scores only those ids; its top ``coarse_k`` are mapped back to
target ids and rescored with the exact head as before. Tokens outside the subset are
never proposed (the target still produces them: proposals never decide the output, so
decoding stays lossless; only tau can change).

A checkpoint carries its subset in ``draft_vocab.json`` (``{"ids": [...], ...}``, sorted
target ids): ``dspine train`` writes the subset it trained on; :func:`build_draft_vocab`
derives one from regenerated training data for older checkpoints (``dspine data vocab``).
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from dspine.config import ConfigError

FILE = "draft_vocab.json"
#: ``--draft-vocab`` values: ``auto`` (the checkpoint's subset when it has one), ``full``
#: (score the whole vocabulary), ``subset`` (the checkpoint's subset; an error without one)
CHOICES = ("auto", "full", "subset")


class DraftVocabError(ConfigError):
    """A ``draft_vocab.json`` is damaged or does not fit the drafter, or
    ``SpeculativeConfig.draft_vocab`` asks for a subset the checkpoint does not have
    (:attr:`field` ``draft_vocab`` where that setting is at fault or is the way out)."""


def frequent_tokens(seqs, n: int, vocab: int) -> torch.Tensor:
    """The ``n`` most frequent token ids in the responses of ``seqs`` (list of (ids, response
    start)), as sorted ids [min(n, vocab)] int64 (ties: lower id first, as ``torch.topk``
    on the counts)."""
    counts = torch.zeros(vocab, dtype=torch.long)
    for s, r in seqs:
        counts += torch.bincount(torch.tensor(s[r:], dtype=torch.long), minlength=vocab)
    n = min(n, vocab)
    return torch.sort(torch.topk(counts, n).indices).values


def coverage(ids: torch.Tensor, seqs) -> float:
    """Fraction of the response tokens of ``seqs`` that lie in ``ids`` (0.0 without tokens)."""
    member = torch.zeros(int(ids.max()) + 1 if ids.numel() else 1, dtype=torch.bool)
    member[ids] = True
    hit = total = 0
    for s, r in seqs:
        t = torch.tensor(s[r:], dtype=torch.long)
        total += t.numel()
        hit += int(member[t[t < member.numel()]].sum())
    return hit / total if total else 0.0


def save_draft_vocab(out_dir: str | Path, ids: torch.Tensor, meta: dict | None = None) -> Path:
    """Write ``out_dir/draft_vocab.json``: sorted ``ids`` [n] int64 plus ``meta`` (source,
    coverage, ...). Returns the file's path."""
    f = Path(out_dir) / FILE
    body = {"size": int(ids.numel()), **(meta or {}), "ids": [int(i) for i in torch.sort(ids).values]}
    f.write_text(json.dumps(body, separators=(",", ":")))
    return f


def load_draft_vocab(ckpt_dir: str | Path | None, vocab_size: int, min_size: int) -> torch.Tensor | None:
    """The checkpoint's draft vocabulary as sorted unique ids [n] int64, or None when it has
    no ``draft_vocab.json`` (or ``ckpt_dir`` is None: a random drafter).

    ``min_size``: the fewest ids the final stage can use (its ``head_topk`` candidates per row).

    Raises:
        DraftVocabError: the file is not JSON, lacks an ``ids`` list, holds ids outside
            ``0..vocab_size-1`` or duplicates, or fewer than ``min_size`` ids.
    """
    if ckpt_dir is None:
        return None
    f = Path(ckpt_dir) / FILE
    if not f.is_file():
        return None
    try:
        body = json.loads(f.read_text(encoding="utf-8"))
        ids = body["ids"]
        if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
            raise TypeError("ids is not a list of integers")
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as e:
        raise DraftVocabError(f"{f} is damaged ({type(e).__name__}: {e}); restore it, or delete it to "
                              f"score the whole vocabulary") from None
    t = torch.tensor(ids, dtype=torch.long)
    if t.numel() and (int(t.min()) < 0 or int(t.max()) >= vocab_size):
        raise DraftVocabError(f"{f}: ids outside the drafter's vocabulary 0..{vocab_size - 1}")
    if torch.unique(t).numel() != t.numel():
        raise DraftVocabError(f"{f}: repeated ids")
    if t.numel() < min_size:
        raise DraftVocabError(f"{f}: {t.numel()} ids, fewer than the final stage's {min_size} candidates "
                              f"per row (head_topk); use SpeculativeConfig.draft_vocab='full'", field="draft_vocab")
    return torch.sort(t).values


def resolve(choice: str, ckpt_dir: str | Path | None, vocab_size: int, min_size: int) -> torch.Tensor | None:
    """The ids to score for ``SpeculativeConfig.draft_vocab`` ``choice`` (None = the whole vocabulary).

    Raises:
        DraftVocabError: unknown ``choice``, ``subset`` without a ``draft_vocab.json``, or a
            damaged file (:func:`load_draft_vocab`).
    """
    if choice not in CHOICES:
        raise DraftVocabError(f"SpeculativeConfig.draft_vocab {choice!r} is unknown; accepted: {', '.join(CHOICES)}",
                              field="draft_vocab")
    if choice == "full":
        return None
    ids = load_draft_vocab(ckpt_dir, vocab_size, min_size)
    if ids is None and choice == "subset":
        where = "a random drafter" if ckpt_dir is None else f"{ckpt_dir}"
        raise DraftVocabError(f"SpeculativeConfig.draft_vocab subset: {where} has no {FILE} (train with "
                              f"`dspine train --vocab-subset`, or write one with `dspine data vocab`); use "
                              f"SpeculativeConfig.draft_vocab='full' (or 'auto')", field="draft_vocab")
    return ids
