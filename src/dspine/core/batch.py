"""Batched speculative decoding over many requests (continuous batching).

:class:`BatchEngine` wraps an :class:`~dspine.core.engine.Engine` and advances every
running request by one cycle per :meth:`BatchEngine.step`: the engine's own cycle
(:mod:`dspine.core.cycle`), run over the rows of one ragged slot cache
(:class:`dspine.core.kv.SlotKV`, :class:`dspine.core.forward.SharedRowsPass`), so all
requests are verified in **one** target forward although their accepted lengths are
ragged. On the lean decode path (a dense-runtime target on the blockq kernels) that
forward packs every request's own inputs without padding (:mod:`dspine.core.batch_lean`)
and a request may verify a **draft tree**; off it, chains.

Prefill stays per request (:meth:`Engine.start`, batch 1) and its KV is then copied
into a free row. Targets whose cache is not plain full attention (sliding windows,
linear-attention hybrids) or whose attention kernel takes no 4-D mask (only ``sdpa``
and ``eager`` do) run each request's cycle over its own cache (:meth:`Engine.step`;
same scheduler, same results, no shared forward).

Exactness: every request sees the same positions, the same committed K/V and the
same sampler/verifier draws (its own ``torch.Generator``) as in a single-request
run; only float reduction order differs, so float32 greedy outputs are
token-identical to single-request runs (tested).
"""
from __future__ import annotations

import time

from dspine.config import SamplingConfig
from dspine.control.batch_policy import BatchCostPolicy
from dspine.core.cycle import Cycle, fail
from dspine.core.engine import Engine, EngineError
from dspine.core.forward import SharedRowsPass
from dspine.core.kv import RowCache, SlotKV
from dspine.core.request import BatchCycle, GenerationResult, Request

MAX_RUNNING_VALIDATED = 8  # spec section 8: at most 8 concurrent requests


