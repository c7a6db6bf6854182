"""The first_boot_host_keys fault: a new VM serves and publishes one set of host keys, then its
guest agent's first-boot action serves new ones, and publishes them a moment later."""

from __future__ import annotations

import paramiko
import pytest

from tests.conftest import poll
from tests.localcloud.conftest import COMPUTE_PROJECT, COMPUTE_ZONE

WHERE = {"project": COMPUTE_PROJECT, "zone": COMPUTE_ZONE}


def published(discovery, name: str) -> dict[str, str]:
    answer = discovery.instances().getGuestAttributes(instance=name, queryPath="hostkeys/", **WHERE).execute()
    return {item["key"]: item["value"] for item in answer["queryValue"]["items"]}


def served(ip: str) -> str:
    """The Ed25519 host key sshd shows a new connection (read with no trust at all)."""
    with paramiko.Transport((ip, 22)) as transport:
        transport.get_security_options().key_types = ["ssh-ed25519"]
        transport.start_client(timeout=10)
        return transport.get_remote_server_key().get_base64()


def test_the_first_boot_serves_new_keys_then_publishes_them(compute_cloud, compute_vm, compute_discovery):
    compute_cloud.set_faults({"first_boot_host_keys": {"seconds": 2, "publish_after": 2, "name_regex": "^lc-fbk-"}})
    instance = compute_vm("lc-fbk-1", metadata={"enable-guest-attributes": "TRUE"})
    ip = instance["networkInterfaces"][0]["networkIP"]
    first = published(compute_discovery, "lc-fbk-1")
    assert set(first) == {"ssh-ed25519", "ecdsa-sha2-nistp256", "ssh-rsa"}
    assert served(ip) == first["ssh-ed25519"]  # cloud-init's keys: published and served
    # The guest agent's new keys are served while the old ones are still published...
    poll(lambda: served(ip) != first["ssh-ed25519"], timeout=30, what="new host keys served")
    new_key = served(ip)
    between = published(compute_discovery, "lc-fbk-1")
    # ...then published (every type changed), and they stay.
    poll(lambda: published(compute_discovery, "lc-fbk-1")["ssh-ed25519"] == new_key, timeout=30,
         what="new host keys published")
    after = published(compute_discovery, "lc-fbk-1")
    assert all(after[kind] != first[kind] for kind in first)
    assert between == first or between == after  # one publication, no mix of old and new
    assert served(ip) == after["ssh-ed25519"] == published(compute_discovery, "lc-fbk-1")["ssh-ed25519"]


@pytest.mark.parametrize("rule", [{}, {"seconds": 0}, {"seconds": 2, "publish_after": -1}, {"seconds": 2, "other": 1}])
def test_bad_rules_are_refused(compute_cloud, rule):
    with pytest.raises(Exception, match="first_boot_host_keys"):
        compute_cloud.set_faults({"first_boot_host_keys": rule})
