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


# A token's role, as whoami-v2's auth.accessToken.role names it: "read" and "write" are read by
# huggingface_hub's own login (_login.py logs "Token is valid (permission: <role>)"); the Hub's
# docs (hub docs, security-tokens: "User access tokens") name the third kind, fine-grained, whose
# role is "fineGrained" with the token's permissions beside it (see HubApi.whoami).
TOKEN_ROLES = ("read", "write", "fineGrained")
# A member's role in an organization (hub docs, "Access control in organizations"): read is
# read-only; contributor may create repos and write those it created (this emulator keeps no
# repo's creator: it lets a contributor write all of them); write and admin write all.
ORG_ROLES = ("read", "contributor", "write", "admin")
# The fine-grained permissions that let a token write a repo's files, on the repo or its owner;
# only "repo.write" on the owner lets it create repos there. The names are the Hub's (its token
# settings page, and whoami-v2 answers of fine-grained tokens); which one creation needs is this
# emulator's reading of them (the Hub documents no table of the two).
CONTENT_WRITE = frozenset({"repo.write", "repo.content.write"})
CREATE = frozenset({"repo.write"})


@dataclass(frozen=True)
class Caller:
    user: str | None = None  # None: anonymous
    role: str | None = None  # one of TOKEN_ROLES
    orgs: tuple[str, ...] = ()
    org_roles: tuple[tuple[str, str], ...] = ()  # (org, one of ORG_ROLES)
    scopes: tuple[tuple[str, str, frozenset], ...] = ()  # fine-grained: (entity type, name, permissions)

    def member_of(self, namespace: str) -> bool:
        return self.user is not None and (namespace == self.user or namespace in self.orgs)

    def may_write(self, namespace: str, repo_id: str) -> bool:
        """May this token write files of `repo_id`, owned by `namespace`?"""
        return self._may(namespace, CONTENT_WRITE, repo_id)

    def may_create(self, namespace: str) -> bool:
        """May this token create a repo under `namespace`?"""
        return self._may(namespace, CREATE, None)

    def _may(self, namespace: str, needed: frozenset, repo_id: str | None) -> bool:
        if not self.member_of(namespace) or dict(self.org_roles).get(namespace) == "read":
            return False
        if self.role == "write":
            return True
        if self.role != "fineGrained":
            return False
        granted = set()
        for kind, name, permissions in self.scopes:
            if (kind in ("user", "org") and name == namespace) or (repo_id is not None and name == repo_id):
                granted |= permissions
        return bool(granted & needed)


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
