"""The export's config.json against the base model's: what the tuned model computes must be what
MaxText trained. MaxText's exporter writes a config.json of its own (hf_model_configs.py), not the
base model's, and some of its values are wrong; a loader trusts them without a warning."""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from typing import Any

# The fields of Gemma3TextConfig (transformers 5.8.0, models/gemma3/configuration_gemma3.py, the
# version of the MaxText 0.2.2 image) that change what the model computes, with that class's
# defaults: a config.json leaves out a field at its default. Left out on purpose: token ids,
# initializer_range, dropout and use_cache (training or generation settings), and
# max_position_embeddings (a context limit: MaxText 0.2.2 writes 163840 where the base model has
# 131072, and no position below either is computed differently).
ARCHITECTURE_DEFAULTS: dict[str, Any] = {
    "vocab_size": 262_208,
    "hidden_size": 2304,
    "intermediate_size": 9216,
    "num_hidden_layers": 26,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 256,
    "hidden_activation": "gelu_pytorch_tanh",
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": True,
    "attention_bias": False,
    "query_pre_attn_scalar": 256,
    "sliding_window": 4096,
    "final_logit_softcapping": None,
    "attn_logit_softcapping": None,
    "use_bidirectional_attention": False,
    # Rope, per layer type. transformers 5 writes them as rope_parameters {full_attention: {...},
    # sliding_attention: {...}}; earlier ones (the base model's config.json) as rope_theta,
    # rope_local_base_freq and rope_scaling (the full-attention layers' only). Gemma3TextConfig's
    # default_theta: 1e6 global, 1e4 local.
    "rope_theta": 1_000_000.0,
    "rope_scaling": {"rope_type": "default"},
    "rope_local_base_freq": 10_000.0,
    "rope_local_scaling": {"rope_type": "default"},
    # Which layers slide: layer_types, or every sliding_window_pattern-th layer full (default 6).
    "layer_types": None,
}
SLIDING_WINDOW_PATTERN = 6

# Values MaxText 0.2.2 is known to export wrong, and what the trained model has: {field: (wrong,
# right, source)}. Corrected only where the export has the wrong value and the base model the
# right one; any other difference fails the run.
KNOWN_WRONG: dict[str, tuple[Any, Any, str]] = {
    # hf_model_configs.py gemma3_4b_config: text_config hidden_activation "gelu" (its vision config
    # has gelu_pytorch_tanh); MaxText trains gemma3 with the tanh approximation.
    "hidden_activation": ("gelu", "gelu_pytorch_tanh", "AI-Hypercomputer/maxtext#2867"),
    # The same config says rope_theta 10000.0 for every layer, while MaxText trains gemma3-4b's
    # global layers with rope_max_timescale 1_000_000 (configs/models/gemma3-4b.yml), as Gemma 3 is.
    "rope_theta": (
        10_000.0, 1_000_000.0,
        "MaxText 0.2.2 configs/models/gemma3-4b.yml rope_max_timescale (hf_model_configs.py writes 10000.0); "
        "huggingface/transformers#41922",
    ),
}

# Values in which MaxText 0.2.2's export differs from the base model by design, accepted as they
# are: {field: (export's, base model's, why)}. Nothing to correct: the export's weights have that
# shape. A run must not fail over them after its TPU hours.
KNOWN_DIFFERENT: dict[str, tuple[Any, Any, str]] = {
    # MaxText's gemma3-4b has the text vocabulary only (configs/models/gemma3-4b.yml vocab_size
    # 262_144; hf_model_configs.py writes it): the exported embedding has 262144 rows. The base
    # model's text config is at Gemma3TextConfig's default, 262208: its rows from
    # image_token_index (262144) on are image tokens, which a text-only fine-tune never reads.
    "vocab_size": (262_144, 262_208, "MaxText trains gemma3-4b's text vocabulary only"),
}

# MaxText arguments that change the architecture on purpose (override_model_config, as the toy
# and the rehearsal kit do: include/rehearsal/make_toy_inputs.py TEXT_DIMS) -> the text config
# field the export then holds (MaxText's to_huggingface _validate_or_update_architecture).
MAXTEXT_DIM_FIELDS = {
    "base_emb_dim": "hidden_size",
    "base_mlp_dim": "intermediate_size",
    "base_num_query_heads": "num_attention_heads",
    "base_num_kv_heads": "num_key_value_heads",
    "head_dim": "head_dim",
    "base_num_decoder_layers": "num_hidden_layers",
    "vocab_size": "vocab_size",
}


# What export_to_hf.sh publishes a text-only Gemma 3 fine-tune as (include/vm/text_only_export.py):
# MaxText 0.2.2 exports it as Gemma3ForConditionalGeneration without the vision tower's tensors.
TEXT_ONLY_ARCHITECTURE = "Gemma3ForCausalLM"


def published_architecture(config: Mapping[str, Any]) -> str | None:
    """The model class config.json names (its first `architectures`), None when it names none."""
    architectures = config.get("architectures")
    return str(architectures[0]) if isinstance(architectures, list) and architectures else None


