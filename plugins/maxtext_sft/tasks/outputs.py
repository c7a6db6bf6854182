"""After the export: put the run's outputs where they last, record them, publish to the Hub."""

from __future__ import annotations

import json
import socket
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from google.api_core.exceptions import NotFound

from airflow.sdk.exceptions import AirflowException, AirflowFailException
from maxtext_sft.cloud.export_files import ExportFiles
from maxtext_sft.cloud.hub import HuggingFaceHubHook
from maxtext_sft.cloud.storage import StorageEndpointHook, split_gcs_uri
from maxtext_sft.vm.ssh_common import LoginRefused, RemoteCommandError
from maxtext_sft.results.export_config import (
    ExportConfigError,
    check_export_config,
    published_architecture,
    requested_architecture,
)
from maxtext_sft.results.lineage import TUNED_MODEL, tuned_model_event
from maxtext_sft.results.loss_curve import render_loss_curve
from maxtext_sft.results.outputs import (
    CONFIG_FILE,
    LOSS_CURVE_NAME,
    MODEL_CARD_NAME,
    RUN_RECORD_NAME,
    ExportLayout,
    ExportLayoutError,
    FinalLossError,
    check_export_folder,
    check_export_layout,
    check_final_loss,
    eval_gate,
    hub_commit_title,
    model_card,
    published_eval_loss,
    run_record,
)
from maxtext_sft.run.paths import local_output_dir
from maxtext_sft.tasks.base import RunTaskOperator
from maxtext_sft.run.spec import RunSpec
from maxtext_sft.ui.task_links import HubCommitLink, RunFolderConsoleLink
from maxtext_sft.results.training_metrics import TrainingMetrics, parse_metrics
from maxtext_sft.vm.access import HostKeysNotPublished, transient_ssh_errors, vm_ssh_hook
from maxtext_sft.vm.steps import STEPS, remote_command, script_files

if TYPE_CHECKING:
    from maxtext_sft.vm.ssh import VmSSHHook


