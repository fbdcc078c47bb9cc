"""OpenAI-compatible serving with batched speculative decoding (``dspine serve``).

:func:`create_app` builds the FastAPI app over a :class:`~dspine.core.batch.BatchEngine`;
:class:`ServerThread` runs it with uvicorn in a background thread (tests, embedding);
``dspine serve`` (:mod:`dspine.serve.cli`) runs it in the foreground. Names are
imported lazily so that ``dspine --help`` does not load the web stack.
"""
from __future__ import annotations

import importlib

_NAMES = {"create_app": "app", "encode_chat": "app", "Scheduler": "scheduler", "Job": "scheduler",
          "QueueFull": "scheduler", "ShuttingDown": "scheduler", "ServerThread": "server",
          "bind_socket": "server", "Metrics": "metrics"}

__all__ = sorted(_NAMES)


def __getattr__(name: str):
    if name in _NAMES:
        return getattr(importlib.import_module(f".{_NAMES[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
