"""A small HTTP server that checks Grafana's folder and dashboard API contract and answers as Grafana
does (Grafana itself cannot be installed here: its licence keeps it out of the package registries).

Contract checked (Grafana HTTP API, "Dashboard API" and "Folder API"): ``Authorization: Bearer
<token>`` on every call (else 401 ``{"message": "Unauthorized"}``); ``GET /api/folders/:uid`` (404
when missing); ``POST /api/folders`` ``{"title", "uid"}``; ``GET /api/dashboards/uid/:uid``
``{"dashboard", "meta"}`` (404 when missing); ``POST /api/dashboards/db`` with ``{"dashboard": {uid,
title, panels, ...}, "folderUid": str, "overwrite": bool, "message": str}`` (400 on another shape);
a stored dashboard is saved over only with its current ``version`` or ``overwrite`` (else 412
``version-mismatch``); another uid with the same title in the folder is 412 ``name-exists``.
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class FakeGrafana:
    """``with FakeGrafana(token) as g:`` serves at ``g.url``; ``g.folders``, ``g.dashboards`` (uid ->
    stored dashboard), ``g.requests`` (method, path, body); ``g.edit_between_read_and_write``: a
    Grafana user saves the dashboard right after its next ``GET``."""

    def __init__(self, token: str):
        self.token = token
        self.folders: dict[str, dict] = {}
        self.dashboards: dict[str, dict] = {}
        self.requests: list[tuple[str, str, dict | None]] = []
        self.edit_between_read_and_write = False
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *_):
                pass

            def _answer(self, status: int, body: dict) -> None:
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _handle(self, method: str) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(length)) if length else None
                fake.requests.append((method, self.path, body))
                if self.headers.get("Authorization") != f"Bearer {fake.token}":
                    return self._answer(401, {"message": "Unauthorized"})
                status, answer = fake.route(method, self.path, body)
                self._answer(status, answer)

            def do_GET(self):
                self._handle("GET")

            def do_POST(self):
                self._handle("POST")

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def __enter__(self) -> FakeGrafana:
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *_):
        self.server.shutdown()
        self.server.server_close()

    def route(self, method: str, path: str, body) -> tuple[int, dict]:
        if method == "GET" and path.startswith("/api/folders/"):
            uid = path.rsplit("/", 1)[1]
            return (200, self.folders[uid]) if uid in self.folders else (404, {"message": "folder not found"})
        if method == "POST" and path == "/api/folders":
            if not isinstance(body, dict) or not isinstance(body.get("title"), str):
                return 400, {"message": "bad request data"}
            uid = body.get("uid") or f"f{len(self.folders)}"
            self.folders[uid] = {"uid": uid, "title": body["title"], "id": len(self.folders) + 1}
            return 200, self.folders[uid]
        if method == "GET" and path.startswith("/api/dashboards/uid/"):
            uid = path.rsplit("/", 1)[1]
            if uid not in self.dashboards:
                return 404, {"message": "Dashboard not found"}
            stored = dict(self.dashboards[uid])
            if self.edit_between_read_and_write:
                self.edit_between_read_and_write = False
                self.dashboards[uid] = dict(stored, version=stored["version"] + 1)
            return 200, {"dashboard": stored, "meta": {"folderUid": stored["_folder"]}}
        if method == "POST" and path == "/api/dashboards/db":
            return self.save(body)
        return 404, {"message": "Not found"}

    def save(self, body) -> tuple[int, dict]:
        ok = (isinstance(body, dict) and isinstance(body.get("dashboard"), dict)
              and isinstance(body.get("overwrite"), bool) and isinstance(body.get("folderUid"), str)
              and isinstance(body["dashboard"].get("uid"), str) and isinstance(body["dashboard"].get("title"), str)
              and isinstance(body["dashboard"].get("panels"), list))
        if not ok:
            return 400, {"message": "bad request data"}
        dash, folder = body["dashboard"], body["folderUid"]
        if folder not in self.folders:
            return 400, {"message": "folder not found"}
        for uid, other in self.dashboards.items():
            if uid != dash["uid"] and other["title"] == dash["title"] and other["_folder"] == folder \
                    and not body["overwrite"]:
                return 412, {"status": "name-exists",
                             "message": "A dashboard with the same name in the folder already exists"}
        stored = self.dashboards.get(dash["uid"])
        if stored is not None and not body["overwrite"] and dash.get("version") != stored["version"]:
            return 412, {"status": "version-mismatch",
                         "message": "The dashboard has been changed by someone else"}
        version = 1 if stored is None else stored["version"] + 1
        self.dashboards[dash["uid"]] = dict(dash, version=version, _folder=folder)
        return 200, {"id": 1, "uid": dash["uid"], "url": f"/d/{dash['uid']}/{dash['uid']}", "status": "success",
                     "version": version, "slug": dash["uid"]}
