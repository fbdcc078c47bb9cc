"""Training levers of the DSpine drafter at equal compute: learning curves of held-out
teacher-forced rows 1-4 (and the chain τ they imply) against CPU-seconds.

Every variant starts from the same checkpoint (``--init``, the shipped drafter by
default), sees the same training rows in the same order (the first ``--train-rows`` of the
committed target-regenerated data, features computed once by the target and shared) and
trains with the project's own loss (:func:`dspine.train.losses.drafter_losses`: rows
weighted ``exp(-(k-1)/gamma)``, the final stage's K-way CE) and AdamW. The variants take
turns, one step each, in one process, every variant's CPU time counted on its own: equal
compute under the same machine load. Each ``--variants`` entry is ``NAME:KEY=VALUE,...``
with keys ``gamma`` (row weights), ``anchors`` (blocks per sequence), ``lr``, ``soft`` and
``sw`` (soft labels: the target's top-``soft`` distribution mixed into each row's CE with
weight ``sw``, as ``dspine train --soft-labels K --soft-weight W``; 0: hard labels only), ``r1``
and ``r1w`` (a dense row-1 term: ``r1`` more anchors per sequence trained on row 1 only, in
two-row blocks, with weight ``r1w``; :func:`dspine.train.losses.row1_loss`), and the
capacity keys ``layers`` (drafter depth), ``ffn`` (SwiGLU width) and ``scratch`` (1: a
fresh random drafter of that shape instead of the start checkpoint). A deeper or wider
variant that is not ``scratch`` is *grown* from the start checkpoint function-preserving
(as LLaMA Pro's block expansion): the new layers are inserted before the old ones with
their attention output, SwiGLU down projection and bridge write at zero (each new layer
starts as the identity), new SwiGLU units get a zero down projection; so every variant
starts from exactly the same drafter and only the capacity to move differs.

Rows are measured as in ``drafter_diagnosis.py``: on the target's own greedy answers to the
first ``--eval-n`` held-out code and chat prompts, the share of answer positions whose rows
1..k are all right (the continuous logits' argmax; for a greedy chain, its acceptance).

    python benchmarks/drafter_levers.py --train-rows 600 --budget 600 --eval-every 150 \\
        --variants base:gamma=7,anchors=24 anchors96:anchors=96 gamma2:gamma=2 \\
        --out benchmarks/drafter-diagnosis/block-levers-avx2-2026-12-05.json
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from drafter_diagnosis import drafter_rows, features, greedy_answers  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
KEYS = {"gamma": float, "anchors": int, "lr": float, "layers": int, "ffn": int, "scratch": int, "soft": int,
        "sw": float, "r1": int, "r1w": float}


def parse_variant(spec: str) -> tuple[str, dict]:
    """``NAME:KEY=VALUE,...`` -> (name, options); ValueError names the bad part."""
    name, _, rest = spec.partition(":")
    if not name:
        raise ValueError(f"--variants {spec!r}: give NAME:KEY=VALUE,...")
    opts = {"gamma": 7.0, "anchors": 24, "lr": 3e-4, "layers": 0, "ffn": 0, "scratch": 0, "soft": 0, "sw": 0.5,
            "r1": 0, "r1w": 1.0}
    for kv in filter(None, rest.split(",")):
        k, eq, v = kv.partition("=")
        if k not in KEYS or not eq:
            raise ValueError(f"--variants {spec!r}: {kv!r} is not KEY=VALUE with KEY one of {', '.join(KEYS)}")
        try:
            opts[k] = KEYS[k](v)
        except ValueError:
            raise ValueError(f"--variants {spec!r}: {k}={v!r} is not a {KEYS[k].__name__}") from None
        if k == "scratch":
            if opts[k] not in (0, 1):
                raise ValueError(f"--variants {spec!r}: scratch must be 0 or 1")
        elif k == "soft":
            if opts[k] < 0:
                raise ValueError(f"--variants {spec!r}: soft must be >= 0 (0: hard labels only)")
        elif k == "sw":
            if not 0 <= opts[k] <= 1:
                raise ValueError(f"--variants {spec!r}: sw must be in [0, 1]")
        elif k in ("r1", "r1w"):
            if not (opts[k] >= 0 and math.isfinite(opts[k])):
                raise ValueError(f"--variants {spec!r}: {k} must be >= 0 (r1 0: no dense row-1 term)")
        elif not (opts[k] > 0 and math.isfinite(opts[k])):
            raise ValueError(f"--variants {spec!r}: {k} must be a positive finite number")
    return name, opts


def topk_labels(target, seqs, k: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per sequence the target's top-``k`` next-token (ids [T, k] int32, probs [T, k]
    float16) at every position (:func:`dspine.train.losses.target_topk`)."""
    from dspine.train.losses import target_topk

    out = []
    with torch.no_grad():
        for ids, _ in seqs:
            logits = target.model(input_ids=torch.tensor([ids])).logits[0]
            out.append(target_topk(logits, k))
    return out


