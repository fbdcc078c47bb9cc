"""Run llama.cpp's ``llama-server`` on token-id prompts, plain and with a DFlash draft GGUF.

Standard library only; called by ``run.py``. Starts the server on loopback, sends each
prompt to ``/completion`` (greedy, no prompt cache), stops the server. Output JSON:
per prompt the output ids, wall time and the server's timings (``draft_n``,
``draft_n_accepted`` when a drafter ran).
"""
from __future__ import annotations

import argparse
import json
import socket
import subprocess
import time
import urllib.request


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def post(url: str, body: dict, timeout: float = 600) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--server", required=True, help="path to llama-server")
    ap.add_argument("--model", required=True, help="target GGUF")
    ap.add_argument("--draft", default=None, help="DFlash drafter GGUF (dspine export --format gguf)")
    ap.add_argument("--prompts", required=True)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--spec-tokens", type=int, default=15)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", required=True)
    ap.add_argument("--log", default=None)
    ap.add_argument("--source", default=None, help="where the llama.cpp build came from (recorded)")
    a = ap.parse_args()
    port = free_port()
    cmd = [a.server, "-m", a.model, "--host", "127.0.0.1", "--port", str(port), "-t", str(a.threads),
           "-tb", str(a.threads), "-c", "2048", "-np", "1", "--temp", "0", "--no-warmup"]
    if a.draft:
        cmd += ["--spec-type", "draft-dflash", "-md", a.draft, "--spec-draft-n-max", str(a.spec_tokens),
                "--spec-draft-n-min", "0", "--spec-draft-p-min", "0"]
    log = open(a.log or "/dev/null", "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        t0 = time.time()
        while True:
            if proc.poll() is not None:
                raise SystemExit(f"llama-server exited with {proc.returncode}; see {a.log}")
            try:
                with urllib.request.urlopen(base + "/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if time.time() - t0 > 300:
                raise SystemExit("llama-server did not become ready in 300 s")
            time.sleep(0.5)
        load_s = time.time() - t0
        prompts = json.load(open(a.prompts))
        body = dict(n_predict=a.max_tokens, temperature=0.0, top_k=1, cache_prompt=False, return_tokens=True,
                    samplers=["top_k"], seed=0)
        post(base + "/completion", dict(body, prompt=prompts[0]))  # warm-up
        outs, walls, timings = [], [], []
        for p in prompts:
            t0 = time.time()
            r = post(base + "/completion", dict(body, prompt=p))
            walls.append(time.time() - t0)
            outs.append(r.get("tokens", []))
            timings.append(r.get("timings", {}))
        props = json.loads(urllib.request.urlopen(base + "/props", timeout=10).read())
        json.dump({"engine": "llama.cpp", "build": props.get("build_info"), "source": a.source, "threads": a.threads,
                   "draft": a.draft, "load_s": load_s, "outputs": outs, "wall_s": walls, "timings": timings},
                  open(a.out, "w"))
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()


if __name__ == "__main__":
    main()
