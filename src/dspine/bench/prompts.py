"""The bench's prompts as token ids: each workload's selected rows (:mod:`dspine.bench.workloads`)
turned into prompts for one target (chat template or raw completion, context budget, stop
strings, the data each workload's answer check needs), so every mode of a run gets the
same ids.
"""
from __future__ import annotations

import json

from dspine.bench.workloads import (CONVERT_INSTRUCTION, EDIT_INSTRUCTION, HUMANEVAL_STOP, MULTIFILE_FILE, MULTIFILE_HEAD,
                                    MULTIFILE_QUESTION, MULTIFILE_SUMMARY, TOOLS_SYSTEM, BenchPrompt, convert_document,
                                    heldout_rows, load_workloads, parse_workloads, top_level_names)

def _strip_module_docstring(src: str) -> str:
    """Source without its module docstring (more code fits the context budget)."""
    import ast

    try:
        body = ast.parse(src).body
    except (SyntaxError, ValueError):
        return src
    if body and isinstance(body[0], ast.Expr) and isinstance(getattr(body[0], "value", None), ast.Constant) \
            and isinstance(body[0].value.value, str):
        lines = src.splitlines(keepends=True)
        return "".join(lines[:body[0].lineno - 1] + lines[body[0].end_lineno:]).lstrip("\n")
    return src


def _encode_chat(target, messages: list[dict]) -> list[int]:
    from dspine.data.tokenizer import encode_record

    return encode_record(target, {"kind": "chat", "messages": messages})


def _tool_messages(row: dict) -> list[dict]:
    system = TOOLS_SYSTEM.format(functions=json.dumps(row["functions"], ensure_ascii=False))
    msgs = [dict(m) for m in row["messages"]]
    extra = [m["content"] for m in msgs if m.get("role") == "system" and m.get("content")]
    msgs = [m for m in msgs if m.get("role") != "system"]
    return [{"role": "system", "content": "\n\n".join([system] + extra)}] + msgs


def _truncate_lines(target, text: str, max_tokens: int) -> str:
    """The longest line-aligned head of ``text`` within ``max_tokens`` tokens."""
    tok = target.tokenizer
    ids = tok.encode(text, add_special_tokens=False)
    if len(ids) <= max_tokens:
        return text
    head = tok.decode(ids[:max(max_tokens, 0)], skip_special_tokens=True)
    nl = head.rfind("\n")
    return head[:nl + 1] if nl >= 0 else ""


