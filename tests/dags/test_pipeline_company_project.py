"""A run in a company-shaped project: its VM on a custom-mode Shared VPC whose host project owns the
network and the subnetwork the run names, and on a TPU reservation another project owns and
shares with the run's; the VM has no external address and every SSH connection, a worker's or a
trigger's, goes through IAP under the Google connection's service account. The local cloud refuses an insert on such a network without a subnetwork,
and a reservation not shared with the inserting project, as Compute Engine does
(tests/localcloud/test_compute_networks.py, test_compute_shared_reservations.py); preflight names
both cases first (tests/dags/test_preflight.py)."""

from __future__ import annotations

import pytest

from localcloud.connections import LOCAL_PROJECT, LOCAL_SERVICE_ACCOUNT

pytestmark = pytest.mark.e2e
HOST = "local-vpc-host"  # the Shared VPC's host project
OWNER = "local-capacity"  # the project that bought the reservation
ZONE = "us-east5-b"


@pytest.fixture
def runs_account_may_tunnel(local_cloud, pipeline_connections):
    """The Google connection's service account (localcloud/connections.py) gets the IAP-secured
    Tunnel User role on the run's project, as a company grants it to its Airflow's account."""
    local_cloud.grant_iap_tunnel_user(LOCAL_PROJECT, f"serviceAccount:{LOCAL_SERVICE_ACCOUNT}")
    yield
    local_cloud.revoke_iap_tunnel_user(LOCAL_PROJECT, f"serviceAccount:{LOCAL_SERVICE_ACCOUNT}")


def test_a_run_on_a_shared_vpc_and_a_shared_reservation_through_iap_succeeds_reading_each_where_it_lives(
    run_pipeline, local_cloud, runs_account_may_tunnel
):
    local_cloud.add_network("team-vpc", project=HOST, subnetworks={"team-tpu": "10.40.0.0/24"})
    local_cloud.add_reservation("team-v6e", 1, zone=ZONE, project=OWNER, shared_with=(LOCAL_PROJECT,))
    reservation = f"projects/{OWNER}/reservations/team-v6e"
    run = run_pipeline(
        {"network": "team-vpc", "subnetwork": "team-tpu", "network_project": HOST, "reservation": reservation,
         "ssh_via_iap": True}
    )
    assert run.state == "success", run.report()
    assert local_cloud.vms() == []
    requests = local_cloud.requests()
    [insert] = [
        r for r in requests
        if r["method"] == "POST" and r["path"].split("?")[0].endswith(f"/projects/{LOCAL_PROJECT}/zones/{ZONE}/instances")
    ]
    [nic] = insert["body"]["networkInterfaces"]
    assert nic["network"].endswith(f"projects/{HOST}/global/networks/team-vpc"), nic
    assert nic["subnetwork"].endswith(f"projects/{HOST}/regions/us-east5/subnetworks/team-tpu"), nic
    assert insert["body"]["reservationAffinity"]["values"] == [reservation]
    assert "accessConfigs" not in nic  # no external address: IAP is the way in
    # Every SSH connection of the run, the workers' steps and the triggers' polls, went through
    # IAP as the connection's account; preflight asked IAM before the VM was made.
    tunnels = [e for e in local_cloud.iap_requests() if e.get("project") == LOCAL_PROJECT]
    assert len(tunnels) >= 5 and {(e["caller"], e["outcome"]) for e in tunnels} == {(LOCAL_SERVICE_ACCOUNT, "connected")}
    assert f"Preflight SSH through IAP: {LOCAL_SERVICE_ACCOUNT} may tunnel to project {LOCAL_PROJECT}'s VMs" in run.log
    # Preflight read the network and subnetwork in the host project, and the reservation in its
    # owner's, before anything was paid for; the capacity gate read the owner's too.
    assert f"Preflight network: network team-vpc in project {HOST}, subnetwork team-tpu (10.40.0.0/24)" in run.log
    assert f"Preflight reservation: reservation team-v6e in {OWNER}/{ZONE}: 1 of 1 ct6e-standard-8t free" in run.log
    reads = [r["path"].split("?")[0] for r in requests if r["method"] == "GET" and "/reservations/" in r["path"]]
    assert reads and all(p.endswith(f"/projects/{OWNER}/zones/{ZONE}/reservations/team-v6e") for p in reads), reads