class CollectOutputsOperator(RunTaskOperator):
    """Write the model card next to the export, the loss curve, and the run record last; without
    an output location, first copy the export off the VM (its checkpoints die with it: the log
    says so). The per-step losses and the eval results are read from MaxText's metrics file on
    the VM, which is still alive here, or from its copy in storage. Returns the run record
    (locations, final step and loss, loss history, base and tuned eval loss)."""

    template_fields: Sequence[str] = ("spec", "hosts", "training", "base_checkpoint", "export")
    operator_extra_links = (RunFolderConsoleLink(),)  # from the run record this task returns

    def __init__(self, *, training, base_checkpoint, export, ssh_conn_id: str, **kwargs):
        super().__init__(ssh_conn_id=ssh_conn_id, **kwargs)
        self.training = training
        self.base_checkpoint = base_checkpoint
        self.export = export

    def execute(self, context) -> dict:
        spec = self.run_spec
        base_checkpoint = (self.base_checkpoint or {}).get("base_checkpoint")
        if spec.durable:
            record = self._in_storage(spec, base_checkpoint)
        else:
            record = self._copied_off_the_vm(spec, base_checkpoint)
        if TUNED_MODEL in self.outlets:  # the event is emitted when this task succeeds
            context["outlet_events"][TUNED_MODEL].extra = tuned_model_event(spec, record)
        return record

    def _card(
        self, spec: RunSpec, export: ExportLayout, metrics: TrainingMetrics | None, corrections: list[dict],
        architecture: str | None,
    ) -> str:
        final_step = self.training["final_step"]
        return model_card(spec, final_step=final_step, final_loss=self.training["final_loss"], export=export,
                          eval_loss=metrics.eval_results(final_step) if metrics else None,
                          config_corrections=corrections, architecture=architecture)

    def _checked_config(self, spec: RunSpec, where: str, config_text: str, write) -> tuple[str | None, list[dict]]:
        """The export's config.json checked against the base model's (results/export_config.py);
        the values MaxText is known to get wrong are corrected in place by `write(text)`. Returns
        the model class it names and the corrections; fails the task, not to be retried, when the
        export differs otherwise."""
        exported = json.loads(config_text)
        architecture = published_architecture(exported)
        self.log.info("The export's %s names %s", CONFIG_FILE, architecture)
        repo = spec.checkpoint_repo()
        if repo is None:
            self.log.warning("The base model is a folder on the VM: the export's %s is not checked", CONFIG_FILE)
            return architecture, []
        api = HuggingFaceHubHook(hf_conn_id=self.hf_conn_id).get_conn()
        with tempfile.TemporaryDirectory(prefix="maxtext-sft-base-config-") as folder:
            base = json.loads(
                Path(api.hf_hub_download(repo, CONFIG_FILE, revision=spec.model_revision, local_dir=folder)).read_text()
            )
        try:
            config, corrections = check_export_config(exported, base, requested_architecture(spec.export_args()))
        except ExportConfigError as error:
            raise AirflowFailException(
                f"The export's {CONFIG_FILE} in {where} does not describe {repo} (revision "
                f"{spec.model_revision or 'default branch'}) as trained: {error}. Nothing is published."
            ) from None
        if corrections:
            write(json.dumps(config, indent=2) + "\n")
            for fix in corrections:
                self.log.warning(
                    "Corrected the export's %s: %s was %r, now %r (%s)",
                    CONFIG_FILE, fix["field"], fix["was"], fix["now"], fix["source"],
                )
        return architecture, corrections

    def _curve(self, metrics: TrainingMetrics | None) -> bytes | None:
        return render_loss_curve(metrics.train, eval_history=metrics.eval) if metrics and metrics.train else None

    def _in_storage(self, spec: RunSpec, base_checkpoint: str | None) -> dict:
        storage = StorageEndpointHook(gcp_conn_id=self.gcp_conn_id)
        export_uri = spec.hf_export_uri
        bucket, prefix = split_gcs_uri(export_uri)
        try:
            export = check_export_layout(
                storage.sizes_under(export_uri), lambda name: storage.read_text(f"{export_uri}/{name}")
            )
        except ExportLayoutError as error:
            raise AirflowException(
                f"The export in {export_uri} is incomplete: {error}. Was export_to_hf's upload complete?"
            ) from None
        self.log.info("The export in %s is %s: %s", export_uri, export.layout, list(export.weight_files))
        architecture, corrections = self._checked_config(
            spec, export_uri, storage.read_text(f"{export_uri}/{CONFIG_FILE}"),
            lambda text: storage.upload(bucket, f"{prefix}/{CONFIG_FILE}", data=text, mime_type="application/json"),
        )
        metrics = self._metrics_or_none(spec)
        storage.upload(
            bucket, f"{prefix}/{MODEL_CARD_NAME}", data=self._card(spec, export, metrics, corrections, architecture),
            mime_type="text/markdown",
        )
        curve = None
        if chart := self._curve(metrics):
            curve = f"{spec.run_output_dir}/{LOSS_CURVE_NAME}"
            curve_bucket, curve_name = split_gcs_uri(curve)
            storage.upload(curve_bucket, curve_name, data=chart, mime_type="image/png")
        record = run_record(
            spec, training=self.training, base_checkpoint=base_checkpoint, hf_export=export_uri,
            location=spec.run_record_uri, metrics=metrics, loss_curve=curve, export=export,
            config_corrections=corrections, architecture=architecture,
        )
        record_bucket, record_name = split_gcs_uri(spec.run_record_uri)
        storage.upload(record_bucket, record_name, data=json.dumps(record, indent=1), mime_type="application/json")
        self.log.info("Outputs of %s: %s", spec.run_name, json.dumps(record, indent=1))
        return record

    def _copied_off_the_vm(self, spec: RunSpec, base_checkpoint: str | None) -> dict:
        folder = local_output_dir() / spec.dag_id / spec.run_name
        export_dir = folder / "hf-export"
        hook = vm_ssh_hook(spec, self.gcp_conn_id, self.ssh_conn_id)
        with hook.get_conn():
            files = hook.download_dir(spec.hf_export_dir, export_dir)
            metrics = self._metrics(spec, hook)
        self.log.info("Copied the export off %s to %s: %s", spec.vm_name, export_dir, files)
        try:
            export = check_export_folder(export_dir)
        except ExportLayoutError as error:
            raise AirflowException(f"The export on {spec.vm_name} ({spec.hf_export_dir}) is incomplete: {error}") from None
        self.log.info("The export is %s: %s", export.layout, list(export.weight_files))
        config_path = export_dir / CONFIG_FILE
        architecture, corrections = self._checked_config(
            spec, f"{export_dir} (copied off {spec.vm_name})", config_path.read_text(), config_path.write_text
        )
        (export_dir / MODEL_CARD_NAME).write_text(self._card(spec, export, metrics, corrections, architecture))
        location = f"{socket.gethostname()}:{export_dir}"
        curve = None
        if chart := self._curve(metrics):
            (folder / LOSS_CURVE_NAME).write_bytes(chart)
            curve = f"{socket.gethostname()}:{folder / LOSS_CURVE_NAME}"
        record = run_record(
            spec, training=self.training, base_checkpoint=base_checkpoint, hf_export=location,
            location=f"{socket.gethostname()}:{folder / RUN_RECORD_NAME}", metrics=metrics, loss_curve=curve,
            export=export, config_corrections=corrections, architecture=architecture,
        )
        (folder / RUN_RECORD_NAME).write_text(json.dumps(record, indent=1))
        self.log.warning(
            "No output_location: the checkpoints were not durable and are deleted with the VM; only the export "
            "was kept, on this worker at %s. Set output_location (gs://...) to keep checkpoints and resume.",
            export_dir,
        )
        return record

    def _metrics(self, spec: RunSpec, hook: VmSSHHook) -> TrainingMetrics | None:
        """The losses by step from MaxText's metrics file on the VM (training_metrics.sh); None,
        with a warning, when the script fails: a missing chart is no reason to fail a run."""
        lines: list[str] = []
        hook.upload_scripts(script_files())
        status, tail = hook.run_command(
            remote_command("training_metrics", spec), timeout=STEPS["training_metrics"].timeout_seconds(spec),
            on_line=lines.append,  # not logged: thousands of JSON lines
        )
        if status != 0:
            self.log.warning("No metrics: training_metrics.sh exited %s on %s: %s", status, spec.vm_name, tail[-5:])
            return None
        return self._read(spec, lines, f"the metrics file on {spec.vm_name}")

    def _read(self, spec: RunSpec, lines: list[str], where: str) -> TrainingMetrics:
        metrics = parse_metrics(lines)
        self.log.info(
            "Metrics of %s from %s: %s training points; eval loss by step %s",
            spec.run_name, where, len(metrics.train), metrics.eval,
        )
        if spec.eval_split and not metrics.eval:
            self.log.warning("The run evaluated on %s but its metrics hold no eval loss", spec.eval_split)
        return metrics

    def _metrics_or_none(self, spec: RunSpec) -> TrainingMetrics | None:
        """With an output location nothing else here needs the VM: the metrics come from the file
        on the VM, or, when the VM cannot be reached or has none (stopped by its autostop, made
        again for the export), from the copy the training made in storage as it exited; without
        either the outputs are still recorded, without the curve and the eval results."""
        try:
            hook = vm_ssh_hook(spec, self.gcp_conn_id, self.ssh_conn_id)
            with hook.get_conn():
                if (metrics := self._metrics(spec, hook)) and metrics.train:
                    return metrics
        except (NotFound, HostKeysNotPublished, LoginRefused, RemoteCommandError, *transient_ssh_errors()) as error:
            self.log.warning("Could not read the metrics file on %s: %s", spec.vm_name, error)
        storage = StorageEndpointHook(gcp_conn_id=self.gcp_conn_id)
        if not storage.uri_exists(spec.training_metrics_uri):
            self.log.warning("No metrics: none on the VM, nothing at %s", spec.training_metrics_uri)
            return None
        return self._read(spec, storage.read_text(spec.training_metrics_uri).splitlines(), spec.training_metrics_uri)


