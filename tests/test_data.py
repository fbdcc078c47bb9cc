"""Tests of dspine.data: prompt sources, splits, and the resumable data build."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from dspine.data import build as B
from dspine.data import cli as data_cli
from dspine.data import load as DL
from dspine.data import sources as S
from dspine.data import splits as SP
from dspine.data import stdlib as SL
from dspine.data import store as ST
from dspine.data import tokenizer as TK


# -- splits and sources ---------------------------------------------------------------------
def test_splits_file_is_consistent():
    sp = SP.load_splits()
    assert set(sp["eval_only_sources"]) == {"humaneval", "mtbench", "bfcl"}
    mods = set(SL.stdlib_modules())
    held = sp["stdlib_heldout_modules"]
    assert held and held <= mods
    assert 0.05 < len(held) / len(mods) < 0.2
    assert len(sp["sharegpt_heldout_ids"]) == 200 == len(sp["sharegpt_heldout_set"])


@pytest.mark.parametrize("src", ["humaneval", "mtbench", "bfcl"])
def test_eval_only_sources_refused_for_training(src):
    with pytest.raises(ValueError, match="eval-only"):
        S.training_prompts(src)


def test_eval_benchmarks_load():
    he, mt, bf = S.load_humaneval(), S.load_mtbench(), S.load_bfcl()
    assert len(he) == 164 and {"task_id", "prompt", "test", "entry_point"} <= set(he[0])
    assert len(mt) == 80 and isinstance(mt[0]["turns"], list)
    assert bf and all(r["messages"] and isinstance(r["functions"], list) for r in bf)
    assert {r["category"] for r in bf} == set(S.BFCL_DEFAULT)


def test_stdlib_training_never_touches_heldout_modules():
    held = SP.load_splits()["stdlib_heldout_modules"]
    train = list(zip(range(1200), S.training_prompts("stdlib")))
    mods = {r["module"] for _, r in train}
    assert len(mods) > 300  # round-robin: the first rounds cover many modules
    assert not mods & held
    assert all(r["kind"] == "code" and r["id"].startswith(r["module"] + ":") for _, r in train)
    code = S.heldout_prompts("code", 100)
    assert len(code) == 100 and {r["module"] for r in code} <= held
    assert not {r["id"] for r in code} & {r["id"] for _, r in train}


def test_stdlib_prompt_ends_at_function_body():
    rec = next(SL.iter_stdlib_prompts(modules=["json.decoder"], context_chars=400))
    assert len(rec["prompt"]) <= 400 and "def " in rec["prompt"]
    # ends after the header/docstring, before the newline (BPE merges it with the indent)
    assert rec["prompt"].endswith((":", '"""', "'''")) and not rec["prompt"].endswith("\n")


def test_sharegpt_training_excludes_heldout_and_eval_texts():
    held = SP.load_splits()["sharegpt_heldout_set"]
    train = [r for _, r in zip(range(400), S.training_prompts("sharegpt"))]
    assert len(train) == 400 and not {r["id"] for r in train} & held
    evals = S.eval_texts()
    assert not any(S._norm(r["prompt"]) in evals for r in train)
    chat = S.heldout_prompts("chat", 200)
    assert [r["id"] for r in chat] == SP.load_splits()["sharegpt_heldout_ids"]


def test_jsonl_training_filters_eval_prompts(tmp_path, capsys):
    turn = S.load_mtbench()[0]["turns"][0]
    p = tmp_path / "p.jsonl"
    p.write_text("\n".join(json.dumps(r) for r in [
        {"id": "a", "prompt": "write a haiku about rust"},
        {"id": "b", "prompt": "  " + turn + " "},  # MT-Bench question: eval-only
        {"id": "HumanEval/3", "prompt": "anything"},  # eval id
        {"messages": [{"role": "user", "content": "hi"}]},
        {"id": "c", "prompt": "Write a haiku  about Rust"},  # repeat: same greedy answer
    ]) + "\n")
    got = [r["id"] for r in S.training_prompts(str(p))]
    assert got == ["a", "p:4"]
    from dspine.data.build import _note_unused_rows  # a data build says what it leaves out

    _note_unused_rows(str(p))
    assert "2 of 5 rows match held-out or eval-only prompts and 1 repeat" in capsys.readouterr().err


def test_build_refuses_a_source_given_twice_or_sources_that_leave_nothing(tmp_path, capsys):
    turn = S.load_mtbench()[0]["turns"][0]
    p = tmp_path / "held.jsonl"
    p.write_text(json.dumps({"id": "a", "prompt": turn}) + "\n")  # eval-only: nothing to train on
    for sources, match in (([str(p), str(tmp_path / "." / "held.jsonl")], "is given twice"),
                           (["stdlib", "stdlib"], "--prompts stdlib is given twice"),
                           ([str(p)], "no row is left for training")):
        with pytest.raises(ValueError, match=match):
            B.build_dataset("no-such-target", sources, tmp_path / "out" / "x", progress=False)
        assert not (tmp_path / "out").exists()  # refused before the target loads or --out is made


