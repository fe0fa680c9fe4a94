"""API keys: config forms, constant-time check, and the ASGI middleware on a bare Starlette app."""

import pytest
from starlette.applications import Starlette
from starlette.responses import PlainTextResponse
from starlette.routing import Route
from starlette.testclient import TestClient

from cluster.ingress.auth import ApiKeys, BearerAuth
from cluster.config.keys import resolve_keys
from cluster.config import ConfigError, check_startable, parse_config

KEY = "sk-test-0123456789"


def test_keys_from_a_list_an_env_var_or_a_file(tmp_path):
    listed = parse_config({"serve": {"api_keys": [KEY]}}, tmp_path).serve.api_keys
    assert KEY not in repr(listed) and resolve_keys(listed) == [KEY]
    env = parse_config({"serve": {"api_keys": {"env": "RDSERVE_KEYS"}}}, tmp_path).serve.api_keys
    assert resolve_keys(env, {"RDSERVE_KEYS": f"{KEY}, other-key-42"}) == [KEY, "other-key-42"]
    (tmp_path / "keys.txt").write_text(f"# team A\n{KEY}\n\n")
    filed = parse_config({"serve": {"api_keys": {"file": "keys.txt"}}}, tmp_path).serve.api_keys
    assert resolve_keys(filed) == [KEY]  # relative to the YAML's directory


@pytest.mark.parametrize("value, message", [
    ([], "empty list"),
    ({"env": "A", "file": "b"}, "exactly one of 'env' and 'file'"),
    ("sk-a-plain-string", "must be a list"),
])
def test_bad_key_settings_name_the_field(tmp_path, value, message):
    with pytest.raises(ConfigError, match=f"serve.api_keys: .*{message}"):
        parse_config({"serve": {"api_keys": value}}, tmp_path)


def test_unresolvable_or_malformed_keys_fail_at_start_without_echoing_a_key(tmp_path, monkeypatch):
    monkeypatch.delenv("RDSERVE_NO_SUCH_VAR", raising=False)
    cfg = parse_config({"serve": {"api_keys": {"env": "RDSERVE_NO_SUCH_VAR"}}}, tmp_path)
    with pytest.raises(ConfigError, match="serve.api_keys: environment variable RDSERVE_NO_SUCH_VAR is not set"):
        check_startable(cfg)
    cfg = parse_config({"serve": {"api_keys": ["has space in it"]}}, tmp_path)
    with pytest.raises(ConfigError, match="key 1 of the list") as err:
        check_startable(cfg)
    assert "has space" not in str(err.value)


def test_accepts_only_a_bearer_of_a_configured_key():
    keys = ApiKeys([KEY, "second-key-xyz"])
    assert keys.accepts(f"Bearer {KEY}") and keys.accepts("bearer second-key-xyz")
    for header in (None, "", KEY, f"Basic {KEY}", f"Bearer {KEY}x", "Bearer "):
        assert not keys.accepts(header), header
    assert not ApiKeys().active and ApiKeys([KEY]).active


def test_middleware_guards_v1_and_leaves_health_open():
    async def ok(_):
        return PlainTextResponse("ok")

    app = Starlette(routes=[Route("/v1/models", ok), Route("/health", ok)])
    keys = ApiKeys()
    app.add_middleware(BearerAuth, keys=keys)
    client = TestClient(app)
    assert client.get("/v1/models").status_code == 200  # no keys configured: open
    keys.set([KEY])
    denied = client.get("/v1/models", headers={"Authorization": "Bearer wrong-key-123"})
    assert denied.status_code == 401 and denied.headers["www-authenticate"] == "Bearer"
    error = denied.json()["error"]
    assert error["code"] == "invalid_api_key" and error["message"].startswith("Authorization:")
    assert "wrong-key-123" not in denied.text
    assert client.get("/v1/models", headers={"Authorization": f"Bearer {KEY}"}).status_code == 200
    assert client.get("/health").status_code == 200


@pytest.mark.parametrize("masked", ["**********", "********", "*" * 40])
def test_the_masked_form_of_a_key_is_never_a_key(tmp_path, masked):
    """A config printed or dumped shows each key as '**********'; read back, that must fail, not become the key."""
    with pytest.raises(ConfigError, match=r"serve.api_keys: .*key 2 of the list is only '\*' characters"):
        parse_config({"serve": {"api_keys": [KEY, masked]}}, tmp_path)  # a YAML holding it fails at load
    env = parse_config({"serve": {"api_keys": {"env": "RDSERVE_KEYS"}}}, tmp_path).serve.api_keys
    with pytest.raises(ValueError, match=r"key 1 of environment variable RDSERVE_KEYS is only '\*' characters"):
        resolve_keys(env, {"RDSERVE_KEYS": masked})
    (tmp_path / "keys.txt").write_text(f"{KEY}\n{masked}\n")
    filed = parse_config({"serve": {"api_keys": {"file": "keys.txt"}}}, tmp_path)
    with pytest.raises(ConfigError, match=r"serve.api_keys: key 2 of file .*keys.txt is only '\*' characters"):
        check_startable(filed)
    with pytest.raises(ValueError, match=r"only '\*' characters"):
        ApiKeys([KEY, masked])
    assert ApiKeys(["sk-*-*-*-*"]).accepts("Bearer sk-*-*-*-*")  # a '*' within a key is fine
