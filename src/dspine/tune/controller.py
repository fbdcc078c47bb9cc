"""Building a controller by name where an engine is built: the ``cost`` policy measures its
cost curve on this machine once (:func:`dspine.tune.cost.measure_cost`, cached) and may
start from the acceptance profile an earlier run saved (spec section 5).
"""
from __future__ import annotations

import torch

from dspine.config import VERIFY_POLICIES, ConfigError
from dspine.control.base import Controller, FixedPolicy
from dspine.control.cost_curve import CostCurve, copy_cost
from dspine.control.per_source import PerSourcePolicy
from dspine.control.policy import CostModelPolicy
from dspine.tune.cost import measure_cost

POLICIES = VERIFY_POLICIES


def profile_key(target, proposer) -> str | None:
    """Key of the persisted acceptance profile of ``target`` + ``proposer`` (a digest of
    the drafter's config and weights, the target's name and dtype), or None for
    proposers without a drafter."""
    import hashlib

    drafter = getattr(proposer, "drafter", None)
    if drafter is None:
        return None
    h = hashlib.sha256(drafter.cfg.to_json().encode())
    h.update(f"{target.name}|{target.dtype}|{target.vocab_size}".encode())
    if getattr(proposer, "ngram", None) is not None:  # a hybrid's drafter sees only non-copy contexts
        h.update(b"|hybrid")
    with torch.no_grad():
        for name, p in sorted(drafter.named_parameters()):
            h.update(name.encode())
            h.update(p.detach().flatten()[:256].float().cpu().numpy().tobytes())
    return "profile:" + h.hexdigest()[:20]


def _sources(proposer) -> list[str]:
    """The proposer sources a policy has to price, the drafter's (default) first."""
    return ["draft"] if proposer is None else list(proposer.sources)


def make_policy(name: str, target=None, proposer=None, n_max: int | None = None,
                cost: CostCurve | None = None, progress: bool = False, persist: bool = False) -> Controller:
    """Build a policy by name: ``fixed`` or ``cost`` (measures the cost curve of
    ``target`` + ``proposer`` unless ``cost`` is given). ``persist``: the cost policy
    starts from the acceptance profile saved by an earlier run on this machine
    (:func:`load_profile`) and remembers its key (``profile_key``) so the caller can
    :func:`save_profile` at the end.

    Raises:
        ConfigError: unknown name (naming ``SpeculativeConfig.verify_policy`` and the accepted
            values), or ``cost`` without a target.
    """
    if name == "fixed":
        return FixedPolicy()
    if name == "cost":
        if cost is None:
            if target is None:
                raise ConfigError("SpeculativeConfig.verify_policy cost needs a target to measure the cost curve",
                                  field="verify_policy")
            if n_max is None:
                n_max = (getattr(proposer, "block_size", 16) - 1) if proposer is not None else 0
            drafting = getattr(proposer, "drafter_proposer", proposer)  # a hybrid: its drafter's cost
            if drafting is not None and getattr(drafting, "drafter", None) is None \
                    and getattr(drafting, "source", "") == "ngram":
                drafting = None  # copies cost only the verification
            cost = measure_cost(target, drafting, n_max=n_max, progress=progress)
        sources = _sources(proposer)
        pols = {s: CostModelPolicy(copy_cost(cost) if s.startswith("ngram") or s == "cache" else cost,
                                   source=s if len(sources) > 1 else None)
                for s in sources}
        pol = pols[sources[0]]
        pol.profile_key = profile_key(target, proposer) if persist and target is not None else None
        if pol.profile_key is not None:
            load_profile(pol, pol.profile_key, str(target.device))
        return pol if len(pols) == 1 else PerSourcePolicy(pols, sources[0])
    raise ConfigError(f"SpeculativeConfig.verify_policy {name!r} is unknown; accepted: {', '.join(POLICIES)}",
                      field="verify_policy")


def load_profile(policy: CostModelPolicy, key: str, device: str = "cpu") -> bool:
    """Restore ``policy``'s acceptance profile saved under ``key`` in this machine's tune
    cache (:meth:`CostModelPolicy.restore_profile`); False when there is none or it is damaged."""
    from dspine.tune import store

    return policy.restore_profile(store.get(key, device))


def save_profile(policy, key: str, device: str = "cpu") -> None:
    """Save ``policy``'s acceptance profile (:meth:`CostModelPolicy.profile`) under ``key``.

    Raises:
        OSError: the cache cannot be written.
    """
    from dspine.tune import store
    from dspine.tune.conditions import conditions

    store.put(key, {**policy.profile(), **conditions(None, None)}, device)  # when, under what load
