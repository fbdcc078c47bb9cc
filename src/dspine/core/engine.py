"""Decoding engine: prefill, then draft -> verify -> commit cycles (spec sections 1, 5, 6).

Modes: ``ar`` (plain target loop: each cycle verifies zero proposals and samples one
token with the plain sampler), ``dflash`` and ``dspine`` (a drafter proposes a block,
the target verifies it in one forward). All modes share this loop, the sampler and
the stop logic, so the baseline and speculation differ only in the proposer.

State lives in :class:`Request` objects (target cache, draft context cache,
generator, counters), so a batch of requests with ragged accepted lengths is a list
of states; :meth:`Engine.step` advances one request by one cycle.
"""
from __future__ import annotations

import resource
import time
from dataclasses import asdict, dataclass, field
from typing import Callable

import torch

from dspine.config import ENGINE_MODES, SamplingConfig
from dspine.control.base import Controller, FixedPolicy
from dspine.core.stopping import StopDetector
from dspine.proposers.base import Plan, Proposal, Proposer
from dspine.core.sampling import filter_probs, make_generator, sample_index, sample_token, uniform
from dspine.target.adapter import Target, TargetCache
from dspine.trees.tree import TreeSpec
from dspine.trees.verify import verify_tree
from dspine.core.verify import Verdict, verify

MODES = ENGINE_MODES
#: labels an Engine accepts: the modes, and ``ngram`` (copies only, no drafter: the bench's own
#: prompt-lookup row; on the command line it is ``--proposer ngram``)
ENGINE_LABELS = MODES + ("ngram",)


class EngineError(ValueError):
    """A request setting the engine refuses (the message names it)."""


@dataclass
class CycleRecord:
    """One cycle: verification length n, acceptance length ``emitted`` = accepted + 1
    (bonus/correction included; tokens that an EOS or a stop string cuts afterwards still
    count, as acceptance is a property of the drafter, not of the stop), times (s)."""

    n: int
    emitted: int
    draft_s: float
    final_s: float
    verify_s: float
    total_s: float
    # batched: a cycle of the batched engine; its times are those of the whole batched cycle
    # the request waited for (every request's drafting, final stage and verification, the
    # shared forward as wide as the widest request), not this request's share
    batched: bool = False
    # the proposer source of this cycle (``draft``, ``ngram``; "" for ``ar``), see Proposer.plan
    source: str = ""
    # nodes of the draft tree verified this cycle (0: a chain of n proposals); n is then its depth
    tree_nodes: int = 0


@dataclass
class GenerationStats:
    """Per-request statistics. Times in seconds, memory in bytes, counts in tokens.

    ``accepted_length_mean`` is tau: tokens emitted per cycle, bonus/correction
    included. ``accepted_per_position[k-1]`` is the fraction of cycles that drafted
    position k in which position k was accepted.
    """

    prompt_tokens: int = 0
    output_tokens: int = 0
    cycles: int = 0
    accepted_length_mean: float = 0.0
    accepted_per_position: list[float] = field(default_factory=list)
    tokens_per_second: float = 0.0  # output tokens after the first / decode time
    ttft_s: float = 0.0
    decode_s: float = 0.0
    total_s: float = 0.0
    draft_s: float = 0.0
    final_stage_s: float = 0.0
    verify_s: float = 0.0
    peak_memory_bytes: int = 0
    verification_lengths: list[int] = field(default_factory=list)
    # per cycle: nodes of the verified draft tree (0 for a chain); empty when no cycle had a tree
    tree_nodes: list[int] = field(default_factory=list)
    # what ran: target dtype and threads, the verification policy, the drafter's
    # candidate-pass kernel per row bucket (measured choices, dspine.tune)
    kernels: dict = field(default_factory=dict)
    # per proposer source (``draft``, ``ngram``): cycles, proposals verified, accepted, tokens emitted
    sources: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class Request:
    """State of one request (everything a cycle reads or commits)."""

    prompt_ids: list[int]
    sampling: SamplingConfig
    max_new_tokens: int
    stop: list[str]
    gen: torch.Generator
    cache: TargetCache
    draft_state: object
    out_ids: list[int] = field(default_factory=list)
    anchor: int = -1  # last emitted token; not yet processed by the target
    finished: bool = False
    finish_reason: str | None = None  # "stop", "length", "cancelled" or "error"
    error: str | None = None  # why a cycle of this request failed (finish_reason "error")
    text: str = ""
    cycles: list[CycleRecord] = field(default_factory=list)
    drafted_at: list[int] = field(default_factory=list)
    accepted_at: list[int] = field(default_factory=list)
    source: str = ""  # this cycle's proposer source, set by Engine.plan before the policy runs
    t_start: float = 0.0
    t_first: float = 0.0
    t_end: float = 0.0
    stops: StopDetector | None = None  # incremental stop-string detection (None: no stop strings)

    def count_acceptance(self, n: int, a: int) -> None:
        """Record a cycle that drafted ``n`` positions and accepted the first ``a``."""
        for k in range(n):
            if len(self.drafted_at) <= k:
                self.drafted_at.append(0)
                self.accepted_at.append(0)
            self.drafted_at[k] += 1
            self.accepted_at[k] += int(k < a)

    @property
    def position(self) -> int:
        """Absolute position of the anchor (= committed target positions)."""
        return self.cache.length


