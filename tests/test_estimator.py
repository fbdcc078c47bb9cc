"""The estimator the controllers share (dspine.control.estimator)."""
from __future__ import annotations

import math

import pytest

from dspine.control.estimator import (AcceptanceStats, DecayedCells, DecisionLog, best_rate, decay_factor,
                                      expected_tokens, explore_length)


def test_decay_factor_halves_at_the_half_life():
    assert decay_factor(4.0) ** 4 == pytest.approx(0.5)
    assert decay_factor(None) == decay_factor(math.inf) == decay_factor(0) == 1.0
    for bad in (-1.0, math.nan, -math.inf):
        with pytest.raises(ValueError, match="half_life"):
            decay_factor(bad)


def test_decayed_cells_age_together():
    c = DecayedCells(1.0)  # every add halves what was there
    c.add("a", 4.0)
    c.add("b", 2.0)
    assert c.weight("a") == pytest.approx(0.5) and c.mean("a") == pytest.approx(4.0)
    assert c.total("b") == 2.0 and c.mean("missing", default=-1.0) == -1.0
    c.add("b", 2.0)
    assert c.observed() == ["b"]  # "a" fell below half an observation


def test_corrected_scales_the_prior_by_the_nearest_observed_ratio():
    c = DecayedCells(None)
    prior = {0: 1.0, 1: 2.0, 2: 3.0, 3: 4.0}.__getitem__
    dist = lambda k, m: (abs(k - m), k)  # noqa: E731
    assert c.corrected(2, prior, dist) == 3.0  # nothing observed: the prior
    c.add(1, 5.0)  # 2.5x the prior at 1
    c.add(3, 4.0)  # 1x at 3
    assert c.corrected(1, prior, dist) == 5.0
    assert c.corrected(2, prior, dist) == pytest.approx(3.0 * 2.5)  # tie: the lower key
    assert c.corrected(0, prior, dist) == pytest.approx(2.5)


def test_best_rate_takes_the_first_of_ties_and_a_free_option():
    assert best_rate(range(4), lambda n: n + 1.0, lambda n: n + 1.0) == 0  # all equal: the first
    assert best_rate(range(4), lambda n: [1, 3, 3.6, 3.7][n], lambda n: 1.0 + 0.2 * n) == 2
    assert best_rate(range(3), lambda n: 1.0, lambda n: 0.0 if n == 2 else 1.0) == 2
    assert best_rate([], lambda n: 1.0, lambda n: 1.0, default=7) == 7
    # an unknown (NaN) cost or value is never taken for a free or the best option
    assert best_rate(range(3), lambda n: 1.0, lambda n: math.nan if n == 1 else 1.0 + n) == 0
    assert best_rate(range(3), lambda n: math.nan if n == 0 else 1.0, lambda n: 1.0) == 1


def test_explore_length_stops_at_the_first_option_over_the_ratio():
    costs = [1.0, 1.5, 2.5, 1.8, 1.9]
    assert explore_length(0, 4, costs.__getitem__) == 1  # 2.5 > 2 x 1.0: stop there, not at 4
    assert explore_length(1, 4, costs.__getitem__) == 4
    assert explore_length(2, 2, costs.__getitem__) == 2


def test_expected_tokens_and_censored_acceptance():
    assert expected_tokens([]) == [1.0]
    assert expected_tokens([0.5, 0.5]) == [1.0, 1.5, 1.75]
    s = AcceptanceStats(None)
    s.update(3, 1)  # position 1 accepted, 2 rejected, 3 never at risk
    assert s.counts(0) == (1.0, 1.0) and s.counts(1) == (0.0, 1.0) and s.counts(2) == (0.0, 0.0)


def test_decision_log_stays_bounded():
    log = DecisionLog(8)
    for i in range(100):
        log.append(i)
    assert 4 <= len(log) <= 8 and log[-1] == 99


def test_acceptance_reports_conditional_rates_per_cycle():
    """`dspine acceptance`'s row_conditional: row k accepted among cycles that verified it with
    the rows before accepted. Here row 2 is verified by one cycle only (the others verified 1):
    the pooled-rate ratio would read (1/1) / (2/3) = 1.5, a probability above 1."""
    from dspine.train.acceptance import conditional_rates

    cycles = [(1, 1), (1, 0), (2, 2)]  # (verified, accepted)
    assert conditional_rates(cycles, 2) == [round(2 / 3, 4), 1.0]
    assert conditional_rates([(3, 0), (3, 1)], 3) == [0.5, 0.0, None]  # row 3: no cycle got there
    assert conditional_rates([], 1) == [None]
