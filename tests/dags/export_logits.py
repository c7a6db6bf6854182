"""Logits of a published export against MaxText's own forward pass on the checkpoint it came from.

Run in the real image's venv (MaxText 0.2.2, JAX, transformers 5.8, torch; not the project's):
    python export_logits.py CHECKPOINT EXPORT_DIR PROMPT MAXTEXT_ARG...
CHECKPOINT: the final step's model_params (a local folder); EXPORT_DIR: the published export (the
text model export_to_hf.sh makes of MaxText's text-only export); MAXTEXT_ARGs: the run's export
arguments (model_name, scan_layers, weight_dtype, the toy's dimensions), without the paths.
Prints one JSON line: the export's tensors against the checkpoint, and the largest absolute
difference of the logits between MaxText and transformers with the published config and with
the config as MaxText wrote it (hidden_activation "gelu", rope_theta 10000 on the global layers).

Both sides compute in float32 on the same weights: the export holds the checkpoint's weights
rounded to bfloat16, so MaxText's model gets the export's tensors back through MaxText's own
HF -> MaxText conversion (to_maxtext.py's loaders and param_mapping.py's hooks: the embedding
times sqrt(hidden), the norms plus 1, the kernels reshaped); that those tensors are the final
checkpoint's, bit for bit, is checked first, by converting the checkpoint again as
to_huggingface.py does (process_maxtext_param) and comparing. The approach follows MaxText's
forward_pass_logit_checker (its tests/utils): a Linen Transformer applied to token ids,
positions and segment ids, against AutoModelForCausalLM's logits on the same ids.
"""

import json
import sys
from pathlib import Path

import jax

jax.config.update("jax_platforms", "cpu")
jax.config.update("jax_default_matmul_precision", "highest")

import numpy as np  # noqa: E402
import torch  # noqa: E402
from safetensors.numpy import load_file  # noqa: E402
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from maxtext.checkpoint_conversion import to_huggingface, to_maxtext  # noqa: E402
from maxtext.checkpoint_conversion.utils import utils as conversion  # noqa: E402
from maxtext.checkpoint_conversion.utils.hf_model_configs import HF_MODEL_CONFIGS  # noqa: E402
from maxtext.checkpoint_conversion.utils.param_mapping import HOOK_FNS, PARAM_MAPPING  # noqa: E402
from maxtext.common.common_types import DECODING_ACTIVE_SEQUENCE_INDICATOR, MODEL_MODE_TRAIN  # noqa: E402
from maxtext.configs import pyconfig  # noqa: E402
from maxtext.models import models  # noqa: E402
from maxtext.utils import maxtext_utils  # noqa: E402

# MaxText names Gemma 3's language model model.language_model.* (param_mapping.py); the published
# text model names it model.* (include/vm/text_only_export.py).
LANGUAGE_MODEL_PREFIX = "model.language_model."
TEXT_PREFIX = "model."
# What MaxText 0.2.2 wrote in config.json, which collect_outputs corrects (results/export_config.py).
AS_MAXTEXT_WROTE = {"hidden_activation": "gelu", "rope_theta": 10_000.0}
# The forward pass in float32 at the highest matmul precision, on one CPU device, without a
# checkpoint of its own (the weights are given to apply).
FORWARD_ARGS = [
    "dtype=float32", "weight_dtype=float32", "matmul_precision=highest", "attention=dot_product",
    "per_device_batch_size=1", "hardware=cpu", "skip_jax_distributed_system=true", "enable_checkpointing=False",
]


def published_name(name):
    return TEXT_PREFIX + name[len(LANGUAGE_MODEL_PREFIX):] if name.startswith(LANGUAGE_MODEL_PREFIX) else name


def read_export(folder):
    """Every tensor of the export (numpy; bfloat16 as ml_dtypes'), by name."""
    index = Path(folder) / "model.safetensors.index.json"
    files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.exists() else ["model.safetensors"]
    tensors = {}
    for name in files:
        tensors.update(load_file(Path(folder) / name))
    return tensors


def hf_config(maxtext_config):
    config = HF_MODEL_CONFIGS[maxtext_config.model_name]
    to_huggingface._validate_or_update_architecture(config, maxtext_config, override=True)
    return config.to_dict()


