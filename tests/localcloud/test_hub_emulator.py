"""The local Hub, driven only through huggingface_hub's own client (HfApi, hf_hub_download,
snapshot_download, HfFileSystem) pointed at it with endpoint= and token=."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from huggingface_hub import (
    CommitOperationAdd,
    HfApi,
    HfFileSystem,
    constants,
    hf_hub_download,
    snapshot_download,
)
from huggingface_hub.errors import (
    EntryNotFoundError,
    GatedRepoError,
    HfHubHTTPError,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)

from localcloud.hub.launcher import HubEmulator

ALICE = "hf_alice_write_token"
BOB = "hf_bob_write_token"
READER = "hf_alice_read_token"


@pytest.fixture(autouse=True)
def _uploads_without_xet(monkeypatch):
    # hf_xet is installed, and huggingface_hub then uploads through Xet storage whatever the
    # LFS batch API answers; the local hub speaks the LFS protocol only (HF_HUB_DISABLE_XET=1).
    monkeypatch.setattr(constants, "HF_HUB_DISABLE_XET", True)


@pytest.fixture
def hub(tmp_path):
    with HubEmulator(tmp_path / "hub-state") as emulator:
        emulator.add_user("alice", ALICE, role="write")
        emulator.add_user("alice", READER, role="read")
        emulator.add_user("bob", BOB, role="write")
        yield emulator


def api(hub: HubEmulator, token: str | bool = ALICE) -> HfApi:
    return HfApi(endpoint=hub.endpoint, token=token)


@pytest.fixture
def model_folder(tmp_path) -> Path:
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "model.safetensors").write_bytes(os.urandom(12 * 1024 * 1024))  # > 10 MB: LFS
    (folder / "config.json").write_text(json.dumps({"model_type": "gemma3", "hidden_size": 8}))
    (folder / "README.md").write_text("---\nlicense: gemma\ntags:\n- sft\n- maxtext\n---\n# Toy SFT model\n")
    return folder


def test_whoami_and_bad_token(hub):
    me = api(hub).whoami()
    assert me["name"] == "alice"
    assert me["auth"]["accessToken"]["role"] == "write"
    assert api(hub, READER).whoami()["auth"]["accessToken"]["role"] == "read"

    with pytest.raises(HfHubHTTPError) as bad:
        api(hub, "hf_not_a_token").whoami()
    assert bad.value.response.status_code == 401
    assert "Invalid user token" in str(bad.value)
    assert hub.requests()[-1]["status"] == 401


def test_create_repo(hub):
    alice = api(hub)
    url = alice.create_repo("alice/toy-model")
    assert (url.repo_id, url.repo_type) == ("alice/toy-model", "model")
    assert url == f"{hub.endpoint}/alice/toy-model"
    assert alice.create_repo("alice/toy-model", exist_ok=True) == url  # the Hub's 409, handled by exist_ok
    with pytest.raises(HfHubHTTPError) as exists:
        alice.create_repo("alice/toy-model")
    assert exists.value.response.status_code == 409

    dataset_url = alice.create_repo("alice/toy-data", repo_type="dataset", private=True)
    assert dataset_url == f"{hub.endpoint}/datasets/alice/toy-data"
    assert alice.dataset_info("alice/toy-data").private is True
    assert alice.repo_exists("alice/toy-data", repo_type="dataset")
    assert not alice.repo_exists("alice/toy-data")  # no such model
    # Like the Hub, a new repo starts with an "initial commit" of .gitattributes.
    [initial] = alice.list_repo_commits("alice/toy-model")
    assert initial.title == "initial commit"
    assert alice.list_repo_files("alice/toy-model") == [".gitattributes"]


def test_upload_folder_makes_one_commit_with_lfs_and_regular_files(hub, model_folder):
    alice = api(hub)
    alice.create_repo("alice/toy-model")
    hub.clear_requests()

    commit = alice.upload_folder(
        repo_id="alice/toy-model", folder_path=model_folder,
        commit_message="Upload SFT checkpoint", commit_description="step 10",
    )

    commits = alice.list_repo_commits("alice/toy-model")
    assert [c.title for c in commits] == ["Upload SFT checkpoint", "initial commit"]
    assert commits[0].commit_id == commit.oid and commits[0].message == "step 10"
    assert commits[0].authors == ["alice"]
    info = alice.model_info("alice/toy-model", files_metadata=True)
    assert info.sha == commit.oid
    files = {s.rfilename: s for s in info.siblings}
    assert sorted(files) == [".gitattributes", "README.md", "config.json", "model.safetensors"]
    assert files["model.safetensors"].lfs.size == 12 * 1024 * 1024
    assert files["config.json"].lfs is None and files["README.md"].lfs is None
    assert info.card_data.license == "gemma"
    assert {"sft", "maxtext", "license:gemma"} <= set(info.tags)

    calls = [(r["method"], r["path"], r["status"]) for r in hub.requests()]
    assert ("POST", "/api/models/alice/toy-model/preupload/main", 200) in calls
    assert ("POST", "/alice/toy-model.git/info/lfs/objects/batch", 200) in calls
    assert any(m == "PUT" and p.startswith("/lfs-uploads/") and s == 200 for m, p, s in calls)
    assert calls.count(("POST", "/api/models/alice/toy-model/commit/main", 200)) == 1


def test_identical_upload_folder_makes_no_commit(hub, model_folder):
    """The Hub would record an empty commit; huggingface_hub does not send it: the preupload
    answer gives each existing file's oid, the client drops unchanged files, and with nothing
    left it returns the branch's head without calling the commit endpoint."""
    alice = api(hub)
    alice.create_repo("alice/toy-model")
    first = alice.upload_folder(repo_id="alice/toy-model", folder_path=model_folder)
    hub.clear_requests()

    again = alice.upload_folder(repo_id="alice/toy-model", folder_path=model_folder)

    assert again.oid == first.oid
    assert len(alice.list_repo_commits("alice/toy-model")) == 2
    paths = [r["path"] for r in hub.requests()]
    assert "/api/models/alice/toy-model/preupload/main" in paths
    assert not any("/commit/" in p or p.startswith("/lfs-uploads/") for p in paths)


