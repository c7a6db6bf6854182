"""Airflow connections that point the pipeline at the local cloud.

These are the only things that differ from a Google Cloud deployment: the Compute, Storage,
OS Login and Resource Manager API endpoints and IAP's relay (the connection extras
`compute_api_endpoint`, `storage_api_endpoint`, `oslogin_api_endpoint`,
`resourcemanager_api_endpoint`, `iap_tunnel_endpoint`), a service-account key whose `token_uri`
is the local cloud's token endpoint, the trust of the IAP relay's certificate (`SSL_CERT_FILE`,
as for a company's TLS-inspecting proxy), the VM login key, a local Hugging Face token and the
local Hub's endpoint (extra `endpoint`). They are given as AIRFLOW_CONN_* environment variables,
the way a deployment gives them.
"""

from __future__ import annotations

import json
import secrets
from pathlib import Path

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

LOCAL_PROJECT = "local-project"
LOCAL_ZONE = "us-east5-b"  # the pipeline's default zone (the tutorial's)
VM_USER = "maxtext"
# The Google connection's account (a service account, as a deployment's usually is).
LOCAL_SERVICE_ACCOUNT = "maxtext-sft@local-project.iam.gserviceaccount.com"
LOCAL_BUCKET = "local-models"
LOCAL_HUB_USER = "local-team"  # owner of the test token on the local Hub, and of the repos runs publish

# Run conf for the local cloud: only values that have no tutorial default, plus fast polling.
LOCAL_RUN_CONF = {
    "project_id": LOCAL_PROJECT,
    "reservation": "local-reservation",
    # Under a real scheduler, a reschedule-mode sensor poked every 1-2 s can be failed by the
    # scheduler (an executor event for the previous poke arrives after the next was queued).
    "poke_interval_seconds": 10,
    "ssh_connect_timeout_seconds": 10,
}


# Outputs in the local cloud's bucket, published to its Hub (what `make run` passes on top).
LOCAL_OUTPUTS_CONF = {
    "output_location": f"gs://{LOCAL_BUCKET}/maxtext-sft",
    "hub_repo_id": f"{LOCAL_HUB_USER}/gemma3-4b-sft",
}


# The slice DAG's run in the local cloud (`make run DAG=maxtext_sft_slice`), over LOCAL_RUN_CONF: a
# v6e-16 (4 hosts of ct6e-standard-4t) in a reservation of its own (run_pipeline adds it), its
# checkpoints in the local bucket (a slice needs an output location), published to the local Hub.
LOCAL_SLICE_HOSTS = 4
LOCAL_SLICE_MACHINE_TYPE = "ct6e-standard-4t"
LOCAL_SLICE_CONF = {
    "reservation": "local-slice-reservation",
    "tpu_slice": "v6e-16",
    "machine_type": LOCAL_SLICE_MACHINE_TYPE,  # the slice DAG's default too: what the reservation holds
    "output_location": f"gs://{LOCAL_BUCKET}/maxtext-sft-slice",
    "hub_repo_id": f"{LOCAL_HUB_USER}/gemma3-4b-sft-slice",
    "steps": 12,
}


# What the tutorial's run reads from the Hub, as the local Hub holds it (the preflight checks them;
# the MaxText stand-in and the real image's toy do not download them).
LOCAL_HUB_MODEL = "google/gemma-3-4b-it"  # gated, like the real one
LOCAL_HUB_DATASET = "HuggingFaceH4/ultrachat_200k"
# The base model's config.json, in the shape the Hub's google/gemma-3-4b-it has (written by a
# transformers 4.x: rope_scaling, fields at Gemma3TextConfig's defaults left out). The values are
# transformers' Gemma3Config defaults and MaxText 0.2.2's hf_model_configs.py gemma3_4b_config;
# collect_outputs compares the export's config with it.
LOCAL_HUB_MODEL_CONFIG = {
    "architectures": ["Gemma3ForConditionalGeneration"],
    "boi_token_index": 255999,
    "eoi_token_index": 256000,
    "eos_token_id": [1, 106],
    "image_token_index": 262144,
    "initializer_range": 0.02,
    "mm_tokens_per_image": 256,
    "model_type": "gemma3",
    "text_config": {
        "hidden_size": 2560,
        "intermediate_size": 10240,
        "model_type": "gemma3_text",
        "num_hidden_layers": 34,
        "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
        "sliding_window": 1024,
        # No vocab_size: Gemma3TextConfig's default, 262208 (the text tokens and the image tokens
        # from image_token_index on), what the published 4B configs show; MaxText trains and
        # exports 262144 (export_config.KNOWN_DIFFERENT). Not read from the Hub's file here.
    },
    "torch_dtype": "bfloat16",
    "transformers_version": "4.50.0.dev0",
    "vision_config": {
        "hidden_size": 1152,
        "image_size": 896,
        "intermediate_size": 4304,
        "model_type": "siglip_vision_model",
        "num_attention_heads": 16,
        "num_hidden_layers": 27,
        "patch_size": 14,
        "vision_use_head": False,
    },
}
# VMs the local reservation holds: room for the runs and VMs a test session has at once.
LOCAL_RESERVATION_COUNT = 8


