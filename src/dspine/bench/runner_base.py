"""What every benchmark runner shares: the identity record and the decoding settings it reports.

:class:`Runner` is the base of :class:`dspine.bench.runners.EngineRunner`,
:class:`dspine.bench.hf_runner.HFRunner` and :class:`dspine.bench.llama_cpp.LlamaCppRunner`:
its :meth:`~Runner.identity` (target, weights fingerprint, dtype, device, threads) and
:meth:`~Runner.decoding` are compared across modes by
:func:`dspine.bench.fairness.check_fair`. Also the helpers that cut an external
generator's output as the Engine cuts its own (:func:`finish_ids`).
"""
from __future__ import annotations

import hashlib
from dataclasses import asdict

import torch

from dspine.config import SamplingConfig


def weights_fingerprint(model: torch.nn.Module) -> str:
    """Cheap fingerprint of a model's weights: names, shapes, dtypes and strided samples."""
    h = hashlib.sha256()
    for name, p in model.state_dict().items():
        h.update(f"{name}:{tuple(p.shape)}:{p.dtype}".encode())
        flat = p.detach().reshape(-1)
        if flat.numel():
            k = min(64, flat.numel())
            idx = torch.arange(k, dtype=torch.long) * (flat.numel() - 1) // max(1, k - 1)
            h.update(flat[idx].float().cpu().numpy().tobytes())
    return h.hexdigest()[:16]


def _sampling_dict(s: SamplingConfig) -> dict:
    d = asdict(s)
    d.pop("seed", None)  # the seed varies per repeat, identically for every mode
    return d


def _cut_at_stop(tok, ids: list[int], stop: list[str]) -> tuple[list[int], bool]:
    """Shortest prefix of ``ids`` whose text contains a stop string (as the Engine does)."""
    if not stop:
        return ids, False
    text = tok.decode(ids, skip_special_tokens=True)
    if not any(s in text for s in stop):
        return ids, False
    for k in range(1, len(ids) + 1):
        if any(s in tok.decode(ids[:k], skip_special_tokens=True) for s in stop):
            return ids[:k], True
    return ids, True


def finish_ids(tok, ids: list[int], eos, stop: list[str]) -> tuple[list[int], str]:
    """An external generator's ids cut as the Engine cuts them: after the first EOS id, then
    at the shortest prefix whose text holds a stop string. Returns (ids, "stop" | "length")."""
    finish = "length"
    cut = next((i for i, t in enumerate(ids) if t in eos), None)
    if cut is not None:
        ids, finish = ids[:cut + 1], "stop"
    ids, hit = _cut_at_stop(tok, ids, stop)
    return ids, "stop" if hit else finish


def _text(tok, ids: list[int], stop: list[str]) -> str:
    text = tok.decode(ids, skip_special_tokens=True)
    cut = [text.find(s) for s in stop if s in text]
    return text[:min(cut)] if cut else text


class Runner:
    """Common part: the shared target and the identity record."""

    mode: str = ""

    def __init__(self, target, threads: int | None = None):
        self.target = target
        self.threads = threads

    def identity(self) -> dict:
        t = self.target
        if not hasattr(t, "_bench_fingerprint"):
            t._bench_fingerprint = weights_fingerprint(t.model)
        return {"target": t.name, "target_path": t.path, "weights": t._bench_fingerprint,
                "dtype": str(next(t.model.parameters()).dtype).replace("torch.", ""),
                "device": str(next(t.model.parameters()).device),
                "threads": torch.get_num_threads()}

    def decoding(self, sampling: SamplingConfig, max_new_tokens: int, stop: list[str]) -> dict:
        """The decoding settings this runner applies for a request (compared across modes)."""
        return {"sampling": _sampling_dict(sampling), "max_new_tokens": max_new_tokens,
                "stop": list(stop), "eos": sorted(self.target.eos_token_ids)}

    def info(self) -> dict:
        """Mode details recorded in each row (drafter, block size, lookup size)."""
        return {"mode": self.mode}
