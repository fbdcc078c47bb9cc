"""Build an engine from a :class:`~dspine.config.SpeculativeConfig` (every command does).

:func:`build_engine` checks the settings before anything is loaded, loads the target and
the drafter, runs the per-machine measurements (``tune``: kernels, the cycle cost curve)
once, here, and returns the :class:`~dspine.core.engine.Engine`. ``generate``, ``serve``,
``tune`` and the fair benchmark build theirs through it (the bench through
:func:`drafter_engine`), so a benchmark times what users run.
"""
from __future__ import annotations

from pathlib import Path

from dspine.config import ConfigError, SpeculativeConfig

#: the drafters shipped with the package, ``<target>-<mode>/``
DEFAULT_CHECKPOINTS = Path(__file__).resolve().parent / "checkpoints"


def default_drafter_path(target: str, mode: str) -> Path | None:
    """Shipped drafter for a named target and mode, or None when none is shipped."""
    p = DEFAULT_CHECKPOINTS / f"{target}-{mode}"
    return p if (p / "config.json").exists() else None


def _refuse(field: str, value, accepted) -> ConfigError:
    return ConfigError(f"SpeculativeConfig.{field} {value!r} is unknown; accepted: {', '.join(accepted)}", field=field)


def check_installed_choices(config: SpeculativeConfig) -> None:
    """The settings whose accepted values depend on this installation (kernels, runtimes,
    draft vocabularies, copy limits), checked before anything is loaded.

    Raises:
        ConfigError: naming the field (:attr:`ConfigError.field`) and the value.
    """
    from dspine.drafter.vocab import CHOICES as VOCAB_CHOICES
    from dspine.proposers import check_copy_settings
    from dspine.proposers.ngram import NgramIndex
    from dspine.runtime.packed import LINEAR_BACKENDS
    from dspine.runtime.select import RUNTIMES
    from dspine.runtime.weights import TARGET_WEIGHTS
    from dspine.drafter.candidate_pass import HEAD_KERNELS

    c = config
    if c.draft_vocab not in VOCAB_CHOICES:
        raise _refuse("draft_vocab", c.draft_vocab, VOCAB_CHOICES)
    if c.ngram_max > NgramIndex.MAX_NGRAM:
        raise ConfigError(f"SpeculativeConfig.ngram_max {c.ngram_max} must be in 1..{NgramIndex.MAX_NGRAM}",
                          field="ngram_max")
    check_copy_settings(c.proposer, c.mode, c.ngram_cache_tokens, c.ngram_max, c.copy_bonus)  # ConfigError, field set
    if c.head_kernel not in ("auto", *HEAD_KERNELS):
        raise _refuse("head_kernel", c.head_kernel, ("auto", *HEAD_KERNELS))
    if c.linear_backend not in ("auto", *LINEAR_BACKENDS):
        raise _refuse("linear_backend", c.linear_backend, ("auto", *LINEAR_BACKENDS))
    if c.runtime not in ("auto", *RUNTIMES):
        raise _refuse("runtime", c.runtime, ("auto", *RUNTIMES))
    if c.target_weights not in TARGET_WEIGHTS:
        raise _refuse("target_weights", c.target_weights, TARGET_WEIGHTS)


def tree_spec(config: SpeculativeConfig):
    """The :class:`dspine.trees.TreeSpec` of ``config``'s tree fields.

    Raises:
        ConfigError: a shape that does not parse, naming ``tree_shape``.
    """
    from dspine.trees.tree import TreeSpec, parse_tree_shape

    return TreeSpec(config.tree_budget, parse_tree_shape(config.tree_shape), size=config.tree_size)