def test_commit_without_change_still_commits_on_the_server(hub):
    """What the client avoids above: a commit that changes nothing, sent anyway, is a commit."""
    from huggingface_hub.utils import build_hf_headers, get_session, hf_raise_for_status

    alice = api(hub)
    alice.create_repo("alice/toy-model")
    head = alice.model_info("alice/toy-model").sha
    ndjson = json.dumps({"key": "header", "value": {"summary": "Nothing new", "description": ""}}) + "\n"
    response = get_session().post(
        f"{hub.endpoint}/api/models/alice/toy-model/commit/main", content=ndjson.encode(),
        headers={"Content-Type": "application/x-ndjson", **build_hf_headers(token=ALICE)},
    )
    hf_raise_for_status(response)
    commits = alice.list_repo_commits("alice/toy-model")
    assert [c.title for c in commits] == ["Nothing new", "initial commit"]
    assert response.json()["commitOid"] == commits[0].commit_id != head
    assert alice.list_repo_files("alice/toy-model") == [".gitattributes"]


def test_dataset_upload_and_deletions(hub, tmp_path):
    alice = api(hub)
    alice.create_repo("alice/toy-data", repo_type="dataset")
    shard = tmp_path / "train-00000.parquet"
    shard.write_bytes(b"PAR1" + os.urandom(4096) + b"PAR1")
    alice.upload_file(repo_id="alice/toy-data", repo_type="dataset", path_or_fileobj=shard,
                      path_in_repo="data/train-00000.parquet")
    alice.upload_file(repo_id="alice/toy-data", repo_type="dataset", path_or_fileobj=b"notes",
                      path_in_repo="docs/notes.txt")
    paths = [r["path"] for r in hub.requests()]
    assert "/datasets/alice/toy-data.git/info/lfs/objects/batch" in paths
    assert "/api/datasets/alice/toy-data/commit/main" in paths

    alice.delete_file("data/train-00000.parquet", repo_id="alice/toy-data", repo_type="dataset")
    alice.delete_folder("docs", repo_id="alice/toy-data", repo_type="dataset")
    assert alice.list_repo_files("alice/toy-data", repo_type="dataset") == [".gitattributes"]
    with pytest.raises(EntryNotFoundError):
        alice.delete_file("docs/notes.txt", repo_id="alice/toy-data", repo_type="dataset")
    # Earlier commits still hold the deleted files.
    commits = alice.list_repo_commits("alice/toy-data", repo_type="dataset")
    assert [c.title for c in commits][:2] == ["Delete folder docs with huggingface_hub", "Delete data/train-00000.parquet with huggingface_hub"]
    assert "docs/notes.txt" in alice.list_repo_files("alice/toy-data", repo_type="dataset", revision=commits[2].commit_id)


