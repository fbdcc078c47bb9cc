"""A bounded soak test of a running ``dspine serve`` (loopback only).

:func:`soak` sends ``n`` mixed requests from ``clients`` concurrent clients and checks what
a server must survive: greedy and seeded-sampling completions and chat completions,
streamed and not, with stop strings; clients that disconnect mid-stream; malformed bodies
(invalid JSON, wrong field types); prompts longer than the context window. Every greedy
request is first sent alone, one at a time, as its reference; under load each answer must
equal it (seeded samples must arrive complete; see :data:`DETERMINED`). Afterwards the server must be
idle with every slot free and its cache bytes and memory back near the warm baseline.

Used by ``benchmarks/soak.py`` (a real target, 500+ requests, results file) and by the
suite's short version (``tests/test_soak.py``). Bounded: ``n`` requests, each with a
timeout, and an overall ``deadline_s``; it talks only to the ``base_url`` it is given.
"""
from __future__ import annotations

import asyncio
import json
import random
import statistics
import time
from dataclasses import dataclass, field

import httpx

KINDS = ("greedy", "greedy_stream", "chat_greedy", "seeded", "seeded_stream", "stop", "disconnect",
         "malformed", "oversize")
WORDS = ("alpha", "beta", "gamma", "delta", "def", "return", "print", "the", "a", "list", "value", "(", ")", ":")


@dataclass
class Spec:
    """One request of the soak: its kind, endpoint path and JSON body (a string for a
    malformed one)."""

    kind: str
    path: str
    body: dict | str
    stream: bool = False

    def key(self) -> str:
        return self.path + json.dumps(self.body, sort_keys=True) if isinstance(self.body, dict) else ""


@dataclass
class SoakResult:
    requests: int = 0
    by_kind: dict = field(default_factory=dict)
    statuses: dict = field(default_factory=dict)
    wrong: list = field(default_factory=list)  # determined answers that differ from their reference
    lost: list = field(default_factory=list)  # no answer (transport error, timeout, truncated stream)
    unexpected: list = field(default_factory=list)  # a status the request's kind does not allow
    server_errors: int = 0  # 5xx (none allowed here: no shutdown during the soak)
    latency_s: dict = field(default_factory=dict)
    wall_s: float = 0.0
    before: dict = field(default_factory=dict)
    after: dict = field(default_factory=dict)

    def ok(self, memory_tolerance: float = 0.10) -> bool:
        """No wrong, lost or unexpected answer, no 5xx, idle afterwards with every slot free,
        and memory (where measured) within ``memory_tolerance`` of the warm baseline."""
        b, a = self.before, self.after
        mem = b.get("rss_bytes") and a.get("rss_bytes")
        return (not self.wrong and not self.lost and not self.unexpected and self.server_errors == 0
                and a.get("running") == 0 and a.get("queued") == 0 and a.get("free_slots") == b.get("free_slots")
                and (not mem or a["rss_bytes"] <= b["rss_bytes"] * (1 + memory_tolerance)))

    def to_dict(self) -> dict:
        return {**self.__dict__, "ok": self.ok()}


def make_specs(n: int, model: str, context: int, seed: int = 0, max_tokens: int = 16) -> list[Spec]:
    """``n`` requests cycling over :data:`KINDS` (shuffled), bodies drawn from ``seed``."""
    rng = random.Random(seed)
    prompts = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 12))) for _ in range(12)]
    out = []
    for i in range(n):
        kind = KINDS[i % len(KINDS)]
        p = rng.choice(prompts)
        m = rng.randint(1, max_tokens)
        base = {"model": model, "prompt": p, "max_tokens": m, "temperature": 0}
        if kind == "greedy":
            out.append(Spec(kind, "/v1/completions", base))
        elif kind == "greedy_stream":
            out.append(Spec(kind, "/v1/completions", {**base, "stream": True}, stream=True))
        elif kind == "chat_greedy":
            out.append(Spec(kind, "/v1/chat/completions", {"model": model, "max_tokens": m, "temperature": 0,
                                                           "messages": [{"role": "user", "content": p}]}))
        elif kind in ("seeded", "seeded_stream"):
            body = {**base, "temperature": 0.8, "top_p": 0.95, "seed": rng.randint(0, 3)}
            out.append(Spec(kind, "/v1/completions", {**body, "stream": kind == "seeded_stream"},
                            stream=kind == "seeded_stream"))
        elif kind == "stop":
            out.append(Spec(kind, "/v1/completions", {**base, "max_tokens": max_tokens, "stop": [rng.choice("ae "), "\n"]}))
        elif kind == "disconnect":
            out.append(Spec(kind, "/v1/completions", {**base, "max_tokens": 4 * max_tokens, "stream": True}, stream=True))
        elif kind == "malformed":
            bad = rng.choice(['{"prompt": ', json.dumps({**base, "max_tokens": "many"}),
                              json.dumps({**base, "temperature": [1]}), json.dumps({"model": model})])
            out.append(Spec(kind, "/v1/completions", bad))
        else:  # oversize: more prompt tokens than the context window
            out.append(Spec(kind, "/v1/completions", {**base, "prompt": [1] * (context + 8)}))
    rng.shuffle(out)
    return out


# greedy answers are determined: each must equal its single-request run. A seeded sample is
# exact in distribution but not reproducible under load: the cost policy's verification
# lengths and the output cache's copies depend on the other requests, and they decide which
# random draws a token uses; seeded requests are checked for a complete answer only.
DETERMINED = ("greedy", "greedy_stream", "chat_greedy", "stop")
ALLOWED = {k: {200} for k in DETERMINED + ("seeded", "seeded_stream", "disconnect")} | {"malformed": {400},
                                                                                     "oversize": {400}}


