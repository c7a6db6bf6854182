"""Preflight's Hub publishing check against the local Hub: it names a token that could not
publish to hub_repo_id (read-only, fine-grained without write there, not of the owner), passes one
that could, and agrees with what the Hub does when publish_to_hub then writes."""

from __future__ import annotations

import dataclasses
import uuid

import pytest
from huggingface_hub import HfApi, constants
from huggingface_hub.errors import HfHubHTTPError

from localcloud.hub.launcher import HubEmulator
from maxtext_sft.tasks.preflight import PreflightFailed, check_hub_write
from tests.plugins.test_spec import make_spec

USER, ORG = "alice", "team-org"
# token -> how add_user makes it; every one is alice's, a write member of team-org (read of read-org)
TOKENS = {
    "write": {"role": "write"},
    "read": {"role": "read"},
    "fine-write-user": {"role": "fineGrained", "scoped": {f"user:{USER}": ["repo.content.read", "repo.write"]}},
    "fine-write-org": {"role": "fineGrained", "scoped": {f"org:{ORG}": ["repo.content.read", "repo.write"]}},
    "fine-read": {"role": "fineGrained", "scoped": {f"user:{USER}": ["repo.content.read"],
                                                    f"org:{ORG}": ["repo.content.read"]}},
    "fine-content-org": {"role": "fineGrained", "scoped": {f"org:{ORG}": ["repo.content.write"]}},
}


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    token: str
    owner: str
    exists: bool
    refusal: str | None = None  # what the failure says, None: it passes


CASES = [
    Case("a write token, own repo", "write", USER, True),
    Case("a write token, org repo to create", "write", ORG, False),
    Case("a read-only token", "read", USER, True, "the Hugging Face token (of alice) is read-only"),
    Case("a read-only token, repo to create", "read", USER, False, "is read-only"),
    Case("fine-grained with write on the user", "fine-write-user", USER, True),
    Case("fine-grained with write on the user, repo to create", "fine-write-user", USER, False),
    Case("fine-grained with write on the org, repo to create", "fine-write-org", ORG, False),
    Case("fine-grained without write on the user", "fine-read", USER, True,
         "is fine-grained without repo.content.write or repo.write on alice/"),
    Case("fine-grained without write on the org", "fine-read", ORG, True,
         "is fine-grained without repo.content.write or repo.write on team-org/"),
    Case("fine-grained without write on the org, repo to create", "fine-read", ORG, False,
         "is fine-grained without repo.write on team-org (its permissions there: repo.content.read)"),
    Case("fine-grained with content write on the org writes its repo", "fine-content-org", ORG, True),
    Case("fine-grained with content write on the org cannot create there", "fine-content-org", ORG, False,
         "cannot create it under team-org"),
    Case("fine-grained with write on the user only, org repo", "fine-write-user", ORG, True, "without"),
    Case("a write token, another user's namespace", "write", "bob", True, "alice is not bob nor a member of it"),
    Case("a write token, an org where alice reads only", "write", "read-org", False,
         "alice has the read role in read-org"),
]


@pytest.fixture(autouse=True)
def _uploads_without_xet(monkeypatch):
    monkeypatch.setattr(constants, "HF_HUB_DISABLE_XET", True)  # the local Hub speaks LFS only


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    with HubEmulator(tmp_path_factory.mktemp("hub")) as emulator:
        emulator.add_user("bob", "hf_bob")
        for token, how in TOKENS.items():
            emulator.add_user(USER, f"hf_{token}", role=how["role"], scoped=how.get("scoped"),
                              orgs=(ORG, "read-org"), org_roles={"read-org": "read"})
        yield emulator


def whoami_of(api: HfApi):
    return lambda: api.whoami()


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_preflight_names_a_token_that_could_not_publish_and_the_hub_agrees(case, hub):
    repo = f"{case.owner}/sft-{uuid.uuid4().hex[:8]}"
    if case.exists:
        hub.seed_repo(repo, {"config.json": "{}"}, private=False)
    spec = make_spec(hub_repo_id=repo)
    api = HfApi(endpoint=hub.endpoint, token=f"hf_{case.token}")
    hub.clear_requests()

    if case.refusal is None:
        found = check_hub_write(api, spec, whoami_of(api))
        assert ("may write to it" if case.exists else f"may create it under {case.owner}") in found
    else:
        with pytest.raises(PreflightFailed) as failed:
            check_hub_write(api, spec, whoami_of(api))
        message = str(failed.value)
        assert case.refusal in message
        assert message.startswith(f"Param hub_repo_id {repo}: ")
        assert f"Put a token with write access to {case.owner} in the Hugging Face connection" in message
    assert {r["method"] for r in hub.requests()} == {"GET"}  # preflight wrote nothing

    # What publish_to_hub then does: create the repo when it is missing, and commit to it.
    try:
        if not case.exists:
            api.create_repo(repo)
        api.upload_file(repo_id=repo, path_or_fileobj=b"{}", path_in_repo="tuned.json")
        published = True
    except HfHubHTTPError as error:
        assert error.response.status_code == 403
        published = False
    assert published == (case.refusal is None)
