"""Push the dashboard to Grafana through its HTTP API with grafana-client.

Grafana's contract (``POST /api/dashboards/db``, ``Authorization: Bearer TOKEN``): the body is
``{"dashboard": {...uid, title, version...}, "folderUid": ..., "overwrite": bool, "message": ...}``;
saving over a stored dashboard needs the stored ``version`` (else 412 ``version-mismatch``), and a
different dashboard with the same title in the folder is 412 ``name-exists``. The dashboard built in
code is the source of truth: :func:`push_dashboard` reads the stored version and saves over it, so a
save made in Grafana between that read and our write is a 412 conflict, reported, never silently lost;
``overwrite`` replaces whatever is there.
"""

from __future__ import annotations

from urllib.parse import urlsplit

from grafana_client import GrafanaApi
from grafana_client.client import GrafanaClientError, GrafanaException, GrafanaUnauthorizedError

FOLDER_UID = "rdserve"
TIMEOUT_S = 10.0


class PushError(RuntimeError):
    """Grafana refused or could not be reached; the message says what to do."""


def shown_url(url: str) -> str:
    """``url`` without any ``user:password@`` part, for messages."""
    parts = urlsplit(url)
    return parts._replace(netloc=parts.netloc.rpartition("@")[2]).geturl() if "@" in parts.netloc else url


def push_dashboard(url: str, token: str, dashboard: dict, folder_title: str = "rdserve",
                   folder_uid: str = FOLDER_UID, overwrite: bool = False) -> dict:
    """Create or update ``dashboard`` (Grafana JSON with ``uid``) in folder ``folder_uid`` (created
    with ``folder_title`` when missing).

    Returns:
        Grafana's answer (``uid``, ``url``, ``version``, ``status``).

    Raises:
        PushError: 401 (token), 403, 412 (conflict), other HTTP errors, a URL that is not
            ``http(s)://HOST[:PORT][/PATH]``, or an unreachable server.
    """
    shown, parts = shown_url(url), urlsplit(url)
    try:
        valid = parts.scheme in ("http", "https") and bool(parts.hostname) and (parts.port or 1) > 0
    except ValueError:  # a port that is not a number in 0-65535
        valid = False
    if not valid:
        raise PushError(f"--grafana-url {shown!r} is not an http(s)://HOST[:PORT] URL")
    api = GrafanaApi.from_url(url, credential=token, timeout=TIMEOUT_S)
    url = shown  # messages below never show credentials written into the URL
    try:
        try:
            api.folder.get_folder(folder_uid)
        except GrafanaClientError as err:
            if err.status_code != 404:
                raise
            api.folder.create_folder(folder_title, uid=folder_uid)
        body = dict(dashboard, id=None)
        try:
            stored = api.dashboard.get_dashboard(dashboard["uid"])
            body["version"] = stored["dashboard"].get("version", 0)
        except GrafanaClientError as err:
            if err.status_code != 404:
                raise
            body.pop("version", None)
        return api.dashboard.update_dashboard({"dashboard": body, "folderUid": folder_uid, "overwrite": overwrite,
                                               "message": "rdserve dashboards push"})
    except GrafanaUnauthorizedError:
        raise PushError(f"Grafana at {url} answered 401 Unauthorized: the token was not accepted (a service "
                        "account token with the Editor role is needed)") from None
    except GrafanaClientError as err:
        detail = err.response.get("message", err.message) if isinstance(err.response, dict) else err.message
        if err.status_code == 412:
            status = err.response.get("status", "conflict") if isinstance(err.response, dict) else "conflict"
            raise PushError(f"Grafana at {url} answered 412 ({status}): {detail}. The dashboard was changed in "
                            "Grafana meanwhile, or another dashboard has its title in the folder; re-run to "
                            "save over the new version, or pass --overwrite to replace it") from None
        if err.status_code == 403:
            raise PushError(f"Grafana at {url} answered 403 Forbidden: the token may not write dashboards or "
                            f"folder '{folder_uid}' ({detail})") from None
        raise PushError(f"Grafana at {url} answered {err.status_code}: {detail}") from None
    except GrafanaException as err:
        raise PushError(f"Grafana at {url}: {err.message}") from None
    except OSError as err:  # the transport's errors (connection refused, DNS, timeout) are OSErrors
        raise PushError(f"Grafana at {url} could not be reached: {type(err).__name__}: {err}") from None
