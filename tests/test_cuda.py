"""CUDA checks, skipped on machines without a GPU (CI here is CPU-only).

Run them on a GPU machine with ``scripts/cuda_check.sh``: a drafter checkpoint loaded by
the CLI path emits the target's own greedy tokens on CUDA, and training steps on CUDA
follow the CPU trajectory (float32, tiny random target: no target download needed).
"""
from __future__ import annotations

import pytest
import torch

from dspine.config import SpeculativeConfig
from dspine.config import DSpineConfig, SamplingConfig
from dspine.target.adapter import load_target
from dspine.train.loop import TrainConfig, Trainer

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.parametrize("mode", ["dspine", "dflash"])
def test_checkpoint_greedy_equals_ar_on_cuda(tmp_path, mode):
    """A drafter checkpoint loaded by the CLI path runs on CUDA and stays lossless;
    the oracle drafter (target's own continuation) exercises long accepted blocks."""
    from conftest import OracleProposer
    from dspine.build import build_engine
    from dspine.drafter.checkpoint import random_drafter, save_drafter
    from dspine.core.engine import Engine

    cpu_target = load_target("random:llama", vocab_size=256)
    save_drafter(random_drafter(cpu_target, mode=mode), tmp_path / "ckpt", dtype=torch.float32)
    target, eng = build_engine(SpeculativeConfig(target="random:llama", drafter=str(tmp_path / "ckpt"),
                                                 mode=mode, dtype="float32", device="cuda",
                                                 verify_policy="fixed", proposer="drafter",
                                                 linear_backend="aten", tree_budget=0))
    assert target.device.type == "cuda"
    assert {p.device.type for p in eng.proposer.drafter.parameters()} == {"cuda"}
    ids = list(range(3, 40))
    ref = Engine(target, None, "ar").generate(ids, SamplingConfig(), 48).token_ids
    assert eng.generate(ids, SamplingConfig(), 48).token_ids == ref
    oracle = Engine(target, OracleProposer(target, ids, 16), mode)
    res = oracle.generate(ids, SamplingConfig(), 48)
    assert res.token_ids == ref and res.stats.cycles <= 4


def _seqs(n=8, length=40, vocab=256):
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(n):
        start, step = int(torch.randint(1, vocab, (1,), generator=g)), int(torch.randint(1, 5, (1,), generator=g))
        out.append(([(start + step * k) % vocab for k in range(length)], 4))
    return out


@pytest.mark.parametrize("mode", ["dspine", "dflash"])
def test_training_on_cuda_follows_cpu(tmp_path, mode):
    params = {}
    for dev in ("cpu", "cuda"):
        tg = load_target("random:llama", vocab_size=256, device=dev)
        cfg = DSpineConfig.for_target(tg, mode=mode, block_size=4, num_layers=1, head_topk=4, coarse_k=8)
        tc = TrainConfig(steps=3, batch_size=4, anchors_per_seq=4, max_len=40, lr=3e-3, warmup=1,
                         vocab_subset=0, feature_dtype="float32", memo_features=False, device=dev)
        tr = Trainer(tg, cfg, _seqs(), tmp_path / dev, tc)
        for _ in range(3):
            rec = tr.train_step()
        assert rec["loss"] > 0
        params[dev] = {k: v.detach().cpu() for k, v in tr.model.state_dict().items()}
    for k, v in params["cpu"].items():
        torch.testing.assert_close(params["cuda"][k], v, atol=2e-4, rtol=1e-3, msg=k)
