"""The local Hub's HTTP server: each request to the API (api.py) or, under /_localcloud/, to the
emulator's own controls (control.py); errors answered in the Hub's shape; the request log.

Owns: Handler, HubServer, make_server. Imports api, accounts, control, protocol and store; no
module of the local Hub imports it but the entry points (__init__, __main__).
"""

from __future__ import annotations

import json
import logging
import secrets
import traceback
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote

from .._daemon import RequestLog
from .accounts import Accounts
from .api import HubApi
from .control import ControlApi
from .protocol import CONTROL_PREFIX, HubError, Reply, Request
from .store import Store, now_iso

log = logging.getLogger(__name__)


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True  # see localcloud/storage/server.py
    server_version = "localcloud-hub/1"
    hub: HubApi  # set on the subclass made by make_server
    control: ControlApi
    request_log: RequestLog

    def do_GET(self) -> None:
        self._handle("GET")

    def do_HEAD(self) -> None:
        self._handle("HEAD")

    def do_POST(self) -> None:
        self._handle("POST")

    def do_PUT(self) -> None:
        self._handle("PUT")

    def do_DELETE(self) -> None:
        self._handle("DELETE")

    def _handle(self, method: str) -> None:
        req = Request(self, method)
        is_control = req.path.startswith(CONTROL_PREFIX)
        try:
            reply = self.control.dispatch(req) if is_control else self.hub.dispatch(req)
        except HubError as exc:
            headers = {"X-Error-Message": exc.message, **exc.headers}
            if exc.code:
                headers["X-Error-Code"] = exc.code
            reply = Reply(exc.status, {"error": exc.message}, headers)
        except Exception:
            log.error("unhandled error on %s %s:\n%s", method, self.path, traceback.format_exc())
            reply = Reply(500, {"error": "Internal error (localcloud hub)"})
        req.drain()  # keep-alive: the next request starts after this body
        if not is_control:
            # Logged before answering, so a client that got its answer finds its request logged.
            query = {k: v[0] if len(v) == 1 else v for k, v in req.query.items() if k != "signature"}
            self.request_log.append({"time": now_iso(), "method": method, "path": unquote(req.path),
                                     "query": query, "status": reply.status, "user": req.caller.user})
        self._send(reply, head_only=method == "HEAD")

    def _send(self, reply: Reply, head_only: bool) -> None:
        headers = {"X-Request-Id": secrets.token_hex(8), **reply.headers}
        data = b""
        if reply.file is None:
            data = json.dumps(reply.payload).encode() if reply.payload is not None else b""
            headers.setdefault("Content-Type", "application/json; charset=utf-8")
        self.send_response(reply.status)
        for name, value in headers.items():
            # Header values are latin-1 on one line; error messages are free text.
            self.send_header(name, " ".join(str(value).split()).encode("ascii", "replace").decode())
        self.send_header("Content-Length", str(reply.length if reply.file is not None else len(data)))
        self.end_headers()
        if head_only:
            return
        if reply.file is None:
            self.wfile.write(data)
            return
        with open(reply.file, "rb") as f:
            f.seek(reply.start)
            remaining = reply.length
            while remaining > 0:
                piece = f.read(min(remaining, 1 << 20))
                if not piece:
                    break
                self.wfile.write(piece)
                remaining -= len(piece)

    def log_message(self, format: str, *args) -> None:
        log.debug("%s - %s", self.address_string(), format % args)


class HubServer(ThreadingHTTPServer):
    daemon_threads = True
    block_on_close = False


def make_server(state_dir: Path, host: str = "127.0.0.1", port: int = 0) -> HubServer:
    """The Hub server over STATE_DIR/hub/ (repos, objects, users); requests log to STATE_DIR/hub-requests.jsonl."""
    store = Store(state_dir / "hub")
    hub = HubApi(store, Accounts(state_dir / "hub" / "users.json"))
    request_log = RequestLog(state_dir / "hub-requests.jsonl")
    request_log.clear()  # the log describes one server run
    handler = type("BoundHandler", (Handler,), {"hub": hub, "control": ControlApi(hub, request_log), "request_log": request_log})
    return HubServer((host, port), handler)
