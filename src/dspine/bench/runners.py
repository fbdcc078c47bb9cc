"""The engine runner of the benchmark and the runner of each mode, all over the *same* loaded target.

* :class:`EngineRunner`: ``ar``, ``dflash``, ``dspine``, ``ngram`` (copies alone) and
  ``dspine-drafter`` (the DSpine drafter alone: no copies, single chains, whole blocks
  verified) through :class:`dspine.core.engine.Engine` (the same loop, sampler and stop logic;
  only the proposer differs).
* :func:`make_runner`: the runner of a mode (:mod:`dspine.bench.modes`): an
  :class:`EngineRunner`, or a :class:`dspine.bench.hf_runner.HFRunner` for the transformers
  peers ``hf`` and ``hf-pld``.

A runner reports its :meth:`identity` (target, weights fingerprint, dtype, device,
threads) and the decoding settings it actually passes (:class:`dspine.bench.runner_base.Runner`);
:func:`dspine.bench.fairness.check_fair` compares them across modes. :meth:`run` returns
one flat dict of measurements.
"""
from __future__ import annotations

import time
from pathlib import Path

import torch

from dspine.bench.hf_runner import HFRunner
from dspine.bench.modes import ALL_MODES, ENGINE_MODES, FIXED_MODES, HF_MODES, drafter_kind
from dspine.bench.peak_memory import PeakMemory
from dspine.bench.runner_base import Runner
from dspine.config import SamplingConfig


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
        from dspine.tune.controller import make_policy
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
                                     ngram_cache_tokens=d.ngram_cache_tokens, copy_bonus=d.copy_bonus, progress=True,
                                     ngram_prior=d.ngram_prior, ngram_prior_weight=d.ngram_prior_weight)
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