def test_a_prompt_holding_an_eval_prompt_is_eval_only(tmp_path):
    """An eval prompt wrapped in other text is still that prompt (a HumanEval task under an
    instruction, a held-out ShareGPT turn with a line added); a short eval text inside a
    longer prompt is not (it would exclude ordinary prompts)."""
    he = S.load_humaneval()[5]["prompt"]
    held = max((r["prompt"] for r in S.heldout_prompts("chat", 50)), key=len)
    short = min((t for t in S.eval_texts() if 2 <= len(t.split()) < S.CONTAINED_MIN_WORDS), key=len)
    p = tmp_path / "p.jsonl"
    p.write_text("\n".join(json.dumps(r) for r in [
        {"id": "a", "prompt": "Complete this function, please:\n\n" + he + "\nThanks!"},
        {"id": "b", "messages": [{"role": "user", "content": held.upper() + "\n\nAnswer briefly."}]},
        {"id": "c", "prompt": "Tell me a story. " + short + " And make it long."},
        {"id": "d", "prompt": he[: len(he) // 2] + " # the first half only"},
    ]) + "\n")
    assert [r["id"] for r in S.training_prompts(str(p))] == ["c", "d"]
    assert S.contains_eval_text("x " + he) and not S.contains_eval_text(he[: len(he) // 2])
    q = S.load_mtbench()[0]["turns"][0]  # punctuation glued to the eval text, other roles
    for wrapped in (f'Answer this: "{q}"', f"Task:{q}", f"({q})", f"```{he}```", f'Fix this: """{he}'):
        assert S.contains_eval_text(wrapped), wrapped[:40]
    assert S.is_eval_record({"messages": [{"role": "system", "content": he},
                                          {"role": "user", "content": "Complete the function above."}]})


def test_sharegpt_stream_stops_at_truncation(tmp_path):
    f = tmp_path / "t.json"
    f.write_text('[\n {"id": "a", "n": 1},\n {"id": "b", "s": "x]y"} ,\n {"id": "c", "conv')
    assert [o["id"] for o in S._iter_json_array(f, chunk_chars=7)] == ["a", "b"]
    f.write_text('[{"id": "a"}, {"id": "b"}]')
    assert [o["id"] for o in S._iter_json_array(f, chunk_chars=3)] == ["a", "b"]
    real = list(zip(range(5), S.iter_sharegpt()))
    assert len(real) == 5 and all(r["prompt"].strip() for _, r in real)
    n = sum(1 for _ in S.iter_sharegpt())  # whole (truncated) file: ends without error
    assert n > 1000


def test_jsonl_source_errors(tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n\n")
    with pytest.raises(ValueError, match="empty.jsonl"):
        list(S.iter_jsonl_prompts(empty))
    useless = tmp_path / "useless.jsonl"
    useless.write_text('{"text": "no prompt field"}\n')
    with pytest.raises(ValueError, match="useless.jsonl"):
        list(S.iter_jsonl_prompts(useless))
    ids = tmp_path / "ids.jsonl"  # null / empty / non-scalar ids fall back to <stem>:<line>
    ids.write_text('{"prompt": "a", "id": null}\n{"prompt": "b", "id": null}\n{"prompt": "c", "id": ""}\n'
                   '{"prompt": "d", "id": [1]}\n{"prompt": "e", "id": 7}\n{"prompt": "f", "id": "q"}\n')
    assert [r["id"] for r in S.iter_jsonl_prompts(ids)] == ["ids:1", "ids:2", "ids:3", "ids:4", "7", "q"]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "x"}\n{oops\n')
    with pytest.raises(ValueError, match="bad.jsonl, line 2"):
        list(S.iter_jsonl_prompts(bad))


# -- data build ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny():
    """The tiny random target, run on one thread (robust on a shared, busy 2-core box)."""
    import torch

    from dspine.target.adapter import load_target
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield load_target("random:llama")
    torch.set_num_threads(threads)


def _prompts(path: Path, n: int) -> Path:
    rows = [{"id": f"q{i}", "prompt": f"prompt number {i} " + "x" * (3 * i),
             "kind": "code" if i % 2 else "chat"} for i in range(n)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _rows(d: Path) -> list[dict]:
    return [json.loads(line) for s in sorted(d.glob("data-*.jsonl")) for line in s.open()]


def test_build_writes_shards_manifest_and_resumes(tiny, tmp_path):
    out = tmp_path / "ds"
    man = B.build_dataset(tiny, [str(_prompts(tmp_path / "a.jsonl", 5))], out, max_new_tokens=6,
                          batch_size=2, progress=False)
    assert man["complete"] and man["target"] == "random:llama"
    disk = json.loads((out / "manifest.json").read_text())
    assert disk["complete"] and disk["counts"]["prompts"] == 5
    assert disk["template"]["chat"].startswith("none")  # byte tokenizer: raw text
    assert {"vocab_sha256", "vocab_size", "name_or_path"} <= set(disk["tokenizer"])
    rows = _rows(out)
    assert sorted(r["id"] for r in rows) == [f"q{i}" for i in range(5)]
    r0 = rows[0]
    assert {"id", "source", "prompt_ids", "response_ids", "finished"} <= set(r0)
    assert all(1 <= len(r["response_ids"]) <= 6 for r in rows)
    assert all(r["finished"] == (r["response_ids"][-1] == 0) for r in rows)
    assert r0["prompt_ids"] == tiny.encode_prompt(
        json.loads((tmp_path / "a.jsonl").read_text().splitlines()[int(r0["id"][1:])])["prompt"])

    with pytest.raises(ValueError, match="--resume"):
        B.build_dataset(tiny, [str(tmp_path / "a.jsonl")], out, max_new_tokens=6, progress=False)
    before = (out / "manifest.json").read_bytes()
    for kw, opt in (({"max_new_tokens": 7}, "--max-new-tokens 6"), ({"max_prompt_tokens": 100}, "--max-prompt-tokens 384")):
        with pytest.raises(ValueError, match=opt):  # rows made differently: refused, nothing written
            B.build_dataset(tiny, [str(tmp_path / "a.jsonl")], out, progress=False, resume=True,
                            **{"max_new_tokens": 6, **kw})
    assert (out / "manifest.json").read_bytes() == before
    more = _prompts(tmp_path / "b.jsonl", 8)
    man = B.build_dataset(tiny, [str(more)], out, max_new_tokens=6, batch_size=3, resume=True,
                          progress=False)
    assert man["complete"] and man["counts"]["prompts"] == 8 and man["runs"][-1]["new_rows"] == 3
    assert sorted(r["id"] for r in _rows(out)) == sorted(f"q{i}" for i in range(8))
    assert man["sources"] == [str(tmp_path / "a.jsonl"), str(more)]  # union of both runs' sources

    seqs = DL.load_dataset(out, tiny)
    assert len(seqs) == 8
    s = seqs[0]
    row = _rows(out)[0]
    assert s.input_ids == row["prompt_ids"] + row["response_ids"]
    assert s.response_start == len(row["prompt_ids"])


def test_damaged_rows_are_named_by_file_and_line(tiny, tmp_path):
    out = tmp_path / "ds"
    B.build_dataset(tiny, [str(_prompts(tmp_path / "a.jsonl", 3))], out, max_new_tokens=3, progress=False)
    shard = out / "data-00000.jsonl"
    good = shard.read_text().splitlines()
    row = json.loads(good[1])
    for damage, needle in ((lambda r: r.pop("prompt_ids"), "prompt_ids must be"),
                           (lambda r: r.update(response_ids="abc"), "response_ids must be"),
                           (lambda r: r.update(prompt_ids=[1.5, 2]), "prompt_ids must be"),
                           (None, "not valid JSON")):
        bad = dict(row)
        text = "{oops" if damage is None else (damage(bad), json.dumps(bad))[1]
        shard.write_text("\n".join([good[0], text, *good[2:]]) + "\n")
        with pytest.raises(ValueError, match=f"data-00000.jsonl, line 2: {needle}"):
            DL.load_dataset(out, tiny)
        with pytest.raises(ValueError, match=f"line 2: {needle}"):  # --resume scans the rows too
            B.build_dataset(tiny, [str(tmp_path / "a.jsonl")], out, max_new_tokens=3, resume=True, progress=False)


def test_build_refuses_a_data_text_directory(tiny, tmp_path):
    out = tmp_path / "text"
    out.mkdir()
    man = {"format": "dspine-data/1", "kind": "text", "target": tiny.name,
           "tokenizer": TK.tokenizer_fingerprint(tiny.tokenizer), "counts": {"prompts": 3}}
    (out / "manifest.json").write_text(json.dumps(man))
    with pytest.raises(ValueError, match="`dspine data text` set"):
        B.build_dataset(tiny, [str(_prompts(tmp_path / "a.jsonl", 2))], out, max_new_tokens=3,
                        resume=True, progress=False)
    assert json.loads((out / "manifest.json").read_text()) == man  # nothing changed


def test_second_build_into_the_same_directory_is_refused(tiny, tmp_path):
    """Two builds appending to one --out duplicated rows; the second now stops at once."""
    out = tmp_path / "ds"
    out.mkdir()
    held = ST._lock_dir(out)  # as a running build holds it
    with pytest.raises(ValueError, match="being written by another"):
        B.build_dataset(tiny, [str(_prompts(tmp_path / "a.jsonl", 3))], out, max_new_tokens=3, progress=False)
    assert not (out / "manifest.json").exists()
    held.close()  # the first build ends: the directory is free again
    man = B.build_dataset(tiny, [str(tmp_path / "a.jsonl")], out, max_new_tokens=3, progress=False)
    assert man["complete"] and man["counts"]["prompts"] == 3


def test_build_shards_are_disjoint_and_cover_the_stream(tiny, tmp_path):
    src = str(_prompts(tmp_path / "a.jsonl", 7))
    ids = []
    for k in range(3):
        man = B.build_dataset(tiny, [src], tmp_path / f"s{k}", max_new_tokens=3, batch_size=2,
                              shard=(k, 3), progress=False)
        assert man["complete"] and man["shard"] == f"{k}/3"
        got = sorted(r["id"] for r in _rows(tmp_path / f"s{k}"))
        assert got == sorted(f"q{i}" for i in range(k, 7, 3))  # positions i % 3 == k
        ids += got
    assert sorted(ids) == sorted(f"q{i}" for i in range(7))
    # a sharded build keeps its shard: resuming with another one is refused, nothing written
    before = _rows(tmp_path / "s1")
    with pytest.raises(ValueError, match="--shard 1/3"):
        B.build_dataset(tiny, [src], tmp_path / "s1", max_new_tokens=3, shard=(0, 3), resume=True,
                        progress=False)
    assert _rows(tmp_path / "s1") == before
    for bad in ("3/3", "1", "a/2", "-1/2"):
        with pytest.raises(ValueError, match="--shard must be k/N"):
            B.parse_shard(bad)
    assert B.parse_shard("1/4") == (1, 4)


def test_build_refuses_other_target_and_load_checks_target(tiny, tmp_path):
    from dspine.target.adapter import load_target

    out = tmp_path / "ds"
    B.build_dataset(tiny, [str(_prompts(tmp_path / "a.jsonl", 2))], out, max_new_tokens=3,
                    progress=False)
    other = load_target("random:qwen2")
    with pytest.raises(ValueError, match=r"random:llama.*random:qwen2"):
        DL.load_dataset(out, other)
    with pytest.raises(ValueError, match="random:llama"):
        B.build_dataset(other, [str(tmp_path / "a.jsonl")], out, max_new_tokens=3, resume=True,
                        progress=False)
    m = out / "manifest.json"
    m.write_text(m.read_text()[:50])  # truncated manifest: the error names the file
    with pytest.raises(ValueError, match=r"manifest.json is damaged"):
        DL.load_dataset(out, tiny)


def test_build_empty_prompt_file(tiny, tmp_path):
    empty = tmp_path / "none.jsonl"
    empty.write_text("")
    with pytest.raises(ValueError, match="none.jsonl"):
        B.build_dataset(tiny, [str(empty)], tmp_path / "ds", progress=False)
    assert not (tmp_path / "ds" / "manifest.json").exists()


def test_build_refuses_prompt_files_with_the_same_name_and_notes_skipped_rows(tiny, tmp_path, capsys):
    """Rows without an id are named <file name>:<line>: two files named p.jsonl would collide
    (the second file's rows silently skipped), so that is refused; rows without a usable
    prompt are reported with their line numbers."""
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    for d, text in (("a", "alpha"), ("b", "beta")):
        (tmp_path / d / "p.jsonl").write_text(json.dumps({"prompt": f"say {text}"}) + "\n")
    with pytest.raises(ValueError, match=r"same file name 'p'"):
        B.build_dataset(tiny, [str(tmp_path / "a" / "p.jsonl"), str(tmp_path / "b" / "p.jsonl")],
                        tmp_path / "ds", max_new_tokens=3, progress=False)
    assert not (tmp_path / "ds").exists()
    mixed = tmp_path / "mixed.jsonl"
    mixed.write_text("".join(json.dumps(r) + "\n" for r in
                             [{"prompt": "Say hi."}, {"text": "nope"}, {"prompt": 123}, {"prompt": "Name a color."}]))
    capsys.readouterr()
    man = B.build_dataset(tiny, [str(mixed)], tmp_path / "ds2", max_new_tokens=3, progress=False)
    assert man["counts"]["prompts"] == 2
    err = capsys.readouterr().err
    assert "skipped 2 row(s)" in err and "line 2, 3" in err and err.count("skipped 2 row(s)") == 1


def test_data_text_never_overwrites_a_dataset(tiny, tmp_path):
    from dspine.data.text import build_text_dataset

    out = tmp_path / "ds"
    B.build_dataset(tiny, [str(_prompts(tmp_path / "a.jsonl", 2))], out, max_new_tokens=3, progress=False)
    before = (out / "data-00000.jsonl").read_bytes()
    with pytest.raises(ValueError, match="already holds a dataset"):
        build_text_dataset(tiny, out, ["stdlib"], max_tokens=200, seq_len=64)
    assert (out / "data-00000.jsonl").read_bytes() == before
    man = build_text_dataset(tiny, tmp_path / "text", ["stdlib"], max_tokens=200, seq_len=64)
    assert man["counts"]["finished"] == man["counts"]["prompts"] > 0


def test_interrupted_build_is_not_complete_and_resumes(tiny, tmp_path, monkeypatch):
    src = str(_prompts(tmp_path / "a.jsonl", 6))
    out = tmp_path / "ds"
    real, calls = B.generate_batch, []

    def flaky(*a, **k):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(*a, **k)

    monkeypatch.setattr(B, "generate_batch", flaky)
    with pytest.raises(KeyboardInterrupt):
        B.build_dataset(tiny, [src], out, max_new_tokens=4, batch_size=2, progress=False)
    man = ST.read_manifest(out)
    assert man["complete"] is False and man["counts"]["prompts"] == 2
    with open(out / "data-00000.jsonl", "a") as f:
        f.write('{"id": "torn", "prompt_ids": [1')  # a crash mid-write
    monkeypatch.setattr(B, "generate_batch", real)
    man = B.build_dataset(tiny, [src], out, max_new_tokens=4, batch_size=2, resume=True,
                          progress=False)
    assert man["complete"] and man["counts"]["prompts"] == 6
    assert sorted(r["id"] for r in _rows(out)) == [f"q{i}" for i in range(6)]


def test_time_limit_stops_between_batches_and_the_build_resumes(tiny, tmp_path, monkeypatch):
    """--time-limit: no batch starts after the limit; what was written stays, the manifest
    says incomplete and why, and --resume finishes the stream."""
    src = str(_prompts(tmp_path / "a.jsonl", 6))
    out = tmp_path / "ds"
    clock = iter(range(0, 1000, 10))  # each time.time() call: 10 s later
    monkeypatch.setattr(B.time, "time", lambda: float(next(clock)))
    man = B.build_dataset(tiny, [src], out, max_new_tokens=3, batch_size=2, progress=False, time_limit=15)
    assert man["complete"] is False and 0 < man["counts"]["prompts"] < 6
    assert man["runs"][-1]["stopped"] == "--time-limit 15 s"
    assert man["sampling"]["device"] == "cpu"
    monkeypatch.undo()
    man = B.build_dataset(tiny, [src], out, max_new_tokens=3, batch_size=2, progress=False, resume=True)
    assert man["complete"] and man["counts"]["prompts"] == 6
    with pytest.raises(ValueError, match="--time-limit"):
        B.build_dataset(tiny, [src], tmp_path / "other", progress=False, time_limit=0)
    with pytest.raises(ValueError, match="SpeculativeConfig.device 'tpu'"):
        B.build_dataset(tiny, [src], tmp_path / "other2", progress=False, device="tpu")


def test_mixed_sources_interleave(tiny, tmp_path):
    man = B.build_dataset(tiny, ["stdlib", "sharegpt"], tmp_path / "ds", max_prompts=4,
                          max_new_tokens=2, batch_size=4, max_prompt_tokens=64, progress=False)
    rows = _rows(tmp_path / "ds")
    assert man["complete"] and man["counts"]["prompts"] + man["counts"]["skipped_too_long"] == 4
    assert {r["source"] for r in rows} <= {"stdlib", "sharegpt"} and "stdlib" in {r["source"] for r in rows}
    assert all(len(r["prompt_ids"]) <= 64 for r in rows)


def test_cli_parser_registers_data_build():
    import argparse

    p = argparse.ArgumentParser()
    sub = p.add_subparsers(dest="cmd")
    data_cli.add_data_parser(sub)
    args = p.parse_args(["data", "build", "--prompts", "stdlib", "sharegpt", "--out", "x", "--resume"])
    assert args.func is data_cli._cmd_build and args.prompts == ["stdlib", "sharegpt"] and args.resume
    assert args.dtype == "auto" and args.target == "smollm2-135m"


def test_generate_batch_matches_hf_generate_with_row_dropping(tiny):
    import collections
    import random

    from dspine.data.generate import generate_batch, generate_batch_hf

    rng = random.Random(0)
    prompts = [[rng.randrange(1, 256) for _ in range(rng.randrange(3, 30))] for _ in range(8)]
    ref = generate_batch_hf(tiny.model, prompts, 20, {0}, 0)
    # a frequent token as EOS makes rows finish at different steps (and get dropped)
    eos = {collections.Counter(t for r, _ in ref for t in r[3:]).most_common(3)[2][0]}
    got = generate_batch(tiny.model, prompts, 20, eos, 0)
    assert got == generate_batch_hf(tiny.model, prompts, 20, eos, 0)
    assert 0 < sum(f for _, f in got) < len(got)
    assert all(r[-1] in eos for r, f in got if f) and all(len(r) == 20 for r, f in got if not f)


def test_failed_build_leaves_no_lock_file_behind(tiny, tmp_path):
    """A build refused before writing anything used to leave ``--out/.lock``, so the folder
    looked used (``dspine data text`` then refused it)."""
    src = str(_prompts(tmp_path / "a.jsonl", 2))
    with pytest.raises(ValueError, match="--shard must be k/N"):  # refused after the lock is taken
        B.build_dataset(tiny, [src], tmp_path / "new", max_new_tokens=3, shard=(2, 2), progress=False)
    assert not (tmp_path / "new").exists()  # the folder this run created is gone again
    (tmp_path / "mine").mkdir()
    with pytest.raises(ValueError, match="--shard must be k/N"):
        B.build_dataset(tiny, [src], tmp_path / "mine", max_new_tokens=3, shard=(2, 2), progress=False)
    assert (tmp_path / "mine").is_dir() and not any((tmp_path / "mine").iterdir())  # kept, still empty
    man = B.build_dataset(tiny, [src], tmp_path / "mine", max_new_tokens=3, progress=False)
    assert man["complete"] and (tmp_path / "mine" / ".lock").exists()  # a used folder keeps its lock file


def test_refused_build_leaves_existing_and_parent_folders_as_found(tiny, tmp_path):
    src = str(_prompts(tmp_path / "a.jsonl", 2))
    shonly = tmp_path / "shonly"  # data shards but no manifest: refused
    shonly.mkdir()
    (shonly / "data-00000.jsonl").write_text("")
    with pytest.raises(ValueError, match="no manifest.json"):
        B.build_dataset(tiny, [src], shonly, max_new_tokens=3, progress=False)
    assert sorted(q.name for q in shonly.iterdir()) == ["data-00000.jsonl"]  # no .lock added
    with pytest.raises(ValueError, match="--shard must be k/N"):
        B.build_dataset(tiny, [src], tmp_path / "n1" / "n2" / "n3", max_new_tokens=3, shard=(3, 2),
                        progress=False)
    assert not (tmp_path / "n1").exists()  # every folder this run created is gone
    for kw, name in (({"max_new_tokens": 0}, "--max-new-tokens 0"), ({"batch_size": 0}, "--batch-size 0")):
        with pytest.raises(ValueError, match=name):
            B.build_dataset(tiny, [src], tmp_path / "z", progress=False, **{"max_new_tokens": 3, **kw})
    assert not (tmp_path / "z").exists()


def test_pack_resume_and_load(tiny, tmp_path):
    """`dspine data pack` gzips shards in place (sha256 in the manifest); a later build
    --resume appends a new plain shard after them, skipping the packed ids; loading reads
    both, and a packed shard whose bytes changed is refused by name."""
    out = tmp_path / "ds"
    B.build_dataset(tiny, [str(_prompts(tmp_path / "a.jsonl", 5))], out, max_new_tokens=6, batch_size=2,
                    progress=False)
    before = [(s.id, s.input_ids) for s in DL.load_dataset(out, tiny)]
    man = ST.pack_dataset(out)
    assert man["shards"] == ["data-00000.jsonl.gz"] and not list(out.glob("data-*.jsonl"))
    e = man["packed"]["data-00000.jsonl.gz"]
    assert e["rows"] == 5 and e["bytes"] == (out / "data-00000.jsonl.gz").stat().st_size
    assert [(s.id, s.input_ids) for s in DL.load_dataset(out, tiny)] == before
    man = B.build_dataset(tiny, [str(_prompts(tmp_path / "b.jsonl", 8))], out, max_new_tokens=6, batch_size=3,
                          resume=True, progress=False)
    assert man["counts"]["prompts"] == 8 and man["runs"][-1]["new_rows"] == 3
    assert man["shards"] == ["data-00000.jsonl.gz", "data-00001.jsonl"]
    assert sorted(s.id for s in DL.load_dataset(out, tiny)) == [f"q{i}" for i in range(8)]
    man = ST.pack_dataset(out)  # packs only the new shard; the first keeps its bytes
    assert man["packed"]["data-00000.jsonl.gz"] == e and man["packed"]["data-00001.jsonl.gz"]["rows"] == 3
    gz = out / "data-00000.jsonl.gz"
    raw = bytearray(gz.read_bytes())
    raw[20] ^= 0xFF  # one damaged byte
    gz.write_bytes(bytes(raw))
    with pytest.raises(ValueError, match="data-00000.jsonl.gz differs from the sha256"):
        DL.load_dataset(out, tiny)
    gz.write_bytes(bytes(raw[:20]) + bytes([raw[20] ^ 0xFF]) + bytes(raw[21:]))  # restored
    DL.load_dataset(out, tiny)
    dup = out / "data-00002.jsonl"  # a hand-made shard repeating a packed row: trained on twice
    dup.write_text(json.dumps({"id": "q0", "prompt_ids": [1], "response_ids": [2]}) + "\n")
    with pytest.raises(ValueError, match="row id 'q0' appears twice"):
        DL.load_dataset(out, tiny)
    dup.unlink()
    gz.write_bytes(bytes(raw))
    # a build --resume refuses it too, before generating anything (training would refuse the result)
    with pytest.raises(ValueError, match="data-00000.jsonl.gz differs from the sha256"):
        B.build_dataset(tiny, [str(_prompts(tmp_path / "c.jsonl", 9))], out, max_new_tokens=6, batch_size=3,
                        resume=True, progress=False)
    assert not list(out.glob("data-*.jsonl"))  # nothing written


def test_head_copies_a_prefix_of_the_rows(tiny, tmp_path):
    """`dspine data head DIR --shards N`: the first N packed shards as their own data directory,
    whose rows are a prefix of the source's (so a run on it continues on the whole), counts
    recounted; bad settings are refused by name and nothing is written."""
    out = tmp_path / "ds"
    B.build_dataset(tiny, [str(_prompts(tmp_path / "a.jsonl", 5))], out, max_new_tokens=6, batch_size=2,
                    progress=False)
    ST.pack_dataset(out)
    B.build_dataset(tiny, [str(_prompts(tmp_path / "b.jsonl", 8))], out, max_new_tokens=6, batch_size=3,
                    resume=True, progress=False)
    ST.pack_dataset(out)
    full = [(s.id, s.input_ids) for s in DL.load_dataset(out, tiny)]
    head = tmp_path / "head"
    man = ST.head_dataset(out, 1, head)
    got = [(s.id, s.input_ids) for s in DL.load_dataset(head, tiny)]
    assert got == full[:5] and man["counts"]["prompts"] == 5 and not man["complete"]
    assert man["counts"]["response_tokens"] == sum(len(i) for _, i in full[:5]) - man["counts"]["prompt_tokens"]
    assert man["head_of"]["shards"] == 1 and man["head_of"]["counts"]["prompts"] == 8
    assert sorted(p.name for p in head.iterdir()) == ["data-00000.jsonl.gz", "manifest.json"]
    from dspine.cli.main import main

    assert main(["data", "head", str(out), "--shards", "2", "--out", str(tmp_path / "h2")]) == 0
    assert [(s.id, s.input_ids) for s in DL.load_dataset(tmp_path / "h2", tiny)] == full
    assert main(["data", "head", str(out), "--shards", "0", "--out", str(tmp_path / "h0")]) == 2
    with pytest.raises(ValueError, match=r"--shards 3: .* has 2 packed shards"):
        ST.head_dataset(out, 3, tmp_path / "h3")
    with pytest.raises(ValueError, match="--out .* is not empty"):
        ST.head_dataset(out, 1, head)
    (out / "data-00000.jsonl.gz").rename(out / "x")
    (out / "data-00000.jsonl").write_bytes(b"")  # an unpacked shard in the prefix
    with pytest.raises(ValueError, match="not listed|missing"):  # the manifest check speaks first
        ST.head_dataset(out, 1, tmp_path / "h4")
    assert not (tmp_path / "h3").exists() and not (tmp_path / "h4").exists()


def test_pack_refuses_what_would_lose_rows(tiny, tmp_path):
    """pack never overwrites a packed shard, never drops a last row without a newline and
    refuses a directory whose packed shards differ from the manifest (nothing written)."""
    out = tmp_path / "ds"
    B.build_dataset(tiny, [str(_prompts(tmp_path / "a.jsonl", 3))], out, max_new_tokens=4, batch_size=2,
                    progress=False)
    ST.pack_dataset(out)
    plain = out / "data-00000.jsonl"
    plain.write_text(json.dumps({"id": "x", "prompt_ids": [1], "response_ids": [2]}) + "\n")
    with pytest.raises(ValueError, match="both exist"):
        ST.pack_dataset(out)
    plain.rename(out / "data-00001.jsonl")
    (out / "data-00001.jsonl").write_text(json.dumps({"id": "x", "prompt_ids": [1], "response_ids": [2]}))
    with pytest.raises(ValueError, match="ends without a newline"):
        ST.pack_dataset(out)
    assert (out / "data-00001.jsonl").exists() and not (out / "data-00001.jsonl.gz").exists()
    (out / "data-00001.jsonl").unlink()
    (out / "data-00009.jsonl.gz").write_bytes(b"stray")
    before = (out / "manifest.json").read_bytes()
    with pytest.raises(ValueError, match="not listed"):
        ST.pack_dataset(out)
    assert (out / "manifest.json").read_bytes() == before
    with pytest.raises(ValueError, match="does not exist"):
        ST.pack_dataset(tmp_path / "nothing")


def test_engine_generator_rows_are_the_runtimes_greedy_output(tmp_path, one_thread):
    """--generator engine: each row is what dspine's own `ar` loop (the measured runtime,
    batched) emits for the prompt alone; a directory keeps its generator on --resume."""
    from dspine.config import SamplingConfig
    from dspine.core.engine import Engine
    from dspine.target.adapter import load_target

    tiny = load_target("random:llama")  # a private copy: the build applies dspine's runtime to it
    out = tmp_path / "ds"
    man = B.build_dataset(tiny, [str(_prompts(tmp_path / "a.jsonl", 6))], out, max_new_tokens=8,
                          batch_size=3, progress=False, generator="engine")
    assert man["complete"] and man["sampling"]["generator"] == "engine"
    single = Engine(tiny, None, "ar")  # the same target object: the runtime the build applied
    rows = _rows(out)
    assert len(rows) == 6
    for r in rows:
        want = single.generate(r["prompt_ids"], SamplingConfig(), 8).token_ids
        assert r["response_ids"] == want
        assert r["finished"] == (want[-1] in tiny.eos_token_ids)
    with pytest.raises(ValueError, match="--generator 'gpu'"):
        B.build_dataset(tiny, [str(tmp_path / "a.jsonl")], tmp_path / "x", progress=False, generator="gpu")


def _tamper_last_row(out):
    """Change the last response token of the directory's last row (a row another decoder wrote)."""
    shard = sorted(out.glob("data-*.jsonl"))[-1]
    lines = shard.read_text().splitlines()
    row = json.loads(lines[-1])
    row["response_ids"][-1] = (row["response_ids"][-1] + 1) % 50
    lines[-1] = json.dumps(row)
    shard.write_text("\n".join(lines) + "\n")
    return row["id"]


def test_resume_switches_generator_only_where_the_new_one_reproduces_the_last_rows(tmp_path, one_thread):
    """--resume with the other --generator regenerates the directory's last rows first: the same
    ids let it continue (recorded in the run), one differing token refuses it, writing nothing."""
    from dspine.data.generator_check import SWITCH_CHECK_ROWS
    from dspine.target.adapter import load_target

    src = str(_prompts(tmp_path / "a.jsonl", SWITCH_CHECK_ROWS + 4))
    for first, other in (("hf", "engine"), ("engine", "hf")):
        tiny = load_target("random:llama")  # a private copy: the engine applies dspine's runtime to it
        out = tmp_path / f"ds-{first}"
        B.build_dataset(tiny, [src], out, max_new_tokens=6, batch_size=4, max_prompts=SWITCH_CHECK_ROWS + 1,
                        progress=False, generator=first)
        shard = sorted(out.glob("data-*.jsonl"))[-1]
        for tamper in ("longer", "finished"):  # a row longer than its answer, or with another end, is no match
            before = shard.read_text()
            lines = before.splitlines()
            row = json.loads(lines[-1])
            if tamper == "longer":
                row["response_ids"] += [5, 5, 5]
            else:
                row["finished"] = not row["finished"]
            shard.write_text("\n".join(lines[:-1] + [json.dumps(row)]) + "\n")
            with pytest.raises(ValueError, match=f"row {row['id']!r}"):
                B.build_dataset(tiny, [src], out, max_new_tokens=6, batch_size=4, progress=False, resume=True,
                                generator=other)
            shard.write_text(before)
        bad = _tamper_last_row(out)  # negative control: a row the new generator does not reproduce
        before = {p.name: p.read_bytes() for p in out.iterdir()}
        with pytest.raises(ValueError, match=f"--generator {first!r}.*row {bad!r}"):
            B.build_dataset(tiny, [src], out, max_new_tokens=6, batch_size=4, progress=False, resume=True,
                            generator=other)
        assert {p.name: p.read_bytes() for p in out.iterdir()} == before  # nothing written
        shard = sorted(out.glob("data-*.jsonl"))[-1]  # drop the tampered row: the resumed run rebuilds it
        shard.write_text("".join(shard.read_text().splitlines(keepends=True)[:-1]))
        man = B.build_dataset(tiny, [src], out, max_new_tokens=6, batch_size=4, progress=False, resume=True,
                              generator=other)
        assert man["complete"] and man["counts"]["prompts"] == SWITCH_CHECK_ROWS + 4
        assert man["runs"][-1]["generator_check"] == {"against": first, "rows": SWITCH_CHECK_ROWS,
                                                      "same": SWITCH_CHECK_ROWS}
        assert man["sampling"]["generator"] == other


def test_directories_from_before_the_generator_setting_resume_as_hf(tiny, tmp_path):
    out = tmp_path / "ds"
    B.build_dataset(tiny, [str(_prompts(tmp_path / "a.jsonl", 2))], out, max_new_tokens=3, progress=False)
    man = json.loads((out / "manifest.json").read_text())
    del man["sampling"]["generator"]  # as written before 2026-12-05
    (out / "manifest.json").write_text(json.dumps(man))
    bad = _tamper_last_row(out)
    with pytest.raises(ValueError, match=f"--generator 'hf'.*row {bad!r}"):  # checked against hf's rows
        B.build_dataset(tiny, [str(tmp_path / "a.jsonl")], out, max_new_tokens=3, progress=False, resume=True,
                        generator="engine", batch_size=4)
    with pytest.raises(ValueError, match="--batch-size 32 with --generator engine"):  # before anything loads
        B.build_dataset("no-such-target", [str(tmp_path / "a.jsonl")], tmp_path / "y", progress=False,
                        generator="engine")
    B.build_dataset(tiny, [str(tmp_path / "a.jsonl")], out, max_new_tokens=3, progress=False, resume=True)
