"""The trainer's checkpoints: ``ckpt/`` written atomically and recovered after an
interrupted save, ``--resume`` (with its checks that config, settings and data match) and
the ``--init-from`` warm start. :class:`TrainerCheckpoints` is a mixin of
:class:`dspine.train.loop.Trainer` and works on its state (model, optimizer, step, ...).
"""
from __future__ import annotations

import sys
from dataclasses import asdict
from pathlib import Path

import torch
import torch.distributed as dist

from dspine.config import DSpineConfig
from dspine.drafter.checkpoint import save_drafter

# config fields a warm start (--init-from) may change: tensors are copied by name, the
# new ones (q/k norms) start at their init, the dropped ones (row embedding) are listed
ADAPTABLE_FIELDS = frozenset({"qk_norm", "row_embedding"})


class TrainerCheckpoints:
    """Checkpoint, resume and warm-start methods of :class:`dspine.train.loop.Trainer`."""

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
                    "init_adapted": self.init_adapted, "data_fingerprint": self.data_fingerprint(),
                    "data_sequences": len(self.seqs), "data_history": self.data_history},
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
    LEGACY_DEFAULTS = {"min_lr_ratio": 0.1, "soft_topk": 0, "soft_weight": 0.5, "lr_schedule": "cosine"}
    # settings a resumed run may change (how long, how often to save / evaluate, where, and
    # the dtype the target computes features in: a speed choice measured per machine,
    # `--feature-dtype auto`, that must not stop a run moved to another CPU)
    _RESUMABLE = {"steps", "save_every", "eval_every", "eval_prompts", "eval_max_new_tokens",
                  "memo_features", "device", "feature_dtype", "time_limit"}
    _FLAGS = {"batch_size": "--batch-size", "anchors_per_seq": "--anchors", "max_len": "--max-len",
              "lr": "--lr", "min_lr_ratio": "--min-lr-ratio", "warmup": "--warmup",
              "vocab_subset": "--vocab-subset", "seed": "--seed", "feature_dtype": "--feature-dtype", "autocast_bf16": "--bf16-autocast",
              "soft_topk": "--soft-labels", "soft_weight": "--soft-weight", "gamma": "--gamma",
              "lr_schedule": "--lr-schedule"}

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
        self.adopt_run(st, where=str(ck), option="--resume")
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

    def adopt_run(self, st: dict, where: str, option: str) -> None:
        """Check that this run may continue the saved run ``st`` (its ``train_config``,
        ``data_fingerprint``, ``data_history`` and ``step``) and take its data history.

        Settings outside :attr:`_RESUMABLE` must be equal; the data must be the same
        sequences, or grow by sequences appended after the old ones (recorded in
        :attr:`data_history`; steps from the saved one on draw from all of them).

        Raises:
            ValueError: another setting or other data, each named (``option`` and ``where``
                say which state was being continued).
        """
        now = asdict(self.tc)
        saved_tc = {**self.LEGACY_DEFAULTS, **(st.get("train_config") or {})}
        for k, v in saved_tc.items():  # each setting of the type the run had: a damaged state otherwise
            if k in now and not _same_kind(v, now[k]):
                raise ValueError(f"{option}: {where} holds train_config.{k} = {v!r}, not a "
                                 f"{type(now[k]).__name__}; the saved state is damaged")
        for k, v in saved_tc.items():
            if k not in self._RESUMABLE and k in now and now[k] != v:
                raise ValueError(f"{option}: {where} was trained with {self._FLAGS.get(k, k)} {v!r}, this run "
                                 f"has {now[k]!r}; continue with the same setting or start a new --out "
                                 f"(--init-from warm-starts the weights with a fresh optimizer)")
        fp = st.get("data_fingerprint")
        history = st.get("data_history")
        if fp is not None and fp != self.data_fingerprint():
            from dspine.train.feature_store import grown_from

            n_old = grown_from(self.seqs, self.tc.max_len, fp)
            if n_old is None:
                raise ValueError(f"{option}: {where} was trained on other --data (sha256 of the sequences "
                                 f"{fp[:12]}, this run {self.data_fingerprint()[:12]}); continue with the same "
                                 f"--data list, or with data that grew only by rows appended after the old "
                                 f"ones (`dspine data build --resume` into the last --data directory), or "
                                 f"start a new --out (--init-from warm-starts the weights)")
            history = (history or [{"step": 0, "sequences": n_old}]) + [{"step": st["step"], "sequences": len(self.seqs)}]
            if self.rank == 0:
                print(f"note: {option}: the training data grew from {n_old} to {len(self.seqs)} sequences (the "
                      f"first {n_old} unchanged); steps from {st['step'] + 1} on draw from all of them. The "
                      f"--vocab-subset stays the one counted on the first data", file=sys.stderr)
        self.data_history = history or [{"step": 0, "sequences": len(self.seqs)}]
        if (now["lr_schedule"] == "cosine" and saved_tc.get("steps") not in (None, now["steps"])
                and self.rank == 0):
            print(f"note: {option} with --steps {now['steps']} (the run was planned for {saved_tc['steps']}): "
                  f"the cosine schedule now ends at step {now['steps']}, so the learning rate of the remaining "
                  f"steps changes; a run extended period after period trains with --lr-schedule constant",
                  file=sys.stderr)

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


def _same_kind(saved, now) -> bool:
    """Whether a saved setting has the type of this run's (an int stands for a float; a bool
    is no number)."""
    if isinstance(now, bool) or isinstance(saved, bool):
        return isinstance(now, bool) and isinstance(saved, bool)
    if isinstance(now, float):
        return isinstance(saved, (int, float))
    return isinstance(saved, type(now))
