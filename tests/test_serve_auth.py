"""``dspine serve --api-key``: keyless or wrong-key ``/v1/*`` requests get 401 in the OpenAI
error shape (checked with the ``openai`` client too); tenants of the output cache come from
the server's key mapping, never from what a client sends."""
from __future__ import annotations

import httpx
import openai
import pytest

from dspine.core.batch import BatchEngine
from dspine.cli.main import main
from dspine.config import SamplingConfig
from dspine.core.engine import Engine
from dspine.proposers import NgramProposer, output_cache_of
from dspine.proposers.cache import OutputCache
from dspine.serve import ServerThread, create_app
from dspine.serve.auth import APIKeys, AuthError
from dspine.target.adapter import load_target

pytestmark = pytest.mark.usefixtures("one_thread_module")
MODEL = "random:llama"


@pytest.fixture(scope="module")
def target():
    return load_target(MODEL)


@pytest.fixture(scope="module")
def server(target):
    eng = Engine(target, NgramProposer(16, 4, 1, cache=OutputCache(10_000, 4)), "dspine")
    keys = APIKeys({"k-alone": None, "k-team-1": "team", "k-team-2": "team"})
    app = create_app(BatchEngine(eng, 4), MODEL, max_queue=8, info={"mode": "dspine"}, api_keys=keys)
    with ServerThread(app) as srv:
        yield srv


def _post(srv, headers=None, prompt="hello world"):
    return httpx.post(srv.url + "/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 8,
                                                         "temperature": 0}, headers=headers or {}, timeout=60)


def test_keyless_and_wrong_key_requests_get_401(server):
    for headers in ({}, {"Authorization": "Bearer nope"}, {"Authorization": "k-alone"},
                    {"Authorization": "Basic k-alone"}):
        r = _post(server, headers)
        assert r.status_code == 401, (headers, r.text)
        err = r.json()["error"]
        assert err["code"] == "invalid_api_key" and err["type"] == "invalid_request_error" and err["message"]
        assert r.headers["www-authenticate"] == "Bearer"
    assert httpx.get(server.url + "/v1/models", timeout=10).status_code == 401
    # probes stay open
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200
    assert httpx.get(server.url + "/metrics", timeout=10).status_code == 200


def test_openai_client_with_and_without_the_key(server, target):
    bad = openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as e:
        bad.completions.create(model=MODEL, prompt="hello world", max_tokens=8, temperature=0)
    assert e.value.status_code == 401
    good = openai.OpenAI(base_url=server.url + "/v1", api_key="k-alone", max_retries=0)
    r = good.completions.create(model=MODEL, prompt="hello world", max_tokens=8, temperature=0)
    ref = Engine(target, None, "ar").generate(target.encode_prompt("hello world"), SamplingConfig(), 8)
    assert r.choices[0].text == ref.text
    assert [m.id for m in good.models.list().data] == [MODEL]


def test_tenants_come_from_the_server_side_mapping(server):
    cache = output_cache_of(server.app.state.batch.engine.proposer)
    cache.clear()
    for key in ("k-alone", "k-team-1", "k-team-2"):
        assert _post(server, {"Authorization": f"Bearer {key}"}, prompt="abc abc abc").status_code == 200
    tenants = {t for t, _ in cache._entries.values()}
    # two keys of one team share its tenant; the lone key is its own; no raw header is a tenant
    assert "tenant:team" in tenants and len(tenants) == 2
    assert not any("k-" in t for t in tenants)


def test_key_settings():
    assert APIKeys.from_settings(None, None, env={}) is None
    keys = APIKeys.from_settings(None, None, env={"DSPINE_API_KEY": "a, b"})
    assert len(keys) == 2 and keys.tenant("Bearer b") is not None and keys.tenant("Bearer c") is None
    assert keys.tenant(None) is None and keys.tenant("bearer a") == keys.tenant("Bearer a")
    with pytest.raises(AuthError, match="--api-key"):
        APIKeys({"has space": None})


def test_keys_file_comments_and_hashes(tmp_path):
    """'#' starts a comment at a line's start or after a space; a '#' inside a key is
    refused (it used to cut the key there, silently); a non-UTF-8 file names the flag."""
    f = tmp_path / "keys"
    f.write_text("# team keys\nk1 team1   # the first\n  k2\n")
    keys = APIKeys.from_settings(None, str(f), env={})
    assert len(keys) == 2 and keys.tenant("Bearer k1") == "tenant:team1" and keys.tenant("Bearer k2") is not None
    f.write_text("abc#def team1\n")
    with pytest.raises(AuthError, match="line 1: '#' inside a key"):
        APIKeys.from_settings(None, str(f), env={})
    f.write_bytes(b"k1 \xff\n")
    with pytest.raises(AuthError, match="--api-keys-file .* is not UTF-8"):
        APIKeys.from_settings(None, str(f), env={})


def test_serve_refuses_an_unreadable_keys_file(capsys, tmp_path):
    code = main(["serve", "--target", MODEL, "--mode", "ar", "--port", "0",
                 "--api-keys-file", str(tmp_path / "missing")])
    err = capsys.readouterr().err
    assert code == 2 and "--api-keys-file" in err and "cannot be read" in err
    bad = tmp_path / "keys"
    bad.write_text("k1 team extra\n")
    assert main(["serve", "--target", MODEL, "--mode", "ar", "--port", "0", "--api-keys-file", str(bad)]) == 2
    assert "line 1" in capsys.readouterr().err
    empty = tmp_path / "empty"  # only comments: it would leave the server open to every client
    empty.write_text("# keys go here\n\n")
    assert main(["serve", "--target", MODEL, "--mode", "ar", "--port", "0", "--api-keys-file", str(empty)]) == 2
    assert "holds no key" in capsys.readouterr().err


def test_serve_refuses_an_unknown_log_level(capsys):
    assert main(["serve", "--target", MODEL, "--mode", "ar", "--port", "0", "--log-level", "bogus"]) == 2
    assert "--log-level: invalid choice: 'bogus'" in capsys.readouterr().err
