"""Drafter training loop: online target features, AdamW + warmup/cosine, checkpoints,
``--resume``, JSONL metrics, held-out acceptance by the real engine loop, DDP.

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
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
from tqdm.auto import tqdm

from dspine.config import DSpineConfig
from dspine.drafter.checkpoint import check_fits_target, save_drafter
from dspine.drafter.vocab import frequent_tokens  # noqa: F401 (re-exported for existing imports)
from dspine.guards import resolve_device
from dspine.drafter.model import DSpineDrafter
from dspine.train.losses import collate, cosine_lr, drafter_losses, sample_anchors, target_topk, weight_sum

# config fields a warm start (--init-from) may change: tensors are copied by name, the
# new ones (q/k norms) start at their init, the dropped ones (row embedding) are listed
ADAPTABLE_FIELDS = frozenset({"qk_norm", "row_embedding"})


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

    def __post_init__(self) -> None:
        for f in ("steps", "batch_size", "anchors_per_seq", "max_len", "save_every"):
            if getattr(self, f) <= 0:
                raise ValueError(f"TrainConfig.{f} must be positive, got {getattr(self, f)}")
        if not (self.lr >= 0 and math.isfinite(self.lr)):  # 0 is allowed here (frozen-weights checks)
            raise ValueError(f"TrainConfig.lr (--lr) must be a finite number >= 0, got {self.lr}")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ValueError(f"TrainConfig.min_lr_ratio (--min-lr-ratio) must be in [0, 1], got {self.min_lr_ratio}")
        if not self.soft_topk:  # unused without soft labels: one value, so resuming never trips on it
            self.soft_weight = 0.5
        if not (self.time_limit >= 0 and math.isfinite(self.time_limit)):
            raise ValueError(f"TrainConfig.time_limit (--time-limit) must be a finite number >= 0, got {self.time_limit}")
        if not 0.0 <= self.soft_weight <= 1.0:
            raise ValueError(f"TrainConfig.soft_weight (--soft-weight) must be in [0, 1], got {self.soft_weight}")
        for f in ("warmup", "vocab_subset", "eval_every", "eval_prompts", "soft_topk"):
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


class Trainer:
    """Trains one drafter for one target.

    Args:
        target: loaded :class:`dspine.target.adapter.Target` (features are computed online).
        drafter_cfg: the drafter's :class:`DSpineConfig` (must fit the target).
        seqs: list of (token ids, response start) training sequences.
        out_dir: checkpoints (``ckpt/``), ``metrics.jsonl`` and the final export.
        eval_fn: optional ``(drafter) -> dict`` of held-out acceptance metrics.
        feature_store: optional :class:`dspine.train.feature_store.FeatureStore` with
            precomputed features of ``seqs`` (read instead of running the target).
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
        if tc.soft_topk > drafter_cfg.vocab_size:
            raise ValueError(f"--soft-labels {tc.soft_topk} exceeds the vocabulary ({drafter_cfg.vocab_size})")
        self.feature_store = feature_store  # optional FeatureStore (precomputed features)
        self.init_source: str | None = None  # checkpoint the weights were warm-started from
        self.init_adapted: dict | None = None  # what an architecture-adapting warm start changed
        self.wall = 0.0

    # -- checkpoints ------------------------------------------------------------------
    def save(self, final: bool = False, extra: dict | None = None) -> Path:
        """Write ``ckpt/`` (weights fp32, optimizer, step, data fingerprint) atomically; rank 0 only.

        The new state is written to ``ckpt.tmp/`` (``trainer.pt`` last, by rename), then
        ``ckpt/`` -> ``ckpt.old/``, ``ckpt.tmp/`` -> ``ckpt/``, and ``ckpt.old/`` removed: a
        crash at any point leaves one complete state that :meth:`resume` finds.
        """
        if self.rank != 0:
            return self.out
        import shutil

        ck, tmp, old = self.out / "ckpt", self.out / "ckpt.tmp", self.out / "ckpt.old"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        save_drafter(self.model, tmp, dtype=torch.float32)
        torch.save({"opt": self.opt.state_dict(), "step": self.step, "wall": self.wall,
                    "subset": self.subset, "train_config": asdict(self.tc),
                    "init_source": self.init_source,
                    "init_adapted": self.init_adapted, "data_fingerprint": self.data_fingerprint()},
                   tmp / "trainer.pt.part")
        (tmp / "trainer.pt.part").rename(tmp / "trainer.pt")  # marks ckpt.tmp complete
        shutil.rmtree(old, ignore_errors=True)
        if ck.exists():
            ck.rename(old)
        tmp.rename(ck)
        shutil.rmtree(old, ignore_errors=True)
        return ck

    def data_fingerprint(self) -> str:
        """sha256 of this run's training sequences (cached): ``--resume`` checks it."""
        if getattr(self, "_data_fp", None) is None:
            from dspine.train.feature_store import data_fingerprint

            self._data_fp = data_fingerprint(self.seqs, self.tc.max_len)
        return self._data_fp

    def _recover_checkpoint(self) -> None:
        """Finish an interrupted :meth:`save`: when ``ckpt/`` has no ``trainer.pt`` but a
        complete ``ckpt.tmp/`` (newer) or ``ckpt.old/`` is left, move it to ``ckpt/``.
        Rank 0 only (other ranks wait at a barrier in :meth:`resume`)."""
        ck, tmp, old = self.out / "ckpt", self.out / "ckpt.tmp", self.out / "ckpt.old"
        if (ck / "trainer.pt").exists():
            return
        for src in (tmp, old):  # crash between the renames: the newest complete state
            if (src / "trainer.pt").exists() and (src / "model.safetensors").exists():
                if ck.exists():
                    import shutil
                    shutil.rmtree(ck)
                src.rename(ck)
                print(f"note: recovered the checkpoint of an interrupted save from {src.name}/", file=sys.stderr)
                return

    # settings added after checkpoints were written: what those checkpoints trained with
    LEGACY_DEFAULTS = {"min_lr_ratio": 0.1, "soft_topk": 0, "soft_weight": 0.5}
    # settings a resumed run may change (how long, how often to save / evaluate, where, and
    # the dtype the target computes features in: a speed choice measured per machine,
    # `--feature-dtype auto`, that must not stop a run moved to another CPU)
    _RESUMABLE = {"steps", "save_every", "eval_every", "eval_prompts", "eval_max_new_tokens",
                  "memo_features", "device", "feature_dtype", "time_limit"}
    _FLAGS = {"batch_size": "--batch-size", "anchors_per_seq": "--anchors", "max_len": "--max-len",
              "lr": "--lr", "min_lr_ratio": "--min-lr-ratio", "warmup": "--warmup",
              "vocab_subset": "--vocab-subset", "seed": "--seed", "feature_dtype": "--feature-dtype", "autocast_bf16": "--bf16-autocast",
              "soft_topk": "--soft-labels", "soft_weight": "--soft-weight", "gamma": "--gamma"}

    def resume(self) -> bool:
        """Load ``ckpt/`` if present; returns True when resumed, False when no checkpoint
        was ever written (the run starts at step 0).

        Raises:
            ValueError: an incomplete checkpoint, or one made with another drafter config,
                other training settings (all but steps, save/eval cadence and device) or
                other training data (sha256 of the sequences), each named.
        """
        if self.rank == 0:
            self._recover_checkpoint()
        if self.world > 1:  # every rank reads the checkpoint rank 0 may just have recovered
            dist.barrier()
        ck = self.out / "ckpt"
        if not (ck / "trainer.pt").exists():
            if ck.exists():
                raise ValueError(f"--resume: {ck} is incomplete (no trainer.pt) and no complete ckpt.tmp/ or "
                                 f"ckpt.old/ is left; restore it or start a new --out")
            return False
        from safetensors.torch import load_file

        saved = DSpineConfig.load(ck)
        if saved != self.cfg:
            diff = {k: (v, getattr(self.cfg, k)) for k, v in asdict(saved).items() if getattr(self.cfg, k) != v}
            raise ValueError(f"--resume: checkpoint in {ck} was trained with another drafter config "
                             f"(checkpoint vs this run: {diff}); use a new --out")
        try:
            st = torch.load(ck / "trainer.pt", weights_only=False, map_location="cpu")
            if not isinstance(st, dict) or not {"opt", "step", "subset"} <= set(st):
                raise ValueError("not a trainer state")
        except Exception as e:  # noqa: BLE001 (pickle, zip and value errors alike)
            raise ValueError(f"--resume: {ck / 'trainer.pt'} is damaged or not a dspine trainer state "
                             f"({type(e).__name__}: {e}); start a new --out, or --init-from a drafter "
                             f"checkpoint") from None
        now = asdict(self.tc)
        saved_tc = {**self.LEGACY_DEFAULTS, **(st.get("train_config") or {})}
        for k, v in saved_tc.items():
            if k not in self._RESUMABLE and k in now and now[k] != v:
                raise ValueError(f"--resume: {ck} was trained with {self._FLAGS.get(k, k)} {v!r}, this run "
                                 f"has {now[k]!r}; resume with the same setting or start a new --out "
                                 f"(--init-from {ck} warm-starts the weights with a fresh optimizer)")
        fp = st.get("data_fingerprint")
        if fp is not None and fp != self.data_fingerprint():
            raise ValueError(f"--resume: {ck} was trained on other --data (sha256 of the sequences "
                             f"{fp[:12]}, this run {self.data_fingerprint()[:12]}); resume with the same "
                             f"--data list or start a new --out (--init-from {ck} warm-starts the weights)")
        try:
            weights = load_file(str(ck / "model.safetensors"))
        except Exception as e:  # noqa: BLE001 (SafetensorError, OSError)
            raise ValueError(f"--resume: {ck / 'model.safetensors'} is damaged ({type(e).__name__}: {e}); "
                             f"start a new --out") from None
        self.model.load_state_dict(weights)
        self.opt.load_state_dict(st["opt"])  # moves the optimizer state to the parameters' device
        self.step, self.wall = st["step"], st.get("wall", 0.0)
        self.subset = None if st["subset"] is None else st["subset"].to(self.device)
        self.init_source = st.get("init_source")
        self.init_adapted = st.get("init_adapted")
        return True

    def init_from(self, path: str | Path) -> None:
        """Warm-start the weights from a drafter checkpoint directory (fresh optimizer).

        Raises:
            DrafterError: unreadable checkpoint, or one whose config differs from this
                run's (other mode, sizes, block size or feature layers).
        """
        from dspine.drafter.checkpoint import DrafterError, load_drafter

        src = load_drafter(path, self.target, dtype=torch.float32, option="--init-from")
        diff = [k for k, v in asdict(self.cfg).items() if asdict(src.cfg).get(k) != v]
        if set(diff) - ADAPTABLE_FIELDS:
            raise DrafterError(f"--init-from {path}: checkpoint config differs from this run's in {diff}")
        if diff and not (self.cfg.qk_norm and not self.cfg.row_embedding):
            raise DrafterError(f"--init-from {path} is an engine-compatible drafter (q/k norm, no row embedding); "
                               f"this run's is not, and would drop its trained q/k norms: add --engine-compatible")
        own, theirs = self.model.state_dict(), src.state_dict()
        copied = {k: v for k, v in theirs.items() if k in own}
        self.model.load_state_dict(copied, strict=False)
        self.init_source = str(path)
        if diff:  # an architecture-adapting warm start (e.g. to --engine-compatible)
            self.init_adapted = {"changed": diff, "dropped": sorted(set(theirs) - set(own)),
                                 "new_at_init": sorted(set(own) - set(theirs))}
            if self.rank == 0:
                print(f"--init-from {path}: config differs in {diff}; copied {len(copied)} tensors, dropped "
                      f"{self.init_adapted['dropped']}, new at init {self.init_adapted['new_at_init']}",
                      file=sys.stderr, flush=True)
        if self.world > 1:
            for p in self.model.parameters():
                dist.broadcast(p.data, 0)

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
        from dspine.data.build import cpu_speed_patches

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
        tc = self.tc
        lr = cosine_lr(self.step, tc.steps, tc.warmup, tc.lr, floor=tc.min_lr_ratio)
        for g in self.opt.param_groups:
            g["lr"] = lr
        seqs, idx = self.batch_for_step(self.step)
        batch = collate(seqs, tc.max_len)
        gen = torch.Generator().manual_seed(tc.seed * 7919 + self.step * 31)
        u = torch.rand(tc.batch_size, tc.anchors_per_seq, generator=gen, dtype=torch.float64)
        per = tc.batch_size // self.world
        anchors = sample_anchors(batch, tc.anchors_per_seq, None, u[self.rank * per:(self.rank + 1) * per])
        feats = self.features(batch, idx)  # [b, T, F*d] float32 on the training device
        denom = None
        if self.world > 1:  # normalise by the global weight sum (exact data parallelism)
            ws = torch.tensor([weight_sum(batch, anchors, self.cfg.block_size, tc.gamma)], dtype=torch.float64,
                              device=self.device)
            dist.all_reduce(ws)
            denom = float(ws) / self.world
        batch, anchors = batch.to(self.device), anchors.to(self.device)
        self.model.train()
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=tc.autocast_bf16):
            losses = drafter_losses(self.model, feats, batch, anchors, tc.gamma,
                                    None if self.subset is None else self.subset, tc.fs_weight, denom,
                                    soft=self.last_soft, soft_weight=tc.soft_weight)
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
            raise TrainingDiverged(f"step {self.step + 1}: the loss ({float(losses['loss'].detach())}) or its "
                                   f"gradients are not finite; lower --lr (now {tc.lr:g}) or check the data. "
                                   f"Nothing of this step was applied; checkpoints written before it stay valid")
        self.opt.step()
        self.step += 1
        return {"step": self.step, "lr": lr, "loss": float(losses["loss"].detach()), "ce": float(losses["ce"]),
                "fs": float(losses["fs"]), "acc1": float(losses["acc1"]), "grad_norm": float(gn)}

    def run(self, resume: bool = False, init_from: str | Path | None = None) -> Path:
        """Train to ``tc.steps``; saves every ``save_every`` steps and at the end.

        ``resume`` continues ``out/ckpt`` when present; otherwise ``init_from`` (a drafter
        checkpoint directory) warm-starts the weights.
        """
        resumed = resume and self.resume()
        if resumed and self.rank == 0:
            print(f"resumed from step {self.step}")
        elif resume and self.rank == 0:
            print(f"note: --resume: no checkpoint in {self.out / 'ckpt'} yet; starting at step 0",
                  file=sys.stderr)
        if not resumed and init_from:
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
