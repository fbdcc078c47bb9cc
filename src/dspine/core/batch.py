"""Batched speculative decoding over many requests (continuous batching).

:class:`BatchEngine` wraps an :class:`~dspine.core.engine.Engine` and advances every
running request by one draft -> verify -> commit cycle per :meth:`BatchEngine.step`,
verifying all of them in **one** target forward although their accepted lengths are
ragged.

Ragged target KV (:class:`SlotKV`): one pre-allocated buffer per target layer,
``[rows, kv_heads, cap, head_dim]``. Row ``i`` holds request ``i``'s committed
positions left-aligned in columns ``0 .. L_i-1``, so *column == absolute position*,
exactly the layout of a single-request cache. A verification writes the padded
block ``[anchor, y_1..y_n, pad..]`` (width ``N = max n_i + 1``) of row ``i`` into
columns ``L_i .. L_i+N-1`` (per-row offsets, in place), with explicit position ids
``L_i + j`` and a 4-D mask ``column <= L_i + j`` per row and query: a query sees its
row's committed prefix and the block up to itself, never a stale column. Commit is
``L_i += accepted + 1``; rejected and pad columns are simply overwritten by the next
cycle, so there are no holes and nothing to compact. Rows of running requests are
kept contiguous (``0 .. b-1``, a leaving row is replaced by the last one), so the
forward reads views of the buffers, not copies. Buffers grow by doubling and are
freed when the batch empties.

On the lean decode path (a dense-runtime target on the blockq kernels) the forward is
instead every request's own inputs packed without padding (:mod:`dspine.core.batch_lean`), and
a request may verify a **draft tree** (the engine's tree budget): its nodes
write columns ``L_i + 1..``, sit at their depths and see their ancestors; after
verification the accepted path's K/V move to consecutive columns
(:meth:`SlotKV.keep_rows`). Off the lean path a tree budget drafts chains.

Prefill stays per request (:meth:`Engine.start`, batch 1) and its KV is then copied
into a free row. Targets whose cache is not plain full attention (sliding windows,
linear-attention hybrids) or whose attention kernel takes no 4-D mask (only ``sdpa``
and ``eager`` do) fall back to per-request :meth:`Engine.step` cycles (same
scheduler, same results, no batched forward).

Exactness: every request sees the same positions, the same committed K/V and the
same sampler/verifier draws (its own ``torch.Generator``) as in a single-request
run; only float reduction order differs, so float32 greedy outputs are
token-identical to single-request runs (tested).
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from dspine.core.batch_lean import Inputs, lean_forward
from dspine.control.batch_policy import BatchCostPolicy, batch_controller
from dspine.config import SamplingConfig
from dspine.core.engine import CycleRecord, Engine, EngineError, GenerationResult, Request, _observe
from dspine.proposers.base import Proposal
from dspine.core.sampling import sample_token
from dspine.trees.verify import verify_tree
from dspine.core.verify import Verdict, verify

MAX_RUNNING_VALIDATED = 8  # spec section 8: at most 8 concurrent requests


class _SlotLayer:
    """One target layer's view of :class:`SlotKV` (the transformers cache-layer protocol)."""

    is_sliding = False
    is_compileable = False
    is_croppable = False
    is_initialized = True

    def __init__(self, owner: "SlotKV", idx: int):
        self.owner, self.idx = owner, idx

    @property
    def keys(self):
        return self.owner.k[self.idx]

    @property
    def values(self):
        return self.owner.v[self.idx]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Write new K/V [b, kv, N, hd] at per-row columns; return views [b, kv, K, hd]."""
        o = self.owner
        b, kv, n, hd = key_states.shape
        idx = o._cols[:, None, :, None].expand(b, kv, n, hd)
        k, v = o.k[self.idx], o.v[self.idx]
        k[:b].scatter_(2, idx, key_states.to(k.dtype))
        v[:b].scatter_(2, idx, value_states.to(v.dtype))
        return k[:b, :, : o._kv_len], v[:b, :, : o._kv_len]

    def get_seq_length(self) -> int:
        return self.owner._kv_len

    def get_mask_sizes(self, query_length: int):
        return self.owner._kv_len, 0

    def get_max_length(self) -> int:
        return -1


def _make_cache_class():
    from transformers.cache_utils import Cache

    class _SlotCache(Cache):
        """transformers Cache facade over :class:`SlotKV` for one batched forward."""

        def __init__(self, owner: "SlotKV"):
            super().__init__(layers=[_SlotLayer(owner, l) for l in range(owner.num_layers)])
            self.owner = owner

        def get_seq_length(self, layer_idx: int = 0) -> int:
            return self.owner._kv_len

        def get_mask_sizes(self, query_length: int, layer_idx: int = 0):
            return self.owner._kv_len, 0

    return _SlotCache


class SlotKV:
    """Ragged batched target KV cache: rows of left-aligned committed positions.

    Attributes:
        lengths: committed positions per active row (row i belongs to ``rows[i]``).
    """

    def __init__(self, num_layers: int, max_rows: int):
        self.num_layers, self.max_rows = num_layers, max_rows
        self.k: list[torch.Tensor] = []
        self.v: list[torch.Tensor] = []
        self.lengths: list[int] = []
        self._cols: torch.Tensor | None = None
        self._kv_len = 0
        self._cache = None

    @property
    def rows(self) -> int:
        return len(self.lengths)

    @property
    def capacity(self) -> int:
        return self.k[0].shape[2] if self.k else 0

    def nbytes(self) -> int:
        """Bytes allocated by the K/V buffers."""
        return sum(t.numel() * t.element_size() for t in self.k + self.v)

    def used_bytes(self) -> int:
        """Bytes of committed positions (what the running requests hold)."""
        if not self.k:
            return 0
        per_pos = sum(t[0, :, 0].numel() * t.element_size() for t in self.k + self.v)
        return per_pos * sum(self.lengths)

    def _ensure(self, cap: int, like: list[tuple[torch.Tensor, torch.Tensor]] | None = None) -> None:
        """Grow the column capacity to >= cap (doubling; allocates from ``like`` shapes)."""
        have = self.capacity
        if self.k and cap <= have:
            return
        new = max(cap, 2 * have, 64)
        if not self.k:
            assert like is not None
            for kk, vv in like:
                _, kvh, _, hd = kk.shape
                self.k.append(kk.new_zeros(self.max_rows, kvh, new, hd))
                self.v.append(vv.new_zeros(self.max_rows, vv.shape[1], new, vv.shape[-1]))
            return
        for lst in (self.k, self.v):
            for l, t in enumerate(lst):
                nt = t.new_zeros(t.shape[0], t.shape[1], new, t.shape[3])
                nt[:, :, :have] = t
                lst[l] = nt

    def add_row(self, kv: list[tuple[torch.Tensor, torch.Tensor]], length: int) -> int:
        """Copy one request's K/V (per layer [1, kv, >=length, hd]) into a new row."""
        if self.rows >= self.max_rows:
            raise RuntimeError("no free KV row")
        self._ensure(length + 1, kv)
        r = self.rows
        for l, (kk, vv) in enumerate(kv):
            self.k[l][r, :, :length] = kk[0, :, :length]
            self.v[l][r, :, :length] = vv[0, :, :length]
        self.lengths.append(length)
        return r

    def remove_row(self, r: int) -> int | None:
        """Drop row r; the last row moves into r. Returns the moved row's old index or None."""
        last = self.rows - 1
        moved = None
        if r != last:
            n = self.lengths[last]
            for lst in (self.k, self.v):
                for t in lst:
                    t[r, :, :n] = t[last, :, :n]
            self.lengths[r] = n
            moved = last
        self.lengths.pop()
        if not self.lengths:  # empty batch: give the memory back
            self.k, self.v, self._cache = [], [], None
        return moved

    def keep_rows(self, r: int, start: int, rows: list[int]) -> None:
        """After a draft tree's forward into row ``r`` from column ``start``: move the K/V of
        its inputs ``rows`` (increasing, the anchor's 0 first: the accepted path) to columns
        ``start, start + 1, ...`` of every layer and set the row's length past them."""
        idx = torch.tensor(rows, dtype=torch.long, device=self.k[0].device) + start
        for lst in (self.k, self.v):
            for t in lst:
                t[r, :, start:start + len(rows)] = t[r, :, idx]  # the index copies first
        self.lengths[r] = start + len(rows)

    def prepare(self, width: int, max_position: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Set up a forward of ``width`` new columns per row.

        Returns (position_ids [b, width], allowed [b, 1, width, K] bool) where
        ``allowed[i, 0, j, c] = c <= L_i + j``. Column ``L_i + j`` holds position
        ``L_i + j``; only pad slots (never seen by a real query) can have their position
        id clamped to ``max_position``.
        """
        L = torch.tensor(self.lengths, dtype=torch.long)
        dev = self.k[0].device
        cols_new = (L[:, None] + torch.arange(width)[None]).to(dev)  # [b, width]
        kv_len = max(self.lengths) + width
        self._ensure(kv_len)
        self._cols, self._kv_len = cols_new, kv_len
        cols = torch.arange(kv_len, device=dev)
        allowed = cols[None, None, None, :] <= cols_new[:, None, :, None]  # [b, 1, width, K]
        if self._cache is None:
            self._cache = _make_cache_class()(self)
        pos = cols_new if max_position is None else cols_new.clamp_max(max_position)
        return pos, allowed


class _RowCache:
    """Stand-in for a request's :class:`TargetCache` once its KV lives in a :class:`SlotKV` row."""

    def __init__(self, length: int):
        self.length = length

    def seq_length(self) -> int:
        return self.length

    def nbytes(self) -> int:
        return 0


@dataclass
class BatchCycle:
    """One batched cycle: requests advanced, times (s) summed over requests for draft/final."""

    batch: int
    draft_s: float
    final_s: float
    verify_s: float
    total_s: float
    emitted: int


def _inputs(anchor: int, p: Proposal) -> Inputs:
    """The forward's inputs of one request: the anchor, then its chain or flattened tree."""
    a = torch.tensor([int(anchor)], dtype=torch.long)
    if p.tree is None:
        return Inputs(torch.cat([a, p.tokens.reshape(-1).long().cpu()]))
    return Inputs(torch.cat([a, p.tree.tokens.long().cpu()]), p.tree.positions(), p.tree.attention_mask())


class BatchEngine:
    """Continuous-batching front of an :class:`Engine` (see module docstring).

    Args:
        engine: the single-request engine (target, proposer, mode, verify policy; a
            ``cost`` policy chooses one n per batched cycle, :mod:`dspine.control.batch_policy`).
        max_running: running requests at most (1..8; the validated limit is 8).
        batch_draft: run the drafter once for all requests (padded context K/V) instead
            of once per request; proposals are the same up to float rounding.
    Raises:
        EngineError: ``max_running`` outside 1..8 (names ``--max-running``).
    """

    def __init__(self, engine: Engine, max_running: int = MAX_RUNNING_VALIDATED, batch_draft: bool = True):
        if not 1 <= int(max_running) <= MAX_RUNNING_VALIDATED:
            raise EngineError(f"--max-running {max_running} is outside the validated range "
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
        cfg = self.target.model.config
        self._attn = getattr(cfg, "_attn_implementation", "sdpa") or "sdpa"

    # -- counters ------------------------------------------------------------------------
    @property
    def free_slots(self) -> int:
        return self.max_running - len(self.running)

    def target_kv_bytes(self) -> int:
        """Bytes of target KV held (batched buffers + any per-request caches)."""
        return self.kv.nbytes() + sum(r.cache.nbytes() for r in self.running)

    def draft_kv_bytes(self) -> int:
        """Bytes of drafter context K/V held by running requests."""
        return sum(int(getattr(r.draft_state, "nbytes", lambda: 0)()) for r in self.running
                   if r.draft_state is not None)

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
                and self._attn in ("sdpa", "eager")
        if req.finished:
            self._release(req)
            return req
        if self.batched:
            self.kv.add_row(rows, req.cache.length)
            req.cache = _RowCache(req.cache.length)
        self.running.append(req)
        return req

    def _release(self, req: Request) -> None:
        req.cache = _RowCache(req.cache.length)
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
        ``req.error`` set; the other requests are unaffected (see :meth:`_fail`).
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
                except Exception as e:  # noqa: BLE001 (this request only; see _fail)
                    out[id(r)] = self._fail(r, e)
            c = [r.cycles[-1] for r in ok if r.cycles]  # a failed request ran no cycle this step
            self.last_cycle = BatchCycle(len(self.running), sum(x.draft_s for x in c),
                                         sum(x.final_s for x in c), sum(x.verify_s for x in c),
                                         time.perf_counter() - t0, sum(len(v) for v in out.values()))
        else:
            out = self._batched_step(t0)
        for r in [r for r in self.running if r.finished]:
            self.remove(r)
        return out

    @staticmethod
    def _fail(req: Request, e: Exception) -> list[int]:
        """Mark ``req`` finished with ``finish_reason == "error"`` (``req.error`` says why).

        Called when the per-request part of a cycle (verification, sampling, a
        single-request step) raised: that request leaves the batch at the end of the
        step, the others go on unchanged. A failure of the shared target forward still
        raises out of :meth:`step` (it cannot be attributed to one request).
        """
        req.finished, req.finish_reason = True, "error"
        req.error = f"{type(e).__name__}: {e}"
        req.t_end = time.perf_counter()
        return []

    @torch.no_grad()
    def _batched_step(self, t0: float) -> dict[int, list[int]]:
        eng, reqs = self.engine, list(self.running)
        bpol = self._batch_policy()
        if bpol is None:
            ns0 = [eng._verification_length(r) for r in reqs]
        else:  # one n for the shared forward, priced at this batch size
            ns0 = bpol.choose(reqs, [eng.plan(r) for r in reqs])
        props = self._propose(reqs, ns0)
        draft_s = sum(p.draft_s for p in props)
        final_s = sum(p.final_s for p in props)
        t1 = time.perf_counter()
        inputs = [_inputs(req.anchor, p) for req, p in zip(reqs, props)]
        ns = [len(q) - 1 for q in inputs]  # a tree: its nodes; the forward's rows are ns + 1
        width = max(ns) + 1
        starts = list(self.kv.lengths)
        fl = eng.feature_layers
        lean = self._lean_plan()
        if lean is not None:  # every request's own inputs in C++ calls without padding (trees too)
            logits, feats = self._lean_forward(lean, inputs, starts, fl)
        else:  # chains only (_propose builds trees only for the lean path)
            ids = torch.zeros(len(reqs), width, dtype=torch.long)
            for i, q in enumerate(inputs):
                ids[i, :len(q)] = q.tokens
            pos, allowed = self.kv.prepare(width, eng.max_positions - 1)
            if self._attn == "sdpa":
                mask = allowed
            else:  # eager & co. add the mask to the scores
                mask = torch.zeros(allowed.shape, dtype=self.target.dtype, device=allowed.device)
                mask.masked_fill_(~allowed, torch.finfo(self.target.dtype).min)
            res = self.target.model(input_ids=ids.to(self.target.device), attention_mask=mask, position_ids=pos,
                                    past_key_values=self.kv._cache, use_cache=True,
                                    output_hidden_states=fl is not None)
            lg = res.logits.float()  # [b, width, V]
            logits = [lg[i, :n + 1] for i, n in enumerate(ns)]
            feats = None
            if fl is not None:
                f = torch.cat([res.hidden_states[l + 1] for l in fl], dim=-1)
                feats = [f[i, :n + 1] for i, n in enumerate(ns)]
        t2 = time.perf_counter()
        verify_s = t2 - t1
        out: dict[int, list[int]] = {}
        emitted, own_verify_s, recs, commits = 0, 0.0, [], []
        for i, (req, p) in enumerate(zip(reqs, props)):
            tc = time.perf_counter()
            n, lg, tree = ns[i], logits[i], p.tree
            if req.finish_reason == "error":  # its proposal failed: nothing to verify or commit
                out[id(req)] = []
                continue
            try:  # the per-request part: a failure here fails this request only
                if tree is not None:
                    verdict = verify_tree(tree, lg, req.sampling, req.gen)
                elif n == 0:
                    verdict = Verdict(0, sample_token(lg[0], req.sampling, req.gen))
                else:
                    verdict = verify(p.tokens, p.q_probs, p.q_ids, lg, req.sampling, req.gen)
            except Exception as e:  # noqa: BLE001
                out[id(req)] = self._fail(req, e)  # nothing of this cycle was committed for it
                continue
            a = verdict.accepted
            if tree is not None:  # keep the accepted path's K/V, in consecutive columns
                rows = [0] + [c + 1 for c in verdict.path]
                self.kv.keep_rows(i, starts[i], rows)
                new = [int(tree.tokens[c]) for c in verdict.path] + [verdict.token]
                if eng.tree_sizer is not None:  # its time model learns from lone cycles only
                    eng.tree_sizer.observe(tree, verdict.path, verify_s if len(reqs) == 1 else 0.0)
            else:
                rows = list(range(a + 1))
                self.kv.lengths[i] = starts[i] + a + 1
                new = [int(t) for t in p.tokens[:a]] + [verdict.token]
            req.cache.length = starts[i] + a + 1
            tv = time.perf_counter()
            if eng.proposer is not None:  # committed for all requests at once below
                f = feats[i][rows] if feats is not None else torch.zeros(a + 1, 0)  # feature-less proposers
                commits.append((req.draft_state, f, starts[i]))
                _observe(eng.proposer, req.draft_state, inputs[i].tokens[rows].tolist(), starts[i])
            depth = tree.max_depth if tree is not None else n
            req.count_acceptance(depth, a)
            req.cycles.append(CycleRecord(depth, a + 1, 0.0, 0.0, 0.0, 0.0, batched=True, source=req.source,
                                          tree_nodes=tree.size if tree is not None else 0))  # times below
            recs.append(req.cycles[-1])
            own_verify_s += tv - tc
            out[id(req)] = eng._emit(req, new)
            emitted += len(out[id(req)])
        if commits:  # the draft context of every request: one projection for the batch
            tv = time.perf_counter()
            eng.proposer.commit_many(*map(list, zip(*commits)))
            draft_s += time.perf_counter() - tv
        self.last_cycle = BatchCycle(len(reqs), draft_s, final_s, verify_s, time.perf_counter() - t0, emitted)
        for rec in recs:  # every request waited for the whole batched cycle: record its phases
            rec.draft_s, rec.final_s = draft_s, final_s
            rec.verify_s, rec.total_s = verify_s + own_verify_s, self.last_cycle.total_s
        if len(recs) == 1 and len(reqs) == 1:  # the gate learns from lone cycles (their own time)
            eng.observe_tree_gate(reqs[0])
        if bpol is not None:
            drafted = sum(1 for r, n in zip(reqs, ns) if n > 0 and bpol.drafts(r))
            bpol.observe(len(reqs), width - 1, self.last_cycle.total_s, drafted)
        return out

    def _lean_plan(self):
        """The target's lean decode path (:mod:`dspine.runtime.lean`) when this batch's
        forwards can take it: a dense-runtime target with a lean plan, K/V in float32 on the
        CPU; else None (transformers' batched forward, chains only)."""
        rt = getattr(self.target, "runtime", None)
        plan = rt.lean_plan() if rt is not None and hasattr(rt, "lean_plan") else None
        if plan is None or not self.kv.k or self.kv.k[0].dtype != torch.float32:
            return None
        return plan

    def _lean_forward(self, plan, inputs: list[Inputs], starts: list[int], fl):
        """The batched forward on the lean path (:func:`dspine.core.batch_lean.lean_forward`)."""
        return lean_forward(self.target, plan, self.kv, inputs, starts, fl)

    def _batch_policy(self) -> BatchCostPolicy | None:
        """The batch-level pricing of the engine's controller
        (:func:`dspine.control.batch_policy.batch_controller`: rebuilt if the engine's
        controller was replaced), or None (per-request choices)."""
        self.batch_policy = batch_controller(self.engine.verify_policy, self.max_running, self.batch_policy)
        return self.batch_policy

    # -- drafting ------------------------------------------------------------------------
    def _propose(self, reqs: list[Request], ns: list[int]) -> list[Proposal]:
        """Proposals of every request (n_i = 0: none). Draft trees first where the engine
        has a tree budget and the batch runs on the lean path (:meth:`_propose_trees`); the
        other requests get chains. With ``batch_draft`` the proposer gets those requests at
        once (:meth:`Proposer.propose_many`: one drafter forward for the drafter's
        requests); if that raises, each request is retried alone, so only the culprit
        fails."""
        empty = lambda: Proposal(torch.zeros(0, dtype=torch.long))  # noqa: E731
        out: list[Proposal | None] = self._propose_trees(reqs, ns)
        idx = [i for i, n in enumerate(ns) if n > 0 and out[i] is None]
        prop = self.engine.proposer
        if self.batch_draft and len(idx) > 1:
            gens = [reqs[i].gen.get_state() for i in idx]  # a retry must redraw the same uniforms
            try:
                got = prop.propose_many([reqs[i] for i in idx], [self.kv.lengths[i] for i in idx],
                                        [ns[i] for i in idx])
            except Exception:  # noqa: BLE001 (retried one by one below: only a culprit fails)
                got = None
                for i, g in zip(idx, gens):
                    reqs[i].gen.set_state(g)
            if got is not None:
                for i, p in zip(idx, got):
                    out[i] = p
                idx = []
        for i in idx:
            r = reqs[i]
            try:
                out[i] = prop.propose(r.draft_state, r.anchor, self.kv.lengths[i], ns[i], r.sampling, r.gen)
            except Exception as e:  # noqa: BLE001 (this request only: it drafts nothing and leaves)
                self._fail(r, e)
        for i, p in enumerate(out):  # chains end at a finishing proposal (Engine.cut_at_finish)
            if p is not None and p.tree is None and ns[i] > 0:
                out[i] = self.engine.cut_at_finish(reqs[i], p)
        return [p if p is not None else empty() for p in out]

    def _propose_trees(self, reqs: list[Request], ns: list[int]) -> list[Proposal | None]:
        """Draft trees (:meth:`Proposer.propose_tree`, the engine's :class:`TreeSpec` and tree
        sizer) for the requests whose proposer can build one this cycle, when the batch's
        forward runs on the lean path (which takes tree masks); None elsewhere. A request
        whose proposal raises fails alone (it gets an empty proposal)."""
        eng = self.engine
        out: list[Proposal | None] = [None] * len(reqs)
        if not eng.tree.enabled or not eng.proposer.supports_tree or self._lean_plan() is None:
            return out
        trim = eng.tree_sizer.trim if eng.tree_sizer is not None else None
        for i, (r, n) in enumerate(zip(reqs, ns)):
            if n <= 0 or (eng.tree_gate is not None and not eng.tree_gate.choose(r.source)):
                continue
            try:
                p = eng.proposer.propose_tree(r.draft_state, r.anchor, self.kv.lengths[i], n, eng.tree,
                                              r.sampling, r.gen, trim=trim)
            except Exception as e:  # noqa: BLE001 (this request only)
                self._fail(r, e)
                p = Proposal(torch.zeros(0, dtype=torch.long))
            if p is not None and (p.tree is not None or r.finish_reason == "error"):
                out[i] = p
        return out

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
