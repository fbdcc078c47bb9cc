"""What a request is and what it reports: the state one decode cycle reads and commits
(:class:`Request`), one cycle's record (:class:`CycleRecord`, :class:`BatchCycle`) and a
finished request's result (:class:`GenerationResult`, :class:`GenerationStats`).

Plain data: nothing here runs the target or a proposer (:mod:`dspine.core.cycle` does).
"""
from __future__ import annotations

import weakref
from dataclasses import asdict, dataclass, field

import torch

from dspine.config import SamplingConfig
from dspine.core.stopping import StopDetector
from dspine.target.adapter import TargetCache


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
    # of ``draft_s``: projecting the draft context of positions committed in earlier cycles
    # (lazy commits, paid by whichever cycle drafts next), and how many positions
    context_s: float = 0.0
    context_rows: int = 0


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
    # per cycle: proposals accepted (emitted - 1; at most the verification length)
    accepted_lengths: list[int] = field(default_factory=list)
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
    #: per-controller state of this request (controller -> its statistics), kept only while
    #: the controller lives (:class:`dspine.control.policy.CostModelPolicy`)
    control_state: weakref.WeakKeyDictionary = field(default_factory=weakref.WeakKeyDictionary)

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


@dataclass
class BatchCycle:
    """One cycle over a batch of requests: how many ran, its phases (s: drafting and final
    stage summed over the requests, the shared target forward, the whole cycle) and the
    tokens it emitted."""

    batch: int
    draft_s: float
    final_s: float
    verify_s: float
    total_s: float
    emitted: int


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
