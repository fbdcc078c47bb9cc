"""The transformers peers ``hf`` and ``hf-pld``: ``generate`` on the bench's shared target.

:class:`HFRunner` runs plain ``model.generate`` (``hf``) or ``generate`` with
``prompt_lookup_num_tokens`` (``hf-pld``), the peers a user would pick. TTFT and cycles
come from a streamer: transformers puts the prompt, then the tokens of every cycle.
"""
from __future__ import annotations

import time

import torch

from dspine.bench.modes import HF_MODES
from dspine.bench.peak_memory import PeakMemory
from dspine.bench.runner_base import Runner, _sampling_dict, _text, finish_ids
from dspine.config import SamplingConfig


class _TimingStreamer:
    """transformers streamer protocol: the first ``put`` is the prompt, then one per cycle."""

    def __init__(self):
        self.t0 = time.perf_counter()
        self.puts: list[tuple[float, int]] = []  # (time, tokens) per cycle after the prompt
        self._prompt_seen = False
        self.t_end = None

    def put(self, value) -> None:
        if not self._prompt_seen:
            self._prompt_seen = True
            return
        self.puts.append((time.perf_counter(), int(value.numel())))

    def end(self) -> None:
        self.t_end = time.perf_counter()


class HFRunner(Runner):
    """``hf`` and ``hf-pld``: transformers' own ``generate`` on the shared target model."""

    def __init__(self, target, mode: str, pld_tokens: int = 10, max_ngram: int = 2,
                 threads: int | None = None):
        super().__init__(target, threads)
        if mode not in HF_MODES:
            raise ValueError(f"HFRunner mode {mode!r}; accepted: {HF_MODES}")
        self.mode = mode
        self.pld_tokens = pld_tokens if mode == "hf-pld" else None
        self.max_ngram = max_ngram

    def info(self) -> dict:
        import transformers

        d = {"mode": self.mode, "block_size": (self.pld_tokens + 1) if self.pld_tokens else 1,
             "transformers": transformers.__version__}
        if self.pld_tokens:
            d.update(prompt_lookup_num_tokens=self.pld_tokens, max_matching_ngram_size=self.max_ngram)
        return d

    def generation_config(self, sampling: SamplingConfig, max_new_tokens: int, timeout_s: float | None = None):
        """The full ``GenerationConfig`` (nothing inherited from the checkpoint's defaults)."""
        from transformers import GenerationConfig

        eos = sorted(self.target.eos_token_ids)
        pad = getattr(self.target.tokenizer, "pad_token_id", None)
        pad = pad if pad is not None else (eos[0] if eos else 0)
        kw = dict(max_new_tokens=max_new_tokens, min_new_tokens=0, do_sample=not sampling.greedy,
                  eos_token_id=eos or None, pad_token_id=pad, num_beams=1, use_cache=True,
                  max_time=timeout_s, repetition_penalty=None)
        if sampling.greedy:
            kw.update(temperature=None, top_k=None, top_p=None, min_p=None)
        else:
            kw.update(temperature=sampling.temperature, top_k=sampling.top_k or None,
                      top_p=sampling.top_p if sampling.top_p < 1 else None,
                      min_p=sampling.min_p or None)
        if self.pld_tokens:
            kw.update(prompt_lookup_num_tokens=self.pld_tokens, max_matching_ngram_size=self.max_ngram)
        return GenerationConfig(**kw)

    def decoding(self, sampling: SamplingConfig, max_new_tokens: int, stop: list[str]) -> dict:
        """Read back from the GenerationConfig actually passed to ``generate``."""
        g = self.generation_config(sampling, max_new_tokens)
        if not g.do_sample:
            applied = SamplingConfig()
        else:
            applied = SamplingConfig(temperature=float(g.temperature), top_k=int(g.top_k or 0),
                                     top_p=float(g.top_p if g.top_p is not None else 1.0),
                                     min_p=float(g.min_p or 0.0))
        eos = g.eos_token_id if isinstance(g.eos_token_id, list) else ([g.eos_token_id] if g.eos_token_id is not None else [])
        return {"sampling": _sampling_dict(applied), "max_new_tokens": g.max_new_tokens,
                "stop": list(stop), "eos": sorted(eos)}

    @torch.no_grad()
    def run(self, prompt_ids: list[int], sampling: SamplingConfig, max_new_tokens: int,
            stop: list[str], timeout_s: float) -> dict:
        from transformers import StoppingCriteria, StoppingCriteriaList

        tok = self.target.tokenizer
        n_prompt = len(prompt_ids)

        class StopStrings(StoppingCriteria):  # works with any tokenizer that decodes
            def __call__(self, input_ids, scores, **kw):
                text = tok.decode(input_ids[0, n_prompt:].tolist(), skip_special_tokens=True)
                done = any(s in text for s in stop)
                return torch.full((input_ids.shape[0],), done, dtype=torch.bool, device=input_ids.device)

        dev = self.target.device
        x = torch.tensor([prompt_ids], device=dev)
        cfg = self.generation_config(sampling, max_new_tokens, timeout_s)
        if not sampling.greedy:
            torch.manual_seed(sampling.seed)
        streamer = _TimingStreamer()
        crit = StoppingCriteriaList([StopStrings()]) if stop else None
        with PeakMemory(dev) as mem:
            t0 = time.perf_counter()
            streamer.t0 = t0
            out = self.target.model.generate(input_ids=x, attention_mask=torch.ones_like(x),
                                             generation_config=cfg, streamer=streamer,
                                             stopping_criteria=crit)
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
            t_end = time.perf_counter()
        ids, finish = finish_ids(tok, [int(t) for t in out[0, n_prompt:].tolist()], self.target.eos_token_ids, stop)
        if finish == "length" and len(ids) < max_new_tokens and t_end - t0 >= timeout_s:
            finish = "timeout"
        puts = streamer.puts
        t_first = puts[0][0] if puts else t_end
        first_n = puts[0][1] if puts else 0
        cycles = max(0, len(puts) - 1)
        emitted = sum(n for _, n in puts[1:])
        decode_s = t_end - t_first
        n_out = len(ids)
        intervals = [b[0] - a[0] for a, b in zip(puts, puts[1:])]
        return {
            "output_ids": ids, "text": _text(tok, ids, stop), "finish_reason": finish,
            "prompt_tokens": n_prompt, "output_tokens": n_out,
            "ttft_s": t_first - t0, "decode_s": decode_s, "e2e_s": t_end - t0,
            # tokens after the first emission (which may hold several with prompt lookup)
            "tokens_per_second": (n_out - first_n) / decode_s if decode_s > 0 and n_out > first_n else 0.0,
            "first_cycle_tokens": first_n,
            "cycles": cycles, "emitted_sum": emitted, "tau": emitted / cycles if cycles else 0.0,
            "accepted_per_position": [], "drafted_counts": [], "accepted_counts": [],
            "verification_lengths": [],
            "draft_s": None, "final_stage_s": None, "verify_s": None,
            "cycle_s": sum(intervals), "overhead_s": None, "split_measured": False,
            "peak_memory_bytes": mem.peak, "peak_memory_kind": mem.kind,
        }
