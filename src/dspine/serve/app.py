"""FastAPI app: OpenAI-compatible endpoints over a :class:`Scheduler`.

Endpoints: ``POST /v1/completions``, ``POST /v1/chat/completions`` (both with
``stream`` = server-sent events ending in ``data: [DONE]``), ``GET /v1/models``,
``GET /health`` (JSON with the scheduler counters: running, queued, free_slots,
cache bytes), ``GET /metrics`` (Prometheus text).

Errors are OpenAI-style JSON ``{"error": {"message", "type", "param", "code"}}``:
400 for an invalid field (named in ``param``), empty or over-long prompt or
``max_tokens`` beyond the context; 404 for an unknown model or path; 429 when the
waiting queue is full; 503 while shutting down; 401 for a ``/v1/*`` request without an
accepted API key when the server has keys (``--api-key``, :mod:`dspine.serve.auth`).
"""
from __future__ import annotations

import asyncio
import hashlib
import json
import secrets
import time
import uuid
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from dspine.core.batch import BatchEngine
from dspine.config import ConfigError, SamplingConfig
from dspine.proposers import output_cache_of
from dspine.proposers.cache import SCOPES
from dspine.serve.auth import APIKeys
from dspine.serve.metrics import CONTENT_TYPE_LATEST, Metrics
from dspine.serve.protocol import APIError, ChatCompletionRequest, CompletionRequest, error_body, field_of
from dspine.serve.scheduler import Event, Job, QueueFull, Scheduler, ShuttingDown

POLL_S = 0.2  # disconnect polling of non-streamed requests


def encode_chat(target, messages: list[dict]) -> list[int]:
    """Token ids of a conversation: the target's chat template (generation prompt added),
    or, for targets without a template, the message contents joined by newlines."""
    tok = target.tokenizer
    if getattr(tok, "chat_template", None) is None:
        return target.encode_prompt("\n".join(m["content"] for m in messages))
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):
        ids = ids["input_ids"]
    return [int(i) for i in ids]


def tenant_of(request: Request, scope: str) -> str:
    """The tenant of an HTTP request for the cross-request output cache
    (:mod:`dspine.proposers.cache`): with scope ``key``, the tenant the server's API keys
    name for the request's key (``--api-key``, :mod:`dspine.serve.auth`; set by the auth
    check) or, on a server without keys, a digest of its ``Authorization`` header (requests
    without one are the tenant ``anonymous``), so one API key never receives copies of
    another's outputs; with ``global``, every request is the same tenant (share only when
    all clients may see each other's outputs).

    ``scope`` is validated by :func:`create_app`.
    """
    if scope == "global":
        return ""
    checked = getattr(request.state, "tenant", None)
    if checked is not None:
        return checked
    auth = request.headers.get("authorization")
    return "key:" + hashlib.sha256(auth.encode()).hexdigest()[:24] if auth else "anonymous"


