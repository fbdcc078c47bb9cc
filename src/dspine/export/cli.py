"""``dspine export``: a drafter (or the target) in the formats serving engines read.

Formats (issue 24):

- ``dflash``: the z-lab DFlash folder vLLM (``speculative_config={"method": "dflash"}``)
  loads; the drafter must be DFlash-style and ``--engine-compatible``.
- ``gguf``: that folder converted by llama.cpp's own converter, for ``llama-server
  --spec-type draft-dflash -md FILE``; needs ``--llama-cpp`` and the engine-ready target
  folder (``--target-dir``, written by ``--format target``).
- ``target``: the target as a standard HF folder with the exact weights dspine decodes
  with (vLLM's ``model=``; the input of ``--format target-gguf``).
- ``target-gguf``: that folder as a GGUF for llama.cpp (``-m``).
"""
from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

FORMATS = ("dflash", "gguf", "target", "target-gguf")
_DTYPES = {"float32": "f32", "bfloat16": "bf16", "float16": "f16"}


def cmd_export(args) -> int:
    import torch

    from .dflash import ExportError, check_exportable, default_mask_token_id, export_dflash
    from .engines import convert_to_gguf, find_converter, write_engine_target
    from ..targets import resolve_target

    out = Path(args.out)
    if args.format in ("gguf", "target-gguf"):
        find_converter(args.llama_cpp)  # fail before any work
        if out.suffix != ".gguf":
            raise ExportError(f"--out {out}: --format {args.format} writes one file; name it *.gguf")
        if out.exists():
            raise ExportError(f"--out {out} exists; choose a new file")
    if args.format in ("target", "target-gguf"):
        if args.drafter:
            print(f"dspine: note: --format {args.format} exports the target; --drafter is ignored", file=sys.stderr)
        tdir = Path(resolve_target(args.target))
        if args.format == "target":
            write_engine_target(tdir, out)
        else:
            with tempfile.TemporaryDirectory(prefix="dspine-target-") as tmp:
                view = write_engine_target(tdir, Path(tmp) / "target")
                convert_to_gguf(view, out, args.llama_cpp, _DTYPES[args.dtype], python=args.converter_python)
        print(json.dumps({"format": args.format, "target": args.target, "out": str(out)}))
        return 0

    from ..cli import default_drafter_path
    from ..draft import load_drafter, read_card
    from ..assets import sha256_file

    drafter = args.drafter or default_drafter_path(args.target, "dflash-engine")
    if drafter is None:
        raise ExportError(f"--drafter: no shipped engine-compatible drafter for {args.target}; pass a checkpoint "
                          f"dir trained with `dspine train --mode dflash --engine-compatible`")
    model = load_drafter(drafter, None, dtype=torch.float32)
    check_exportable(model.cfg, where=f"--drafter {drafter}")
    tdir = Path(resolve_target(args.target))
    tcfg = json.loads((tdir / "config.json").read_text())
    if model.cfg.target_hidden != tcfg.get("hidden_size") or model.cfg.vocab_size != tcfg.get("vocab_size"):
        raise ExportError(f"--drafter {drafter} (hidden {model.cfg.target_hidden}, vocab {model.cfg.vocab_size}) "
                          f"does not fit --target {args.target} (hidden {tcfg.get('hidden_size')}, vocab "
                          f"{tcfg.get('vocab_size')})")
    mask_id = args.mask_token_id if args.mask_token_id is not None else default_mask_token_id(tdir)
    card = read_card(drafter)
    source = {"drafter": str(drafter), "model_sha256": sha256_file(Path(drafter) / "model.safetensors"),
              "target": args.target, "window": model.cfg.window,
              "heldout_acceptance": card.get("heldout_acceptance_greedy_fp32", {}).get("tau_code") and {
                  k: card["heldout_acceptance_greedy_fp32"].get(k) for k in ("tau_code", "tau_chat")}}
    kw = dict(mask_token_id=mask_id, max_position_embeddings=int(tcfg.get("max_position_embeddings", 4096)),
              num_target_layers=int(tcfg["num_hidden_layers"]), source=source)
    if args.format == "dflash":
        if out.exists() and any(out.iterdir()):
            raise ExportError(f"--out {out} exists and is not empty; choose a new folder")
        export_dflash(model, out, dtype=getattr(torch, args.dtype), **kw)
    else:  # gguf: export to a temporary folder, then llama.cpp's converter
        if args.target_dir is None:
            raise ExportError("--format gguf needs --target-dir: the engine-ready target folder the converter "
                              "reads the tokenizer (and the embedding the mask row patches) from; write it "
                              f"with `dspine export --format target --target {args.target} --out DIR`")
        with tempfile.TemporaryDirectory(prefix="dspine-dflash-") as tmp:
            folder = export_dflash(model, Path(tmp) / "dflash", dtype=torch.float32, **kw)
            convert_to_gguf(folder, out, args.llama_cpp, _DTYPES[args.dtype], target_dir=args.target_dir,
                            python=args.converter_python)
    print(json.dumps({"format": args.format, "drafter": str(drafter), "out": str(out), "mask_token_id": mask_id,
                      "target_layer_ids": model.cfg.feature_layers, "block_size": model.cfg.block_size}))
    return 0


def add_export_parser(sub) -> None:
    p = sub.add_parser("export", help="write a DFlash-style drafter (or the target) for vLLM / llama.cpp")
    p.add_argument("--format", required=True, choices=FORMATS,
                   help="dflash: z-lab folder for vLLM; gguf: llama.cpp draft-dflash file; target / "
                        "target-gguf: the target with dspine's exact weights for either engine")
    p.add_argument("--drafter", default=None,
                   help="DFlash-style checkpoint trained with --engine-compatible (default: the shipped "
                        "TARGET-dflash-engine drafter)")
    p.add_argument("--target", default="smollm2-135m")
    p.add_argument("--out", required=True, help="folder (dflash, target) or file *.gguf (gguf, target-gguf)")
    p.add_argument("--mask-token-id", type=int, default=None,
                   help="token id whose embedding the engines replace by the drafter's mask embedding "
                        "(default: the target's highest unused special token)")
    p.add_argument("--dtype", default="float32", choices=sorted(_DTYPES),
                   help="weights of the written files (float32 keeps them bit-exact)")
    p.add_argument("--llama-cpp", default=None, help="llama.cpp source tree (gguf formats; or $DSPINE_LLAMA_CPP)")
    p.add_argument("--converter-python", default=None,
                   help="Python that runs llama.cpp's converter (needs its requirements: numpy, torch, "
                        "transformers, sentencepiece; default: this one)")
    p.add_argument("--target-dir", default=None,
                   help="engine-ready target folder (`--format target`), needed by --format gguf")
    p.set_defaults(func=cmd_export)
