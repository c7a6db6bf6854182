"""RunSpec: validation, naming and command building, without Airflow or a cloud."""

from __future__ import annotations

import re
from datetime import datetime, timezone

import pytest

from maxtext_sft.run.maxtext_args import OWNED_KEYS
from maxtext_sft.run.params import GCE_NAME, SpecError, defaults
from maxtext_sft.run.spec import RunSpec, build_run_spec

TUTORIAL_DEFAULTS = defaults()

STARTED = datetime(2026, 11, 29, 22, 29, 25, tzinfo=timezone.utc)
RUN_ID = "manual__2026-11-29T22:29:25.123+00:00"


def make_spec(generation: int = 0, run_id: str = RUN_ID, ssh_user: str = "maxtext", **params) -> RunSpec:
    return build_run_spec(
        {"reservation": "my-reservation", **params},
        dag_id="maxtext_sft",
        run_id=run_id,
        generation=generation,
        started=STARTED,
        default_project_id="my-project",
        ssh_user=ssh_user,
        ssh_public_key="ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIExample",
    )


def test_names_are_valid_stable_and_change_with_the_generation():
    spec = make_spec()
    assert GCE_NAME.match(spec.vm_name) and len(spec.vm_name) <= 63
    assert make_spec().vm_name == spec.vm_name  # a retry derives the same name
    assert make_spec().run_name == spec.run_name
    assert make_spec(generation=1).run_name != spec.run_name  # a cleared run trains again
    assert make_spec(generation=1).vm_name != spec.vm_name
    assert make_spec(run_id="manual__other").vm_name != spec.vm_name
    assert spec.run_name.startswith("2026-11-29-22-29-25-")


def test_labels_are_valid_gce_labels_and_identify_the_run():
    labels = make_spec().labels
    assert labels["managed-by"] == "airflow-maxtext-sft"
    assert labels["airflow-dag"] == "maxtext_sft"
    for key, value in labels.items():
        assert re.fullmatch(r"[a-z][a-z0-9_-]{0,62}", key)
        assert re.fullmatch(r"[a-z0-9_-]{0,63}", value)
    assert make_spec(run_id="scheduled__x").labels["airflow-run"] != labels["airflow-run"]


def test_round_trips_through_xcom_json():
    spec = make_spec(train_extra_args=["attention=dot_product"])
    assert RunSpec.from_dict(spec.to_dict()) == spec


def test_train_command_matches_the_tutorial():
    spec = make_spec()
    assert spec.train_args() == [
        f"run_name={spec.run_name}",
        "base_output_directory=/dev/shm/gemma3-4b/post-train/",
        "model_name=gemma3-4b",
        "load_parameters_path=/dev/shm/gemma3-4b/mt-format/0/items",
        "per_device_batch_size=1",
        "steps=1000",
        "checkpoint_period=10000",  # not in the tutorial: MaxText's default, stated since it is a Param
        "hf_path=HuggingFaceH4/ultrachat_200k",
        "train_split=train_sft",
        "train_data_columns=['messages']",
        # Not in the tutorial: the held-out evaluation, before the first step and after the last.
        "eval_interval=1000",
        "eval_steps=25",
        "hf_eval_split=test_sft",
        "eval_data_columns=['messages']",
        "profiler=xplane",
    ]
    assert "eval_interval=-1" in make_spec(eval_split=None).train_args()
    assert spec.final_checkpoint_path == f"/dev/shm/gemma3-4b/post-train/{spec.run_name}/checkpoints/1000/model_params"
    assert "checkpoint_storage_use_zarr3=1" in spec.convert_args()
    assert "checkpoint_storage_use_zarr3=0" in make_spec(use_pathways=True).convert_args()
    assert not any("hf_access_token" in a for a in spec.convert_args() + spec.train_args() + spec.export_args())


@pytest.mark.parametrize(
    ("conf", "eval_files"),
    [
        # A pinned snapshot: the held-out split's files at the same commit, as the training's.
        ({"dataset_revision": "0123abc"},
         ["hf_eval_files=hf://datasets/HuggingFaceH4/ultrachat_200k@0123abc/data/test_sft-*.parquet",
          "hf_eval_split=train"]),
        # A bucket folder: its files of the split, read by the parquet builder.
        ({"dataset_name": "gs://team/chats"}, ["hf_eval_files=gs://team/chats/data/test_sft-*.parquet",
                                               "hf_eval_split=train"]),
        ({"dataset_name": "/data/chats", "eval_split": "validation"}, ["hf_eval_split=validation"]),
    ],
)
def test_the_eval_split_is_read_like_the_training_split(conf, eval_files):
    args = make_spec(**conf).train_args()
    assert [a for a in args if a.startswith(("hf_eval_files=", "hf_eval_split="))] == eval_files