@dataclass
class GenerationResult:
    """Output of :meth:`Engine.generate`: text, token ids (EOS included when hit)."""

    text: str
    token_ids: list[int]
    mode: str
    finish_reason: str
    stats: GenerationStats


def _peak_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # ru_maxrss is KiB on Linux


def _observe(proposer, state, tokens: list[int], start_pos: int) -> None:
    """Tell ``proposer`` the token ids it committed (:meth:`Proposer.observe`)."""
    proposer.observe(state, tokens, start_pos)


def source_stats(cycles: list[CycleRecord]) -> dict:
    """Per proposer source: cycles, proposals verified, proposals accepted, tokens emitted
    (the bonus/correction included) and tau of that source's cycles."""
    out: dict[str, dict] = {}
    for c in cycles:
        d = out.setdefault(c.source or "none", {"cycles": 0, "proposed": 0, "accepted": 0, "emitted": 0})
        d["cycles"] += 1
        d["proposed"] += c.n
        d["accepted"] += c.emitted - 1
        d["emitted"] += c.emitted
    for d in out.values():
        d["tau"] = d["emitted"] / d["cycles"]
    return out


def _features(out, k: int) -> torch.Tensor:
    """Features [k, F*d] of the first k positions of a forward; [k, 0] when none were captured."""
    if out.features is None:
        return torch.zeros(k, 0)
    return out.features[0, :k]


