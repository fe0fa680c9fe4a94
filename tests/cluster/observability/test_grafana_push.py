"""``rdserve dashboards push`` against a fake Grafana that checks the API contract (fake_grafana.py)."""

import pytest
from fake_grafana import FakeGrafana
from typer.testing import CliRunner

from cluster.cli.main import app

TOKEN = "glsa_test_token"


def push(url: str, *args: str, token: str | None = TOKEN):
    env = {"GRAFANA_TOKEN": token} if token is not None else {}
    return CliRunner().invoke(app, ["dashboards", "push", "--grafana-url", url, *args], env=env)


@pytest.fixture
def grafana():
    with FakeGrafana(TOKEN) as g:
        yield g


def test_push_creates_the_folder_and_dashboard_then_updates_it(grafana):
    result = push(grafana.url)
    assert result.exit_code == 0, result.output
    assert "version 1" in result.output and grafana.folders["rdserve"]["title"] == "rdserve"
    stored = grafana.dashboards["rdserve"]
    assert stored["title"] == "rdserve" and stored["_folder"] == "rdserve" and len(stored["panels"]) > 20
    method, path, body = grafana.requests[-1]
    assert (method, path, body["overwrite"], body["folderUid"]) == ("POST", "/api/dashboards/db", False, "rdserve")
    result = push(grafana.url)  # again: saved over the stored version, no conflict
    assert result.exit_code == 0, result.output
    assert grafana.dashboards["rdserve"]["version"] == 2 and len(grafana.folders) == 1


def test_a_wrong_token_is_reported_as_401(grafana):
    result = push(grafana.url, token="wrong")
    assert result.exit_code == 1
    assert "401 Unauthorized" in result.output and "token" in result.output
    assert not grafana.dashboards


def test_a_missing_token_names_the_environment_variable(grafana):
    result = push(grafana.url, "--token-env", "MY_GRAFANA_TOKEN", token=None)
    assert result.exit_code == 2 and "MY_GRAFANA_TOKEN" in result.output
    assert not grafana.requests


def test_a_concurrent_edit_is_a_412_conflict_reported_and_overwrite_replaces_it(grafana):
    assert push(grafana.url).exit_code == 0
    grafana.edit_between_read_and_write = True  # someone saves in Grafana between our read and write
    result = push(grafana.url)
    assert result.exit_code == 1
    assert "412 (version-mismatch)" in result.output and "--overwrite" in result.output
    assert grafana.dashboards["rdserve"]["version"] == 2  # their save stands
    grafana.edit_between_read_and_write = True
    result = push(grafana.url, "--overwrite")
    assert result.exit_code == 0, result.output
    assert grafana.dashboards["rdserve"]["version"] == 4 and grafana.requests[-1][2]["overwrite"] is True


def test_another_dashboard_with_the_title_is_a_412_name_conflict(grafana):
    grafana.folders["rdserve"] = {"uid": "rdserve", "title": "rdserve", "id": 1}
    grafana.dashboards["other"] = {"uid": "other", "title": "rdserve", "version": 3, "_folder": "rdserve", "panels": []}
    result = push(grafana.url)
    assert result.exit_code == 1 and "412 (name-exists)" in result.output


def test_an_unreachable_or_malformed_url_is_one_clear_line_without_credentials():
    import socket

    with socket.socket() as s:  # a port nothing listens on once closed
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    result = push(f"http://admin:hunter2@127.0.0.1:{port}")
    assert result.exit_code == 1
    assert f"Grafana at http://127.0.0.1:{port} could not be reached" in result.output, result.output
    assert "Traceback" not in result.output and "hunter2" not in result.output and TOKEN not in result.output
    for bad in ("grafana:3000", "ftp://grafana", "http://grafana:99999"):
        result = push(bad)
        assert result.exit_code == 1 and "is not an http(s)://HOST[:PORT] URL" in result.output, result.output


def test_a_rejected_token_never_appears_in_the_output(grafana):
    result = push(grafana.url, token="glsa_rejected_secret")
    assert result.exit_code == 1 and "401" in result.output and "glsa_rejected_secret" not in result.output
