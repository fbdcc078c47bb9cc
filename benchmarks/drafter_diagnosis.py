"""What caps the shipped drafter's tau: row-1 accuracy of the block drafter against a
one-layer autoregressive EAGLE-style head trained on the same target features.

Held-out set: the target's own greedy answers (``--eval-tokens`` new tokens) to the first
``--eval-n`` held-out code and chat prompts (:func:`dspine.data.sources.heldout_prompts`;
never trained on). Training set: the first ``--train-rows`` rows of the committed
target-regenerated data (``training-data/smollm2-135m-regen``; training prompts only).

Measured on the held-out answers, teacher-forced (for a greedy chain this is exactly the
engine's acceptance: a row is verified only when every row before it was right, and then
its predecessors are the true tokens):

- the shipped DSpine / DFlash-style drafters: share of anchors whose row k (k = 1..4) and
  every row before it are right (the continuous logits' argmax, the drafter's proposal
  before the final stage), and the implied chain tau;
- the EAGLE-style head (EAGLE, Li et al. 2024: ``fc([features_t ; embed(x_{t+1})])`` -> one
  causal decoder layer -> norm -> the target's frozen head, predicting x_{t+2}): its row-1
  accuracy after every ``--eval-every`` CPU-seconds of training (a learning curve). Each
  ``--variants`` entry ``FEATURES:INIT`` is one head: FEATURES ``drafter`` (the drafter's
  feature layers) or ``last`` (those plus the target's final, normed hidden state); INIT
  ``random`` or ``target`` (the decoder layer starts as a copy of the target's last layer).
  The heads train in turns, one step each, every head's CPU time counted on its own: equal
  compute, same data order, same process and machine load.

    python benchmarks/drafter_diagnosis.py --train-rows 600 --budget 1200 --out benchmarks/drafter-diagnosis/avx512-2026-12-04.json
    python benchmarks/drafter_diagnosis.py --train-rows 800 --budget 700 --eval-every 175 \
        --variants drafter:random last:random last:target --skip-drafters \
        --out benchmarks/drafter-diagnosis/levers-avx2-2026-12-05.json
"""
from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as Fn
from torch import nn

ROOT = Path(__file__).resolve().parents[1]


def greedy_answers(target, kind: str, n: int, new: int) -> list[tuple[list[int], int]]:
    """(prompt + greedy answer ids, answer start) for ``n`` held-out prompts of ``kind``."""
    from dspine.config import SamplingConfig
    from dspine.data.tokenizer import encode_record
    from dspine.data.sources import heldout_prompts
    from dspine.core.engine import Engine

    eng = Engine(target, None, "ar")
    out = []
    for rec in heldout_prompts(kind, n):
        ids = encode_record(target, rec)[-300:]
        r = eng.generate(ids, SamplingConfig(), new)
        out.append((ids + r.token_ids, len(ids)))
    return out


@torch.no_grad()
def features(target, seqs, layers: list[int], last: bool) -> list[torch.Tensor]:
    """Per sequence [T, F*d] bfloat16: the outputs of ``layers`` (as the drafters read them),
    plus the final (normed) hidden state when ``last``."""
    out = []
    for ids, _ in seqs:
        o = target.model(input_ids=torch.tensor([ids]), output_hidden_states=True, logits_to_keep=1)
        hs = [o.hidden_states[l + 1][0] for l in layers] + ([o.hidden_states[-1][0]] if last else [])
        out.append(torch.cat(hs, -1).to(torch.bfloat16))
    return out