class Engine:
    """Speculative decoding engine over one target and an optional proposer.

    Args:
        target: the loaded :class:`Target`.
        proposer: None for ``ar``; else a :class:`Proposer` (drafter, oracle, ...).
        mode: one of :data:`MODES` (recorded in results).
        verify_policy: the :class:`~dspine.control.base.Controller` that chooses each
            cycle's source and verification length before drafting (non-anticipating,
            spec s.5; with a tree, n is the tree's depth) and, when it prices cycles
            (``cost`` set), sizes and gates draft trees; None: :class:`FixedPolicy` (the
            whole block every cycle).
        tree: :class:`~dspine.trees.TreeSpec`; with a budget > 0 a cycle whose proposer
            can build a tree (:meth:`Proposer.propose_tree`) and whose target cache can
            verify one (the dense runtime) verifies a draft tree instead of a chain;
            other cycles (copies, hybrid Gated-DeltaNet targets, ``--runtime hf``) keep chains.
    Raises:
        EngineError: unknown mode, a speculative mode without a proposer, or a
            ``verify_policy`` that is not a :class:`~dspine.control.base.Controller`.
    """

    def __init__(self, target: Target, proposer: Proposer | None = None, mode: str = "dspine",
                 verify_policy: Controller | None = None, tree: TreeSpec | None = None):
        if mode not in ENGINE_LABELS:
            raise EngineError(f"--mode {mode!r} is unknown; accepted: {', '.join(MODES)}")
        if mode != "ar" and proposer is None:
            raise EngineError(f"--mode {mode} needs a drafter")
        self.target, self.proposer, self.mode = target, (proposer if mode != "ar" else None), mode
        if verify_policy is not None and not isinstance(verify_policy, Controller):
            raise EngineError(f"verify_policy must be a dspine.control.base.Controller, got {type(verify_policy).__name__}")
        self.verify_policy = verify_policy if verify_policy is not None else FixedPolicy()
        self.tree = tree or TreeSpec()
        # --tree-size cost: the verified prefix of best-first trees, from the policy's cost curve
        self.tree_sizer = None
        curve = self.verify_policy.cost
        if self.tree.enabled and self.tree.size == "cost" and curve is not None:
            from dspine.control.tree_sizer import TreeSizer
            self.tree_sizer = TreeSizer(curve.verify_s)
        # ... and whether a drafting cycle drafts a tree or a chain, by their measured rates
        self.tree_gate = None
        if self.tree_sizer is not None:
            from dspine.control.tree_gate import TreeGate
            self.tree_gate = TreeGate()
        # target feature layers the proposer reads; None (no capture) for ``ar`` and for
        # proposers without features (oracles in tests), which then get [n, 0] features
        fl = list(self.proposer.feature_layers) if self.proposer is not None else []
        self.feature_layers = fl if fl and self.proposer.needs_features else None
        self.max_positions = int(getattr(target.config, "max_position_embeddings", 1 << 30))

    # -- request lifecycle -------------------------------------------------------------
    def start(self, prompt_ids: list[int], sampling: SamplingConfig | None = None,
              max_new_tokens: int = 128, stop: list[str] | None = None, tenant: str | None = None) -> Request:
        """Validate, prefill the target and the draft context, and emit the first token.

        ``tenant``: whose part of a cross-request output cache the request reads and, once
        finished, writes (:mod:`dspine.proposers.cache`; None = the default tenant).

        Raises:
            EngineError: empty prompt, ``max_new_tokens`` < 1, or prompt + max_new_tokens
                beyond the target's context window.
        """
        sampling = sampling or SamplingConfig()
        if not prompt_ids:
            raise EngineError("prompt is empty")
        if max_new_tokens < 1:
            raise EngineError(f"--max-new-tokens must be >= 1, got {max_new_tokens}")
        if len(prompt_ids) + max_new_tokens > self.max_positions:
            raise EngineError(f"prompt ({len(prompt_ids)} tokens) + --max-new-tokens {max_new_tokens} "
                              f"exceeds the target's context window of {self.max_positions} tokens")
        bad = [t for t in prompt_ids if not 0 <= t < self.target.vocab_size]
        if bad:
            raise EngineError(f"prompt token ids {bad[:3]} are outside the vocabulary (size {self.target.vocab_size})")
        req = Request(list(prompt_ids), sampling, max_new_tokens, [s for s in (stop or []) if s],
                      make_generator(sampling.seed), self.target.new_cache(),
                      self.proposer.new_state(prompt_ids) if self.proposer else None)
        if self.proposer is not None:
            self.proposer.set_tenant(req.draft_state, tenant)
        if req.stop:
            req.stops = StopDetector(self.target.tokenizer, req.stop)
        req.t_start = time.perf_counter()
        ids = torch.tensor([prompt_ids], device=self.target.device)
        out = self.target.forward(ids, req.cache, self.feature_layers, logits_to_keep=1)
        req.cache.rollback(len(prompt_ids))
        if self.proposer is not None:
            self.proposer.commit(req.draft_state, _features(out, len(prompt_ids)), 0)
            _observe(self.proposer, req.draft_state, list(prompt_ids), 0)
        first = sample_token(out.logits[0, -1], sampling, req.gen)
        req.t_first = time.perf_counter()
        self._emit(req, [first])
        return req

    def max_verification_length(self, req: Request) -> int:
        """The most proposals ``req`` may verify this cycle: block size - 1, and no more
        than its remaining tokens allow (0 for ``ar``)."""
        if self.proposer is None:
            return 0
        remaining = req.max_new_tokens - len(req.out_ids)
        return max(0, min(self.proposer.block_size - 1, remaining - 1))

    def plan(self, req: Request) -> int:
        """Ask the proposer what this cycle proposes (:meth:`Proposer.plan`, from the
        committed context and the anchor only); set ``req.source`` and return the most
        proposals it can verify (<= :meth:`max_verification_length`)."""
        n_max = self.max_verification_length(req)
        if self.proposer is None:
            req.source = ""
            return 0
        if n_max <= 0:
            plan = Plan(self.proposer.source, n_max)
        else:
            plan = self.proposer.plan(req.draft_state, req.anchor, n_max, pick=self.verify_policy.picker(req))
        req.source = plan.source
        return max(0, min(n_max, int(plan.max_n)))

    def _verification_length(self, req: Request) -> int:
        n_max = self.plan(req)
        if n_max > 0:
            n = int(self.verify_policy(req, n_max))
            return max(0, min(n, n_max))
        return n_max

    def step(self, req: Request) -> list[int]:
        """One cycle for ``req``: draft n tokens, verify in one target pass, commit.

        Returns the token ids emitted this cycle (after stop handling).
        """
        if req.finished:
            return []
        t0 = time.perf_counter()
        n = self._verification_length(req)
        pos = req.position
        prop = None
        if n > 0 and self.tree.enabled and self.target.supports_tree(req.cache) \
                and (self.tree_gate is None or self.tree_gate.choose(req.source)):
            prop = self.proposer.propose_tree(req.draft_state, req.anchor, pos, n, self.tree, req.sampling,
                                              req.gen, trim=self.tree_sizer.trim if self.tree_sizer else None)
        if prop is not None and prop.tree is not None:
            emitted = self._step_tree(req, prop, t0)
            self.observe_tree_gate(req)
            return emitted
        if n > 0:
            prop = self.cut_at_finish(req, self.proposer.propose(req.draft_state, req.anchor, pos, n,
                                                                 req.sampling, req.gen))
        else:
            prop = Proposal(torch.zeros(0, dtype=torch.long))
        n = int(prop.tokens.shape[0])
        source = req.source
        t1 = time.perf_counter()
        ids = torch.cat([torch.tensor([req.anchor]), prop.tokens.cpu()])[None].to(self.target.device)
        out = self.target.forward(ids, req.cache, self.feature_layers)  # logits [1, n+1, V]
        logits = out.logits[0]
        if n == 0:
            verdict = Verdict(0, sample_token(logits[0], req.sampling, req.gen))
        else:
            verdict = verify(prop.tokens, prop.q_probs, prop.q_ids, logits, req.sampling, req.gen)
        a = verdict.accepted
        new = [int(t) for t in prop.tokens[:a]] + [verdict.token]
        emitted = self._emit(req, new)  # EOS, a stop string or max_new_tokens may cut `new`
        # commit: the anchor and the emitted accepted proposals enter the caches, except the
        # last emitted token (never fed to the target, as in the plain loop); nothing
        # rejected and nothing past a stop (spec s.5)
        keep = 1 + min(a, len(emitted) - 1)
        req.cache.rollback(pos + keep)
        self._commit_draft(req, prop, _features(out, keep), ids[0, :keep].tolist(), pos, n, a, source, t0, t1)
        self.observe_tree_gate(req)
        return emitted

    def cut_at_finish(self, req: Request, prop: Proposal) -> Proposal:
        """``prop`` (a chain) without the proposals after the first one that would end
        ``req``: an EOS token, or the token after which the output's text holds one of the
        request's stop strings (the same test as :meth:`_apply_stop`). Were they accepted,
        :meth:`_emit` would cut them, so verifying them would only cost time (a copy that
        runs past the end of a function and into the stop string ``\\ndef``, say).

        Exact whatever the proposals' q: the kept prefix is decided by the values of the
        tokens kept, never by a dropped token's own value, and every output the full chain
        can emit is emitted with the same probability (a rejection at or before the cut
        is drawn as before; past it the request has ended); see
        ``tests/test_engine_finish.py``. The stop-string test decodes the proposals and a few
        tokens before them (:class:`dspine.core.stopping.StopDetector`), not the output."""
        toks = prop.tokens.tolist()
        eos = self.target.eos_token_ids
        k = next((i + 1 for i, t in enumerate(toks) if t in eos), len(toks))
        if req.stops is not None and k > 0:
            n = len(req.out_ids)
            j = req.stops.first_stop(req.out_ids + toks[:k], n)
            k = k if j is None else j - n
        if k >= len(toks):
            return prop
        prop.tokens = prop.tokens[:k]
        prop.q_ids = prop.q_ids[:k] if prop.q_ids is not None else None
        prop.q_probs = prop.q_probs[:k] if prop.q_probs is not None else None
        return prop

    def observe_tree_gate(self, req: Request) -> None:
        """Tell the tree gate (:class:`dspine.control.tree_gate.TreeGate`) how ``req``'s last cycle
        went, when it drafted (a tree or a chain of its source)."""
        c = req.cycles[-1] if req.cycles else None
        if self.tree_gate is not None and c is not None and c.n > 0:
            self.tree_gate.observe(c.source, c.tree_nodes > 0, c.emitted, c.total_s)

    def _commit_draft(self, req: Request, prop: Proposal, feats: torch.Tensor, tokens: list[int], pos: int,
                      n: int, a: int, source: str, t0: float, t1: float, tree_nodes: int = 0) -> None:
        """The end of a cycle, chain or tree: the committed positions' features [keep, F*d]
        and token ids (the anchor and the accepted proposals, from ``pos``) reach the
        proposer, and the cycle is recorded (``n`` proposals, or the tree's depth)."""
        t2 = time.perf_counter()
        commit_s = 0.0
        if self.proposer is not None:
            self.proposer.commit(req.draft_state, feats, pos)
            _observe(self.proposer, req.draft_state, tokens, pos)
            commit_s = time.perf_counter() - t2
        req.count_acceptance(n, a)
        req.cycles.append(CycleRecord(n, a + 1, prop.draft_s + commit_s, prop.final_s, t2 - t1,
                                      time.perf_counter() - t0, source=source, tree_nodes=tree_nodes))

    def _step_tree(self, req: Request, prop: Proposal, t0: float) -> list[int]:
        """The verify and commit half of :meth:`step` for a draft tree (:mod:`dspine.trees`):
        one target forward over the anchor and the flattened tree, greedy longest path or
        multi-candidate speculative sampling, then only the accepted path's K/V (moved to
        consecutive slots), features and tokens are committed."""
        tree, pos, source = prop.tree, req.position, req.source
        t1 = time.perf_counter()
        ids = torch.cat([torch.tensor([req.anchor]), tree.tokens])[None].to(self.target.device)
        out = self.target.forward(ids, req.cache, self.feature_layers,
                                  tree=(tree.positions(), tree.attention_mask()))
        verify_s = time.perf_counter() - t1
        verdict = verify_tree(tree, out.logits[0], req.sampling, req.gen)
        if self.tree_sizer is not None:
            self.tree_sizer.observe(tree, verdict.path, verify_s)
        a = verdict.accepted
        path_tokens = [int(tree.tokens[c]) for c in verdict.path]
        emitted = self._emit(req, path_tokens + [verdict.token])
        keep = 1 + min(a, len(emitted) - 1)
        rows = ([0] + [c + 1 for c in verdict.path])[:keep]
        req.cache.keep_rows(pos, rows)
        feats = out.features[0, rows] if out.features is not None else torch.zeros(keep, 0)
        self._commit_draft(req, prop, feats, ids[0, rows].tolist(), pos, tree.max_depth, a, source, t0, t1,
                           tree_nodes=tree.size)
        return emitted

    def _emit(self, req: Request, new: list[int]) -> list[int]:
        """Append tokens, enforcing EOS, stop strings and max_new_tokens."""
        room = req.max_new_tokens - len(req.out_ids)
        new = new[:room]
        for i, t in enumerate(new):
            if t in self.target.eos_token_ids:
                new = new[: i + 1]
                req.finished, req.finish_reason = True, "stop"
                break
        start = len(req.out_ids)
        req.out_ids.extend(new)
        if req.stop:
            self._apply_stop(req, start)
        if not req.finished and len(req.out_ids) >= req.max_new_tokens:
            req.finished, req.finish_reason = True, "length"
        if not req.finished:
            req.anchor = req.out_ids[-1]
        if req.finished and not req.t_end:
            req.t_end = time.perf_counter()
            if self.proposer is not None:  # e.g. the output joins a cross-request cache
                self.proposer.finish(req.draft_state, req.prompt_ids, req.out_ids, req.finish_reason)
        return req.out_ids[start:]

    def _apply_stop(self, req: Request, start: int) -> None:
        """End the output at the first token after which the decoded text holds a stop
        string, checking the text after *each* token emitted this cycle, as the plain
        one-token loop does (an intermediate text can hold a stop that the whole block's
        text does not, e.g. U+FFFD of a UTF-8 character split over byte tokens).
        Incremental: each token decodes a few tokens, not the whole output
        (:class:`dspine.core.stopping.StopDetector`)."""
        k = req.stops.first_stop(req.out_ids, start)
        if k is None:
            req.stops.advance(req.out_ids)
            return
        del req.out_ids[k:]
        req.finished, req.finish_reason = True, "stop"

    def text_of(self, req: Request) -> str:
        """Decoded output, cut before the first stop string."""
        text = self.target.tokenizer.decode(req.out_ids, skip_special_tokens=True)
        cut = [text.find(s) for s in req.stop if s in text]
        return text[: min(cut)] if cut else text

    # -- whole generation ----------------------------------------------------------------
    def generate(self, prompt_ids: list[int], sampling: SamplingConfig | None = None,
                 max_new_tokens: int = 128, stop: list[str] | None = None,
                 on_text: Callable[[str], None] | None = None,
                 on_cycle: Callable[[Request], None] | None = None,
                 tenant: str | None = None) -> GenerationResult:
        """Generate for one prompt until EOS, a stop string or ``max_new_tokens``.

        ``on_text`` receives text deltas as they become final (streaming); ``on_cycle``
        is called with the request after every cycle (progress display); ``tenant`` as in
        :meth:`start`.
        """
        req = self.start(prompt_ids, sampling, max_new_tokens, stop, tenant=tenant)
        shown = 0
        hold = max((len(s) for s in req.stop), default=1) - 1
        while True:
            if on_text is not None:
                text = self.text_of(req)
                safe = len(text) if req.finished else max(shown, len(text) - hold)
                while safe > shown and text[safe - 1] == "\ufffd" and not req.finished:
                    safe -= 1
                if safe > shown:
                    on_text(text[shown:safe])
                    shown = safe
            if req.finished:
                break
            self.step(req)
            if on_cycle is not None:
                on_cycle(req)
        return self.result(req)

    def kernel_info(self) -> dict:
        """What this engine runs: target dtype, device and threads, the verification
        policy, and the proposer's kernels (``Proposer.kernel_info`` when it has one)."""
        prop = self.proposer.kernel_info() if self.proposer is not None else {}
        info = {"proposer": prop.get("proposer", "drafter") if self.proposer is not None else None,
                "target_dtype": str(self.target.dtype).replace("torch.", ""),
                "linear_backend": getattr(self.target, "linear_backend", "aten"),
                "target_weights": getattr(self.target, "weights_format", "as-is"),
                "target_runtime": getattr(self.target, "runtime_name", "hf"),
                "decode_path": getattr(getattr(self.target, "runtime", None), "decode_path", "python"),
                "device": str(self.target.device), "threads": torch.get_num_threads(),
                "verify_policy": self.verify_policy.name if self.proposer else None,
                "draft_tree": self.tree_info()}
        if self.tree_gate is not None:  # trees or chains, as measured so far (control/tree_gate.py)
            info["tree_gate"] = self.tree_gate.describe()
        info.update(prop)
        return info

    def tree_info(self) -> str:
        """``chain``, or the tree settings and whether this engine can use them."""
        if self.proposer is None or not self.tree.enabled:
            return "chain"
        if not self.proposer.supports_tree:
            return f"chain ({self.mode} drafter has no final-stage tables for a tree)"
        if not self.target.supports_tree(self.target.new_cache()):
            return f"chain (trees need the dense runtime; target runs {self.target.runtime_name})"
        if self.tree.size == "cost" and self.tree_sizer is None:
            return self.tree.describe().replace(", size=cost", ", size=fixed: --tree-size cost needs "
                                                "--verify-policy cost")
        return self.tree.describe()

    def result(self, req: Request) -> GenerationResult:
        """Collect text, ids and :class:`GenerationStats` of a finished request."""
        st = GenerationStats(prompt_tokens=len(req.prompt_ids), output_tokens=len(req.out_ids))
        st.cycles = len(req.cycles)
        st.accepted_length_mean = (sum(c.emitted for c in req.cycles) / st.cycles) if st.cycles else 0.0
        st.accepted_per_position = [a / d for a, d in zip(req.accepted_at, req.drafted_at)]
        st.ttft_s = req.t_first - req.t_start
        end = req.t_end or time.perf_counter()
        st.total_s = end - req.t_start
        st.decode_s = end - req.t_first
        st.tokens_per_second = (len(req.out_ids) - 1) / st.decode_s if st.decode_s > 0 and len(req.out_ids) > 1 else 0.0
        st.draft_s = sum(c.draft_s for c in req.cycles)
        st.final_stage_s = sum(c.final_s for c in req.cycles)
        st.verify_s = sum(c.verify_s for c in req.cycles)
        st.peak_memory_bytes = _peak_memory_bytes(self.target.device)
        st.verification_lengths = [c.n for c in req.cycles]
        if any(c.tree_nodes for c in req.cycles):
            st.tree_nodes = [c.tree_nodes for c in req.cycles]
        st.kernels = self.kernel_info()
        st.sources = source_stats(req.cycles)
        return GenerationResult(self.text_of(req), list(req.out_ids), self.mode,
                                req.finish_reason or "length", st)
