"""SpeculativeConfig: every engine setting and its default once; the CLI maps flags onto it."""
from __future__ import annotations

import argparse
from dataclasses import fields

import pytest

from dspine.cli.main import add_generate_parser, config_from_args, main
from dspine.config import ConfigError, SpeculativeConfig


def _generate_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_generate_parser(p.add_subparsers(dest="command"))
    return p.parse_args(["generate", "hello", *argv])


def test_generate_without_flags_is_the_config_defaults():
    """`dspine generate` with no flags builds exactly SpeculativeConfig() (persist aside):
    the CLI holds no default of its own."""
    assert config_from_args(_generate_args([])) == SpeculativeConfig()


def test_every_flag_lands_in_its_field():
    args = _generate_args(["--verify-policy", "fixed", "--proposer", "drafter", "--ngram-max", "6",
                           "--tree-budget", "0", "--linear-backend", "aten", "--mode", "dflash"])
    c = config_from_args(args, persist=True)
    assert (c.verify_policy, c.proposer, c.ngram_max, c.tree_budget, c.linear_backend, c.mode, c.persist) == \
        ("fixed", "drafter", 6, 0, "aten", "dflash", True)
    # every field a generate flag exists for is read from it (names match: --x-y -> x_y)
    dests = set(vars(_generate_args([])))
    # concurrency and the output cache are serve's (--max-running, --ngram-cache-tokens); persist is set by the command
    missing = {f.name for f in fields(SpeculativeConfig)} - dests - {"concurrency", "ngram_cache_tokens", "persist"}
    assert not missing, missing


@pytest.mark.parametrize("field,value,why", [
    ("mode", "turbo", "is unknown"), ("proposer", "suffix", "is unknown"), ("verify_policy", "fast", "is unknown"),
    ("ngram_max", 0, "integer >= 1"), ("block_size", 1, "2..64"), ("tree_budget", 10_000, "at most"),
    ("copy_bonus", float("nan"), "finite"), ("seed", True, "integer"), ("concurrency", 0, "integer >= 1"),
    ("drafter", "", "path"),
])
def test_bad_values_name_the_field_and_value(field, value, why):
    with pytest.raises(ConfigError, match=f"SpeculativeConfig.{field}") as e:
        SpeculativeConfig(**{field: value})
    assert e.value.field == field and why in str(e.value) and repr(value) in str(e.value)


def test_ngram_min_above_max_is_refused(capsys):
    with pytest.raises(ConfigError, match="ngram_min 3 must be <= SpeculativeConfig.ngram_max"):
        SpeculativeConfig(ngram_max=2, ngram_min=3)
    # the command line turns every field the message names into its flag
    assert main(["generate", "x", "--target", "random:llama", "--ngram-max", "2", "--ngram-min", "3"]) == 2
    err = capsys.readouterr().err
    assert "--ngram-min 3 must be <= --ngram-max (2)" in err and "SpeculativeConfig" not in err


def test_the_command_line_adds_the_flag(capsys):
    assert main(["generate", "x", "--target", "random:llama", "--mode", "ar", "--runtime", "fast"]) == 2
    err = capsys.readouterr().err
    assert "dspine: error: --runtime 'fast' is unknown" in err and "SpeculativeConfig" not in err


def test_installed_choices_are_checked_before_loading(monkeypatch):
    """A kernel or runtime name this installation lacks is refused before any target loads."""
    import dspine.target.adapter as adapter
    from dspine.build import build_engine

    monkeypatch.setattr(adapter, "load_target", lambda *a, **k: pytest.fail("loaded before the check"))
    for field, bad in (("head_kernel", "int4"), ("linear_backend", "cuda"), ("draft_vocab", "tiny")):
        with pytest.raises(ConfigError, match=f"SpeculativeConfig.{field} '{bad}' is unknown") as e:
            build_engine(SpeculativeConfig(target="random:llama", **{field: bad}))
        assert e.value.field == field


def test_drafter_and_copy_settings_are_checked_before_loading(monkeypatch, tmp_path):
    """A missing drafter checkpoint, a target without a shipped drafter and a copy setting
    that cannot work are refused before any target loads, each naming its field."""
    import dspine.target.adapter as adapter
    from dspine.build import build_engine

    monkeypatch.setattr(adapter, "load_target", lambda *a, **k: pytest.fail("loaded before the check"))
    cases = [(dict(drafter=str(tmp_path / "nowhere")), "drafter", "no such checkpoint"),
             (dict(drafter=None), "drafter", "no shipped dspine drafter"),
             (dict(proposer="drafter", ngram_cache_tokens=4096), "ngram_cache_tokens", "needs SpeculativeConfig.proposer hybrid"),
             (dict(proposer="drafter", copy_bonus=1.0), "copy_bonus", "needs SpeculativeConfig.proposer hybrid")]
    for kw, field, why in cases:
        with pytest.raises(ConfigError, match=why) as e:
            build_engine(SpeculativeConfig(target="random:llama", **kw))
        assert e.value.field == field


