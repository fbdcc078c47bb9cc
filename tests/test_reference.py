"""The reference loop (:mod:`dspine.core.reference`) and the engine agree: with the whole
block verified every cycle (no policy, no tree, no copies) the engine emits the reference's
tokens, greedy on the real target with the shipped DSpine drafter, and seeded samples
(the same random draws in the same order, so the same distribution) on a tiny target; a
negative control that verifies one proposal fewer per cycle draws differently."""
from __future__ import annotations

import pytest

from conftest import random_proposer
from dspine.build import default_drafter_path
from dspine.config import SamplingConfig
from dspine.core.reference import reference_generate
from dspine.drafter.checkpoint import load_drafter
from dspine.proposers.drafter import DrafterProposer
from dspine.control.base import Controller
from dspine.core.engine import Engine

pytestmark = pytest.mark.usefixtures("one_thread")


def engine_ids(target, proposer, prompt, sampling, n, policy=None):
    mode = "ar" if proposer is None else "dspine"
    return Engine(target, proposer, mode, verify_policy=policy).generate(prompt, sampling, n).token_ids


@pytest.mark.parametrize("chat", [pytest.param(True, marks=pytest.mark.slow), False])
def test_greedy_reference_equals_engine_and_ar_on_the_real_target(smol, chat):
    prompt = smol.encode_prompt("Write a Python function that reverses a string." if chat
                                else "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n", chat=chat)
    drafter = load_drafter(default_drafter_path("smollm2-135m", "dspine"), smol)
    ref = reference_generate(smol, DrafterProposer(drafter), prompt, SamplingConfig(), 48)
    assert ref == engine_ids(smol, DrafterProposer(drafter), prompt, SamplingConfig(), 48)
    assert ref == reference_generate(smol, None, prompt, SamplingConfig(), 48)  # lossless: ar's ids
    assert ref == engine_ids(smol, None, prompt, SamplingConfig(), 48)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("mode", ["dspine", "dflash"])
def test_seeded_reference_equals_engine(tiny, seed, mode):
    prompt = [1, 5, 2, 7, 3]
    s = SamplingConfig(temperature=0.9, top_p=0.95, seed=seed)
    ref = reference_generate(tiny, random_proposer(tiny, mode, 4), prompt, s, 24)
    assert len(ref) == 24
    assert ref == engine_ids(tiny, random_proposer(tiny, mode, 4), prompt, s, 24)


class _OneFewer(Controller):
    """Verify one proposal fewer than the block allows."""

    def __call__(self, req, n_max: int) -> int:
        return max(0, n_max - 1)


def test_negative_control_fewer_proposals_draw_differently(tiny):
    """Verifying one proposal fewer per cycle uses the draws differently: over a few seeds
    the outputs differ from the reference's (the comparison above can fail)."""
    prompt = [1, 5, 2, 7, 3]
    differ = 0
    for seed in range(4):
        s = SamplingConfig(temperature=0.9, top_p=0.95, seed=seed)
        ref = reference_generate(tiny, random_proposer(tiny, "dspine", 4), prompt, s, 24)
        short = engine_ids(tiny, random_proposer(tiny, "dspine", 4), prompt, s, 24, policy=_OneFewer())
        differ += ref != short
    assert differ >= 2
