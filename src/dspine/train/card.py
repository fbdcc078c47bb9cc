"""The model card of a trained drafter: ``README.md`` rendered from ``card.json``
(:func:`write_model_card`), and the card fields ``dspine train`` fills in (data kinds,
hardware, warm-start lineage).
"""
from __future__ import annotations

import json
import platform
from pathlib import Path

import torch


_OLD_DATA_SUMMARY = ("target-regenerated responses plus teacher-forcing text from training stdlib modules "
                     "and ShareGPT")  # cards written before data_summary existed


def _data_summary(data_dirs) -> str:
    """What kinds of sequences a --data list holds, for the model card: target-regenerated
    responses (`dspine data build`) and/or teacher-forcing text (`dspine data text`)."""
    from dspine.data.store import read_manifest

    kinds = set()
    for d in data_dirs:
        try:
            kinds.add("text" if (read_manifest(Path(d)) or {}).get("kind") == "text" else "build")
        except Exception:  # noqa: BLE001 (the card is informational; loading already checked the data)
            kinds.add("?")
    parts = (["target-regenerated responses"] if "build" in kinds else []) + \
            (["teacher-forcing text"] if "text" in kinds else [])
    return " plus ".join(parts) if parts and "?" not in kinds else "data of unknown kind"


def _schedule(ratio, schedule: str = "cosine") -> str:
    """The learning-rate schedule for the model card (--lr-schedule, --min-lr-ratio); empty
    when the card does not record a number."""
    if schedule == "constant":
        return "(constant after warmup)"
    if isinstance(ratio, bool) or not isinstance(ratio, (int, float)):
        return ""
    return "(cosine down to 0)" if ratio == 0 else f"(cosine down to {ratio:g} x lr)"


def _subset_text(subset, vocab) -> str:
    """The card's vocabulary subset: ``all`` when it is off or spans the vocabulary."""
    if not subset or (isinstance(vocab, int) and isinstance(subset, int) and subset >= vocab):
        return "all"
    return str(subset)


def _card_command(cmd) -> str:
    """A card's command entry: ``"cmd"`` or ``{"cmd": ..., "note": ...}`` (note kept out of the code span)."""
    if isinstance(cmd, dict):
        return f"`{cmd.get('cmd')}`" + (f" ({cmd['note']})" if cmd.get("note") else "")
    return f"`{cmd}`"


