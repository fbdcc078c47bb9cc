"""The llama.cpp peer of ``dspine bench`` (dspine.bench.llama_cpp).

Most tests drive a fake ``llama-server`` (a small Python HTTP server speaking the same
endpoints) so the client, the fairness rules and the report are tested without a
llama.cpp build; one slow test runs the real server when ``DSPINE_LLAMA_CPP`` names one.
"""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import pytest

from dspine.bench import harness as H
from dspine.bench import run_config as RC
from dspine.bench.fairness import BenchError, UnfairComparisonError, check_fair
from dspine.bench.llama_cpp import PROBE_TEXT, LlamaCppRunner, default_gguf, find_llama_server
from dspine.config import SamplingConfig

FAKE_SERVER = r'''#!{python}
"""A fake llama-server: /health, /props, /tokenize, /completion (answers from env)."""
import json, os, sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

args = sys.argv[1:]
port = int(args[args.index("--port") + 1])
if os.environ.get("FAKE_EXIT"):
    print("error: " + os.environ["FAKE_EXIT"], flush=True)
    sys.exit(3)
if os.environ.get("FAKE_PIDFILE"):
    open(os.environ["FAKE_PIDFILE"], "a").write(f"{{os.getpid()}}\n")
if os.environ.get("FAKE_ARGS"):
    open(os.environ["FAKE_ARGS"], "a").write(json.dumps(args) + "\n")

class H(BaseHTTPRequestHandler):
    def log_message(self, *a):
        pass

    def _send(self, obj):
        b = json.dumps(obj).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(b)))
        self.end_headers()
        self.wfile.write(b)

    def do_GET(self):
        if self.path == "/health":
            self._send({{"status": "ok"}})
        elif self.path == "/props":
            self._send({{"model_ftype": "F16", "build_info": "fake-1"}})

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if self.path == "/tokenize":
            self._send({{"tokens": json.loads(os.environ["FAKE_PROBE"])}})
            return
        if os.environ.get("FAKE_BODIES"):
            open(os.environ["FAKE_BODIES"], "a").write(json.dumps(body) + "\n")
        toks = json.loads(os.environ.get("FAKE_TOKENS", "[5, 6, 7]"))[: body["n_predict"]]
        acc = int(os.environ.get("FAKE_ACCEPTED", "0"))
        self._send({{"tokens": toks, "stop_type": "limit", "timings": {{
            "prompt_n": len(body["prompt"]), "prompt_ms": 10.0, "predicted_n": len(toks),
            "predicted_ms": 20.0 * max(1, len(toks) - 1), "draft_n": 2 * acc, "draft_n_accepted": acc}}}})

ThreadingHTTPServer(("127.0.0.1", port), H).serve_forever()
'''


def write_gguf(path: Path, layers: int, hidden: int, arch: str = "llama") -> None:
    """A metadata-only GGUF (no tensors): enough for the shape check; the fake server ignores it."""
    from gguf import GGUFWriter

    w = GGUFWriter(str(path), arch)
    w.add_block_count(layers)
    w.add_embedding_length(hidden)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture
def fake(tmp_path, monkeypatch, tiny256):
    """(server path, gguf path, env setter) for the fake llama-server over ``tiny256``."""
    srv = tmp_path / "bin" / "llama-server"
    srv.parent.mkdir()
    srv.write_text(FAKE_SERVER.format(python=sys.executable))
    srv.chmod(0o755)
    gguf = tmp_path / "model.gguf"
    write_gguf(gguf, tiny256.config.num_hidden_layers, tiny256.config.hidden_size)
    monkeypatch.delenv("DSPINE_LLAMA_CPP", raising=False)
    monkeypatch.setenv("FAKE_PROBE", json.dumps(list(tiny256.tokenizer.encode(PROBE_TEXT, add_special_tokens=False))))
    monkeypatch.setenv("FAKE_PIDFILE", str(tmp_path / "pids"))
    return srv, gguf


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie (exited, not yet reaped by its parent) counts as gone
        return Path(f"/proc/{pid}/status").read_text().find("State:\tZ") < 0
    except OSError:
        return True


# -- fairness ----------------------------------------------------------------------------------
def test_check_fair_lets_an_external_engine_hold_its_own_weights_only():
    base = {"target": "t", "weights": "abc", "dtype": "float32", "device": "cpu", "threads": 2}
    ext = dict(base, weights="gguf:123", dtype="f16", external_weights={"gguf": "m.gguf"})
    check_fair({"ar": base, "dspine": dict(base), "llama-cpp": ext})  # accepted
    with pytest.raises(UnfairComparisonError, match="threads"):  # everything else must match
        check_fair({"ar": base, "llama-cpp": dict(ext, threads=1)})
    with pytest.raises(UnfairComparisonError, match="weights"):  # negative control: no exemption for ours
        check_fair({"ar": base, "dspine": dict(base, weights="other")})
    with pytest.raises(UnfairComparisonError, match="weights"):  # two external modes share one GGUF
        check_fair({"llama-cpp": ext, "llama-cpp-lookup": dict(ext, weights="gguf:999")})


