"""Training and evaluation data for DSpine drafters (spec section 9).

* :mod:`dspine.data.sources`: offline prompt sources (HumanEval, MT-Bench, BFCL,
  ShareGPT, user JSONL), training and held-out prompts; :mod:`dspine.data.stdlib` code cut
  from the Python standard library; :mod:`dspine.data.splits` the committed train/eval
  splits (``splits.json``).
* :mod:`dspine.data.build`: regeneration of responses by the target itself
  (``dspine data build``); :mod:`dspine.data.generate` the batched greedy generation it runs.
* :mod:`dspine.data.store`: a data directory on disk (resumable JSONL shards + manifest,
  packing); :mod:`dspine.data.tokenizer` its tie to the target's tokenizer.
* :mod:`dspine.data.load`: :func:`load_dataset`, a data directory as training sequences.
"""
from __future__ import annotations

from dspine.data.sources import (
    heldout_prompts,
    iter_jsonl_prompts,
    iter_sharegpt,
    load_bfcl,
    load_humaneval,
    load_mtbench,
    training_prompts,
)
from dspine.data.splits import load_splits
from dspine.data.stdlib import iter_stdlib_prompts

__all__ = [
    "heldout_prompts", "iter_jsonl_prompts", "iter_sharegpt", "iter_stdlib_prompts",
    "load_bfcl", "load_humaneval", "load_mtbench", "load_splits", "training_prompts",
    "build_dataset", "load_dataset",
]


def __getattr__(name):  # lazy: build.py imports torch/transformers
    if name == "build_dataset":
        from dspine.data import build
        return build.build_dataset
    if name == "load_dataset":
        from dspine.data import load
        return load.load_dataset
    raise AttributeError(name)
