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


def test_ngram_min_above_max_is_refused():
    with pytest.raises(ConfigError, match="ngram_min 3 must be <= ngram_max"):
        SpeculativeConfig(ngram_max=2, ngram_min=3)


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