def test_list_repo_commits_follows_pages(hub):
    hub.seed_repo("alice/long-history", commits=[
        {"files": {"step.txt": str(i)}, "title": f"step {i}", "date": f"2024-01-01T00:{i:02d}:00Z"} for i in range(57)
    ])
    commits = api(hub).list_repo_commits("alice/long-history")
    assert [c.title for c in commits] == [f"step {i}" for i in reversed(range(57))]
    pages = [r["query"].get("p") for r in hub.requests() if "/commits/" in r["path"]]
    assert pages == [None, "1"]  # a second page, reached through the Link header


def test_branch_and_upload_to_branch(hub):
    alice = api(hub)
    alice.create_repo("alice/toy-model")
    main_head = alice.model_info("alice/toy-model").sha
    alice.create_branch("alice/toy-model", branch="sft-run-1")
    alice.create_branch("alice/toy-model", branch="sft-run-1", exist_ok=True)
    with pytest.raises(HfHubHTTPError) as exists:
        alice.create_branch("alice/toy-model", branch="sft-run-1")
    assert exists.value.response.status_code == 409

    commit = alice.upload_file(
        repo_id="alice/toy-model", path_or_fileobj=b"{}", path_in_repo="checkpoints/10/config.json",
        revision="sft-run-1", commit_message="Checkpoint 10",
    )

    refs = {b.name: b.target_commit for b in alice.list_repo_refs("alice/toy-model").branches}
    assert refs == {"main": main_head, "sft-run-1": commit.oid}
    assert alice.file_exists("alice/toy-model", "checkpoints/10/config.json", revision="sft-run-1")
    assert not alice.file_exists("alice/toy-model", "checkpoints/10/config.json")
    assert [c.title for c in alice.list_repo_commits("alice/toy-model", revision="sft-run-1")] == [
        "Checkpoint 10", "initial commit"]
    assert alice.revision_exists("alice/toy-model", "sft-run-1")
    assert not alice.revision_exists("alice/toy-model", "no-such-branch")
    tree = alice.list_repo_tree("alice/toy-model", revision="sft-run-1", recursive=True)
    assert sorted(e.path for e in tree) == [".gitattributes", "checkpoints", "checkpoints/10", "checkpoints/10/config.json"]
    [info] = alice.get_paths_info("alice/toy-model", ["checkpoints/10/config.json", "missing"], revision="sft-run-1")
    assert (info.path, info.size) == ("checkpoints/10/config.json", 2)


def test_parent_commit_conflict(hub):
    alice = api(hub)
    alice.create_repo("alice/toy-model")
    stale = alice.model_info("alice/toy-model").sha
    alice.upload_file(repo_id="alice/toy-model", path_or_fileobj=b"a", path_in_repo="a.txt")

    with pytest.raises(HfHubHTTPError) as conflict:
        alice.create_commit(
            "alice/toy-model", [CommitOperationAdd("b.txt", b"b")], commit_message="late", parent_commit=stale)
    assert conflict.value.response.status_code == 412
    assert "The branch was updated since you opened this page" in str(conflict.value)

    current = alice.model_info("alice/toy-model").sha
    commit = alice.create_commit(
        "alice/toy-model", [CommitOperationAdd("b.txt", b"b")], commit_message="on time", parent_commit=current)
    assert alice.list_repo_commits("alice/toy-model")[0].commit_id == commit.oid


