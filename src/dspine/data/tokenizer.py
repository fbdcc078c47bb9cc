"""A data set's tie to its target's tokenizer: the tokenizer fingerprint a manifest
records and is checked against, the chat-template record, and prompt records encoded to
the target's token ids (chat template for chat/tool kinds, raw text for code).
"""
from __future__ import annotations

import hashlib
import json


def tokenizer_fingerprint(tok) -> dict:
    """name_or_path, vocab size and a sha256 of the vocabulary (token -> id) of ``tok``."""
    if hasattr(tok, "get_vocab"):
        vocab = sorted(tok.get_vocab().items(), key=lambda kv: kv[1])
        digest = hashlib.sha256(json.dumps(vocab, ensure_ascii=False).encode()).hexdigest()
    else:  # dspine's ByteTokenizer (random targets)
        digest = hashlib.sha256(f"{type(tok).__name__}:{len(tok)}".encode()).hexdigest()
    return {"name_or_path": str(getattr(tok, "name_or_path", type(tok).__name__)),
            "vocab_size": int(len(tok)), "vocab_sha256": digest}


def _template_info(tok) -> dict:
    tmpl = getattr(tok, "chat_template", None)
    return {"chat": "tokenizer chat template, add_generation_prompt" if tmpl else "none: raw text",
            "chat_template_sha256": hashlib.sha256(tmpl.encode()).hexdigest() if tmpl else None,
            "code": "raw continuation, no template"}


def encode_record(target, rec: dict) -> list[int]:
    """Prompt ids of a record: chat template for chat/tool kinds when the target has one."""
    tok = target.tokenizer
    has_tmpl = getattr(tok, "chat_template", None) is not None
    if "messages" in rec:
        if has_tmpl and rec.get("kind") != "code":
            ids = tok.apply_chat_template(rec["messages"], add_generation_prompt=True, tokenize=True)
            if isinstance(ids, dict) or hasattr(ids, "input_ids"):
                ids = ids["input_ids"]
            return [int(i) for i in ids]
        text = "\n".join(str(m.get("content") or "") for m in rec["messages"])
        return target.encode_prompt(text, chat=False)
    chat = rec.get("kind") != "code" and has_tmpl
    return target.encode_prompt(rec["prompt"], chat=chat)


def _same_target(man: dict, target, fp: dict) -> bool:
    same_name = man.get("target") == target.name or (
        target.path is not None and man.get("target_path") == target.path)
    tok = man.get("tokenizer")
    return same_name and isinstance(tok, dict) and tok.get("vocab_sha256") == fp["vocab_sha256"]