async def _send(client: httpx.AsyncClient, spec: Spec, headers: dict) -> tuple[int, str | None]:
    """(status, answer text or None). A disconnect reads two events, then closes."""
    if spec.stream:
        async with client.stream("POST", spec.path, json=spec.body, headers=headers) as r:
            if r.status_code != 200:
                await r.aread()
                return r.status_code, None
            parts, done, events = [], False, 0
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                events += 1
                if spec.kind == "disconnect" and events >= 2:
                    return 200, None  # leave mid-stream: the context manager closes the connection
                if data == "[DONE]":
                    done = True
                    break
                ch = json.loads(data)
                if "error" in ch:
                    return 500, None
                for c in ch.get("choices", []):
                    parts.append(c.get("text") or (c.get("delta") or {}).get("content") or "")
            if not done:
                raise httpx.ReadError("stream ended without [DONE]")
            return 200, "".join(parts)
    content = spec.body if isinstance(spec.body, str) else json.dumps(spec.body)
    r = await client.post(spec.path, content=content, headers={**headers, "Content-Type": "application/json"})
    if r.status_code != 200:
        return r.status_code, None
    c = r.json()["choices"][0]
    return 200, c.get("text") if "text" in c else c["message"]["content"]


async def _state(client: httpx.AsyncClient, rss) -> dict:
    h = (await client.get("/health")).json()
    out = {k: h.get(k) for k in ("running", "queued", "free_slots", "cache_bytes", "cycles")}
    if rss is not None:
        out["rss_bytes"] = rss()
    return out


async def _wait_idle(client: httpx.AsyncClient, timeout: float = 60.0) -> None:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        h = (await client.get("/health")).json()
        if h.get("running") == 0 and h.get("queued") == 0:
            return
        await asyncio.sleep(0.05)


async def soak_async(base_url: str, n: int = 500, clients: int = 8, seed: int = 0, max_tokens: int = 16,
                     api_key: str | None = None, rss=None, timeout_s: float = 120.0,
                     deadline_s: float = 3600.0, progress=None) -> SoakResult:
    """Run the soak against ``base_url`` (module docstring). ``rss``: a callable giving the
    server process's resident memory in bytes (None: not checked). ``progress(done, n)`` is
    called after each request of the concurrent phase."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    res = SoakResult(requests=n)
    t_start = time.monotonic()
    async with httpx.AsyncClient(base_url=base_url, timeout=timeout_s, headers=headers) as client:
        info = (await client.get("/v1/models")).json()["data"][0]
        specs = make_specs(n, info["id"], int(info["max_model_len"]), seed, max_tokens)
        refs: dict[str, str] = {}
        for s in specs:  # references: each determined request alone (this also warms every path up)
            if s.kind in DETERMINED and s.key() not in refs:
                st, text = await _send(client, s, headers)
                if st != 200 or text is None:
                    res.unexpected.append({"kind": s.kind, "status": st, "phase": "reference"})
                    continue
                refs[s.key()] = text
        await _wait_idle(client)
        res.before = await _state(client, rss)
        queue: asyncio.Queue = asyncio.Queue()
        for s in specs:
            queue.put_nowait(s)
        lat: dict[str, list[float]] = {}
        done = [0]

        async def worker():
            while not queue.empty() and time.monotonic() - t_start < deadline_s:
                s = queue.get_nowait()
                t0 = time.perf_counter()
                try:
                    st, text = await _send(client, s, headers)
                except (httpx.HTTPError, json.JSONDecodeError, KeyError) as e:
                    res.lost.append({"kind": s.kind, "error": f"{type(e).__name__}: {e}"[:200]})
                    continue
                finally:
                    done[0] += 1
                    if progress:
                        progress(done[0], n)
                lat.setdefault(s.kind, []).append(time.perf_counter() - t0)
                res.by_kind[s.kind] = res.by_kind.get(s.kind, 0) + 1
                res.statuses[str(st)] = res.statuses.get(str(st), 0) + 1
                if st >= 500:
                    res.server_errors += 1
                if st not in ALLOWED[s.kind]:
                    res.unexpected.append({"kind": s.kind, "status": st})
                elif s.kind in DETERMINED and s.key() in refs and text != refs[s.key()]:
                    res.wrong.append({"kind": s.kind, "body": s.body, "got": text, "want": refs[s.key()]})

        await asyncio.gather(*(worker() for _ in range(clients)))
        res.lost.extend({"kind": s.kind, "error": "deadline"} for s in _drain(queue))
        await _wait_idle(client)
        await asyncio.sleep(0.3)  # a disconnected stream's cancellation reaches the scheduler
        await _wait_idle(client)
        res.after = await _state(client, rss)
    res.wall_s = round(time.monotonic() - t_start, 2)
    res.latency_s = {k: {"p50": round(statistics.median(v), 3), "max": round(max(v), 3), "n": len(v)}
                     for k, v in sorted(lat.items())}
    return res


def _drain(queue: asyncio.Queue) -> list:
    out = []
    while not queue.empty():
        out.append(queue.get_nowait())
    return out


def soak(base_url: str, **kw) -> SoakResult:
    """:func:`soak_async` from synchronous code."""
    return asyncio.run(soak_async(base_url, **kw))


def rss_of(pid: int | str = "self"):
    """A callable reading the resident memory (bytes) of process ``pid`` from /proc."""
    def read() -> int:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
        return 0
    return read
