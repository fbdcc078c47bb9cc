"""``dspine export``: a drafter (or the target) in the formats serving engines read.

Formats:

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

import contextlib
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

FORMATS = ("dflash", "gguf", "target", "target-gguf")
_DTYPES = {"float32": "f32", "bfloat16": "bf16", "float16": "f16"}


def _check_out(out: Path, fmt: str) -> None:
    """Refuse an --out that exists (or is not writable) before any work."""
    from dspine.export.dflash import ExportError

    if fmt in ("gguf", "target-gguf"):
        if out.suffix != ".gguf":
            raise ExportError(f"--out {out}: --format {fmt} writes one file; name it *.gguf")
        if out.exists():
            raise ExportError(f"--out {out} exists; choose a new file")
    elif out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ExportError(f"--out {out} exists and is not an empty folder; choose a new folder")
    if not out.parent.is_dir():
        raise ExportError(f"--out {out}: the folder {out.parent} does not exist")


@contextlib.contextmanager
def _atomic(out: Path):
    """Yield a temporary sibling of ``out``; move it into place only when the block ends
    without error (an interrupted or failed export leaves nothing at ``out``)."""
    tmp = out.with_name(f".{out.name}.partial-{os.getpid()}")
    try:
        yield tmp
        if out.is_dir():  # an empty folder the user made
            out.rmdir()
        os.replace(tmp, out)
        for f in ([out] if out.is_file() else out.iterdir()):
            f.chmod(0o644)  # safetensors writes 0600; engines may run as another user
    finally:
        if tmp.is_dir():
            shutil.rmtree(tmp, ignore_errors=True)
        elif tmp.exists():
            tmp.unlink()


def cmd_export(args) -> int:
    import torch

    from dspine.export.dflash import ExportError, check_exportable, default_mask_token_id, export_dflash
    from dspine.export.engines import convert_to_gguf, find_converter, write_engine_target
    from dspine.target.registry import resolve_target

    out = Path(args.out)
    _check_out(out, args.format)
    if args.format in ("gguf", "target-gguf"):
        find_converter(args.llama_cpp)  # fail before any work
        if args.converter_python and not shutil.which(args.converter_python):
            raise ExportError(f"--converter-python {args.converter_python}: no such executable")
    if args.format == "gguf":
        if args.target_dir is None:
            raise ExportError("--format gguf needs --target-dir: the engine-ready target folder the converter "
                              "reads the tokenizer (and the embedding the mask row patches) from; write it "
                              f"with `dspine export --format target --target {args.target} --out DIR`")
        if not (Path(args.target_dir) / "config.json").is_file():
            raise ExportError(f"--target-dir {args.target_dir}: no config.json (write it with "
                              f"`dspine export --format target --out DIR`)")
    if args.target.startswith("random:"):
        raise ExportError(f"--target {args.target}: random targets exist only in memory; export a named target, "
                          f"an HF folder or a .gguf file")
    ignored = [o for o, v in (("--drafter", args.drafter), ("--mask-token-id", args.mask_token_id),
                              ("--target-dir", args.target_dir)) if v is not None]
    if args.format in ("target", "target-gguf"):
        ignored += ["--dtype"] if args.format == "target" and args.dtype != "float32" else []
        if ignored:
            print(f"dspine: note: --format {args.format} exports the target as it is; {', '.join(ignored)} "
                  f"ignored", file=sys.stderr)
        tdir = Path(resolve_target(args.target))
        with _atomic(out) as tmp:
            if args.format == "target":
                write_engine_target(tdir, tmp)
            else:
                with tempfile.TemporaryDirectory(prefix="dspine-target-") as view:
                    write_engine_target(tdir, Path(view) / "target")
                    convert_to_gguf(Path(view) / "target", tmp, args.llama_cpp, _DTYPES[args.dtype],
                                    python=args.converter_python)
        print(json.dumps({"format": args.format, "target": args.target, "out": str(out)}))
        return 0

    from dspine.build import default_drafter_path
    from dspine.drafter.checkpoint import load_drafter, read_card
    from dspine.target.assets import sha256_file

    drafter = args.drafter or default_drafter_path(args.target, "dflash-engine")
    if drafter is None:
        raise ExportError(f"--drafter: no shipped engine-compatible drafter for {args.target}; pass a checkpoint "
                          f"dir trained with `dspine train --mode dflash --engine-compatible`")
    model = load_drafter(drafter, None, dtype=torch.float32)
    check_exportable(model.cfg, where=f"--drafter {drafter}")
    tdir = Path(resolve_target(args.target))
    tcfg = json.loads((tdir / "config.json").read_text())
    n_layers = int(tcfg.get("num_hidden_layers", 0))
    if model.cfg.target_hidden != tcfg.get("hidden_size") or model.cfg.vocab_size != tcfg.get("vocab_size"):
        raise ExportError(f"--drafter {drafter} (hidden {model.cfg.target_hidden}, vocab {model.cfg.vocab_size}) "
                          f"does not fit --target {args.target} (hidden {tcfg.get('hidden_size')}, vocab "
                          f"{tcfg.get('vocab_size')})")
    bad = [l for l in model.cfg.feature_layers if l >= n_layers]
    if bad:
        raise ExportError(f"--drafter {drafter}: feature layers {bad} do not exist in --target {args.target} "
                          f"({n_layers} layers)")
    if model.cfg.target_name and model.cfg.target_name != args.target:
        print(f"dspine: note: --drafter {drafter} was trained for {model.cfg.target_name!r}, exported for "
              f"--target {args.target} (sizes fit; acceptance may be low)", file=sys.stderr)
    mask_id = args.mask_token_id if args.mask_token_id is not None else default_mask_token_id(tdir)
    _check_mask_token(mask_id, tdir)
    card = read_card(drafter)
    tau = card.get("heldout_acceptance_greedy_fp32") or {}
    source = {"drafter": str(drafter), "model_sha256": sha256_file(Path(drafter) / "model.safetensors"),
              "target": args.target, "window": model.cfg.window,
              "heldout_acceptance": {k: tau.get(k) for k in ("tau_code", "tau_chat")} if tau else None}
    kw = dict(mask_token_id=mask_id, max_position_embeddings=int(tcfg.get("max_position_embeddings", 4096)),
              num_target_layers=n_layers, source=source)
    with _atomic(out) as tmp:
        if args.format == "dflash":
            export_dflash(model, tmp, dtype=getattr(torch, args.dtype), **kw)
        else:  # gguf: export to a temporary folder, then llama.cpp's converter
            with tempfile.TemporaryDirectory(prefix="dspine-dflash-") as folder:
                export_dflash(model, Path(folder) / "dflash", dtype=torch.float32, **kw)
                convert_to_gguf(Path(folder) / "dflash", tmp, args.llama_cpp, _DTYPES[args.dtype],
                                target_dir=args.target_dir, python=args.converter_python)
    print(json.dumps({"format": args.format, "drafter": str(drafter), "out": str(out), "mask_token_id": mask_id,
                      "target_layer_ids": model.cfg.feature_layers, "block_size": model.cfg.block_size}))
    return 0


def _check_mask_token(mask_id: int, tdir: Path) -> None:
    """Refuse a mask token the target writes (BOS/EOS/PAD/UNK): the engines substitute the
    mask vector for every occurrence of it among the drafter's inputs."""
    from dspine.export.dflash import ExportError

    tc = json.loads((tdir / "tokenizer_config.json").read_text()) if (tdir / "tokenizer_config.json").exists() else {}
    tok = json.loads((tdir / "tokenizer.json").read_text()) if (tdir / "tokenizer.json").exists() else {}
    ids = {t["content"]: t["id"] for t in tok.get("added_tokens", [])}
    for key in ("bos_token", "eos_token", "pad_token", "unk_token"):
        if tc.get(key) in ids and ids[tc[key]] == mask_id:
            raise ExportError(f"--mask-token-id {mask_id} is the target's {key} ({tc[key]!r}), which it writes; "
                              f"choose a token it never writes (default: its highest unused special token)")


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
