"""The pipeline deployed the way docker-compose.yaml deploys it, without containers: CeleryExecutor
with Redis as the broker, two Celery workers (each with a home, temp folder and hostname of its
own), a scheduler, dag-processor, triggerer and api-server on PostgreSQL, and the connections
given as AIRFLOW_CONN_* environment variables."""

from __future__ import annotations

import uuid

import pytest

from localcloud.redis import RedisServer
from tests.dags.conftest import wait_for_run_end

pytestmark = pytest.mark.e2e


@pytest.fixture
def redis_url(tmp_path):
    with RedisServer(tmp_path / "redis") as server:
        yield server.url


def test_a_run_on_two_celery_workers_succeeds_and_deletes_its_vm(
    start_airflow, redis_url, local_cloud, pipeline_connections, hf_token
):
    from huggingface_hub import HfApi

    from localcloud.connections import LOCAL_BUCKET, LOCAL_HUB_USER, LOCAL_RUN_CONF

    # The connections reach every component only through the environment, as a deployment's .env.
    assert set(pipeline_connections) >= {
        "AIRFLOW_CONN_GOOGLE_CLOUD_DEFAULT", "AIRFLOW_CONN_MAXTEXT_SFT_VM_SSH", "AIRFLOW_CONN_HUGGINGFACE_DEFAULT"
    }
    airflow = start_airflow(celery_broker_url=redis_url, celery_workers=2)
    local_cloud.clear_requests()
    folder = f"celery-{uuid.uuid4().hex[:8]}"
    conf = {
        **LOCAL_RUN_CONF,
        "steps": 30,
        "output_location": f"gs://{LOCAL_BUCKET}/{folder}",
        "hub_repo_id": f"{LOCAL_HUB_USER}/{folder}",
    }
    run_id = airflow.trigger(conf)
    final = wait_for_run_end(airflow, run_id, timeout=600)

    # Every task's state, through the REST API.
    task_instances = airflow.task_instances(run_id)
    states = {ti["task_id"]: ti["state"] for ti in task_instances}
    assert final["state"] == "success", states
    assert set(states.values()) == {"success"}, states
    # The tasks were spread over both workers: whatever one task left on its worker's disk was
    # not there for the next task on the other one.
    # (The scheduler marks an EmptyOperator done without sending it to any worker.)
    where = {ti["task_id"]: ti["hostname"] for ti in task_instances}
    on_workers = {ti["task_id"]: ti["hostname"] for ti in task_instances if ti["operator"] != "EmptyOperator"}
    assert set(on_workers.values()) == {"celery-worker-1", "celery-worker-2"}, where
    assert len(on_workers) >= len(task_instances) - 1, where  # vm_lease alone is an EmptyOperator

    assert local_cloud.vms() == []
    deletes = [r for r in local_cloud.requests() if r["method"] == "DELETE" and "/instances/" in r["path"]]
    assert [r["status"] for r in deletes] == [200]
    # Outputs written from one worker and read (model card, publish) from another.
    record = airflow.xcom(run_id, "collect_outputs")
    assert record["run_record"].startswith(f"{conf['output_location']}/runs/"), record
    assert record["hf_export"].startswith(f"{conf['output_location']}/runs/"), record
    published = HfApi(endpoint=local_cloud.hub.endpoint, token=hf_token).list_repo_files(conf["hub_repo_id"])
    assert "README.md" in published, published