def grown(d0, layers: int, ffn: int, scratch: bool):
    """A drafter with ``layers`` layers and SwiGLU width ``ffn`` (0: the start's), built from
    the start drafter ``d0`` (float32, bound to the target).

    ``scratch``: fresh random weights of that shape. Otherwise function-preserving growth:
    new layers are inserted *before* the old ones (the last layer's bridge read feeds the
    final stage, so it must stay the old last layer) with ``o_proj``, ``down`` and the
    bridge ``write`` at zero; extra SwiGLU units get random ``gate``/``up`` rows and zero
    ``down`` columns. Raises ValueError when asked to shrink.
    """
    import dataclasses

    from dspine.drafter.model import DSpineDrafter

    c0 = d0.cfg
    L, F = layers or c0.num_layers, ffn or c0.ffn
    if not scratch and (L < c0.num_layers or F < c0.ffn):
        raise ValueError(f"layers={L}, ffn={F}: growth only (start has {c0.num_layers} layers, ffn {c0.ffn})")
    cfg = dataclasses.replace(c0, num_layers=L, ffn=F)
    d = DSpineDrafter(cfg).float()
    d.bind_target(d0._target_embed, d0._target_head)
    if scratch:
        return d
    new = L - c0.num_layers
    src = d0.state_dict()
    with torch.no_grad():
        for k, v in d.state_dict().items():
            parts = k.split(".")
            if parts[0] in ("layers", "read", "write") and parts[1].isdigit():
                i = int(parts[1])
                if i < new:  # an inserted layer: identity
                    if parts[0] == "write" or parts[2:] in (["o_proj", "weight"], ["down", "weight"]):
                        v.zero_()
                    continue
                parts[1] = str(i - new)
            w = src[".".join(parts)]
            if w.shape == v.shape:
                v.copy_(w)
            elif parts[-2] in ("gate", "up"):  # [ffn, d]: old rows, new rows stay random
                v[: w.shape[0]].copy_(w)
            elif parts[-2] == "down":  # [d, ffn]: old columns, new columns zero
                v.zero_()
                v[:, : w.shape[1]].copy_(w)
            else:
                raise ValueError(f"cannot grow {k}: {tuple(w.shape)} -> {tuple(v.shape)}")
    return d


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--init", default=None, help="start checkpoint (default: the shipped DSpine drafter)")
    ap.add_argument("--variants", nargs="+", required=True, metavar="NAME:KEY=VALUE,...")
    ap.add_argument("--train-rows", type=int, default=600)
    ap.add_argument("--train-from", type=int, default=0,
                    help="first committed row trained on (rows after the shipped drafters' data are new to them)")
    ap.add_argument("--max-len", type=int, default=256)
    ap.add_argument("--batch", type=int, default=4, help="sequences per step")
    ap.add_argument("--budget", type=float, default=600.0, help="CPU-seconds of training per variant")
    ap.add_argument("--eval-every", type=float, default=150.0)
    ap.add_argument("--eval-n", type=int, default=16)
    ap.add_argument("--eval-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--no-charge-features", action="store_true",
                    help="do not charge each step the target forward of its sequences (charged by default: "
                         "CPU training computes features per step, so more anchors per sequence amortize it)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--save-dir", type=Path, default=None,
                    help="save each variant's drafter at every evaluation to SAVE_DIR/NAME (its draft "
                         "vocabulary copied from --init), to measure it in the engine (`dspine acceptance`)")
    args = ap.parse_args()
    try:
        variants = [parse_variant(v) for v in args.variants]
    except ValueError as e:
        ap.error(str(e))
    if args.threads < 1:
        ap.error(f"--threads {args.threads}: must be >= 1")
    if len({n for n, _ in variants}) < len(variants):
        ap.error("--variants: two variants have the same name")
    torch.set_num_threads(args.threads)
    from dspine.build import default_drafter_path
    from dspine.data.load import load_dataset
    from dspine.drafter.checkpoint import load_drafter
    from dspine.drafter.vocab import resolve
    from dspine.target.adapter import load_target
    from dspine.train.losses import collate, drafter_losses, fit_window, sample_anchors
    from dspine.tune.machine import describe

    t_all = time.time()
    say = lambda *a: print(f"[{time.time() - t_all:7.1f}s]", *a, file=sys.stderr, flush=True)  # noqa: E731
    init = Path(args.init or default_drafter_path("smollm2-135m", "dspine"))
    target = load_target("smollm2-135m", dtype="float32")
    target.model.requires_grad_(False)  # the drafters share its frozen embedding and head
    ev = {k: greedy_answers(target, k, args.eval_n, args.eval_tokens) for k in ("code", "chat")}
    d0 = load_drafter(init, target)
    for name, opts in variants:  # growth only: say so now, not after the features are computed
        if (opts["layers"] and opts["layers"] < d0.cfg.num_layers and not opts["scratch"]) \
                or (opts["ffn"] and opts["ffn"] < d0.cfg.ffn and not opts["scratch"]):
            ap.error(f"--variants {name}: layers={opts['layers']}, ffn={opts['ffn']} would shrink the start "
                     f"({d0.cfg.num_layers} layers, ffn {d0.cfg.ffn}); a smaller drafter needs scratch=1")
    layers = list(d0.cfg.feature_layers)
    ev_f = {k: features(target, v, layers, False) for k, v in ev.items()}
    vocab = resolve("auto", str(init), d0.cfg.vocab_size, d0.cfg.head_topk)
    data = load_dataset(ROOT / "training-data" / "smollm2-135m-regen", target)
    if not 0 <= args.train_from < len(data):
        ap.error(f"--train-from {args.train_from}: the committed data has {len(data)} rows")
    data = data[args.train_from: args.train_from + args.train_rows]
    tr = [fit_window(s.input_ids, s.response_start, args.max_len) for s in data]
    t0 = time.time()
    tr_f = features(target, tr, layers, False)
    per_row = (time.time() - t0) / max(1, len(tr)) * args.threads  # CPU-s of one sequence's feature forward
    say("train features", len(tr), "rows", round(time.time() - t0, 1), "s")
    K = max(o["soft"] for _, o in variants)
    tr_soft = None
    if K:
        t1 = time.time()
        tr_soft = topk_labels(target, tr, K)  # a second forward here; training computes both in one
        say("train top-k", K, round(time.time() - t1, 1), "s")
    res = {"machine": describe(), "threads": args.threads, "date": time.strftime("%Y-%m-%d"), "args": vars(args),
           "init": str(init.relative_to(ROOT) if init.is_relative_to(ROOT) else init),
           "train_answer_tokens": sum(len(s) - r for s, r in tr), "feature_s": round(time.time() - t0, 1),
           "feature_cpu_s_per_row": round(per_row, 3), "charged_features": not args.no_charge_features}

    def measure(d) -> dict:
        d.eval()
        with torch.no_grad():
            rows = {k: drafter_rows(d, ev[k], ev_f[k], vocab) for k in ("code", "chat")}
        d.train()
        return {"rows_code": rows["code"], "rows_chat": rows["chat"],
                "tau_rows1to4_code": round(1 + sum(rows["code"]), 4),
                "tau_rows1to4_chat": round(1 + sum(rows["chat"]), 4)}

    runs = {}
    for name, opts in variants:
        d = load_drafter(init, target).float()
        if opts["layers"] or opts["ffn"] or opts["scratch"]:
            d = grown(d, opts["layers"], opts["ffn"], bool(opts["scratch"]))
        d.train()
        params = [p for p in d.parameters() if p.requires_grad]
        runs[name] = dict(opts=opts, d=d, params=params, cpu=0.0, step=0, next_eval=0.0, curve=[], done=False,
                          opt=torch.optim.AdamW(params, lr=opts["lr"], weight_decay=0.01),
                          gen=torch.Generator().manual_seed(0),
                          gen1=torch.Generator().manual_seed(1))
    while not all(r["done"] for r in runs.values()):
        for name, r in runs.items():  # one step each, in turns
            if r["done"]:
                continue
            used = r["cpu"]
            if used >= r["next_eval"] or used >= args.budget:
                pt = {"cpu_s": round(used, 1), "step": r["step"], **measure(r["d"])}
                r["curve"].append(pt)
                say(name, pt)
                if args.save_dir is not None:
                    save_variant(r["d"], args.save_dir / name, init, pt)
                partial = {**res, "partial": True, "runs": {n: {"opts": x["opts"], "curve": x["curve"]}
                                                            for n, x in runs.items()}}
                Path(args.out).parent.mkdir(parents=True, exist_ok=True)
                Path(args.out).write_text(json.dumps(partial, indent=1, default=str) + "\n")  # a stopped run keeps its points
                r["next_eval"] += args.eval_every
                if used >= args.budget:
                    r["done"] = True
                    continue
            c0 = time.process_time()
            idx = torch.randint(len(tr), (args.batch,), generator=r["gen"]).tolist()
            batch = collate([tr[i] for i in idx], args.max_len)
            T = batch.ids.shape[1]
            feats = torch.zeros(len(idx), T, tr_f[0].shape[-1])
            for j, i in enumerate(idx):
                n = min(T, tr_f[i].shape[0])
                feats[j, :n] = tr_f[i][:n].float()
            anchors = sample_anchors(batch, r["opts"]["anchors"], r["gen"])
            lr = r["opts"]["lr"] * 0.5 * (1 + math.cos(math.pi * min(1.0, used / args.budget)))
            for g in r["opt"].param_groups:
                g["lr"] = lr
            soft, k = None, r["opts"]["soft"]
            if k:
                s_ids = torch.zeros(len(idx), T, k, dtype=torch.int32)
                s_p = torch.zeros(len(idx), T, k, dtype=torch.float16)
                for j, i in enumerate(idx):
                    n = min(T, tr_soft[i][0].shape[0])
                    s_ids[j, :n], s_p[j, :n] = tr_soft[i][0][:n, :k], tr_soft[i][1][:n, :k]
                soft = (s_ids, s_p)
            r1 = sample_anchors(batch, r["opts"]["r1"], r["gen1"]) if r["opts"]["r1"] else None
            out = drafter_losses(r["d"], feats, batch, anchors, r["opts"]["gamma"], vocab_subset=vocab,
                                 soft=soft, soft_weight=r["opts"]["sw"], row1_anchors=r1,
                                 row1_weight=r["opts"]["r1w"])
            r["opt"].zero_grad(set_to_none=True)
            out["loss"].backward()
            torch.nn.utils.clip_grad_norm_(r["params"], 1.0)
            r["opt"].step()
            r["step"] += 1
            r["cpu"] += time.process_time() - c0 + (0.0 if args.no_charge_features else per_row * len(idx))
    res["runs"] = {name: {"opts": r["opts"], "trained_params": sum(p.numel() for p in r["params"]),
                          "curve": r["curve"]} for name, r in runs.items()}
    res["wall_s"] = round(time.time() - t_all, 1)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=1, default=str) + "\n")
    plot(res, Path(args.out).with_suffix(".png"))
    print(json.dumps({k: v["curve"][-1] for k, v in res["runs"].items()}))
    return 0


