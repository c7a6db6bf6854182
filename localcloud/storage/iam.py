"""IAM as Cloud Storage checks a call: the permission each JSON API method needs, checked against
the permissions bound to the caller when a binding names it. The caller is the service account
whose token the compute emulator's token endpoint issued, asked once per token from its tokeninfo
(`tokeninfo_url`, as oauth2.googleapis.com/tokeninfo answers); the VMs' token (their service
account's, localcloud/cloud.py VM_ACCESS_TOKEN) is named by the binding call itself. A caller no
binding names is not checked (the tests' own inspecting clients, anonymous).

Sources: Cloud Storage's "IAM permissions for JSON methods" (cloud.google.com/storage/docs/
access-control/iam-json): objects.list storage.objects.list; objects.get storage.objects.get;
objects.insert storage.objects.create (and storage.objects.delete to overwrite: not checked
here, the role that publishes holds both); objects.delete storage.objects.delete; objects.patch
and update storage.objects.update; objects.copy, rewrite and compose storage.objects.create on the
destination and storage.objects.get on the sources; buckets.get storage.buckets.get; buckets.insert
storage.buckets.create; buckets.list storage.buckets.list. The refusal is server.py's 403 in the
API's words ("EMAIL does not have PERMISSION access to the Google Cloud Storage object.
Permission 'PERMISSION' denied on resource (or it may not exist).").
"""

from __future__ import annotations

import json
import re
import threading
import urllib.parse
import urllib.request

# Storage Object User (roles/storage.objectUser), the predefined role the docs give the VMs'
# service account on the output bucket, as `gcloud iam roles describe roles/storage.objectUser`
# prints it (the dump in darkbitio/gcp-iam-role-permissions, roles/storage.objectUser, 2026-08-22).
# No storage.buckets.get: a VM that reads the bucket's own metadata is refused.
STORAGE_OBJECT_USER = (
    "monitoring.timeSeries.create", "orgpolicy.policy.get", "resourcemanager.projects.get",
    "resourcemanager.projects.list", "storage.folders.create", "storage.folders.delete", "storage.folders.get",
    "storage.folders.list", "storage.folders.rename", "storage.managedFolders.create", "storage.managedFolders.delete",
    "storage.managedFolders.get", "storage.managedFolders.list", "storage.multipartUploads.abort",
    "storage.multipartUploads.create", "storage.multipartUploads.list", "storage.multipartUploads.listParts",
    "storage.objects.create", "storage.objects.createContext", "storage.objects.delete", "storage.objects.deleteContext",
    "storage.objects.get", "storage.objects.list", "storage.objects.move", "storage.objects.restore",
    "storage.objects.update", "storage.objects.updateContext",
)

# (method, path pattern) -> permissions, in match order (server.py's paths).
_METHODS: list[tuple[str, re.Pattern[str], tuple[str, ...]]] = [
    (method, re.compile(pattern), permissions)
    for method, pattern, permissions in (
        ("GET", r"/storage/v1/b", ("storage.buckets.list",)),
        ("POST", r"/storage/v1/b", ("storage.buckets.create",)),
        ("GET", r"/storage/v1/b/[^/]+", ("storage.buckets.get",)),
        ("GET", r"/storage/v1/b/[^/]+/o", ("storage.objects.list",)),
        ("POST", r"/upload/storage/v1/b/[^/]+/o", ("storage.objects.create",)),
        ("POST", r"/storage/v1/b/[^/]+/o/[^/]+/(copyTo|rewriteTo)/b/[^/]+/o/[^/]+",
         ("storage.objects.create", "storage.objects.get")),
        ("POST", r"/storage/v1/b/[^/]+/o/[^/]+/compose", ("storage.objects.create", "storage.objects.get")),
        ("GET", r"(/download)?/storage/v1/b/[^/]+/o/[^/]+", ("storage.objects.get",)),
        ("DELETE", r"/storage/v1/b/[^/]+/o/[^/]+", ("storage.objects.delete",)),
        ("PATCH", r"/storage/v1/b/[^/]+/o/[^/]+", ("storage.objects.update",)),
        ("PUT", r"/storage/v1/b/[^/]+/o/[^/]+", ("storage.objects.update",)),
    )
]


def required_permissions(method: str, path: str) -> tuple[str, ...]:
    for wanted, pattern, permissions in _METHODS:
        if wanted == method and pattern.fullmatch(path):
            return permissions
    return ()


class Bindings:
    """Bound members' permissions, and the identity behind each token seen."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._members: dict[str, frozenset[str]] = {}
        self._tokens: dict[str, str | None] = {}  # token -> service account (None: not one)
        self.tokeninfo_url: str | None = None

    def bind(self, body: dict) -> dict:
        """{"member": "serviceAccount:EMAIL", "permissions": [...] | None, "token"?: T (a token that
        is the member's: the VMs'), "tokeninfo_url"?: URL}."""
        member, permissions = body["member"], body["permissions"]
        with self._lock:
            if body.get("tokeninfo_url"):
                self.tokeninfo_url = body["tokeninfo_url"]
            if body.get("token"):
                self._tokens[body["token"]] = member.removeprefix("serviceAccount:")
            if permissions is None:
                self._members.pop(member, None)
            else:
                self._members[member] = frozenset(permissions)
            return {"member": member, "permissions": sorted(self._members.get(member, ()))}

    def caller(self, authorization: str | None) -> str | None:
        scheme, _, token = (authorization or "").partition(" ")
        token = token.strip()
        if scheme.lower() != "bearer" or not token:
            return None
        with self._lock:
            if token in self._tokens:
                return self._tokens[token]
            url = self.tokeninfo_url
        email = None
        if url:
            try:
                with urllib.request.urlopen(f"{url}?{urllib.parse.urlencode({'access_token': token})}", timeout=10) as answer:
                    email = json.loads(answer.read()).get("email")
            except OSError:  # urllib's HTTPError (400 invalid_token) among them: not one of its tokens
                email = None
        with self._lock:
            self._tokens[token] = email
        return email

    def missing(self, email: str | None, method: str, path: str) -> str | None:
        """The first permission `email`'s binding lacks for this call; None when it has them all,
        or when no binding names `email`."""
        if email is None:
            return None
        with self._lock:
            held = self._members.get(f"serviceAccount:{email}")
        if held is None:
            return None
        return next((p for p in required_permissions(method, path) if p not in held), None)
