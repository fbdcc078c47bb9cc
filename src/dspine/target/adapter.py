"""Target adapter: a Hugging Face causal LM with feature capture and a rollback-able cache.

The adapter exposes what speculative decoding needs from the target (spec sections
1, 3, 5, 6): logits for every processed position, the hidden states of the
configured feature layers (the drafter's context), the frozen input embedding and
output head, and a KV cache with explicit commit/rollback to an accepted length.

Feature layer id ``l`` means the output of decoder layer ``l`` (0-based), i.e.
``hidden_states[l + 1]`` of transformers' ``output_hidden_states``.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from dspine.config import ConfigError
from dspine.target.cache import TargetCache  # noqa: F401 (re-export: the cache of a Target)
from dspine.target.registry import DEFAULT_TARGET, TargetError, resolve_target

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

# Tiny random-weight configs per architecture (for tests and debugging).
_RANDOM_ARCHS = {
    "llama": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16),
    "qwen2": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2),
    "qwen3": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16),
}


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    """Map ``float32|bfloat16|float16`` to a torch dtype. Raises ConfigError naming
    ``SpeculativeConfig.dtype``."""
    if isinstance(name, torch.dtype):
        return name
    if name not in _DTYPES:
        raise ConfigError(f"SpeculativeConfig.dtype {name!r} is not supported; accepted: {sorted(_DTYPES)}",
                          field="dtype")
    return _DTYPES[name]


class PromptTextError(UnicodeError):
    """A prompt that is not valid Unicode text (a ValueError too: command lines report it)."""


def check_prompt_text(prompt: str) -> None:
    """Raises :class:`PromptTextError` where ``prompt`` is not valid Unicode text (lone
    surrogates: what Python makes of command-line bytes that are not UTF-8)."""
    try:
        prompt.encode("utf-8")
    except UnicodeEncodeError as e:
        raise PromptTextError(f"prompt is not valid UTF-8 text (character {e.start}: "
                              f"{prompt[e.start:e.start + 1]!r}); convert it first, e.g. "
                              f"`iconv -f latin1 -t utf-8`") from None


class ByteTokenizer:
    """Minimal tokenizer for random targets: UTF-8 bytes modulo the vocabulary size.

    ``eos_token_id`` is 0; ids >= 256 decode to nothing. Not reversible when
    ``vocab_size < 256`` (bytes fold), which is fine for random-weight debugging.
    """

    chat_template = None

    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size
        self.eos_token_id = 0
        self.eos_token = "\x00"

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [b % self.vocab_size for b in text.encode("utf-8")] or [1 % self.vocab_size]

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        return bytes(int(i) for i in ids if 0 < int(i) < 256).decode("utf-8", errors="replace")

    def __len__(self) -> int:
        return self.vocab_size


def build_random_model(arch: str, vocab_size: int = 256, seed: int = 0, **overrides) -> nn.Module:
    """A tiny random-weight causal LM of transformers architecture ``arch`` (seeded).

    Raises:
        TargetError: the architecture is unknown here (hybrids live in ``dspine.target.random_hybrid``).
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    if arch in ("qwen3_5", "qwen3_next"):
        from dspine.target.random_hybrid import build_random_hybrid  # hybrid targets, spec section 6
        return build_random_hybrid(arch, vocab_size=vocab_size, seed=seed, **overrides)
    if arch not in _RANDOM_ARCHS:
        raise TargetError(f"unknown random target architecture {arch!r}; known: "
                          f"{sorted(_RANDOM_ARCHS) + ['qwen3_5', 'qwen3_next']}")
    kw = dict(_RANDOM_ARCHS[arch])
    kw.update(overrides)
    cfg = AutoConfig.for_model(arch, vocab_size=vocab_size, max_position_embeddings=4096,
                               tie_word_embeddings=False, bos_token_id=1, eos_token_id=0,
                               pad_token_id=0, **kw)
    g = torch.random.fork_rng()
    with g:
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(cfg)
        # Random LMs are near-uniform; sharpen the head so distributions are peaked and
        # speculative paths are exercised with realistic acceptance.
        with torch.no_grad():
            model.get_output_embeddings().weight.mul_(8.0)
    return model


@dataclass
class TargetOutput:
    """Result of one target forward.

    logits:   [b, n_keep, V] float32 (the last ``n_keep`` positions only).
    features: [b, n, F * d_target] in the target dtype (concatenated feature layers),
              or None when not requested.
    """

    logits: torch.Tensor
    features: torch.Tensor | None


