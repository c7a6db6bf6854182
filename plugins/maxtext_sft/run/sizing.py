"""How big a real run is, computed from the model's own shape, so preflight can refuse what cannot fit.

The local cloud runs the real structure at a tiny width; these numbers are the real model's.
Parameter counts come from the shape of the Hugging Face checkpoint (Gemma3ForConditionalGeneration:
a text decoder with tied embeddings, a SigLIP vision tower and a projector); bytes per parameter
come from MaxText 0.2.2's defaults (`maxtext/configs/base.yml`: `weight_dtype: float32`,
`opt_type: adamw`; `to_maxtext --save_dtype` defaults to bfloat16) and the pipeline's own
arguments (`to_huggingface ... weight_dtype=bfloat16`). docs/toy-vs-real.md shows them per step.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

GB = 1000**3  # disk sizes (boot_disk_size_gb) and the Hub's file sizes are decimal

BF16_BYTES = 2
FP32_BYTES = 4
# A training checkpoint holds the float32 weights and AdamW's two float32 moments (mu, nu).
TRAINING_CHECKPOINT_BYTES_PER_PARAMETER = FP32_BYTES * 3

# The MaxText venv on the VM's boot disk: maxtext[tpu-post-train] with CPU torch measured 6.4 GB
# here (localcloud's real image); a TPU venv swaps torch's CPU wheel for libtpu and vLLM's TPU
# packages, so it is given room to be larger.
MAXTEXT_VENV_BYTES = 12 * GB
# MaxText 0.2.2 writes an export above this size in shards of at most this size
# (maxtext/checkpoint_conversion/utils/utils.py, DEFAULT_MAX_SHARD_SIZE).
MAXTEXT_MAX_SHARD_BYTES = 3 * 1024**3
# The boot image itself (Ubuntu with the TPU drivers) and the OS's own use of the disk; Compute
# Engine refuses a boot disk smaller than the image, so this only has to leave the OS room to work.
OS_ALLOWANCE_BYTES = 30 * GB

# Host memory of the single-host TPU v6e machine types: Google's TPU v6e page gives 1536 GiB of
# DRAM per 8-chip host and the share of a host each machine type gets (1/8, 1/2, 1).
HOST_MEMORY_BYTES: dict[str, int] = {
    "ct6e-standard-1t": 1536 * 1024**3 // 8,
    "ct6e-standard-4t": 1536 * 1024**3 // 2,
    "ct6e-standard-8t": 1536 * 1024**3,
}


@dataclasses.dataclass(frozen=True)
class Gemma3Shape:
    """The widths of a Gemma 3 checkpoint that decide its parameter count (HF config names)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vision_hidden_size: int
    vision_intermediate_size: int
    vision_num_hidden_layers: int
    image_size: int
    patch_size: int

    @classmethod
    def from_hf_config(cls, config: Mapping) -> Gemma3Shape:
        text, vision = config["text_config"], config["vision_config"]
        return cls(
            vocab_size=text["vocab_size"],
            hidden_size=text["hidden_size"],
            intermediate_size=text["intermediate_size"],
            num_hidden_layers=text["num_hidden_layers"],
            num_attention_heads=text["num_attention_heads"],
            num_key_value_heads=text["num_key_value_heads"],
            head_dim=text["head_dim"],
            vision_hidden_size=vision["hidden_size"],
            vision_intermediate_size=vision["intermediate_size"],
            vision_num_hidden_layers=vision["num_hidden_layers"],
            image_size=vision["image_size"],
            patch_size=vision["patch_size"],
        )

    def text_parameters(self) -> int:
        """The decoder: embeddings (tied with the output layer), 34 layers for 4B, final norm."""
        hidden, heads, kv_heads, head = self.hidden_size, self.num_attention_heads, self.num_key_value_heads, self.head_dim
        attention = hidden * heads * head * 2 + hidden * kv_heads * head * 2 + head * 2  # q, o, k, v, q/k norms
        mlp = hidden * self.intermediate_size * 3  # gate, up, down
        norms = hidden * 4  # input, post-attention, pre- and post-feedforward
        return self.vocab_size * hidden + self.num_hidden_layers * (attention + mlp + norms) + hidden

    def vision_parameters(self) -> int:
        """The SigLIP tower and the projector into the decoder: in the download, not in training
        (the pipeline converts and exports with use_multimodal=False)."""
        width, inner = self.vision_hidden_size, self.vision_intermediate_size
        patches = (self.image_size // self.patch_size) ** 2
        embeddings = width * 3 * self.patch_size**2 + width + patches * width
        layer = 4 * (width * width + width) + 4 * width + (width * inner + inner) + (inner * width + width)
        projector = width * self.hidden_size + width
        return embeddings + self.vision_num_hidden_layers * layer + 2 * width + projector


# The shapes MaxText 0.2.2's converters hard-code for the Gemma 3 models
# (maxtext/checkpoint_conversion/utils/hf_model_configs.py); the vision tower is the same SigLIP.
_SIGLIP = {"vision_hidden_size": 1152, "vision_intermediate_size": 4304, "vision_num_hidden_layers": 27,
           "image_size": 896, "patch_size": 14}
MODEL_SHAPES: dict[str, Gemma3Shape] = {
    "gemma3-4b": Gemma3Shape(262144, 2560, 10240, 34, 8, 4, 256, **_SIGLIP),
    "gemma3-12b": Gemma3Shape(262144, 3840, 15360, 48, 16, 8, 256, **_SIGLIP),
    "gemma3-27b": Gemma3Shape(262144, 5376, 21504, 62, 32, 16, 128, **_SIGLIP),
}


@dataclasses.dataclass(frozen=True)
class RunSizes:
    """Bytes each step of one run writes, for one model."""

    text_parameters: int
    vision_parameters: int
    hf_download: int  # the Hub checkpoint in bf16, vision tower included (HF cache on the boot disk)
    converted_checkpoint: int  # to_maxtext, bf16, text only
    training_checkpoint: int  # one step: float32 weights plus AdamW's two moments
    export: int  # to_huggingface weight_dtype=bfloat16, text only
    largest_export_file: int  # the largest file of the export: one shard at most

    @classmethod
    def of(cls, shape: Gemma3Shape) -> RunSizes:
        text, vision = shape.text_parameters(), shape.vision_parameters()
        return cls(
            text_parameters=text,
            vision_parameters=vision,
            hf_download=(text + vision) * BF16_BYTES,
            converted_checkpoint=text * BF16_BYTES,
            training_checkpoint=text * TRAINING_CHECKPOINT_BYTES_PER_PARAMETER,
            export=text * BF16_BYTES,
            # Every Gemma 3 tensor (the largest, the embedding, 1.3 GB for gemma3-4b) is under the
            # shard size, so no shard exceeds it.
            largest_export_file=min(text * BF16_BYTES, MAXTEXT_MAX_SHARD_BYTES),
        )


def run_sizes(model_name: str) -> RunSizes | None:
    """The sizes of a run of `model_name`, or None for a model whose shape is not in MODEL_SHAPES."""
    shape = MODEL_SHAPES.get(model_name)
    return None if shape is None else RunSizes.of(shape)


def saved_steps(steps: int, checkpoint_period: int) -> int:
    """How many training checkpoints a fresh run keeps: MaxText saves the first step, every
    period-th step and the last, and keeps them all (max_num_checkpoints_to_keep: None)."""
    saved = {1, steps} | set(range(checkpoint_period, steps + 1, checkpoint_period))
    return len(saved)


def prunable_steps(committed: list[int], kept: int | None) -> list[int]:
    """Which of the committed checkpoint steps (ascending) to delete so that the newest `kept`
    stay (None: keep all). MaxText 0.2.2's train_sft does not prune: its Orbax options set no
    max_to_keep (max_num_checkpoints_to_keep is read by the RL and distillation trainers only)."""
    if kept is None or len(committed) <= kept:
        return []
    return committed[:-kept]


def gb(size: int) -> str:
    return f"{size / GB:.1f} GB"
