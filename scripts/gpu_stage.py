#!/usr/bin/env python3
"""Stage what scripts/gpu_train.sh needs on a GPU machine that reaches no network, within
the device tool's limit of 64 MiB per call (docs/gpu-run.md).

What travels with a device call is the working tree (tracked files and untracked files git
does not ignore) plus up to 8 carried paths, 64 MiB in all. The tracked tree is ~90 MB,
~77 MB of it the shipped drafter checkpoints, and the default target's GGUF is ~98 MB, so:

* ``--untrack`` takes ``src/dspine/checkpoints`` out of git's index (files stay on disk)
  and ignores it in ``.git/info/exclude``: the tree that travels is ~12 MB.
  ``--restore`` puts both back exactly (run it right after the device calls).
* ``.gpu/`` (ignored) receives the target's GGUF in parts of at most ``--part-mib`` MiB,
  the training prompt streams as gzipped JSONL (prompts whose ids are already in
  ``--skip-data`` left out, so the GPU answers only new prompts), optionally the
  checkpoint to warm-start from (``--init``), and the ``gguf`` wheel transformers needs
  to read the GGUF (``--wheel-dir``, downloaded here beforehand).

It then prints the device calls (command and carry list) in order. Nothing here needs a GPU.
"""
from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
STAGE = ROOT / ".gpu"
CKPTS = "src/dspine/checkpoints"
EXCLUDE_LINES = (f"/{CKPTS}/",)  # .gpu/ is in .gitignore