class Target:
    """A loaded target LM (see module docstring). Use :func:`load_target` to build one."""

    def __init__(self, model: nn.Module, tokenizer, name: str, path: str | None = None):
        self.model = model.eval()
        for p in self.model.parameters():
            p.requires_grad_(False)
        # The head gets a contiguous input: a sliced hidden state (logits_to_keep) would
        # make F.linear copy the whole [V, d] head per batch row on CPU.
        model.get_output_embeddings().register_forward_pre_hook(
            lambda mod, args: (args[0].contiguous(),) + tuple(args[1:]))
        self.tokenizer = tokenizer
        self.name = name
        self.path = path
        cfg = model.config
        from dspine.target.hybrid_arch import hybrid_family  # refuses unknown hybrids / non-fp32 recurrent state
        self.hybrid: str | None = hybrid_family(cfg)  # None (dense), "qwen3_5" or "qwen3_next"
        self.config = getattr(cfg, "text_config", None) or cfg
        self.hidden_size: int = self.config.hidden_size
        self.vocab_size: int = model.get_output_embeddings().weight.shape[0]
        self.num_layers: int = self.config.num_hidden_layers
        self.dtype: torch.dtype = next(model.parameters()).dtype
        self.device: torch.device = next(model.parameters()).device
        eos = getattr(tokenizer, "eos_token_id", None)
        gen_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
        ids = set()
        for e in (eos, gen_eos):
            if isinstance(e, int):
                ids.add(e)
            elif isinstance(e, (list, tuple)):
                ids.update(int(x) for x in e)
        self.eos_token_ids: frozenset[int] = frozenset(ids)
        self.runtime = None  # a DenseRuntime (dspine.runtime.dense) once set_runtime("dense")
        self.runtime_name = "hf"

    def set_runtime(self, name: str) -> str:
        """Run forwards through transformers (``hf``) or :mod:`dspine.runtime.dense`
        (``dense``); returns the name. Caches made before keep working with their runtime.

        Raises:
            ConfigError: an unknown name, or ``dense`` for a target it cannot run (naming
                ``SpeculativeConfig.runtime``).
        """
        if name == "hf":
            self.runtime = None
        elif name == "dense":
            from dspine.runtime.dense import DenseRuntime
            self.runtime = DenseRuntime(self.model)
        else:
            raise ConfigError(f"SpeculativeConfig.runtime {name!r} is unknown; accepted: auto, hf, dense",
                              field="runtime")
        self.runtime_name = name
        return name

    # -- frozen parts shared with the drafter -------------------------------------------
    def output_head(self) -> torch.Tensor:
        """Output head weight H, [V, d_target] in the target dtype (frozen, shared)."""
        return self.model.get_output_embeddings().weight

    def input_embeddings(self) -> nn.Embedding:
        """The target's input embedding table, [V, d_target] (frozen, shared)."""
        return self.model.get_input_embeddings()

    def default_feature_layers(self, n: int = 5) -> list[int]:
        """``n`` layer ids spread from layer 1 to layer L-2 (release: 1,16,31,46,61 of 64)."""
        L = self.num_layers
        if L <= n:
            return list(range(L))
        lo, hi = 1, L - 2
        return sorted({round(lo + k * (hi - lo) / (n - 1)) for k in range(n)})

    # -- forward ------------------------------------------------------------------------
    def new_cache(self) -> TargetCache:
        """An empty cache for one request (:class:`dspine.target.replay_ssm.ReplayCache` for hybrid targets)."""
        if self.hybrid is not None:
            from dspine.target.replay_ssm import ReplayCache
            return ReplayCache(self.model)
        if self.runtime is not None:
            return self.runtime.new_cache()
        return TargetCache(self.model)

    @staticmethod
    def supports_tree(cache) -> bool:
        """Whether ``cache`` can verify a draft tree in one forward (the dense runtime's
        caches; transformers' caches and hybrid targets verify chains)."""
        return hasattr(cache, "keep_rows")

    @torch.no_grad()
    def forward(self, input_ids: torch.Tensor, cache: TargetCache | None,
                feature_layers: list[int] | None, logits_to_keep: int = 0,
                tree: tuple[torch.Tensor, torch.Tensor] | None = None) -> TargetOutput:
        """Run the target over ``input_ids`` [b, n] (int64) appended to ``cache``.

        Args:
            logits_to_keep: 0 keeps logits for all n positions, k > 0 the last k.
            feature_layers: layer ids whose outputs are concatenated as features; None
                skips feature capture.
            tree: (offsets [n], mask [n, n]) of a flattened draft tree (see
                :meth:`dspine.runtime.dense.DenseRuntime.forward`); only with a cache that
                :meth:`supports_tree`.
        Returns:
            :class:`TargetOutput` with float32 logits.
        Raises:
            ConfigError: ``tree`` with a cache that cannot hold a tree (naming
                ``SpeculativeConfig.runtime``).
        """
        if cache is not None and not isinstance(cache, TargetCache):  # a DenseCache
            logits, feats = cache.rt.forward(input_ids.to(self.device), cache, feature_layers, logits_to_keep,
                                             tree=tree)
            return TargetOutput(logits=logits.float(), features=feats)
        if tree is not None:
            raise ConfigError("draft trees need the dense runtime (SpeculativeConfig.runtime='dense'); this target "
                              f"runs {self.runtime_name!r}", field="runtime")
        out = self.model(input_ids=input_ids.to(self.device),
                         past_key_values=None if cache is None else cache.kv,
                         use_cache=cache is not None,
                         output_hidden_states=bool(feature_layers),
                         logits_to_keep=logits_to_keep)
        feats = None
        if feature_layers:
            hs = out.hidden_states
            feats = torch.cat([hs[l + 1] for l in feature_layers], dim=-1)  # [b, n, F*d]
        return TargetOutput(logits=out.logits.float(), features=feats)

    def encode_prompt(self, prompt: str, chat: bool = False) -> list[int]:
        """Token ids of ``prompt``; with ``chat`` the tokenizer's chat template is applied.

        Raises:
            ValueError: ``prompt`` is not a string; :class:`PromptTextError` (a ValueError and
                UnicodeError) where it is not valid Unicode text (lone surrogates: what Python
                makes of command-line bytes that are not UTF-8); a target without a chat
                template with ``chat``.
        """
        if not isinstance(prompt, str):
            raise ValueError(f"prompt must be a str, got {type(prompt).__name__}")
        check_prompt_text(prompt)
        tok = self.tokenizer
        if chat:
            if getattr(tok, "chat_template", None) is None:
                raise ValueError(f"chat=True: target {self.name!r} has no chat template")
            ids = tok.apply_chat_template([{"role": "user", "content": prompt}],
                                          add_generation_prompt=True, tokenize=True)
            if isinstance(ids, dict) or hasattr(ids, "input_ids"):
                ids = ids["input_ids"]
            return [int(i) for i in ids]
        return [int(i) for i in tok.encode(prompt, add_special_tokens=False)]


