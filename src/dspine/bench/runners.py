"""One runner per benchmark mode, all over the *same* loaded :class:`~dspine.target.adapter.Target`.

* :class:`EngineRunner`: ``ar``, ``dflash``, ``dspine``, ``ngram`` (copies alone) and
  ``dspine-drafter`` (the DSpine drafter alone: no copies, single chains, whole blocks
  verified) through :class:`dspine.core.engine.Engine` (the same loop, sampler and stop logic;
  only the proposer differs).
* :class:`HFRunner`: ``hf`` (plain ``model.generate``) and ``hf-pld`` (``generate`` with
  ``prompt_lookup_num_tokens``), the peers a user would pick. TTFT and cycles come
  from a streamer: transformers puts the prompt, then the tokens of every cycle.

A runner reports its :meth:`identity` (target, weights fingerprint, dtype, device,
threads) and the decoding settings it actually passes; :func:`dspine.bench.harness.check_fair`
compares them across modes. :meth:`run` returns one flat dict of measurements.
"""
from __future__ import annotations

import hashlib
import os
import threading
import time
from dataclasses import asdict
from pathlib import Path

import torch

from dspine.config import SamplingConfig

ENGINE_MODES = ("ar", "dflash", "dspine", "ngram", "dspine-drafter")  # ngram: our own prompt lookup (no drafter)
#: modes that run a fixed configuration whatever the run's --proposer / --verify-policy / tree:
#: the drafter alone (single chain, the whole block verified every cycle)
FIXED_MODES = {"dspine-drafter": dict(drafter="dspine", proposer="drafter", verify_policy="fixed")}


def drafter_kind(mode: str) -> str:
    """The drafter a mode runs (``dspine`` / ``dflash``), ``mode`` itself for the others."""
    return FIXED_MODES.get(mode, {}).get("drafter", mode)
HF_MODES = ("hf", "hf-pld")
ALL_MODES = ENGINE_MODES + HF_MODES


# -- memory --------------------------------------------------------------------------------
def _rss_bytes() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        import resource

        return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