def test_snapshot_download_round_trip(hub, model_folder, tmp_path):
    alice = api(hub)
    alice.create_repo("alice/toy-model")
    commit = alice.upload_folder(repo_id="alice/toy-model", folder_path=model_folder)

    local = Path(snapshot_download("alice/toy-model", endpoint=hub.endpoint, token=ALICE, local_dir=tmp_path / "dl"))
    for name in ("model.safetensors", "config.json", "README.md"):
        assert (local / name).read_bytes() == (model_folder / name).read_bytes()

    cached = hf_hub_download("alice/toy-model", "model.safetensors", revision=commit.oid,
                             endpoint=hub.endpoint, token=ALICE, cache_dir=tmp_path / "cache")
    assert Path(cached).read_bytes() == (model_folder / "model.safetensors").read_bytes()
    assert f"snapshots/{commit.oid}/" in cached
    with pytest.raises(EntryNotFoundError):
        hf_hub_download("alice/toy-model", "missing.bin", endpoint=hub.endpoint, token=ALICE, cache_dir=tmp_path / "cache")
    with pytest.raises(RevisionNotFoundError):
        hf_hub_download("alice/toy-model", "config.json", revision="nope", endpoint=hub.endpoint, token=ALICE,
                        cache_dir=tmp_path / "cache")


def test_dataset_commits_keep_their_seeded_dates(hub):
    seeded = hub.seed_repo("alice/ultrachat-toy", repo_type="dataset", commits=[
        {"files": {"data/train.jsonl": '{"n": 1}\n'}, "title": "January data", "date": "2024-01-15T10:00:00Z"},
        {"files": {"data/train.jsonl": '{"n": 2}\n'}, "title": "March data", "date": "2024-03-15T10:00:00Z"},
    ])
    alice = api(hub)
    commits = alice.list_repo_commits("alice/ultrachat-toy", repo_type="dataset")
    assert [c.commit_id for c in commits] == list(reversed(seeded["commits"]))
    assert [c.created_at.isoformat() for c in commits] == ["2024-03-15T10:00:00+00:00", "2024-01-15T10:00:00+00:00"]

    # "The newest commit at or before a date", pinned, reads that commit's data.
    import datetime as dt
    cutoff = dt.datetime(2024, 2, 1, tzinfo=dt.timezone.utc)
    pinned = next(c.commit_id for c in commits if c.created_at <= cutoff)
    assert alice.dataset_info("alice/ultrachat-toy", revision=pinned).sha == pinned
    path = hf_hub_download("alice/ultrachat-toy", "data/train.jsonl", repo_type="dataset", revision=pinned,
                           endpoint=hub.endpoint, token=ALICE, cache_dir=hub.state_dir.parent / "cache")
    assert Path(path).read_text() == '{"n": 1}\n'


def test_hffilesystem_glob_and_read_parquet_at_a_pinned_revision(hub):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")

    def parquet(rows: list[str]) -> bytes:
        buffer = io.BytesIO()
        pq.write_table(pa.table({"text": rows}), buffer)
        return buffer.getvalue()

    seeded = hub.seed_repo("alice/chat-data", repo_type="dataset", commits=[
        {"files": {"data/train-00000.parquet": parquet(["v1 row"]), "README.md": "# data"}, "date": "2024-01-01T00:00:00Z"},
        {"files": {"data/train-00000.parquet": parquet(["v2 row"]), "data/train-00001.parquet": parquet(["more"])},
         "date": "2024-02-01T00:00:00Z"},
    ])
    first = seeded["commits"][0]
    fs = HfFileSystem(endpoint=hub.endpoint, token=ALICE, skip_instance_cache=True)

    assert fs.glob(f"datasets/alice/chat-data@{first}/data/*.parquet") == [
        f"datasets/alice/chat-data@{first}/data/train-00000.parquet"]
    assert len(fs.glob("datasets/alice/chat-data/data/*.parquet")) == 2
    with fs.open(f"hf://datasets/alice/chat-data@{first}/data/train-00000.parquet", "rb") as f:
        assert pq.read_table(f).column("text").to_pylist() == ["v1 row"]
    # The reads were ranged GETs of the pinned commit's file (parquet reads its footer first).
    ranged = [r for r in hub.requests() if r["method"] == "GET" and "/resolve/" in r["path"]]
    assert ranged and all(r["status"] == 206 and f"/resolve/{first}/" in r["path"] for r in ranged)
    assert api(hub).get_paths_info("alice/chat-data", ["data/train-00000.parquet"], repo_type="dataset",
                                   revision=first)[0].lfs is not None  # binary and *.parquet: LFS


