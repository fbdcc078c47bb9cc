"""A training state small enough to commit: ``trainer.json`` beside a drafter checkpoint.

``out/ckpt/`` holds what ``--resume`` needs to continue a run bit for bit (float32 weights
and AdamW's two moments: ~260 MB for the shipped DSpine drafter), which stays on the
machine that wrote it. A run's exported drafter (``out/final/``: bfloat16 weights, < 60 MB)
plus :data:`STATE_FILE` (step, wall time, training settings, data fingerprint and history,
warm-start source; a few kB) is what can travel in the repository, and
``dspine train --continue-from DIR`` continues that run on another machine: the same step
count, learning-rate schedule, batch order and vocabulary subset, from the bfloat16 weights,
with AdamW's moments rebuilt by :func:`rebuild_moments` instead of carried.

Rebuilding: AdamW's moments are exponential averages of the clipped gradients of recent
steps (betas 0.9 / 0.95: half-lives of ~7 and ~14 steps). Replaying the gradients of the
``k`` steps before the saved one (their own batches, deterministic in seed and step), taken
at the saved weights, through the same update rules gives moments whose weight on steps
older than ``k`` is ``beta2 ** k`` (0.04 at the default k = 64); the replayed gradients
differ from the original ones only by where they are taken (the saved weights rather than
the weights at each of those steps). It is an approximation, measured in
``tests/test_train.py``; resuming from ``ckpt/`` stays exact.
"""
from __future__ import annotations

import json
import sys
import time
from dataclasses import asdict
from pathlib import Path

import torch

FORMAT = "dspine-trainer-state/1"
STATE_FILE = "trainer.json"
DEFAULT_REBUILD_STEPS = 64