class ExportConfigError(ValueError):
    """The export's config.json describes another model than the base model: the message names
    each field, the export's value and the base model's."""


def text_config(config: Mapping[str, Any]) -> dict[str, Any]:
    """The language model's part: text_config of a Gemma3ForConditionalGeneration config, else
    the config itself (a text-only one)."""
    text = config.get("text_config")
    return text if isinstance(text, dict) else config  # type: ignore[return-value]


def _rope(text: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    parameters = text.get("rope_parameters")
    if isinstance(parameters, dict) and ("full_attention" in parameters or "sliding_attention" in parameters):
        full = dict(parameters.get("full_attention") or {})
        sliding = dict(parameters.get("sliding_attention") or {})
    else:
        full = dict(text.get("rope_scaling") or {})
        full["rope_theta"] = text.get("rope_theta", ARCHITECTURE_DEFAULTS["rope_theta"])
        sliding = {"rope_theta": text.get("rope_local_base_freq", ARCHITECTURE_DEFAULTS["rope_local_base_freq"])}
    for layer, theta in ((full, "rope_theta"), (sliding, "rope_local_base_freq")):
        if "type" in layer:  # rope_scaling's older spelling
            layer.setdefault("rope_type", layer.pop("type"))
        layer.setdefault("rope_type", "default")
        layer.setdefault("rope_theta", ARCHITECTURE_DEFAULTS[theta])
    return {"full": full, "sliding": sliding}


def architecture(config: Mapping[str, Any]) -> dict[str, Any]:
    """The fields of ARCHITECTURE_DEFAULTS as the config sets them, defaults filled in, rope and
    layer types in one form whatever transformers version wrote the file."""
    text = text_config(config)
    found = {field: text.get(field, default) for field, default in ARCHITECTURE_DEFAULTS.items()}
    rope = _rope(text)
    found["rope_theta"] = float(rope["full"].pop("rope_theta"))
    found["rope_scaling"] = rope["full"]
    found["rope_local_base_freq"] = float(rope["sliding"].pop("rope_theta"))
    found["rope_local_scaling"] = rope["sliding"]
    if not text.get("layer_types"):
        pattern = text.get("sliding_window_pattern") or text.get("_sliding_window_pattern") or SLIDING_WINDOW_PATTERN
        found["layer_types"] = [
            "full_attention" if (i + 1) % pattern == 0 else "sliding_attention"
            for i in range(found["num_hidden_layers"])
        ]
    return found


def requested_architecture(export_args: Sequence[str]) -> dict[str, Any]:
    """The text config fields the export's MaxText arguments set on purpose (key=value)."""
    requested: dict[str, Any] = {}
    for arg in export_args:
        key, _, value = arg.lstrip("-").partition("=")
        if key in MAXTEXT_DIM_FIELDS:
            requested[MAXTEXT_DIM_FIELDS[key]] = int(value)
    if "head_dim" in requested:
        # Gemma 3 scales queries by head_dim ** -0.5: the toy's config sets the scalar with head_dim.
        requested["query_pre_attn_scalar"] = requested["head_dim"]
    return requested


def _set(text: dict[str, Any], field: str, value: Any) -> None:
    """Write one field where the file keeps it (rope_theta in rope_parameters for transformers 5)."""
    parameters = text.get("rope_parameters")
    if field == "rope_theta" and isinstance(parameters, dict) and "full_attention" in parameters:
        parameters["full_attention"]["rope_theta"] = value
    else:
        text[field] = value


def check_export_config(
    export: Mapping[str, Any], base: Mapping[str, Any], requested: Mapping[str, Any]
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The export's config, corrected, and its corrections [{field, was, now, source}], when it
    describes the base model with the `requested` changes (field -> value); else ExportConfigError.

    Each architecture field of the export equals the run's requested value, or the base model's,
    or is a KNOWN_WRONG value where the base model has the right one (then corrected)."""
    exported, original = architecture(export), architecture(base)
    corrected = copy.deepcopy(dict(export))
    corrections, unknown = [], []
    for field, value in exported.items():
        if field in requested:
            expected, whose = requested[field], "the run's MaxText arguments"
        else:
            expected, whose = original[field], "the base model's"
        if field == "layer_types" and "num_hidden_layers" in requested:
            continue  # another layer count: the pattern is what num_hidden_layers' check leaves
        if value == expected or KNOWN_DIFFERENT.get(field, (None, None))[:2] == (value, expected):
            continue
        wrong, right, source = KNOWN_WRONG.get(field, (object(), None, ""))
        if value == wrong and expected == right:
            _set(text_config(corrected), field, right)
            corrections.append({"field": field, "was": value, "now": right, "source": source})
        else:
            unknown.append(f"{field}: the export has {value!r}, {whose} {expected!r}")
    if unknown:
        raise ExportConfigError("; ".join(unknown))
    return corrected, corrections
