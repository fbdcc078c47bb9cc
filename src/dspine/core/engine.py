"""Decoding engine: prefill, then draft -> verify -> commit cycles (spec sections 1, 5, 6).

Modes: ``ar`` (plain target loop: each cycle verifies zero proposals and samples one
token with the plain sampler), ``dflash`` and ``dspine`` (a drafter proposes a block,
the target verifies it in one forward). All modes share one cycle
(:mod:`dspine.core.cycle`), the sampler and the stop logic, so the baseline and
speculation differ only in the proposer.

The engine holds what a cycle asks of it: the request lifecycle (:meth:`Engine.start`
validates and prefills), the plan (:meth:`Engine.plan`, :meth:`Engine.verification_length`),
the end of a chain at a finishing proposal (:meth:`Engine.cut_at_finish`) and emission
with EOS / stop / length handling (:meth:`Engine.emit`). State lives in
:class:`~dspine.core.request.Request` objects; :meth:`Engine.step` advances one request by
one cycle over its own cache, :class:`dspine.core.batch.BatchEngine` many over a slot cache.
"""
from __future__ import annotations

import resource
import time
from typing import Callable

import torch

from dspine.config import ENGINE_MODES, ConfigError, SamplingConfig
from dspine.control.base import Controller, FixedPolicy
from dspine.core.cycle import Cycle
from dspine.core.forward import OwnCachePass
from dspine.core.request import GenerationResult, GenerationStats, Request, source_stats
from dspine.core.sampling import make_generator, sample_token
from dspine.core.stopping import StopDetector
from dspine.proposers.base import Plan, Proposal, Proposer
from dspine.target.adapter import Target
from dspine.trees.tree import TreeSpec

MODES = ENGINE_MODES
#: labels an Engine accepts: the modes, and ``ngram`` (copies only, no drafter: the bench's own
#: prompt-lookup row; on the command line it is ``--proposer ngram``)
ENGINE_LABELS = MODES + ("ngram",)


class EngineError(ConfigError):
    """A request setting the engine refuses (the message names it: the
    :class:`~dspine.config.SpeculativeConfig` field, :attr:`field`, where it is one, else the
    argument)."""