def save_variant(d, out: Path, init: Path, point: dict) -> None:
    """The drafter ``d`` as a checkpoint in ``out`` (bfloat16, as shipped), with the start
    checkpoint's draft vocabulary and the evaluation point it was saved at."""
    import shutil

    from dspine.drafter.checkpoint import save_drafter

    save_drafter(d, out)
    if (init / "draft_vocab.json").is_file():
        shutil.copy(init / "draft_vocab.json", out / "draft_vocab.json")
    (out / "levers_point.json").write_text(json.dumps({"init": str(init), **point}, indent=1) + "\n")


def plot(res: dict, path: Path) -> None:
    """Implied chain τ (1 + rows 1-4, top) and row 1 alone (bottom) against CPU-seconds,
    code and chat side by side."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(9, 6.2), sharex=True)
    for j, k in enumerate(("code", "chat")):
        for name, r in res["runs"].items():
            xs = [p["cpu_s"] for p in r["curve"]]
            axes[0, j].plot(xs, [p[f"tau_rows1to4_{k}"] for p in r["curve"]], marker="o", label=name)
            axes[1, j].plot(xs, [p[f"rows_{k}"][0] for p in r["curve"]], marker="o", label=name)
        axes[0, j].set_title(f"held-out {k}", fontsize=9)
        axes[1, j].set_xlabel("CPU-seconds of training")
    axes[0, 0].set_ylabel("1 + rows 1-4 right (teacher-forced)")
    axes[1, 0].set_ylabel("row 1 right (teacher-forced)")
    axes[0, 0].legend(fontsize=8)
    fig.suptitle(f"{res['machine']}, {res['date']}", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
