"""Scheduler: one background thread owns the :class:`BatchEngine`.

Each iteration: drop cancelled requests (their KV and draft context are freed),
admit waiting requests into free slots (prefill + first token), run one batched
cycle for all running requests, and push text deltas to the waiting HTTP handlers
(thread-safe hand-off into their asyncio loop). Waiting requests beyond
``max_queue`` are refused (:class:`QueueFull`, HTTP 429).
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import time
import traceback
from collections import deque
from dataclasses import dataclass, field

from dspine.core.batch import BatchEngine
from dspine.config import SamplingConfig
from dspine.core.engine import EngineError
from dspine.core.request import Request
from dspine.serve.metrics import Metrics

log = logging.getLogger("dspine.serve")


class QueueFull(Exception):
    """The waiting queue is at ``max_queue``."""


class ShuttingDown(Exception):
    """The server is stopping and takes no new requests."""


@dataclass
class Event:
    """What a handler receives: ``delta`` (text, tokens so far), ``done`` or ``error``."""

    kind: str
    text: str = ""
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    status: int = 0
    message: str = ""
    token_ids: list[int] | None = None  # delta: ids emitted so far (all, EOS/stop included)


_ids = itertools.count(1)


@dataclass
class Job:
    """One HTTP generation request, from submission to its last event."""

    prompt_ids: list[int]
    sampling: SamplingConfig
    max_tokens: int
    stop: list[str]
    loop: asyncio.AbstractEventLoop
    endpoint: str = "completions"
    tenant: str | None = None  # its part of a cross-request output cache (app.tenant_of)
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    id: int = field(default_factory=lambda: next(_ids))
    cancelled: bool = False
    finished: bool = False
    req: Request | None = None
    shown: int = 0
    t_submit: float = field(default_factory=time.perf_counter)
    t_first: float = 0.0

    def push(self, ev: Event) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, ev)
        except RuntimeError:  # the handler's loop is closed (server stopping)
            pass


class Scheduler:
    """Continuous batching loop (see module docstring).

    Args:
        batch: the engine (owned by the scheduler thread from :meth:`start` on).
        max_queue: waiting requests at most (0: none wait; beyond -> QueueFull).
        metrics: where counters go.
    """

    def __init__(self, batch: BatchEngine, max_queue: int = 64, metrics: Metrics | None = None):
        if max_queue < 0:
            raise ValueError(f"--max-queue must be >= 0, got {max_queue}")
        self.batch, self.max_queue = batch, max_queue
        self.metrics = metrics or Metrics()
        self.tok = batch.target.tokenizer
        self._cv = threading.Condition()
        self._waiting: deque[Job] = deque()
        self._jobs: dict[int, Job] = {}  # id(req) -> job, running
        self._admitting = 0  # popped from the queue, prefill not yet done (hold a slot)
        self._stop = False
        self._closed = False
        self._thread: threading.Thread | None = None
        self.cycles = 0
        self._snapshot = self._counters()
        self._publish()

    # -- public (any thread) -------------------------------------------------------------
    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="dspine-scheduler", daemon=True)
        self._thread.start()

    def submit(self, job: Job) -> None:
        """Queue a job. Raises QueueFull or ShuttingDown."""
        with self._cv:
            if self._closed:
                raise ShuttingDown("the server is shutting down")
            beyond = len(self._waiting) - max(0, self._free_slots_locked())  # would wait, not run
            if beyond >= self.max_queue:
                raise QueueFull(f"server busy: {self.batch.max_running} requests running and "
                                f"{len(self._waiting)} waiting (--max-queue {self.max_queue})")
            self._waiting.append(job)
            self.metrics.queue_depth.set(len(self._waiting))
            self._cv.notify_all()

    def cancel(self, job: Job) -> None:
        """Ask for the job's state to be freed at the next cycle (idempotent)."""
        if job.finished:
            return
        with self._cv:
            job.cancelled = True
            self._cv.notify_all()

    def counters(self) -> dict:
        """Snapshot published by the scheduler thread after each iteration."""
        with self._cv:
            return dict(self._snapshot)

    def close(self) -> None:
        """Stop taking new requests (they get ShuttingDown); running ones continue."""
        with self._cv:
            self._closed = True

    def stop(self, timeout: float = 30.0) -> None:
        """Cancel everything still waiting or running, free its state, end the thread."""
        with self._cv:
            self._closed = True
            self._stop = True
            self._cv.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)

    def idle(self) -> bool:
        c = self.counters()
        return c["running"] == 0 and c["queued"] == 0

    # -- internals -----------------------------------------------------------------------
    def _free_slots_locked(self) -> int:
        return self.batch.max_running - len(self._jobs) - self._admitting

    def _counters(self) -> dict:
        b = self.batch
        tk, dk = b.target_kv_bytes(), b.draft_kv_bytes()
        return {"running": len(b.running), "queued": len(self._waiting), "free_slots": b.free_slots,
                "max_running": b.max_running, "max_queue": self.max_queue, "target_kv_bytes": tk,
                "draft_kv_bytes": dk, "cache_bytes": tk + dk, "cycles": self.cycles}

    def _publish(self) -> None:
        snap = self._counters()
        with self._cv:
            snap["queued"] = len(self._waiting)
            self._snapshot = snap
        m = self.metrics
        m.queue_depth.set(snap["queued"])
        m.running.set(snap["running"])
        m.free_slots.set(snap["free_slots"])
        m.cache_bytes.labels("target_kv").set(snap["target_kv_bytes"])
        m.cache_bytes.labels("draft_kv").set(snap["draft_kv_bytes"])

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._stop and not self._waiting and not self._jobs:
                    self._cv.wait(0.5)
                if self._stop:
                    break
                gone = [j for j in self._waiting if j.cancelled]  # free their queue places now
                for j in gone:
                    self._waiting.remove(j)
                admit = []
                free = self._free_slots_locked()
                while self._waiting and len(admit) < free:
                    admit.append(self._waiting.popleft())
                self._admitting = len(admit)
            for j in gone:
                self._finish(j, cancelled=True)
            try:
                self._iteration(admit)
            except Exception as e:  # never leave a handler hanging
                log.error("scheduler iteration failed: %s\n%s", e, traceback.format_exc())
                self._fail_all(f"internal error: {type(e).__name__}: {e}")
                with self._cv:
                    self._admitting = 0
            self._publish()
        self._shutdown_jobs()
        self._publish()

    def _admit(self, job: Job) -> None:
        """Prefill one admitted job and deliver its first token (or its error)."""
        if job.cancelled:
            self._finish(job, cancelled=True)
            return
        try:
            req = self.batch.add(job.prompt_ids, job.sampling, job.max_tokens, job.stop, tenant=job.tenant)
        except EngineError as e:
            self._error(job, 400, str(e))
            return
        except Exception as e:  # noqa: BLE001 (prefill failure: this request only)
            log.error("prefill failed: %s\n%s", e, traceback.format_exc())
            self._error(job, 500, f"internal error during prefill: {type(e).__name__}: {e}")
            return
        job.req = req
        job.t_first = time.perf_counter()
        self.metrics.ttft.observe(job.t_first - job.t_submit)
        self.metrics.prompt_tokens.inc(len(job.prompt_ids))
        self.metrics.generation_tokens.inc(len(req.out_ids))
        if req.finished:
            self._deliver(job)
            self._finish(job)
        else:
            with self._cv:
                self._jobs[id(req)] = job
            self._deliver(job)

    def _iteration(self, admit: list[Job]) -> None:
        b = self.batch
        # 1. cancellations free their state before anything else runs
        for job in [j for j in self._jobs.values() if j.cancelled]:
            self._finish(job, cancelled=True)
        # 2. admissions (prefill + first token); each admitted job holds its slot through
        #    ``_admitting`` until it is running or finished (submit() counts it)
        for job in admit:
            try:
                self._admit(job)
            finally:
                with self._cv:
                    self._admitting -= 1
        # 3. one batched cycle
        if not b.running:
            return
        running = list(b.running)
        emitted = b.step()
        self.cycles += 1
        c = b.last_cycle
        m = self.metrics
        if c is not None:
            m.cycle.labels("draft").observe(c.draft_s)
            m.cycle.labels("final").observe(c.final_s)
            m.cycle.labels("verify").observe(c.verify_s)
            m.cycle.labels("total").observe(c.total_s)
            m.batch_size.observe(c.batch)
        for req in running:
            job = self._jobs.get(id(req))
            if req.cycles:
                m.acceptance.observe(req.cycles[-1].emitted)
            m.generation_tokens.inc(len(emitted.get(id(req), [])))
            if job is None:
                continue
            if req.finish_reason == "error":  # this request's own part of the cycle failed
                log.error("request failed in a cycle: %s", req.error)
                self._error(job, 500, f"internal error: {req.error}")
                continue
            self._deliver(job)
            if req.finished:
                self._finish(job)

    def _deliver(self, job: Job) -> None:
        """Push the newly final text of the job (held back while a stop could still match)."""
        req = job.req
        text = self.batch.engine.text_of(req)
        if req.finished:
            safe = len(text)
        else:
            hold = max((len(s) for s in req.stop), default=1) - 1
            safe = max(job.shown, len(text) - hold)
            while safe > job.shown and text[safe - 1] == "\ufffd":
                safe -= 1
        if safe > job.shown:
            job.push(Event("delta", text[job.shown:safe], completion_tokens=len(req.out_ids),
                           token_ids=list(req.out_ids)))
            job.shown = safe

    def _finish(self, job: Job, cancelled: bool = False) -> None:
        req = job.req
        if req is not None:
            self._jobs.pop(id(req), None)
            if not req.finished or cancelled:
                self.batch.remove(req, "cancelled")
        job.finished = True
        outcome = "cancelled" if cancelled else "completed"
        self.metrics.requests.labels(job.endpoint, outcome).inc()
        self.metrics.latency.observe(time.perf_counter() - job.t_submit)
        job.push(Event("done", finish_reason="cancelled" if cancelled else (req.finish_reason or "length"),
                       prompt_tokens=len(job.prompt_ids),
                       completion_tokens=len(req.out_ids) if req is not None else 0,
                       token_ids=list(req.out_ids) if req is not None else []))

    def _error(self, job: Job, status: int, message: str) -> None:
        if job.req is not None:
            self._jobs.pop(id(job.req), None)
            self.batch.remove(job.req, "error")
        job.finished = True
        self.metrics.requests.labels(job.endpoint, "error").inc()
        job.push(Event("error", status=status, message=message))

    def _fail_all(self, message: str) -> None:
        for job in list(self._jobs.values()):
            self._error(job, 500, message)
        for req in list(self.batch.running):  # anything left without a job
            self.batch.remove(req, "error")

    def _shutdown_jobs(self) -> None:
        with self._cv:
            waiting = list(self._waiting)
            self._waiting.clear()
        for job in waiting + list(self._jobs.values()):
            self._error(job, 503, "the server is shutting down; the request was cancelled")
