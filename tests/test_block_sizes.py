"""Every block size ``dspine train`` can produce (2..16; row 0 is the anchor, so a block of
1 would propose nothing and is refused by name) generates, serves and tunes on dense and
hybrid (Gated-DeltaNet) random targets, and greedy output equals ``--mode ar``.

A drafter of block 2 can draft one row: the tuner must time only row counts the drafter can
use (it once timed a 4-row pass and died: "rows must be in 1..2, got 4").
"""
from __future__ import annotations

import json

import pytest

from dspine.config import SpeculativeConfig
from dspine.core.batch import BatchEngine
from dspine.build import build_engine
from dspine.cli.main import main
from dspine.config import ConfigError, DSpineConfig

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPT = "def f(x):"
TARGETS = ["random:llama", "random:qwen3_5"]
BLOCKS = [2, 3, 4, 8, 16]
NEW = 12


def _gen(capsys, *args) -> dict:
    code = main(["generate", PROMPT, "--max-new-tokens", str(NEW), "--json", *args])
    out = capsys.readouterr()
    assert code == 0, out.err
    return json.loads(out.out)


@pytest.fixture(scope="module")
def ar_ids():
    """``ar``'s greedy ids per target (built once)."""
    out = {}
    for name in TARGETS:
        target, eng = build_engine(SpeculativeConfig(target=name, drafter=None, mode="ar",
                                                     verify_policy="fixed", proposer="drafter",
                                                     linear_backend="aten", tree_budget=0))
        out[name] = eng.generate(target.encode_prompt(PROMPT), max_new_tokens=NEW).token_ids
    return out


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("block", BLOCKS)
def test_generate_every_block_size_equals_ar(capsys, ar_ids, target, block):
    """The CLI's defaults (cost policy, copy-or-draft proposer, measured drafter linears and
    candidate-pass kernel) and the fixed policy (every row verified) both run and equal ar."""
    for policy in ("cost", "fixed"):
        got = _gen(capsys, "--target", target, "--drafter", "random", "--mode", "dspine",
                   "--block-size", str(block), "--verify-policy", policy)
        assert got["token_ids"] == ar_ids[target], (block, policy)
        if policy == "fixed":  # the whole block was verified: no verification past the block
            assert max(got["stats"]["verification_lengths"], default=0) <= block - 1


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("block", [2, 3])
def test_serve_small_blocks_equals_ar(ar_ids, target, block):
    """The batched engine (what ``dspine serve`` runs) with two requests at once."""
    t, eng = build_engine(SpeculativeConfig(target=target, drafter="random", mode="dspine", block_size=block,
                                            verify_policy="cost", proposer="hybrid", concurrency=2,
                                            linear_backend="aten", tree_budget=0))
    ids = t.encode_prompt(PROMPT)
    res = BatchEngine(eng, 2).generate_many([ids, ids], max_new_tokens=[NEW, NEW])
    assert [r.token_ids for r in res] == [ar_ids[target]] * 2


@pytest.mark.parametrize("block", [2, 3])
def test_tune_measures_only_rows_the_drafter_has(block):
    """The drafter-linears measurement of a small block runs, and its key names the rows."""
    from dspine.target.adapter import load_target
    from dspine.drafter.checkpoint import random_drafter
    from dspine.tune.drafter import plan_drafter_linears

    seen = []

    def timer(name, fn, repeats, cap_s):
        fn()  # runs the real forward: a row count above the block would raise here
        seen.append(name)
        return 0.001

    d = random_drafter(load_target("random:llama"), "dspine", block)
    _, choice = plan_drafter_linears(d, "auto", redo=True, timer=timer, progress=False)
    if choice is not None:  # None where the blockq kernels cannot be built
        assert not choice.errors, choice.errors
        assert f"rows={min(4, block)}" in choice.key
        assert set(seen) == {"float32", "q8"}


def test_block_size_one_is_refused_by_name():
    with pytest.raises(ConfigError, match=r"SpeculativeConfig\.block_size") as e:
        DSpineConfig(block_size=1)
    assert e.value.field == "block_size"
    from dspine.cli.main import flag_message
    assert "--block-size" in flag_message(e.value)


@pytest.mark.parametrize("target", TARGETS)
def test_dspine_tune_runs_for_a_block_2_drafter(capsys, tmp_path, target):
    """``dspine tune`` with a block-2 checkpoint on dense and hybrid targets (the hybrid's
    batched-decoding dtype measurement once died: its recurrent cache cannot crop)."""
    from dspine.drafter.checkpoint import random_drafter, save_drafter
    from dspine.target.adapter import load_target

    path = save_drafter(random_drafter(load_target(target), "dspine", 2), tmp_path / "d2")
    assert main(["tune", "--target", target, "--drafter", str(path), "--json", "--data-batch", "4"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert len(rep["cost_curve_ms"]["verify"]) == 2  # n = 0 and n = 1: all a block of 2 drafts
    assert set(rep["batched_dtype"]) == {"data build decode step", "feature extraction forward"}
