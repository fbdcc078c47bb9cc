"""Teacher-forced check of an n-gram memory against the block drafter's rows (the prototype
behind ``--ngram-prior``; docs/decisions.md, "An n-gram memory in the final stage").

The target's greedy answers to N held-out code and chat prompts (NEW tokens each); at every
answer anchor the shipped DSpine drafter's continuous logits of rows 1-4 (top 16 over its draft
vocabulary), and counts of the target's continuations after the same 1-6 tokens in the
committed training data; prints the share of anchors whose rows 1..k are all right for the
drafter alone, the memory alone and the two summed (log-softmax + weight * log(P + 0.001),
with or without the memory's own token joining the candidates). Acceptance only: the
machine and its load do not matter.

    python benchmarks/ngram_prior_prototype.py 32 128
"""
import sys, time, json, gzip, glob, math, collections, pickle, os
sys.path.insert(0, str(__import__('pathlib').Path(__file__).resolve().parent))
import torch
torch.set_num_threads(1)
from drafter_diagnosis import greedy_answers, features
from dspine.build import default_drafter_path
from dspine.drafter.checkpoint import load_drafter
from dspine.drafter.vocab import resolve
from dspine.target.adapter import load_target

N = int(sys.argv[1]); NEW = int(sys.argv[2])
target = load_target("smollm2-135m", dtype="float32")
cache = f'/tmp/ngram-prior-answers-{N}-{NEW}.pkl'
if os.path.exists(cache):
    ev = pickle.load(open(cache, 'rb'))
else:
    ev = {k: greedy_answers(target, k, N, NEW) for k in ("code", "chat")}
    pickle.dump(ev, open(cache, 'wb'))
print('answers', {k: sum(len(s)-r for s, r in v) for k, v in ev.items()}, flush=True)
d = load_drafter(default_drafter_path("smollm2-135m", "dspine"), target).eval()
vocab = resolve("auto", str(default_drafter_path("smollm2-135m", "dspine")), d.cfg.vocab_size, d.cfg.head_topk)
layers = list(d.cfg.feature_layers)
feats = {k: features(target, v, layers, False) for k, v in ev.items()}
H = d.head[vocab]
ROWS = 4; TOPK = 16
# drafter per-anchor top-16 candidates and log-softmax scores per row
drafts = {}
for k, seqs in ev.items():
    out = []
    for (ids, rs), f in zip(seqs, feats[k]):
        T = len(ids); a = torch.arange(max(rs, 1), T - 1)[None]
        ids_t = torch.tensor([ids]); pos = torch.arange(T)[None]
        with torch.no_grad():
            ctx = d.context_kv(f[None].float(), pos)
            o = d.forward_blocks(ids_t[:, a[0]], a, ctx, pos, torch.ones(1, T, dtype=torch.bool))
            z = torch.log_softmax(d.norm_f(o.h[:, :, 1:ROWS + 1]) @ H.T, -1)[0]  # [nb, rows, V']
        sc, ix = z.topk(TOPK, -1)
        out.append((ids, rs, a[0].tolist(), sc, vocab[ix]))
    drafts[k] = out
print('drafted', flush=True)
# corpus
K = [6, 5, 4, 3, 2, 1]
tab = {k: collections.defaultdict(collections.Counter) for k in K}
for f in sorted(glob.glob(str(__import__('pathlib').Path(__file__).resolve().parents[1] / 'training-data/smollm2-135m-regen/*.gz'))):
    for l in gzip.open(f):
        r = json.loads(l); p = r['prompt_ids'][-8:]; seq = p + r['response_ids']
        for i in range(len(p), len(seq)):
            for kk in K:
                if i - kk >= 0: tab[kk][tuple(seq[i-kk:i])][seq[i]] += 1
print('corpus built', flush=True)
def corpus_dist(ctx):
    """(dict token->prob, top token, confidence) from the longest matching context."""
    for kk in K:
        c = tab[kk].get(tuple(ctx[-kk:]))
        if c:
            tot = sum(c.values())
            return {t: n / tot for t, n in c.items()}, c.most_common(1)[0][0], kk
    return {}, None, 0
def run(lam, inject, only_corpus=False, floor=1e-3):
    res = {}
    for k, items in drafts.items():
        hit = [0]*ROWS; tot = 0
        for ids, rs, anchors, sc, ix in items:
            for j, a in enumerate(anchors):
                ctx = list(ids[:a+1]); ok = True
                for r in range(ROWS):
                    p = a + r + 1
                    if p >= len(ids): ok = False; break
                    dist, top, kk = corpus_dist(ctx)
                    if only_corpus:
                        choice = top
                    else:
                        cands = ix[j, r].tolist(); s = sc[j, r].tolist()
                        score = {c: v for c, v in zip(cands, s)}
                        if inject and top is not None and top not in score:
                            score[top] = min(s)  # the corpus's token joins with the lowest drafter score
                        if lam:
                            for c in score: score[c] += lam * math.log(dist.get(c, 0) + floor)
                        choice = max(score, key=score.get)
                    if choice != ids[p]: ok = False
                    if not ok: break
                    hit[r] += 1; ctx.append(choice)
                tot += 1
        res[k] = [round(h / tot, 3) for h in hit]
    return res
print('drafter only', run(0, False), flush=True)
print('corpus only', run(0, False, True), flush=True)
for lam in [0.25, 0.5, 1.0]:
    for inj in [False, True]:
        print('lam', lam, 'inject', inj, run(lam, inj), flush=True)
