"""Configuration dataclasses, validated on construction.

:class:`SpeculativeConfig` holds every setting of an engine and its default, once.

:class:`DSpineConfig` describes a drafter (spec sections 2-4); profiles:
``release`` (the released 27B-target checkpoint's dimensions, spec section 2) and
``small`` (for the default target SmolLM2-135M). ``bridge=False, final_stage=False,
block_causal=False`` is the DFlash-style baseline (spec section 10).

:class:`SamplingConfig` holds the decoding filters shared by the plain sampler and
the verifier (spec section 5).
"""
from __future__ import annotations

import json
import math
import numbers
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

from dspine.argtypes import (DEFAULT_TREE_BUDGET, DEFAULT_TREE_SIZE, MAX_NGRAM_PRIOR_WEIGHT, MAX_TREE_BUDGET,
                             PROPOSER_NAMES, TREE_SIZES)

#: the engine modes (``ar`` = the target alone; the drafters' architectures)
ENGINE_MODES = ("ar", "dflash", "dspine")
#: verification-length controllers by name (:func:`dspine.tune.controller.make_policy`)
VERIFY_POLICIES = ("fixed", "cost")


class ConfigError(ValueError):
    """A configuration value is invalid; the message names the field.

    ``field``: the field's name when one field is at fault (a command line adds its flag,
    ``--`` + the name with ``-``), else None.
    """

    def __init__(self, message: str, field: str | None = None):
        super().__init__(message)
        self.field = field


MAX_BLOCK_SIZE = 64  # largest block a drafter may have (spec default 16; memory grows with B)


