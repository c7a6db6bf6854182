"""OS Login's login profiles: each Google account's POSIX account and SSH public keys.

A profile is made by the first users.importSshPublicKey with a projectId ("Default POSIX account
information is set when no username and UID exist as part of the login profile": the method's
description in the oslogin v1 discovery document). Its username is derived from the account:
a service account's is `sa_` and its numeric unique id (google/syzkaller#4423: "It looks like
sa_1234567..."), a user's is the email with `@` and `.` made `_`
(GoogleCloudPlatform/compute-image-packages#692: "username_gmail_com"). The unique id and the uid
are the emulator's own, stable per email (the service assigns both; guest-oslogin's NSS module
refuses a uid below 1000, oslogin_utils.cc ValidatePasswd).

Keys are stored with their `expirationTimeUsec` (int64 as a JSON string, as the discovery
document types it) and returned whether expired or not: the VM filters expired ones
(guest-oslogin oslogin_utils.cc ParseJsonToSshKeys), see guest.py. Re-importing a key the profile
holds sets the expiry the request gives (what a re-import of the same key body asks for; the
pipeline does not rely on it: it checks the answer and patches the key if the expiry did not take,
cloud/os_login.py).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import re
import threading
from collections.abc import Callable

# An OpenSSH public key line: TYPE BASE64 [COMMENT] (RFC 4253 section 6.6, the `key` field's format).
_KEY_LINE = re.compile(r"(ssh-(rsa|dss|ed25519)|ecdsa-sha2-nistp(256|384|521)|sk-\S+) ([A-Za-z0-9+/=]+)( .*)?")
SERVICE_ACCOUNT_DOMAIN = ".gserviceaccount.com"


class OsLoginError(Exception):
    """An error answer in the API's shape: google.rpc.Status as JSON (AIP-193), which
    google-api-core's REST transport reads (exceptions.from_http_response: error.message,
    error.status)."""

    def __init__(self, code: int, status: str, message: str) -> None:
        super().__init__(message)
        self.code, self.status, self.message = code, status, message

    def body(self) -> dict:
        return {"error": {"code": self.code, "message": self.message, "status": self.status}}


def _number(email: str, salt: str, low: int, high: int) -> int:
    digest = int.from_bytes(hashlib.sha256(f"{salt}:{email}".encode()).digest()[:8], "big")
    return low + digest % (high - low)


def posix_username(email: str) -> str:
    """The POSIX username OS Login gives `email`'s account (see the module's sources)."""
    if email.endswith(SERVICE_ACCOUNT_DOMAIN):
        return f"sa_{_number(email, 'unique-id', 10**20, 10**21)}"
    return re.sub(r"[^a-z0-9_]", "_", email.lower())[:32]


def fingerprint(key: str) -> str:
    """The key's SHA-256 fingerprint, hex (the discovery document: "The SHA-256 fingerprint of the
    SSH public key"; here over the key's blob)."""
    return hashlib.sha256(base64.b64decode(key.split()[1])).hexdigest()


def check_key(key: object) -> str:
    if not isinstance(key, str) or not key.strip():
        raise OsLoginError(400, "INVALID_ARGUMENT", "Request contains an invalid argument: ssh_public_key.key is required.")
    key = key.strip()
    match = _KEY_LINE.fullmatch(key)
    try:
        valid = bool(match) and bool(base64.b64decode(match.group(4), validate=True))
    except (binascii.Error, ValueError):
        valid = False
    if not valid:
        raise OsLoginError(400, "INVALID_ARGUMENT", "Request contains an invalid argument: ssh_public_key.key.")
    return key


def check_expiry(value: object) -> str | None:
    """expirationTimeUsec: an int64, as a JSON string or number (proto3 JSON takes both)."""
    if value in (None, "", 0, "0"):
        return None
    try:
        return str(int(value))
    except (TypeError, ValueError):
        raise OsLoginError(
            400, "INVALID_ARGUMENT", f'Invalid value at \'ssh_public_key.expiration_time_usec\' (TYPE_INT64), "{value}"'
        ) from None