def test_gated_repo_needs_a_grant(hub, tmp_path):
    hub.seed_repo("google/gemma-toy", {"config.json": '{"model_type": "gemma3"}'}, gated=True)
    bob = api(hub, BOB)

    info = bob.model_info("google/gemma-toy")  # metadata stays visible
    assert info.gated == "manual"
    assert bob.repo_exists("google/gemma-toy")
    with pytest.raises(GatedRepoError):
        hf_hub_download("google/gemma-toy", "config.json", endpoint=hub.endpoint, token=BOB, cache_dir=tmp_path / "c1")
    with pytest.raises(GatedRepoError):
        hf_hub_download("google/gemma-toy", "config.json", endpoint=hub.endpoint, token=False, cache_dir=tmp_path / "c1")

    hub.grant("bob", "google/gemma-toy")
    path = hf_hub_download("google/gemma-toy", "config.json", endpoint=hub.endpoint, token=BOB, cache_dir=tmp_path / "c2")
    assert json.loads(Path(path).read_text()) == {"model_type": "gemma3"}


def test_auth_check_answers_whether_the_files_are_readable(hub):
    hub.seed_repo("google/gemma-auth", {"config.json": "{}"}, gated=True)
    bob = api(hub, BOB)
    with pytest.raises(GatedRepoError):
        bob.auth_check("google/gemma-auth")
    with pytest.raises(RepositoryNotFoundError):
        bob.auth_check("google/no-such-model")
    hub.grant("bob", "google/gemma-auth")
    bob.auth_check("google/gemma-auth")  # no error: access granted
    hub.seed_repo("open/dataset", {"data/train.parquet": b"x"}, repo_type="dataset")
    bob.auth_check("open/dataset", repo_type="dataset")


def test_private_repo_does_not_exist_for_others(hub, tmp_path):
    alice = api(hub)
    alice.create_repo("alice/secret", private=True)
    alice.upload_file(repo_id="alice/secret", path_or_fileobj=b"x", path_in_repo="x.txt")

    for token in (BOB, False):
        with pytest.raises(RepositoryNotFoundError):
            api(hub, token).model_info("alice/secret")
        with pytest.raises(RepositoryNotFoundError):
            hf_hub_download("alice/secret", "x.txt", endpoint=hub.endpoint, token=token, cache_dir=tmp_path / "c")
        assert not api(hub, token).repo_exists("alice/secret")
    assert alice.model_info("alice/secret").private is True


def test_read_token_cannot_write(hub):
    reader = api(hub, READER)
    with pytest.raises(HfHubHTTPError) as create:
        reader.create_repo("alice/new-model")
    assert create.value.response.status_code == 403
    assert not api(hub).repo_exists("alice/new-model")

    api(hub).create_repo("alice/toy-model")
    with pytest.raises(HfHubHTTPError) as upload:
        reader.upload_file(repo_id="alice/toy-model", path_or_fileobj=b"x", path_in_repo="x.txt")
    assert upload.value.response.status_code == 403
    assert reader.list_repo_files("alice/toy-model") == [".gitattributes"]  # reading is fine
    # Someone else's namespace is off limits even with a write token.
    with pytest.raises(HfHubHTTPError) as foreign:
        api(hub, BOB).create_repo("alice/bobs-model")
    assert foreign.value.response.status_code == 403


