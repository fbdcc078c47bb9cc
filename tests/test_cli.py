"""``dspine generate``: bad settings exit 2 with a one-line error naming the setting;
``--json`` prints text, token_ids, mode and stats.

Most cases call ``dspine.cli.main.main`` in-process (fast); one runs ``python -m dspine.cli``
in a subprocess to check the real exit status and stderr.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from dataclasses import fields

import pytest

from dspine.cli.main import main
from dspine.drafter.checkpoint import random_drafter, save_drafter
from dspine.core.request import GenerationStats
from dspine.target.adapter import load_target

pytestmark = pytest.mark.usefixtures("one_thread")

CLI_TARGET = "random:llama"  # what the CLI loads: vocab 256, hidden 64, seed 0


def cli(capsys, *args):
    code = main(list(args))
    out = capsys.readouterr()
    return code, out.out, out.err


def assert_error(code, err, *needles):
    assert code == 2
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    assert lines[0].startswith("dspine: error:")
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    """Saved random drafters: a good one for the CLI target (block 16, DSpine and DFlash),
    and ones for other random targets (vocabulary 128; hidden 32)."""
    root = tmp_path_factory.mktemp("ckpts")
    target = load_target(CLI_TARGET)
    paths = {
        "good": save_drafter(random_drafter(target, "dspine", 16), root / "good"),
        "dflash": save_drafter(random_drafter(target, "dflash", 16), root / "dflash"),
        "vocab128": save_drafter(random_drafter(load_target(CLI_TARGET, vocab_size=128), "dspine", 16),
                                 root / "vocab128"),
        "hidden32": save_drafter(random_drafter(load_target(CLI_TARGET, hidden_size=32, intermediate_size=64),
                                                "dspine", 16), root / "hidden32"),
    }
    return {k: str(v) for k, v in paths.items()}


def _gen(*extra):
    return ["generate", "hello world", "--target", CLI_TARGET, "--max-new-tokens", "12", *extra]


def test_unknown_target_subprocess():
    env = dict(os.environ, OMP_NUM_THREADS="1")
    r = subprocess.run([sys.executable, "-m", "dspine.cli", "generate", "hi", "--target", "no-such-model-xyz",
                        "--mode", "ar"], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 2, r
    assert_error(2, r.stderr, "no-such-model-xyz")
    assert r.stdout == ""


def test_an_empty_stop_string_is_refused_before_loading(capsys):
    code, out, err = cli(capsys, "generate", "hi", "--target", "no-such-model-xyz", "--stop", "x", "--stop", "")
    assert_error(code, err, "--stop ''", "empty")
    code, out, err = cli(capsys, "generate", "hi", "--target", "no-such-model-xyz", "--stop", "x")
    assert_error(code, err, "unknown target")  # negative control: a real stop string passes this check


def test_unknown_target_in_process(capsys):
    code, out, err = cli(capsys, "generate", "hi", "--target", "no-such-model-xyz", "--mode", "ar")
    assert_error(code, err, "no-such-model-xyz", "unknown target")
    code, out, err = cli(capsys, "generate", "hi", "--target", "random:gpt9", "--mode", "ar")
    assert_error(code, err, "gpt9")
    code, out, err = cli(capsys, "generate", "hi", "--target", "no-such-model-xyz")  # the default mode, dspine
    assert_error(code, err, "no-such-model-xyz", "unknown target")  # not "no shipped drafter for it"


def test_vocab_mismatch(capsys, ckpts):
    code, out, err = cli(capsys, *_gen("--drafter", ckpts["vocab128"], "--mode", "dspine"))
    assert_error(code, err, "vocabulary", "128", "256")


def test_hidden_mismatch(capsys, ckpts):
    code, out, err = cli(capsys, *_gen("--drafter", ckpts["hidden32"], "--mode", "dspine"))
    assert_error(code, err, "hidden size", "32", "64")


def test_block_size_mismatch(capsys, ckpts):
    code, out, err = cli(capsys, *_gen("--drafter", ckpts["good"], "--block-size", "8", "--mode", "dspine"))
    assert_error(code, err, "--block-size 8", "block size 16")


def test_acceptance_mode_mismatch(capsys, ckpts):
    code, out, err = cli(capsys, "acceptance", "--target", CLI_TARGET, "--drafter", ckpts["good"], "--mode", "dflash")
    assert_error(code, err, "--mode dflash does not match", "trained as dspine")


def test_mode_mismatch(capsys, ckpts):
    code, out, err = cli(capsys, *_gen("--drafter", ckpts["dflash"], "--mode", "dspine"))
    assert_error(code, err, "--mode 'dspine'", "dflash")


def test_missing_and_corrupt_weights(capsys, ckpts, tmp_path):
    missing = tmp_path / "missing"
    shutil.copytree(ckpts["good"], missing)
    (missing / "model.safetensors").unlink()
    code, out, err = cli(capsys, *_gen("--drafter", str(missing), "--mode", "dspine"))
    assert_error(code, err, "model.safetensors", "missing")

    garbage = tmp_path / "garbage"
    shutil.copytree(ckpts["good"], garbage)
    (garbage / "model.safetensors").write_bytes(b"\x07not a safetensors file\xff" * 64)
    code, out, err = cli(capsys, *_gen("--drafter", str(garbage), "--mode", "dspine"))
    assert_error(code, err, "model.safetensors", "corrupt")

    truncated = tmp_path / "truncated"
    shutil.copytree(ckpts["good"], truncated)
    f = truncated / "model.safetensors"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    code, out, err = cli(capsys, *_gen("--drafter", str(truncated), "--mode", "dspine"))
    assert_error(code, err, "model.safetensors")

    nocfg = tmp_path / "nocfg"
    shutil.copytree(ckpts["good"], nocfg)
    (nocfg / "config.json").unlink()
    code, out, err = cli(capsys, *_gen("--drafter", str(nocfg), "--mode", "dspine"))
    assert_error(code, err, "config.json")

    code, out, err = cli(capsys, *_gen("--drafter", str(tmp_path / "nowhere"), "--mode", "dspine"))
    assert_error(code, err, "nowhere")


@pytest.mark.parametrize("args,needle", [
    (["--temperature", "-1"], "temperature"),
    (["--top-p", "0"], "top_p"),
    (["--min-p", "1.5"], "min_p"),
    (["--top-k", "-2"], "top_k"),
    (["--max-new-tokens", "0"], "max-new-tokens"),
    (["--dtype", "float8"], "--dtype"),
    (["--mode", "medusa"], "medusa"),
    (["--seed", "18446744073709551616"], "--seed"),
    (["--seed", "-1"], "--seed"),
    (["--tree-budget", "-1"], "--tree-budget"),
    (["--tree-budget", "100000"], "--tree-budget"),
    (["--tree-shape", "4,0"], "--tree-shape"),
    (["--tree-shape", "wide"], "--tree-shape"),
])
def test_bad_settings(capsys, args, needle):
    code, out, err = cli(capsys, *_gen("--drafter", "random", *args))
    assert_error(code, err, needle)


def test_generate_json(capsys, ckpts):
    stat_keys = {f.name for f in fields(GenerationStats)}
    results = {}
    for mode, drafter in (("ar", []), ("dspine", ["--drafter", "random"]), ("dflash", ["--drafter", "random"]),
                          ("dspine", ["--drafter", ckpts["good"]])):
        code, out, err = cli(capsys, *_gen("--mode", mode, "--json", *drafter))
        assert code == 0, err
        obj = json.loads(out)
        assert {"text", "token_ids", "mode", "stats"} <= set(obj)
        assert obj["mode"] == mode
        assert isinstance(obj["text"], str)
        assert set(obj["stats"]) == stat_keys
        st = obj["stats"]
        ids = obj["token_ids"]
        assert 1 <= len(ids) <= 12 and all(isinstance(i, int) and 0 <= i < 256 for i in ids)
        assert st["output_tokens"] == len(ids)
        assert st["cycles"] == len(st["verification_lengths"])
        assert st["prompt_tokens"] == len("hello world".encode())
        assert st["peak_memory_bytes"] > 0 and st["total_s"] >= st["decode_s"] >= 0
        if mode != "ar":
            assert st["cycles"] >= 1 and st["accepted_length_mean"] >= 1.0
        results[(mode, len(drafter) and drafter[1])] = ids
    # lossless through the CLI too: every greedy mode prints the ar token ids
    assert len({tuple(v) for v in results.values()}) == 1, results


def test_generate_tree_json(capsys):
    """``--tree-budget`` verifies draft trees (the dense runtime, a DSpine drafter): the stats
    say so and count the nodes; the ids stay the target's own."""
    code, out, err = cli(capsys, *_gen("--mode", "dspine", "--drafter", "random", "--json", "--tree-budget", "8",
                                       "--proposer", "drafter", "--verify-policy", "fixed"))
    assert code == 0, err
    st = json.loads(out)["stats"]
    # the default --tree-size cost needs the cost policy's curve: with --verify-policy fixed it says so
    assert st["kernels"]["draft_tree"] == ("tree(budget=8, shape=dynamic, size=fixed: --tree-size cost needs "
                                           "--verify-policy cost)")
    assert st["tree_nodes"] and max(st["tree_nodes"]) <= 8
    code, out_ar, _ = cli(capsys, *_gen("--mode", "ar", "--json"))
    assert json.loads(out)["token_ids"] == json.loads(out_ar)["token_ids"]
    code, out, err = cli(capsys, *_gen("--mode", "dspine", "--drafter", "random", "--json", "--tree-budget", "8",
                                       "--runtime", "hf"))
    assert code == 0, err
    assert json.loads(out)["stats"]["kernels"]["draft_tree"].startswith("chain (trees need the dense runtime")


