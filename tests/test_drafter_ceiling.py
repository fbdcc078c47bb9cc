"""benchmarks/drafter_ceiling.py: its n-gram tables and bucketed summary (nothing timed)."""
from types import SimpleNamespace

from conftest import load_script


def _module():
    return load_script("benchmarks/drafter_ceiling.py")


def test_ngram_tables_keep_the_most_frequent_answer_continuation():
    dc = _module()
    seq = lambda ids, rs: SimpleNamespace(input_ids=ids, response_start=rs)  # noqa: E731
    # answers: after 5 comes 6 three times and 7 twice; after (4, 5) comes 7 twice; (8, 9) -> 1 only
    # inside a prompt
    data = [seq([8, 9, 1, 4, 5, 7], 3), seq([8, 9, 1, 4, 5, 7], 3), seq([0, 3, 5, 6, 5, 6, 5, 6], 1)]
    big, tri = dc.ngram_tables(data, 10)
    assert big[5] == 6 and big[4] == 5 and big[8] == -1
    assert tri[4 * 10 + 5] == 7 and tri[6 * 10 + 5] == 6
    assert 8 * 10 + 9 not in tri and tri[9 * 10 + 1] == 4  # continuations of answer tokens only


def test_summary_buckets_by_the_targets_confidence():
    dc = _module()
    recs = [{"p1": p, "row1": r, "lens29": r or p > 0.9} for p, r in
            ((0.1, False), (0.2, True), (0.95, True), (0.99, False), (0.6, True))]
    s = dc.summarize(recs, [29])
    assert s["positions"] == 5 and s["row1"] == 0.6
    b = {tuple(x["p1"]): x for x in s["buckets"]}
    assert b[(0.0, 0.3)]["share"] == 0.4 and b[(0.0, 0.3)]["row1"] == 0.5
    assert b[(0.9, 1.0)]["row1"] == 0.5 and b[(0.9, 1.0)]["lens29"] == 1.0
    assert b[(0.3, 0.5)]["row1"] is None and b[(0.3, 0.5)]["share"] == 0.0