def write_model_card(ckpt: str | Path) -> Path:
    """Render ``README.md`` (the model card) of a checkpoint from its ``card.json``.

    Leads with the total training (all warm-started runs), then this run's data,
    commands and settings, the lineage of earlier runs when ``card.json`` lists one
    (``lineage``: dicts with ``commit``, ``steps``, ``total_steps``, ``data_sequences``,
    ``data_response_tokens``, ``tau_code``, ``tau_chat``), and the held-out acceptance.
    Returns the path of the written ``README.md``. Optional fields that are missing or
    null are left out.

    Raises:
        ValueError: ``card.json`` / ``config.json`` is not a JSON object or lacks a field
            the card needs (``target``, ``mode``; ``bridge``, ``block_size``,
            ``num_layers``, ``target_hidden``, ``feature_layers``), naming file and field.
    """
    from dspine.drafter.checkpoint import read_card
    from dspine.train.checkpoints import TrainerCheckpoints

    ckpt = Path(ckpt)
    c = read_card(ckpt)  # ConfigError (a ValueError) when damaged or not an object
    cfg = json.loads((ckpt / "config.json").read_text())
    for name, d, keys in (("card.json", c, ("target", "mode")),
                          ("config.json", cfg, ("bridge", "block_size", "num_layers", "target_hidden",
                                                "feature_layers"))):
        if not isinstance(d, dict):
            raise ValueError(f"{ckpt / name} is not a JSON object; cannot render the model card")
        missing = [k for k in keys if d.get(k) is None]
        if missing:
            raise ValueError(f"{ckpt / name} lacks {', '.join(missing)}; cannot render the model card")
    acc = c.get("heldout_acceptance_greedy_fp32") or {}
    tc = c.get("train_config") or {}
    sched = {**TrainerCheckpoints.LEGACY_DEFAULTS, **tc}
    total = c.get("total_steps") or c.get("steps")
    total_wall = c.get("total_wall_time_s") or c.get("wall_time_s")
    lines = [
        f"# {c['target']} {c['mode']} drafter", "",
        f"Drafter for target `{c['target']}` ({'DSpine: bridge + final stage, causal block' if cfg['bridge'] else 'DFlash-style: no bridge, no final stage, bidirectional block'}), "
        f"block size {cfg['block_size']}, {cfg['num_layers']} layers, hidden {cfg['target_hidden']}, "
        f"feature layers {cfg['feature_layers']}. Weights bf16 (`model.safetensors`), config in `config.json`.", "",
        f"**{total} training steps in all** ({total_wall} s of training); " + (
            f"held-out τ {acc.get('tau_code')} (code) / {acc.get('tau_chat')} (chat), see below."
            if acc.get("tau_code") is not None else "held-out τ not measured by this run (see below)."), "",
        "## Training (last run)", "",
        f"- data: {', '.join(map(str, c.get('data') or []))} — {c.get('data_sequences')} sequences, "
        f"{c.get('data_response_tokens')} response tokens ({c.get('data_summary', _OLD_DATA_SUMMARY)}; "
        "held-out sets excluded, see `src/dspine/data/splits.json`)",
        *([f"- ran: {_card_command(cmd)}" for cmd in c.get("data_commands") or []]),
        f"- steps: {c.get('steps')} (batch {tc.get('batch_size')} sequences x {tc.get('anchors_per_seq')} anchors, "
        f"max length {tc.get('max_len')}, lr {tc.get('lr')} "
        f"{_schedule(sched['min_lr_ratio'], sched['lr_schedule']) if tc else ''}, "
        f"warmup {tc.get('warmup')}, vocab subset "
        f"{_subset_text(tc.get('vocab_subset'), cfg.get('vocab_size'))}, bf16 autocast {tc.get('autocast_bf16')})",
        *([f"- the data grew during the run: " + ", ".join(f"{h.get('sequences')} sequences from step {h.get('step')}"
                                                          for h in c["data_history"])]
          if isinstance(c.get("data_history"), list) and len(c["data_history"]) > 1
          and all(isinstance(h, dict) for h in c["data_history"]) else []),
        *([f"- soft labels: the target's top {tc['soft_topk']} next-token probabilities, weight "
           f"{tc.get('soft_weight')} in each row's CE"] if tc.get("soft_topk") else []),
        *([f"- stopped by --time-limit {tc.get('time_limit')} s at step {c.get('steps')} of {tc.get('steps')} "
           f"(--resume continues the schedule)"] if c.get("stopped_by_time_limit") else []),
        *([f"- warm-started from {c['init_from']} ({c.get('parent_steps')} steps before this run)"]
          if c.get("init_from") else []),
        *([f"- continued from step {c['continued_from'].get('step')} of the run exported in "
           f"{c['continued_from'].get('path')} (`--continue-from`; the steps above count from that run's "
           f"start; optimizer moments rebuilt from {c['continued_from'].get('moments_rebuilt_from_steps')} steps)"]
          if isinstance(c.get("continued_from"), dict) else []),
        f"- wall time: {c.get('wall_time_s')} s on {c.get('hardware')}, world size {c.get('world_size')}",
    ]
    lin = c.get("lineage") or []
    if lin:
        lines += ["", "## Lineage (each run warm-started from the one before)", "",
                  "| commit | steps | total steps | sequences | response tokens | τ code | τ chat | prompts per set |",
                  "|---|---|---|---|---|---|---|---|"]
        lines += [f"| {r.get('commit')} | {r.get('steps')} | {r.get('total_steps')} | {r.get('data_sequences')} | "
                  f"{r.get('data_response_tokens')} | {r.get('tau_code')} | {r.get('tau_chat')} | "
                  f"{r.get('n_prompts', '–')} |" for r in lin]
    target_opt = "" if c["target"] == "smollm2-135m" else f"--target {c['target']} "
    lines += ["", "## Held-out acceptance (greedy, float32, engine loop, the drafter alone, chains)", ""]
    if acc.get("tau_code") is not None or acc.get("tau_chat") is not None:
        lines += [
            f"- code completion (held-out stdlib modules): tau = {acc.get('tau_code')} over {acc.get('n_code')} prompts",
            f"- chat (held-out ShareGPT prompts): tau = {acc.get('tau_chat')} over {acc.get('n_chat')} prompts"]
    else:
        lines += ["- not measured by this run (`--eval-prompts 0`)"]
    lines += [
        "", "tau counts tokens emitted per cycle, bonus/correction included (1.0 = nothing accepted).",
        f"Measure {'again' if acc.get('tau_code') is not None else 'it'} with `dspine acceptance {target_opt}"
        f"--drafter <this dir> --sets code chat --n {acc.get('n_code') or 32} "
        f"--max-new-tokens {acc.get('max_new_tokens', 64)}`.", ""]
    (ckpt / "README.md").write_text("\n".join(lines))
    return ckpt / "README.md"


def _warm_start_fields(init_from, steps: int, wall: float) -> dict:
    """Card fields for a warm-started run: the parent card and cumulative steps/wall time."""
    if not init_from:
        return {}
    from dspine.drafter.checkpoint import read_card

    parent = read_card(init_from)
    return {"init_from": str(init_from), "parent_steps": parent.get("steps"),
            "total_steps": steps + int(parent.get("total_steps") or parent.get("steps") or 0),
            "total_wall_time_s": round(wall + float(parent.get("total_wall_time_s") or parent.get("wall_time_s") or 0), 1)}


def _hardware(device: torch.device) -> str:
    """Where a run trained, for the model card (CPU threads or the GPU's name)."""
    if device.type == "cuda":
        return f"{torch.cuda.get_device_name(device)} (cuda)"
    return f"{platform.machine()} {torch.get_num_threads()} threads, cpu"
