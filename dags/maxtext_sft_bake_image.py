"""Bake MaxText into an image family, so that fine-tunes booting it skip the install.

On a real TPU VM the install (`pip install maxtext[tpu-post-train]`) takes minutes at about $20
an hour, every run. Trigger this DAG by hand once per MaxText version (Params: project, zone,
source image, CPU machine type, maxtext_version, target image family and name, disk size); it
  1. plans: validates every Param and the connections, and checks the source image family
     exists; if the target family already has a READY image of this version, it says so and
     skips everything (running it twice is safe)
  2. creates a cheap on-demand CPU VM from the source image (the install is CPU work; no
     reservation), which Compute Engine deletes at the end of its lifetime whatever happens
  3. waits for SSH as the pipeline's VM user, runs the fine-tune's own install_maxtext step
  4. stops the VM and creates an image of its boot disk in the family
  5. deletes the VM (a teardown: also when a step failed); the run fails if any step failed

Then trigger `maxtext_sft` with image_project=<the bake's project> and image_family=<its family>:
its install_maxtext step finds the venv and logs "already installed".

The venv is in WORK_DIR/maxtext_venv under the home of the SSH connection's user (work_dir "~"
by default). The image keeps that home for that user name only: runs must log in with the same
SSH login and use the same work_dir (the image's labels maxtext-vm-user and maxtext-work-dir say
which); a run as another user gets a fresh home and installs again. An absolute work_dir is
refused at planning time. The task graph is in plugins/maxtext_sft/builders/bake_pipeline.py.
"""

from __future__ import annotations

# The heavy clients the bake's operators are built on, named here so that the DAG processor
# imports them once, before it forks each parse (docs/architecture.md: cheap to parse).
import airflow.providers.google.cloud.hooks.gcs  # noqa: F401
import airflow.providers.google.cloud.operators.compute  # noqa: F401
from airflow.sdk import DAG  # also what Airflow's safe-mode scan looks for in a DAG file
from maxtext_sft.builders.bake_pipeline import bake_image_dag

dag: DAG = bake_image_dag("maxtext_sft_bake_image", doc_md=__doc__)
