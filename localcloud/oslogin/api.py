"""The OS Login v1 REST routes the emulator serves, as google-cloud-os-login's REST transport sends
them (oslogin_v1/services/os_login_service/transports/rest_base.py; the v1 discovery document):

    POST   /v1/users/{user}:importSshPublicKey?projectId=P   body SshPublicKey {key, expirationTimeUsec}
           -> ImportSshPublicKeyResponse {loginProfile: {name, posixAccounts, sshPublicKeys}}
    GET    /v1/users/{user}/loginProfile                      -> LoginProfile
    GET    /v1/users/{user}/sshPublicKeys/{fingerprint}       -> SshPublicKey
    PATCH  /v1/users/{user}/sshPublicKeys/{fingerprint}?updateMask=...   body SshPublicKey -> SshPublicKey
    DELETE /v1/users/{user}/sshPublicKeys/{fingerprint}       -> Empty

`user` is the account's email. No credentials are checked (the local cloud has no IAM, as for
the other APIs): every account may manage its own profile.
"""

from __future__ import annotations

import re
from urllib.parse import unquote

from .store import OsLoginError, OsLoginStore

PREFIX = "/v1/users/"
_IMPORT = re.compile(r"(?P<user>[^/:]+):importSshPublicKey")
_PROFILE = re.compile(r"(?P<user>[^/:]+)/loginProfile")
_KEY = re.compile(r"(?P<user>[^/:]+)/sshPublicKeys/(?P<fp>[^/:]+)")


def dispatch(store: OsLoginStore, method: str, path: str, query: dict[str, list[str]], body: object) -> tuple[int, dict]:
    """One request under /v1/users/: (status, JSON payload); raises OsLoginError."""
    rest = path[len(PREFIX):]

    def arg(name: str) -> str | None:
        values = query.get(name)
        return values[0] if values else None

    if body is not None and not isinstance(body, dict):
        raise OsLoginError(400, "INVALID_ARGUMENT", "Invalid JSON payload received.")
    body = body or {}
    if (m := _IMPORT.fullmatch(rest)) and method == "POST":
        return 200, store.import_key(unquote(m["user"]), arg("projectId"), body)
    if (m := _PROFILE.fullmatch(rest)) and method == "GET":
        return 200, store.login_profile(unquote(m["user"]))
    if m := _KEY.fullmatch(rest):
        user, fp = unquote(m["user"]), unquote(m["fp"])
        if method == "GET":
            return 200, store.get_key(user, fp)
        if method == "PATCH":
            return 200, store.update_key(user, fp, body, arg("updateMask"))
        if method == "DELETE":
            return 200, store.delete_key(user, fp)
    raise OsLoginError(404, "NOT_FOUND", f"The requested URL {path} was not found on this server (localcloud).")
