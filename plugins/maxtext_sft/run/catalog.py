"""What Compute Engine and MaxText offer the pipeline: the TPU machine types it knows and the
Hugging Face models MaxText converts. Plain data, no imports: the Params' choices come from here."""

from __future__ import annotations

# TPU runtime environment per machine type (the tutorial's TPU_* exports for ct6e-standard-8t).
# host_bounds: how many hosts the slice spans in each dimension (one, on a single-host machine).
TPU_TOPOLOGIES: dict[str, dict[str, str]] = {
    "ct6e-standard-8t": {"accelerator_type": "v6e-8", "topology": "2x4", "chips_per_host_bounds": "2,4,1", "host_bounds": "1,1,1"},
    "ct6e-standard-4t": {"accelerator_type": "v6e-4", "topology": "2x2", "chips_per_host_bounds": "2,2,1", "host_bounds": "1,1,1"},
    "ct6e-standard-1t": {"accelerator_type": "v6e-1", "topology": "1x1", "chips_per_host_bounds": "1,1,1", "host_bounds": "1,1,1"},
}

# Multi-host v6e slices on Compute Engine: a managed instance group of `hosts` ct6e-standard-4t
# VMs (4 chips each, 2x2) under a workload policy with the slice's accelerator topology. The
# shapes are the Cloud TPU v6e documentation's multi-host configurations (v6e-16 4x4 to v6e-256
# 16x16; chips = hosts x 4); host_bounds is topology / chips per host, as TPU_HOST_BOUNDS.
TPU_SLICES: dict[str, dict[str, str | int]] = {
    f"v6e-{chips}": {
        "accelerator_type": f"v6e-{chips}",
        "machine_type": "ct6e-standard-4t",
        "hosts": chips // 4,
        "topology": topology,
        "chips_per_host_bounds": "2,2,1",
        "host_bounds": host_bounds,
    }
    for chips, topology, host_bounds in (
        (16, "4x4", "2,2,1"),
        (32, "4x8", "2,4,1"),
        (64, "8x8", "4,4,1"),
        (128, "8x16", "4,8,1"),
        (256, "16x16", "8,8,1"),
    )
}

# The models MaxText 0.2.2 converts from Hugging Face, each with the Hub checkpoint its converter
# downloads (maxtext/utils/globals.py HF_IDS; to_maxtext refuses any other model_name, on the VM)
# and, where the model's Hub card states one, its licence: the model card's `base_model` and
# `license` (None: the card names no licence).
BASE_MODELS: dict[str, tuple[str, str | None]] = {
    **{f"gemma2-{size}": (f"google/gemma-2-{size}", "gemma") for size in ("2b", "9b", "27b")},
    **{f"gemma3-{size}": (f"google/gemma-3-{size}-it", "gemma") for size in ("4b", "12b", "27b")},
    "gemma4-26b": ("google/gemma-4-26b-a4b-it", None),
    "gemma4-31b": ("google/gemma-4-31b-it", None),
    **{f"qwen2.5-{size}": (f"Qwen/Qwen2.5-{size.upper()}-Instruct", "apache-2.0") for size in ("1.5b", "7b", "14b")},
    "qwen3-0.6b": ("Qwen/Qwen3-0.6B", "apache-2.0"),
    "qwen3-4b": ("Qwen/Qwen3-4B", "apache-2.0"),
    "qwen3-4b-thinking-2507": ("Qwen/Qwen3-4B-Thinking-2507", "apache-2.0"),
    "qwen3-8b": ("Qwen/Qwen3-8B", "apache-2.0"),
    "qwen3-14b": ("Qwen/Qwen3-14B", "apache-2.0"),
    "qwen3-32b": ("Qwen/Qwen3-32B", "apache-2.0"),
    "qwen3-30b-a3b": ("Qwen/Qwen3-30B-A3B-Thinking-2507", "apache-2.0"),
    "qwen3-30b-a3b-base": ("Qwen/Qwen3-30B-A3B-Base", "apache-2.0"),
    "qwen3-235b-a22b": ("Qwen/Qwen3-235B-A22B-Thinking-2507", "apache-2.0"),
    "qwen3-480b-a35b": ("Qwen/Qwen3-Coder-480B-A35B-Instruct", "apache-2.0"),
    "qwen3-omni-30b-a3b": ("Qwen/Qwen3-Omni-30B-A3B-Instruct", None),
    "qwen3-next-80b-a3b": ("Qwen/Qwen3-Next-80B-A3B-Instruct", None),
    "llama3.1-8b": ("meta-llama/Llama-3.1-8B", "llama3.1"),
    "llama3.1-8b-Instruct": ("meta-llama/Llama-3.1-8B-Instruct", "llama3.1"),
    "llama3.1-70b": ("meta-llama/Llama-3.1-70B", "llama3.1"),
    "llama3.1-70b-Instruct": ("meta-llama/Llama-3.1-70B-Instruct", "llama3.1"),
    "llama3.1-405b": ("meta-llama/Llama-3.1-405B", "llama3.1"),
    "deepseek2-16b": ("deepseek-ai/DeepSeek-V2-Lite", None),
    "deepseek3-671b": ("deepseek-ai/DeepSeek-V3", None),
    "deepseek3.2-671b": ("deepseek-ai/DeepSeek-V3.2", None),
    "gpt-oss-20b": ("openai/gpt-oss-20b", "apache-2.0"),
    "gpt-oss-120b": ("openai/gpt-oss-120b", "apache-2.0"),
    "mixtral-8x7b": ("mistralai/Mixtral-8x7B-Instruct-v0.1", "apache-2.0"),
    "mixtral-8x22b": ("mistralai/Mixtral-8x22B-Instruct-v0.1", "apache-2.0"),
    "olmo3-7b": ("allenai/Olmo-3-7B-Instruct", None),
    "olmo3-7b-pt": ("allenai/Olmo-3-1025-7B", None),
    "olmo3-32b": ("allenai/Olmo-3-32B-Think", None),
}