def test_evaluation_and_the_metrics_file_are_the_pipelines_to_set():
    for key in ("eval_interval", "hf_eval_split", "metrics_file"):
        with pytest.raises(SpecError, match=f"'{key}' is set by the pipeline"):
            make_spec(train_extra_args=[f"{key}=x"])


def test_a_resumed_training_does_not_profile():
    """Tunix refuses a profiling window the remaining steps cannot hold; the last word wins."""
    spec = make_spec(checkpoint_period=50, train_extra_args=["profiler=xplane"])
    assert "checkpoint_period=50" in spec.train_args()
    assert spec.train_args()[-1] == "profiler=xplane"
    assert spec.train_args(resuming=True)[-1] == "profiler=''"


@pytest.mark.parametrize(
    ("conf", "period"),
    [
        ({}, 10_000),  # checkpoints on the VM die with it: MaxText's default, step 1 and the last
        ({"output_location": "gs://team/sft"}, 100),  # a tenth of the tutorial's 1000 steps
        ({"output_location": "gs://team/sft", "steps": 12}, 2),  # rounded up
        ({"output_location": "gs://team/sft", "steps": 5}, 1),
        ({"output_location": "gs://team/sft", "steps": 100_000}, 1000),  # at least every 1000 steps
        ({"output_location": "gs://team/sft", "checkpoint_period": 7}, 7),  # the user's wins
    ],
)
def test_checkpoints_come_every_tenth_of_the_steps_when_storage_keeps_them(conf, period):
    spec = make_spec(**conf)
    assert spec.checkpoint_period == period
    assert f"checkpoint_period={period}" in spec.train_args()
    assert RunSpec.from_dict(spec.to_dict()).checkpoint_period == period  # resolved once, in plan_run


@pytest.mark.parametrize("value", [0, -1, 1.5, "2"])
def test_checkpoints_kept_is_a_positive_count_or_empty(value):
    assert make_spec().checkpoints_kept == 2 and make_spec(checkpoints_kept=None).checkpoints_kept is None
    with pytest.raises(SpecError, match="checkpoints_kept"):
        make_spec(checkpoints_kept=value)


@pytest.mark.parametrize("name, value", [("checkpoint_period", 0), ("max_vm_recoveries", 11), ("max_vm_recoveries", -1)])
def test_recovery_params_are_bounded(name, value):
    with pytest.raises(SpecError, match=name):
        make_spec(**{name: value})


@pytest.mark.parametrize("value", [-1, 7 * 24 * 60 + 1, 1.5, True, "60"])
def test_the_capacity_wait_is_whole_minutes_up_to_a_week(value):
    with pytest.raises(SpecError, match="max_capacity_wait_minutes"):
        make_spec(max_capacity_wait_minutes=value)


def test_the_capacity_wait_defaults_to_twelve_hours_and_may_be_zero():
    assert make_spec().max_capacity_wait_minutes == 720
    assert make_spec(max_capacity_wait_minutes=0).max_capacity_wait_minutes == 0  # full: fail at once


@pytest.mark.parametrize("step", sorted(OWNED_KEYS))
def test_extra_args_cannot_override_what_the_pipeline_owns(step):
    for key in sorted(OWNED_KEYS[step]):
        for arg in (f"{key}=x", f"--{key}=x"):
            with pytest.raises(SpecError, match=f"{step}_extra_args.*{key}"):
                make_spec(**{f"{step}_extra_args": [arg]})


@pytest.mark.parametrize("bad", ["no_equals", "=x", "1abc=2", "a b=c", 5])
def test_extra_args_must_be_key_value(bad):
    with pytest.raises(SpecError, match="train_extra_args"):
        make_spec(train_extra_args=[bad])


def test_extra_args_keep_values_as_data():
    spec = make_spec(train_extra_args=["learning_rate=1e-5", "--flag=a b; $(x)"])
    assert spec.train_args()[-2:] == ["learning_rate=1e-5", "--flag=a b; $(x)"]


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("zone", "us east"),
        ("reservation", "Bad_Reservation"),
        ("reservation", "projects/owner-project/reservations/"),
        ("reservation", "projects/owner-project/reservations/r;id"),
        ("reservation", "owner-project/reservations/r"),
        ("subnetwork", "Team_Subnet"),
        ("network_project", "-host"),
        ("machine_type", "n2-standard-8"),
        ("steps", 0),
        ("steps", "1000"),
        ("per_device_batch_size", True),
        ("dataset_name", "not a hub id"),
        ("work_dir", "relative/dir"),
        ("work_dir", "~/$(reboot)"),
        ("train_data_columns", []),
        ("train_data_columns", ["mess'ages"]),
        ("dataset_revision", "main; rm -rf /"),
        ("maxtext_version", "latest"),
        ("vm_name_prefix", "UPPER"),
        ("use_pathways", "yes"),
        ("output_location", "s3://bucket/x"),
        ("output_location", "gs://bucket/a b"),
        ("output_location", "gs://bucket/$(id)"),
        ("model_revision", "main`id`"),
        ("hub_repo_id", "no-owner"),
        ("hub_branch", "-bad"),
        ("hub_private", "no"),
        ("hub_max_final_loss", "1.5"),
        ("hub_max_final_loss", float("nan")),
        ("vm_hourly_price_usd", -1),
        ("vm_hourly_price_usd", "20"),
        ("vm_hourly_price_usd", True),
        ("vm_hourly_price_usd", None),
        ("vm_hourly_price_usd", float("nan")),
        ("vm_hourly_price_usd", float("inf")),
    ],
)
def test_bad_values_are_rejected_naming_the_field(field, value):
    with pytest.raises(SpecError, match=f"'{field}'"):
        make_spec(**{field: value})


