"""scripts/gpu_train.sh end to end on the CPU in a tiny setting: data
build, packing, training, and results that fit the device limits and unpack into a
loadable drafter and a loadable data directory."""
from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _env(tmp_path: Path, **kw) -> dict:
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"p{i}", "prompt": f"tiny prompt {i} " + "y" * i, "kind": "chat"})
                               + "\n" for i in range(8)))
    env = {**os.environ, "OUT": str(tmp_path / "out"), "PYTHON": sys.executable, "DEVICE": "cpu",
           "TARGET": "random:llama", "PROMPTS": str(prompts), "BASE_DATA": "", "INIT_FROM": "",
           "DATA_SECONDS": "120", "DATA_BATCH": "3", "MAX_NEW": "10", "MAX_PROMPTS": "6",
           "STEPS": "3", "TRAIN_SECONDS": "120", "TRAIN_BATCH": "2", "ANCHORS": "2", "MAX_LEN": "48",
           "SOFT_LABELS": "4", "TRAIN_ARGS": "--block-size 4 --threads 1", "WORK": str(tmp_path / "work"),
           "DSPINE_HOME": os.environ.get("DSPINE_HOME", str(Path.home() / ".cache" / "dspine"))}
    env.update(kw)
    return env


@pytest.mark.slow  # long CLI / subprocess run; the default suite stays under ~15 min on 2 cores
def test_gpu_script_runs_end_to_end_on_cpu_within_the_device_limits(tmp_path):
    r = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_train.sh")], env=_env(tmp_path),
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    out = tmp_path / "out"
    files = sorted(p for p in out.rglob("*") if p.is_file())
    assert len(files) <= 8 and sum(p.stat().st_size for p in files) <= 64 << 20
    assert all(p.stat().st_size <= 16 << 20 for p in files)
    names = {p.name for p in files}
    assert {"data.tar", "metrics.jsonl", "run.log", "SHA256SUMS", "drafter.tar.part00"} <= names
    for line in (out / "SHA256SUMS").read_text().splitlines():  # what the caller checks after the transfer
        digest, name = line.split()
        assert hashlib.sha256((out / name).read_bytes()).hexdigest() == digest

    # the parts join into the final drafter, which loads for the target it was trained on
    joined = tmp_path / "drafter.tar"
    joined.write_bytes(b"".join(p.read_bytes() for p in sorted(out.glob("drafter.tar.part*"))))
    with tarfile.open(joined) as t:
        t.extractall(tmp_path / "unpacked", filter="data")
    card = json.loads((tmp_path / "unpacked" / "final" / "card.json").read_text())
    assert card["steps"] == 3 and card["train_config"]["soft_topk"] == 4
    readme = (tmp_path / "unpacked" / "final" / "README.md").read_text()
    assert "soft labels: the target's top 4" in readme and "None" not in readme
    assert "not measured by this run" in readme and "dspine acceptance --target random:llama" in readme
    from dspine.drafter.checkpoint import load_drafter
    from dspine.target.adapter import load_target
    tg = load_target("random:llama")
    assert load_drafter(tmp_path / "unpacked" / "final", tg).cfg.block_size == 4

    # the new data comes back packed (sha256 in its manifest) and loads
    with tarfile.open(out / "data.tar") as t:
        t.extractall(tmp_path / "d", filter="data")
    from dspine.data.load import load_dataset
    from dspine.data.store import read_manifest
    man = read_manifest(tmp_path / "d" / "data")
    assert man["counts"]["prompts"] == 6 and man["sampling"]["device"] == "cpu"
    assert all(s.endswith(".jsonl.gz") for s in man["shards"])
    assert len(load_dataset(tmp_path / "d" / "data", tg)) == 6
    log = (out / "run.log").read_text()
    assert "data build + pack" in log and "done" in log


def test_gpu_script_refuses_without_out_or_prompts(tmp_path):
    env = _env(tmp_path)
    del env["OUT"]
    r = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_train.sh")], env=env, capture_output=True, text=True)
    assert r.returncode != 0 and "set OUT" in r.stderr
    r = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_train.sh")], env=_env(tmp_path, PROMPTS=""),
                       capture_output=True, text=True, cwd=tmp_path)
    assert r.returncode == 2 and "no prompt files" in r.stderr
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "drafter.tar.part01").write_text("stale")
    r = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_train.sh")], env=_env(tmp_path, OUT="full"),
                       capture_output=True, text=True, cwd=tmp_path)  # relative to the caller's folder
    assert r.returncode == 2 and "is not empty" in r.stderr
    for kw in ({"TRAIN_SECONDS": "0"}, {"SOFT_LABELS": "-1"}, {"STEPS": "0"}):
        r = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_train.sh")],
                           env=_env(tmp_path, OUT=str(tmp_path / f"o{len(kw)}{list(kw)[0]}"), **kw),
                           capture_output=True, text=True, timeout=120)
        assert r.returncode != 0 and "bad training setting" in r.stderr, (kw, r.stderr[-500:])
        assert not (tmp_path / "work" / "data").exists()  # refused before the data build


@pytest.mark.skipif(not (ROOT / ".git").exists(), reason="needs the git checkout")
def test_gpu_script_is_tracked_and_executable():
    assert os.access(ROOT / "scripts" / "gpu_train.sh", os.X_OK)


def test_stage_helpers_split_join_and_skip_answered_prompts(tmp_path):
    """scripts/gpu_stage.py: parts join back byte for byte; staged prompts leave out ids
    already answered (packed or growing shards) and read back with the same ids."""
    import gzip

    from conftest import load_script

    stage = load_script("scripts/gpu_stage.py")
    blob = os.urandom(2500)
    (tmp_path / "t.gguf").write_bytes(blob)
    parts = stage.split_file(tmp_path / "t.gguf", tmp_path / "parts", 1000)
    assert [p.stat().st_size for p in parts] == [1000, 1000, 500] and parts[0].name == "t.gguf.part000"
    assert b"".join(p.read_bytes() for p in parts) == blob

    d = tmp_path / "data"
    d.mkdir()
    with pytest.raises(ValueError, match="not a `dspine data build` directory"):
        stage.done_ids([d])
    (d / "manifest.json").write_text("{}")
    with gzip.open(d / "data-00000.jsonl.gz", "wt") as f:
        f.write(json.dumps({"id": "a"}) + "\n")
    (d / "data-00001.jsonl").write_text(json.dumps({"id": "b"}) + "\n" + '{"id": "c", "prompt_ids": [1')  # torn line
    assert stage.done_ids([d]) == {"a", "b"}
    src = tmp_path / "p.jsonl"
    src.write_text("".join(json.dumps({"id": i, "prompt": f"question {i}?"}) + "\n" for i in "abcd"))
    out = tmp_path / "prompts-p.jsonl.gz"
    assert stage.export_prompts(str(src), out, {"a", "b"}) == 2
    with pytest.raises(ValueError):
        stage.export_prompts("humaneval", tmp_path / "bad.jsonl.gz", set())  # eval-only: refused
    assert not (tmp_path / "bad.jsonl.gz").exists()
    from dspine.data.sources import iter_jsonl_prompts
    plain = tmp_path / "prompts-p.jsonl"
    plain.write_bytes(gzip.decompress(out.read_bytes()))
    assert [(r["id"], r["prompt"]) for r in iter_jsonl_prompts(plain)] == [("c", "question c?"), ("d", "question d?")]