class PeakMemory:
    """Peak memory during a ``with`` block: max allocated on CUDA, sampled RSS on CPU."""

    def __init__(self, device: torch.device, interval_s: float = 0.01):
        self.device, self.interval = torch.device(device), interval_s
        self.peak = 0
        self.kind = "cuda_max_allocated" if self.device.type == "cuda" else "rss"
        self._stop = threading.Event()
        self._thread = None

    def _poll(self) -> None:
        while not self._stop.wait(self.interval):
            self.peak = max(self.peak, _rss_bytes())

    def __enter__(self) -> "PeakMemory":
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            self.peak = _rss_bytes()
            self._thread = threading.Thread(target=self._poll, daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.peak = int(torch.cuda.max_memory_allocated(self.device))
        else:
            self._stop.set()
            self._thread.join()
            self.peak = max(self.peak, _rss_bytes())


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


class EngineRunner(Runner):
    """``ar`` / ``dflash`` / ``dspine`` over the shared target.

    Args:
        drafter: checkpoint directory or ``random`` (ignored for ``ar``).
        block_size: block size of a random drafter (checkpoints run at their own).
    """

    def __init__(self, target, mode: str, drafter: str | None = None, block_size: int | None = None,
                 seed: int = 0, threads: int | None = None, proposer: str = "drafter",
                 verify_policy: str = "fixed", tree=None, drafter_linears: str = "auto",
                 draft_vocab: str = "auto", head_kernel: str = "auto"):
        """``verify_policy`` / ``tree`` / ``drafter_linears`` / ``draft_vocab`` /
        ``head_kernel``: as ``dspine generate``'s settings of the same names, given to the
        engine when it is built (a tree sized by the cost curve and the tree gate need the
        policy then), so the bench times what ``generate`` runs.

        Raises:
            EngineError: no drafter for a drafter mode, a checkpoint of the other mode, or a
                drafter setting that cannot run here (naming the setting).
        """
        super().__init__(target, threads)
        from dspine.drafter.checkpoint import load_drafter, random_drafter, read_card
        from dspine.core.engine import Engine, EngineError
        from dspine.build import drafter_engine
        from dspine.config import SpeculativeConfig
        from dspine.control.policy import make_policy
        from dspine.proposers import make_proposer

        self.mode = mode
        kind = drafter_kind(mode)
        self.drafter_path, self.card = None, {}
        self.proposer = proposer if mode not in ("ar", "ngram") else ("ngram" if mode == "ngram" else None)
        if mode == "ar":
            self.engine = Engine(target, None, "ar")
            self.block_size = 1
            return
        if mode == "ngram":  # copies of the request's own text, no drafter (ours, beside hf-pld)
            prop = make_proposer("ngram", None, block_size=16 if block_size is None else block_size)
            with torch.no_grad():
                policy = None if verify_policy == "fixed" else make_policy(verify_policy, target, prop, progress=True)
                self.engine = Engine(target, prop, "ngram", verify_policy=policy)
            self.block_size = self.engine.proposer.block_size
            return
        if drafter is None:
            raise EngineError(f"--mode {mode} needs a drafter (a checkpoint directory or 'random')")
        dt = target.dtype
        if drafter == "random":
            model = random_drafter(target, mode=kind, block_size=16 if block_size is None else block_size, seed=seed, dtype=dt)
            self.drafter_path = "random"
        else:
            model = load_drafter(drafter, target, dtype=dt, block_size=block_size)
            if model.cfg.bridge != (kind == "dspine"):
                raise EngineError(f"--drafter-{kind} {drafter} was trained as {model.cfg.mode}, "
                                  f"not {kind}")
            self.drafter_path, self.card = str(drafter), read_card(drafter)
            w = Path(drafter) / "model.safetensors"
            if w.is_file():  # which weights ran, beyond the path (a path's content changes with commits)
                from dspine.target.assets import sha256_file

                self.drafter_sha256 = sha256_file(w)[:16]
        self.block_size = model.cfg.block_size
        self.drafter_cfg = model.cfg
        d = SpeculativeConfig()  # the copy settings the bench does not vary: generate's defaults
        self.engine = drafter_engine(target, model, drafter, kind, proposer=proposer, verify_policy=verify_policy,
                                     tree=tree, head_kernel=head_kernel, drafter_linears=drafter_linears,
                                     draft_vocab=draft_vocab, ngram_max=d.ngram_max, ngram_min=d.ngram_min,
                                     ngram_cache_tokens=d.ngram_cache_tokens, copy_bonus=d.copy_bonus, progress=True)
        drafting = getattr(self.engine.proposer, "drafter_proposer", self.engine.proposer)
        # what ran, as generate's --json stats.kernels says it: candidate pass per row count,
        # drafter linears and forward, draft vocabulary size; and the --head-kernel setting
        self.drafter_kernels = {**drafting.kernel_info(), "head_kernel": head_kernel}

    def info(self) -> dict:
        d = {"mode": self.mode, "block_size": self.block_size, "drafter": self.drafter_path,
             "verify_policy": getattr(self, "verify_policy", "fixed"), "proposer": self.proposer,
             "draft_tree": self.engine.tree_info()}
        if getattr(self, "drafter_sha256", None):
            d["drafter_sha256"] = self.drafter_sha256  # first 16 hex digits of model.safetensors
        if self.card:
            steps = self.card.get("total_steps")
            d["drafter_steps"] = steps if steps is not None else self.card.get("steps")
        if self.mode not in ("ar", "ngram"):
            c = self.drafter_cfg
            d.update(self.drafter_kernels)
            d.update(drafter_dtype=str(next(self.engine.proposer.drafter.parameters()).dtype).replace("torch.", ""),
                     bridge=c.bridge, final_stage=c.final_stage, block_causal=c.block_causal,
                     drafter_target=c.target_name, card=self.card)
            cost = getattr(self.engine.verify_policy, "cost", None)
            if cost is not None:  # the --verify-policy cost input: measured cycle cost by n, ms
                d["policy_cycle_ms"] = [round(1000 * cost.cycle_s(n), 2) for n in range(cost.n_max + 1)]
        return d

    @torch.no_grad()
    def run(self, prompt_ids: list[int], sampling: SamplingConfig, max_new_tokens: int,
            stop: list[str], timeout_s: float) -> dict:
        eng = self.engine
        with PeakMemory(self.target.device) as mem:
            req = eng.start(list(prompt_ids), sampling, max_new_tokens, stop)
            deadline = req.t_start + timeout_s
            timed_out = False
            while not req.finished:
                if time.perf_counter() > deadline:
                    timed_out = True
                    break
                eng.step(req)
            if self.target.device.type == "cuda":
                torch.cuda.synchronize(self.target.device)
            if timed_out:
                req.t_end = time.perf_counter()
            res = eng.result(req)
        return self._row(req, res, mem, "timeout" if timed_out else res.finish_reason)

    def _row(self, req, res, mem: PeakMemory, finish: str) -> dict:
        st = res.stats
        drafted = [sum(1 for n in st.verification_lengths if n > k) for k in range(len(st.accepted_per_position))]
        accepted = [int(round(f * d)) for f, d in zip(st.accepted_per_position, drafted)]
        emitted = [c.emitted for c in req.cycles]
        cycle_s = sum(c.total_s for c in req.cycles)
        return {
            "output_ids": list(res.token_ids), "text": res.text, "finish_reason": finish,
            "prompt_tokens": st.prompt_tokens, "output_tokens": st.output_tokens,
            "ttft_s": st.ttft_s, "decode_s": st.decode_s, "e2e_s": st.total_s,
            "tokens_per_second": st.tokens_per_second,
            "cycles": st.cycles, "emitted_sum": sum(emitted), "tau": st.accepted_length_mean,
            "accepted_per_position": st.accepted_per_position, "drafted_counts": drafted,
            "accepted_counts": accepted, "verification_lengths": st.verification_lengths,
            "draft_s": st.draft_s, "final_stage_s": st.final_stage_s, "verify_s": st.verify_s,
            "cycle_s": cycle_s, "overhead_s": max(0.0, st.decode_s - st.draft_s - st.final_stage_s - st.verify_s),
            "split_measured": True,
            "peak_memory_bytes": mem.peak, "peak_memory_kind": mem.kind,
            "engine_peak_memory_bytes": st.peak_memory_bytes,
            "sources": st.sources,  # per proposer source: cycles, proposed, accepted, emitted, tau
            "tree_nodes": st.tree_nodes,  # per cycle: nodes of the verified draft tree (0: a chain)
        }

    def concurrent(self, batch_engine, prompts: list, sampling_for, timeout_s: float) -> list[dict]:
        """Closed loop over ``prompts`` with the batched engine (``--concurrency N``).

        ``prompts``: (BenchPrompt, repeat) pairs; ``sampling_for(repeat)`` gives the
        request's SamplingConfig. Rows come back in input order. Each row's
        ``prefill_stall_s`` is the time (s) its decoding waited while other requests
        were prefilled and admitted (prefill is not chunked into the cycles).
        """
        from dspine.core.engine import EngineError  # noqa: F401  (errors propagate as ValueError)

        be = batch_engine
        reqs: list = [None] * len(prompts)
        stall: dict[int, float] = {}  # id(request) -> s spent in other requests' prefills
        nxt = 0
        with PeakMemory(self.target.device) as mem:
            while nxt < len(prompts) or be.running:
                while nxt < len(prompts) and be.free_slots > 0:
                    p, rep = prompts[nxt]
                    waiting = list(be.running)  # their decode clocks run through this prefill
                    t0 = time.perf_counter()
                    reqs[nxt] = be.add(list(p.prompt_ids), sampling_for(rep), p.max_new_tokens, p.stop)
                    dt = time.perf_counter() - t0
                    for r in waiting:
                        stall[id(r)] = stall.get(id(r), 0.0) + dt
                    nxt += 1
                now = time.perf_counter()
                for r in list(be.running):
                    if now - r.t_start > timeout_s:
                        be.remove(r, reason="timeout")
                if be.running:
                    be.step()
        rows = []
        for r in reqs:
            res = self.engine.result(r)
            rows.append(self._row(r, res, mem, r.finish_reason or res.finish_reason))
            rows[-1]["prefill_stall_s"] = min(stall.get(id(r), 0.0), rows[-1]["overhead_s"])
            if r.error:  # this request's own part of a cycle failed (finish_reason "error")
                rows[-1]["error"] = r.error
        return rows


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


def make_runner(target, mode: str, drafters: dict, block_size: int | None, seed: int,
                pld_tokens: int, verify_policy: str = "fixed", proposer: str = "drafter", tree=None,
                drafter_linears: str = "auto", draft_vocab: str = "auto", head_kernel: str = "auto") -> Runner:
    """The runner of ``mode`` over ``target`` (drafters: mode -> path | 'random';
    ``proposer``: what the drafter modes propose with, :data:`dspine.proposers.PROPOSERS`;
    ``tree``: the drafter modes' :class:`dspine.trees.TreeSpec`; ``drafter_linears`` /
    ``draft_vocab`` / ``head_kernel``: how their drafter runs, as in :class:`EngineRunner`)."""
    if mode in FIXED_MODES:
        f = FIXED_MODES[mode]
        r = EngineRunner(target, mode, drafters.get(f["drafter"]), block_size, seed, proposer=f["proposer"],
                         verify_policy=f["verify_policy"], tree=None, drafter_linears=drafter_linears,
                         draft_vocab=draft_vocab, head_kernel=head_kernel)
        r.verify_policy = f["verify_policy"]
        return r
    if mode in ENGINE_MODES:
        r = EngineRunner(target, mode, drafters.get(mode), block_size, seed, proposer=proposer,
                         verify_policy=verify_policy if mode != "ar" else "fixed",
                         tree=tree if mode not in ("ar", "ngram") else None, drafter_linears=drafter_linears,
                         draft_vocab=draft_vocab, head_kernel=head_kernel)
        r.verify_policy = verify_policy if mode != "ar" else "fixed"
        return r
    if mode in HF_MODES:
        return HFRunner(target, mode, pld_tokens)
    raise ValueError(f"--modes: {mode!r} is unknown; accepted: {', '.join(ALL_MODES)}")
