"""The Hugging Face Hub API subset that `huggingface_hub` uses for repos, commits and files.

Requests, headers and error shapes follow what huggingface_hub's client sends and parses
(read from its source): errors are {"error": message} with X-Error-Code / X-Error-Message
headers, so the client raises RepositoryNotFoundError, RevisionNotFoundError,
EntryNotFoundError and GatedRepoError. Links in responses use the request's own Host.

Owns: the API's routes and handlers (HubApi), over a store.Store and accounts.Accounts.
Imports protocol, accounts and store; never server.py or control.py (which build on it).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import html
import json
import logging
import re
import secrets
import time
from pathlib import Path
from urllib.parse import parse_qs, unquote, urlencode

from .accounts import Accounts
from .protocol import Caller, HubError, Reply, Request
from .store import (
    DEFAULT_BRANCH, DEFAULT_GITATTRIBUTES, LFS_MIN_SIZE, REPO_TYPES, FileEntry, Repo, Store,
    check_repo_path, goes_to_lfs, lfs_patterns, lfs_pointer, tree_oid,
)

log = logging.getLogger(__name__)

COMMITS_PAGE_SIZE = 50  # guessed: the Hub's page size is not documented; the client follows Link
TREE_PAGE_SIZE = 1000  # the Hub's: 1000 entries per tree page, 50 with expand (huggingface_hub docs)
TREE_PAGE_SIZE_EXPANDED = 50
UPLOAD_URL_TTL = 3600
_REPO = r"(?P<ns>[^/]+)/(?P<name>[^/]+?)"
_API = rf"/api/(?P<types>models|datasets)/{_REPO}"
_GIT = rf"/(?:(?P<prefix>datasets)/)?{_REPO}"
ROUTES = [
    ("GET", r"/api/whoami-v2", "whoami"),
    ("POST", r"/api/repos/create", "create_repo"),
    ("DELETE", r"/api/repos/delete", "delete_repo"),
    ("POST", r"/api/validate-yaml", "validate_yaml"),
    ("GET", rf"{_API}(?:/revision/(?P<rev>[^/]+))?", "repo_info"),
    ("GET", rf"{_API}/refs", "refs"),
    ("GET", rf"{_API}/auth-check", "auth_check"),
    ("GET", rf"{_API}/commits/(?P<rev>[^/]+)", "commits"),
    ("GET", rf"{_API}/tree/(?P<rev>[^/]+)(?:/(?P<path>.*))?", "tree"),
    ("POST", rf"{_API}/paths-info/(?P<rev>[^/]+)", "paths_info"),
    ("POST", rf"{_API}/preupload/(?P<rev>[^/]+)", "preupload"),
    ("POST", rf"{_API}/commit/(?P<rev>[^/]+)", "commit"),
    ("POST DELETE", rf"{_API}/branch/(?P<branch>[^/]+)", "branch"),
    ("GET POST", rf"{_API}/xet-(?:read|write)-token(?:/.*)?", "xet_token"),
    ("POST", rf"{_GIT}\.git/info/lfs/objects/batch", "lfs_batch"),
    ("POST", rf"{_GIT}\.git/info/lfs/objects/verify", "lfs_verify"),
    ("PUT", r"/lfs-uploads/(?P<oid>[0-9a-f]{64})", "lfs_upload"),
    ("GET HEAD", rf"{_GIT}/resolve/(?P<rev>[^/]+)/(?P<path>.+)", "resolve"),
]
ROUTES = [(methods.split(), re.compile(pattern), name) for methods, pattern, name in ROUTES]


def card_data(readme: bytes | None) -> dict | None:
    """The YAML front matter of a README.md, or None (also when PyYAML is not installed)."""
    if not readme:
        return None
    text = readme.decode("utf-8", errors="replace")
    match = re.match(r"---\s*\n(.*?)\n---\s*(\n|$)", text, re.S)
    if not match:
        return None
    try:
        import yaml
    except ImportError:
        return None
    data = yaml.safe_load(match.group(1))  # YAMLError is the caller's to report
    return json.loads(json.dumps(data, default=str)) if isinstance(data, dict) else None


def repo_url_path(repo_type: str, repo_id: str) -> str:
    return f"/{repo_id}" if repo_type == "model" else f"/{repo_type}s/{repo_id}"


class HubApi:
    def __init__(self, store: Store, accounts: Accounts) -> None:
        self.store = store
        self.accounts = accounts
        self.lock = store.lock
        self.upload_key = secrets.token_bytes(32)  # signs LFS upload URLs, like presigned S3 URLs

    def dispatch(self, req: Request) -> Reply:
        for methods, pattern, name in ROUTES:
            match = pattern.fullmatch(req.path)
            if match and req.method in methods:
                if name != "lfs_upload":  # upload URLs carry their own signature, like S3's
                    req.caller = self.accounts.caller(req.headers.get("Authorization"))
                args = {k: unquote(v) for k, v in match.groupdict().items() if v is not None}
                handler = getattr(self, name)
                if name in ("lfs_upload", "resolve"):  # streaming: they lock only their bookkeeping
                    return handler(req, **args)
                req.body()  # read before locking: a slow client must not stall everyone else
                with self.lock:
                    return handler(req, **args)
        raise HubError(404, f"Sorry, we can't find the page you are looking for ({req.method} {req.path}).")

    # ----- access ---------------------------------------------------------------------------

    def _repo(self, req: Request, ns: str, name: str, types: str | None = None, prefix: str | None = None,
              write: bool = False) -> Repo:
        repo_type = (types or prefix or "models")[:-1]
        repo = self.store.get(repo_type, f"{ns}/{name}")
        caller = req.caller
        if repo is None or (repo.private and not caller.member_of(repo.namespace)):
            # Like the Hub: a private repo of someone else does not exist; anonymous gets 401.
            raise HubError(401 if caller.user is None else 404, "Repository not found", "RepoNotFound")
        if write and not caller.may_write(repo.namespace, repo.id):
            self._refuse(caller, f"You don't have the rights to write to {repo.id}: it takes a token with "
                                 "write access to it")
        return repo

    @staticmethod
    def _refuse(caller: Caller, message: str) -> None:
        """A write the token may not make. The Hub answers 403 to a token that may not write (a
        commit: huggingface/deep-rl-class#593, "403 Client Error: Forbidden for url: .../commit/main"
        from upload_folder; a repo creation: huggingface/community-events#25 and
        huggingface/autotrain-advanced#274, "403 ... /api/repos/create - You don't have the rights to
        create a dataset under this namespace"), and 401 to no token at all."""
        if caller.user is None:
            raise HubError(401, "You must be authenticated to do this")
        raise HubError(403, message)

    @staticmethod
    def _require_gate_passed(req: Request, repo: Repo) -> None:
        """A gated repo's files are for its namespace's members and the users granted access."""
        caller = req.caller
        if repo.gated and not caller.member_of(repo.namespace) and caller.user not in repo.grants:
            kind = repo.type
            if caller.user is None:
                raise HubError(401, f"Access to {kind} {repo.id} is restricted. You must have access to it "
                                    "and be authenticated to access it. Please log in.", "GatedRepo")
            raise HubError(403, f"Access to {kind} {repo.id} is restricted and you are not in the authorized "
                                f"list. Visit {req.base}{repo_url_path(kind, repo.id)} to ask for access.", "GatedRepo")

    @staticmethod
    def _revision(repo: Repo, revision: str) -> str:
        commit_id = repo.resolve(revision)
        if commit_id is None:
            raise HubError(404, f"Invalid rev id: {revision}", "RevisionNotFound")
        return commit_id

    # ----- account and repos ----------------------------------------------------------------

    def whoami(self, req: Request) -> Reply:
        """What GET /api/whoami-v2 answers. Where each field comes from:
        - the user's fields and orgs[] (type, id, name, fullname, email...): huggingface.js,
          packages/hub/src/types/api/api-who-am-i.ts (ApiWhoAmIUser, ApiWhoAmIOrg);
        - orgs[].roleInOrg (read, contributor, write, admin): the field huggingface_hub's
          _oauth.py reads from the Hub's user info, the values the Hub docs' "Access control in
          organizations";
        - auth.type "access_token" and auth.accessToken {displayName, role}: api-who-am-i.ts
          (ApiWhoAmIAuthInfo) and huggingface_hub's _login.py, which reads both; createdAt: seen in
          whoami-v2 answers that public scripts quote (no client of Hugging Face's reads it);
        - auth.accessToken.fineGrained {canReadGatedRepos, global, scoped: [{entity: {_id, type,
          name}, permissions}]} for a token of role "fineGrained": the shape public clients of
          whoami-v2 read (the Hub's OpenAPI schema, huggingface.co/.well-known/openapi.json,
          describes it; it is not vendored here)."""
        caller = req.caller
        if caller.user is None:
            raise HubError(401, "Invalid credentials in Authorization header")
        token = self.accounts.data["tokens"][req.headers["Authorization"].removeprefix("Bearer ").strip()]
        roles = dict(caller.org_roles)
        access_token = {"displayName": f"localcloud-{caller.role}", "role": caller.role,
                        "createdAt": token["createdAt"]}
        if token.get("fineGrained") is not None:
            fine = token["fineGrained"]
            access_token["fineGrained"] = {**fine, "scoped": [
                {"entity": {"_id": _fake_id(scope["entity"]["name"]), **scope["entity"]},
                 "permissions": scope["permissions"]} for scope in fine["scoped"]]}
        return Reply(payload={
            "type": "user", "id": _fake_id(caller.user), "name": caller.user, "fullname": caller.user,
            "email": None, "emailVerified": False, "isPro": False, "canPay": False, "avatarUrl": "",
            "orgs": [{"type": "org", "name": o, "fullname": o, "id": _fake_id(o), "roleInOrg": roles.get(o, "write")}
                     for o in caller.orgs],
            "auth": {"type": "access_token", "accessToken": access_token},
        })

    def create_repo(self, req: Request) -> Reply:
        body = req.json()
        repo_type = body.get("type") or "model"
        caller = req.caller
        namespace = body.get("organization") or caller.user or ""
        if not caller.may_create(namespace):
            self._refuse(caller, f"You don't have the rights to create a {repo_type} under this namespace")
        if repo_type not in REPO_TYPES:
            raise HubError(400, f"Invalid repo type {repo_type!r} (the local hub has models and datasets)")
        if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]{0,95}", body.get("name") or ""):
            raise HubError(400, "Invalid repo name")
        repo_id = f"{namespace}/{body['name']}"
        url = req.base + repo_url_path(repo_type, repo_id)
        if self.store.get(repo_type, repo_id) is not None:
            # The client reads "url" from this 409 when exist_ok=True.
            return Reply(409, {"error": f"You already created this {repo_type} repo", "url": url},
                         {"X-Error-Message": f"You already created this {repo_type} repo"})
        private = body.get("private", body.get("visibility") == "private")
        repo = self.store.create_repo(repo_type, repo_id, private=bool(private))
        # Like the Hub: every new repo starts with a commit holding the default .gitattributes.
        entry = self.store.put_regular(DEFAULT_GITATTRIBUTES.encode())
        self.store.commit(repo, DEFAULT_BRANCH, {".gitattributes": entry}, title="initial commit", author=caller.user)
        return Reply(payload={"url": url, "name": repo_id, "id": repo_id})

    def delete_repo(self, req: Request) -> Reply:
        body = req.json()
        ns = body.get("organization") or req.caller.user or ""
        repo = self._repo(req, ns, body.get("name", ""), types=f"{body.get('type') or 'model'}s", write=True)
        self.store.delete_repo(repo)
        return Reply(payload={})

    def validate_yaml(self, req: Request) -> Reply:
        content = req.json().get("content", "")
        try:
            data = card_data(content.encode())
        except Exception as exc:  # yaml.YAMLError, without importing yaml here
            return Reply(400, {"error": "Invalid metadata in README.md", "errors": [{"message": str(exc)}]})
        if data is None:
            return Reply(payload={"errors": [], "warnings": [{"message": "empty or missing yaml metadata in repo card"}]})
        return Reply(payload={"errors": [], "warnings": []})

    def repo_info(self, req: Request, types: str, ns: str, name: str, rev: str = DEFAULT_BRANCH) -> Reply:
        repo = self._repo(req, ns, name, types)
        commit_id = self._revision(repo, rev)
        commit = repo.commits[commit_id]
        files = repo.files(commit_id)
        try:
            card = card_data(self.store.read(files["README.md"])) if "README.md" in files else None
        except Exception:
            card = None  # invalid YAML: the Hub shows the repo without card data
        card = card or {}
        tags = card.get("tags") or []
        tags = [tags] if isinstance(tags, str) else list(tags)
        if "license" in card:
            tags.append(f"license:{card['license']}")
        with_blobs = req.flag("blobs")
        siblings = []
        for path, entry in files.items():
            sibling = {"rfilename": path}
            if with_blobs:
                sibling.update(size=entry.size, blobId=entry.oid)
                if entry.lfs:
                    sibling["lfs"] = {"sha256": entry.lfs, "size": entry.size,
                                      "pointerSize": len(lfs_pointer(entry.lfs, entry.size))}
            siblings.append(sibling)
        info = {
            "_id": _fake_id(f"{repo.type}/{repo.id}"), "id": repo.id, "author": repo.namespace,
            "sha": commit_id, "lastModified": commit["date"], "createdAt": repo.created_at,
            "private": repo.private, "gated": repo.gated, "disabled": False, "downloads": 0, "likes": 0,
            "tags": tags + ["region:us"], "siblings": siblings, "usedStorage": sum(e.size for e in files.values()),
        }
        if card:
            info["cardData"] = card
        if repo.type == "model":
            info.update(modelId=repo.id, library_name=card.get("library_name"), pipeline_tag=card.get("pipeline_tag"))
        expand = req.query.get("expand") or req.query.get("expand[]")
        if expand:  # only the asked properties, as the Hub does
            info = {k: v for k, v in info.items() if k in expand or k in ("_id", "id")}
        return Reply(payload=info)

    def auth_check(self, req: Request, types: str, ns: str, name: str) -> Reply:
        """What huggingface_hub's auth_check asks: may the caller read this repo's files?"""
        self._require_gate_passed(req, self._repo(req, ns, name, types))
        return Reply(200, {})

    def refs(self, req: Request, types: str, ns: str, name: str) -> Reply:
        repo = self._repo(req, ns, name, types)
        refs = {
            "branches": [{"name": b, "ref": f"refs/heads/{b}", "targetCommit": c} for b, c in sorted(repo.branches.items())],
            "converts": [], "tags": [],
        }
        if req.flag("include_prs"):
            refs["pullRequests"] = []
        return Reply(payload=refs)

    def branch(self, req: Request, types: str, ns: str, name: str, branch: str) -> Reply:
        repo = self._repo(req, ns, name, types, write=True)
        branch = branch.removeprefix("refs/heads/")
        if req.method == "DELETE":
            if branch == DEFAULT_BRANCH:
                raise HubError(403, "Cannot delete the default branch")
            if repo.branches.pop(branch, None) is None:
                raise HubError(404, f"Invalid rev id: {branch}", "RevisionNotFound")
        else:
            if not re.fullmatch(r"[A-Za-z0-9._/-]+", branch) or re.fullmatch(r"[0-9a-f]{40}", branch):
                raise HubError(400, f"Invalid branch name {branch!r}")
            if branch in repo.branches:
                raise HubError(409, "Reference already exists")
            repo.branches[branch] = self._revision(repo, req.json().get("startingPoint") or DEFAULT_BRANCH)
        self.store.save(repo)
        return Reply(payload={})

    # ----- history and trees ----------------------------------------------------------------

    def commits(self, req: Request, types: str, ns: str, name: str, rev: str) -> Reply:
        repo = self._repo(req, ns, name, types)
        chain = list(repo.history(self._revision(repo, rev)))
        page = int(req.arg("p", "0"))
        formatted = "formatted" in req.query.get("expand[]", [])
        items = []
        for commit_id, commit in chain[page * COMMITS_PAGE_SIZE:(page + 1) * COMMITS_PAGE_SIZE]:
            item = {"id": commit_id, "title": commit["title"], "message": commit["message"],
                    "authors": [{"user": a, "avatar": None} for a in commit["authors"]], "date": commit["date"]}
            if formatted:
                item["formatted"] = {"title": html.escape(commit["title"]), "message": html.escape(commit["message"])}
            items.append(item)
        headers = {}
        if (page + 1) * COMMITS_PAGE_SIZE < len(chain):
            headers["Link"] = _next_link(req, p=page + 1)
        return Reply(payload=items, headers=headers)

    def tree(self, req: Request, types: str, ns: str, name: str, rev: str, path: str = "") -> Reply:
        repo = self._repo(req, ns, name, types)
        commit_id = self._revision(repo, rev)
        files = repo.files(commit_id)
        folder = path.strip("/")
        folders = {"/".join(p.split("/")[:i]) for p in files for i in range(1, p.count("/") + 1)}
        if folder and folder not in folders:
            if folder in files:  # a file lists as itself
                return Reply(payload=[self._path_info(repo, commit_id, files, folder, req.flag("expand"))])
            raise HubError(404, f"Entry not found: {folder}", "EntryNotFound")
        prefix = folder + "/" if folder else ""
        recursive = req.flag("recursive")
        listed = sorted(
            p for p in folders | set(files)
            if p.startswith(prefix) and (recursive or "/" not in p[len(prefix):])
        )
        expand = req.flag("expand")
        page_size = TREE_PAGE_SIZE_EXPANDED if expand else TREE_PAGE_SIZE
        start = int(req.arg("cursor", "0"))
        page = listed[start:start + page_size]
        headers = {"Link": _next_link(req, cursor=start + page_size)} if start + page_size < len(listed) else {}
        return Reply(payload=[self._path_info(repo, commit_id, files, p, expand) for p in page], headers=headers)

    def paths_info(self, req: Request, types: str, ns: str, name: str, rev: str) -> Reply:
        repo = self._repo(req, ns, name, types)
        commit_id = self._revision(repo, rev)
        if "json" in req.headers.get("Content-Type", ""):
            body = req.json()
            paths, expand = body.get("paths", []), bool(body.get("expand"))
        else:  # the client posts a form: paths=a&paths=b&expand=false
            form = parse_qs(req.body().decode(), keep_blank_values=True)
            paths, expand = form.get("paths", []), (form.get("expand") or [""])[-1].lower() in ("1", "true")
        files = repo.files(commit_id)
        infos = []
        for path in dict.fromkeys(p.strip("/") for p in paths):
            if path in files or any(p.startswith(path + "/") for p in files):
                infos.append(self._path_info(repo, commit_id, files, path, expand))
        return Reply(payload=infos)

    def _path_info(self, repo: Repo, commit_id: str, files: dict[str, FileEntry], path: str, expand: bool) -> dict:
        entry = files.get(path)
        if entry is not None:
            info = {"type": "file", "oid": entry.oid, "size": entry.size, "path": path}
            if entry.lfs:
                info["lfs"] = {"oid": entry.lfs, "size": entry.size, "pointerSize": len(lfs_pointer(entry.lfs, entry.size))}
        else:
            info = {"type": "directory", "oid": tree_oid(files, path), "size": 0, "path": path}
        if expand:
            last_id, last = repo.last_change(commit_id, path)
            info["lastCommit"] = {"id": last_id, "title": last["title"], "date": last["date"]}
        return info

    # ----- upload ---------------------------------------------------------------------------

    def preupload(self, req: Request, types: str, ns: str, name: str, rev: str) -> Reply:
        repo = self._repo(req, ns, name, types, write=True)
        commit_id = self._revision(repo, rev)
        files = repo.files(commit_id)
        gitattributes = self.store.read(files[".gitattributes"]).decode(errors="replace") \
            if ".gitattributes" in files else DEFAULT_GITATTRIBUTES
        patterns = lfs_patterns(gitattributes)
        answers = []
        for item in req.json().get("files", []):
            path = item["path"]
            if (problem := check_repo_path(path)) is not None:
                raise HubError(422, problem)
            sample = base64.b64decode(item.get("sample", ""))
            answer = {"path": path, "uploadMode": "lfs" if goes_to_lfs(path, item["size"], sample, patterns) else "regular",
                      "shouldIgnore": False}
            if path in files:
                # The client leaves out files whose oid it finds unchanged, and skips a commit
                # left empty by that (so an identical re-upload makes no commit).
                answer["oid"] = files[path].remote_oid
            answers.append(answer)
        return Reply(payload={"files": answers, "commitOid": commit_id})

    def lfs_batch(self, req: Request, ns: str, name: str, prefix: str | None = None) -> Reply:
        repo = self._repo(req, ns, name, prefix=prefix, write=True)
        body = req.json()
        if body.get("operation") != "upload":
            raise HubError(400, "The local hub's LFS batch API serves uploads only; download through /resolve/")
        expires = int(time.time()) + UPLOAD_URL_TTL
        objects = []
        for obj in body.get("objects", []):
            oid, size = obj.get("oid"), obj.get("size")
            if not (isinstance(oid, str) and re.fullmatch(r"[0-9a-f]{64}", oid) and isinstance(size, int) and size >= 0):
                objects.append({"oid": str(oid), "size": size if isinstance(size, int) else 0,
                                "error": {"code": 422, "message": "Invalid oid or size"}})
            elif self.store.lfs_size(oid) == size:
                objects.append({"oid": oid, "size": size})  # no actions: already stored
            else:
                query = urlencode({"size": size, "expires": expires, "signature": self._sign(oid, size, expires)})
                objects.append({"oid": oid, "size": size, "authenticated": True, "actions": {
                    "upload": {"href": f"{req.base}/lfs-uploads/{oid}?{query}", "expires_at": _iso_epoch(expires)},
                    "verify": {"href": f"{req.base}{repo_url_path(repo.type, repo.id)}.git/info/lfs/objects/verify"},
                }})
        # "basic": one PUT per object to a presigned-style URL (the Hub may also offer multipart).
        return Reply(payload={"transfer": "basic", "objects": objects},
                     headers={"Content-Type": "application/vnd.git-lfs+json"})

    def _sign(self, oid: str, size: int, expires: int) -> str:
        return hmac.new(self.upload_key, f"{oid}:{size}:{expires}".encode(), hashlib.sha256).hexdigest()

    def lfs_upload(self, req: Request, oid: str) -> Reply:
        try:
            size, expires = int(req.arg("size", "")), int(req.arg("expires", ""))
        except ValueError:
            raise HubError(403, "Missing or invalid upload signature") from None
        if not hmac.compare_digest(self._sign(oid, size, expires), req.arg("signature", "")) or expires < time.time():
            raise HubError(403, "Missing, invalid or expired upload signature")
        digest, received = hashlib.sha256(), 0
        tmp = self.store.incoming_file()
        try:
            with tmp:
                for piece in req.chunks():
                    digest.update(piece)
                    received += len(piece)
                    tmp.write(piece)
            if received != size or digest.hexdigest() != oid:
                raise HubError(400, f"Uploaded content does not match: expected sha256 {oid} and {size} bytes")
            self.store.adopt_lfs(Path(tmp.name), oid)
        finally:
            Path(tmp.name).unlink(missing_ok=True)  # gone already once adopted
        return Reply(payload={})

    def lfs_verify(self, req: Request, ns: str, name: str, prefix: str | None = None) -> Reply:
        self._repo(req, ns, name, prefix=prefix, write=True)
        body = req.json()
        if self.store.lfs_size(str(body.get("oid"))) != body.get("size"):
            raise HubError(404, f"LFS object {body.get('oid')} not found")
        return Reply(payload={"success": True})

    def xet_token(self, req: Request, **_) -> Reply:
        # huggingface_hub uploads through Xet whenever hf_xet is installed, whatever the LFS
        # batch API answers; hf_xet shows only this URL and status, so say why here too.
        message = ("The local hub has no Xet storage: set HF_HUB_DISABLE_XET=1 so that "
                   "huggingface_hub uploads LFS files through the LFS batch API")
        log.warning("%s %s: %s", req.method, req.path, message)
        raise HubError(501, message)

    def commit(self, req: Request, types: str, ns: str, name: str, rev: str) -> Reply:
        repo = self._repo(req, ns, name, types, write=True)
        if req.flag("create_pr"):
            raise HubError(400, "The local hub does not support pull requests (create_pr)")
        branch = rev.removeprefix("refs/heads/")
        if branch not in repo.branches:
            raise HubError(404, f"Invalid rev id: {rev} (commits go to a branch)", "RevisionNotFound")
        lines = [json.loads(line) for line in req.body().splitlines() if line.strip()]
        if not lines or lines[0].get("key") != "header":
            raise HubError(400, "The first line of a commit must be its header")
        header = lines[0]["value"]
        head = repo.branches[branch]
        parent = header.get("parentCommit")
        if parent and not head.startswith(parent):
            raise HubError(412, "The branch was updated since you opened this page. Please refresh and try again.")
        if not header.get("summary"):
            raise HubError(400, "A commit needs a summary")
        before = repo.files(head)
        after = dict(before)
        for line in lines[1:]:
            self._apply(after, line.get("key"), line.get("value") or {})
        changes = {p: e for p, e in after.items() if before.get(p) != e}
        changes.update({p: None for p in before if p not in after})
        commit_id = self.store.commit(repo, branch, changes, title=header["summary"],
                                      message=header.get("description") or "", author=req.caller.user)
        return Reply(payload={"success": True, "commitOid": commit_id, "hookOutput": "",
                              "commitUrl": f"{req.base}{repo_url_path(repo.type, repo.id)}/commit/{commit_id}"})

    def _apply(self, files: dict[str, FileEntry], key: str, value: dict) -> None:
        """Apply one NDJSON operation of a commit to the working tree `files`."""
        path = value.get("path", "")
        if key in ("file", "lfsFile") and (problem := check_repo_path(path)) is not None:
            raise HubError(422, problem)
        if key == "file":
            try:
                data = base64.b64decode(value["content"], validate=True) if value.get("encoding") == "base64" \
                    else value["content"].encode()
            except (KeyError, binascii.Error):
                raise HubError(400, f"Invalid content for {path}") from None
            if len(data) >= LFS_MIN_SIZE:
                raise HubError(400, f"Your push was rejected because {path} is larger than 10 MiB: store it with LFS")
            files[path] = self.store.put_regular(data)
        elif key == "lfsFile":
            oid = value.get("oid", "")
            size = self.store.lfs_size(oid)  # a copy of an LFS file gives no size
            if size is None or value.get("size", size) != size:
                raise HubError(400, f"Your push was rejected because the LFS object {oid} of {path} was never uploaded")
            files[path] = self.store.lfs_entry(oid, size)
        elif key == "deletedFile":
            if files.pop(path, None) is None:
                raise HubError(404, f"A file with this name doesn't exist: {path}", "EntryNotFound")
        elif key == "deletedFolder":
            below = [p for p in files if p.startswith(path.rstrip("/") + "/")]
            if not below:
                raise HubError(404, f"A folder with this name doesn't exist: {path}", "EntryNotFound")
            for p in below:
                del files[p]
        else:
            raise HubError(400, f"Unknown commit operation {key!r}")

    # ----- download -------------------------------------------------------------------------

    def resolve(self, req: Request, ns: str, name: str, rev: str, path: str, prefix: str | None = None) -> Reply:
        with self.lock:
            repo = self._repo(req, ns, name, prefix=prefix)
            self._require_gate_passed(req, repo)
            commit_id = self._revision(repo, rev)
            entry = repo.files(commit_id).get(path)
            if entry is None:
                # With X-Repo-Commit, the client caches that the file does not exist at that commit.
                raise HubError(404, "Entry not found", "EntryNotFound", {"X-Repo-Commit": commit_id})
            content = self.store.content_path(entry)
        headers = {"X-Repo-Commit": commit_id, "Accept-Ranges": "bytes", "Content-Type": "application/octet-stream"}
        if entry.lfs:
            # The Hub redirects LFS files to its CDN; the client only needs these headers
            # (it downloads from the URL it asked when there is no redirect).
            headers.update({"ETag": f'"{entry.lfs}"', "X-Linked-Etag": f'"{entry.lfs}"', "X-Linked-Size": str(entry.size)})
        else:
            headers["ETag"] = f'"{entry.oid}"'
        start, length = 0, entry.size
        byte_range = req.headers.get("Range")
        if byte_range:
            start, end = _parse_range(byte_range, entry.size)
            length = end - start + 1
            headers["Content-Range"] = f"bytes {start}-{end}/{entry.size}"
        return Reply(206 if byte_range else 200, headers=headers, file=content, start=start, length=length)


def _parse_range(header: str, size: int) -> tuple[int, int]:
    match = re.fullmatch(r"bytes=(\d*)-(\d*)", header.strip())
    if not match or match.groups() == ("", ""):
        raise HubError(416, f"Invalid range {header!r}", headers={"Content-Range": f"bytes */{size}"})
    first, last = match.groups()
    if first == "":  # the last N bytes
        start, end = max(size - int(last), 0), size - 1
    else:
        start, end = int(first), min(int(last), size - 1) if last else size - 1
    if start >= size or start > end:
        raise HubError(416, "Requested range not satisfiable", headers={"Content-Range": f"bytes */{size}"})
    return start, end


def _next_link(req: Request, **params) -> str:
    query = {k: v[-1] for k, v in req.query.items()}
    query.update({k: str(v) for k, v in params.items()})
    return f'<{req.base}{req.path}?{urlencode(query)}>; rel="next"'


def _fake_id(name: str) -> str:
    return hashlib.sha1(name.encode()).hexdigest()[:24]  # the Hub's ids are 24-hex object ids


def _iso_epoch(seconds: int) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(seconds))
