"""The Compute Engine insert body of a run's VM: the tutorial's gcloud request, with the
differences commented. `ComputeInstanceBody` is one part of spec.RunSpec; no Airflow imports."""

from __future__ import annotations

from typing import Any

# The insert-body fields in which a rehearsal's VM differs from the real run's on a reservation
# (paths in the body). The rehearsal's VM is on demand: of a Spot or flex-start run it also differs
# in the rest of `scheduling` (and flex-start's `params`); without a cloud-enforced lifetime, in
# the termination action (STANDARD takes none without a time limit).
REHEARSAL_FIELDS = (
    "machine_type",
    "disks[0].initialize_params.source_image",
    "reservation_affinity",
    "scheduling.provisioning_model",
)


class ComputeInstanceBody:
    """The VM's insert request."""

    @property
    def external_address(self) -> bool:
        """Whether the VM gets an external IP: only when the workers SSH to it over one."""
        return not (self.use_internal_ip or self.ssh_via_iap)

    @property
    def network_host(self) -> str:
        """The project that owns the VM's network: a Shared VPC's host project, or the run's."""
        return self.network_project or self.project_id

    @property
    def subnetwork_path(self) -> str | None:
        """The subnetwork's partial URL, in the zone's region; None when the run names none."""
        if not self.subnetwork:
            return None
        return f"projects/{self.network_host}/regions/{self.region}/subnetworks/{self.subnetwork}"

    def instance_body(self) -> dict[str, Any]:
        """The insert request body: the tutorial's gcloud request, with the differences commented.

        Field names are google-cloud-compute's (snake_case); on the wire they become the REST API's
        camelCase. URLs are partial: the client library resolves them against its endpoint.
        """
        project, zone = self.project_id, self.zone
        body = {
            "name": self.vm_name,  # per DAG run, instead of the tutorial's fixed NAME
            "machine_type": f"projects/{project}/zones/{zone}/machineTypes/{self.machine_type}",
            "can_ip_forward": False,
            "deletion_protection": False,
            "disks": [
                {
                    "auto_delete": True,
                    "boot": True,
                    "initialize_params": {
                        "disk_size_gb": self.boot_disk_size_gb,
                        "source_image": (
                            f"projects/{self.image_project}/zones/-/imageFamilyViews/{self.image_family}"
                        ),
                    },
                    "mode": "READ_WRITE",
                    "type_": "PERSISTENT",
                }
            ],
            # The tutorial's external address, unless the workers reach the VM inside the VPC or
            # through IAP: then none (what `gcloud ... --no-address` sends), so a project under the
            # compute.vmExternalIpAccess policy can run it (the VM's egress then needs Cloud NAT).
            "network_interfaces": [
                {
                    **(
                        {"access_configs": [{"name": "external-nat", "type_": "ONE_TO_ONE_NAT"}]}
                        if self.external_address
                        else {}
                    ),
                    "network": f"projects/{self.network_host}/global/networks/{self.network}",
                    # A custom-mode network needs one (the API refuses the insert without); gcloud's
                    # --subnet sends it so, in the host project of a Shared VPC.
                    **({"subnetwork": self.subnetwork_path} if self.subnetwork else {}),
                }
            ],
            "reservation_affinity": self._reservation_affinity(),
            "scheduling": self._scheduling(),
            # A stable tag a firewall rule can target, instead of the per-run VM name.
            "tags": {"items": [self.network_tag]},
            # Identify the package, DAG and run, so a janitor can find VMs whose run is gone.
            "labels": self.labels,
            # The pipeline's SSH key (the guest agent creates the user), guest attributes on (the
            # guest agent publishes the sshd host keys there, which every SSH step verifies), and
            # the full run identity that label values cannot hold; gcloud sent an empty metadata object.
            "metadata": {
                "items": [
                    # With OS Login the guest ignores ssh-keys: the key is imported into the profile.
                    {"key": "enable-oslogin", "value": "TRUE"}
                    if self.os_login
                    else {"key": "ssh-keys", "value": f"{self.ssh_user}:{self.ssh_public_key} {self.ssh_user}"},
                    {"key": "enable-guest-attributes", "value": "TRUE"},
                    {"key": "airflow-dag-id", "value": self.dag_id},
                    {"key": "airflow-run-id", "value": self.run_id},
                ]
            },
            # gcloud attaches the project's default service account; the capture endpoint had none.
            # cloud-platform scope so the VM can write its outputs to storage (IAM still decides).
            "service_accounts": [
                {"email": self.service_account, "scopes": ["https://www.googleapis.com/auth/cloud-platform"]}
            ],
        }
        if self.capacity == "flex-start" and not self.rehearsal:
            # How long the request waits in the queue for a machine (InstanceParams in the v1
            # discovery document); the insert's operation waits with it.
            body["params"] = {"request_valid_for_duration": {"seconds": self.flex_start_valid_minutes * 60}}
        return self._as_rehearsal(body) if self.rehearsal else body

    def _reservation_affinity(self) -> dict[str, Any]:
        """The tutorial's named reservation; for the other capacity types none, not even one that is
        consumed automatically (Spot and flex-start VMs cannot consume one: Compute Engine's "Consume
        reserved instances" and "About flex-start VMs" pages; an on-demand run takes no one else's)."""
        if self.capacity != "reservation" or self.rehearsal:
            return {"consume_reservation_type": "NO_RESERVATION"}
        return {
            "consume_reservation_type": "SPECIFIC_RESERVATION",
            "key": "compute.googleapis.com/reservation-name",
            "values": [self.reservation],
        }

    def _scheduling(self) -> dict[str, Any]:
        """The VM's scheduling for its capacity type. TPU VMs cannot live-migrate, so every kind
        terminates on host maintenance. A hard lifetime (maxRunDuration, with the DELETE action)
        lets Compute Engine delete the VM even if Airflow is gone; flex-start requires one."""
        capacity = "on-demand" if self.rehearsal else self.capacity
        lifetime = {
            "instance_termination_action": "DELETE",
            "max_run_duration": {"seconds": self.max_run_duration_minutes * 60},
        }
        enforced = lifetime if self.cloud_enforced_lifetime else {}
        if capacity == "reservation":
            # The tutorial's gcloud flags; the termination action is allowed without a lifetime
            # on a reservation-bound VM.
            return {
                "automatic_restart": True,
                "instance_termination_action": "DELETE",
                "on_host_maintenance": "TERMINATE",
                "provisioning_model": "RESERVATION_BOUND",
                **enforced,
            }
        if capacity == "flex-start":
            # "About flex-start VMs": a run duration is required, the VM is deleted at its end.
            # No automatic restart (gcloud 528 sends its default, true): a VM that failed is
            # TERMINATED, and the training sensor replaces it, instead of a restarted VM with no training.
            return {"automatic_restart": False, "on_host_maintenance": "TERMINATE", "provisioning_model": "FLEX_START",
                    **lifetime}
        if capacity == "spot":
            # cloud.google.com/tpu/docs/spot-compute: --provisioning-model=SPOT, a termination
            # action (DELETE: a preempted VM is replaced, never restarted), --maintenance-policy=TERMINATE;
            # preemptible and no restart as gcloud 528 sends them (tests/fixtures/gcloud-capacity-requests.json).
            return {"automatic_restart": False, "instance_termination_action": "DELETE",
                    "on_host_maintenance": "TERMINATE", "preemptible": True, "provisioning_model": "SPOT", **enforced}
        # On demand: a termination action only with a time limit (the API refuses it alone on STANDARD).
        return {"automatic_restart": True, "on_host_maintenance": "TERMINATE", "provisioning_model": "STANDARD",
                **enforced}

    def _as_rehearsal(self, body: dict[str, Any]) -> dict[str, Any]:
        """The rehearsal's VM: the same request but for what makes it a cheap CPU VM on demand
        (REHEARSAL_FIELDS: its reservation affinity and scheduling are made so by the methods
        above); the disk, network, labels, metadata, service account and lifetime stay the real run's."""
        project, zone = self.project_id, self.zone
        body["machine_type"] = f"projects/{project}/zones/{zone}/machineTypes/{self.rehearsal_machine_type}"
        body["disks"][0]["initialize_params"]["source_image"] = (
            f"projects/{self.rehearsal_image_project}/zones/-/imageFamilyViews/{self.rehearsal_image_family}"
        )
        return body
