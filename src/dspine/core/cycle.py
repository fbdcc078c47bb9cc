"""One decode cycle over a batch of requests: the only implementation of the cycle.

::

    plan     -> the proposer's source and n_max per request (Engine.plan); the
                controller's verification length n (per request, or one n for a shared
                forward priced at the batch size, dspine.control.batch_policy)
    propose  -> a draft tree or a chain of n proposals per request (n = 0: none); chains
                end at a proposal that would finish the request (Engine.cut_at_finish)
    forward  -> one target pass over [anchor, proposals] of every request (dspine.core.forward)
    verify   -> dspine.core.verify.verify_proposal: accepted prefix/path + correction or bonus
    emit     -> Engine.emit: EOS, stop strings, max_new_tokens (may cut the block)
    commit   -> the anchor and the emitted accepted proposals enter the target KV (the
                pass's commit) and the proposer's context (features, token ids); nothing
                rejected and nothing past a stop (spec s.5); the cycle is recorded

A single request (:meth:`dspine.core.engine.Engine.step`) is a batch of one over its own
cache; the batched engine (:class:`dspine.core.batch.BatchEngine`) runs the same cycle over
the rows of its slot cache. Spec sections 1, 5 and 6.
"""
from __future__ import annotations

import time
from typing import Callable

import torch

from dspine.core.batch_lean import Inputs
from dspine.core.request import BatchCycle, CycleRecord, Request
from dspine.core.verify import verify_proposal
from dspine.proposers.base import Proposal


def fail(req: Request, e: Exception) -> None:
    """Mark ``req`` finished with ``finish_reason == "error"`` (``req.error`` says why).

    Used where a cycle isolates failures: the request's own part (its proposal, its
    verification) raised; it leaves the batch, the others go on. A failure of a shared
    forward is not attributed to a request and raises."""
    req.finished, req.finish_reason = True, "error"
    req.error = f"{type(e).__name__}: {e}"
    req.t_end = time.perf_counter()


def _empty() -> Proposal:
    return Proposal(torch.zeros(0, dtype=torch.long))


def inputs_of(anchor: int, p: Proposal) -> Inputs:
    """The forward's inputs of one request: the anchor, then its chain or flattened tree."""
    a = torch.tensor([int(anchor)], dtype=torch.long)
    if p.tree is None:
        return Inputs(torch.cat([a, p.tokens.reshape(-1).long().cpu()]))
    return Inputs(torch.cat([a, p.tree.tokens.long().cpu()]), p.tree.positions(), p.tree.attention_mask())


