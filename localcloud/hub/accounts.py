"""The local Hub's users and their tokens: who a request's Authorization header names.

Owns: Accounts (STATE/hub/users.json). Imports protocol (HubError, Caller) and store (now_iso).
"""

from __future__ import annotations

import json
from pathlib import Path

from .protocol import ORG_ROLES, TOKEN_ROLES, Caller, HubError
from .store import now_iso


class Accounts:
    """Users and their tokens (seeded through the control API), kept in STATE/users.json."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.data = json.loads(path.read_text()) if path.exists() else {"users": {}, "tokens": {}}

    def add(self, name: str, token: str, role: str = "write", orgs: list[str] = (),
            org_roles: dict[str, str] | None = None, fine_grained: dict | None = None) -> None:
        """`orgs`: the user's organizations, each with role "write" unless `org_roles` names
        another; `fine_grained`: the token's {"scoped": [{"entity": {"type", "name"},
        "permissions": [...]}], "global": [...]} when `role` is "fineGrained"."""
        if role not in TOKEN_ROLES:
            raise HubError(400, f"role must be one of {', '.join(TOKEN_ROLES)}")
        if (role == "fineGrained") != (fine_grained is not None):
            raise HubError(400, "a fineGrained token needs its fine_grained permissions, and only it")
        roles = {org: (org_roles or {}).get(org, "write") for org in orgs}
        if bad := sorted(org for org, org_role in roles.items() if org_role not in ORG_ROLES):
            raise HubError(400, f"roles of {bad} must be one of {', '.join(ORG_ROLES)}")
        self.data["users"][name] = {"orgs": list(orgs), "org_roles": roles}
        self.data["tokens"][token] = {"user": name, "role": role, "createdAt": now_iso(),
                                      "fineGrained": _fine_grained(fine_grained)}
        self.path.write_text(json.dumps(self.data, indent=1))

    def caller(self, authorization: str | None) -> Caller:
        if not authorization:
            return Caller()
        token = authorization.removeprefix("Bearer ").strip()
        info = self.data["tokens"].get(token)
        if info is None:
            # The client tells this message apart from a "repo not found" 401.
            raise HubError(401, "Invalid credentials in Authorization header")
        user = self.data["users"][info["user"]]
        scopes = tuple(
            (scope["entity"]["type"], scope["entity"]["name"], frozenset(scope["permissions"]))
            for scope in (info.get("fineGrained") or {}).get("scoped", [])
        )
        return Caller(info["user"], info["role"], tuple(user["orgs"]),
                      tuple(sorted(user.get("org_roles", {}).items())), scopes)


def _fine_grained(permissions: dict | None) -> dict | None:
    """The token's fine-grained permissions as whoami-v2 answers them (see HubApi.whoami)."""
    if permissions is None:
        return None
    scoped = []
    for scope in permissions.get("scoped", []):
        entity = scope.get("entity") or {}
        if entity.get("type") not in ("user", "org", "model", "dataset") or not entity.get("name"):
            raise HubError(400, f"a scope's entity needs a type (user, org, model, dataset) and a name: {scope}")
        scoped.append({"entity": {"type": entity["type"], "name": entity["name"]},
                       "permissions": list(scope.get("permissions") or [])})
    return {"canReadGatedRepos": bool(permissions.get("canReadGatedRepos", True)),
            "global": list(permissions.get("global") or []), "scoped": scoped}