def drafter_rows(drafter, seqs, feats, vocab: torch.Tensor | None, rows: int = 4) -> list[float]:
    """Share of response anchors whose rows 1..k are all right (k = 1..rows), teacher-forced,
    continuous logits over the drafter's draft vocabulary ``vocab`` (its candidate pass; None:
    all tokens)."""
    hit = [0] * rows
    total = 0
    H = drafter.head if vocab is None else drafter.head[vocab]
    for (ids, rs), f in zip(seqs, feats):
        T = len(ids)
        a = torch.arange(max(rs, 1), T - 1)[None]  # every anchor in the answer
        if a.numel() == 0:
            continue
        ids_t = torch.tensor([ids])
        pos = torch.arange(T)[None]
        with torch.no_grad():
            ctx = drafter.context_kv(f[None].float(), pos)
            o = drafter.forward_blocks(ids_t[:, a[0]], a, ctx, pos, torch.ones(1, T, dtype=torch.bool))
            z = drafter.norm_f(o.h[:, :, 1:rows + 1]) @ H.T  # [1, nb, rows, V]
        pred = z.argmax(-1)[0]  # [nb, rows]
        if vocab is not None:
            pred = vocab[pred]
        ok_all = torch.ones(a.shape[1], dtype=torch.bool)
        for k in range(rows):
            p = a[0] + k + 1
            inside = p < T
            truth = ids_t[0, p.clamp(max=T - 1)]
            ok_all = ok_all & inside & (pred[:, k] == truth)
            hit[k] += int(ok_all.sum())
        total += a.shape[1]
    return [round(h / max(total, 1), 4) for h in hit]


class EagleHead(nn.Module):
    """fc([features_t ; embed(x_{t+1})]) -> one Llama decoder layer -> RMSNorm; logits through
    the target's frozen head (a vocabulary subset). Position t predicts x_{t+2}."""

    def __init__(self, target, feat_dim: int, subset: torch.Tensor, init: str = "random"):
        super().__init__()
        from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

        cfg = target.model.config
        d = cfg.hidden_size
        self.embed = target.model.get_input_embeddings().weight.detach().float()  # frozen [V, d]
        self.head = target.model.get_output_embeddings().weight.detach().float()[subset]  # frozen [Vs, d]
        self.fc = nn.Linear(feat_dim + d, d, bias=False)
        self.layer = LlamaDecoderLayer(cfg, 0).float()
        self.rope = LlamaRotaryEmbedding(cfg)
        self.norm = nn.RMSNorm(d, eps=cfg.rms_norm_eps)
        if init == "target":  # the target's last decoder layer and final norm as the start
            self.layer.load_state_dict({k: v.float() for k, v in target.model.model.layers[-1].state_dict().items()})
            self.norm.weight.data.copy_(target.model.model.norm.weight.float())
        elif init != "random":
            raise ValueError(f"--variants: init {init!r} is unknown; accepted: random, target")

    def forward(self, feats: torch.Tensor, nxt: torch.Tensor) -> torch.Tensor:
        """feats [b, T, F*d] float32, nxt [b, T] ids of x_{t+1} -> logits [b, T, Vs]."""
        x = self.fc(torch.cat([feats, self.embed[nxt]], -1))
        b, T, _ = x.shape
        pos = torch.arange(T)[None].expand(b, T)
        mask = torch.full((T, T), float("-inf")).triu(1)[None, None]
        h = self.layer(x, attention_mask=mask, position_ids=pos, position_embeddings=self.rope(x, pos))
        h = h[0] if isinstance(h, tuple) else h
        return self.norm(h) @ self.head.T


def eagle_batch(seqs, feats, idx, remap):
    """Padded (feats [b, T, F*d], next ids [b, T], targets [b, T] in subset ids, -100 where
    not supervised: outside the answer, beyond the sequence or outside the subset)."""
    T = max(len(seqs[i][0]) for i in idx) - 1
    F = feats[idx[0]].shape[-1]
    fb = torch.zeros(len(idx), T, F)
    nx = torch.zeros(len(idx), T, dtype=torch.long)
    tg = torch.full((len(idx), T), -100, dtype=torch.long)
    for j, i in enumerate(idx):
        ids, rs = seqs[i]
        n = len(ids) - 2  # positions t with x_{t+2} known
        fb[j, :n] = feats[i][:n].float()
        nx[j, :n] = torch.tensor(ids[1:n + 1])
        t = remap[torch.tensor(ids[2:n + 2])]
        t[: max(rs - 1, 0)] = -100  # supervise x_{t+2} inside the answer only (t + 2 >= rs + 1)
        tg[j, :n] = t
    return fb, nx, tg


