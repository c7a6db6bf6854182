"""/_localcloud/: the local Hub's own controls for tests (never part of the Hub's API):
users and tokens, seeded repos and histories, access grants to gated repos, the request log.

Owns: ControlApi. Imports api (the HubApi whose store and accounts it changes), protocol and
store; only server.py imports it.
"""

from __future__ import annotations

import base64
import re
from pathlib import Path

from .._daemon import RequestLog
from .api import HubApi
from .protocol import CONTROL_PREFIX, HubError, Reply, Request
from .store import (
    DEFAULT_BRANCH, DEFAULT_GITATTRIBUTES, REPO_TYPES, FileEntry, check_repo_path, goes_to_lfs, lfs_patterns,
    normalize_date,
)


class ControlApi:
    def __init__(self, hub: HubApi, request_log: RequestLog) -> None:
        self.hub = hub
        self.store = hub.store
        self.request_log = request_log

    def dispatch(self, req: Request) -> Reply:
        what = req.path[len(CONTROL_PREFIX):].rstrip("/")
        with self.store.lock:
            if what == "requests" and req.method == "GET":
                return Reply(payload=self.request_log.read())
            if what == "requests" and req.method == "DELETE":
                self.request_log.clear()
                return Reply(payload={})
            if what == "users" and req.method == "POST":  # {name, token, role, orgs, org_roles, fine_grained}
                body = req.json()
                self.hub.accounts.add(body["name"], body["token"], body.get("role", "write"), body.get("orgs", []),
                                      body.get("org_roles"), body.get("fine_grained"))
                return Reply(payload={"name": body["name"]})
            if what == "repos" and req.method == "POST":
                return Reply(payload=self.seed_repo(req.json()))
            if what == "grants" and req.method == "POST":  # {user, repo, type}
                body = req.json()
                repo = self.store.get(body.get("type", "model"), body["repo"])
                if repo is None:
                    raise HubError(404, f"No repo {body['repo']}")
                repo.grants.add(body["user"])
                self.store.save(repo)
                return Reply(payload={"grants": sorted(repo.grants)})
        raise HubError(404, f"No control endpoint {req.method} {req.path}")

    def seed_repo(self, body: dict) -> dict:
        """{type, id, private, gated, commits: [{files, deleted, title, message, date, author, branch}]};
        a single commit may be given at the top level instead (files, date, title, ...).
        A file is text, {"text": ...}, {"base64": ...} or {"local_path": "/abs/file"}.
        Commits go on top of the repo's branch; a new repo gets exactly the seeded history."""
        repo_type, repo_id = body.get("type", "model"), body["id"]
        if repo_type not in REPO_TYPES or not re.fullmatch(r"[^/]+/[^/]+", repo_id):
            raise HubError(400, "type must be model or dataset and id NAMESPACE/NAME")
        repo = self.store.get(repo_type, repo_id) or self.store.create_repo(repo_type, repo_id)
        if "private" in body:
            repo.private = bool(body["private"])
        if "gated" in body:
            repo.gated = "manual" if body["gated"] is True else (body["gated"] or False)
        commits = body.get("commits") or [{k: body[k] for k in
                                           ("files", "deleted", "title", "message", "date", "author", "branch") if k in body}]
        created = []
        for spec in commits:
            branch = spec.get("branch", DEFAULT_BRANCH)
            if branch not in repo.branches and repo.branches:
                repo.branches[branch] = repo.branches[DEFAULT_BRANCH]
            current = repo.files(repo.branches.get(branch))
            contents = {path: _seed_content(value) for path, value in (spec.get("files") or {}).items()}
            gitattributes = contents.get(".gitattributes") or (
                self.store.read(current[".gitattributes"]) if ".gitattributes" in current else DEFAULT_GITATTRIBUTES.encode())
            patterns = lfs_patterns(gitattributes.decode(errors="replace"))
            changes: dict[str, FileEntry | None] = {p: None for p in spec.get("deleted", [])}
            for path, data in contents.items():
                if (problem := check_repo_path(path)) is not None:
                    raise HubError(400, problem)
                lfs = goes_to_lfs(path, len(data), data[:512], patterns)
                changes[path] = self.store.put_lfs(data) if lfs else self.store.put_regular(data)
            date = normalize_date(spec["date"]) if spec.get("date") else None
            created.append(self.store.commit(
                repo, branch, changes, title=spec.get("title") or ("initial commit" if not repo.commits else "Seed files"),
                message=spec.get("message", ""), author=spec.get("author") or repo.namespace, date=date))
        self.store.save(repo)
        return {"type": repo.type, "id": repo.id, "commits": created, "sha": repo.branches.get(DEFAULT_BRANCH)}


def _seed_content(value: object) -> bytes:
    if isinstance(value, str):
        return value.encode()
    if isinstance(value, dict) and "text" in value:
        return value["text"].encode()
    if isinstance(value, dict) and "base64" in value:
        return base64.b64decode(value["base64"])
    if isinstance(value, dict) and "local_path" in value:
        return Path(value["local_path"]).read_bytes()
    raise HubError(400, 'A seeded file is text, {"text": ...}, {"base64": ...} or {"local_path": ...}')