class BatchEngine:
    """Continuous-batching front of an :class:`Engine` (see module docstring).

    Args:
        engine: the single-request engine (target, proposer, mode, verify policy; a
            ``cost`` policy chooses one n per batched cycle, :mod:`dspine.control.batch_policy`).
        max_running: running requests at most (1..8; the validated limit is 8).
        batch_draft: run the drafter once for all requests (padded context K/V) instead
            of once per request; proposals are the same up to float rounding.
    Raises:
        EngineError: ``max_running`` outside 1..8 (naming it).
    """

    def __init__(self, engine: Engine, max_running: int = MAX_RUNNING_VALIDATED, batch_draft: bool = True):
        if not 1 <= int(max_running) <= MAX_RUNNING_VALIDATED:
            raise EngineError(f"max_running {max_running} is outside the validated range "
                              f"1..{MAX_RUNNING_VALIDATED} (spec section 8: at most "
                              f"{MAX_RUNNING_VALIDATED} concurrent requests)")
        self.engine = engine
        self.target = engine.target
        self.max_running = int(max_running)
        self.batch_draft = batch_draft
        self.running: list[Request] = []  # row i of the KV <-> running[i] (batched path)
        self.kv = SlotKV(self.target.num_layers, self.max_running)
        self.batched: bool | None = None  # decided at the first prefill
        self.last_cycle: BatchCycle | None = None
        self.batch_policy: BatchCostPolicy | None = None  # see _batch_policy
        # the engine's cycle over the slot cache's rows: one forward, one n priced at the
        # batch size, failures isolated per request
        rows = SharedRowsPass(self.target, self.kv, engine.feature_layers, engine.max_positions - 1)
        self.cycle = Cycle(engine, rows, pricing=self._batch_policy, batch_draft=batch_draft, isolate=True)

    # -- counters ------------------------------------------------------------------------
    @property
    def free_slots(self) -> int:
        return self.max_running - len(self.running)

    def target_kv_bytes(self) -> int:
        """Bytes of target KV held (batched buffers + any per-request caches)."""
        return self.kv.nbytes() + sum(r.cache.nbytes() for r in self.running)

    def draft_kv_bytes(self) -> int:
        """Bytes of drafter context K/V held by running requests."""
        prop = self.engine.proposer
        return sum(prop.state_nbytes(r.draft_state) for r in self.running if r.draft_state is not None)

    def cache_bytes(self) -> int:
        return self.target_kv_bytes() + self.draft_kv_bytes()

    # -- lifecycle -----------------------------------------------------------------------
    def add(self, prompt_ids: list[int], sampling: SamplingConfig | None = None,
            max_new_tokens: int = 128, stop: list[str] | None = None, tenant: str | None = None) -> Request:
        """Prefill a request, emit its first token and let it join the batch (``tenant``:
        its part of a cross-request output cache, :meth:`Engine.start`).

        A request finished by its first token (EOS, stop, max_new_tokens 1) is returned
        without joining. Raises EngineError (invalid request) or RuntimeError (no slot).
        """
        if self.free_slots <= 0:
            raise RuntimeError(f"all {self.max_running} slots are running")
        req = self.engine.start(prompt_ids, sampling, max_new_tokens, stop, tenant=tenant)
        rows = req.cache.kv_rows()
        if self.batched is None:
            self.batched = rows is not None and len(rows) == self.target.num_layers \
                and self.cycle.target_pass.attn in ("sdpa", "eager")
        if req.finished:
            self._release(req)
            return req
        if self.batched:
            self.kv.add_row(rows, req.cache.length)
            req.cache = RowCache(req.cache.length)
        self.running.append(req)
        return req

    def _release(self, req: Request) -> None:
        req.cache = RowCache(req.cache.length)
        req.draft_state = None

    def remove(self, req: Request, reason: str | None = None) -> None:
        """Take ``req`` out of the batch and free its KV (target and drafter).

        ``reason`` (e.g. ``"cancelled"``) marks an unfinished request finished.
        """
        i = next((k for k, r in enumerate(self.running) if r is req), None)
        if i is None:
            return
        if self.batched:
            moved = self.kv.remove_row(i)
            if moved is not None:
                self.running[i] = self.running[moved]
            self.running.pop()
        else:
            self.running.pop(i)
        if not req.finished:
            req.finished, req.finish_reason = True, reason or "cancelled"
            req.t_end = time.perf_counter()
        self._release(req)

    def step(self) -> dict[int, list[int]]:
        """One cycle for every running request. Returns ``{id(req): emitted ids}``.

        Finished requests leave the batch (their KV is freed); their :class:`Request`
        keeps ids, text and statistics (use :meth:`Engine.result`). A request whose own
        part of the cycle raised finishes with ``finish_reason == "error"`` and
        ``req.error`` set; the other requests are unaffected
        (:func:`dspine.core.cycle.fail`).
        Raises whatever the shared drafter or target forward raises.
        """
        if not self.running:
            return {}
        t0 = time.perf_counter()
        if not self.batched:
            out, ok = {}, []
            for r in list(self.running):
                try:
                    out[id(r)] = self.engine.step(r)
                    ok.append(r)
                except Exception as e:  # noqa: BLE001 (this request only; see dspine.core.cycle.fail)
                    fail(r, e)
                    out[id(r)] = []
            c = [r.cycles[-1] for r in ok if r.cycles]  # a failed request ran no cycle this step
            self.last_cycle = BatchCycle(len(self.running), sum(x.draft_s for x in c),
                                         sum(x.final_s for x in c), sum(x.verify_s for x in c),
                                         time.perf_counter() - t0, sum(len(v) for v in out.values()))
        else:
            out = self.cycle.run(list(self.running))
            self.last_cycle = self.cycle.last
        for r in [r for r in self.running if r.finished]:
            self.remove(r)
        return out

    def _batch_policy(self) -> BatchCostPolicy | None:
        """The batch-level pricing of the engine's controller
        (:meth:`dspine.control.base.Controller.batch_pricing`: the current controller's, so a
        replaced controller is followed), or None (per-request choices)."""
        self.batch_policy = self.engine.verify_policy.batch_pricing(self.max_running)
        return self.batch_policy

    # -- convenience ---------------------------------------------------------------------
    def generate_many(self, prompts: list[list[int]], sampling: list[SamplingConfig] | SamplingConfig | None = None,
                      max_new_tokens: list[int] | int = 128, stop: list[list[str] | None] | None = None
                      ) -> list[GenerationResult]:
        """Run all prompts to completion with continuous batching (admission in order)."""
        k = len(prompts)
        samp = sampling if isinstance(sampling, list) else [sampling] * k
        mnt = max_new_tokens if isinstance(max_new_tokens, list) else [max_new_tokens] * k
        stops = stop if stop is not None else [None] * k
        reqs: list[Request | None] = [None] * k
        nxt = 0
        while nxt < k or self.running:
            while nxt < k and self.free_slots > 0:
                reqs[nxt] = self.add(prompts[nxt], samp[nxt], mnt[nxt], stops[nxt])
                nxt += 1
            self.step()
        return [self.engine.result(r) for r in reqs]
