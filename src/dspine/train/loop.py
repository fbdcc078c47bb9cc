"""Drafter training loop: online target features, AdamW + warmup/cosine, checkpoints,
``--resume`` (those two in :mod:`dspine.train.checkpoints`), JSONL metrics, held-out
acceptance by the real engine loop, DDP.

Device: ``TrainConfig.device`` (``--device auto|cpu|cuda|cuda:N``); target, drafter,
batches and the loss run there, features cached in RAM stay on the CPU.

Multi-process: launch with ``torchrun --nproc-per-node N -m dspine.cli train ...``;
each rank takes a disjoint slice of every global batch (gloo on CPU, nccl on CUDA
with one GPU per rank, ``cuda:LOCAL_RANK``)
and gradients are averaged with one flat all-reduce per step (data parallel, as
DDP does), so N processes with per-rank batch b/N follow the same
trajectory as one process with batch b (tested).
"""
from __future__ import annotations

import json
import math
import os
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
from tqdm.auto import tqdm

from dspine.config import DSpineConfig
from dspine.drafter.checkpoint import check_fits_target
from dspine.drafter.vocab import frequent_tokens  # noqa: F401 (re-exported for existing imports)
from dspine.guards import resolve_device
from dspine.drafter.model import DSpineDrafter
from dspine.train.checkpoints import TrainerCheckpoints
from dspine.train.losses import (LR_SCHEDULES, collate, cosine_lr, drafter_losses, sample_anchors, target_topk,
                                 weight_sum)


class TrainingDiverged(ValueError):
    """The loss or its gradients became NaN/inf (the message names --lr)."""


@dataclass
class TrainConfig:
    """Training settings. ``batch_size`` is the global number of sequences per step."""

    steps: int = 1000
    batch_size: int = 8
    anchors_per_seq: int = 32
    max_len: int = 384
    lr: float = 1e-3
    min_lr_ratio: float = 0.1  # cosine decays to min_lr_ratio * lr (0 = to zero)
    lr_schedule: str = "cosine"  # or "constant" after warmup: open-ended runs extended by --resume --steps
    weight_decay: float = 0.01
    warmup: int = 50
    grad_clip: float = 1.0
    gamma: float = 7.0
    fs_weight: float = 1.0
    vocab_subset: int = 8192  # 0 = full vocabulary in the CE
    seed: int = 0
    save_every: int = 100
    eval_every: int = 0  # 0 = only at the end
    eval_prompts: int = 4
    eval_max_new_tokens: int = 48  # periodic evaluation; the final held-out measurement uses 64
    feature_dtype: str = "bfloat16"
    autocast_bf16: bool = False
    memo_features: bool = True  # keep each sequence's target features in RAM once computed
    device: str = "cpu"  # resolved device name (see resolve_device)
    soft_topk: int = 0  # > 0: soft labels from the target's top-k (losses.py), 0 = hard labels only
    soft_weight: float = 0.5  # share of the soft-label CE in each row's CE when soft_topk > 0
    time_limit: float = 0.0  # seconds of this process's training after which it saves and stops (0 = none)
    row1_anchors: int = 0  # > 0: this many more anchors per sequence trained on row 1 only (losses.row1_loss)
    row1_weight: float = 1.0  # weight of that dense row-1 term

    def __post_init__(self) -> None:
        for f in ("steps", "batch_size", "anchors_per_seq", "max_len", "save_every"):
            if getattr(self, f) <= 0:
                raise ValueError(f"TrainConfig.{f} must be positive, got {getattr(self, f)}")
        if not (self.lr >= 0 and math.isfinite(self.lr)):  # 0 is allowed here (frozen-weights checks)
            raise ValueError(f"TrainConfig.lr (--lr) must be a finite number >= 0, got {self.lr}")
        if self.lr_schedule not in LR_SCHEDULES:
            raise ValueError(f"TrainConfig.lr_schedule (--lr-schedule) must be one of {', '.join(LR_SCHEDULES)}, "
                             f"got {self.lr_schedule!r}")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ValueError(f"TrainConfig.min_lr_ratio (--min-lr-ratio) must be in [0, 1], got {self.min_lr_ratio}")
        if not self.soft_topk:  # unused without soft labels: one value, so resuming never trips on it
            self.soft_weight = 0.5
        if not self.row1_anchors:  # likewise without the dense row-1 term
            self.row1_weight = 1.0
        if not (self.row1_weight >= 0 and math.isfinite(self.row1_weight)):
            raise ValueError(f"TrainConfig.row1_weight (--row1-weight) must be a finite number >= 0, got {self.row1_weight}")
        if not (self.time_limit >= 0 and math.isfinite(self.time_limit)):
            raise ValueError(f"TrainConfig.time_limit (--time-limit) must be a finite number >= 0, got {self.time_limit}")
        if not 0.0 <= self.soft_weight <= 1.0:
            raise ValueError(f"TrainConfig.soft_weight (--soft-weight) must be in [0, 1], got {self.soft_weight}")
        for f in ("warmup", "vocab_subset", "eval_every", "eval_prompts", "soft_topk", "row1_anchors"):
            if getattr(self, f) < 0:
                raise ValueError(f"TrainConfig.{f} must be >= 0, got {getattr(self, f)}")
        if self.max_len < 4:
            raise ValueError("TrainConfig.max_len must be >= 4")
        self.device = str(resolve_device(self.device))


