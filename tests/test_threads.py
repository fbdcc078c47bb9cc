"""Default thread count: every core on a quiet machine, the free cores on a busy one."""
from __future__ import annotations

import pytest
import torch

from dspine.tune import conditions
from dspine.tune.threads import choose_threads, free_threads


def test_free_threads_leaves_out_the_busy_cores():
    assert free_threads(2, None) == 2 and free_threads(2, 0.3) == 2  # quiet or unknown: every core
    assert free_threads(2, 1.0) == 1 and free_threads(2, 0.6) == 1 and free_threads(2, 2.0) == 1
    assert free_threads(8, 2.2) == 6 and free_threads(8, 30.0) == 1


@pytest.fixture
def threads_back():
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


@pytest.mark.parametrize("busy,want", [(0.0, 2), (1.0, 1)])
def test_choose_threads_by_load(monkeypatch, capsys, threads_back, busy, want):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(conditions, "others_now", lambda interval_s=0.3: busy)
    torch.set_num_threads(2)
    assert choose_threads(0) == want == torch.get_num_threads()
    err = capsys.readouterr().err
    assert ("running on 1 thread" in err and "--threads 2" in err) == (want == 1)


def test_a_choice_is_kept(monkeypatch, capsys, threads_back):
    monkeypatch.setattr(conditions, "others_now", lambda interval_s=0.3: 1.0)
    monkeypatch.setattr("os.cpu_count", lambda: 2)
    torch.set_num_threads(2)
    assert choose_threads(2) == 2 == torch.get_num_threads()  # --threads 2: as given, busy or not
    assert "warning: --threads 2 while other processes keep ~1.0 of 2 cores busy" in capsys.readouterr().err
    monkeypatch.setattr(conditions, "others_now", lambda interval_s=0.3: 0.1)
    assert choose_threads(2) == 2 and "warning" not in capsys.readouterr().err  # quiet: nothing to say
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    monkeypatch.setattr(conditions, "others_now", lambda interval_s=0.3: 1.0)
    assert choose_threads(0) == 2 == torch.get_num_threads()  # the environment chose, warned about
    assert "warning: OMP_NUM_THREADS=2 while other processes keep ~1.0" in capsys.readouterr().err
    for bad in ("abc", "0", "-2", "2,1"):  # torch ignores these: dspine says so and chooses by load
        monkeypatch.setenv("OMP_NUM_THREADS", bad)
        torch.set_num_threads(2)
        assert choose_threads(0) == 1 == torch.get_num_threads()
        assert f"OMP_NUM_THREADS={bad!r} is not a positive number" in capsys.readouterr().err