def test_the_vm_price_defaults_to_a_reserved_v6e_8_and_takes_any_non_negative_number():
    assert make_spec().vm_hourly_price_usd == 20.0
    assert make_spec(vm_hourly_price_usd=0).vm_hourly_price_usd == 0.0
    assert make_spec(vm_hourly_price_usd=11.5).vm_hourly_price_usd == 11.5


def test_a_dataset_revision_pins_revision_addressed_files():
    args = make_spec(dataset_revision="0123abc").train_args()
    assert "hf_train_files=hf://datasets/HuggingFaceH4/ultrachat_200k@0123abc/data/train_sft-*.parquet" in args
    assert "train_split=train" in args and "train_split=train_sft" not in args
    assert not any(a.startswith("hf_train_files=") for a in make_spec().train_args())


def test_a_dataset_is_a_hub_id_or_a_folder_on_the_vm():
    assert "hf_path=/data/ultrachat" in make_spec(dataset_name="/data/ultrachat").train_args()
    with pytest.raises(SpecError, match="'dataset_revision'"):
        make_spec(dataset_name="/data/ultrachat", dataset_revision="abc123")
    with pytest.raises(SpecError, match="'dataset_name'"):
        make_spec(dataset_name="relative/../x y")


def test_root_is_refused_as_vm_user():
    with pytest.raises(SpecError, match="non-root"):
        make_spec(ssh_user="root")


def test_defaults_are_the_tutorials():
    assert TUTORIAL_DEFAULTS["machine_type"] == "ct6e-standard-8t"
    assert TUTORIAL_DEFAULTS["steps"] == 1000
    spec = make_spec()
    assert spec.tpu == {
        "accelerator_type": "v6e-8", "topology": "2x4", "chips_per_host_bounds": "2,4,1", "host_bounds": "1,1,1"
    }
    body = spec.instance_body()
    assert body["scheduling"]["provisioning_model"] == "RESERVATION_BOUND"
    assert body["scheduling"]["instance_termination_action"] == "DELETE"


def test_with_an_output_location_maxtext_writes_its_run_folder_there():
    spec = make_spec(output_location="gs://team-bucket/sft/")
    assert spec.durable and spec.output_location == "gs://team-bucket/sft"
    assert "base_output_directory=gs://team-bucket/sft/runs/" in spec.train_args()
    assert spec.checkpoints_dir == f"gs://team-bucket/sft/runs/{spec.run_name}/checkpoints"
    assert spec.hf_export_uri == f"gs://team-bucket/sft/runs/{spec.run_name}/hf-export"
    assert spec.run_record_uri == f"gs://team-bucket/sft/runs/{spec.run_name}/run-record.json"
    assert "load_parameters_path=gs://cache/0/items" in spec.train_args("gs://cache/0/items")
    local = make_spec()
    assert not local.durable and local.hf_export_uri is None and local.base_checkpoint_cache is None
    assert local.checkpoints_dir.startswith("/dev/shm/gemma3-4b/post-train/")


def test_the_conversion_cache_key_names_model_revision_version_and_flags():
    base = make_spec(output_location="gs://bkt/p")
    again = make_spec(output_location="gs://bkt/p", run_id="scheduled__another")
    assert base.base_checkpoint_cache == again.base_checkpoint_cache  # another run, same conversion
    assert base.base_checkpoint_cache.startswith("gs://bkt/p/base-checkpoints/gemma3-4b/")
    for change in (
        {"model_revision": "abc123"},
        {"maxtext_version": "0.2.3"},
        {"convert_extra_args": ["--hf_model_path=/models/gemma"]},
        {"use_pathways": True},
    ):
        assert make_spec(output_location="gs://bkt/p", **change).base_checkpoint_cache != base.base_checkpoint_cache
    assert "--revision=abc123" in make_spec(model_revision="abc123").convert_args()


