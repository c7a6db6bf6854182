"""The Compute Engine insert body of a run's VM: the tutorial's gcloud request, with the
differences commented. `ComputeInstanceBody` is one part of spec.RunSpec; no Airflow imports."""

from __future__ import annotations

from typing import Any

# The insert-body fields in which a rehearsal's VM differs from the real run's (paths in the body).
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
                    "network": f"projects/{project}/global/networks/{self.network}",
                }
            ],
            "reservation_affinity": {
                "consume_reservation_type": "SPECIFIC_RESERVATION",
                "key": "compute.googleapis.com/reservation-name",
                "values": [self.reservation],
            },
            "scheduling": {
                "automatic_restart": True,
                "instance_termination_action": "DELETE",
                "on_host_maintenance": "TERMINATE",
                "provisioning_model": "RESERVATION_BOUND",
                # A hard lifetime: Compute Engine deletes the VM even if Airflow is gone.
                **(
                    {"max_run_duration": {"seconds": self.max_run_duration_minutes * 60}}
                    if self.cloud_enforced_lifetime
                    else {}
                ),
            },
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
        return self._as_rehearsal(body) if self.rehearsal else body

    def _as_rehearsal(self, body: dict[str, Any]) -> dict[str, Any]:
        """The rehearsal's VM: the same request but for what makes it a cheap CPU VM (REHEARSAL_FIELDS);
        the disk, network, labels, metadata, service account and lifetime stay the real run's."""
        project, zone = self.project_id, self.zone
        body["machine_type"] = f"projects/{project}/zones/{zone}/machineTypes/{self.rehearsal_machine_type}"
        body["disks"][0]["initialize_params"]["source_image"] = (
            f"projects/{self.rehearsal_image_project}/zones/-/imageFamilyViews/{self.rehearsal_image_family}"
        )
        # Consumes no reservation (not even an automatically consumed one); on demand.
        body["reservation_affinity"] = {"consume_reservation_type": "NO_RESERVATION"}
        body["scheduling"]["provisioning_model"] = "STANDARD"
        return body
