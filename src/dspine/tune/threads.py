"""How many CPU threads to decode (or train, or generate data) with when the user chose none.

torch's default is a thread per core. When other processes keep some cores busy, a team
of that size waits at every parallel operation for the thread whose core is taken: on a
2-core Intel Xeon with AMX, with one core kept busy by another job, a plain step of the
default target took 189 ms on 2 threads and 21 ms on 1 (2026-12-06, ``DSPINE_TUNE=off``
``dspine generate``; the whole command 4:26 against 0:35). So where neither ``--threads``
nor ``OMP_NUM_THREADS`` says otherwise, :func:`choose_threads` samples the load for 0.3 s
(:func:`dspine.tune.conditions.others_now`) and leaves out the cores other processes keep
busy (at least one thread). A quiet machine keeps torch's default.
"""
from __future__ import annotations

import os
import sys

#: other processes must keep at least this many cores busy before threads are left out
BUSY_CORES = 0.5


def free_threads(threads: int, others: float | None) -> int:
    """Threads to use out of ``threads`` when other processes keep ``others`` cores busy
    (None: unknown): ``threads`` minus the busy cores, rounded, at least 1."""
    if others is None or others < BUSY_CORES:
        return threads
    return max(1, min(threads, int(threads - others + 0.5)))


def choose_threads(requested: int, progress: bool = True, option: str = "--threads") -> int:
    """Set torch's intra-op threads and return their number.

    ``requested`` > 0 is used as given. 0 (the default of the commands' ``--threads``)
    means: torch's default (a thread per core) unless other processes keep cores busy now
    (:func:`free_threads`), then say on stderr (``progress``) how many are used and how to
    choose. A valid ``OMP_NUM_THREADS`` in the environment counts as a choice (torch's
    thread count, warned about like ``--threads`` when above the free cores); an invalid one
    (not a positive integer, which torch ignores) is named on stderr and the free cores used.
    """
    import torch

    env = os.environ.get("OMP_NUM_THREADS")
    if requested <= 0 and env is not None:
        if env.strip().isdigit() and int(env) > 0:
            requested, option = torch.get_num_threads(), "OMP_NUM_THREADS="
        elif progress:
            print(f"dspine: note: OMP_NUM_THREADS={env!r} is not a positive number of threads (torch ignores "
                  f"it); choosing the threads as without it", file=sys.stderr, flush=True)
    if requested > 0:
        torch.set_num_threads(requested)
        if requested > 1 and progress:  # a choice is kept, but not silently when it will crawl
            from dspine.tune.conditions import others_now

            others = others_now()
            free = free_threads(min(requested, os.cpu_count() or requested), others)
            if free < requested:
                sep = "" if option.endswith("=") else " "
                print(f"dspine: warning: {option}{sep}{requested} while other processes keep ~{others:.1f} of "
                      f"{os.cpu_count()} cores busy: the thread team waits on the busy cores at every step "
                      f"(several times slower); {option}{sep}{free} or leaving it out runs on the free cores",
                      file=sys.stderr, flush=True)
        return requested
    n = torch.get_num_threads()
    if n <= 1:
        return n
    from dspine.tune.conditions import others_now

    others = others_now()
    use = free_threads(n, others)
    if use < n:
        torch.set_num_threads(use)
        if progress:
            print(f"dspine: other processes keep ~{others:.1f} of {n} cores busy: running on {use} thread"
                  f"{'s' if use > 1 else ''}{' (at least one)' if others >= n else ''} (a team of {n} would wait on the busy cores at every step, "
                  f"several times slower); {option} {n} uses every core anyway", file=sys.stderr, flush=True)
    return use
