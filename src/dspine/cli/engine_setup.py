"""The engine of a drafter mode, put together as ``dspine generate`` does.

``generate`` and ``serve`` (:func:`dspine.cli.main.build_engine`) and ``bench``
(:class:`dspine.bench.runners.EngineRunner`) all build theirs here, so that a benchmark
times what users run: the drafter's measured linears, draft vocabulary and candidate-pass
kernel, the proposer, and the verification policy and draft tree given to the engine when
it is built (the tree's cost sizing and the tree gate read the policy's cost curve then).
"""
from __future__ import annotations


def drafter_engine(target, model, drafter_path: str | None, mode: str, *, proposer: str = "hybrid",
                   verify_policy: str = "cost", tree=None, head_kernel: str = "auto",
                   drafter_linears: str = "auto", draft_vocab: str = "auto", ngram_max: int = 4,
                   ngram_min: int = 1, ngram_cache_tokens: int = 0, copy_bonus: float | None = None,
                   progress: bool = False, persist: bool = False):
    """An :class:`~dspine.core.engine.Engine` for ``mode`` (``dflash`` / ``dspine``) over
    ``target`` with the loaded drafter ``model`` (from ``drafter_path``, a checkpoint
    directory, or None / ``random`` for an untrained one).

    ``proposer``: :data:`dspine.proposers.PROPOSERS`; ``verify_policy``: ``fixed`` or
    ``cost`` (:func:`dspine.control.policy.make_policy`, which measures the cost curve once per
    machine; ``progress`` says so on stderr, ``persist`` starts from the saved acceptance
    profile); ``tree``: a :class:`dspine.trees.TreeSpec` or None (chains);
    ``head_kernel`` / ``drafter_linears`` / ``draft_vocab``: see
    :class:`dspine.proposers.drafter.DrafterProposer` and :mod:`dspine.drafter.vocab`;
    ``ngram_*`` / ``copy_bonus``: :func:`dspine.proposers.make_proposer`.

    Raises:
        EngineError: a drafter setting that cannot run here, naming the setting.
    """
    import torch

    from dspine.drafter.vocab import DraftVocabError, resolve as resolve_vocab
    from dspine.core.engine import Engine, EngineError
    from dspine.control.policy import make_policy
    from dspine.proposers import make_proposer
    from dspine.proposers.drafter import DrafterProposer

    path = None if drafter_path in (None, "random") else drafter_path
    with torch.no_grad():
        try:
            vocab = resolve_vocab(draft_vocab, path, model.cfg.vocab_size, model.cfg.head_topk)
            drafting = DrafterProposer(model, head_kernel=head_kernel, linears=drafter_linears, vocab=vocab)
            prop = make_proposer(proposer, drafting, ngram_max=ngram_max, ngram_min=ngram_min,
                                 cache_tokens=ngram_cache_tokens, copy_bonus=copy_bonus)
        except (DraftVocabError, ValueError) as e:
            raise EngineError(str(e)) from None
        policy = None if verify_policy == "fixed" else make_policy(verify_policy, target, prop,
                                                                   progress=progress, persist=persist)
        return Engine(target, prop, mode, verify_policy=policy, tree=tree)