@torch.no_grad()
def eagle_row1(head, seqs, feats, remap) -> float:
    hit = tot = 0
    for i in range(len(seqs)):
        fb, nx, tg = eagle_batch(seqs, feats, [i], remap)
        pred = head(fb, nx).argmax(-1)
        ok = tg >= 0
        hit += int(((pred == tg) & ok).sum())
        tot += int(ok.sum())
    return round(hit / max(tot, 1), 4)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--train-rows", type=int, default=600)
    ap.add_argument("--max-len", type=int, default=256)
    ap.add_argument("--eval-n", type=int, default=16, help="held-out prompts per set (code, chat)")
    ap.add_argument("--eval-tokens", type=int, default=64)
    ap.add_argument("--budget", type=float, default=1200.0, help="CPU-seconds of EAGLE-head training")
    ap.add_argument("--eval-every", type=float, default=150.0)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--variants", nargs="+", default=["drafter:random"],
                    help="heads to train side by side, FEATURES:INIT with FEATURES drafter|last, INIT random|target")
    ap.add_argument("--skip-drafters", action="store_true", help="do not re-measure the shipped drafters' rows")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    variants = []
    for v in args.variants:
        f, _, init = v.partition(":")
        if f not in ("drafter", "last") or init not in ("random", "target"):
            ap.error(f"--variants {v!r}: expected FEATURES:INIT, FEATURES drafter|last, INIT random|target")
        variants.append((v, f, init))
    if len({v for v, _, _ in variants}) < len(variants):
        ap.error("--variants: a variant is listed twice")
    last = any(f == "last" for _, f, _ in variants)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)

    from dspine.build import default_drafter_path
    from dspine.data.load import load_dataset
    from dspine.drafter.checkpoint import load_drafter
    from dspine.drafter.vocab import resolve
    from dspine.target.adapter import load_target
    from dspine.tune.machine import describe

    t_all = time.time()
    target = load_target("smollm2-135m", dtype="float32")
    say = lambda *a: print(f"[{time.time() - t_all:7.1f}s]", *a, file=sys.stderr, flush=True)  # noqa: E731
    ev = {k: greedy_answers(target, k, args.eval_n, args.eval_tokens) for k in ("code", "chat")}
    say("held-out answers", {k: sum(len(s) - r for s, r in v) for k, v in ev.items()})
    shipped = load_drafter(default_drafter_path("smollm2-135m", "dspine"), target)
    layers = list(shipped.cfg.feature_layers)
    ev_f = {k: features(target, v, layers, last) for k, v in ev.items()}
    dF = len(layers) * target.model.config.hidden_size
    res = {"machine": describe(), "threads": args.threads, "date": time.strftime("%Y-%m-%d"),
           "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                    cwd=ROOT).stdout.strip(), "args": vars(args),
           "eval_answer_tokens": {k: sum(len(s) - r for s, r in v) for k, v in ev.items()}}
    for mode in () if args.skip_drafters else ("dspine", "dflash"):
        d = load_drafter(default_drafter_path("smollm2-135m", mode), target).eval()
        vocab = resolve("auto", str(default_drafter_path("smollm2-135m", mode)), d.cfg.vocab_size, d.cfg.head_topk)
        for k in ("code", "chat"):
            rows = drafter_rows(d, ev[k], [f[:, :dF] for f in ev_f[k]], vocab)
            res[f"{mode}_rows_{k}"] = rows
            res[f"{mode}_chain_tau_rows1to4_{k}"] = round(1 + sum(rows), 4)
        say(mode, {k: res[f"{mode}_rows_{k}"] for k in ("code", "chat")})

    data = load_dataset(ROOT / "training-data" / "smollm2-135m-regen", target)[: args.train_rows]
    from dspine.train.losses import fit_window

    tr = [fit_window(s.input_ids, s.response_start, args.max_len) for s in data]
    t0 = time.time()
    tr_f = features(target, tr, layers, last)
    res["feature_s"] = round(time.time() - t0, 1)
    res["train_answer_tokens"] = sum(len(s) - r for s, r in tr)
    say("train features", len(tr), "rows", res["train_answer_tokens"], "answer tokens", res["feature_s"], "s")
    vocab = resolve("auto", str(default_drafter_path("smollm2-135m", "dspine")), shipped.cfg.vocab_size,
                    shipped.cfg.head_topk)
    subset = vocab if vocab is not None else torch.arange(target.vocab_size)
    remap = torch.full((target.vocab_size,), -100, dtype=torch.long)
    remap[subset] = torch.arange(subset.numel())
    sl = {"drafter": dF, "last": None}  # feature columns each head reads
    heads = {}
    for name, f, init in variants:
        torch.manual_seed(0)  # every head starts from the same random draw
        head = EagleHead(target, dF if f == "drafter" else tr_f[0].shape[-1], subset, init)
        params = [p for p in head.parameters() if p.requires_grad]
        heads[name] = dict(head=head, params=params, cols=sl[f], curve=[], cpu=0.0, step=0, next_eval=0.0,
                           opt=torch.optim.AdamW(params, lr=args.lr, weight_decay=0.01),
                           gen=torch.Generator().manual_seed(0), done=False)
        res[f"eagle_params_{name}"] = sum(p.numel() for p in params)

    def cut(fs, cols):
        return fs if cols is None else [x[:, :cols] for x in fs]

    while not all(h["done"] for h in heads.values()):
        for name, h in heads.items():  # one step each, in turns (equal compute, same load)
            if h["done"]:
                continue
            used = h["cpu"]
            if used >= h["next_eval"] or used >= args.budget:
                h["head"].eval()
                pt = {"cpu_s": round(used, 1), "step": h["step"],
                      **{f"row1_{k}": eagle_row1(h["head"], ev[k], cut(ev_f[k], h["cols"]), remap)
                         for k in ("code", "chat")}}
                h["head"].train()
                h["curve"].append(pt)
                say("eagle", name, pt)
                if args.out:  # the curve so far, so a stopped run keeps its points
                    res["eagle_curves"] = {n: g["curve"] for n, g in heads.items()}
                    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
                    Path(args.out).write_text(json.dumps({**res, "partial": True}, indent=1) + "\n")
                h["next_eval"] += args.eval_every
                if used >= args.budget:
                    h["done"] = True
                    continue
            c0 = time.process_time()
            idx = torch.randint(len(tr), (args.batch,), generator=h["gen"]).tolist()
            fb, nx, tg = eagle_batch(tr, cut(tr_f, h["cols"]), idx, remap)
            lr = args.lr * 0.5 * (1 + math.cos(math.pi * min(1.0, used / args.budget)))
            for g in h["opt"].param_groups:
                g["lr"] = lr
            loss = Fn.cross_entropy(h["head"](fb, nx).reshape(-1, subset.numel()), tg.reshape(-1), ignore_index=-100)
            h["opt"].zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(h["params"], 1.0)
            h["opt"].step()
            h["step"] += 1
            h["cpu"] += time.process_time() - c0
    res["eagle_curves"] = {name: h["curve"] for name, h in heads.items()}
    res["wall_s"] = round(time.time() - t_all, 1)
    print(json.dumps(res))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(res, indent=1) + "\n")
        plot_curves(res, Path(args.out).with_suffix(".png"))
    return 0


def plot_curves(res: dict, path: Path) -> None:
    """Row-1 accuracy of each EAGLE-style head against CPU-seconds, code and chat."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(9, 3.4), sharey=True)
    for ax, k in zip(axes, ("code", "chat")):
        for name, curve in res["eagle_curves"].items():
            ax.plot([p["cpu_s"] for p in curve], [p[f"row1_{k}"] for p in curve], marker="o", label=name)
        shipped = res.get(f"dspine_rows_{k}")
        if shipped:
            ax.axhline(shipped[0], color="k", lw=0.8, ls="--", label="shipped DSpine")
        ax.set_title(f"held-out {k}: row-1 accuracy", fontsize=9)
        ax.set_xlabel("CPU-seconds of training")
    axes[0].legend(fontsize=8)
    fig.suptitle(f"{res['machine']}, {res['date']}", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