def export_from_checkpoint(checkpoint, export_args):
    """What to_huggingface writes for the checkpoint, tensor by tensor (its own steps, in memory)."""
    config = pyconfig.initialize(["export_logits", *export_args, f"load_parameters_path={checkpoint}"])
    weights = conversion.detect_and_extract_checkpoint(conversion.load_orbax_checkpoint(config))
    mappings = to_huggingface._get_model_mappings(config.model_name, config.scan_layers, hf_config(config), config)
    keys = conversion.validate_and_filter_param_map_keys(mappings["param_mapping"].keys(), weights.keys())
    expected = {}
    for key in keys:
        if "vision_encoder" in str(key):  # use_multimodal=False: to_huggingface skips them too
            continue
        weight = [weights[k] for k in key] if isinstance(key, tuple) else weights[key]
        for name, array in conversion.process_maxtext_param(
            key, weight, mappings["param_mapping"], mappings["hook_fn_mapping"], mappings["shape_mapping"], config
        ):
            expected[published_name(name)] = array
    return expected


def compare_with_checkpoint(export, expected):
    """Names the export lacks or adds, and the tensors whose bits differ from the checkpoint's."""
    differ = [name for name in sorted(set(export) & set(expected))
              if export[name].dtype != expected[name].dtype or export[name].shape != expected[name].shape
              or export[name].tobytes() != expected[name].tobytes()]
    return {"missing": sorted(set(expected) - set(export)), "extra": sorted(set(export) - set(expected)),
            "differ": differ, "compared": len(expected)}


def maxtext_params(export, config):
    """The export's tensors as MaxText's parameters (float32), through MaxText's HF -> MaxText loaders."""
    abstract, treedef = to_maxtext.get_maxtext_model_info(config)
    mapping = PARAM_MAPPING[config.model_name](hf_config(config), config, config.scan_layers)
    hooks = HOOK_FNS[config.model_name](hf_config(config), config, config.scan_layers, saving_to_hf=False)

    def tensor(name):
        return export[published_name(name)].astype(np.float32)

    leaves = [None] * len(abstract)
    for key, (index, shape) in abstract.items():
        load = to_maxtext._get_hf_loading_function(mapping[key], tensor, hooks.get(key), shape, config)
        leaves[index] = np.asarray(load(), dtype=np.float32)
    return jax.tree_util.tree_unflatten(treedef, leaves)


def maxtext_logits(config, params, ids):
    devices = maxtext_utils.create_device_mesh(config)
    mesh = jax.sharding.Mesh(devices, config.mesh_axes)
    model = models.transformer_as_linen(config, mesh, quant=None, model_mode=MODEL_MODE_TRAIN)
    tokens = np.asarray(ids, dtype=np.int32)[None, :]
    positions = np.arange(tokens.shape[1], dtype=np.int32)[None, :]
    segments = np.full(tokens.shape, DECODING_ACTIVE_SEQUENCE_INDICATOR, dtype=np.int32)
    logits = model.apply({"params": params}, tokens, positions, segments, enable_dropout=False)
    return np.asarray(logits[0], dtype=np.float32)


def transformers_logits(folder, ids, **changes):
    config = AutoConfig.from_pretrained(folder)
    for field, value in changes.items():
        if field == "rope_theta":
            config.rope_parameters["full_attention"]["rope_theta"] = value
        else:
            setattr(config, field, value)
    model = AutoModelForCausalLM.from_pretrained(folder, config=config, dtype=torch.float32)
    model.eval()
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].numpy(), type(model).__name__


def main(checkpoint, folder, prompt, export_args):
    export = read_export(folder)
    expected = export_from_checkpoint(checkpoint, export_args)
    ids = AutoTokenizer.from_pretrained(folder)(prompt)["input_ids"]
    forward = pyconfig.initialize(["export_logits", *export_args, *FORWARD_ARGS, f"max_target_length={len(ids)}"])
    reference = maxtext_logits(forward, maxtext_params(export, forward), ids)
    published, model_class = transformers_logits(folder, ids)
    # Each value as MaxText wrote it, then both: each error alone must show.
    variants = [{field: value} for field, value in AS_MAXTEXT_WROTE.items()] + [AS_MAXTEXT_WROTE]
    as_written = {
        "+".join(variant): float(np.abs(transformers_logits(folder, ids, **variant)[0] - reference).max())
        for variant in variants
    }
    print(json.dumps({
        "checkpoint": compare_with_checkpoint(export, expected),
        "tokens": len(ids),
        "model_class": model_class,
        "logit_scale": float(np.abs(reference).max()),
        "published": float(np.abs(published - reference).max()),
        "as_maxtext_wrote": as_written,
    }))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4:])