class Cycle:
    """The decode cycle of one engine over one kind of target pass.

    Args:
        engine: the :class:`~dspine.core.engine.Engine` (target, proposer, controller,
            tree settings, stop handling).
        target_pass: :class:`~dspine.core.forward.OwnCachePass` or
            :class:`~dspine.core.forward.SharedRowsPass`.
        pricing: optional ``pricing() -> BatchCostPolicy | None``: one verification length
            for the whole batch, priced at its size (the batched engine); None or a None
            result: the engine's controller per request.
        batch_draft: draft the chains of several requests in one
            :meth:`~dspine.proposers.base.Proposer.propose_many` call.
        isolate: a request whose proposal or verification raises finishes with
            ``finish_reason == "error"`` (:func:`fail`) instead of raising out of :meth:`run`.
    """

    def __init__(self, engine, target_pass, pricing: Callable[[], object] | None = None,
                 batch_draft: bool = False, isolate: bool = False):
        self.engine, self.target_pass = engine, target_pass
        self.pricing, self.batch_draft, self.isolate = pricing, batch_draft, isolate
        self.last: BatchCycle | None = None

    def _failed(self, req: Request, e: Exception) -> None:
        if not self.isolate:
            raise e
        fail(req, e)

    # -- plan ------------------------------------------------------------------------------
    def lengths(self, reqs: list[Request]):
        """Verification length per request (sets each ``req.source``) and the batch
        pricing that chose them (None: the engine's controller per request)."""
        eng = self.engine
        bpol = self.pricing() if self.pricing is not None else None
        if bpol is not None:
            return bpol.choose(reqs, [eng.plan(r) for r in reqs]), bpol
        return [eng.verification_length(r) for r in reqs], None

    # -- propose ---------------------------------------------------------------------------
    def propose(self, reqs: list[Request], ns: list[int], starts: list[int]) -> list[Proposal]:
        """Proposals of every request (n_i = 0: none). Draft trees first where the engine has
        a tree budget, the proposer builds trees, the pass verifies them and the tree gate
        opens; the other requests get chains (several at once with ``batch_draft``: if that
        raises, each is retried alone, redrawing the same uniforms, so only a culprit fails)."""
        eng, prop, ctl = self.engine, self.engine.proposer, self.engine.verify_policy
        out: list[Proposal | None] = [None] * len(reqs)
        if eng.tree.enabled and prop is not None and prop.supports_tree:
            trim = ctl.tree_trim()
            for i, (r, n) in enumerate(zip(reqs, ns)):
                if n <= 0 or not self.target_pass.takes_tree(r) or not ctl.draft_tree(r):
                    continue
                try:
                    p = prop.propose_tree(r.draft_state, r.anchor, starts[i], n, eng.tree, r.sampling, r.gen,
                                          trim=trim)
                except Exception as e:  # noqa: BLE001 (this request only, when isolating)
                    self._failed(r, e)
                    p = _empty()
                if p is not None and (p.tree is not None or r.finish_reason == "error"):
                    out[i] = p
        idx = [i for i, n in enumerate(ns) if n > 0 and out[i] is None]
        if self.batch_draft and len(idx) > 1:
            gens = [reqs[i].gen.get_state() for i in idx]  # a retry must redraw the same uniforms
            try:
                got = prop.propose_many([reqs[i] for i in idx], [starts[i] for i in idx], [ns[i] for i in idx])
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
                out[i] = prop.propose(r.draft_state, r.anchor, starts[i], ns[i], r.sampling, r.gen)
            except Exception as e:  # noqa: BLE001 (this request only: it drafts nothing and leaves)
                self._failed(r, e)
        for i, p in enumerate(out):
            if p is not None and p.tree is None and ns[i] > 0:
                out[i] = eng.cut_at_finish(reqs[i], p)
        return [p if p is not None else _empty() for p in out]

    # -- the cycle -------------------------------------------------------------------------
    @torch.no_grad()
    def run(self, reqs: list[Request]) -> dict[int, list[int]]:
        """Advance every request in ``reqs`` (none finished) by one cycle.

        Returns ``{id(req): emitted ids}`` (after stop handling; [] for a request that
        failed). Sets :attr:`last`. Raises what a shared forward raises, and with
        ``isolate=False`` what any step raises.
        """
        eng, tp, ctl = self.engine, self.target_pass, self.engine.verify_policy
        t0 = time.perf_counter()
        ns0, bpol = self.lengths(reqs)
        starts = tp.starts(reqs)
        props = self.propose(reqs, ns0, starts)
        draft_s = sum(p.draft_s for p in props)
        final_s = sum(p.final_s for p in props)
        context_s, context_rows = sum(p.context_s for p in props), sum(p.context_rows for p in props)
        t1 = time.perf_counter()
        inputs = [inputs_of(r.anchor, p) for r, p in zip(reqs, props)]
        logits, feats = tp.forward(reqs, inputs)
        verify_s = time.perf_counter() - t1
        out: dict[int, list[int]] = {}
        own_s, recs, commits, emitted = 0.0, [], [], 0
        for i, (req, p) in enumerate(zip(reqs, props)):
            tc = time.perf_counter()
            if req.finish_reason == "error":  # its proposal failed: nothing to verify or commit
                out[id(req)] = []
                continue
            try:  # the request's own part: with isolate, a failure here fails this request only
                o = verify_proposal(p, logits[i], req.sampling, req.gen)
            except Exception as e:  # noqa: BLE001
                self._failed(req, e)
                out[id(req)] = []
                continue
            new = eng.emit(req, o.tokens)  # EOS, a stop string or max_new_tokens may cut the block
            keep = 1 + min(o.accepted, len(new) - 1)  # the last emitted token is the next anchor
            rows = o.rows[:keep]
            tp.commit(i, req, starts[i], rows)
            if p.tree is not None:  # the tree budget learns (its time model from lone cycles only)
                ctl.observe_tree(p.tree, [r - 1 for r in o.rows[1:]], verify_s if len(reqs) == 1 else 0.0)
            if eng.proposer is not None:
                f = feats[i] if feats is not None else None
                sel = rows if p.tree is not None else slice(0, keep)  # a chain keeps a prefix
                f = f[sel] if f is not None else torch.zeros(len(rows), 0)  # feature-less proposers
                commits.append((req.draft_state, f, starts[i], inputs[i].tokens[sel].tolist()))
            req.count_acceptance(o.depth, o.accepted)
            req.cycles.append(CycleRecord(o.depth, o.accepted + 1, 0.0, 0.0, 0.0, 0.0, batched=tp.shared,
                                          source=req.source, tree_nodes=o.nodes))  # times below
            recs.append(req.cycles[-1])
            own_s += time.perf_counter() - tc
            out[id(req)] = new
            emitted += len(new)
        if commits:  # the draft context of every request: one projection for the batch
            tv = time.perf_counter()
            states, fs, ps, toks = map(list, zip(*commits))
            eng.proposer.commit_many(states, fs, ps)
            for s, t, p in zip(states, toks, ps):
                eng.proposer.observe(s, t, p)
            draft_s += time.perf_counter() - tv
        total = time.perf_counter() - t0
        self.last = BatchCycle(len(reqs), draft_s, final_s, verify_s, total, emitted)
        for rec in recs:  # every request waited for the whole cycle: record its phases
            rec.draft_s, rec.final_s, rec.verify_s, rec.total_s = draft_s, final_s, verify_s + own_s, total
            rec.context_s, rec.context_rows = context_s, context_rows
        if len(reqs) == 1 and recs:  # tree or chain is learned from lone cycles (their own time)
            ctl.observe_cycle(reqs[0])
        if bpol is not None:
            width = max(len(q) for q in inputs)
            drafted = sum(1 for r, q in zip(reqs, inputs) if len(q) > 1 and bpol.drafts(r))
            bpol.observe(len(reqs), width - 1, total, drafted)
        return out