def test_the_model_card_names_the_checkpoint_maxtext_converts_from():
    spec = make_spec(hub_repo_id="team/gemma-sft")
    assert (spec.base_model_id, spec.base_model_license) == ("google/gemma-3-4b-it", "gemma")
    # MaxText converts gemma2 from the pretrained checkpoint, not the instruction-tuned one.
    assert make_spec(model_name="gemma2-2b").base_model_id == "google/gemma-2-2b"
    custom = make_spec(model_name="qwen3-4b", hub_repo_id="team/x", base_model_id="lab/qwen3-4b-tuned")
    assert (custom.base_model_id, custom.base_model_license) == ("lab/qwen3-4b-tuned", None)


def test_a_model_maxtext_cannot_convert_is_refused_naming_model_name():
    """to_maxtext refuses a model_name outside its HF_IDS, on the VM: refused here instead."""
    with pytest.raises(SpecError, match=r"Param 'model_name': 'gemma3-4B' .*did you mean 'gemma3-4b'"):
        make_spec(model_name="gemma3-4B")
    with pytest.raises(SpecError, match=r"Param 'model_name': 'mystery-7b' is not a model MaxText 0.2.2 converts"):
        make_spec(model_name="mystery-7b", hub_repo_id="team/x", base_model_id="lab/mystery-7b")


def test_os_login_replaces_the_ssh_keys_metadata():
    """OS Login ignores the ssh-keys metadata: the key goes to the login profile instead."""
    with_os_login = {i["key"]: i["value"] for i in make_spec(os_login=True).instance_body()["metadata"]["items"]}
    assert with_os_login["enable-oslogin"] == "TRUE"
    assert "ssh-keys" not in with_os_login
    default = {i["key"] for i in make_spec().instance_body()["metadata"]["items"]}
    assert "ssh-keys" in default and "enable-oslogin" not in default


def test_ssh_via_iap_tunnels_to_the_vms_port_22_with_the_connections_identity():
    from maxtext_sft.cloud.iap_tunnel import iap_target, tunnel_url

    spec = make_spec(ssh_via_iap=True)
    target = iap_target("gcp", spec.project_id, spec.zone, spec.vm_name)
    assert target == {"gcp_conn_id": "gcp", "project": "my-project", "zone": spec.zone, "instance": spec.vm_name, "port": 22}
    # The query gcloud's CreateWebSocketConnectUrl sends.
    assert tunnel_url("wss://tunnel.cloudproxy.app/v4/", "my-project", spec.zone, spec.vm_name, 22) == (
        f"wss://tunnel.cloudproxy.app/v4/connect?project=my-project&port=22&newWebsocket=True&zone={spec.zone}"
        f"&instance={spec.vm_name}&interface=nic0"
    )


def test_a_dataset_in_a_bucket_names_the_runs_date_and_is_read_as_parquet_files():
    spec = make_spec(dataset_name="gs://team-data/chats/{{ ds }}/", train_split="train_sft")
    assert spec.dataset_name == f"gs://team-data/chats/{STARTED:%Y-%m-%d}"
    assert spec.bucket_dataset and not spec.hub_dataset
    args = spec.train_args()
    assert "hf_path=parquet" in args and "train_split=train" in args
    assert f"hf_train_files=gs://team-data/chats/{STARTED:%Y-%m-%d}/data/train_sft-*.parquet" in args
    assert make_spec(dataset_name="gs://team-data/d={{ds_nodash}}").dataset_name == f"gs://team-data/d={STARTED:%Y%m%d}"
    for bad in ("gs://team-data/{{ conn.huggingface_default.password }}", "gs://team-data/{{ ds }};x", "gs://team-data"):
        with pytest.raises(SpecError, match="'dataset_name'"):
            make_spec(dataset_name=bad)
    with pytest.raises(SpecError, match="only a Hub dataset has revisions"):
        make_spec(dataset_name="gs://team-data/chats", dataset_revision="abc")


def test_a_shared_reservation_and_a_shared_vpc_are_named_in_their_owner_projects():
    spec = make_spec(reservation="projects/owner-project/reservations/team-v6e", subnetwork="team-tpu",
                     network="team-vpc", network_project="vpc-host")
    body = spec.instance_body()
    assert body["reservation_affinity"]["values"] == ["projects/owner-project/reservations/team-v6e"]
    [nic] = body["network_interfaces"]
    assert nic["network"] == "projects/vpc-host/global/networks/team-vpc"
    assert nic["subnetwork"] == "projects/vpc-host/regions/us-east5/subnetworks/team-tpu"
    # Without a host project and a subnetwork: the run's project's network, no subnetwork (the tutorial's).
    [nic] = make_spec().instance_body()["network_interfaces"]
    assert nic["network"].startswith(f"projects/{make_spec().project_id}/") and "subnetwork" not in nic