def load_target(name_or_path: str = DEFAULT_TARGET, dtype: str | torch.dtype = "float32",
                device: str = "cpu", vocab_size: int = 256, seed: int = 0, **random_overrides) -> Target:
    """Load a target by name, path or ``random:<arch>`` (see :mod:`dspine.target.registry`).

    Args:
        dtype: ``float32`` (exactness tests) or ``bfloat16``.
        vocab_size, seed, random_overrides: only for ``random:<arch>``.
    Raises:
        TargetError: unknown name/path or architecture.
        ConfigError: unsupported dtype (naming ``SpeculativeConfig.dtype``).
    """
    dt = parse_dtype(dtype)
    resolved = resolve_target(name_or_path)
    if isinstance(resolved, str) and resolved.startswith("random:"):
        arch = resolved.split(":", 1)[1]
        model = build_random_model(arch, vocab_size=vocab_size, seed=seed, **random_overrides)
        model = model.to(device=device, dtype=dt)
        return Target(model, ByteTokenizer(vocab_size), name=name_or_path)
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # no "Loading weights" bar on every start
    path = Path(resolved)
    try:
        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dt).to(device)
        tok = AutoTokenizer.from_pretrained(str(path))
    except (OSError, ValueError, json.JSONDecodeError) as e:
        raise TargetError(f"SpeculativeConfig.target {name_or_path!r}: could not load model from {path}: {e}",
                          field="target") from e
    return Target(model, tok, name=name_or_path, path=str(path))
