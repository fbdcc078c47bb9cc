"""Running the app with uvicorn on a socket we bind ourselves (so port 0 works)."""
from __future__ import annotations

import socket
import threading
import time


def bind_socket(host: str = "127.0.0.1", port: int = 0) -> socket.socket:
    """A listening TCP socket on (host, port); port 0 picks a free port.

    Raises:
        ValueError: the address cannot be bound (message names --host/--port).
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise ValueError(f"--host {host} --port {port}: cannot listen there ({e.strerror or e})") from None
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def make_server(app, shutdown_timeout: float = 30.0, log_level: str = "warning"):
    """A uvicorn server for ``app`` whose graceful shutdown ends requests cleanly.

    uvicorn gives open connections ``shutdown_timeout`` seconds, then cancels their
    handlers, which would answer with a bare 500 or cut a stream short. So shortly
    before that deadline (``shutdown_timeout`` minus min(1 s, half of it)) the app's
    scheduler (``app.state.scheduler``, if any) is stopped: requests still running get
    an OpenAI-style 503 (JSON, or an SSE error event and ``[DONE]``) and their state is
    freed.
    """
    import uvicorn

    class _Server(uvicorn.Server):
        async def shutdown(self, sockets=None):
            sched = getattr(getattr(app, "state", None), "scheduler", None)
            if sched is not None:
                t = float(shutdown_timeout)
                timer = threading.Timer(max(0.0, t - min(1.0, t / 2)), sched.stop)
                timer.daemon = True
                timer.start()
            await super().shutdown(sockets=sockets)

    cfg = uvicorn.Config(app, log_level=log_level, lifespan="on", timeout_graceful_shutdown=shutdown_timeout,
                         access_log=False, timeout_keep_alive=5)
    return _Server(cfg)


class ServerThread:
    """uvicorn serving ``app`` from a background thread on ``host``:``port`` (0 = free port).

    Use as a context manager, or :meth:`start` / :meth:`stop`. ``url`` is the base URL.
    """

    def __init__(self, app, host: str = "127.0.0.1", port: int = 0, shutdown_timeout: float = 10.0,
                 log_level: str = "warning"):
        self.app = app
        self.sock = bind_socket(host, port)
        self.host, self.port = host, self.sock.getsockname()[1]
        self.url = f"http://{host}:{self.port}"
        self.server = make_server(app, shutdown_timeout, log_level)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]},
                                       name="dspine-uvicorn", daemon=True)

    def start(self, timeout: float = 60.0) -> "ServerThread":
        self.thread.start()
        t0 = time.monotonic()
        while not self.server.started:
            if not self.thread.is_alive():
                raise RuntimeError("server thread exited during start-up")
            if time.monotonic() - t0 > timeout:
                raise TimeoutError("server did not start")
            time.sleep(0.02)
        return self

    def stop(self, timeout: float = 30.0) -> None:
        self.server.should_exit = True
        self.thread.join(timeout)

    def __enter__(self) -> "ServerThread":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
