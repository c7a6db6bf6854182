"""What one request and its answer are, to the Hub's API (api.py) and to the controls
(control.py) alike: the request as read off the socket, the caller it authenticates as, the
reply, and errors in the Hub's shape.

Owns: CONTROL_PREFIX, HubError, Reply, Caller, Request. Imports only the standard library; every
other module of the local Hub may import it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

CONTROL_PREFIX = "/_localcloud/"


class HubError(Exception):
    """An error answer in the Hub's shape; `code` is the X-Error-Code the client maps.

    Where the shapes come from: huggingface_hub's hf_raise_for_status (utils/_http.py) reads
    X-Error-Code (RevisionNotFound, EntryNotFound, GatedRepo, RepoNotFound) and X-Error-Message,
    treats a 401 on a repo URL whose message is not "Invalid credentials in Authorization
    header" as RepoNotFound, and maps 400 to BadRequestError, 403 to "Forbidden: <message>",
    416 to a range error (with Content-Range); its _format collects the message from
    X-Error-Message and the JSON body's "error" (the body sent here). The gated-repo messages
    ("Access to model X is restricted ...", "... is restricted and you are not in the
    authorized list.") and "Access to this resource is disabled." are quoted in its errors.py.
    Other messages (a local hub's unsupported features, a bad request the client never sends)
    are this emulator's own wording in those same shapes.
    """

    def __init__(self, status: int, message: str, code: str | None = None, headers: dict | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.code, self.headers = status, message, code, headers or {}


@dataclass
class Reply:
    status: int = 200
    payload: object = None  # JSON body
    headers: dict = field(default_factory=dict)
    file: Path | None = None  # or a file's bytes [start, start + length)
    start: int = 0
    length: int = 0


@dataclass(frozen=True)
class Caller:
    user: str | None = None  # None: anonymous
    role: str | None = None  # "read" or "write"
    orgs: tuple[str, ...] = ()

    def member_of(self, namespace: str) -> bool:
        return self.user is not None and (namespace == self.user or namespace in self.orgs)


class Request:
    def __init__(self, handler: BaseHTTPRequestHandler, method: str) -> None:
        url = urlsplit(handler.path)
        self.method = method
        self.path = url.path  # still percent-encoded: a quoted "/" stays inside its segment
        self.query = parse_qs(url.query, keep_blank_values=True)
        self.headers = handler.headers
        host = handler.headers.get("Host") or "%s:%d" % handler.server.server_address[:2]
        self.base = f"http://{host}"
        self.caller = Caller()
        self._rfile = handler.rfile
        self._body: bytes | None = None
        self._consumed = False

    def arg(self, name: str, default: str | None = None) -> str | None:
        values = self.query.get(name)
        return values[-1] if values else default

    def flag(self, name: str) -> bool:
        return (self.arg(name) or "").lower() in ("1", "true")

    def chunks(self):
        """The body, piece by piece (plain or chunked transfer encoding); readable once."""
        if self._consumed:
            return
        self._consumed = True
        if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
            while True:
                size = int(self._rfile.readline().split(b";")[0].strip() or b"0", 16)
                if size == 0:
                    while self._rfile.readline() not in (b"\r\n", b"\n", b""):
                        pass  # trailers
                    return
                yield self._rfile.read(size)
                self._rfile.readline()
        else:
            remaining = int(self.headers.get("Content-Length") or 0)
            while remaining > 0:
                piece = self._rfile.read(min(remaining, 1 << 20))
                if not piece:
                    return
                remaining -= len(piece)
                yield piece

    def body(self) -> bytes:
        if self._body is None:
            self._body = b"".join(self.chunks())
        return self._body

    def json(self) -> object:
        try:
            return json.loads(self.body() or b"{}")
        except ValueError as exc:
            raise HubError(400, f"Invalid JSON body: {exc}") from None

    def drain(self) -> None:
        for _ in self.chunks():
            pass