def create_app(batch: BatchEngine, model_name: str, max_queue: int = 64, info: dict | None = None,
               scheduler: Scheduler | None = None, cache_scope: str = "key",
               api_keys: APIKeys | None = None) -> FastAPI:
    """Build the app. The scheduler thread starts with the app's lifespan and stops with it
    (running and waiting requests are cancelled then, their state freed).

    ``info``: extra fields shown by ``/v1/models`` and ``/health`` (mode, drafter, dtype).
    ``cache_scope``: who shares the proposer's cross-request output cache, if it has one
    (:func:`tenant_of`; ``/health`` shows the cache's counters under ``ngram_cache``).
    ``api_keys``: with keys, ``/v1/*`` requests without an accepted ``Authorization: Bearer``
    key get 401 (:mod:`dspine.serve.auth`); None serves everyone.

    Raises:
        ValueError: an unknown ``cache_scope``.
    """
    if cache_scope not in SCOPES:
        raise ValueError(f"--ngram-cache-scope {cache_scope!r} is unknown; accepted: {', '.join(SCOPES)}")
    out_cache = output_cache_of(batch.engine.proposer)
    metrics = Metrics()
    sched = scheduler or Scheduler(batch, max_queue=max_queue, metrics=metrics)
    metrics = sched.metrics
    if out_cache is not None:
        metrics.add_output_cache(out_cache)
    target = batch.target
    ctx = batch.engine.max_positions
    info = dict(info or {})
    created = int(time.time())

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        sched.start()
        try:
            yield
        finally:
            await asyncio.get_running_loop().run_in_executor(None, sched.stop)

    app = FastAPI(title="dspine", lifespan=lifespan)
    app.state.scheduler = sched
    app.state.batch = batch
    app.state.metrics = metrics
    app.state.model_name = model_name

    # -- authentication ----------------------------------------------------------------
    if api_keys is not None:
        @app.middleware("http")
        async def _auth(request: Request, call_next):
            if request.url.path.startswith("/v1/"):
                tenant = api_keys.tenant(request.headers.get("authorization"))
                if tenant is None:
                    if request.method == "POST":
                        _count(request, "unauthorized")
                    msg = ("missing API key: send 'Authorization: Bearer <key>'"
                           if not request.headers.get("authorization") else "invalid API key")
                    return JSONResponse(error_body(msg, "invalid_request_error", None, "invalid_api_key"),
                                        status_code=401, headers={"WWW-Authenticate": "Bearer"})
                request.state.tenant = tenant
            return await call_next(request)

    # -- errors ------------------------------------------------------------------------
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        if exc.status in (400, 404) and request.method == "POST":
            _count(request, "invalid")
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError):
        errs = exc.errors()
        e = errs[0] if errs else {"loc": ("body",), "msg": "invalid request", "type": "invalid"}
        if e.get("type") == "json_invalid":
            param, msg = None, f"request body is not valid JSON: {e.get('ctx', {}).get('error', e['msg'])}"
        else:
            param = field_of(tuple(e.get("loc", ())))
            msg = f"invalid value for '{param}': {e.get('msg')}"
        _count(request, "invalid")
        return JSONResponse(error_body(msg, param=param, code="invalid_value"), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        typ = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return JSONResponse(error_body(f"{request.method} {request.url.path}: {exc.detail}", typ),
                            status_code=exc.status_code)

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception):
        return JSONResponse(error_body(f"internal error: {type(exc).__name__}: {exc}", "server_error"),
                            status_code=500)

    def _count(request: Request, outcome: str) -> None:
        ep = "chat" if request.url.path.endswith("chat/completions") else "completions"
        metrics.requests.labels(ep, outcome).inc()

    # -- info endpoints ----------------------------------------------------------------
    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": created,
                                            "owned_by": "dspine", "max_model_len": ctx, **info}]}

    @app.get("/health")
    async def health():
        c = sched.counters()
        status = "stopping" if sched._closed else "ok"
        if out_cache is not None:
            c = {**c, "ngram_cache": {"scope": cache_scope, **out_cache.stats()}}
        return JSONResponse({"status": status, "model": model_name, **info, **c},
                            status_code=200 if status == "ok" else 503)

    @app.get("/metrics")
    async def prom():
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    # -- generation --------------------------------------------------------------------
    def _check_model(name: str | None) -> None:
        if name is not None and name != model_name:
            raise APIError(404, f"The model '{name}' does not exist; this server serves '{model_name}'",
                           "model", type="invalid_request_error", code="model_not_found")

    def _sampling(body) -> SamplingConfig:
        top_k = body.top_k if body.top_k is not None else 0
        try:
            return SamplingConfig(temperature=1.0 if body.temperature is None else body.temperature,
                                  top_k=max(0, top_k), top_p=1.0 if body.top_p is None else body.top_p,
                                  min_p=0.0 if body.min_p is None else body.min_p,
                                  seed=body.seed if body.seed is not None else secrets.randbits(63))
        except ConfigError as e:
            raise APIError(400, str(e), str(e).split()[0]) from None

    def _limits(prompt_ids: list[int], max_tokens: int | None, default: int | None) -> int:
        n = len(prompt_ids)
        if n == 0:
            raise APIError(400, "prompt is empty", "prompt", code="empty_prompt")
        bad = [t for t in prompt_ids if not 0 <= t < target.vocab_size]
        if bad:
            raise APIError(400, f"prompt token ids {bad[:3]} are outside the vocabulary "
                                f"(size {target.vocab_size})", "prompt")
        if n >= ctx:
            raise APIError(400, f"prompt has {n} tokens; this model's context window is {ctx} tokens "
                                f"(at least 1 must remain for the completion)", "prompt",
                           code="context_length_exceeded")
        if max_tokens is None:
            max_tokens = ctx - n if default is None else min(default, ctx - n)
        if n + max_tokens > ctx:
            raise APIError(400, f"max_tokens {max_tokens} + prompt {n} tokens exceeds this model's "
                                f"context window of {ctx} tokens", "max_tokens",
                           code="context_length_exceeded")
        return max_tokens

    def _submit(job: Job) -> None:
        try:
            sched.submit(job)
        except QueueFull as e:
            metrics.requests.labels(job.endpoint, "rejected").inc()
            raise APIError(429, str(e), None, type="rate_limit_error", code="rate_limit_exceeded") from None
        except ShuttingDown as e:
            metrics.requests.labels(job.endpoint, "rejected").inc()
            raise APIError(503, str(e), None, type="server_error", code="shutting_down") from None

    async def _collect(job: Job, request: Request) -> tuple[str, Event]:
        parts: list[str] = []
        try:
            while True:
                try:
                    ev = await asyncio.wait_for(job.queue.get(), POLL_S)
                except asyncio.TimeoutError:
                    if await request.is_disconnected():
                        sched.cancel(job)
                        raise APIError(499, "client disconnected", None)
                    continue
                if ev.kind == "delta":
                    parts.append(ev.text)
                elif ev.kind == "done":
                    return "".join(parts), ev
                else:
                    raise APIError(ev.status, ev.message, None,
                                   type="server_error" if ev.status >= 500 else "invalid_request_error")
        finally:
            sched.cancel(job)  # no-op when finished; frees state when the handler is cancelled

    def _usage(ev: Event) -> dict:
        return {"prompt_tokens": ev.prompt_tokens, "completion_tokens": ev.completion_tokens,
                "total_tokens": ev.prompt_tokens + ev.completion_tokens}

    def _stream(job: Job, rid: str, chat: bool, include_usage: bool, with_ids: bool) -> StreamingResponse:
        obj = "chat.completion.chunk" if chat else "text_completion"
        sent = [0]

        def chunk(text: str | None, finish: str | None, role: bool = False, ids: list[int] | None = None) -> str:
            if chat:
                delta = {"role": "assistant", "content": ""} if role else ({} if text is None else {"content": text})
                choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
            else:
                choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
            if with_ids and not role:
                ids = ids or []
                choice["token_ids"] = ids[sent[0]:]
                sent[0] = max(sent[0], len(ids))
            d = {"id": rid, "object": obj, "created": int(time.time()), "model": model_name, "choices": [choice]}
            if include_usage:
                d["usage"] = None
            return f"data: {json.dumps(d)}\n\n"

        async def gen():
            try:
                if chat:
                    yield chunk(None, None, role=True)
                while True:
                    ev = await job.queue.get()
                    if ev.kind == "delta":
                        yield chunk(ev.text, None, ids=ev.token_ids)
                    elif ev.kind == "done":
                        yield chunk(None, ev.finish_reason, ids=ev.token_ids)
                        if include_usage:
                            d = {"id": rid, "object": obj, "created": int(time.time()), "model": model_name,
                                 "choices": [], "usage": _usage(ev)}
                            yield f"data: {json.dumps(d)}\n\n"
                        yield "data: [DONE]\n\n"
                        return
                    else:
                        typ = "server_error" if ev.status >= 500 else "invalid_request_error"
                        yield f"data: {json.dumps(error_body(ev.message, typ))}\n\n"
                        yield "data: [DONE]\n\n"
                        return
            finally:
                sched.cancel(job)  # client went away (task cancelled) or stream ended

        return StreamingResponse(gen(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def _run(body, prompt_ids: list[int], request: Request, chat: bool, default_max: int | None):
        max_tokens = _limits(prompt_ids, body.max_tokens, default_max)
        sampling = _sampling(body)
        job = Job(prompt_ids, sampling, max_tokens, list(body.stop or []), asyncio.get_running_loop(),
                  endpoint="chat" if chat else "completions",
                  tenant=tenant_of(request, cache_scope) if out_cache is not None else None)
        _submit(job)
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        if body.stream:
            inc = bool(body.stream_options and body.stream_options.include_usage)
            return _stream(job, rid, chat, inc, body.return_token_ids)
        text, ev = await _collect(job, request)
        if chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                      "finish_reason": ev.finish_reason}
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": ev.finish_reason}
        if body.return_token_ids:
            choice["prompt_token_ids"] = list(prompt_ids)
            choice["token_ids"] = list(ev.token_ids or [])
        return {"id": rid, "object": "chat.completion" if chat else "text_completion",
                "created": int(time.time()), "model": model_name, "choices": [choice], "usage": _usage(ev)}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        _check_model(body.model)
        p = body.prompt
        if isinstance(p, str):
            if not p:
                raise APIError(400, "prompt is empty", "prompt", code="empty_prompt")
            try:
                ids = target.encode_prompt(p)
            except UnicodeError as e:  # e.g. a lone surrogate such as "\ud800"
                raise APIError(400, f"prompt is not valid Unicode text: {e}", "prompt") from None
        else:
            ids = [int(t) for t in p]
        return await _run(body, ids, request, chat=False, default_max=16)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        _check_model(body.model)
        msgs = [{"role": m.role, "content": m.text()} for m in body.messages]
        if not any(m["content"] for m in msgs):
            raise APIError(400, "messages have no content", "messages", code="empty_prompt")
        try:
            ids = encode_chat(target, msgs)
        except Exception as e:  # template errors (e.g. a role the template refuses)
            raise APIError(400, f"messages could not be rendered with the chat template: {e}",
                           "messages") from None
        return await _run(body, ids, request, chat=True, default_max=None)

    return app