# -- finding the server and the GGUF ------------------------------------------------------------
def test_find_llama_server_names_the_setting(tmp_path, monkeypatch):
    monkeypatch.delenv("DSPINE_LLAMA_CPP", raising=False)
    with pytest.raises(BenchError, match="--llama-cpp"):
        find_llama_server(None)
    with pytest.raises(BenchError, match="no executable llama-server"):
        find_llama_server(tmp_path)
    b = tmp_path / "build" / "bin" / "llama-server"
    b.parent.mkdir(parents=True)
    b.write_text("#!/bin/sh\n")
    b.chmod(0o755)
    assert find_llama_server(tmp_path) == b and find_llama_server(b) == b
    monkeypatch.setenv("DSPINE_LLAMA_CPP", str(tmp_path))
    assert find_llama_server(None) == b


def test_default_gguf_is_the_targets_own_source_only(tiny256):
    assert default_gguf(tiny256) is None  # a random target has no source GGUF


# -- the runner over the fake server --------------------------------------------------------------
def test_runner_sends_ids_and_reads_back_timings(fake, tiny256, tmp_path, monkeypatch):
    srv, gguf = fake
    monkeypatch.setenv("FAKE_TOKENS", json.dumps([5, 6, 7, 0, 9]))  # EOS (0) inside: cut after it
    monkeypatch.setenv("FAKE_ACCEPTED", "2")
    monkeypatch.setenv("FAKE_BODIES", str(tmp_path / "bodies"))
    monkeypatch.setenv("FAKE_ARGS", str(tmp_path / "args"))
    r = LlamaCppRunner(tiny256, "llama-cpp-lookup", str(srv), str(gguf), threads=2, ctx=512)
    try:
        out = r.run([1, 2, 3], SamplingConfig(), 8, [], 30.0)
        assert out["output_ids"] == [5, 6, 7, 0] and out["finish_reason"] == "stop"
        assert out["ttft_s"] == pytest.approx(0.010) and out["decode_s"] == pytest.approx(0.080)
        assert out["tokens_per_second"] == pytest.approx(4 / 0.080)
        assert out["cycles"] == 2 and out["tau"] == pytest.approx(2.0)  # 4 tokens after the first, 2 drafted ones accepted
        r.run([1, 2], SamplingConfig(temperature=0.7, top_k=5, top_p=0.9, min_p=0.05, seed=3), 4, ["\n"], 30.0)
        greedy, sampled = [json.loads(x) for x in (tmp_path / "bodies").read_text().splitlines()]
        assert greedy["prompt"] == [1, 2, 3] and greedy["samplers"] == ["top_k"] and greedy["top_k"] == 1
        assert greedy["cache_prompt"] is False and greedy["n_predict"] == 8
        assert sampled["samplers"] == ["temperature", "top_k", "top_p", "min_p"]  # dspine's order (spec s.7)
        assert (sampled["temperature"], sampled["top_k"], sampled["top_p"], sampled["min_p"], sampled["seed"]) \
            == (0.7, 5, 0.9, 0.05, 3)
        assert sampled["stop"] == ["\n"] and sampled["repeat_penalty"] == 1.0
        args = json.loads((tmp_path / "args").read_text().splitlines()[0])
        assert args[args.index("-t") + 1] == "2" and args[args.index("-tb") + 1] == "2"
        assert "ngram-simple" in args  # the lookup mode's speculation
        ident = r.identity()
        assert ident["external_weights"]["ftype"] == "F16" and ident["weights"].startswith("gguf:")
        assert r.decoding(SamplingConfig(), 8, [])["sampling"] == r.decoding(SamplingConfig(seed=5), 8, [])["sampling"]
    finally:
        r.close()
    pid = int((tmp_path / "pids").read_text().split()[0])
    assert not _alive(pid)


def test_runner_refuses_a_server_that_exits(fake, tiny256, monkeypatch):
    srv, gguf = fake
    monkeypatch.setenv("FAKE_EXIT", "unknown model architecture")
    with pytest.raises(BenchError, match="exited with status 3.*unknown model architecture"):
        LlamaCppRunner(tiny256, "llama-cpp", str(srv), str(gguf))


def test_runner_refuses_a_gguf_of_another_model(fake, tiny256, tmp_path, monkeypatch):
    srv, gguf = fake
    monkeypatch.setenv("FAKE_PROBE", json.dumps([1, 2, 3]))
    with pytest.raises(BenchError, match="tokenizer gives other ids"):
        LlamaCppRunner(tiny256, "llama-cpp", str(srv), str(gguf))
    time.sleep(0.2)
    assert not _alive(int((tmp_path / "pids").read_text().split()[0]))  # stopped on the refusal
    other = tmp_path / "drafter.gguf"  # same tokenizer, another model (e.g. a 2-layer drafter)
    write_gguf(other, 2, tiny256.config.hidden_size, arch="dflash")
    monkeypatch.setenv("FAKE_PROBE", json.dumps(list(tiny256.tokenizer.encode(PROBE_TEXT, add_special_tokens=False))))
    with pytest.raises(BenchError, match="another shape.*layers 2 vs"):
        LlamaCppRunner(tiny256, "llama-cpp", str(srv), str(other))
    text = tmp_path / "notes.gguf"
    text.write_text("not a model")
    with pytest.raises(BenchError, match="not a readable GGUF"):
        LlamaCppRunner(tiny256, "llama-cpp", str(srv), str(text))
    with pytest.raises(BenchError, match="no GGUF"):
        LlamaCppRunner(tiny256, "llama-cpp", str(srv), None)
    with pytest.raises(BenchError, match="no such file"):
        LlamaCppRunner(tiny256, "llama-cpp", str(srv), str(tmp_path / "missing.gguf"))