def write_state(trainer, out_dir: str | Path) -> Path:
    """Write ``out_dir/trainer.json`` for ``trainer`` (a :class:`dspine.train.loop.Trainer`)
    next to its exported weights. Returns the file's path."""
    st = {"format": FORMAT, "step": trainer.step, "wall": round(trainer.wall, 3),
          "train_config": asdict(trainer.tc), "data_fingerprint": trainer.data_fingerprint(),
          "data_sequences": len(trainer.seqs), "data_history": trainer.data_history,
          "init_source": trainer.init_source, "continued_from": trainer.continued_from,
          "saved": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    f = Path(out_dir) / STATE_FILE
    f.write_text(json.dumps(st, indent=1))
    return f


def read_state(path: str | Path) -> dict:
    """The trainer state of a drafter checkpoint directory.

    Raises:
        ValueError: no ``trainer.json`` (names ``--continue-from`` and what to use instead),
            not JSON, another format, lacking step / settings / data fingerprint, or a step
            beyond the run's own ``steps`` or before its recorded data growth.
    """
    f = Path(path) / STATE_FILE
    if not f.is_file():
        raise ValueError(f"--continue-from {path}: no {STATE_FILE} there (a drafter exported by "
                         f"`dspine train` since 2026-12-06 has one); --init-from {path} warm-starts its weights "
                         f"with a new schedule instead")
    try:
        st = json.loads(f.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"--continue-from {path}: {STATE_FILE} is unreadable ({e})") from None
    if not isinstance(st, dict) or st.get("format") != FORMAT:
        raise ValueError(f"--continue-from {path}: {STATE_FILE} is not a {FORMAT} state")
    bad = [k for k, t in (("step", int), ("train_config", dict), ("data_fingerprint", str))
           if not isinstance(st.get(k), t) or isinstance(st.get(k), bool)]
    if bad or st["step"] < 0:
        raise ValueError(f"--continue-from {path}: {STATE_FILE} lacks a valid {', '.join(bad) or 'step'}")
    planned = st["train_config"].get("steps")
    if isinstance(planned, int) and not isinstance(planned, bool) and st["step"] > planned:
        raise ValueError(f"--continue-from {path}: {STATE_FILE} says step {st['step']}, beyond that run's own "
                         f"--steps {planned}; the state is damaged")
    hist = st.get("data_history")
    if hist is not None and not (isinstance(hist, list) and hist and all(
            isinstance(h, dict) and all(isinstance(h.get(k), int) and not isinstance(h.get(k), bool) and h[k] >= 0
                                        for k in ("step", "sequences")) for h in hist)):
        raise ValueError(f"--continue-from {path}: {STATE_FILE} holds a damaged data_history (a list of "
                         f"{{step, sequences}} integers expected)")
    if hist and max(h["step"] for h in hist) > st["step"]:
        raise ValueError(f"--continue-from {path}: {STATE_FILE} records data added after its own step "
                         f"{st['step']}; the state is damaged")
    return st


def continue_from(trainer, path: str | Path, rebuild_steps: int = DEFAULT_REBUILD_STEPS) -> None:
    """Make ``trainer`` continue the run exported in ``path`` (weights + trainer.json).

    Loads the weights (upcast to float32), checks settings and data as ``--resume`` does
    (:meth:`dspine.train.checkpoints.TrainerCheckpoints.adopt_run`; data that grew by
    appended rows is accepted), takes the step count, wall time, vocabulary subset
    (``draft_vocab.json``) and warm-start source, then rebuilds AdamW's moments.

    Raises:
        ValueError: a missing or damaged state, another drafter config, other settings or
            data (each named), or ``rebuild_steps`` < 0.
        DrafterError: unreadable weights.
    """
    from dspine.config import DSpineConfig
    from dspine.drafter.checkpoint import DrafterError, load_drafter
    from dspine.drafter.vocab import load_draft_vocab

    if rebuild_steps < 0:
        raise ValueError(f"--rebuild-moments must be >= 0, got {rebuild_steps}")
    st = read_state(path)
    if st["step"] >= trainer.tc.steps:
        raise ValueError(f"--continue-from {path}: that run is at step {st['step']}; --steps {trainer.tc.steps} "
                         f"adds nothing (give --steps above {st['step']})")
    saved = DSpineConfig.load(path)
    if saved != trainer.cfg:
        diff = {k: (v, getattr(trainer.cfg, k)) for k, v in asdict(saved).items() if getattr(trainer.cfg, k) != v}
        raise ValueError(f"--continue-from {path} was trained with another drafter config (it vs this run: "
                         f"{diff}); use the same --config/--mode/--block-size")
    trainer.adopt_run(st, where=str(path), option="--continue-from")
    src = load_drafter(path, trainer.target, dtype=torch.float32, option="--continue-from")
    own = trainer.model.state_dict()
    theirs = {k: v for k, v in src.state_dict().items() if k in own}
    if set(theirs) != set(own):
        raise DrafterError(f"--continue-from {path}: its weights lack {sorted(set(own) - set(theirs))[:4]}")
    trainer.model.load_state_dict(theirs)
    tc = trainer.tc
    if 0 < tc.vocab_subset < trainer.cfg.vocab_size:
        sub = load_draft_vocab(path, trainer.cfg.vocab_size, 1)
        if sub is None or sub.numel() != min(tc.vocab_subset, trainer.cfg.vocab_size):
            raise ValueError(f"--continue-from {path}: --vocab-subset {tc.vocab_subset} needs the run's "
                             f"draft_vocab.json of {tc.vocab_subset} ids beside its weights")
        trainer.subset = sub.to(trainer.device)
    else:
        trainer.subset = None
    trainer.step, trainer.wall = st["step"], float(st.get("wall") or 0.0)
    trainer.init_source = st.get("init_source")
    replayed = rebuild_moments(trainer, rebuild_steps)
    # lineage: where this run was continued from (and what that one was continued from)
    trainer.continued_from = {"path": str(path), "step": st["step"], "moments_rebuilt_from_steps": replayed,
                              **({"earlier": st["continued_from"]} if st.get("continued_from") else {})}


def rebuild_moments(trainer, k: int) -> int:
    """Fill AdamW's state of ``trainer`` from the gradients of the ``k`` steps before
    ``trainer.step`` (each on its own batch, at the current weights, clipped as in
    training), through AdamW's update rules; the optimizer's step count is set to
    ``trainer.step`` so that its bias correction is that of the continued run. The weights
    do not change. Returns the number of steps replayed (``min(k, trainer.step)``).
    """
    opt = trainer.opt
    first = max(0, trainer.step - k)
    params = [p for g in opt.param_groups for p in g["params"]]
    b1, b2 = opt.param_groups[0]["betas"]
    m = {p: torch.zeros_like(p) for p in params}
    v = {p: torch.zeros_like(p) for p in params}
    seen: set = set()
    from tqdm.auto import tqdm

    for s in tqdm(range(first, trainer.step), desc="rebuild optimizer moments", disable=trainer.rank != 0,
                  file=sys.stderr):
        trainer.gradients(s)
        for p in params:
            if p.grad is not None:
                seen.add(p)
                m[p].mul_(b1).add_(p.grad, alpha=1 - b1)
                v[p].mul_(b2).addcmul_(p.grad, p.grad, value=1 - b2)
    opt.zero_grad(set_to_none=True)
    replayed = trainer.step - first
    if replayed == 0:
        return 0  # nothing to rebuild from: AdamW starts its state at the first step, as in a new run
    # AdamW divides by (1 - beta ** step) at the run's step count; averages over `replayed`
    # steps need (1 - beta ** replayed): rescale so that the two agree (equal when the run
    # is replayed from step 0)
    t = trainer.step
    c1, c2 = (1 - b1 ** t) / (1 - b1 ** replayed), (1 - b2 ** t) / (1 - b2 ** replayed)
    for p in params:
        if p in seen:
            opt.state[p] = {"step": torch.tensor(float(t)), "exp_avg": m[p].mul_(c1), "exp_avg_sq": v[p].mul_(c2)}
    return replayed
