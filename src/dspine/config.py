"""Configuration dataclasses, validated on construction.

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
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path


class ConfigError(ValueError):
    """A configuration value is invalid; the message names the field."""


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
        for f in ("target_hidden", "vocab_size", "block_size", "num_layers", "ffn", "num_heads",
                  "num_kv_heads", "head_dim", "window", "code_dim", "msg_dim", "head_topk", "coarse_k"):
            v = getattr(self, f)
            if not isinstance(v, int) or v <= 0:
                raise ConfigError(f"DSpineConfig.{f} must be a positive int, got {v!r}")
        if not 2 <= self.block_size <= MAX_BLOCK_SIZE:
            raise ConfigError(f"block size (--block-size) must be 2..{MAX_BLOCK_SIZE}, got {self.block_size}")
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
        """Build from a dict; unknown keys raise ConfigError naming them."""
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
        if not (self.temperature >= 0 and math.isfinite(self.temperature)):
            raise ConfigError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ConfigError(f"top_k must be an int >= 0, got {self.top_k}")
        if not (0 < self.top_p <= 1):
            raise ConfigError(f"top_p must be in (0, 1], got {self.top_p}")
        if not (0 <= self.min_p < 1):
            raise ConfigError(f"min_p must be in [0, 1), got {self.min_p}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or not 0 <= self.seed <= 2**63 - 1:
            raise ConfigError(f"seed must be an integer in 0 .. 2**63 - 1, got {self.seed!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
