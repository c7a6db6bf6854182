"""The local Hub's users and their tokens: who a request's Authorization header names.

Owns: Accounts (STATE/hub/users.json). Imports protocol (HubError, Caller) and store (now_iso).
"""

from __future__ import annotations

import json
from pathlib import Path

from .protocol import Caller, HubError
from .store import now_iso


class Accounts:
    """Users and their tokens (seeded through the control API), kept in STATE/users.json."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.data = json.loads(path.read_text()) if path.exists() else {"users": {}, "tokens": {}}

    def add(self, name: str, token: str, role: str = "write", orgs: list[str] = ()) -> None:
        if role not in ("read", "write"):
            raise HubError(400, "role must be 'read' or 'write'")
        self.data["users"][name] = {"orgs": list(orgs)}
        self.data["tokens"][token] = {"user": name, "role": role, "createdAt": now_iso()}
        self.path.write_text(json.dumps(self.data, indent=1))

    def caller(self, authorization: str | None) -> Caller:
        if not authorization:
            return Caller()
        token = authorization.removeprefix("Bearer ").strip()
        info = self.data["tokens"].get(token)
        if info is None:
            # The client tells this message apart from a "repo not found" 401.
            raise HubError(401, "Invalid credentials in Authorization header")
        return Caller(info["user"], info["role"], tuple(self.data["users"][info["user"]]["orgs"]))