def test_request_log_has_no_bodies_or_credentials(hub):
    alice = api(hub)
    alice.create_repo("alice/toy-model")
    alice.upload_file(repo_id="alice/toy-model", path_or_fileobj=b"secret-content", path_in_repo="x.txt")
    entries = hub.requests()
    assert entries and all(set(e) == {"time", "method", "path", "query", "status", "user"} for e in entries)
    assert {e["user"] for e in entries} == {"alice"}
    dump = json.dumps(entries)
    assert ALICE not in dump and "secret-content" not in dump and "c2VjcmV0" not in dump
    hub.clear_requests()
    assert hub.requests() == []


def test_uploads_through_xet_are_refused(hub, monkeypatch, tmp_path):
    """With hf_xet installed and Xet not disabled, the client never asks the LFS batch API."""
    monkeypatch.setattr(constants, "HF_HUB_DISABLE_XET", False)
    alice = api(hub)
    alice.create_repo("alice/toy-model")
    weights = tmp_path / "weights.bin"
    weights.write_bytes(b"\0" * 1024)
    with pytest.raises(Exception, match="xet-write-token"):
        alice.upload_file(repo_id="alice/toy-model", path_or_fileobj=weights, path_in_repo="weights.bin")
    assert any(r["path"].endswith("/xet-write-token/main") and r["status"] == 501 for r in hub.requests())


def test_state_survives_a_restart_and_stop_ends_the_server(tmp_path):
    state = tmp_path / "hub-state"
    with HubEmulator(state) as first:
        first.add_user("alice", ALICE)
        api(first).create_repo("alice/toy-model")
        server = first._service.proc
    assert server.returncode == 0  # SIGTERM is a clean exit
    with HubEmulator(state) as second:
        assert api(second).list_repo_files("alice/toy-model") == [".gitattributes"]


def test_server_exits_when_its_parent_dies(tmp_path):
    # The parent is a shell that starts the server in the background and exits at once.
    server_log = tmp_path / "server.log"
    parent = subprocess.run(
        ["bash", "-c", f'{sys.executable} -m localcloud.hub --state-dir {tmp_path / "s"} '
                       f'--parent-pid $$ >{server_log} 2>&1 & sleep 1.5; echo $!'],
        capture_output=True, text=True, check=True, cwd=Path(__file__).resolve().parents[2],
    )
    server_pid = int(parent.stdout.strip())
    deadline = time.monotonic() + 10
    while Path(f"/proc/{server_pid}").exists() and "zombie" not in _proc_state(server_pid):
        assert time.monotonic() < deadline, "the hub server outlived its parent"
        time.sleep(0.1)
    log_text = server_log.read_text()
    assert "hub emulator listening" in log_text and "is gone" in log_text, log_text


def _proc_state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/status").read_text().lower()
    except FileNotFoundError:
        return "gone"


def test_client_configured_by_environment_only(hub, model_folder, tmp_path):
    """How a process on the VM uses the hub: HF_ENDPOINT, HF_TOKEN and HF_HUB_DISABLE_XET=1."""
    script = f"""
import pathlib
from huggingface_hub import HfApi, snapshot_download
api = HfApi()
api.create_repo("alice/from-env", exist_ok=True)
api.upload_folder(repo_id="alice/from-env", folder_path={str(model_folder)!r}, commit_message="from env")
local = pathlib.Path(snapshot_download("alice/from-env", local_dir={str(tmp_path / "env-dl")!r}))
print(sorted(p.name for p in local.iterdir() if p.is_file()))
"""
    env = {**os.environ, "HF_ENDPOINT": hub.endpoint, "HF_TOKEN": ALICE, "HF_HUB_DISABLE_XET": "1",
           "HF_HOME": str(tmp_path / "hf-home")}
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip() == "['.gitattributes', 'README.md', 'config.json', 'model.safetensors']"
    assert (tmp_path / "env-dl" / "model.safetensors").read_bytes() == (model_folder / "model.safetensors").read_bytes()
    assert api(hub).list_repo_commits("alice/from-env")[0].title == "from env"


FINE_WRITE = "hf_carol_fine_grained_write"
FINE_READ = "hf_carol_fine_grained_read"
FINE_REPO = "hf_carol_fine_grained_one_repo"