class PublishToHubOperator(RunTaskOperator):
    """Upload the exported model with its card to `hub_repo_id` in one commit named after the run.

    Nothing is published, and the task fails, when the final loss is NaN, infinite or above
    `hub_max_final_loss`. Nothing is published, and the task succeeds saying why, when the held-out
    evaluation does not show the tuned model better than the base model, and than the model last
    published to the same repo and branch by `hub_min_eval_improvement` (outputs.eval_gate). A
    commit of this DAG run already on the branch means it was published: running the task again
    adds no commit. Returns {"published": bool, "reason": why not or None, and the repo, branch,
    commit and its URL when published}.
    """

    template_fields: Sequence[str] = ("spec", "record")
    operator_extra_links = (HubCommitLink(),)  # from the commit this task returns

    def __init__(self, *, record, hf_conn_id: str, **kwargs):
        super().__init__(hf_conn_id=hf_conn_id, **kwargs)
        self.record = record

    def execute(self, context) -> dict | None:
        spec = self.run_spec
        if not spec.hub_repo_id:
            self.log.info("hub_repo_id is not set: nothing to publish")
            return {"published": False, "reason": "hub_repo_id is not set"}
        try:
            loss = check_final_loss(self.record["final_loss"], spec.hub_max_final_loss)
        except FinalLossError as error:
            raise AirflowFailException(f"Not publishing to {spec.hub_repo_id}: {error}") from None
        api = HuggingFaceHubHook(hf_conn_id=self.hf_conn_id).get_conn()
        title = hub_commit_title(spec)
        if published := self._published_by_this_run(api, spec, title):
            return published
        if reason := eval_gate(spec, self.record.get("eval_loss"), self._last_published_eval_loss(api, spec)):
            self.log.warning("Not publishing to %s@%s: %s", spec.hub_repo_id, spec.hub_branch, reason)
            return {"published": False, "reason": reason}
        files = ExportFiles(self.record["hf_export"], gcp_conn_id=self.gcp_conn_id)
        try:  # checked again: what is uploaded is what this task reads, not what collect_outputs saw
            export = check_export_layout(files.sizes, files.read_text)
        except ExportLayoutError as error:
            raise AirflowFailException(
                f"Not publishing to {spec.hub_repo_id}: the export at {self.record['hf_export']} is incomplete: {error}"
            ) from None
        # Created only when missing: huggingface_hub's create_repo(exist_ok=True) answers a token that
        # may write the repo but not create repos there from a 403, and builds that answer's URL for
        # huggingface.co only (a private Hub endpoint then fails).
        if not api.repo_exists(spec.hub_repo_id, repo_type="model"):
            self.log.info("Hub repo: %s", api.create_repo(spec.hub_repo_id, repo_type="model", private=spec.hub_private))
        if spec.hub_branch != "main":
            api.create_branch(spec.hub_repo_id, branch=spec.hub_branch, exist_ok=True)
        self.log.info("Publishing the %s export: %s", export.layout, list(export.weight_files))
        info = api.create_commit(
            repo_id=spec.hub_repo_id,
            operations=self._upload_one_at_a_time(api, spec, files),
            revision=spec.hub_branch,
            commit_message=title,
            commit_description=f"MaxText run {spec.run_name}: {self.record['final_step']} steps, final loss {loss}.",
        )
        self.log.info("Published %s to %s@%s: commit %s", spec.run_name, spec.hub_repo_id, spec.hub_branch, info.oid)
        return {
            "published": True, "reason": None,
            "repo_id": spec.hub_repo_id, "branch": spec.hub_branch, "commit": info.oid, "url": info.commit_url,
        }

    def _upload_one_at_a_time(self, api, spec: RunSpec, files: ExportFiles) -> list:
        """Each file of the export fetched to this worker and uploaded before the next is fetched,
        so the worker needs room for the largest file, not the whole export (about 8 GB for
        gemma3-4b). Returns the commit's operations: the Hub's large (LFS) files are uploaded
        already and create_commit sends only their hash and size; the small ones it keeps in git
        travel in the commit itself, so their bytes are kept here."""
        from huggingface_hub import CommitOperationAdd  # imported when used: DAG files stay cheap to parse (docs/architecture.md)
        from huggingface_hub.utils import DEFAULT_IGNORE_PATTERNS, filter_repo_objects

        operations = []
        names = list(filter_repo_objects(sorted(files.sizes), ignore_patterns=DEFAULT_IGNORE_PATTERNS))  # as upload_folder
        with tempfile.TemporaryDirectory(prefix="maxtext-sft-publish-") as scratch:
            for name in names:
                with files.local_file(name, Path(scratch)) as path:
                    operation = CommitOperationAdd(path_in_repo=name, path_or_fileobj=str(path))
                    # free_memory (the default) empties an uploaded LFS file's content: the commit
                    # reads none of it; what still names the file goes to git, in the commit.
                    api.preupload_lfs_files(spec.hub_repo_id, additions=[operation], revision=spec.hub_branch)
                    if isinstance(operation.path_or_fileobj, str):
                        operation.path_or_fileobj = path.read_bytes()
                operations.append(operation)
                self.log.info("Uploaded %s (%d bytes)", name, files.sizes[name])
        return operations

    def _published_by_this_run(self, api, spec: RunSpec, title: str) -> dict | None:
        """This DAG run's commit on the branch, if an earlier try published it."""
        from huggingface_hub.errors import RepositoryNotFoundError, RevisionNotFoundError  # imported when used: DAG files stay cheap to parse (docs/architecture.md)

        try:
            commits = api.list_repo_commits(spec.hub_repo_id, revision=spec.hub_branch)
        except (RepositoryNotFoundError, RevisionNotFoundError):
            return None  # nothing published there yet
        for commit in commits:
            if commit.title == title:
                self.log.info("Already published by this DAG run as commit %s; adding none", commit.commit_id)
                return {
                    "published": True, "reason": None,
                    "repo_id": spec.hub_repo_id, "branch": spec.hub_branch, "commit": commit.commit_id,
                }
        return None

    def _last_published_eval_loss(self, api, spec: RunSpec) -> float | None:
        """The eval loss in the model card on the branch (the model last published there), when
        it reports one on this run's eval split; None when nothing is published there yet."""
        from huggingface_hub.errors import (  # imported when used: DAG files stay cheap to parse (docs/architecture.md)
            RemoteEntryNotFoundError,
            RepositoryNotFoundError,
            RevisionNotFoundError,
        )

        if not spec.eval_split:
            return None
        try:
            path = api.hf_hub_download(spec.hub_repo_id, MODEL_CARD_NAME, revision=spec.hub_branch)
        except (RepositoryNotFoundError, RevisionNotFoundError, RemoteEntryNotFoundError):
            return None
        loss = published_eval_loss(Path(path).read_text(encoding="utf-8"), spec)
        self.log.info("Last published model on %s@%s: eval loss %s", spec.hub_repo_id, spec.hub_branch, loss)
        return loss
