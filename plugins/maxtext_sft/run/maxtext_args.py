"""The MaxText command lines of a run: to_maxtext (conversion), train_sft, to_huggingface (export),
the tutorial's with the token left to the environment, and the arguments the pipeline owns.
`MaxTextCommandLines` is one part of spec.RunSpec; no Airflow imports."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from maxtext_sft.run.catalog import TPU_SLICES, TPU_TOPOLOGIES
from maxtext_sft.run.rehearsal_kit import toy_args
from maxtext_sft.run.params import SpecError

# MaxText arguments the pipeline itself sets; extra args may not override them.
OWNED_KEYS: dict[str, frozenset[str]] = {
    "convert": frozenset(
        {"model_name", "base_output_directory", "hf_access_token", "lazy_load_tensors", "run_name", "revision"}
    ),
    "train": frozenset(
        {
            "run_name",
            "base_output_directory",
            "load_parameters_path",
            "model_name",
            "steps",
            "checkpoint_period",
            "hf_access_token",
            "per_device_batch_size",
            "hf_path",
            "train_split",
            "train_data_columns",
            "hf_train_files",
            # Held-out evaluation (eval_split, eval_steps) and where MaxText writes its metrics.
            "eval_interval",
            "eval_steps",
            "hf_eval_split",
            "hf_eval_files",
            "eval_data_columns",
            "metrics_file",
        }
    ),
    "export": frozenset(
        {"model_name", "load_parameters_path", "base_output_directory", "hf_access_token", "run_name"}
    ),
}


# A checkpoint every tenth of the steps bounds what a lost VM costs to a tenth of the training;
# the cap bounds it in steps for a long run (1000 steps of gemma3-4b: ~10 minutes on a v6e-8).
CHECKPOINTS_PER_RUN = 10
MAX_DERIVED_CHECKPOINT_PERIOD = 1000
# A Spot VM can be preempted at any time with 30 s of notice, too short to write a real gemma3-4b
# checkpoint (46.6 GB), so only the periodic ones count: at most 100 steps (about a minute of
# gemma3-4b on a v6e-8) are lost per preemption, and each write (about 47 s at 1 GB/s) ends
# before the next begins. docs/capacity.md shows the trade-off.
MAX_DERIVED_SPOT_CHECKPOINT_PERIOD = 100
MAXTEXT_CHECKPOINT_PERIOD = 10_000  # MaxText's own default (base.yml)


def checkpoint_period_for(steps: int, durable: bool, capacity: str = "reservation") -> int:
    """checkpoint_period when the Param leaves it empty. Without durable storage a checkpoint is
    lost with its VM, so saving more often would only fill /dev/shm: MaxText's default then."""
    if not durable:
        return MAXTEXT_CHECKPOINT_PERIOD
    cap = MAX_DERIVED_SPOT_CHECKPOINT_PERIOD if capacity == "spot" else MAX_DERIVED_CHECKPOINT_PERIOD
    return min(max(1, -(-steps // CHECKPOINTS_PER_RUN)), cap)


def refuse_owned_keys(step: str, args: Sequence[str]) -> None:
    """Extra MaxText arguments (already `key=value` or `--flag=value`) may not set a key the
    pipeline sets itself."""
    for arg in args:
        key = arg.split("=", 1)[0].removeprefix("--")
        if key in OWNED_KEYS[step]:
            name = f"{step}_extra_args"
            raise SpecError(f"Param {name!r}: {key!r} is set by the pipeline and cannot be overridden", name)


class MaxTextCommandLines:
    """The run's MaxText arguments, and the TPU runtime environment they run in."""

    @property
    def tpu(self) -> dict[str, str]:
        """The TPU runtime environment: the slice's (tpu_slice) or the single VM's machine type."""
        tpu_slice = self.params.get("tpu_slice")
        return TPU_SLICES[tpu_slice] if tpu_slice else TPU_TOPOLOGIES[self.machine_type]

    def conversion_key(self) -> dict[str, Any]:
        """What a converted base checkpoint depends on: runs with equal keys share one conversion."""
        return {
            "model_name": self.model_name,
            "model_revision": self.model_revision or "default-branch",
            "maxtext_version": self.maxtext_version,
            "convert_args": self._conversion_flags(),
        }

    def checkpoint_repo(self) -> str | None:
        """The Hub repo the conversion downloads; None when it reads a folder on the VM (--hf_model_path)."""
        for arg in self.convert_extra_args:
            key, _, value = arg.lstrip("-").partition("=")
            if key == "hf_model_path":
                return None if value.startswith(("/", "~", ".")) else value
        return self.base_model_id

    def convert_args(self) -> list[str]:
        return [
            f"model_name={self.model_name}",
            f"base_output_directory={self.maxtext_checkpoint_dir}",
            *self._conversion_flags(),
        ]

    def _conversion_flags(self) -> list[str]:
        """Every conversion argument but where it writes (what the conversion cache is keyed on)."""
        zarr_ocdbt = str(0 if self.use_pathways else 1)
        return [
            "scan_layers=True",
            "use_multimodal=False",
            "hardware=cpu",
            "skip_jax_distributed_system=true",
            f"checkpoint_storage_use_zarr3={zarr_ocdbt}",
            f"checkpoint_storage_use_ocdbt={zarr_ocdbt}",
            f"--lazy_load_tensors={self.lazy_load_tensors}",
            *([f"--revision={self.model_revision}"] if self.model_revision else []),
            *self._toy("convert"),
            *self.convert_extra_args,
        ]

    def _toy(self, step: str) -> list[str]:
        """A rehearsal's extra arguments for `step`: its toy kit on the VM (run/rehearsal_kit.py)."""
        return toy_args(self.work_dir)[step] if self.rehearsal else []

    def train_args(self, base_checkpoint: str | None = None, *, resuming: bool = False) -> list[str]:
        """train_sft's arguments; `base_checkpoint` is the converted checkpoint the convert step reported.

        `resuming`: a recreated VM takes up the run from its latest checkpoint (MaxText restores it
        by run_name). It does not profile: Tunix refuses a profiling window that the steps left
        cannot hold, and the first attempt's trace is already in tensorboard/.
        """
        base_checkpoint = base_checkpoint or f"{self.maxtext_checkpoint_dir}0/items"
        columns = "[" + ", ".join(f"'{c}'" for c in self.train_data_columns) + "]"
        split = [f"train_split={self.train_split}"]
        hf_path = self.dataset_name
        if self.rehearsal:
            # The toy dataset of the kit; the run's own dataset is only read (preflight, check_vm_access).
            kit_dataset = toy_args(self.work_dir)["dataset"]
            hf_path, split = kit_dataset["path"], [f"train_split={kit_dataset['split']}"]
        elif self.bucket_dataset:
            # `datasets`' parquet builder reads the bucket's files (gcsfs); as with a pinned Hub
            # revision, the split's files are named and `datasets` calls their split "train".
            hf_path = "parquet"
            split = [f"hf_train_files={self.dataset_name}/{self.train_files_pattern}", "train_split=train"]
        elif self.dataset_revision:
            # MaxText's loader takes no revision: revision-pinned files pin the snapshot instead.
            # `datasets` names the split of explicit data files "train"; the split Param picks
            # the files (UltraChat's data/<split>-*.parquet layout).
            split = [
                f"hf_train_files=hf://datasets/{self.dataset_name}@{self.dataset_revision}/{self.train_files_pattern}",
                "train_split=train",
            ]
        return [
            f"run_name={self.run_name}",
            f"base_output_directory={self.train_output_dir}",
            f"model_name={self.model_name}",
            f"load_parameters_path={base_checkpoint}",
            f"per_device_batch_size={self.per_device_batch_size}",
            f"steps={self.steps}",
            f"checkpoint_period={self.checkpoint_period}",
            f"hf_path={hf_path}",
            *split,
            f"train_data_columns={columns}",
            *self._eval_args(columns),
            "profiler=xplane",
            *self._toy("train"),
            *self.train_extra_args,
            *(["profiler=''"] if resuming else []),
        ]

    def _eval_args(self, columns: str) -> list[str]:
        """The held-out evaluation: eval_interval = steps makes Tunix evaluate before the first
        step (the base model) and after the last (the tuned one), eval_steps batches each, and
        write both to MaxText's metrics file (start_training.sh names it). The split's files are
        read the way the training's are: revision-pinned, from the bucket folder, or by split."""
        if not self.eval_split:
            return ["eval_interval=-1"]
        if self.rehearsal:
            split = [f"hf_eval_split={toy_args(self.work_dir)['dataset']['eval_split']}"]  # the kit's held-out split
        elif self.bucket_dataset:
            split = [f"hf_eval_files={self.dataset_name}/{self.eval_files_pattern}", "hf_eval_split=train"]
        elif self.dataset_revision:
            split = [
                f"hf_eval_files=hf://datasets/{self.dataset_name}@{self.dataset_revision}/{self.eval_files_pattern}",
                "hf_eval_split=train",
            ]
        else:
            split = [f"hf_eval_split={self.eval_split}"]
        return [f"eval_interval={self.steps}", f"eval_steps={self.eval_steps}", *split, f"eval_data_columns={columns}"]

    def export_args(self) -> list[str]:
        return [
            f"model_name={self.model_name}",
            f"load_parameters_path={self.final_checkpoint_path}",
            f"base_output_directory={self.hf_export_dir}",
            "scan_layers=True",
            "use_multimodal=False",
            "weight_dtype=bfloat16",
            *self._toy("export"),
            *self.export_extra_args,
        ]