# The custom role the docs publish for the Airflow service account (gcloud iam roles create --file).
AIRFLOW_ROLE_FILE = Path(__file__).resolve().parent.parent / "include" / "iam" / "airflow-role.yaml"


def airflow_role_permissions() -> list[str]:
    import yaml

    return list(yaml.safe_load(AIRFLOW_ROLE_FILE.read_text())["includedPermissions"])


def prepare_local_cloud(cloud, hf_token: str) -> None:
    """What a team has before its first run: the reservation the run conf names, the output bucket,
    a Hub account whose write token the Hugging Face connection holds, with the gated base model's
    licence accepted, and the Google connection's account holding exactly the published role."""
    from localcloud.cloud import VM_ACCESS_TOKEN, VM_SERVICE_ACCOUNT_EMAIL
    from localcloud.storage.iam import STORAGE_OBJECT_USER

    cloud.bind_role(f"serviceAccount:{LOCAL_SERVICE_ACCOUNT}", airflow_role_permissions())
    # The VMs' service account holds Storage Object User (docs/google-cloud.md): their gcloud calls
    # are checked against it.
    cloud.bind_role(f"serviceAccount:{VM_SERVICE_ACCOUNT_EMAIL}", list(STORAGE_OBJECT_USER), token=VM_ACCESS_TOKEN)
    cloud.add_reservation(LOCAL_RUN_CONF["reservation"], LOCAL_RESERVATION_COUNT, zone=LOCAL_ZONE, project=LOCAL_PROJECT)
    cloud.create_bucket(LOCAL_BUCKET, exist_ok=True)
    cloud.hub.add_user(LOCAL_HUB_USER, hf_token, role="write")
    cloud.hub.seed_repo(LOCAL_HUB_MODEL, {"config.json": json.dumps(LOCAL_HUB_MODEL_CONFIG, indent=2)}, gated=True)
    cloud.hub.grant(LOCAL_HUB_USER, LOCAL_HUB_MODEL)
    cloud.hub.seed_repo(
        LOCAL_HUB_DATASET,
        {"data/train_sft-00000-of-00001.parquet": b"stand-in", "data/test_sft-00000-of-00001.parquet": b"stand-in"},
        repo_type="dataset",
    )


def generate_ssh_private_key() -> str:
    """A fresh Ed25519 key in OpenSSH format (what the SSH connection's private_key extra holds)."""
    key = Ed25519PrivateKey.generate()
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH, serialization.NoEncryption()
    ).decode()


def new_hf_token() -> str:
    return "hf_local_" + secrets.token_hex(16)


def airflow_connection_env(cloud, ssh_private_key: str, hf_token: str) -> dict[str, str]:
    """Environment for Airflow's processes: the three connections, pointed at `cloud` (a LocalCloud)."""
    google = {
        "conn_type": "google_cloud_platform",
        "extra": {
            "project": LOCAL_PROJECT,
            # A service-account key of the local cloud (its token_uri the local token endpoint): the
            # credentials refresh as a deployment's key does, and have an identity IAP can check.
            "keyfile_dict": json.dumps(cloud.add_service_account(LOCAL_SERVICE_ACCOUNT)),
            "compute_api_endpoint": cloud.compute_endpoint,
            "storage_api_endpoint": cloud.storage_endpoint,
            "oslogin_api_endpoint": cloud.oslogin_endpoint,
            # SSH through IAP (Param ssh_via_iap; the account holds no tunnel role until a test grants it).
            "iap_tunnel_endpoint": cloud.iap_tunnel_endpoint,
            "resourcemanager_api_endpoint": cloud.resourcemanager_endpoint,
        },
    }
    vm_ssh = {
        "conn_type": "ssh",
        "login": VM_USER,
        # No host-key settings: each step verifies the key the VM publishes in its guest attributes.
        "extra": {"private_key": ssh_private_key},
    }
    hugging_face = {"conn_type": "generic", "password": hf_token, "extra": {"endpoint": cloud.hub.endpoint}}
    return {
        "AIRFLOW_CONN_GOOGLE_CLOUD_DEFAULT": json.dumps(google),
        "AIRFLOW_CONN_MAXTEXT_SFT_VM_SSH": json.dumps(vm_ssh),
        "AIRFLOW_CONN_HUGGINGFACE_DEFAULT": json.dumps(hugging_face),
        # The local Hub stores LFS files but has no Xet storage: huggingface_hub then uploads the
        # classic way (a documented huggingface_hub setting; read when it is imported).
        "HF_HUB_DISABLE_XET": "1",
        # The IAP relay's certificate is its own CA (localcloud/iap/relay.py): trusted by OpenSSL's
        # default verify paths, which Python's default TLS context (the tunnel's) reads.
        "SSL_CERT_FILE": cloud.iap_tunnel_ca_file,
    }

