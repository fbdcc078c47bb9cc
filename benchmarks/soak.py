"""Soak ``dspine serve`` on loopback: 500+ mixed requests from 8 concurrent clients.

Starts ``dspine serve`` as its own process (the defaults, real target unless ``--target``
says otherwise, an API key, an output cache), runs :func:`dspine.serve.soak.soak` against it
(greedy / seeded, streamed or not, stop strings, mid-stream disconnects, malformed bodies,
oversize prompts; every greedy answer compared with its single-request run), reads the
server's resident memory from /proc before and after, stops it with SIGTERM (it must exit
0) and writes the result with the machine line, the commit and the date.

    python benchmarks/soak.py --n 540 --out benchmarks/soak/avx512-2026-12-04.json

Exit status 1 when the soak found a wrong or lost answer, a 5xx, a leaked slot or memory
more than 10% above the warm baseline.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--n", type=int, default=540, help="requests (cycled over the request kinds)")
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--max-running", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--deadline", type=float, default=3000.0, help="seconds for the whole soak")
    ap.add_argument("--out", default=None, help="results JSON (default: print only)")
    args = ap.parse_args()

    from dspine.serve.soak import rss_of, soak
    from dspine.tune.machine import describe

    key = "soak-" + os.urandom(6).hex()
    cmd = [sys.executable, "-m", "dspine.cli", "serve", "--target", args.target, "--port", "0",
           "--max-running", str(args.max_running), "--ngram-cache-tokens", "20000", "--api-key", key]
    srv = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    url = None
    t0 = time.monotonic()
    while url is None and time.monotonic() - t0 < 900:
        line = srv.stdout.readline()
        if not line:
            raise SystemExit(f"dspine serve exited {srv.wait()}: {srv.stderr.read()[-2000:]}")
        if "listening on " in line:
            url = line.split("listening on ", 1)[1].strip()
    for line in iter(srv.stdout.readline, ""):  # the model line and the endpoint line follow
        if "endpoints" in line:
            break
    load0 = os.getloadavg()
    last = [0.0]

    def progress(done, n):
        if time.monotonic() - last[0] > 10 or done == n:
            last[0] = time.monotonic()
            print(f"soak: {done}/{n} requests", file=sys.stderr, flush=True)

    try:
        res = soak(url, n=args.n, clients=args.clients, seed=args.seed, max_tokens=args.max_tokens,
                   api_key=key, rss=rss_of(srv.pid), deadline_s=args.deadline, progress=progress)
    finally:
        srv.send_signal(signal.SIGTERM)
        code = srv.wait(120)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    out = {"machine": describe(), "load_average_start_end": [round(load0[0], 2), round(os.getloadavg()[0], 2)],
           "commit": commit, "date": time.strftime("%Y-%m-%d"), "command": " ".join(cmd[2:]).replace(key, "KEY"),
           "server_exit_code": code, **res.to_dict()}
    out["ok"] = out["ok"] and code == 0
    b, a = res.before, res.after
    print(f"soak: {res.requests} requests from {args.clients} clients in {res.wall_s:.0f} s: "
          f"{len(res.wrong)} wrong, {len(res.lost)} lost, {len(res.unexpected)} unexpected, "
          f"{res.server_errors} 5xx; statuses {res.statuses}; slots free {b.get('free_slots')} -> "
          f"{a.get('free_slots')}; RSS {b.get('rss_bytes', 0) / 2**20:.0f} -> {a.get('rss_bytes', 0) / 2**20:.0f} MiB; "
          f"server exit {code}; {'OK' if out['ok'] else 'FAILED'}")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    return 0 if out["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