def test_tune_refuses_an_unknown_device_and_keeps_the_cache_on_bad_settings(tmp_path, monkeypatch, capsys):
    """`dspine tune --device tpu` is an error message, not a traceback; `--redo` with a
    setting that cannot work forgets nothing."""
    from dspine.tune import store

    monkeypatch.setenv("DSPINE_HOME", str(tmp_path))
    monkeypatch.setenv("DSPINE_TUNE", "on")
    store.put("head:keep-me", {"chosen": "exact"})
    assert main(["tune", "--device", "tpu"]) == 2
    assert "dspine: error: --device 'tpu'" in capsys.readouterr().err
    assert main(["tune", "--redo", "--target", "random:llama", "--drafter", str(tmp_path / "nowhere")]) == 2
    assert "--drafter" in capsys.readouterr().err
    assert store.get("head:keep-me") is not None  # --redo refused before clearing
    # refused only while loading (a dtype the runtime has not validated): put back
    assert main(["tune", "--redo", "--target", "random:llama", "--drafter", "random", "--dtype", "float16"]) == 2
    assert "float16" in capsys.readouterr().err
    assert store.get("head:keep-me") is not None
    # a damaged entry is listed as unreadable, not a traceback
    store.put("cost:damaged", {"curve": {"verify_s": "abc"}})
    assert main(["tune", "--show"]) == 0
    assert "unreadable" in capsys.readouterr().out


def test_serve_refuses_an_empty_verify_policy(capsys):
    assert main(["serve", "--verify-policy", ""]) == 2  # it meant `cost` silently before
    assert "--verify-policy: invalid choice: ''" in capsys.readouterr().err



def test_library_errors_name_the_field_and_the_command_line_its_flag(tiny256, capsys):
    """Engine modules name SpeculativeConfig fields (never a flag); every command's error
    path turns them into flags with one helper (dspine.cli.main.flag_message)."""
    from dspine.cli.main import flag_message
    from dspine.proposers import NgramIndex, NgramProposer, OutputCache
    from dspine.runtime.packed import apply_linear_backend
    from dspine.trees.tree import TreeSpec, parse_tree_shape

    cases = [(lambda: TreeSpec(-1), "tree_budget", "--tree-budget"),
             (lambda: parse_tree_shape("4,0"), "tree_shape", "--tree-shape '4,0'"),
             (lambda: NgramIndex(40), "ngram_max", "--ngram-max 40 must be in 1..16"),
             (lambda: NgramProposer(16, max_ngram=2, min_match=3), "ngram_min",
              "--ngram-min 3 must be in 1..--ngram-max (2)"),
             (lambda: OutputCache(100, max_ngram=1), "ngram_cache_tokens", "needs --ngram-max in 2..16"),
             (lambda: apply_linear_backend(tiny256, "mkl"), "linear_backend", "--linear-backend 'mkl' is unknown"),
             (lambda: apply_linear_backend(tiny256, "blockq", progress=False), "linear_backend",
              "--linear-backend blockq: not available")]
    for call, field, flag in cases:
        with pytest.raises(ConfigError) as e:
            call()
        msg = str(e.value)
        assert e.value.field == field and f"SpeculativeConfig.{field}" in msg and "--" not in msg, msg
        assert flag in flag_message(e.value) and "SpeculativeConfig" not in flag_message(e.value)
    # a suggested value becomes the flag and its value; a flag spelled otherwise is mapped
    assert flag_message("x; use SpeculativeConfig.runtime='hf'") == "x; use --runtime hf"
    assert flag_message("SpeculativeConfig.concurrency 9", "serve") == "--max-running 9"
    assert flag_message("SpeculativeConfig.concurrency 9", "bench") == "--concurrency 9"
    # through the command line, a library error (wrapped on its way) still names the flag
    assert main(["generate", "x", "--target", "random:qwen3_5", "--mode", "ar", "--runtime", "dense",
                 "--max-new-tokens", "1", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "dspine: error: --runtime dense cannot run this target" in err and "use --runtime hf" in err
    assert "SpeculativeConfig" not in err
    assert main(["generate", "x", "--target", "random:llama", "--mode", "ar", "--linear-backend", "blockq",
                 "--max-new-tokens", "1", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "dspine: error: --linear-backend blockq: not available" in err and "SpeculativeConfig" not in err


@pytest.mark.parametrize("kw,field", [({"temperature": "0.7"}, "temperature"), ({"temperature": None}, "temperature"),
                                      ({"temperature": True}, "temperature"), ({"top_p": "0.9"}, "top_p"),
                                      ({"min_p": None}, "min_p"), ({"top_k": True}, "top_k"),
                                      ({"top_k": 2.0}, "top_k"), ({"seed": -1}, "seed")])
def test_sampling_settings_of_the_wrong_type_name_the_field(kw, field):
    """The Python API's SamplingConfig refuses a str, None or bool where a number goes with a
    ConfigError naming the field (not a TypeError from a comparison, nor True read as 1)."""
    from dspine.config import SamplingConfig

    with pytest.raises(ConfigError) as e:
        SamplingConfig(**kw)
    assert e.value.field == field and field in str(e.value)


def test_a_prompt_that_is_not_utf8_is_refused_by_name():
    """Command-line bytes that are not UTF-8 reach Python as lone surrogates; the tokenizer
    would raise a TypeError deep inside: refused with a ValueError that says what to do."""
    from dspine.target.adapter import load_target

    target = load_target("random:llama")
    bad = b"abc\xff\xfe".decode("utf-8", "surrogateescape")
    for chat in (False, True):
        if chat and getattr(target.tokenizer, "chat_template", None) is None:
            continue
        with pytest.raises(ValueError, match="not valid UTF-8"):
            target.encode_prompt(bad, chat=chat)
    assert target.encode_prompt("abc") == target.encode_prompt("abc")  # text still encodes