def _dist_info() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def init_distributed(device: str | torch.device = "cpu") -> tuple[int, int]:
    """Initialise torch.distributed from torchrun's env: nccl when training on CUDA
    (after selecting this rank's GPU), gloo on CPU. Returns (rank, world size)."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ and not dist.is_initialized():
        dev = torch.device(device)
        if dev.type == "cuda":
            torch.cuda.set_device(dev)
        dist.init_process_group("nccl" if dev.type == "cuda" else "gloo")
    return _dist_info()


class Trainer(TrainerCheckpoints):
    """Trains one drafter for one target.

    Args:
        target: loaded :class:`dspine.target.adapter.Target` (features are computed online).
        drafter_cfg: the drafter's :class:`DSpineConfig` (must fit the target).
        seqs: list of (token ids, response start) training sequences.
        out_dir: checkpoints (``ckpt/``), ``metrics.jsonl`` and the final export.
        eval_fn: optional ``(drafter) -> dict`` of held-out acceptance metrics.
        feature_store: optional :class:`dspine.train.feature_store.FeatureStore` with
            precomputed features of ``seqs`` (read instead of running the target).

    Checkpoints, ``--resume`` and ``--init-from``: :class:`dspine.train.checkpoints.TrainerCheckpoints`.
    """

    def __init__(self, target, drafter_cfg: DSpineConfig, seqs, out_dir: str | Path, tc: TrainConfig,
                 eval_fn=None, data_meta: dict | None = None, feature_store=None):
        check_fits_target(drafter_cfg, target, where="train")
        if not seqs:
            raise ValueError("training data holds no sequences")
        if drafter_cfg.block_size >= tc.max_len:
            raise ValueError(f"--block-size {drafter_cfg.block_size} must be smaller than --max-len {tc.max_len}")
        self.target, self.cfg, self.tc, self.eval_fn = target, drafter_cfg, tc, eval_fn
        self.seqs = seqs
        self.out = Path(out_dir)
        self.rank, self.world = _dist_info()
        if tc.batch_size % self.world:
            raise ValueError(f"--batch-size {tc.batch_size} must be divisible by the world size {self.world}")
        self.device = torch.device(tc.device)
        tdev = torch.device(getattr(target, "device", "cpu"))
        if tdev.type != self.device.type or (tdev.index or 0) != (self.device.index or 0):
            raise ValueError(f"--device {tc.device}: the target is loaded on {tdev}; load it on the training device")
        torch.manual_seed(tc.seed)
        self.model = DSpineDrafter(drafter_cfg).to(self.device)  # init on CPU (same weights on any device)
        self.model.bind_target(target.input_embeddings(), target.output_head())
        if self.world > 1:  # identical start on every rank
            for p in self.model.parameters():
                dist.broadcast(p.data, 0)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=tc.lr, weight_decay=tc.weight_decay,
                                     betas=(0.9, 0.95))
        self.step = 0
        self.subset = (frequent_tokens(seqs, tc.vocab_subset, drafter_cfg.vocab_size).to(self.device)
                       if 0 < tc.vocab_subset < drafter_cfg.vocab_size else None)
        self.data_meta = data_meta or {}
        self.memo: dict[int, torch.Tensor] = {}
        self.soft_memo: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # target top-k per sequence
        if tc.soft_topk and feature_store is not None:
            raise ValueError("--soft-labels needs the target's logits, which a --feature-store does not hold; "
                             "train without --feature-store or without --soft-labels")
        if drafter_cfg.final_stage and 0 < tc.vocab_subset < min(drafter_cfg.head_topk, drafter_cfg.vocab_size):
            raise ValueError(f"--vocab-subset {tc.vocab_subset} is smaller than the final stage's "
                             f"{drafter_cfg.head_topk} candidates per row; use at least {drafter_cfg.head_topk} "
                             f"or 0 (the whole vocabulary)")
        if tc.row1_anchors and not drafter_cfg.block_causal:
            raise ValueError("--row1-anchors trains two-row blocks, which a bidirectional (DFlash-style) drafter "
                             "cannot run: use it with --mode dspine or leave it out")
        if tc.soft_topk > drafter_cfg.vocab_size:
            raise ValueError(f"--soft-labels {tc.soft_topk} exceeds the vocabulary ({drafter_cfg.vocab_size})")
        self.feature_store = feature_store  # optional FeatureStore (precomputed features)
        self.init_source: str | None = None  # checkpoint the weights were warm-started from
        self.init_adapted: dict | None = None  # what an architecture-adapting warm start changed
        self.wall = 0.0
        # the data size from each step on: [{"step": 0, "sequences": n}, ...]; --resume appends
        # an entry when the data grew (rows appended after the old ones)
        self.data_history: list[dict] = [{"step": 0, "sequences": len(seqs)}]
        # set by --continue-from (dspine.train.portable): the exported run this one continues
        self.continued_from: dict | None = None

    def log(self, rec: dict) -> None:
        if self.rank == 0:
            self.out.mkdir(parents=True, exist_ok=True)
            with open(self.out / "metrics.jsonl", "a") as f:
                f.write(json.dumps(rec) + "\n")
            try:
                if not hasattr(self, "_tb"):
                    from torch.utils.tensorboard import SummaryWriter  # optional
                    self._tb = SummaryWriter(str(self.out / "tb"))
                for k, v in rec.items():
                    if isinstance(v, (int, float)) and k != "step":
                        self._tb.add_scalar(k, v, rec.get("step", 0))
            except Exception:  # tensorboard not installed: JSONL only
                self._tb = None

    # -- training ---------------------------------------------------------------------
    def batch_for_step(self, step: int) -> list[tuple[list[int], int]]:
        """This rank's slice of the global batch of ``step`` (deterministic in seed/step)."""
        rng = random.Random(self.tc.seed * 1_000_003 + step)
        idx = [rng.randrange(len(self.seqs)) for _ in range(self.tc.batch_size)]
        per = self.tc.batch_size // self.world
        mine = idx[self.rank * per:(self.rank + 1) * per]
        return [self.seqs[i] for i in mine], mine

    @torch.no_grad()
    def features(self, batch, idx: list[int]) -> torch.Tensor:
        """Target features [b, T, F*d] float32 for a collated batch (teacher forcing).

        Computed online by a target forward; with ``memo_features`` each sequence's
        features are kept in RAM (feature dtype) after the first time it is drawn. With
        ``soft_topk`` the same forward's top-k next-token distribution per position is kept
        too (:attr:`last_soft`, ids [b, T, k] int32 and probs float16, on the device).
        """
        from dspine.data.generate import cpu_speed_patches

        tc = self.tc
        fdt = getattr(torch, tc.feature_dtype)
        if self.target.dtype != fdt:
            self.target.model.to(fdt)
            self.target.dtype = fdt
        T = batch.ids.shape[1]
        store = self.feature_store
        K = tc.soft_topk
        todo = [j for j, i in enumerate(idx)
                if not ((tc.memo_features and i in self.memo and (not K or i in self.soft_memo))
                        or (store is not None and i in store))]
        fresh, fresh_soft = {}, {}
        if todo:
            dev = self.target.device
            ids, valid = batch.ids[todo].to(dev), batch.valid[todo].to(dev)
            with cpu_speed_patches(self.target.model):
                out = self.target.model(input_ids=ids, attention_mask=valid.long(),
                                        output_hidden_states=True, logits_to_keep=0 if K else 1)
            f = torch.cat([out.hidden_states[l + 1] for l in self.cfg.feature_layers], -1)  # [n, T, F*d]
            for k, j in enumerate(todo):
                fresh[j] = f[k]
                if K:  # one row at a time: the float32 softmax of [T, V] stays small
                    fresh_soft[j] = target_topk(out.logits[k], K)
                if tc.memo_features:
                    n_valid = int(valid[k].sum())
                    self.memo[idx[j]] = f[k][:n_valid].to("cpu", copy=True)  # RAM, not GPU
                    if K:
                        self.soft_memo[idx[j]] = tuple(t[:n_valid].to("cpu", copy=True) for t in fresh_soft[j])
            del out
        rows, s_ids, s_p = [], [], []

        def fit(x: torch.Tensor) -> torch.Tensor:  # [n, ...] -> [T, ...] on the training device
            x = x.to(self.device)
            pad = T - x.shape[0]
            return torch.nn.functional.pad(x, (0, 0, 0, pad)) if pad > 0 else x[:T]

        for j, i in enumerate(idx):
            rows.append(fit(fresh[j] if j in fresh else (self.memo[i] if i in self.memo else store.get(i))))
            if K:
                si, sp = fresh_soft[j] if j in fresh_soft else self.soft_memo[i]
                s_ids.append(fit(si))
                s_p.append(fit(sp))
        self.last_soft = (torch.stack(s_ids), torch.stack(s_p)) if K else None
        return torch.stack(rows).float()

    def train_step(self) -> dict:
        """One optimizer step on the batch of ``self.step`` (then ``self.step`` += 1).

        Raises:
            TrainingDiverged: the loss or gradients are not finite (nothing applied).
        """
        tc = self.tc
        lr = cosine_lr(self.step, tc.steps, tc.warmup, tc.lr, floor=tc.min_lr_ratio, schedule=tc.lr_schedule)
        for g in self.opt.param_groups:
            g["lr"] = lr
        losses, gn = self.gradients(self.step)
        self.opt.step()
        self.step += 1
        return {"step": self.step, "lr": lr, "loss": float(losses["loss"].detach()), "ce": float(losses["ce"]),
                "fs": float(losses["fs"]), "acc1": float(losses["acc1"]), "grad_norm": float(gn),
                **({"r1": float(losses["r1"])} if self.tc.row1_anchors else {})}

    def gradients(self, step: int) -> tuple[dict, torch.Tensor]:
        """Clipped gradients (in ``p.grad``, averaged over ranks) of the loss on the batch of
        ``step``, as the optimizer step of ``step`` sees them; returns (losses, grad norm
        before clipping). Deterministic in (seed, step, number of sequences).

        Raises:
            TrainingDiverged: the loss or gradients are not finite.
        """
        tc = self.tc
        seqs, idx = self.batch_for_step(step)
        batch = collate(seqs, tc.max_len)
        gen = torch.Generator().manual_seed(tc.seed * 7919 + step * 31)
        u = torch.rand(tc.batch_size, tc.anchors_per_seq, generator=gen, dtype=torch.float64)
        per = tc.batch_size // self.world
        anchors = sample_anchors(batch, tc.anchors_per_seq, None, u[self.rank * per:(self.rank + 1) * per])
        row1 = None
        if tc.row1_anchors:  # drawn from their own stream: the block anchors are those of a run without them
            g1 = torch.Generator().manual_seed(tc.seed * 7919 + step * 31 + 1)
            u1 = torch.rand(tc.batch_size, tc.row1_anchors, generator=g1, dtype=torch.float64)
            row1 = sample_anchors(batch, tc.row1_anchors, None, u1[self.rank * per:(self.rank + 1) * per])
        feats = self.features(batch, idx)  # [b, T, F*d] float32 on the training device
        denom = None
        if self.world > 1:  # normalise by the global weight sum (exact data parallelism)
            ws = torch.tensor([weight_sum(batch, anchors, self.cfg.block_size, tc.gamma)], dtype=torch.float64,
                              device=self.device)
            dist.all_reduce(ws)
            denom = float(ws) / self.world
        batch, anchors = batch.to(self.device), anchors.to(self.device)
        row1 = row1.to(self.device) if row1 is not None else None
        self.model.train()
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=tc.autocast_bf16):
            losses = drafter_losses(self.model, feats, batch, anchors, tc.gamma,
                                    None if self.subset is None else self.subset, tc.fs_weight, denom,
                                    soft=self.last_soft, soft_weight=tc.soft_weight,
                                    row1_anchors=row1, row1_weight=tc.row1_weight)
        self.opt.zero_grad(set_to_none=True)
        losses["loss"].backward()
        if self.world > 1:  # data parallel: average gradients over ranks (one flat all-reduce)
            params = [p for p in self.model.parameters() if p.requires_grad]
            for p in params:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
            flat = torch.cat([p.grad.reshape(-1) for p in params])
            dist.all_reduce(flat)
            flat /= self.world
            off = 0
            for p in params:
                p.grad.copy_(flat[off:off + p.numel()].view_as(p))
                off += p.numel()
        gn = torch.nn.utils.clip_grad_norm_(self.model.parameters(), tc.grad_clip)
        if not math.isfinite(float(gn)):  # NaN/inf loss or gradients; identical on every rank
            raise TrainingDiverged(f"step {step + 1}: the loss ({float(losses['loss'].detach())}) or its "
                                   f"gradients are not finite; lower --lr (now {tc.lr:g}) or check the data. "
                                   f"Nothing of this step was applied; checkpoints written before it stay valid")
        return losses, gn

    def run(self, resume: bool = False, init_from: str | Path | None = None,
            continue_from: str | Path | None = None, rebuild_steps: int = 64) -> Path:
        """Train to ``tc.steps``; saves every ``save_every`` steps and at the end.

        ``resume`` continues ``out/ckpt`` when present (exactly); otherwise ``continue_from``
        (an exported drafter with ``trainer.json``) continues that run's schedule with
        rebuilt optimizer moments (:mod:`dspine.train.portable`), or ``init_from`` (a
        drafter checkpoint directory) warm-starts the weights.
        """
        resumed = resume and self.resume()
        if resumed and self.rank == 0:
            print(f"resumed from step {self.step}")
            if continue_from:
                print(f"note: --continue-from {continue_from} is not used: {self.out / 'ckpt'} holds this run's "
                      f"own checkpoint, which --resume continues exactly", file=sys.stderr)
        elif resume and self.rank == 0:
            print(f"note: --resume: no checkpoint in {self.out / 'ckpt'} yet; "
                  + ("continuing the exported run" if continue_from else "starting at step 0"), file=sys.stderr)
        if not resumed and continue_from:
            from dspine.train.portable import continue_from as continue_run

            continue_run(self, continue_from, rebuild_steps)
            if self.rank == 0:
                print(f"continuing {continue_from} from step {self.step} (optimizer moments rebuilt from "
                      f"{min(rebuild_steps, self.step)} steps)", file=sys.stderr)
        elif not resumed and init_from:
            self.init_from(init_from)
        tc = self.tc
        bar = tqdm(total=tc.steps, initial=self.step, desc=f"train {self.cfg.mode}", disable=self.rank != 0)
        started = time.perf_counter()
        self.stopped_early = False
        rec = None
        while self.step < tc.steps:
            if tc.time_limit and time.perf_counter() - started >= tc.time_limit:
                self.stopped_early = True  # rank 0's clock decides for every rank (same step count)
            if self.world > 1 and tc.time_limit:  # no collective per step without a limit
                flag = torch.tensor([float(self.stopped_early)], device=self.device)
                dist.broadcast(flag, 0)
                self.stopped_early = bool(flag.item())
            if self.stopped_early:
                if self.rank == 0:
                    print(f"note: --time-limit {tc.time_limit:g} s reached at step {self.step} of {tc.steps}; "
                          f"saved (--resume continues the same schedule)", file=sys.stderr)
                if rec is not None and self.step % 10:  # the last step is in metrics.jsonl too
                    self.log({**rec, "stopped_by_time_limit": True})
                break
            t0 = time.perf_counter()
            rec = self.train_step()
            self.wall += time.perf_counter() - t0
            rec["wall_s"] = round(self.wall, 2)
            if self.step % 10 == 0 or self.step == tc.steps:
                self.log(rec)
            bar.update(1)
            bar.set_postfix(loss=f"{rec['loss']:.3f}", acc1=f"{rec['acc1']:.2f}")
            if self.step % tc.save_every == 0:
                self.save()
            if tc.eval_every and self.step % tc.eval_every == 0 and self.eval_fn and self.rank == 0:
                self.log({"step": self.step, **self.eval_fn(self.model)})
        bar.close()
        self.save()
        return self.out / "ckpt"
