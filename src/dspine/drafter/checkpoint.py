"""Drafter checkpoints: save, load and validate against a target; random drafters.
The run-time proposers are in :mod:`dspine.proposers`."""
from __future__ import annotations

import json
from pathlib import Path

import torch

from dspine.config import ConfigError, DSpineConfig
from dspine.drafter.model import DSpineDrafter


class DrafterError(ValueError):
    """A drafter checkpoint is missing, corrupt or does not fit the target/settings."""


# -- checkpoints ----------------------------------------------------------------------
def save_drafter(drafter: DSpineDrafter, out_dir: str | Path, dtype: torch.dtype = torch.bfloat16,
                 extra: dict | None = None) -> Path:
    """Write ``config.json`` + ``model.safetensors`` (weights cast to ``dtype``)."""
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    sd = {k: v.detach().to(dtype).contiguous().cpu() for k, v in drafter.state_dict().items()}
    save_file(sd, str(out / "model.safetensors.tmp"), metadata={"format": "pt", **{k: str(v) for k, v in (extra or {}).items()}})
    (out / "model.safetensors.tmp").replace(out / "model.safetensors")
    (out / "config.json").write_text(drafter.cfg.to_json())
    return out


def load_drafter(path: str | Path, target=None, dtype: torch.dtype = torch.float32,
                 block_size: int | None = None, option: str = "--drafter") -> DSpineDrafter:
    """Load and validate a checkpoint directory against ``target`` (if given).

    With a ``target`` the drafter is placed on ``target.device`` and bound to its
    embedding and head; without one it stays on the CPU.

    ``option`` is the command-line setting named in error messages.

    Raises:
        DrafterError: missing/corrupt file, a tensor whose shape differs from the
            config, hidden/vocab/feature-layer mismatch with the target, or a
            ``block_size`` different from the checkpoint's.
    """
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    p = Path(path)
    if not (p / "config.json").is_file():
        raise DrafterError(f"{option} {path}: no config.json (expected a directory with "
                           f"config.json and model.safetensors)")
    if not (p / "model.safetensors").is_file():
        raise DrafterError(f"{option} {path}: model.safetensors is missing")
    try:
        cfg = DSpineConfig.load(p)
    except ConfigError as e:
        raise DrafterError(f"{option} {path}: {e}") from None
    if block_size is not None and block_size != cfg.block_size:
        raise DrafterError(f"SpeculativeConfig.block_size {block_size} differs from the checkpoint's block size "
                           f"{cfg.block_size}; a drafter runs only at its trained block size")
    if target is not None:
        check_fits_target(cfg, target, where=f"{option} {path}")
        if cfg.target_name and cfg.target_name != getattr(target, "name", cfg.target_name):
            import warnings

            warnings.warn(f"{option} {path} was trained for target {cfg.target_name!r} and now runs on "
                          f"{target.name!r} (sizes match; output stays lossless, acceptance may be low)",
                          stacklevel=2)
    try:
        sd = load_file(str(p / "model.safetensors"))
    except (SafetensorError, OSError, ValueError, RuntimeError) as e:
        raise DrafterError(f"{option} {path}: model.safetensors is corrupt or unreadable ({e})") from None
    model = DSpineDrafter(cfg)
    want = model.state_dict()
    missing = sorted(set(want) - set(sd))
    unexpected = sorted(set(sd) - set(want))
    if missing or unexpected:
        raise DrafterError(f"{option} {path}: tensors missing {missing[:5]} / unexpected {unexpected[:5]}")
    for k, v in want.items():
        if tuple(sd[k].shape) != tuple(v.shape):
            raise DrafterError(f"{option} {path}: tensor {k} has shape {tuple(sd[k].shape)}, "
                               f"config expects {tuple(v.shape)}")
    model.load_state_dict({k: v.to(dtype) for k, v in sd.items()})
    model = model.to(dtype)
    if target is not None:  # the drafter runs on the target's device
        model = model.to(getattr(target, "device", "cpu"))
        model.bind_target(target.input_embeddings(), target.output_head())
    return model.eval()


def check_fits_target(cfg: DSpineConfig, target, where: str = "drafter") -> None:
    """Raise DrafterError when cfg's hidden size, vocabulary or feature layers do not fit."""
    if cfg.target_hidden != target.hidden_size:
        raise DrafterError(f"{where}: drafter hidden size {cfg.target_hidden} != target "
                           f"{target.name!r} hidden size {target.hidden_size}")
    if cfg.vocab_size != target.vocab_size:
        raise DrafterError(f"{where}: drafter vocabulary {cfg.vocab_size} != target "
                           f"{target.name!r} vocabulary {target.vocab_size}")
    bad = [l for l in cfg.feature_layers if l >= target.num_layers]
    if bad:
        raise DrafterError(f"{where}: feature layers {bad} do not exist in target {target.name!r} "
                           f"({target.num_layers} layers)")


def random_drafter(target, mode: str = "dspine", block_size: int = 16, seed: int = 0,
                   dtype: torch.dtype = torch.float32, **overrides) -> DSpineDrafter:
    """An untrained drafter for ``target`` (seeded), for tests and debugging."""
    cfg = DSpineConfig.for_target(target, mode=mode, block_size=block_size, **overrides)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = DSpineDrafter(cfg)
    model = model.to(dtype=dtype, device=getattr(target, "device", "cpu"))
    return model.bind_target(target.input_embeddings(), target.output_head()).eval()


def read_card(path: str | Path) -> dict:
    """The checkpoint's ``card.json`` metadata, or {} when absent.

    Raises:
        ConfigError: the file is not valid JSON or not a JSON object (names the file).
    """
    f = Path(path) / "card.json"
    if not f.exists():
        return {}
    try:
        card = json.loads(f.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{f} is damaged (not valid JSON: {e}); restore it or delete it "
                          f"(the card is metadata only)") from None
    if not isinstance(card, dict):
        raise ConfigError(f"{f} is damaged (not a JSON object); restore it or delete it "
                          f"(the card is metadata only)")
    return card