def check_drafter_setting(config: SpeculativeConfig) -> str | None:
    """The drafter checkpoint ``config`` asks for (a path, ``random``, or None for ``ar`` and
    copies only), checked before any model is loaded: a shipped drafter exists for the
    target and mode, a given path exists.

    Raises:
        ConfigError: no shipped drafter, or a missing checkpoint path (field ``drafter``).
        TargetError: an unknown target name (before the drafter is looked for).
    """
    c = config
    if c.mode == "ar" or c.proposer == "ngram":
        return None
    if c.drafter is None:
        from dspine.target.registry import check_target_name

        check_target_name(c.target)  # an unknown target says so, not "no shipped drafter for it"
        path = default_drafter_path(c.target, c.mode)
        if path is None:
            raise ConfigError(f"SpeculativeConfig.drafter: no shipped {c.mode} drafter for target {c.target!r}; "
                              f"give a trained checkpoint's path or 'random'", field="drafter")
        return str(path)
    if c.drafter != "random" and not Path(c.drafter).exists():
        raise ConfigError(f"SpeculativeConfig.drafter {c.drafter!r}: no such checkpoint directory", field="drafter")
    return c.drafter


def build_engine(config: SpeculativeConfig | None = None, *, progress: bool = False):
    """Load target + drafter as ``config`` says and return ``(target, engine)``.

    ``config``: :class:`SpeculativeConfig` (None: every default, as ``dspine generate``).
    ``progress``: say on stderr when a one-time measurement runs. Settings the runtime has
    not validated are refused before anything is loaded, and again against the loaded
    target and drafter (:func:`dspine.guards.validate_runtime`).

    Raises:
        ConfigError: a setting out of range or not installed here, naming the field.
        ValueError subclasses naming the setting: an unknown target or drafter, a drafter
            of the other mode, and the guards' :class:`~dspine.guards.GuardError`.
    """
    import torch

    from dspine.tune.controller import make_policy
    from dspine.core.engine import Engine, EngineError
    from dspine.drafter.checkpoint import load_drafter, random_drafter
    from dspine.guards import resolve_device, validate_runtime
    from dspine.proposers import make_proposer
    from dspine.runtime.packed import apply_linear_backend
    from dspine.runtime.select import apply_runtime
    from dspine.runtime.weights import quantize_target
    from dspine.target.adapter import load_target, parse_dtype

    c = config if config is not None else SpeculativeConfig()
    check_installed_choices(c)
    tree = tree_spec(c)
    device = str(resolve_device("auto")) if c.device == "auto" else c.device  # as `dspine train --device auto`
    validate_runtime(None, None, dtype=c.dtype, device=device, concurrency=c.concurrency,
                     verify_policy=c.verify_policy)  # settings alone, before loading anything
    drafter = check_drafter_setting(c)
    dt = parse_dtype(c.dtype)
    guard = dict(dtype=dt, device=device, concurrency=c.concurrency, verify_policy=c.verify_policy)
    target = load_target(c.target, dtype=dt, device=device)

    def set_up_target():  # after the guards' checks; the runtime first, so the backend is timed under it
        try:
            quantize_target(target, c.target_weights)  # opt-in: the quantized target is then the reference
            apply_runtime(target, c.runtime)
        except ValueError as e:
            raise EngineError(str(e), field=getattr(e, "field", None)) from None
        apply_linear_backend(target, c.linear_backend, progress=progress)

    if c.mode == "ar":
        validate_runtime(target, None, **guard)
        set_up_target()
        return target, Engine(target, None, "ar")
    if c.proposer == "ngram":  # copies only: no drafter is loaded
        validate_runtime(target, None, **guard)
        set_up_target()
        prop = make_proposer("ngram", None, block_size=16 if c.block_size is None else c.block_size,
                             ngram_max=c.ngram_max, ngram_min=c.ngram_min, cache_tokens=c.ngram_cache_tokens)
        with torch.no_grad():
            policy = None if c.verify_policy == "fixed" else make_policy(c.verify_policy, target, prop,
                                                                         progress=progress)
        return target, Engine(target, prop, c.mode, verify_policy=policy)
    if drafter == "random":
        model = random_drafter(target, mode=c.mode, block_size=16 if c.block_size is None else c.block_size,
                               seed=c.seed, dtype=dt)
    else:
        model = load_drafter(drafter, target, dtype=dt, block_size=c.block_size, option="SpeculativeConfig.drafter")
        if model.cfg.bridge != (c.mode == "dspine"):
            raise ConfigError(f"SpeculativeConfig.mode {c.mode!r} does not match drafter {drafter} "
                              f"(trained as {model.cfg.mode})", field="mode")
    validate_runtime(target, model.cfg, block_size=c.block_size, **guard)
    set_up_target()
    return target, drafter_engine(target, model, drafter, c.mode, proposer=c.proposer, verify_policy=c.verify_policy,
                                  tree=tree, head_kernel=c.head_kernel, drafter_linears=c.drafter_linears,
                                  draft_vocab=c.draft_vocab, ngram_max=c.ngram_max, ngram_min=c.ngram_min,
                                  ngram_cache_tokens=c.ngram_cache_tokens, copy_bonus=c.copy_bonus,
                                  progress=progress, persist=c.persist, ngram_prior=c.ngram_prior,
                                  ngram_prior_weight=c.ngram_prior_weight)


