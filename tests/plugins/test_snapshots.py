"""Each logical date maps to the dataset commit current at its interval's end (local Hub history)."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

import pytest
from huggingface_hub import HfApi

from maxtext_sft.snapshots import SnapshotError, dataset_revision_at, snapshot_moment

DAY = timedelta(days=1)
START = datetime(2026, 11, 1, tzinfo=timezone.utc)


@pytest.fixture(scope="module")
def history(local_cloud, hf_token):
    """A dataset with a commit at noon on Nov 1, 2, 4 (none on Nov 3)."""
    days = [0, 1, 3]
    seeded = local_cloud.hub.seed_repo(
        "snapshots-team/daily",
        repo_type="dataset",
        commits=[
            {"files": {"data/train-00000.parquet": f"day {d}"}, "date": (START + d * DAY + DAY / 2).isoformat()}
            for d in days
        ],
    )
    local_cloud.hub.add_user("snapshots-team", hf_token, role="write")
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
    assert dataset_revision_at(api, "snapshots-team/daily", interval_end) == commits[day]


def test_before_the_first_commit_there_is_no_snapshot(history):
    api, _ = history
    with pytest.raises(SnapshotError, match="no commit at or before 2026-11-01T00:00:00"):
        dataset_revision_at(api, "snapshots-team/daily", START)


def test_a_run_without_data_interval_pins_to_run_after():
    assert snapshot_moment(None, START) == START
    assert snapshot_moment(START + DAY, START) == START + DAY