def test_generate_streams_text(capsys):
    code, out, err = cli(capsys, *_gen("--mode", "dspine", "--drafter", "random"))
    assert code == 0
    code2, out2, _ = cli(capsys, *_gen("--mode", "ar", "--json"))
    assert out == json.loads(out2)["text"] + "\n"
    assert "[dspine]" in err and "tau" in err


def test_generate_notes_ignored_settings(capsys):
    code, _, err = cli(capsys, *_gen("--mode", "ar", "--top-k", "5", "--top-p", "0.9", "--drafter", "random"))
    assert code == 0
    assert "--top-k 5, --top-p 0.9 ignored: --temperature 0 is greedy" in err
    assert "--drafter / --block-size ignored: --mode ar" in err
    code, _, err = cli(capsys, *_gen("--mode", "ar", "--verify-policy", "cost"))
    assert code == 0 and "--verify-policy cost ignored: --mode ar" in err
    code, _, err = cli(capsys, *_gen("--mode", "ar", "--temperature", "0.7", "--top-k", "5"))
    assert code == 0 and "ignored" not in err
    code, _, err = cli(capsys, *_gen("--mode", "ar", "--tree-budget", "4"))
    assert code == 0 and "--tree-budget 4 ignored: --mode ar" in err
    code, _, err = cli(capsys, *_gen("--mode", "dspine", "--drafter", "random", "--tree-budget", "0", "--tree-shape", "4,2"))
    assert code == 0 and "--tree-shape 4,2 ignored: --tree-budget is 0" in err


