"""What a benchmark run compares under: one :class:`BenchConfig` for every mode, and its checks.

:class:`DecodeSetting` (:data:`GREEDY`, :data:`SAMPLED`) names a decoding setting shared by
every mode; :func:`smoke_config` is the ``--smoke`` run. The checks made before anything
is loaded: :func:`parse_modes` (``--modes``), :func:`require_batched_engine`
(``--concurrency``) and :func:`resolve_drafters` (the drafter of each speculative mode).
The protocol that runs a config is :mod:`dspine.bench.harness`.
"""
from __future__ import annotations

import importlib.util
from dataclasses import asdict, dataclass, field

from dspine.argtypes import DEFAULT_TREE_BUDGET, DEFAULT_TREE_SIZE
from dspine.bench.fairness import BenchError
from dspine.bench.llama_cpp import LLAMA_MODES
from dspine.bench.modes import ALL_MODES, drafter_kind
from dspine.bench.workloads import WORKLOAD_NAMES
from dspine.config import SamplingConfig


@dataclass(frozen=True)
class DecodeSetting:
    """A named decoding setting shared by every mode (the seed varies per repeat)."""

    name: str
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0

    def sampling(self, seed: int = 0) -> SamplingConfig:
        return SamplingConfig(self.temperature, self.top_k, self.top_p, self.min_p, seed)


GREEDY = DecodeSetting("greedy")
SAMPLED = DecodeSetting("sampled", temperature=0.7, top_p=0.95)


@dataclass
class BenchConfig:
    """Everything a run compares under; one object for all modes."""

    target: str = "smollm2-135m"
    dtype: str = "float32"
    device: str = "cpu"
    threads: int | None = None
    modes: tuple[str, ...] = ALL_MODES
    drafters: dict = field(default_factory=dict)  # mode -> checkpoint dir | "random"
    block_size: int | None = None  # random drafters only
    pld_tokens: int = 10
    verify_policy: str = "cost"  # verification-length policy of the drafter modes
    proposer: str = "hybrid"  # what dflash / dspine propose with: drafter | ngram | hybrid
    linear_backend: str = "auto"  # the shared target's linears (dspine.runtime.packed), every mode alike
    runtime: str = "auto"  # the shared target's forward (dspine.runtime.select); hf/hf-pld run transformers' generate
    tree_budget: int = DEFAULT_TREE_BUDGET  # draft-tree nodes per cycle of the drafter modes (dspine.trees); 0 = chains
    tree_shape: str = "dynamic"  # dynamic | widths per depth such as 4,2,1
    tree_size: str = DEFAULT_TREE_SIZE  # fixed | cost (dspine.control.tree_sizer)
    # how the drafter modes' drafter runs, as generate's defaults (dspine.tune.drafter,
    # dspine.drafter.vocab, dspine.tune.head): the speed of what users run
    drafter_linears: str = "auto"  # auto | float32 | q8
    draft_vocab: str = "auto"  # auto | full | subset
    head_kernel: str = "auto"  # auto | int8 | bfloat16 | exact | blockq
    workloads: tuple[str, ...] = WORKLOAD_NAMES
    limit: int | None = None
    max_new_tokens: int | None = None
    context_tokens: int = 2048
    settings: tuple[DecodeSetting, ...] = (GREEDY, SAMPLED)
    repeats: int = 3
    warmup: int = 1
    warmup_tokens: int | None = None
    seed: int = 0
    request_timeout_s: float = 600.0
    code_timeout_s: float = 10.0
    concurrency: tuple[int, ...] = (1,)
    smoke: bool = False
    llama_cpp: str | None = None  # llama-server binary or llama.cpp tree (modes llama-cpp*; $DSPINE_LLAMA_CPP)
    gguf: str | None = None  # the GGUF llama.cpp serves (default: the target's own source GGUF)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["settings"] = [asdict(s) for s in self.settings]
        return d


#: Per-request timeout of ``--smoke`` (16 tokens): generous, because a slow CPU or a busy
#: machine must not fail the smoke run; ``--request-timeout`` overrides it.
SMOKE_TIMEOUT_S = 300.0


def smoke_config(**overrides) -> BenchConfig:
    """The ``--smoke`` run: real default target, 1 prompt per workload, 16 new tokens,
    greedy, ar + dspine + dflash (the shipped drafters at their block size; random ones at
    block size 16 when none is shipped) + hf-pld, one thread."""
    base = dict(modes=("ar", "dspine", "dflash", "ngram", "hf-pld"), limit=1, max_new_tokens=16,
                settings=(GREEDY,), repeats=1, warmup=1, warmup_tokens=4, context_tokens=512,
                threads=1, block_size=None, request_timeout_s=SMOKE_TIMEOUT_S, smoke=True)
    base.update(overrides)
    return BenchConfig(**base)


def parse_modes(spec: str | list[str]) -> tuple[str, ...]:
    """Mode names of ``--modes`` (``all``: dspine's modes and the transformers peers; the
    llama.cpp peers :data:`LLAMA_MODES` need a build and are named explicitly)."""
    names = spec.split(",") if isinstance(spec, str) else list(spec)
    names = [n.strip() for n in names if n.strip()]
    if names == ["all"]:
        return ALL_MODES
    bad = [n for n in names if n not in ALL_MODES + LLAMA_MODES]
    if bad or not names:
        raise BenchError(f"--modes {','.join(bad) or '(empty)'}: unknown; accepted: "
                         f"{', '.join(ALL_MODES + LLAMA_MODES)} or all")
    if len(set(names)) != len(names):
        raise BenchError(f"--modes {','.join(names)}: a mode is listed twice")
    return tuple(names)


def require_batched_engine(concurrency: int) -> None:
    """Concurrency above 1 needs the batched engine (``dspine.core.batch``); refuse otherwise."""
    if concurrency < 1:
        raise BenchError(f"--concurrency {concurrency}: must be >= 1")
    if concurrency > 1 and importlib.util.find_spec("dspine.core.batch") is None:
        raise BenchError(f"--concurrency {concurrency}: this build has no batched engine "
                         f"(dspine.core.batch); only --concurrency 1 can be measured")


def resolve_drafters(cfg: BenchConfig) -> dict:
    """Drafter per speculative mode: explicit > shipped checkpoint > random (smoke only)."""
    from dspine.build import default_drafter_path

    out = {}
    wanted = {drafter_kind(m) for m in cfg.modes}
    for mode in ("dspine", "dflash"):
        if mode not in wanted:
            continue
        d = cfg.drafters.get(mode)
        if d is None:
            p = default_drafter_path(cfg.target, mode)
            d = str(p) if p is not None else ("random" if cfg.smoke else None)
        if d is None:
            raise BenchError(f"no shipped {mode} drafter for --target {cfg.target!r}; pass "
                             f"--drafter-{mode} PATH (a trained checkpoint) or --drafter random")
        out[mode] = d
    return out
