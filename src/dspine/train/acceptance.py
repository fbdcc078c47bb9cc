"""Held-out acceptance length tau of a drafter, measured with the real engine loop
(greedy): what ``dspine acceptance`` prints and ``dspine train`` records in the card.
"""
from __future__ import annotations

import torch


def measure_acceptance(target, drafter, sets=("code", "chat"), n: int = 8, max_new_tokens: int = 64,
                       progress: bool = False, proposer: str = "drafter", tree=None,
                       copy_bonus: float | None = None, vocab: torch.Tensor | None = None, prior=None) -> dict:
    """Held-out mean acceptance length tau per prompt set, by the engine loop (greedy).

    ``proposer``: ``drafter`` (the drafter alone, the default: what training improves),
    ``ngram`` or ``hybrid`` (:mod:`dspine.proposers`); with more than one source the
    result also holds ``sources_<set>`` (cycles, proposals, accepted per source).
    ``tree``: a :class:`dspine.trees.TreeSpec` to verify draft trees (the target must run the
    dense runtime); the result then also holds ``tree_nodes_<set>``, the mean nodes per cycle.
    ``copy_bonus``: the hybrid fuses copies into the final stage (``--copy-bonus``).
    ``vocab``: a draft vocabulary for the candidate pass (:mod:`dspine.drafter.vocab`; None = all).
    ``prior``: an n-gram prior scored in the final stage (:mod:`dspine.drafter.ngram_prior`).

    Returns ``{"tau_<set>": pooled tokens/cycle, "tau_<set>_per_prompt": [...],
    "row_accept_<set>": [...], "row_conditional_<set>": [...], "n_<set>": prompts}``, where
    ``row_accept[k-1]`` is the share of cycles verifying row k that accepted it (with a chain,
    rows < k were accepted too) and ``row_conditional[k-1]`` the share of cycles that verified row k with rows < k accepted which accepted row k (None where no cycle did). Prompts come from :func:`dspine.data.sources.heldout_prompts`
    (never trained on).
    """
    from dspine.data.tokenizer import encode_record
    from dspine.data.sources import heldout_prompts
    from dspine.tune.drafter import measured_proposer
    from dspine.core.engine import Engine
    from dspine.proposers import make_proposer

    was_training = drafter.training
    drafter.eval()
    eng = Engine(target, make_proposer(proposer, measured_proposer(drafter, linears="float32", vocab=vocab,
                                                                  progress=False, prior=prior),
                                       copy_bonus=copy_bonus),
                 drafter.cfg.mode, tree=tree)
    res = {}
    for s in sets:
        prompts = heldout_prompts(s, n)
        emitted = cycles = 0
        per, by_src, nodes = [], {}, []
        acc_k: list[float] = []  # per row k: cycles that accepted row k (pooled over prompts)
        drafted_k: list[int] = []  # per row k: cycles that drafted (verified) row k
        cycles_va: list[tuple[int, int]] = []  # per cycle: (verification length, proposals accepted)
        it = prompts
        if progress:
            from tqdm.auto import tqdm
            it = tqdm(prompts, desc=f"acceptance {s}")
        for rec in it:
            ids = encode_record(target, rec)[-768:]
            with torch.no_grad():
                r = eng.generate(ids, max_new_tokens=max_new_tokens)
            st = r.stats
            emitted += round(st.accepted_length_mean * st.cycles)  # tokens emitted by cycles
            cycles += st.cycles
            per.append(round(st.accepted_length_mean, 3))
            cycles_va += zip(st.verification_lengths, st.accepted_lengths)
            for k, rate in enumerate(st.accepted_per_position):
                d = sum(1 for v in st.verification_lengths if v > k)
                while len(acc_k) <= k:
                    acc_k.append(0.0)
                    drafted_k.append(0)
                acc_k[k] += rate * d
                drafted_k[k] += d
            nodes.extend(st.tree_nodes)
            for src, d in st.sources.items():
                agg = by_src.setdefault(src, {"cycles": 0, "proposed": 0, "accepted": 0, "emitted": 0})
                for k in agg:
                    agg[k] += d[k]
        res[f"tau_{s}"] = round(emitted / max(1, cycles), 4)
        if proposer != "drafter":
            res[f"sources_{s}"] = {k: {**d, "tau": round(d["emitted"] / max(1, d["cycles"]), 4)}
                                   for k, d in by_src.items()}
        res[f"tau_{s}_per_prompt"] = per
        # row k accepted among cycles that verified it (a chain: rows < k accepted too), and the
        # conditional rate given rows < k accepted, counted per cycle (conditional_rates)
        rates = [round(a / d, 4) if d else None for a, d in zip(acc_k, drafted_k)]
        res[f"row_accept_{s}"] = rates
        res[f"row_conditional_{s}"] = conditional_rates(cycles_va, len(rates))
        res[f"n_{s}"] = len(prompts)
        res["draft_tree"] = eng.tree_info()
        if nodes:
            res[f"tree_nodes_{s}"] = round(sum(nodes) / len(nodes), 2)
    res["max_new_tokens"] = max_new_tokens
    drafter.train(was_training)
    return res


def conditional_rates(cycles: list[tuple[int, int]], rows: int) -> list[float | None]:
    """Per row k = 1..``rows``: among cycles that verified row k with rows 1..k-1 accepted,
    the share that accepted row k (None where no cycle did). ``cycles``: (verification
    length, proposals accepted) per cycle, a chain's or a tree's path. Counted per cycle: the
    ratio of two rows' pooled rates is not this, since fewer cycles verify the later rows
    (near a request's end, or when the policy verifies fewer) and can exceed 1."""
    out: list[float | None] = []
    for k in range(rows):
        reached = [a for v, a in cycles if v > k and a >= k]
        out.append(round(sum(1 for a in reached if a > k) / len(reached), 4) if reached else None)
    return out