@pytest.mark.parametrize("argv,needle", [
    (["generate", "hi", "--threads", "-1"], "--threads"),
    (["generate", "hi", "--target", CLI_TARGET, "--drafter", "random", "--head-kernel", "fp4"], "--head-kernel 'fp4'"),
    (["generate", "hi", "--target", CLI_TARGET, "--linear-backend", "mkl"], "--linear-backend 'mkl'"),
    (["bench", "--modes", "ar", "--target", CLI_TARGET, "--linear-backend", "mkl"], "--linear-backend 'mkl'"),
    (["generate", "hi", "--target", CLI_TARGET, "--drafter", "random", "--block-size", "100000"], "--block-size"),
    (["generate", "hi", "--target", CLI_TARGET, "--dtype", "int8"], "--dtype int8"),
    (["train", "--data", "d", "--out", "o", "--threads", "-3"], "--threads"),
    (["train", "--data", "d", "--out", "o", "--save-every", "0"], "--save-every"),
    (["train", "--data", "d", "--out", "o", "--vocab-subset", "-5"], "--vocab-subset"),
    (["train", "--data", "d", "--out", "o", "--device", "tpu"], "--device"),
    (["serve", "--port", "99999"], "--port"),
    (["serve", "--shutdown-timeout", "nan"], "--shutdown-timeout"),
    (["bench", "--modes", "ar", "--max-new-tokens", "0"], "--max-new-tokens"),
    (["bench", "--modes", "ar", "--limit", "0"], "--limit"),
    (["bench", "--modes", "dspine", "--dtype", "float16"], "--dtype float16"),
    (["bench", "--modes", "ar", "--concurrency", "9"], "concurrency 9"),
    (["data", "build", "--prompts", "stdlib", "--out", "o", "--batch-size", "0"], "--batch-size"),
    (["data", "text", "--out", "o", "--seq-len", "4"], "--seq-len"),
    (["acceptance", "--drafter", "random", "--n", "0"], "--n"),
    (["acceptance", "--drafter", "random", "--tree-budget", "x"], "--tree-budget"),
    (["bench", "--modes", "dspine", "--tree-shape", "0"], "--tree-shape"),
    (["acceptance", "--drafter", "random", "--target", "random:llama", "--dtype", "float16"], "float16"),
])
def test_bad_settings_of_every_command(capsys, tmp_path, monkeypatch, argv, needle):
    """One ``dspine: error:`` line naming the setting, exit 2, nothing written."""
    monkeypatch.chdir(tmp_path)
    code, out, err = cli(capsys, *argv)
    assert_error(code, err, needle)
    assert not any(tmp_path.iterdir()), list(tmp_path.iterdir())


