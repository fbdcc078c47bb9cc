"""``dspine bench --headline``: the preset, the drafter-alone mode, the table and its stamp."""
from __future__ import annotations

import json
import os

import pytest

from dspine.bench import harness as H
from dspine.bench import headline as HL
from dspine.bench import report as R
from dspine.bench import run_config as RC

pytestmark = pytest.mark.usefixtures("one_thread")


def test_preset_modes_and_llama_cpp_column(tmp_path, monkeypatch):
    monkeypatch.delenv("DSPINE_LLAMA_CPP", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))  # no llama-server anywhere
    cfg = HL.headline_config()
    assert cfg.modes == HL.HEADLINE_MODES and cfg.workloads == HL.HEADLINE_WORKLOADS
    assert cfg.settings == (RC.GREEDY,) and cfg.max_new_tokens == 128 and cfg.llama_cpp is None
    server = tmp_path / "llama-server"
    server.write_text("#!/bin/sh\n")
    server.chmod(0o755)
    cfg = HL.headline_config()  # found on PATH: the llama.cpp column joins
    assert cfg.modes[-1] == "llama-cpp" and cfg.llama_cpp == str(server)
    assert "llama-cpp" not in HL.headline_config(modes=("ar", "dspine")).modes  # not asked for: not looked up
    monkeypatch.setenv("DSPINE_LLAMA_CPP", str(tmp_path / "nowhere"))
    with pytest.raises(H.BenchError, match="DSPINE_LLAMA_CPP=.*nowhere"):  # a named build that is not there
        HL.headline_config()


@pytest.mark.parametrize("over, msg", [(dict(modes=("dspine", "ngram")), "include ar"),
                                       (dict(settings=(RC.SAMPLED,)), "greedy"),
                                       (dict(concurrency=(2,)), "concurrency 1")])
def test_a_headline_without_its_reference_is_refused(over, msg):
    with pytest.raises(H.BenchError, match=msg):
        HL.headline_config(**over)


def test_headline_run_writes_the_table(tmp_path):
    """A shrunken headline run on a random target: every mode's greedy ids equal ar's, the
    drafter-alone mode verifies whole blocks of drafted tokens only (no copies, no policy:
    with the run's cost policy or copies it would verify fewer or copy), and the table,
    JSON and plot are written with the machine stamp."""
    cfg = HL.headline_config(target="random:llama", drafters={"dspine": "random"}, block_size=4, limit=1,
                             max_new_tokens=8, repeats=1, warmup_tokens=3, threads=1,
                             modes=("ar", "dspine", "ngram", "dspine-drafter"), workloads=("stdlib", "sharegpt"))
    summary = H.run_bench(cfg, tmp_path, progress=False, plots=False)
    doc = HL.write_headline(summary, tmp_path, plots=True)
    rows = [r for r in R.load_rows(tmp_path) if not r["warmup"]]
    alone = [r for r in rows if r["mode"] == "dspine-drafter"]
    assert alone and all(r["mode_info"]["proposer"] == "drafter" and r["mode_info"]["verify_policy"] == "fixed"
                         for r in alone)
    for r in alone:  # each cycle verifies the whole block (3 proposals), all drafted, as far as the budget allows
        assert set(r["sources"]) == {"draft"} and sum(r["accepted_counts"]) == 0  # a random drafter: 1 token a cycle
        assert r["verification_lengths"] == [min(3, 8 - 2 - i) for i in range(7)]
    assert {r["mode_info"]["proposer"] for r in rows if r["mode"] == "dspine"} == {"hybrid"}
    for w, cells in doc["table"].items():
        assert set(cells) == {"ar", "dspine", "ngram", "dspine-drafter"}
        for m in ("dspine", "ngram", "dspine-drafter"):
            assert cells[m]["same_ids"][0] == cells[m]["same_ids"][1] == 1  # greedy: lossless
            assert cells[m]["vs_ar_median"] > 0
    st = doc["stamp"]
    assert st["isa"] and st["cpu"] and st["threads"] == 1 and st["command"] == "dspine bench --headline"
    md = (tmp_path / "headline.md").read_text()
    assert "| code (held-out stdlib) |" in md and "| chat (held-out ShareGPT) |" in md
    assert f"({st['isa']}), 1 thread of" in md and st["date"] in md and "llama.cpp: not installed" in md
    ch = st["changed_from_preset"]  # a shrunken run says so in its stamp
    assert ch["target"] == "random:llama" and ch["limit"] == 1 and ch["max_new_tokens"] == 8 and ch["repeats"] == 1
    assert "changed from the preset: target=random:llama" in md
    o = st["others_cores_at_start"]  # the load of other processes, not the run's own threads
    assert isinstance(o, float) and f"other processes ~{o:.1f} cores busy at start" in md
    assert ("measured under load" in md) == (o > 0.5)
    busy = HL.render(doc["table"], {**st, "others_cores_at_start": 1.0}, list(cfg.modes))
    assert "**measured under load**" in busy and "measured under load" not in HL.render(
        doc["table"], {**st, "others_cores_at_start": 0.1}, list(cfg.modes))
    assert json.loads((tmp_path / "headline.json").read_text())["table"] == json.loads(json.dumps(doc["table"]))
    assert (tmp_path / "headline.png").stat().st_size > 0


def test_headline_and_smoke_are_exclusive(capsys):
    from dspine.cli.main import main

    assert main(["bench", "--headline", "--smoke", "--no-progress"]) == 2
    assert "--smoke and --headline" in capsys.readouterr().err


def test_default_out_names_the_cpu_class_and_date():
    from types import SimpleNamespace

    from dspine.bench.cli import default_out

    out = default_out(SimpleNamespace(smoke=False, headline=True))
    assert out.startswith("benchmarks/headline/") and out.rsplit("-", 3)[0].split("/")[-1] in (
        "avx2", "avx512", "amx", "default", "vsx", "zvector", "sve256", "no avx")
    assert os.path.basename(out)[-10:].count("-") == 2  # ...-YYYY-MM-DD