def drafter_engine(target, model, drafter_path: str | None, mode: str, *, proposer: str, verify_policy: str,
                   tree, head_kernel: str, drafter_linears: str, draft_vocab: str, ngram_max: int,
                   ngram_min: int, ngram_cache_tokens: int, copy_bonus: float | None,
                   progress: bool = False, persist: bool = False, ngram_prior: str = "off",
                   ngram_prior_weight: float = 0.5):
    """An :class:`~dspine.core.engine.Engine` for ``mode`` (``dflash`` / ``dspine``) over
    ``target`` with the loaded drafter ``model`` (from ``drafter_path``, a checkpoint
    directory, or None / ``random`` for an untrained one).

    ``proposer``: :data:`dspine.proposers.PROPOSERS`; ``verify_policy``: ``fixed`` or
    ``cost`` (:func:`dspine.tune.controller.make_policy`, which measures the cost curve once per
    machine; ``progress`` says so on stderr, ``persist`` starts from the saved acceptance
    profile); ``tree``: a :class:`dspine.trees.TreeSpec` or None (chains);
    every setting is a :class:`~dspine.config.SpeculativeConfig` field of the same name
    (its defaults are there); ``head_kernel`` / ``drafter_linears`` / ``draft_vocab``: see
    :class:`dspine.proposers.drafter.DrafterProposer` and :mod:`dspine.drafter.vocab`;
    ``ngram_*`` / ``copy_bonus``: :func:`dspine.proposers.make_proposer`; ``ngram_prior`` /
    ``ngram_prior_weight``: :func:`dspine.data.prior.resolve_prior` (DSpine drafters).

    Raises:
        EngineError: a drafter setting that cannot run here, naming the setting.
    """
    import torch

    from dspine.data.prior import resolve_prior
    from dspine.drafter.vocab import DraftVocabError, resolve as resolve_vocab
    from dspine.core.engine import Engine, EngineError
    from dspine.tune.controller import make_policy
    from dspine.proposers import make_proposer
    from dspine.tune.drafter import measured_proposer

    path = None if drafter_path in (None, "random") else drafter_path
    with torch.no_grad():
        try:
            vocab = resolve_vocab(draft_vocab, path, model.cfg.vocab_size, model.cfg.head_topk)
            prior = (resolve_prior(ngram_prior, target, ngram_prior_weight)
                     if model.cfg.final_stage and ngram_prior_weight > 0 else None)
            if ngram_prior != "off" and prior is None:  # said, not silently dropped
                import sys

                why = ("the DFlash-style drafter has no final stage to score" if not model.cfg.final_stage else
                       "--ngram-prior-weight 0 (the table would be loaded for nothing)" if ngram_prior_weight <= 0 else
                       f"no committed training data for target {target.name!r} (give a data directory)")
                print(f"dspine: note: --ngram-prior {ngram_prior} is off: {why}", file=sys.stderr, flush=True)
            drafting = measured_proposer(model, head_kernel=head_kernel, linears=drafter_linears, vocab=vocab,
                                         progress=progress, prior=prior)
            prop = make_proposer(proposer, drafting, ngram_max=ngram_max, ngram_min=ngram_min,
                                 cache_tokens=ngram_cache_tokens, copy_bonus=copy_bonus)
        except (DraftVocabError, ValueError) as e:
            raise EngineError(str(e), field=getattr(e, "field", None)) from None
        policy = None if verify_policy == "fixed" else make_policy(verify_policy, target, prop,
                                                                   progress=progress, persist=persist)
        return Engine(target, prop, mode, verify_policy=policy, tree=tree)
