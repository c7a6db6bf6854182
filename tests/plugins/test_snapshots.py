"""Each logical date maps to the dataset commit current at its interval's end (local Hub history)."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

import pytest
from huggingface_hub import HfApi

from localcloud.connections import LOCAL_HUB_USER
from maxtext_sft.run.snapshots import SnapshotError, dataset_revision_at, snapshot_moment

DAY = timedelta(days=1)
START = datetime(2026, 11, 1, tzinfo=timezone.utc)
DATASET = f"{LOCAL_HUB_USER}/snapshots-daily"  # the test token's own namespace


@pytest.fixture(scope="module")
def history(local_cloud, hf_token, pipeline_connections):
    """A dataset with a commit at noon on Nov 1, 2, 4 (none on Nov 3)."""
    days = [0, 1, 3]
    seeded = local_cloud.hub.seed_repo(
        DATASET,
        repo_type="dataset",
        commits=[
            {"files": {"data/train-00000.parquet": f"day {d}"}, "date": (START + d * DAY + DAY / 2).isoformat()}
            for d in days
        ],
    )
    return HfApi(endpoint=local_cloud.hub.endpoint, token=hf_token), dict(zip(days, seeded["commits"]))


@pytest.mark.parametrize(
    ("interval_end", "day"),
    [
        (START + DAY, 0),  # Nov 2 00:00: the Nov 1 commit
        (START + DAY / 2, 0),  # exactly at the commit: it counts
        (START + 2 * DAY, 1),
        (START + 3 * DAY, 1),  # nothing new on Nov 3: still Nov 2's
        (START + 4 * DAY, 3),
        (START + 40 * DAY, 3),
    ],
)
def test_each_interval_end_maps_to_the_commit_current_then(history, interval_end, day):
    api, commits = history
    assert dataset_revision_at(api, DATASET, interval_end) == commits[day]


def test_before_the_first_commit_there_is_no_snapshot(history):
    api, _ = history
    with pytest.raises(SnapshotError, match="no commit at or before 2026-11-01T00:00:00"):
        dataset_revision_at(api, DATASET, START)


def test_a_run_without_data_interval_pins_to_run_after():
    assert snapshot_moment(None, START) == START
    assert snapshot_moment(START + DAY, START) == START + DAY


def test_a_run_is_pinned_to_its_snapshot_an_explicit_revision_wins_and_its_files_are_listed(
    history, pipeline_connections, local_cloud
):
    import logging
    from types import SimpleNamespace

    from maxtext_sft.tasks.plan import pin_dataset_snapshot
    from tests.plugins.test_spec import make_spec

    api, commits = history
    log = logging.getLogger("test")

    def pinned(dataset_revision=None, *, interval_end=None, run_after=START + 40 * DAY):
        spec = make_spec(dataset_name=DATASET, train_split="train", dataset_revision=dataset_revision)
        run = SimpleNamespace(data_interval_end=interval_end, run_after=run_after)
        return pin_dataset_snapshot(spec, run, hf_conn_id="huggingface_default", log=log)

    scheduled = pinned(interval_end=START + 2 * DAY, run_after=START + 40 * DAY)
    assert scheduled.dataset_revision == commits[1]  # the interval's end decides, not when it ran
    assert scheduled.dataset_files == ("data/train-00000.parquet",)
    assert f"hf_train_files=hf://datasets/{DATASET}@{commits[1]}/data/train-*.parquet" in scheduled.train_args()
    assert pinned(run_after=START + DAY).dataset_revision == commits[0]  # manual: no interval
    assert pinned(commits[0], interval_end=START + 4 * DAY).dataset_revision == commits[0]  # the Param wins
    assert pinned("main", interval_end=START + DAY).dataset_revision == commits[3]  # a branch: its head, now
    # A revision the Hub does not know is left for preflight to name (with every other finding).
    assert pinned("no-such-branch").dataset_revision == "no-such-branch"
    folder = make_spec(dataset_name="/data/chats")
    assert pin_dataset_snapshot(folder, SimpleNamespace(), hf_conn_id="huggingface_default", log=log) is folder