def test_train_refuses_to_overwrite_a_run(capsys, tmp_path):
    (tmp_path / "run" / "ckpt").mkdir(parents=True)
    code, out, err = cli(capsys, "train", "--target", CLI_TARGET, "--data", str(tmp_path / "none"),
                         "--out", str(tmp_path / "run"), "--device", "cpu")
    assert_error(code, err, "--resume")


def test_data_build_checks_prompt_files_before_writing(capsys, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "fine"}\n{"messages": [{"foo": 1}]}\n')
    code, out, err = cli(capsys, "data", "build", "--target", CLI_TARGET, "--prompts", str(bad),
                         "--out", str(tmp_path / "out"))
    assert_error(code, err, "bad.jsonl, line 2", "'role'")
    code, out, err = cli(capsys, "data", "build", "--target", CLI_TARGET, "--prompts", str(tmp_path / "nope.jsonl"),
                         "--out", str(tmp_path / "out"))
    assert_error(code, err, "nope.jsonl")
    assert not (tmp_path / "out").exists()
    (tmp_path / "afile").write_text("x")
    code, out, err = cli(capsys, "data", "build", "--target", CLI_TARGET, "--prompts", str(bad),
                         "--out", str(tmp_path / "afile"))
    assert code == 2  # the prompt file is checked first; a valid file then meets the --out check
    good = tmp_path / "good.jsonl"
    good.write_text('{"prompt": "fine"}\n')
    code, out, err = cli(capsys, "data", "build", "--target", CLI_TARGET, "--prompts", str(good),
                         "--out", str(tmp_path / "afile"))
    assert_error(code, err, "--out", "is a file")


def test_interrupt_exits_130_with_a_resume_hint(capsys, monkeypatch):
    import dspine.cli.main

    def interrupted(args):
        raise KeyboardInterrupt
    monkeypatch.setattr(dspine.cli.main, "cmd_generate", interrupted)
    code, out, err = cli(capsys, "generate", "hi")
    assert code == 130 and "interrupted" in err and "Traceback" not in err


def test_sigterm_stops_a_command_like_ctrl_c():
    """`kill PID` (SIGTERM) of a long command gives the same clean stop as Ctrl-C, exit 143
    (a background job started by a script ignores SIGINT, so SIGTERM is how it is stopped)."""
    code = ("import sys, time, dspine.cli.main as c\n"
            "def slow(args):\n    print('started', flush=True)\n    time.sleep(60)\n"
            "c.cmd_generate = slow\nsys.exit(c.main(['generate', 'hi']))\n")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "started"
    proc.terminate()
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 143 and "terminated; what was saved is kept" in err and "Traceback" not in err


def test_interrupted_target_conversion_leaves_no_folder(tmp_path):
    """A failed conversion removes its temporary folder; folders left by killed
    conversions (dead pid) are removed by the next one, a live one's are kept."""
    from pathlib import Path

    from dspine.target.registry import _remove_stale_tmp, convert_gguf

    out = tmp_path / "targets" / "gguf-x"
    out.parent.mkdir()
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (out.parent / f"gguf-x.tmp{dead.pid}").mkdir()
    (out.parent / f"gguf-x.tmp{os.getpid()}-keep").mkdir()  # not a pid suffix: left alone
    live = out.parent / f"gguf-x.tmp{os.getppid()}"
    live.mkdir()
    _remove_stale_tmp(out)
    assert sorted(p.name for p in out.parent.iterdir()) == sorted([f"gguf-x.tmp{os.getpid()}-keep", live.name])
    with pytest.raises(Exception):
        convert_gguf(Path(tmp_path / "missing.gguf"), out)
    assert not out.exists() and not (out.parent / f"gguf-x.tmp{os.getpid()}").exists()