def _multifile_prompt(target, entry: dict, budget: int) -> tuple[list[int], dict] | None:
    from dspine.data.stdlib import module_path

    files = []
    for m in entry["modules"]:
        try:
            files.append((m, _strip_module_docstring(module_path(m).read_text(encoding="utf-8"))))
        except (OSError, UnicodeDecodeError):
            continue
    if not files:
        return None
    k = len(files)

    def render(texts: list[str]) -> tuple[str, str | None, str | None]:
        body = MULTIFILE_HEAD.format(k=k) + "".join(
            MULTIFILE_FILE.format(name=f"{m.replace('.', '/')}.py", text=t.rstrip("\n"))
            for (m, _), t in zip(files, texts))
        # the question names a public top-level symbol of the answer file's kept text
        order = [entry["answer"]] + [m for m, _ in files if m != entry["answer"]]
        for m in order:
            if m not in dict(files):
                continue
            t = texts[[x for x, _ in files].index(m)]
            names = [n for n in top_level_names(t) if not n.startswith("_")]
            if names:
                return body + MULTIFILE_QUESTION.format(symbol=names[-1]), m, names[-1]
        return body + MULTIFILE_SUMMARY, None, None

    overhead = len(_encode_chat(target, [{"role": "user", "content": render([""] * k)[0]}]))
    share = max(0, (budget - overhead) // k)
    for _ in range(20):  # shrink until the whole prompt fits (token merges at the seams)
        texts = [_truncate_lines(target, src, share) for _, src in files]
        text, answer, symbol = render(texts)
        ids = _encode_chat(target, [{"role": "user", "content": text}])
        if len(ids) <= budget:
            return ids, {"modules": [m for m, _ in files], "answer": answer, "symbol": symbol,
                         "answer_file": f"{answer.replace('.', '/')}.py" if answer else None}
        share = int(share * 0.9)
    return None


def build_prompts(target, names: list[str], limit: int | None = None, context_tokens: int = 2048,
                  max_new_tokens: int | None = None) -> tuple[list[BenchPrompt], list[dict]]:
    """Tokenized prompts of the workloads ``names`` for ``target``.

    Args:
        limit: at most this many prompts per workload (the first ones of the set).
        context_tokens: prompt + output budget per request; multifile prompts are built
            to fit, other prompts that do not fit are skipped (and reported).
        max_new_tokens: overrides every workload's output budget (smoke runs).
    Returns:
        (prompts, skipped) where ``skipped`` lists ``{"workload", "id", "reason"}``.
    """
    from dspine.data.sources import load_bfcl, load_humaneval, load_mtbench

    ws = load_workloads()["workloads"]
    prompts: list[BenchPrompt] = []
    skipped: list[dict] = []
    for name in parse_workloads(names):
        w = ws[name]
        mnt = int(max_new_tokens or w["max_new_tokens"])
        budget = context_tokens - mnt
        ids_wanted = w["ids"][:limit] if limit is not None else w["ids"]
        made: list[BenchPrompt] = []
        if name in ("short", "long"):
            rows = {f"mtbench/{r['question_id']}": r for r in load_mtbench()}
            for rid in ids_wanted:
                r = rows[rid]
                ids = _encode_chat(target, [{"role": "user", "content": r["turns"][0]}])
                made.append(BenchPrompt(name, rid, ids, mnt, [], {"category": r["category"]}))
        elif name == "code":
            rows = {r["task_id"]: r for r in load_humaneval()}
            for rid in ids_wanted:
                r = rows[rid]
                ids = target.encode_prompt(r["prompt"], chat=False)
                made.append(BenchPrompt(name, rid, ids, mnt, list(w.get("stop", HUMANEVAL_STOP)),
                                        {"prompt": r["prompt"], "test": r["test"],
                                         "entry_point": r["entry_point"]}))
        elif name == "multifile":
            for entry in ids_wanted:
                built = _multifile_prompt(target, entry, budget)
                if built is None:
                    skipped.append({"workload": name, "id": entry["id"], "reason": "modules unavailable"})
                    continue
                made.append(BenchPrompt(name, entry["id"], built[0], mnt, [], built[1]))
        elif name == "tools":
            rows = {r["id"]: r for r in load_bfcl()}
            for rid in ids_wanted:
                r = rows[rid]
                ids = _encode_chat(target, _tool_messages(r))
                made.append(BenchPrompt(name, rid, ids, mnt, [],
                                        {"functions": r["functions"], "category": r["category"]}))
        elif name == "edit":
            rows = {r["task_id"]: r for r in load_humaneval()}
            for rid in ids_wanted:
                r = rows[rid]
                code = r["prompt"] + r["canonical_solution"]
                ids = _encode_chat(target, [{"role": "user", "content": EDIT_INSTRUCTION.format(code=code)}])
                made.append(BenchPrompt(name, rid, ids, mnt, [], {"test": r["test"], "entry_point": r["entry_point"]}))
        elif name == "convert":
            rows = {r["id"]: r for r in load_bfcl()}
            for rid in ids_wanted:
                doc = convert_document(rows[rid])
                text = CONVERT_INSTRUCTION.format(document=json.dumps(doc, indent=2, ensure_ascii=False))
                ids = _encode_chat(target, [{"role": "user", "content": text}])
                made.append(BenchPrompt(name, rid, ids, mnt, [], {"document": doc}))
        elif name in ("stdlib", "sharegpt"):
            rows = heldout_rows("code" if name == "stdlib" else "chat", ids_wanted)
            for rid in ids_wanted:
                r = rows.get(rid)
                if r is None:
                    skipped.append({"workload": name, "id": rid, "reason": "prompt unavailable (another "
                                                                          "Python's stdlib?)"})
                    continue
                ids = (target.encode_prompt(r["prompt"], chat=False) if name == "stdlib"
                       else _encode_chat(target, [{"role": "user", "content": r["prompt"]}]))
                made.append(BenchPrompt(name, rid, ids, mnt, [], {}))
        for p in made:
            if len(p.prompt_ids) > budget:
                skipped.append({"workload": name, "id": p.id,
                                "reason": f"prompt {len(p.prompt_ids)} tokens > budget {budget} "
                                          f"(--context-tokens {context_tokens} - {mnt} new)"})
            else:
                prompts.append(p)
    return prompts, skipped


def warmup_prompt(target, max_new_tokens: int | None = None) -> BenchPrompt:
    """The short prompt every mode is warmed on before recording."""
    w = load_workloads()["warmup"]
    ids = _encode_chat(target, [{"role": "user", "content": w["prompt"]}])
    return BenchPrompt("warmup", "warmup", ids, int(max_new_tokens or w["max_new_tokens"]))