@dataclass
class DSpineConfig:
    """Drafter configuration (spec sections 2-4). All widths in elements.

    Raises:
        ConfigError: on construction when a field is out of range or inconsistent.
    """

    target_hidden: int = 576  # d_target (drafter hidden d equals it: z = H . norm_f(h))
    vocab_size: int = 49152  # V, shared with the target
    feature_layers: list[int] = field(default_factory=lambda: [1, 8, 14, 21, 28])
    block_size: int = 16  # B: row 0 = anchor, rows 1..B-1 proposals
    num_layers: int = 2  # L_d
    ffn: int = 1536
    num_heads: int = 9
    num_kv_heads: int = 3
    head_dim: int = 64
    window: int = 2048  # sliding attention window over context positions
    rope_theta: float = 100000.0
    code_dim: int = 256  # d_c
    msg_dim: int = 128  # d_m
    rms_eps: float = 1e-6
    head_topk: int = 16  # K candidates per row
    coarse_k: int = 128  # K_c coarse pool
    bridge: bool = True
    final_stage: bool = True
    block_causal: bool = True  # DSpine: causal inside the block; DFlash: bidirectional
    row_embedding: bool = True  # learned per-row embedding (project choice, spec s.9)
    qk_norm: bool = False  # per-head q/k RMSNorm before RoPE (Qwen3; z-lab DFlash as engines run it)
    mode: str = "dspine"  # "dspine" | "dflash" (informational; flags decide)
    target_name: str = ""  # target the checkpoint belongs to (informational)

    def __post_init__(self) -> None:
        for f in ("rms_eps", "rope_theta"):  # numbers (a JSON int is fine), never bool or str
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, numbers.Real):
                raise ConfigError(f"DSpineConfig.{f} must be a number, got {v!r}")
        if not (math.isfinite(self.rms_eps) and self.rms_eps > 0):
            raise ConfigError(f"DSpineConfig.rms_eps must be positive, got {self.rms_eps}")
        for f in ("bridge", "final_stage", "block_causal", "row_embedding", "qk_norm"):
            if not isinstance(getattr(self, f), bool):
                raise ConfigError(f"DSpineConfig.{f} must be true or false, got {getattr(self, f)!r}")
        for f in ("mode", "target_name"):
            if not isinstance(getattr(self, f), str):
                raise ConfigError(f"DSpineConfig.{f} must be a string, got {getattr(self, f)!r}")
        if not isinstance(self.feature_layers, (list, tuple)):
            raise ConfigError(f"DSpineConfig.feature_layers must be a list of layer indices, got {self.feature_layers!r}")
        for f in ("target_hidden", "vocab_size", "block_size", "num_layers", "ffn", "num_heads",
                  "num_kv_heads", "head_dim", "window", "code_dim", "msg_dim", "head_topk", "coarse_k"):
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise ConfigError(f"DSpineConfig.{f} must be a positive int, got {v!r}")
        if not 2 <= self.block_size <= MAX_BLOCK_SIZE:
            raise ConfigError(f"block size must be 2..{MAX_BLOCK_SIZE}, got {self.block_size} "
                              f"(SpeculativeConfig.block_size)", field="block_size")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(f"DSpineConfig.num_heads ({self.num_heads}) must be a multiple of "
                              f"num_kv_heads ({self.num_kv_heads})")
        if not self.feature_layers or any((not isinstance(l, int)) or l < 0 for l in self.feature_layers):
            raise ConfigError(f"DSpineConfig.feature_layers must be non-negative ints, got {self.feature_layers}")
        if self.head_topk > self.coarse_k or self.coarse_k > self.vocab_size:
            raise ConfigError(f"DSpineConfig needs head_topk <= coarse_k <= vocab_size, got "
                              f"{self.head_topk}, {self.coarse_k}, {self.vocab_size}")
        if self.final_stage and not self.bridge:
            raise ConfigError("DSpineConfig.final_stage refines the bridge's last write: it needs bridge=True")
        if self.mode not in ("dspine", "dflash"):
            raise ConfigError(f"DSpineConfig.mode must be 'dspine' or 'dflash', got {self.mode!r}")
        if not math.isfinite(self.rope_theta) or self.rope_theta <= 0:
            raise ConfigError(f"DSpineConfig.rope_theta must be positive, got {self.rope_theta}")

    # -- profiles ----------------------------------------------------------------------
    @classmethod
    def release(cls) -> "DSpineConfig":
        """Released checkpoint dimensions (spec section 2): 27B hybrid target."""
        return cls(target_hidden=5120, vocab_size=248320, feature_layers=[1, 16, 31, 46, 61],
                   block_size=16, num_layers=5, ffn=17408, num_heads=32, num_kv_heads=8,
                   head_dim=128, window=8192, rope_theta=1e7, code_dim=1024, msg_dim=512,
                   head_topk=16, coarse_k=128, row_embedding=False, target_name="Qwen3.8-27B")

    @classmethod
    def small(cls, **overrides) -> "DSpineConfig":
        """Small profile for the default target SmolLM2-135M (hidden 576, vocab 49152)."""
        return cls(**overrides)

    @classmethod
    def for_target(cls, target, profile: str = "small", mode: str = "dspine", **overrides) -> "DSpineConfig":
        """A config matching ``target``'s hidden size, vocabulary and layer count.

        ``mode="dflash"`` switches bridge/final stage off and block attention to
        bidirectional (the DFlash-style baseline, spec section 10).
        """
        if profile == "release":
            base = asdict(cls.release())
        elif profile == "small":
            base = asdict(cls())
        else:
            raise ConfigError(f"unknown drafter profile {profile!r}; accepted: release, small, or a config path")
        d = target.hidden_size
        base.update(target_hidden=d, vocab_size=target.vocab_size,
                    feature_layers=target.default_feature_layers(5),
                    target_name=target.name)
        if profile == "small":
            heads = max(1, d // 64)
            kv = heads // 3 if heads % 3 == 0 and heads >= 3 else (heads // 2 if heads % 2 == 0 and heads >= 2 else heads)
            base.update(num_heads=heads, num_kv_heads=max(1, kv), head_dim=64 if d >= 64 else d,
                        ffn=int(d * 8 / 3) // 16 * 16 or 16,
                        code_dim=min(256, max(16, d // 2)), msg_dim=min(128, max(8, d // 4)),
                        coarse_k=min(128, target.vocab_size), head_topk=min(16, target.vocab_size))
        base.update(dflash_flags() if mode == "dflash" else {"mode": "dspine"})
        base.update(overrides)
        return cls(**base)

    # -- (de)serialization --------------------------------------------------------------
    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)

    @classmethod
    def from_dict(cls, d: dict) -> "DSpineConfig":
        """Build from a dict; unknown keys, a value of the wrong type or out of range raise
        ConfigError naming them."""
        if not isinstance(d, dict):
            raise ConfigError(f"a drafter config must be a JSON object of DSpineConfig fields, got {type(d).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ConfigError(f"unknown DSpineConfig fields {unknown}")
        return cls(**d)

    @classmethod
    def load(cls, path: str | Path) -> "DSpineConfig":
        p = Path(path)
        if p.is_dir():
            p = p / "config.json"
        try:
            return cls.from_dict(json.loads(p.read_text()))
        except FileNotFoundError:
            raise ConfigError(f"drafter config not found: {p}") from None
        except json.JSONDecodeError as e:
            raise ConfigError(f"drafter config {p} is not valid JSON: {e}") from None


def dflash_flags() -> dict:
    """Field overrides that turn a DSpine config into the DFlash-style baseline."""
    return dict(bridge=False, final_stage=False, block_causal=False, mode="dflash")


def engine_compatible_flags() -> dict:
    """Overrides that, on top of :func:`dflash_flags`, make a DFlash-style drafter exactly
    the z-lab DFlash architecture that vLLM (``DFlashDraftModel``) and llama.cpp
    (``dflash``) run: per-head q/k RMSNorm, no per-row embedding."""
    return dict(qk_norm=True, row_embedding=False)


@dataclass
class SamplingConfig:
    """Decoding settings (spec section 5). ``temperature == 0`` means greedy.

    Filters are applied in the order temperature -> top-k -> top-p -> min-p, by the
    plain sampler and by the verifier alike (:mod:`dspine.core.sampling`).

    Raises:
        ConfigError: naming the field when out of range.
    """

    temperature: float = 0.0
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off
    min_p: float = 0.0  # 0 = off
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("temperature", "top_p", "min_p"):  # a str, None or bool is not a number here
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, numbers.Real):
                raise ConfigError(f"{name} must be a number, got {v!r}", name)
        if not (self.temperature >= 0 and math.isfinite(self.temperature)):
            raise ConfigError(f"temperature must be a finite number >= 0, got {self.temperature}", "temperature")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise ConfigError(f"top_k must be an int >= 0, got {self.top_k!r}", "top_k")
        if not (0 < self.top_p <= 1):
            raise ConfigError(f"top_p must be in (0, 1], got {self.top_p}", "top_p")
        if not (0 <= self.min_p < 1):
            raise ConfigError(f"min_p must be in [0, 1), got {self.min_p}", "min_p")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or not 0 <= self.seed <= 2**63 - 1:
            raise ConfigError(f"seed must be an integer in 0 .. 2**63 - 1, got {self.seed!r}", "seed")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass
class SpeculativeConfig:
    """Every setting of a speculative-decoding engine, each default given once here.

    ``dspine generate`` / ``serve`` / ``bench`` map their flags onto these fields (a flag
    is the field's name with ``-``, e.g. ``--verify-policy``); a library user gets the
    same engine with :func:`dspine.build.build_engine` ``(SpeculativeConfig())``.

    Fields:
        target: a registered target name (``dspine.target.registry``) or ``random:<arch>``.
        mode: ``ar`` (no drafting), ``dspine`` or ``dflash`` (the drafter's architecture).
        drafter: a checkpoint directory, ``random`` (untrained, seeded) or None (the
            checkpoint shipped for ``target`` and ``mode``).
        proposer: ``hybrid`` (a copy where the context repeats, the drafter elsewhere),
            ``drafter`` or ``ngram`` (copies alone, no drafter loaded).
        verify_policy: ``cost`` (verify as many proposals as pay off on this machine) or
            ``fixed`` (the whole block every cycle).
        dtype, device: of the target and the drafter.
        block_size: the drafter's block (None: the checkpoint's).
        seed: of a ``random`` drafter.
        concurrency: the most requests decoded together (checked by the guards).
        head_kernel, drafter_linears, draft_vocab: how the drafter proposes
            (``auto``: measured on this machine; the output is the target's either way).
        linear_backend, runtime, target_weights: how the target runs (``auto``: measured).
        ngram_max, ngram_min: longest / shortest suffix match of a copy (tokens).
        ngram_cache_tokens: > 0: a cross-request cache of earlier outputs for copies.
        copy_bonus: fuse copies into the DSpine final stage with this score bonus (None: off).
        ngram_prior, ngram_prior_weight: score the DSpine final stage's chain with an n-gram
            memory of the target's regenerated answers (``off``, ``auto`` or a data
            directory; :mod:`dspine.drafter.ngram_prior`) at this weight.
        tree_budget, tree_shape, tree_size: draft trees of the drafter modes (budget 0:
            chains; shape ``dynamic`` or widths per depth ``4,2,1``; size ``fixed`` or
            ``cost``), :class:`dspine.trees.TreeSpec`.
        persist: the cost policy starts from (and may save) the acceptance profile of
            earlier runs on this machine.

    Raises:
        ConfigError: a value of the wrong type or range; the message names the field
            (:attr:`ConfigError.field`) and the value. Choices that depend on what is
            installed (kernels, runtimes) are checked by ``build_engine``.
    """

    target: str = "smollm2-135m"
    mode: str = "dspine"
    drafter: str | None = None
    proposer: str = "hybrid"
    verify_policy: str = "cost"
    dtype: str = "float32"
    device: str = "cpu"
    block_size: int | None = None
    seed: int = 0
    concurrency: int = 1
    head_kernel: str = "auto"
    drafter_linears: str = "auto"
    draft_vocab: str = "auto"
    linear_backend: str = "auto"
    runtime: str = "auto"
    target_weights: str = "as-is"
    ngram_max: int = 4
    ngram_min: int = 1
    ngram_cache_tokens: int = 0
    copy_bonus: float | None = None
    ngram_prior: str = "off"
    ngram_prior_weight: float = 0.5
    tree_budget: int = DEFAULT_TREE_BUDGET
    tree_shape: str = "dynamic"
    tree_size: str = DEFAULT_TREE_SIZE
    persist: bool = False

    def __post_init__(self) -> None:
        def bad(name: str, why: str):
            return ConfigError(f"SpeculativeConfig.{name} {getattr(self, name)!r} {why}", field=name)

        for name in ("target", "mode", "proposer", "verify_policy", "dtype", "device", "head_kernel",
                     "drafter_linears", "draft_vocab", "linear_backend", "runtime", "target_weights",
                     "tree_shape", "tree_size", "ngram_prior"):
            if not isinstance(getattr(self, name), str) or not getattr(self, name):
                raise bad(name, "must be a non-empty string")
        if self.drafter is not None and (not isinstance(self.drafter, str) or not self.drafter):
            raise bad("drafter", "must be a path, 'random' or None")
        if self.mode not in ENGINE_MODES:
            raise bad("mode", f"is unknown; accepted: {', '.join(ENGINE_MODES)}")
        if self.proposer not in PROPOSER_NAMES:
            raise bad("proposer", f"is unknown; accepted: {', '.join(PROPOSER_NAMES)}")
        if self.verify_policy not in VERIFY_POLICIES:
            raise bad("verify_policy", f"is unknown; accepted: {', '.join(VERIFY_POLICIES)}")
        if self.tree_size not in TREE_SIZES:
            raise bad("tree_size", f"is unknown; accepted: {', '.join(TREE_SIZES)}")
        ints = {"seed": 0, "concurrency": 1, "ngram_max": 1, "ngram_min": 1, "ngram_cache_tokens": 0,
                "tree_budget": 0}
        for name, lo in ints.items():
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < lo:
                raise bad(name, f"must be an integer >= {lo}")
        if self.seed > 2**63 - 1:
            raise bad("seed", "must be at most 2**63 - 1")
        if self.block_size is not None and (isinstance(self.block_size, bool) or not isinstance(self.block_size, int)
                                            or not 2 <= self.block_size <= MAX_BLOCK_SIZE):
            raise bad("block_size", f"must be an integer in 2..{MAX_BLOCK_SIZE} (or unset: the drafter's own block)")
        if self.ngram_min > self.ngram_max:
            raise bad("ngram_min", f"must be <= SpeculativeConfig.ngram_max ({self.ngram_max})")
        if self.tree_budget > MAX_TREE_BUDGET:
            raise bad("tree_budget", f"must be at most {MAX_TREE_BUDGET}")
        if self.copy_bonus is not None and (isinstance(self.copy_bonus, bool) or not isinstance(self.copy_bonus, (int, float))
                                            or not (math.isfinite(self.copy_bonus) and self.copy_bonus >= 0)):
            raise bad("copy_bonus", "must be None or a finite number >= 0")
        w = self.ngram_prior_weight
        if isinstance(w, bool) or not isinstance(w, (int, float)) or not 0 <= w <= MAX_NGRAM_PRIOR_WEIGHT:
            raise bad("ngram_prior_weight", f"must be a number in 0..{MAX_NGRAM_PRIOR_WEIGHT:g} (a weight on "
                                            f"log-probabilities; float32 scores overflow far above that)")
        if not isinstance(self.persist, bool):
            raise bad("persist", "must be True or False")

    def replace(self, **changes) -> "SpeculativeConfig":
        """A copy with ``changes`` (validated again)."""
        from dataclasses import replace

        return replace(self, **changes)