@pytest.mark.parametrize("cmd, needles", [
    (["train"], ["--steps STEPS         default: 1000", "(default: 32)", "default: 4"]),
    (["data", "build"], ["default: 256", "default: auto"]),
    (["acceptance"], ["default: 96"]),
    (["serve"], ["(default: 8000)"]),
    (["generate"], ["0 = greedy (default: 0.0)", "--top-k TOP_K 0 = off (default: 0)"]),  # zero defaults too
])
def test_help_shows_defaults(capsys, cmd, needles):
    """Every option's default is in --help (a fresh user had to read the source for them)."""
    with pytest.raises(SystemExit) as e:
        main([*cmd, "--help"])
    assert e.value.code == 0
    out = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
    for n in needles:
        assert " ".join(n.split()) in out, n


def test_damaged_card_is_named(tmp_path):
    from dspine.config import ConfigError
    from dspine.drafter.checkpoint import read_card

    for text, needle in (("{bad", "not valid JSON"), ("[1, 2]", "not a JSON object")):
        (tmp_path / "card.json").write_text(text)
        with pytest.raises(ConfigError, match=f"card.json is damaged \\({needle}"):
            read_card(tmp_path)
    (tmp_path / "card.json").unlink()
    assert read_card(tmp_path) == {}


def test_generate_help_groups_common_options_first(capsys):
    """`dspine generate --help`: sampling and speculation before the advanced groups, whose
    expert knobs (kernels, linears, trees) stay available."""
    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    out = capsys.readouterr().out
    heads = ["what to generate:", "sampling (the default is greedy):", "speculation:", "output:",
             "advanced: device, dtype, kernels", "advanced: draft trees:"]
    pos = [out.index(h) for h in heads]
    assert pos == sorted(pos), pos
    body = out[pos[0]:]  # the option list (the usage line above names every flag too)
    adv = body.index("advanced: device")
    for flag in ("--head-kernel", "--drafter-linears", "--linear-backend", "--tree-budget"):
        assert body.index("  " + flag) > adv, flag
    assert body.index("  --temperature") < adv and body.index("  --proposer") < adv


def test_a_damaged_gguf_target_is_a_clean_error(capsys, tmp_path, monkeypatch):
    """A cut or foreign .gguf given as --target names the setting, never a struct.error."""
    monkeypatch.setenv("DSPINE_HOME", str(tmp_path / "home"))
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF\x03\x00\x00\x00\x01")
    code, out, err = cli(capsys, "generate", "hi", "--target", str(bad), "--mode", "ar")
    assert_error(code, err, "--target", "not a readable GGUF model")


def test_acceptance_names_an_unknown_set_before_loading(capsys, monkeypatch):
    """`--sets code foo` is refused naming --sets before the target loads (it used to run the
    whole code set first)."""
    import dspine.target.adapter as adapter

    def no_load(*a, **k):
        raise AssertionError("the target was loaded before --sets was checked")

    monkeypatch.setattr(adapter, "load_target", no_load)
    code, out, err = cli(capsys, "acceptance", "--target", CLI_TARGET, "--drafter", "random", "--sets", "code", "foo")
    assert_error(code, err, "--sets 'foo'", "accepted: code, chat")


def test_engine_takes_one_stop_string_and_a_tensor_prompt(tiny256):
    """The Python API: ``stop="ab"`` is one stop string (not 'a' and 'b'), and a 1-D tensor
    prompt is its values (it used to fail on a tensor's truth value)."""
    import torch

    from dspine.config import SamplingConfig
    from dspine.core.engine import Engine, EngineError

    eng = Engine(tiny256, None, "ar")
    req = eng.start([5, 6, 7], SamplingConfig(), 4, stop="ab")
    assert req.stop == ["ab"]
    a = eng.generate(torch.tensor([5, 6, 7]), SamplingConfig(), 6).token_ids
    assert a == eng.generate([5, 6, 7], SamplingConfig(), 6).token_ids
    with pytest.raises(EngineError, match="1-D tensor"):
        eng.start(torch.tensor([[5, 6]]), SamplingConfig(), 4)


def test_generate_refuses_an_empty_or_undecodable_prompt_before_loading(capsys, monkeypatch):
    """An empty prompt (without --chat) and command-line bytes that are not UTF-8 are named
    before the target loads (they used to cost 10-20 s of loading first)."""
    import dspine.cli.main as climain

    def no_build(*a, **k):
        raise AssertionError("the engine was built before the prompt was checked")

    monkeypatch.setattr(climain, "build_engine", no_build)
    code, out, err = cli(capsys, "generate", "")
    assert_error(code, err, "the prompt is empty")
    code, out, err = cli(capsys, "generate", b"abc\xff".decode("utf-8", "surrogateescape"))
    assert_error(code, err, "not valid UTF-8")