# The bare image (no MaxText: install_maxtext.sh installs the stand-in for real, offline) under a
# family of its own: a run or a bake names it to start from an image without MaxText. A bake makes
# BAKED_IMAGE_FAMILY in the run's project (maxtext_sft_bake_image's default family).
BARE_IMAGE_PROJECT = "local-images"
BARE_IMAGE_FAMILY = "ubuntu-2204-without-maxtext"
BARE_IMAGE_KEY = f"{BARE_IMAGE_PROJECT}/{BARE_IMAGE_FAMILY}"
BARE_IMAGE_CONF = {"image_project": BARE_IMAGE_PROJECT, "image_family": BARE_IMAGE_FAMILY}
BAKED_IMAGE_CONF = {"image_project": LOCAL_PROJECT, "image_family": "maxtext-sft"}

# The real MaxText image plays a custom boot image with MaxText preinstalled: runs select it with
# the image Params, as a team would select its own image on Google Cloud.
REAL_IMAGE_PROJECT = "local-images"
REAL_IMAGE_FAMILY = "maxtext-0-2-2-toy"
REAL_IMAGE_KEY = f"{REAL_IMAGE_PROJECT}/{REAL_IMAGE_FAMILY}"


def real_maxtext_run_conf(
    image_dir: Path, *, steps: int = 5, dataset: str = "ultrachat_200k", outputs: bool = False
) -> dict:
    """Run conf for the real MaxText at toy size: only Param values differ from a cloud run.

    With `outputs`, MaxText writes its run folder to the local bucket and the run publishes to the
    local Hub (LOCAL_OUTPUTS_CONF), without the profiler: jaxlib writes traces to gs:// with its own
    C++ Cloud Storage client, which only talks to storage.googleapis.com, so it cannot reach the
    local emulator (on Google Cloud the traces land in the bucket).
    """
    toy = json.loads((image_dir / "toy" / "toy.json").read_text())
    train_extra_args = toy["extra_args"]["train"] + (["profiler=''"] if outputs else [])
    return {
        **(LOCAL_OUTPUTS_CONF if outputs else {}),
        **LOCAL_RUN_CONF,
        "image_project": REAL_IMAGE_PROJECT,
        "image_family": REAL_IMAGE_FAMILY,
        "steps": steps,
        # Three batches per evaluation, not the Param's 25: on CPU each batch is a forward pass of
        # ~1.3 s and the toy's test split packs into a handful of sequences (measured: the two
        # evaluations at 25 took 65 s of a 236 s training); three still exercise the eval loop.
        "eval_steps": 3,
        "dataset_name": str(image_dir / "toy" / toy["datasets"][dataset]),
        "convert_extra_args": toy["extra_args"]["convert"],
        "train_extra_args": train_extra_args,
        "export_extra_args": toy["extra_args"]["export"],
    }
# The rehearsal's default boot image (the Params rehearsal_image_project/family): the public
# Ubuntu family, which the local cloud serves with one of its images.
REHEARSAL_IMAGE_KEY = "ubuntu-os-cloud/ubuntu-2204-lts"
# The rehearsal's run conf in the local cloud, over LOCAL_RUN_CONF: outputs to the local bucket
# and Hub, and no profiler (jaxlib writes its traces to gs:// with its own C++ client, which only
# talks to storage.googleapis.com: see real_maxtext_run_conf). The kit brings the toy inputs.
LOCAL_REHEARSAL_CONF = {**LOCAL_OUTPUTS_CONF, "steps": 3, "train_extra_args": ["profiler=''"]}
