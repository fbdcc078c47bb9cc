"""The n-gram prior scored in the DSpine final stage's chain (``--ngram-prior``).

- the memory: counts of continuations after 1..6 tokens, the longest matching context
  wins, hashes equal between the vectorized build and the lookup, the cache follows the data;
- greedy: with the prior the drafter (alone and in the hybrid, single and batched) emits
  exactly the ``ar`` ids of the real default target, and the prior really changes proposals;
- sampling: exact-distribution test on a tiny random target, and a negative control that
  must fail: the chain sampled with the prior but verified with the q of the chain without it.
"""
from __future__ import annotations

import json
import random

import numpy as np
import pytest
import torch

from dspine.core.engine import Engine
from dspine.data.prior import prior_from_data, resolve_prior
from dspine.drafter.ngram_prior import NgramPrior, _key, _keys, compact_counts
from dspine.proposers import make_proposer
from dspine.proposers.drafter import DrafterProposer
from test_fused_copies import (M, PROMPT, _drafter, equal_ar_single_and_batched, exact, q_along,  # noqa: F401
                               shipped_dspine, tiny8)
from test_policy import sources_chi_square

pytestmark = pytest.mark.usefixtures("one_thread")


def test_counts_longest_context_and_hashes():
    seq = np.array([5, 6, 7, 8, -1, 5, 6, 9], dtype=np.int64)
    h, i = _keys(seq, 2)
    assert [int(x) for x in h] == [_key(tuple(int(t) for t in seq[j - 2:j])) for j in i]
    assert 5 not in i.tolist()  # no context spans the separator
    p = NgramPrior.build([([1, 2], [5, 6, 7, 5, 6, 9, 5, 6, 7])], beta=0)
    ids, ps = p.lookup([5, 6])
    assert ids == [7, 9] and ps == pytest.approx([2 / 3, 1 / 3])
    assert p.lookup([9, 5, 6]) == ([7], [1.0])  # the longer context decides
    assert p.lookup([42]) == ([], [])
    assert p.lookup([2]) == ([5], [1.0])  # the prompt's tail is context too
    assert p.chain([5], 4) == [6, 7, 5, 6]
    s = p.scores([5, 6], torch.tensor([7, 9, 3]))
    w, f = p.weight, p.floor
    assert s.tolist() == pytest.approx([w * np.log(2 / 3 + f), w * np.log(1 / 3 + f), w * np.log(f)], rel=1e-6)
    with pytest.raises(ValueError, match="weight"):
        NgramPrior.build([([1], [2, 3])], weight=-1.0)
    for bad in ({"row1_weight": 101.0}, {"beta": -1.0}, {"beta": float("nan")}, {"row1_weight": True}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            NgramPrior.build([([1], [2, 3])], **bad)


def test_smoothing_backs_off_over_every_held_context():
    rows = [([1, 2], [5, 6, 7, 5, 6, 9, 5, 6, 7]), ([0], [8, 6, 9])]
    p = NgramPrior.build(rows, beta=1.0)
    # P_1(. | 6) = (c + 0) / (4 + 1): 7 twice, 9 twice; P_2(. | 5 6) = (c + 1 * P_1) / (3 + 1)
    p1 = {7: 2 / 5, 9: 2 / 5}
    p2 = {7: (2 + p1[7]) / 4, 9: (1 + p1[9]) / 4}
    ids, ps = p.lookup([5, 6])
    assert ids == [7, 9] and ps == pytest.approx([p2[7], p2[9]])
    # the longest context (9 5 6 -> 7, seen once) no longer claims certainty
    ids, ps = p.lookup([9, 5, 6])
    assert ids[0] == 7 and ps[0] == pytest.approx((1 + p2[7]) / 2) and ps[1] == pytest.approx(p2[9] / 2)
    assert p.lookup([42]) == ([], []) and p.lookup([42, 6]) == p.lookup([6])  # 42 6 never held: (6) decides
    assert NgramPrior.build(rows, beta=0).lookup([9, 5, 6]) == ([7], [1.0])  # beta 0: the longest context alone


def test_counts_fit_16_bits_and_keep_their_shares():
    counts, totals = compact_counts(np.array([[70000, 50000], [3, 1]]), np.array([140000, 4]))
    assert counts.dtype == totals.dtype == np.uint16 and totals.tolist() == [65535, 4]
    assert counts[0] / totals[0] == pytest.approx([0.5, 50000 / 140000], abs=1e-4) and counts[1].tolist() == [3, 1]
    assert NgramPrior.build([([1], [2, 3, 2])]).ids.dtype == np.uint16
    wide = NgramPrior.build([([1], [70000, 2, 70000, 3])], beta=0)  # a vocabulary beyond 16 bits
    assert wide.ids.dtype == np.int32 and wide.lookup([70000]) == ([2, 3], [0.5, 0.5])


def test_row_1_has_its_own_weight():
    mem = NgramPrior.build([([1], [2, 3, 2, 3])], weight=1.0, row1_weight=0.0)
    prop = DrafterProposer.__new__(DrafterProposer)
    prop.prior = mem

    class State:
        tail = [1, 2]
    for row1, row1_scored in ((0.0, False), (1.0, True)):
        mem.row1_weight = row1
        _copy, score = prop._prior_parts(State(), 3, 4, None)
        s1 = score([], torch.tensor([2, 5]))  # row 1 after ... 1 2 | 3: the memory says 2
        assert bool(s1.any()) is row1_scored
        assert score([2], torch.tensor([3, 5]))[0] > score([2], torch.tensor([3, 5]))[1]  # row 2 always


def test_from_data_caches_by_content_and_resolve_refuses_other_data(tmp_path, monkeypatch):
    d = tmp_path / "data"
    d.mkdir()
    (d / "manifest.json").write_text(json.dumps({"target": "random:llama"}))
    (d / "data-00000.jsonl").write_text(json.dumps({"id": "a", "prompt_ids": [1], "response_ids": [2, 3, 2, 4]}) + "\n")
    cache = tmp_path / "cache"
    a = prior_from_data(d, cache, beta=0)
    assert a.lookup([2]) == ([3, 4], [0.5, 0.5]) and len(list(cache.glob("*.npz"))) == 1
    assert prior_from_data(d, cache, beta=0).lookup([2]) == a.lookup([2])  # read back
    (d / "data-00000.jsonl").write_text(json.dumps({"id": "a", "prompt_ids": [1], "response_ids": [2, 4]}) + "\n")
    assert prior_from_data(d, cache, beta=0).lookup([2]) == ([4], [1.0])  # other data: built again
    monkeypatch.setenv("DSPINE_HOME", str(tmp_path / "home"))
    assert resolve_prior("off", "random:llama") is None
    assert resolve_prior(str(d), "random:llama").lookup([2]) == ([4], [0.5])  # seen once: (1 + 0) / (1 + beta)
    with pytest.raises(ValueError, match="--ngram-prior .*not of 'smollm2-135m'"):
        resolve_prior(str(d), "smollm2-135m")
    with pytest.raises(ValueError, match="--ngram-prior .*no manifest.json"):
        resolve_prior(str(tmp_path), "random:llama")
    shard = d / "data-00000.jsonl"
    for damaged, why in (('{"prompt": "x"}', "line 1"), ('{"id": "a", "prompt_ids": [1], "response_ids": [1.5]}', "line 1"),
                         ("", "no answer tokens")):
        shard.write_text(damaged + ("\n" if damaged else ""))
        with pytest.raises(ValueError, match=f"--ngram-prior .*{why}"):
            resolve_prior(str(d), "random:llama")
    (d / "manifest.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match="--ngram-prior .*manifest.json is damaged"):
        resolve_prior(str(d), "random:llama")
    (d / "manifest.json").write_text(json.dumps({"target": "random:llama"}))
    with pytest.raises(ValueError, match="--ngram-prior .*no data shards"):
        shard.unlink()
        resolve_prior(str(d), "random:llama")


def test_the_table_refuses_other_vocabularies_and_rebuilds_a_broken_cache(tmp_path):
    from dspine.target.adapter import load_target

    tiny = load_target("random:llama")
    d = tmp_path / "data"
    d.mkdir()
    (d / "manifest.json").write_text(json.dumps({"target": tiny.name}))
    (d / "data-00000.jsonl").write_text(json.dumps({"id": "a", "prompt_ids": [1],
                                                    "response_ids": [2, tiny.vocab_size + 5]}) + "\n")
    with pytest.raises(ValueError, match="outside the target's vocabulary"):
        prior_from_data(d, tmp_path / "cache", vocab_size=tiny.vocab_size)
    (d / "data-00000.jsonl").write_text(json.dumps({"id": "a", "prompt_ids": [1], "response_ids": [2, 3]}) + "\n")
    prior_from_data(d, tmp_path / "cache")
    (cached,) = (tmp_path / "cache").glob("*.npz")
    cached.write_bytes(b"not a zip file")  # a damaged cache file is built again, not an error
    assert prior_from_data(d, tmp_path / "cache", beta=0).lookup([2]) == ([3], [1.0])
    with pytest.raises(ValueError, match="weight"):
        NgramPrior.build([([1], [2, 3])], weight=1e38)  # float32 scores would overflow


# -- greedy equality on the real target ------------------------------------------------------------
class CountingPrior(DrafterProposer):
    """Counts proposals that the prior changed (the same block without it proposes others)."""

    changed = 0

    def propose(self, state, anchor, anchor_pos, n, sampling, gen, copy=None, bonus=0.0):
        p = super().propose(state, anchor, anchor_pos, n, sampling, gen, copy=copy, bonus=bonus)
        prior, self.prior = self.prior, None
        try:
            plain = super().propose(state, anchor, anchor_pos, n, sampling, gen, copy=copy, bonus=bonus)
        finally:
            self.prior = prior
        CountingPrior.changed += int(not torch.equal(plain.tokens, p.tokens))
        return p


@pytest.fixture(scope="module")
def smol_prior(smol):
    from dspine.data.prior import committed_data_dir
    from dspine.data.load import load_dataset

    d = committed_data_dir("smollm2-135m")
    if d is None:
        pytest.skip("the repository's committed training data is not here")
    rows = load_dataset(d, smol)[:1500]
    return NgramPrior.build((s.input_ids[:s.response_start], s.input_ids[s.response_start:]) for s in rows)


def test_greedy_with_prior_equals_ar(smol, smol_prior, shipped_dspine):
    prompts = [smol.encode_prompt(t, chat=True) for t in ("Write a Python function that reverses a string.",
                                                          "What is the capital of France?")]
    CountingPrior.changed = 0
    equal_ar_single_and_batched(smol, prompts, CountingPrior(shipped_dspine, prior=smol_prior),
                                make_proposer("hybrid", DrafterProposer(shipped_dspine, prior=smol_prior)))
    assert CountingPrior.changed > 0  # the prior really changed what was proposed


# -- exact distribution (tiny random target: the fused-copy tests' target, prompt and drafter) --------
@pytest.fixture(scope="module")
def tiny_prior():
    rng = random.Random(0)  # a memory whose contexts match often and disagree with the drafter
    rows = [([0], [rng.choice([1, 2, 3, 3, 5, 6]) for _ in range(40)]) for _ in range(30)]
    return NgramPrior.build(rows, weight=2.0)


def test_distribution_with_prior(tiny8, exact, tiny_prior):
    eng = Engine(tiny8, DrafterProposer(_drafter(tiny8), prior=tiny_prior), "dspine")
    p, impossible, used = sources_chi_square(eng, PROMPT, M, exact, 300)
    assert impossible == 0
    assert p > 1e-3, p


class ForgetsPriorDrafter(DrafterProposer):
    """BROKEN: samples the chain with the prior but reports the q of the chain without it."""

    def propose(self, state, anchor, anchor_pos, n, sampling, gen, copy=None, bonus=0.0):
        p = super().propose(state, anchor, anchor_pos, n, sampling, gen, copy=copy, bonus=bonus)
        if p.q_probs is None:
            return p
        cand, T = self._last_tables
        p.q_probs = q_along(cand, T, p.tokens, sampling)
        return p

    def _tables(self, out, a, n, copy=None, bonus=0.0):
        self._last_tables = super()._tables(out, a, n, copy, bonus)
        return self._last_tables


def test_distribution_with_prior_wrong_q_fails(tiny8, exact, tiny_prior):
    """Negative control: the chi-square test must reject the chain verified without the prior's scores."""
    eng = Engine(tiny8, ForgetsPriorDrafter(_drafter(tiny8), prior=tiny_prior), "dspine")
    p, _, _ = sources_chi_square(eng, PROMPT, M, exact, 300)
    assert p < 1e-6, p


def test_settings_are_checked():
    from dspine.config import ConfigError, SpeculativeConfig

    for bad in (-1.0, float("nan"), True, "0.5"):
        with pytest.raises(ConfigError, match="SpeculativeConfig.ngram_prior_weight"):
            SpeculativeConfig(ngram_prior_weight=bad)
    with pytest.raises(ConfigError, match="SpeculativeConfig.ngram_prior"):
        SpeculativeConfig(ngram_prior="")
    assert SpeculativeConfig().ngram_prior == "off"


def test_cli_names_a_bad_prior_directory(tmp_path, capsys):
    from dspine.cli.main import main

    assert main(["generate", "hi", "--target", "random:llama", "--drafter", "random", "--max-new-tokens", "2",
                 "--ngram-prior", str(tmp_path), "--verify-policy", "fixed", "--threads", "1"]) == 2
    assert "--ngram-prior" in capsys.readouterr().err


def test_resolve_refuses_damaged_packed_data_text_data_and_a_manifest_without_tokenizer(tmp_path, monkeypatch):
    """The prior counts exactly the rows training would accept: a packed shard whose bytes
    differ from the manifest's sha256, one listed but missing, or one not listed is refused
    (as `dspine train` refuses it), and so are `dspine data text` directories (human text,
    not the target's answers) and a manifest that cannot be checked against the target."""
    from dspine.data.store import pack_dataset
    from dspine.data.tokenizer import tokenizer_fingerprint
    from dspine.target.adapter import load_target

    monkeypatch.setenv("DSPINE_HOME", str(tmp_path / "home"))
    target = load_target("random:llama")
    tok = tokenizer_fingerprint(target.tokenizer)
    d = tmp_path / "data"
    d.mkdir()
    (d / "manifest.json").write_text(json.dumps({"target": "random:llama", "tokenizer": tok}))
    (d / "data-00000.jsonl").write_text(json.dumps({"id": "a", "prompt_ids": [1], "response_ids": [2, 3, 2, 4]}) + "\n")
    pack_dataset(d)
    assert resolve_prior(str(d), target).lookup([2])[0]  # sound: built
    gz = d / "data-00000.jsonl.gz"
    good = gz.read_bytes()
    gz.write_bytes(good[:-1] + bytes([good[-1] ^ 1]))
    with pytest.raises(ValueError, match="--ngram-prior .*differs from the sha256"):
        resolve_prior(str(d), target)
    gz.write_bytes(good)
    (d / "data-00001.jsonl.gz").write_bytes(good)  # an extra packed shard nobody listed
    with pytest.raises(ValueError, match="--ngram-prior .*not listed"):
        resolve_prior(str(d), target)
    (d / "data-00001.jsonl.gz").unlink()
    man = json.loads((d / "manifest.json").read_text())
    for packed in ([], {"data-00000.jsonl.gz": "x"}):
        (d / "manifest.json").write_text(json.dumps({**man, "packed": packed}))
        with pytest.raises(ValueError, match="--ngram-prior .*'packed' must map"):
            resolve_prior(str(d), target)
    (d / "manifest.json").write_text(json.dumps({**man, "kind": "text"}))
    with pytest.raises(ValueError, match="--ngram-prior .*dspine data text"):
        resolve_prior(str(d), target)
    for tokenizer in (None, "abc"):
        (d / "manifest.json").write_text(json.dumps({**{k: v for k, v in man.items() if k != "tokenizer"},
                                                     **({"tokenizer": tokenizer} if tokenizer else {})}))
        with pytest.raises(ValueError, match="--ngram-prior .*names no tokenizer fingerprint"):
            resolve_prior(str(d), target)


def test_the_cache_keeps_the_most_recently_used_tables(tmp_path):
    """Data that grows writes a new table per change (~100 MB each for the committed data):
    the cache keeps the newest ``CACHE_KEEP`` by use and removes the rest."""
    import os
    import time as _time

    from dspine.data.prior import CACHE_KEEP, prune_cache

    cache = tmp_path / "cache"
    d = tmp_path / "data"
    d.mkdir()
    (d / "manifest.json").write_text(json.dumps({"target": "random:llama"}))
    made = []
    for k in range(CACHE_KEEP + 2):  # the data changes each time: a new table each time
        (d / "data-00000.jsonl").write_text(json.dumps({"id": "a", "prompt_ids": [1], "response_ids": [2, 3 + k]}) + "\n")
        prior_from_data(d, cache, beta=0)
        new = [f for f in cache.glob("ngram-prior-*.npz") if f not in made]
        assert len(new) == 1
        made += new
        os.utime(new[0], (_time.time() - 100 + k, _time.time() - 100 + k))  # distinct ages, oldest first
    left = sorted(cache.glob("ngram-prior-*.npz"))
    assert len(left) == CACHE_KEEP and set(left) == set(made[-CACHE_KEEP:])
    assert prune_cache(cache, n=1) == [made[-2]]  # the older of the two
    assert list(cache.glob("*.npz")) == [made[-1]]


def test_weight_zero_turns_the_prior_off(tmp_path, monkeypatch, capsys):
    """``--ngram-prior-weight 0`` is off, said on stderr: the table is not loaded, and the
    prior's continuation is not injected as a candidate (it used to be, changing proposals)."""
    from dspine.build import build_engine
    from dspine.config import SpeculativeConfig
    from dspine.data.tokenizer import tokenizer_fingerprint
    from dspine.target.adapter import load_target

    monkeypatch.setenv("DSPINE_HOME", str(tmp_path / "home"))
    d = tmp_path / "data"
    d.mkdir()
    tok = tokenizer_fingerprint(load_target("random:llama").tokenizer)
    (d / "manifest.json").write_text(json.dumps({"target": "random:llama", "tokenizer": tok}))
    (d / "data-00000.jsonl").write_text(json.dumps({"id": "a", "prompt_ids": [1], "response_ids": [2, 3, 2, 4]}) + "\n")
    on = SpeculativeConfig(target="random:llama", drafter="random", ngram_prior=str(d), proposer="drafter")
    _, eng = build_engine(on)
    assert eng.kernel_info().get("ngram_prior")
    _, eng = build_engine(SpeculativeConfig(**{**on.__dict__, "ngram_prior_weight": 0.0}))
    assert not eng.kernel_info().get("ngram_prior")
    assert "--ngram-prior-weight 0" in capsys.readouterr().err