def _peak_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # ru_maxrss is KiB on Linux


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
        EngineError: unknown mode, a speculative mode without a proposer (naming
            ``SpeculativeConfig.mode``), or a ``verify_policy`` that is not a
            :class:`~dspine.control.base.Controller`.
    """

    def __init__(self, target: Target, proposer: Proposer | None = None, mode: str = "dspine",
                 verify_policy: Controller | None = None, tree: TreeSpec | None = None):
        if mode not in ENGINE_LABELS:
            raise EngineError(f"SpeculativeConfig.mode {mode!r} is unknown; accepted: {', '.join(MODES)}", field="mode")
        if mode != "ar" and proposer is None:
            raise EngineError(f"SpeculativeConfig.mode {mode} needs a drafter", field="mode")
        self.target, self.proposer, self.mode = target, (proposer if mode != "ar" else None), mode
        if verify_policy is not None and not isinstance(verify_policy, Controller):
            raise EngineError(f"verify_policy must be a dspine.control.base.Controller, got {type(verify_policy).__name__}")
        self.verify_policy = verify_policy if verify_policy is not None else FixedPolicy()
        self.tree = tree or TreeSpec()
        # the controller decides the tree budget too (--tree-size cost: tree or chain, and
        # each tree's verified prefix, from its cost curve; control/priced.py)
        self.verify_policy.bind_trees(self.tree)
        # target feature layers the proposer reads; None (no capture) for ``ar`` and for
        # proposers without features (oracles in tests), which then get [n, 0] features
        fl = list(self.proposer.feature_layers) if self.proposer is not None else []
        self.feature_layers = fl if fl and self.proposer.needs_features else None
        self.max_positions = int(getattr(target.config, "max_position_embeddings", 1 << 30))
        # the decode cycle of one request over its own cache (BatchEngine runs the same
        # cycle over its slot cache's rows)
        self.cycle = Cycle(self, OwnCachePass(target, self.feature_layers))

    # -- request lifecycle -------------------------------------------------------------
    def start(self, prompt_ids: list[int], sampling: SamplingConfig | None = None,
              max_new_tokens: int = 128, stop: list[str] | None = None, tenant: str | None = None) -> Request:
        """Validate, prefill the target and the draft context, and emit the first token.

        ``tenant``: whose part of a cross-request output cache the request reads and, once
        finished, writes (:mod:`dspine.proposers.cache`; None = the default tenant).

        ``prompt_ids``: a list of ints (a 1-D tensor is taken as its values); ``stop``: a
        list of stop strings (one string is one stop string, not its characters).

        Raises:
            EngineError: empty prompt, ``max_new_tokens`` < 1, or prompt + max_new_tokens
                beyond the target's context window.
        """
        sampling = sampling or SamplingConfig()
        if isinstance(prompt_ids, torch.Tensor):
            if prompt_ids.dim() != 1:
                raise EngineError(f"prompt_ids must be a list of token ids or a 1-D tensor, got shape "
                                  f"{tuple(prompt_ids.shape)}")
            prompt_ids = prompt_ids.tolist()
        if isinstance(stop, str):
            stop = [stop]
        if not prompt_ids:
            raise EngineError("prompt is empty")
        if max_new_tokens < 1:
            raise EngineError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        if len(prompt_ids) + max_new_tokens > self.max_positions:
            raise EngineError(f"prompt ({len(prompt_ids)} tokens) + max_new_tokens {max_new_tokens} "
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
            self.proposer.observe(req.draft_state, list(prompt_ids), 0)
        first = sample_token(out.logits[0, -1], sampling, req.gen)
        req.t_first = time.perf_counter()
        self.emit(req, [first])
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

    def verification_length(self, req: Request) -> int:
        """This cycle's verification length for ``req``: :meth:`plan`, then the controller
        (``verify_policy(req, n_max)``), clamped to ``0..n_max``."""
        n_max = self.plan(req)
        if n_max > 0:
            n = int(self.verify_policy(req, n_max))
            return max(0, min(n, n_max))
        return n_max

    def step(self, req: Request) -> list[int]:
        """One cycle for ``req`` (:mod:`dspine.core.cycle`, a batch of one over its own
        cache): plan, propose, one target forward, verify, emit, commit.

        Returns the token ids emitted this cycle (after stop handling); raises what any
        step raises.
        """
        if req.finished:
            return []
        return self.cycle.run([req])[id(req)]

    def cut_at_finish(self, req: Request, prop: Proposal) -> Proposal:
        """``prop`` (a chain) without the proposals after the first one that would end
        ``req``: an EOS token, or the token after which the output's text holds one of the
        request's stop strings (the same test as :meth:`_apply_stop`). Were they accepted,
        :meth:`emit` would cut them, so verifying them would only cost time (a copy that
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

    def emit(self, req: Request, new: list[int]) -> list[int]:
        """Append tokens, enforcing EOS, stop strings and max_new_tokens; return those
        appended (a prefix of ``new``). Finishing calls :meth:`Proposer.finish`."""
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
        if self.proposer is not None:  # e.g. trees or chains, as measured so far (control/priced.py)
            info.update(self.verify_policy.describe())
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
        if self.tree.size == "cost" and not self.verify_policy.sizes_trees:
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
        st.accepted_lengths = [max(0, c.emitted - 1) for c in req.cycles]
        if any(c.tree_nodes for c in req.cycles):
            st.tree_nodes = [c.tree_nodes for c in req.cycles]
        st.kernels = self.kernel_info()
        st.sources = source_stats(req.cycles)
        return GenerationResult(self.text_of(req), list(req.out_ids), self.mode,
                                req.finish_reason or "length", st)
