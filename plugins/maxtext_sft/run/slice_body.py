"""The Compute Engine requests that make a run's multi-host TPU slice: a workload policy, an
instance template and a managed instance group (MIG) of `hosts` VMs made from it, as the
documented gcloud commands send them (tests/fixtures/gcloud-slice-requests.json), with the
pipeline's differences commented. `SliceBodies` is one part of spec.RunSpec; no Airflow imports.

    gcloud compute resource-policies create workload-policy POLICY --type=HIGH_THROUGHPUT
        --accelerator-topology=4x4 --region=REGION
    gcloud compute instance-templates create TEMPLATE --machine-type=ct6e-standard-4t ...
        --reservation-affinity=specific --reservation=RES --provisioning-model=RESERVATION_BOUND
        --instance-termination-action=DELETE --maintenance-policy=TERMINATE
    gcloud compute instance-groups managed create GROUP --zone=ZONE --template=TEMPLATE
        --size=HOSTS --workload-policy=projects/P/regions/REGION/resourcePolicies/POLICY
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Sequence
from typing import Any

from maxtext_sft.run.catalog import TPU_SLICES
from maxtext_sft.run.names import vm_name_for

GCE_NAME_MAX = 63
SLICE_GROUP_KEY = "airflow-slice-group"  # instance metadata: the group a slice's host belongs to


class SliceBodies:
    """A slice run's resource names and the bodies that create them."""

    @property
    def is_slice(self) -> bool:
        """A run on a multi-host slice (fine_tune_dag(tpu_slice=True)), not on one VM."""
        return bool(self.params.get("tpu_slice"))

    @property
    def hosts(self) -> int:
        """How many VMs the run trains on: the slice's hosts, or the one VM."""
        return int(TPU_SLICES[self.tpu_slice]["hosts"]) if self.is_slice else 1

    @property
    def region(self) -> str:
        return self.zone.rsplit("-", 1)[0]

    # The group takes the run's VM name (its hosts are named GROUP-xxxx by the MIG); the template
    # and the policy are named after it, so one name finds all three (teardown, janitor).
    @property
    def group_name(self) -> str:
        # The run's VM name, also in a host's spec (on_hosts), whose vm_name is the host's.
        return vm_name_for(self.vm_name_prefix, self.dag_id, self.run_id, self.generation)

    @property
    def template_name(self) -> str:
        return f"{self.group_name}-tmpl"

    @property
    def policy_name(self) -> str:
        return f"{self.group_name}-policy"

    def on_hosts(self, hosts: Sequence[dict]) -> list:
        """One spec per host of the slice ([{"name", "ip", "id"}] in worker order, as create_slice
        found them): the host's VM name and instance id, its worker id and every host's address."""
        addresses = tuple(host["ip"] for host in hosts)
        return [
            dataclasses.replace(
                self, vm_name=host["name"], host_index=index, worker_hostnames=addresses, host_id=str(host.get("id", ""))
            )
            for index, host in enumerate(hosts)
        ]

    def workload_policy_body(self) -> dict[str, Any]:
        """resourcePolicies.insert (REST JSON, as gcloud sends it): all hosts in one ICI slice."""
        return {
            "name": self.policy_name,
            "region": self.region,
            "workloadPolicy": {"type": "HIGH_THROUGHPUT", "acceleratorTopology": self.tpu["topology"]},
        }

    def instance_template_body(self) -> dict[str, Any]:
        """instanceTemplates.insert (google-cloud-compute field names): each host's VM is the single
        VM's insert body (run/compute_body.py: reservation, RESERVATION_BOUND, DELETE, SSH key, labels,
        metadata) but for the differences commented here."""
        properties = copy.deepcopy(self.instance_body())
        del properties["name"]  # the MIG names each host GROUP-xxxx
        del properties["deletion_protection"]  # not an instance property a template can set
        # A template names its machine type and image without a zone (gcloud sends them so; a
        # template is global). The family resolves to its newest image when each host is made.
        properties["machine_type"] = self.tpu["machine_type"]
        properties["disks"][0]["initialize_params"]["source_image"] = (
            f"projects/{self.image_project}/global/images/family/{self.image_family}"
        )
        # No cloud-enforced lifetime: a MIG re-creates a host that max_run_duration deleted, so it
        # would bound nothing. The group's bounds are the teardown, the hosts' autostop (which the
        # group leaves stopped, see group_body), the expiry label and the janitor.
        properties["scheduling"].pop("max_run_duration", None)
        # Each host names its group: the janitor deletes the group (a host deleted alone, the
        # group would re-create), its template and its policy.
        properties["metadata"]["items"].append({"key": SLICE_GROUP_KEY, "value": self.group_name})
        return {"name": self.template_name, "properties": properties}

    def group_body(self) -> dict[str, Any]:
        """instanceGroupManagers.insert (google-cloud-compute field names), as gcloud's create with
        --template, --size and --workload-policy, plus what the pipeline adds (commented)."""
        project = self.project_id
        return {
            "name": self.group_name,
            "zone": self.zone,
            "instance_template": f"projects/{project}/global/instanceTemplates/{self.template_name}",
            # gcloud leaves it to the API, which takes the group's name; the provider's operator
            # requires it, so it is sent: the same value.
            "base_instance_name": self.group_name,
            "target_size": self.hosts,
            "resource_policies": {
                "workload_policy": f"projects/{project}/regions/{self.region}/resourcePolicies/{self.policy_name}"
            },
            # Added: a host that fails or stops (its autostop after Airflow is gone) stays down
            # instead of being re-created and paid for; the run fails on a lost host either way.
            "instance_lifecycle_policy": {"default_action_on_failure": "DO_NOTHING"},
        }

    def check_slice_names(self) -> str | None:
        """Why the slice's names cannot be made (too long for Compute Engine), or None."""
        for name in (self.template_name, self.policy_name):
            if len(name) > GCE_NAME_MAX:
                return f"{name!r} is longer than {GCE_NAME_MAX} characters: choose a shorter VM name prefix"
        return None