class OsLoginStore:
    """Profiles by email; `on_new_account(account)` runs (outside the lock) when an import makes a
    POSIX account: the VMs with OS Login resolve it from then on, as guest-oslogin's NSS module
    does by asking the metadata server at each lookup."""

    def __init__(self, on_new_account: Callable[[dict], None] | None = None) -> None:
        self.lock = threading.Lock()
        self.profiles: dict[str, dict] = {}  # email -> {"projects": {project: account}, "keys": {fp: key}}
        self.on_new_account = on_new_account

    # ----- the API's methods ---------------------------------------------------------------

    def import_key(self, email: str, project: str | None, body: dict) -> dict:
        key = check_key(body.get("key"))
        expiry = check_expiry(body.get("expirationTimeUsec"))
        new_account = None
        with self.lock:
            profile = self.profiles.setdefault(email, {"projects": {}, "keys": {}})
            if project and project not in profile["projects"]:
                new_account = profile["projects"][project] = self._account(email, project)
            fp = fingerprint(key)
            profile["keys"][fp] = {"key": key, **({"expirationTimeUsec": expiry} if expiry else {})}
            answer = {"loginProfile": self._profile(email)}
        if new_account and self.on_new_account:
            self.on_new_account(dict(new_account))
        return answer

    def login_profile(self, email: str) -> dict:
        with self.lock:
            return self._profile(email)

    def get_key(self, email: str, fp: str) -> dict:
        with self.lock:
            return self._key(email, fp)

    def update_key(self, email: str, fp: str, body: dict, update_mask: str | None) -> dict:
        """updateSshPublicKey: the fields `update_mask` names (comma-separated; all given ones
        without a mask) from `body`."""
        fields = {f.strip() for f in update_mask.split(",")} if update_mask else set(body)
        unknown = fields - {"key", "expirationTimeUsec", "expiration_time_usec"}
        if unknown:
            raise OsLoginError(400, "INVALID_ARGUMENT", f"Invalid update mask: {sorted(unknown)}.")
        with self.lock:
            stored = self.profiles.get(email, {}).get("keys", {}).get(fp)
            if stored is None:
                raise self._not_found(email, fp)
            if "key" in fields and check_key(body.get("key")) != stored["key"]:
                raise OsLoginError(400, "INVALID_ARGUMENT", "The key's fingerprint does not match the resource name.")
            if fields & {"expirationTimeUsec", "expiration_time_usec"}:
                expiry = check_expiry(body.get("expirationTimeUsec"))
                stored.pop("expirationTimeUsec", None)
                if expiry:
                    stored["expirationTimeUsec"] = expiry
            return self._key(email, fp)

    def delete_key(self, email: str, fp: str) -> dict:
        with self.lock:
            if self.profiles.get(email, {}).get("keys", {}).pop(fp, None) is None:
                raise self._not_found(email, fp)
        return {}

    # ----- what the VMs see ----------------------------------------------------------------

    def accounts(self) -> list[dict]:
        """Every POSIX account (one per account and project), for the VMs' passwd."""
        with self.lock:
            return [dict(account) for profile in self.profiles.values() for account in profile["projects"].values()]

    def guest_user(self, username: str) -> dict | None:
        """The metadata server's `oslogin/users?username=` answer for `username` (the shape
        guest-oslogin parses: {"loginProfiles": [profile]}), or None for no such user (404)."""
        with self.lock:
            for email, profile in self.profiles.items():
                if any(a["username"] == username for a in profile["projects"].values()):
                    return {"loginProfiles": [self._profile(email)]}
        return None

    # ----- shapes --------------------------------------------------------------------------

    @staticmethod
    def _account(email: str, project: str) -> dict:
        uid = _number(email, "uid", 2**30, 2**31)
        username = posix_username(email)
        return {
            "primary": True, "username": username, "uid": str(uid), "gid": str(uid),
            "homeDirectory": f"/home/{username}", "shell": "/bin/bash", "gecos": "", "systemId": "",
            "accountId": project, "operatingSystemType": "LINUX", "name": f"users/{email}/projects/{project}",
        }

    def _profile(self, email: str) -> dict:
        profile = self.profiles.get(email)
        if profile is None:
            return {"name": email}
        return {
            "name": email,
            "posixAccounts": [dict(a) for a in profile["projects"].values()],
            "sshPublicKeys": {fp: self._key(email, fp) for fp in profile["keys"]},
        }

    def _key(self, email: str, fp: str) -> dict:
        stored = self.profiles.get(email, {}).get("keys", {}).get(fp)
        if stored is None:
            raise self._not_found(email, fp)
        return {**stored, "fingerprint": fp, "name": f"users/{email}/sshPublicKeys/{fp}"}

    @staticmethod
    def _not_found(email: str, fp: str) -> OsLoginError:
        return OsLoginError(404, "NOT_FOUND", f"Requested entity was not found: users/{email}/sshPublicKeys/{fp}.")
