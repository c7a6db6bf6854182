"""Which dataset snapshot a run trains on: the Hub commit current at the run's data interval end.

A scheduled run trains on the dataset as it was when its interval closed, so a backfill over past
intervals trains each run on its own snapshot. Manual runs in Airflow 3 may have no data
interval: their `run_after` stands in. An explicit `dataset_revision` Param wins over both.
MaxText's loader takes no revision, so the run trains on revision-addressed files
(`hf://datasets/ID@COMMIT/...`, see RunSpec.train_args); the files are listed here, for the record.
"""

from __future__ import annotations

import fnmatch
from datetime import datetime
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from huggingface_hub import HfApi


class SnapshotError(ValueError):
    """No commit of the dataset existed at the moment a run pins to."""


def dataset_revision_at(api: HfApi, dataset: str, moment: datetime, branch: str | None = None) -> str:
    """The id of the newest commit on `branch` (default: the repo's default branch) made at or before `moment`."""
    if moment.tzinfo is None:
        raise ValueError("moment must be timezone-aware (Airflow's dates are)")
    for commit in api.list_repo_commits(dataset, repo_type="dataset", revision=branch):  # newest first
        if commit.created_at <= moment:
            return commit.commit_id
    raise SnapshotError(f"dataset {dataset} has no commit at or before {moment.isoformat()}")


def snapshot_moment(data_interval_end: datetime | None, run_after: datetime) -> datetime:
    """The moment a run's data is pinned to: its data interval's end, or `run_after` without one."""
    return data_interval_end or run_after


def files_at(api: HfApi, dataset: str, revision: str, pattern: str) -> list[str]:
    """The dataset's files at `revision` that match `pattern` (what the run will read), sorted."""
    names = api.list_repo_files(dataset, repo_type="dataset", revision=revision)
    return sorted(name for name in names if fnmatch.fnmatchcase(name, pattern))