@pytest.fixture
def fine_grained(hub):
    """carol, a member of team-org: fine-grained tokens with write on her namespace and the org,
    with read only, and with content write on one repo only."""
    hub.add_user("carol", FINE_WRITE, role="fineGrained", orgs=("team-org",),
                 scoped={"user:carol": ["repo.content.read", "repo.write"], "org:team-org": ["repo.write"]})
    hub.add_user("carol", FINE_READ, role="fineGrained", orgs=("team-org",),
                 scoped={"user:carol": ["repo.content.read"], "org:team-org": ["repo.content.read"]})
    hub.add_user("carol", FINE_REPO, role="fineGrained", orgs=("team-org",),
                 scoped={"model:carol/one": ["repo.content.read", "repo.content.write"]})
    api(hub, FINE_WRITE).create_repo("carol/one")
    return hub


def test_whoami_of_a_fine_grained_token_names_its_permissions_and_the_orgs_role(fine_grained):
    me = api(fine_grained, FINE_READ).whoami()
    token = me["auth"]["accessToken"]
    assert me["auth"]["type"] == "access_token" and token["role"] == "fineGrained"
    assert [(s["entity"]["type"], s["entity"]["name"], s["permissions"]) for s in token["fineGrained"]["scoped"]] == [
        ("user", "carol", ["repo.content.read"]), ("org", "team-org", ["repo.content.read"])]
    assert all(len(s["entity"]["_id"]) == 24 for s in token["fineGrained"]["scoped"])
    assert token["fineGrained"]["global"] == [] and token["fineGrained"]["canReadGatedRepos"] is True
    assert [(o["name"], o["roleInOrg"]) for o in me["orgs"]] == [("team-org", "write")]
    assert "fineGrained" not in api(fine_grained).whoami()["auth"]["accessToken"]  # a classic write token


def test_a_fine_grained_token_without_write_is_refused_every_write(fine_grained, tmp_path):
    reader = api(fine_grained, FINE_READ)
    for write in (
        lambda: reader.create_repo("carol/two"),
        lambda: reader.create_repo("team-org/two"),
        lambda: reader.upload_file(repo_id="carol/one", path_or_fileobj=b"x", path_in_repo="x.txt"),  # a commit
        lambda: reader.preupload_lfs_files("carol/one", additions=[  # the LFS upload before a commit
            CommitOperationAdd("w.safetensors", os.urandom(11 * 1024 * 1024))]),
    ):
        with pytest.raises(HfHubHTTPError) as refused:
            write()
        assert refused.value.response.status_code == 403
        assert "You don't have the rights to" in str(refused.value)
    assert [r["status"] for r in fine_grained.requests() if r["method"] == "POST"][-4:] == [403] * 4
    assert reader.list_repo_files("carol/one") == [".gitattributes"]  # reading is fine


def test_a_fine_grained_token_writes_where_its_scopes_say(fine_grained):
    api(fine_grained, FINE_WRITE).create_repo("team-org/two")  # repo.write on the org: may create
    one = api(fine_grained, FINE_REPO)
    one.upload_file(repo_id="carol/one", path_or_fileobj=b"x", path_in_repo="x.txt")  # content write on it
    with pytest.raises(HfHubHTTPError) as create:
        one.create_repo("carol/three")  # but no repo.write on carol: no creation
    assert create.value.response.status_code == 403
    with pytest.raises(HfHubHTTPError) as other:
        one.upload_file(repo_id="team-org/two", path_or_fileobj=b"x", path_in_repo="x.txt")
    assert other.value.response.status_code == 403


def test_a_read_member_of_an_org_cannot_write_there_even_with_a_write_token(hub):
    hub.add_user("dave", "hf_dave_write", orgs=("team-org", "other-org"), org_roles={"team-org": "read"})
    dave = api(hub, "hf_dave_write")
    assert {o["name"]: o["roleInOrg"] for o in dave.whoami()["orgs"]} == {"team-org": "read", "other-org": "write"}
    with pytest.raises(HfHubHTTPError) as refused:
        dave.create_repo("team-org/model")
    assert refused.value.response.status_code == 403
    dave.create_repo("other-org/model")