def split_file(src: Path, out_dir: Path, part_bytes: int) -> list[Path]:
    """Write ``src`` as ``<name>.partNN`` files of at most ``part_bytes`` in ``out_dir``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    if part_bytes < 1:
        raise ValueError(f"part size {part_bytes} bytes: must be at least 1")
    parts = []
    with open(src, "rb") as f:
        while chunk := f.read(part_bytes):
            p = out_dir / f"{src.name}.part{len(parts):03d}"  # sorts as it joins (cat part*)
            p.write_bytes(chunk)
            parts.append(p)
    return parts


def done_ids(data_dirs: list[Path]) -> set[str]:
    """Prompt ids already answered in ``dspine data build`` directories (packed or not).

    Raises:
        ValueError: a folder that is not a data directory (no ``manifest.json``), or a
            shard that cannot be read (naming it); a torn last line is skipped.
    """
    ids: set[str] = set()
    for d in data_dirs:
        if not (Path(d) / "manifest.json").is_file():
            raise ValueError(f"--skip-data {d}: not a `dspine data build` directory (no manifest.json)")
        for shard in sorted(Path(d).glob("data-*.jsonl*")):
            opener = gzip.open if shard.suffix == ".gz" else open
            try:
                with opener(shard, "rt", encoding="utf-8") as f:
                    for line in f:
                        try:
                            row = json.loads(line) if line.strip() else None
                        except json.JSONDecodeError:
                            continue  # a torn last line of a growing shard
                        if isinstance(row, dict) and "id" in row:
                            ids.add(str(row["id"]))
            except (OSError, EOFError, UnicodeDecodeError) as e:
                raise ValueError(f"--skip-data: cannot read {shard}: {e}") from None
    return ids


def export_prompts(source: str, out: Path, skip: set[str]) -> int:
    """The training prompt stream of ``source`` (held-out and eval prompts already left
    out by :func:`dspine.data.sources.training_prompts`) minus ``skip``, as gzipped JSONL
    rows a ``dspine data build --prompts FILE.jsonl`` reads back with the same ids."""
    sys.path.insert(0, str(ROOT / "src"))
    from dspine.data.sources import training_prompts

    n = 0
    try:
        with gzip.open(out, "wt", encoding="utf-8") as f:
            for rec in training_prompts(source):
                if rec["id"] in skip:
                    continue
                row = {"id": rec["id"], "kind": rec.get("kind", "chat")}
                row.update({k: rec[k] for k in ("prompt", "messages") if k in rec})
                f.write(json.dumps(row) + "\n")
                n += 1
    except BaseException:
        out.unlink(missing_ok=True)  # no half-written prompt file left behind
        raise
    return n


def _git(*args: str) -> str:
    return subprocess.run(["git", "-C", str(ROOT), *args], check=True, capture_output=True, text=True).stdout


def untrack() -> None:
    excl = ROOT / ".git" / "info" / "exclude"
    lines = excl.read_text().splitlines() if excl.exists() else []
    excl.write_text("\n".join(lines + [x for x in EXCLUDE_LINES if x not in lines]) + "\n")
    _git("rm", "-r", "--cached", "-q", CKPTS)
    print(f"untracked {CKPTS} (files kept); run `scripts/gpu_stage.py --restore` after the device calls")


def restore() -> None:
    _git("reset", "-q", "--", CKPTS)
    excl = ROOT / ".git" / "info" / "exclude"
    if excl.exists():
        keep = [x for x in excl.read_text().splitlines() if x != f"/{CKPTS}/"]
        excl.write_text("\n".join(keep) + "\n")
    print(f"restored {CKPTS} to the index; `git status` should show no change there")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="smollm2-135m", help="named target whose GGUF is staged")
    ap.add_argument("--sources", nargs="+", default=["sharegpt", "stdlib"])
    ap.add_argument("--skip-data", nargs="*", default=["training-data/smollm2-135m-regen"],
                    help="data directories whose prompt ids are left out of the staged prompts")
    ap.add_argument("--init", default=None, help="checkpoint folder to warm-start from (copied to .gpu/init)")
    ap.add_argument("--wheel-dir", default=None, help="folder with the gguf wheel (pip download gguf==0.19.0 --no-deps)")
    ap.add_argument("--part-mib", type=int, default=47, help="largest GGUF part (MiB)")
    ap.add_argument("--untrack", action="store_true", help="only take the checkpoints out of the index")
    ap.add_argument("--restore", action="store_true", help="only put the checkpoints back in the index")
    a = ap.parse_args(argv)
    if not 1 <= a.part_mib <= 60:
        ap.error(f"--part-mib {a.part_mib}: must be 1..60 (a call carries at most 64 MiB with the ~12 MB tree)")
    if a.untrack:
        untrack()
        return 0
    if a.restore:
        restore()
        return 0
    sys.path.insert(0, str(ROOT / "src"))
    from dspine.target.assets import dspine_home
    from dspine.target.registry import NAMED_TARGETS, _assemble_gguf

    if a.target not in NAMED_TARGETS:
        raise SystemExit(f"--target {a.target!r}: only named targets are staged ({sorted(NAMED_TARGETS)})")
    spec = NAMED_TARGETS[a.target]
    skip = done_ids([ROOT / d for d in a.skip_data])  # checked before .gpu/ is replaced
    if a.init and not (Path(a.init) / "config.json").is_file():
        raise SystemExit(f"--init {a.init}: not a drafter checkpoint (no config.json)")
    if STAGE.exists():
        shutil.rmtree(STAGE)
    STAGE.mkdir()
    gguf = _assemble_gguf(spec, dspine_home() / "gguf" / f"{spec.name}.gguf")
    parts = split_file(gguf, STAGE / "gguf", a.part_mib << 20)
    (STAGE / "prompts").mkdir()
    for s in a.sources:
        n = export_prompts(s, STAGE / "prompts" / f"prompts-{s}.jsonl.gz", skip)
        print(f"prompts {s}: {n} (left out {len(skip)} ids already answered)")
    carry_run = [".gpu/prompts"]
    if a.init:
        shutil.copytree(a.init, STAGE / "init")
        carry_run.append(".gpu/init")
    wheels = sorted(Path(a.wheel_dir).glob("*.whl")) if a.wheel_dir else []
    if wheels:
        (STAGE / "whl").mkdir()
        for w in wheels:
            shutil.copy(w, STAGE / "whl" / w.name)
        carry_run.append(".gpu/whl")
    size = sum(p.stat().st_size for p in STAGE.rglob("*") if p.is_file())
    print(f"staged {size / 2**20:.1f} MiB in {STAGE}; GGUF sha256 {spec.sha256[:16]}... in {len(parts)} parts")
    home = "/tmp/dspine-home"
    print("\ndevice calls, in order (each within ~30 s of the last, while the machine is warm):")
    for p in parts:
        print(f"  run carry=['.gpu/gguf/{p.name}'] command: mkdir -p {home}/gguf && cp .gpu/gguf/{p.name} {home}/gguf/")
    whl = ("python3 -m pip install -q --no-index --no-deps --target /tmp/site .gpu/whl/*.whl && "
           "export PYTHONPATH=/tmp/site; " if wheels else "")
    print(f"  run carry={carry_run} timeout_s=590 command: {whl}export DSPINE_HOME={home}; "
          f"cat {home}/gguf/{spec.name}.gguf.part* > {home}/gguf/{spec.name}.gguf && "
          f"echo '{spec.sha256}  {home}/gguf/{spec.name}.gguf' | sha256sum -c - && "
          f"for f in .gpu/prompts/*.gz; do gunzip -c $f > .gpu/$(basename $f .gz); done && "
          f"OUT=$OUT timeout 560 bash scripts/gpu_train.sh")
    digest = hashlib.sha256(b"".join(p.read_bytes() for p in parts)).hexdigest()
    assert digest == spec.sha256, "the parts do not join into the pinned GGUF"
    return 0


if __name__ == "__main__":
    sys.exit(main())
