"""API keys of ``dspine serve`` (``--api-key``, ``DSPINE_API_KEY``, ``--api-keys-file``).

As vLLM's and llama-server's ``--api-key``: with keys set, every ``/v1/*`` request must
carry ``Authorization: Bearer <key>``; others get HTTP 401 in the OpenAI error shape
(``code: invalid_api_key``). ``/health`` and ``/metrics`` stay open (probes and scrapers
carry no key; neither shows request text). Each key belongs to a *tenant*, named on the
server side: the cross-request output cache (:mod:`dspine.proposers.cache`) shares copies
only among requests of one tenant, so a client cannot claim another's tenant by what it
sends. A keys file holds one ``KEY [TENANT]`` per line (``#`` at the start of a line or after
a space starts a comment; a key or tenant holding ``#`` is refused); a key
without a tenant name is its own tenant (named by a digest of the key, never the key).
"""
from __future__ import annotations

import hashlib
import hmac
import os
from pathlib import Path

ENV = "DSPINE_API_KEY"  # one key, or several separated by commas


class AuthError(ValueError):
    """A bad key setting (names the flag)."""


def _digest(key: str) -> str:
    return "key:" + hashlib.sha256(key.encode()).hexdigest()[:24]


class APIKeys:
    """Accepted keys and their tenants.

    Args:
        keys: key -> tenant name (None: the key's own digest).
    Raises:
        AuthError: no keys, or a key that is empty or holds whitespace.
    """

    def __init__(self, keys: dict[str, str | None]):
        if not keys:
            raise AuthError("--api-key: no keys given")
        for k in keys:
            if not k or any(c.isspace() for c in k):
                raise AuthError("--api-key: a key must be non-empty and hold no whitespace")
        self._keys = {k: ("tenant:" + t if t else _digest(k)) for k, t in keys.items()}

    def __len__(self) -> int:
        return len(self._keys)

    def tenant(self, authorization: str | None) -> str | None:
        """The tenant of a request's ``Authorization`` header value, or None when it does not
        carry an accepted ``Bearer`` key (every key is compared in constant time)."""
        if not authorization:
            return None
        scheme, _, given = authorization.partition(" ")
        if scheme.lower() != "bearer":
            return None
        given = given.strip().encode()
        found = None
        for k, t in self._keys.items():
            if hmac.compare_digest(k.encode(), given):
                found = t
        return found

    @classmethod
    def from_settings(cls, keys: list[str] | None = None, keys_file: str | None = None,
                      env: dict | None = None) -> "APIKeys | None":
        """Keys from ``--api-key`` (repeatable), ``--api-keys-file`` and, when neither is
        given, ``$DSPINE_API_KEY`` (comma-separated); None when there are none (no auth).

        Raises:
            AuthError: an unreadable, malformed or empty keys file (an empty one would leave
                the server open), or a bad key.
        """
        env = os.environ if env is None else env
        out: dict[str, str | None] = {k: None for k in (keys or [])}
        if keys_file:
            try:
                lines = Path(keys_file).read_text(encoding="utf-8").splitlines()
            except OSError as e:
                raise AuthError(f"--api-keys-file {keys_file}: cannot be read ({e.strerror or e})") from None
            except UnicodeDecodeError as e:
                raise AuthError(f"--api-keys-file {keys_file}: is not UTF-8 text ({e.reason} at byte {e.start})") from None
            found = 0
            for i, line in enumerate(lines, 1):
                line = line.strip()
                if not line or line.startswith("#"):
                    continue
                if "#" in line:  # a comment after the fields, or a key holding '#': say which, never guess
                    head, _, _ = line.partition("#")
                    if head and not head[-1].isspace():
                        raise AuthError(f"--api-keys-file {keys_file} line {i}: '#' inside a key or tenant; "
                                        f"keys must not hold '#' (a comment starts with '#' after a space)")
                    line = head.strip()
                parts = line.split()
                if len(parts) > 2:
                    raise AuthError(f"--api-keys-file {keys_file} line {i}: expected 'KEY [TENANT]', "
                                    f"got {len(parts)} fields")
                out[parts[0]] = parts[1] if len(parts) == 2 else None
                found += 1
            if not found:
                raise AuthError(f"--api-keys-file {keys_file}: holds no key (a keys file that leaves the "
                                f"server open to every client is refused; give 'KEY [TENANT]' lines)")
        if not out and not keys_file and env.get(ENV):
            out = {k.strip(): None for k in env[ENV].split(",") if k.strip()}
        return cls(out) if out else None