# -- the harness and report --------------------------------------------------------------------
def test_bench_run_with_the_llama_cpp_peer(fake, tiny256, tmp_path, monkeypatch, one_thread):
    srv, gguf = fake
    monkeypatch.setenv("FAKE_TOKENS", json.dumps([70, 71, 72, 73, 74, 75]))
    cfg = RC.BenchConfig(target="random:llama", modes=("ar", "dspine", "llama-cpp"), drafters={"dspine": "random"},
                        block_size=4, limit=1, max_new_tokens=6, context_tokens=1536, settings=(RC.GREEDY,),
                        repeats=1, warmup=1, warmup_tokens=3, threads=1, verify_policy="fixed",
                        workloads=("short",), llama_cpp=str(srv), gguf=str(gguf))
    s = H.run_bench(cfg, tmp_path / "out", progress=False, plots=False, target=tiny256)
    g = {x["mode"]: x for x in s["results"]}
    assert g["dspine"]["speedup_vs_llama_cpp"]["n"] == 1 and g["llama-cpp"]["speedup_vs_llama_cpp"] is None
    assert g["llama-cpp"]["speedup"]["n"] == 1  # vs ar, per request
    assert g["llama-cpp"]["greedy_matches_ar"] == 0.0  # the fake's tokens are not the target's
    report = (tmp_path / "out" / "report.md").read_text()
    assert "vs llama-cpp" in report and "gguf_ftype=F16" in report
    row = [l for l in report.splitlines() if l.startswith("| llama-cpp |")][-1]  # the workload table's row
    assert "| 0/1 |" in row and "| – |" in row  # greedy ids = ar; the server's memory is not sampled
    assert "| 1/1 |" in [l for l in report.splitlines() if l.startswith("| dspine |")][-1]
    assert any("other rounding" in n for n in s["notes"])
    assert all(not _alive(int(p)) for p in (tmp_path / "pids").read_text().split())  # the server is stopped


def test_a_refused_rerun_keeps_the_earlier_results(fake, tiny256, tmp_path):
    srv, gguf = fake
    out = tmp_path / "out"
    out.mkdir()
    (out / "results.jsonl").write_text("{}\n")
    cfg = RC.BenchConfig(target="random:llama", modes=("ar", "llama-cpp"), settings=(RC.GREEDY,),
                        llama_cpp=str(tmp_path / "missing"), gguf=str(gguf))
    with pytest.raises(BenchError, match="--llama-cpp"):
        H.run_bench(cfg, out, progress=False, plots=False, target=tiny256, overwrite=True)
    assert (out / "results.jsonl").read_text() == "{}\n"  # nothing deleted before the settings passed
    with pytest.raises(BenchError, match="concurrency 1 only"):
        H.Harness(RC.BenchConfig(target="random:llama", modes=("ar", "llama-cpp"), concurrency=(2,),
                                settings=(RC.GREEDY,), llama_cpp=str(srv), gguf=str(gguf)), target=tiny256)


def test_llama_options_need_a_llama_mode(tiny256):
    with pytest.raises(BenchError, match="--llama-cpp / --gguf"):
        H.Harness(RC.BenchConfig(target="random:llama", modes=("ar",), gguf="x.gguf", settings=(RC.GREEDY,)),
                  target=tiny256)
    with pytest.raises(BenchError, match="llama-cpp-lookup"):  # the error lists the optional modes
        RC.parse_modes("ar,llamacpp")


# -- the real server (only where a llama.cpp build is named) ------------------------------------------
@pytest.mark.slow
@pytest.mark.skipif(not os.environ.get("DSPINE_LLAMA_CPP"), reason="needs DSPINE_LLAMA_CPP (a llama.cpp build)")
def test_real_llama_server_on_the_default_target(smol):
    if default_gguf(smol) is None:
        pytest.skip("the target's source GGUF is not in DSPINE_HOME")
    r = LlamaCppRunner(smol, "llama-cpp", threads=2, ctx=512)
    try:
        ids = smol.tokenizer.apply_chat_template([{"role": "user", "content": "Name three colors."}],
                                                 add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
        out = r.run(list(ids), SamplingConfig(), 16, [], 120.0)
        assert out["output_tokens"] > 0 and out["tokens_per_second"] > 0 and out["text"].strip()
    finally:
        r.close()
