"""The learned drafters as proposers: DSpine and DFlash-style (spec sections 4-6, 10).

:class:`DrafterProposer` runs a :class:`~dspine.drafter.model.DSpineDrafter` (DSpine with bridge
and final stage, or DFlash-style without, by its config flags) over the request's
draft context K/V (:class:`~dspine.proposers.draft_context.DraftContextCache`); :func:`propose_batch` runs it for
several requests with one drafter forward (the batched engine).
"""
from __future__ import annotations

import time

import torch

from dspine.config import ConfigError, SamplingConfig
from dspine.drafter.candidate_pass import CandidatePass, forced_candidate_pass
from dspine.drafter.final_stage import candidates, chain, fused_tables, parallel_argmax
from dspine.drafter.ngram_prior import ORDER
from dspine.drafter.model import BlockOutput, DSpineDrafter
from dspine.drafter.q8 import forced_linears
from dspine.runtime.blockq import MAX_ROWS
from dspine.runtime.lean_drafter import block_forward
from dspine.core.sampling import filter_probs, sample_index, uniform
from dspine.proposers.base import Proposal, Proposer
from dspine.proposers.draft_context import DraftContextCache


class DrafterProposer(Proposer):
    """Runs a :class:`DSpineDrafter` (DSpine or DFlash-style by its config flags)."""

    def __init__(self, drafter: DSpineDrafter, use_quantized_head: bool = True,
                 head_kernel: "str | CandidatePass" = "exact", linears: str = "float32",
                 vocab: torch.Tensor | None = None, linears_choice=None, prior=None):
        """Nothing is measured here: the machine-dependent choices are made where an engine
        is built (:func:`dspine.tune.drafter.measured_proposer` times them and passes them in).

        ``use_quantized_head``: candidates from a coarse pass over the head followed by
        exact rescoring (DSpine's final stage, and the DFlash-style greedy argmax). False
        is the reference path: exact head over the full vocabulary. ``head_kernel``: the
        coarse pass, a :class:`~dspine.drafter.candidate_pass.CandidatePass` (e.g. measured
        per row count, :func:`dspine.tune.head.plan_candidate_pass`) or a kernel name for
        every row count (``exact``, ``int8``, ``bfloat16``, ``blockq``). Sampled
        DFlash-style proposals always use the dense filtered q over all V tokens (spec
        section 10). ``linears``: the drafter's own linear layers, ``float32`` (as trained)
        or ``q8`` (a copy rounded to Q8_0 blocks on the blockq kernels, :mod:`dspine.drafter.q8`;
        the drafter only proposes, so the output stays the target's); a drafter already
        quantized stays so. ``vocab``: a draft vocabulary [Vs] int64 of sorted target ids
        (:mod:`dspine.drafter.vocab`): the candidate pass scores only those rows of the head
        (tokens outside are never proposed; needs ``use_quantized_head``; with a given
        ``CandidatePass`` it must be the pass's own ``ids``); None = the whole vocabulary.
        ``linears_choice``: the measurement that chose the linears (shown by ``dspine tune``).
        ``prior``: an :class:`~dspine.drafter.ngram_prior.NgramPrior` scored in the final
        stage's chain (DSpine drafters; its own greedy continuation joins the candidates
        where no copy is fused), or None.

        Raises:
            ValueError: unknown ``head_kernel`` (naming ``--head-kernel``) or ``linears``
                (naming ``--drafter-linears``), a forced ``q8`` that cannot run here, or a
                draft vocabulary without the coarse pass.
        """
        drafter = forced_linears(drafter.eval(), linears)
        self.linears_choice = linears_choice
        self.linears = "q8" if _is_q8(drafter) else "float32"
        self.drafter = drafter
        self.cfg = drafter.cfg
        self.block_size = self.cfg.block_size
        self.feature_layers = list(self.cfg.feature_layers)
        if vocab is not None and not use_quantized_head:
            raise ConfigError("SpeculativeConfig.draft_vocab: a draft vocabulary needs the coarse candidate pass "
                              "(the exact reference path scores the whole vocabulary)", field="draft_vocab")
        if not use_quantized_head:
            self.qhead = None
        elif isinstance(head_kernel, CandidatePass):
            self.qhead = head_kernel
        else:
            self.qhead = forced_candidate_pass(drafter.head, head_kernel, ids=vocab)
        self.draft_vocab = 0 if vocab is None else int(vocab.numel())
        self.prior = prior if self.cfg.final_stage else None

    def observe(self, state: DraftContextCache, tokens: list[int], start_pos: int) -> None:
        """Keep the last committed token ids (the n-gram prior's context)."""
        if self.prior is not None and state is not None:
            state.tail = (state.tail + [int(t) for t in tokens])[-ORDER:]

    def _prior_parts(self, state: DraftContextCache, anchor: int, n: int, copy):
        """(copy to fuse, chain prior) of one request: the memory's own continuation when
        nothing else is fused, and its scores given the committed tail, the anchor and the
        chain's earlier choices; (copy, None) without a prior."""
        if self.prior is None:
            return copy, None
        ctx = state.tail[-(ORDER - 1):] + [int(anchor)]  # the anchor completes the longest context
        if not copy:
            copy = self.prior.chain(ctx, n) or None
        prior = self.prior

        def score(chosen: list[int], cand_i: torch.Tensor) -> torch.Tensor:
            return prior.scores(ctx + chosen, cand_i, row=len(chosen) + 1)
        return copy, score

    def state_nbytes(self, state) -> int:
        """Bytes of ``state``'s draft context K/V."""
        return int(state.nbytes())

    def kernel_info(self) -> dict:
        """The kernels this proposer runs (for ``--json`` stats): the candidate pass's
        kernel per row bucket, or ``exact-reference`` without a coarse pass."""
        fwd = "lean" if getattr(self.drafter, "_lean", None) is not None else "pytorch"
        # the prior only where one runs: without it the dict (and the cost-curve cache key) is as before
        prior = {} if self.prior is None else {"ngram_prior": {
            "weight": self.prior.weight, "contexts": int(self.prior.keys.shape[0]), "bytes": self.prior.nbytes(),
            "source": self.prior.source, "scores": "chains and draft trees"}}
        if self.qhead is None:
            return {"candidate_pass": "exact-reference", "drafter_linears": self.linears,
                    "drafter_forward": fwd, "draft_vocab": self.cfg.vocab_size, **prior}
        return {"candidate_pass": self.qhead.describe()["kernels"], "drafter_linears": self.linears,
                "drafter_forward": fwd, "draft_vocab": self.draft_vocab or self.cfg.vocab_size, **prior}

    def new_state(self, prompt_ids):
        return DraftContextCache(self.cfg.num_layers, self.cfg.window, project=self._project)

    @torch.no_grad()
    def _project(self, features: torch.Tensor, pos: torch.Tensor):
        """Draft context K/V of features [1, n, F*d] at pos [1, n]: the lean drafter's one C++
        call where it runs and n is within the blockq row limit (as its linears would take it),
        else :meth:`DSpineDrafter.context_kv`."""
        lean = getattr(self.drafter, "_lean", None)
        if (lean is not None and lean.has_context and features.shape[0] == 1
                and features.shape[1] <= MAX_ROWS and features.dtype == torch.float32):
            return lean.context_kv(features, pos)
        return self.drafter.context_kv(features, pos)

    def commit(self, state: DraftContextCache, features: torch.Tensor, start_pos: int) -> None:
        """Accepted features [n, F*d] of positions ``start_pos ..``: kept until the drafter next
        reads its context (:meth:`DraftContextCache.defer`; projected then in one call)."""
        state.defer(features, start_pos)

    def commit_many(self, states: list[DraftContextCache], features: list[torch.Tensor],
                    starts: list[int]) -> None:
        """:meth:`commit` for several requests (each deferred; :meth:`flush_many` projects
        them together before the next batched proposal)."""
        for s, f, p in zip(states, features, starts):
            self.commit(s, f, p)

    @torch.no_grad()
    def flush_many(self, states: list[DraftContextCache]) -> None:
        """Project the pending commits of several requests with one context projection.

        The context K/V of a position depends on its own features and position only, so
        this equals :meth:`DraftContextCache.flush` per request (up to float rounding of the
        larger matrix product); it saves b - 1 small projections per batched cycle.
        """
        items = [(s, it) for s in states if (it := s.pending_items()) is not None]
        if len(items) == 1:
            s, (f, p) = items[0]
            s.append(self._project(f[None], p[None]), p)
        if len(items) <= 1:
            return
        feats = torch.cat([f for _, (f, _) in items])[None]  # [1, sum n_i, F*d]
        pos = torch.cat([p for _, (_, p) in items])  # [sum n_i]
        kv = self._project(feats, pos[None])  # per layer (k, v) [1, kv, sum n_i, hd]
        o = 0
        for s, (f, p) in items:
            n = f.shape[0]
            s.append([(k[:, :, o:o + n], v[:, :, o:o + n]) for k, v in kv], p)
            o += n

    @torch.no_grad()
    def propose(self, state: DraftContextCache, anchor: int, anchor_pos: int, n: int,
                sampling: SamplingConfig, gen, copy: list[int] | None = None, bonus: float = 0.0) -> Proposal:
        """``copy``: a copied continuation fused into the final stage (DSpine only; ignored
        without one): its tokens join the candidates of rows 1.. and following it scores
        ``bonus`` more (:func:`~dspine.drafter.final_stage.inject_copy`, :func:`~dspine.drafter.final_stage.copy_bonus`)."""
        d = self.drafter
        t0 = time.perf_counter()
        dev = d.fc.weight.device
        k = state.flush()
        context_s = time.perf_counter() - t0
        kv, cpos, cvalid = state.as_batch()
        a = torch.tensor([[anchor]], device=dev)
        # a block-causal drafter runs only the rows it proposes from (same values as the
        # full block, model.forward_blocks); a short verification length costs less
        rows = max(1, n + 1) if self.cfg.block_causal else None
        out = block_forward(d)(a, torch.tensor([[anchor_pos]], device=dev), kv, cpos, cvalid, rows=rows)
        t1 = time.perf_counter()
        ctx = {"context_s": context_s, "context_rows": k}
        if n == 0:
            return Proposal(torch.zeros(0, dtype=torch.long), draft_s=t1 - t0, **ctx)
        if self.cfg.final_stage:
            copy, prior = self._prior_parts(state, anchor, n, copy)
            cand, T = self._tables(out, a, n, copy, bonus)  # [n, K], [n, K, K]
            ch = chain(T, cand, n, sampling, gen, prior=prior)
            t2 = time.perf_counter()
            return Proposal(ch.tokens.cpu(), ch.q_ids, ch.q_probs, draft_s=t1 - t0, final_s=t2 - t1, **ctx)
        if sampling.greedy and self.qhead is not None:  # argmax via the shared candidate pass
            toks = parallel_argmax(d, d.norm_f(out.h[0, 0, 1:n + 1]), self.qhead)
            return Proposal(toks.cpu(), draft_s=time.perf_counter() - t0, **ctx)
        p = dense_proposal(d.logits(out.h[0, 0, 1:n + 1]).float(), sampling, gen, t0)
        p.context_s, p.context_rows = context_s, k
        return p

    def _tables(self, out, a: torch.Tensor, n: int, copy: list[int] | None = None,
                bonus: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
        """The final stage's candidates cand [n, K] int64 and conditional tables T [n, K, K]
        float32 of one block (``out``: the drafter's forward, ``a`` [1, 1] the anchor),
        with ``copy`` fused in when given (see :meth:`propose`)."""
        d = self.drafter
        x = d.norm_f(out.h[0, 0, 1:n + 1])  # [n, d]
        cand = candidates(d, x, self.cfg.head_topk, self.cfg.coarse_k, self.qhead)  # [n, K]
        cand, T = fused_tables(d, out.h_pre[:, 0, :n + 1], out.r[:, 0, :n + 1], out.c[:, 0, :n + 1],
                               a[:, 0], cand[None], [copy], bonus)
        return cand[0], T[0]  # [n, K], [n, K, K]

    @property
    def supports_tree(self) -> bool:
        """Trees are built from the final stage's tables: DSpine drafters only."""
        return bool(self.cfg.final_stage)

    @torch.no_grad()
    def propose_tree(self, state: DraftContextCache, anchor: int, anchor_pos: int, depth: int, spec,
                     sampling: SamplingConfig, gen, trim=None) -> Proposal | None:
        """A draft tree (:mod:`dspine.trees.build`) at most ``depth`` deep under ``spec``
        (:class:`dspine.trees.TreeSpec`): best-first for greedy decoding with a dynamic
        shape, else the static widths (``spec.sampled_shape`` when sampling with a
        dynamic shape). ``trim``: see :meth:`Proposer.propose_tree` (greedy best-first
        trees only). Returns a :class:`Proposal` whose ``tree`` is set (``tokens`` are
        the tree's nodes), or None when this drafter has no final stage (the engine then
        drafts a chain)."""
        if not self.supports_tree or depth < 1:
            return None
        from dspine.trees.build import dynamic_tree, static_tree

        d = self.drafter
        t0 = time.perf_counter()
        dev = d.fc.weight.device
        k = state.flush()
        context_s = time.perf_counter() - t0
        kv, cpos, cvalid = state.as_batch()
        a = torch.tensor([[anchor]], device=dev)
        rows = depth + 1 if self.cfg.block_causal else None
        out = block_forward(d)(a, torch.tensor([[anchor_pos]], device=dev), kv, cpos, cvalid, rows=rows)
        t1 = time.perf_counter()
        copy, prior = self._prior_parts(state, anchor, depth, None)  # (None, None) without a prior
        cand, T = self._tables(out, a, depth, copy)
        cand, T = cand.cpu(), T.cpu()
        if sampling.greedy and spec.shape is None:
            tree = dynamic_tree(T, cand, depth, spec.budget, prior=prior)
            if trim is not None:
                tree = trim(tree, time.perf_counter() - t0)
        else:
            shape = spec.shape if spec.shape is not None else spec.sampled_shape
            tree = static_tree(T, cand, depth, shape, spec.budget, sampling, gen, prior=prior)
        prop = Proposal(tree.tokens, tree.q_ids, tree.q_probs, draft_s=t1 - t0, final_s=time.perf_counter() - t1,
                        context_s=context_s, context_rows=k)
        prop.tree = tree
        return prop

    def propose_many(self, reqs: list, positions: list[int], ns: list[int]) -> list[Proposal]:
        """One drafter forward for all requests (:func:`propose_batch`) once every
        request's draft context holds positions; else one by one. A request may carry
        ``copy`` / ``bonus`` (the hybrid's fused copies, :meth:`propose`)."""
        self.flush_many([r.draft_state for r in reqs])
        if len(reqs) > 1 and all(r.draft_state.pos is not None for r in reqs):
            return propose_batch(self, reqs, positions, ns)
        return [self.propose(r.draft_state, r.anchor, p, n, r.sampling, r.gen, copy=getattr(r, "copy", None),
                             bonus=getattr(r, "bonus", 0.0)) for r, p, n in zip(reqs, positions, ns)]



def _is_q8(drafter) -> bool:
    """Whether ``drafter``'s linears run on Q8_0 blocks (:func:`dspine.drafter.q8.quantize_drafter`)."""
    from dspine.runtime.blockq import BlockQLinear

    return isinstance(drafter.fc, BlockQLinear)


def _padded_context(states: list[DraftContextCache], num_layers: int, b: int, dev):
    """The draft contexts of ``b`` requests padded to the largest capacity with invalid slots:
    (per layer (k, v) [b, kv, cap, hd], pos [b, cap] int64, valid [b, cap] bool)."""
    cap = max(s.pos.shape[0] for s in states)
    kv = []
    for l in range(num_layers):
        k0 = states[0].k[l]
        K = k0.new_zeros(b, k0.shape[0], cap, k0.shape[-1])
        V = k0.new_zeros(b, k0.shape[0], cap, k0.shape[-1])
        for j, s in enumerate(states):
            c = s.pos.shape[0]
            K[j, :, :c] = s.k[l]
            V[j, :, :c] = s.v[l]
        kv.append((K, V))
    cpos = torch.full((b, cap), -1, dtype=torch.long, device=dev)
    cvalid = torch.zeros(b, cap, dtype=torch.bool, device=dev)
    for j, s in enumerate(states):
        c = s.pos.shape[0]
        cpos[j, :c], cvalid[j, :c] = s.pos, s.valid
    return kv, cpos, cvalid


def dense_proposal(z: torch.Tensor, sampling: SamplingConfig, gen, t0: float) -> Proposal:
    """Reference DFlash-style proposals from full-vocabulary logits z [n, V] float32:
    argmax (greedy) or ``y_i ~ q_i = filter_probs(z_i)`` with the dense q [n, V] float64."""
    n = z.shape[0]
    if sampling.greedy:
        return Proposal(torch.argmax(z, dim=-1).cpu(), draft_s=time.perf_counter() - t0)
    q = filter_probs(z, sampling).cpu()  # [n, V] dense q
    toks = torch.tensor([sample_index(q[i], uniform(gen)) for i in range(n)], dtype=torch.long)
    return Proposal(toks, None, q, draft_s=time.perf_counter() - t0)


@torch.no_grad()
def propose_batch(prop: DrafterProposer, reqs: list, positions: list[int], ns: list[int]) -> list[Proposal]:
    """:meth:`DrafterProposer.propose` for several requests with one drafter forward.

    ``reqs``: :class:`~dspine.core.engine.Request` objects (``draft_state``, ``anchor``,
    ``sampling``, ``gen`` are read); ``positions[j]`` is request j's anchor position and
    ``ns[j] >= 1`` its verification length. Returns one :class:`Proposal` per request.

    Context K/V of the requests (ring buffers of different capacity) are padded to the
    largest capacity with invalid slots (or, on the lean drafter forward, each request's block
    runs in its own C++ call over its own context); candidates and conditional tables are batched;
    the serial chain runs per request with its own sampling settings and generator.
    Shared times are split evenly over the requests.
    """
    d, cfg = prop.drafter, prop.cfg
    t0 = time.perf_counter()
    dev = d.fc.weight.device
    b, nmax = len(reqs), max(ns)
    states = [r.draft_state for r in reqs]
    a = torch.tensor([[r.anchor] for r in reqs], device=dev)
    apos = torch.tensor([[p] for p in positions], device=dev)
    rows = nmax + 1 if cfg.block_causal else None  # causal block: only the rows proposed from
    lean = getattr(d, "_lean", None)
    if lean is not None:  # one C++ call per request (its own context, no padding) beats one batched
        # PyTorch forward (dspine.runtime.lean_drafter)
        outs = []
        for j, s in enumerate(states):
            kv, cpos, cvalid = s.as_batch()
            outs.append(lean.forward_blocks(a[j:j + 1], apos[j:j + 1], kv, cpos, cvalid, rows=rows))
        out = BlockOutput(*(torch.cat([getattr(o, f) for o in outs]) for f in ("h", "h_pre", "r", "c")))
    else:
        out = d.forward_blocks(a, apos, *_padded_context(states, cfg.num_layers, b, dev), rows=rows)
    t1 = time.perf_counter()
    res: list[Proposal] = []
    if cfg.final_stage:
        x = d.norm_f(out.h[:, 0, 1:nmax + 1])  # [b, nmax, d]
        cand = candidates(d, x.reshape(b * nmax, -1), cfg.head_topk, cfg.coarse_k, prop.qhead)
        cand = cand.reshape(b, nmax, -1)  # [b, nmax, K]
        # copies fused into the final stage (hybrid, --copy-bonus): one bonus per proposer
        bonus = max((getattr(r, "bonus", 0.0) for r in reqs), default=0.0)
        parts = [prop._prior_parts(r.draft_state, r.anchor, nmax, getattr(r, "copy", None)) for r in reqs]
        cand, T = fused_tables(d, out.h_pre[:, 0, :nmax + 1], out.r[:, 0, :nmax + 1], out.c[:, 0, :nmax + 1],
                               a[:, 0], cand, [c for c, _ in parts], bonus)  # T [b, nmax, K, K]
        t2 = time.perf_counter()
        shared = (t2 - t1) / b
        for j, r in enumerate(reqs):
            tc = time.perf_counter()
            ch = chain(T[j], cand[j], ns[j], r.sampling, r.gen, prior=parts[j][1])
            res.append(Proposal(ch.tokens.cpu(), ch.q_ids, ch.q_probs, draft_s=(t1 - t0) / b,
                                final_s=shared + time.perf_counter() - tc))
        return res
    if prop.qhead is not None and all(r.sampling.greedy for r in reqs):  # argmax via the candidate pass
        x = d.norm_f(out.h[:, 0, 1:nmax + 1])  # [b, nmax, d]
        toks = parallel_argmax(d, x.reshape(b * nmax, -1), prop.qhead).view(b, nmax)
        res = [Proposal(toks[j, : ns[j]].cpu()) for j in range(b)]
    else:
        z = d.logits(out.h[:, 0, 1:nmax + 1]).float()  # [b, nmax, V]
        for j, r in enumerate(reqs):
            res.append(dense_proposal(z[j, : ns[j]], r.sampling, r.gen, t0))
    share = (time.perf_counter() - t0) / b
    for p in res:
        p.draft_s = share
    return res
