"""Stand-in for `python3 -m maxtext.checkpoint_conversion.to_huggingface` (see maxtext/__init__.py).

Reads the stand-in checkpoint at load_parameters_path (a complete step's
model_params, in a local folder or on gs://) and writes small fake Hugging Face
files to BASE_OUTPUT_DIRECTORY (a local folder, as in MaxText): config.json, the
weights, tokenizer.json, tokenizer_config.json and chat_template.jinja. Like MaxText it
refuses model dimensions that differ from the Hugging Face model's unless
--override_model_architecture is given.

The weights are a few tiny BF16 tensors with MaxText's names (standin_tensors), laid out as
MaxText 0.2.2 lays out an export (checkpoint_conversion/utils/utils.py: shard_checkpoint,
save_weight_files): tensors in sorted order fill shards up to a size threshold, a tensor
above it getting a shard of its own; one shard is written as model.safetensors, several as
model-0000N-of-0000M.safetensors with model.safetensors.index.json ({"metadata":
{"total_size": N}, "weight_map": {tensor: shard}}). MaxText's threshold is 3 GiB, so Gemma 3
4B (about 8.6 GB) is always sharded; the stand-in's default threshold shards its weights the
same way (four shards), and the fault file's "to_huggingface": {"max_shard_size": BYTES}
changes it. Every file's safetensors metadata names the source checkpoint.
"""

import json
import math
import struct
import sys
import time
from pathlib import Path

from maxtext import _standin as s

# The stand-in's chat template, in the Gemma turn format.
CHAT_TEMPLATE = """{{ bos_token }}{% for message in messages %}{% set role = 'model' if message['role'] == 'assistant' \
else message['role'] %}<start_of_turn>{{ role }}
{{ message['content'] | trim }}<end_of_turn>
{% endfor %}{% if add_generation_prompt %}<start_of_turn>model
{% endif %}"""

SPECIAL_TOKENS = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"]


def standin_tensors(model_name):
    """The stand-in's weights: name -> shape, BF16 (2 bytes an element), zeros. Named as MaxText
    0.2.2 names the language model's tensors: for Gemma 3, model.language_model.* whatever
    use_multimodal says (checkpoint_conversion/utils/param_mapping.py,
    GEMMA3_MAXTEXT_TO_HF_PARAM_MAPPING), for the other models model.*."""
    prefix = "model.language_model." if model_name.startswith("gemma3") else "model."
    return {
        f"{prefix}embed_tokens.weight": [8, 4],
        **{f"{prefix}layers.{i}.self_attn.q_proj.weight": [4, 4] for i in range(4)},
        f"{prefix}norm.weight": [4],
    }


BF16_BYTES = 2
# The embedding alone fills a shard, two layers each the next ones, the norm the last: 4 shards.
DEFAULT_MAX_SHARD_SIZE = 64
SINGLE_WEIGHTS_FILE = "model.safetensors"
WEIGHTS_INDEX_FILE = "model.safetensors.index.json"


def tensor_bytes(shape):
    return math.prod(shape) * BF16_BYTES


def write_safetensors(path, tensors, metadata):
    """A valid safetensors file holding `tensors` (name -> shape, BF16 zeros); `metadata` goes in its header."""
    header = {"__metadata__": {key: str(value) for key, value in metadata.items()}}
    offset = 0
    for name, shape in tensors.items():
        header[name] = {"dtype": "BF16", "shape": shape, "data_offsets": [offset, offset + tensor_bytes(shape)]}
        offset += tensor_bytes(shape)
    header_bytes = json.dumps(header).encode()
    header_bytes += b" " * (-len(header_bytes) % 8)  # the format pads the header to 8 bytes
    Path(path).write_bytes(struct.pack("<Q", len(header_bytes)) + header_bytes + bytes(offset))


def shard(tensors, max_shard_size):
    """[{name: shape}, ...]: tensors in sorted order, a new shard when the next would exceed the size."""
    shards = [{}]
    size = 0
    for name in sorted(tensors):
        nbytes = tensor_bytes(tensors[name])
        if shards[-1] and size + nbytes > max_shard_size:
            shards.append({})
            size = 0
        shards[-1][name] = tensors[name]
        size += nbytes
    return shards


def write_weights(out, tensors, max_shard_size, metadata):
    shards = shard(tensors, max_shard_size)
    if len(shards) == 1:
        write_safetensors(out / SINGLE_WEIGHTS_FILE, shards[0], metadata)
        return
    weight_map = {}
    for number, shard_tensors in enumerate(shards, 1):
        name = f"model-{number:05d}-of-{len(shards):05d}.safetensors"
        write_safetensors(out / name, shard_tensors, metadata)
        weight_map.update(dict.fromkeys(shard_tensors, name))
    total = sum(tensor_bytes(shape) for shape in tensors.values())
    (out / WEIGHTS_INDEX_FILE).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map},
                                                     indent=2))


def standin_config(config):
    """A made-up config.json for the models other than gemma3-4b (no loader reads it)."""
    dims = config.model_dims
    return {
        "architectures": ["MaxTextStandinForCausalLM"],
        "model_type": config.model_name.split("-")[0],
        "hidden_size": dims["base_emb_dim"], "intermediate_size": dims["base_mlp_dim"],
        "num_hidden_layers": dims["base_num_decoder_layers"], "num_attention_heads": dims["base_num_query_heads"],
        "num_key_value_heads": dims["base_num_kv_heads"], "head_dim": dims["head_dim"],
        "vocab_size": dims["vocab_size"], "torch_dtype": config.weight_dtype,
        "maxtext_standin": {"hf_id": s.HF_IDS[config.model_name], "source": config.load_parameters_path},
    }


def gemma3_4b_config(dims):
    """The config.json MaxText 0.2.2 writes for gemma3-4b: its
    maxtext/checkpoint_conversion/utils/hf_model_configs.py gemma3_4b_config, as transformers 5.8
    saves it (rope_parameters by layer type, layer_types spelled out), with the run's dimensions
    (--override_model_architecture). Its two known errors are kept: text hidden_activation "gelu"
    (AI-Hypercomputer/maxtext#2867) and rope_theta 10000.0 for the global layers too."""
    layers = dims["base_num_decoder_layers"]
    return {
        "architectures": ["Gemma3ForConditionalGeneration"],
        "boi_token_index": 255999, "eoi_token_index": 256000, "eos_token_id": [1, 106],
        "image_token_index": 262144, "initializer_range": 0.02, "mm_tokens_per_image": 256,
        "model_type": "gemma3", "dtype": "bfloat16", "transformers_version": "5.8.0",
        "text_config": {
            "attention_bias": False, "attention_dropout": 0.0, "attn_logit_softcapping": None,
            "cache_implementation": "hybrid", "final_logit_softcapping": None,
            "head_dim": dims["head_dim"], "hidden_activation": "gelu", "hidden_size": dims["base_emb_dim"],
            "initializer_range": 0.02, "intermediate_size": dims["base_mlp_dim"],
            "layer_types": ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(layers)],
            "max_position_embeddings": 163840, "model_type": "gemma3_text",
            "num_attention_heads": dims["base_num_query_heads"], "num_hidden_layers": layers,
            "num_key_value_heads": dims["base_num_kv_heads"],
            # The toy's configs keep query_pre_attn_scalar = head_dim (make_toy_inputs.py).
            "query_pre_attn_scalar": dims["head_dim"], "rms_norm_eps": 1e-06,
            "rope_parameters": {
                "full_attention": {"factor": 8.0, "rope_theta": 10000.0, "rope_type": "linear"},
                "sliding_attention": {"rope_theta": 10000.0, "rope_type": "default"},
            },
            "sliding_window": 1024, "sliding_window_pattern": 6, "use_cache": True,
            "vocab_size": dims["vocab_size"],
        },
        "vision_config": {
            "attention_dropout": 0.0, "hidden_act": "gelu_pytorch_tanh", "hidden_size": 1152, "image_size": 896,
            "intermediate_size": 4304, "layer_norm_eps": 1e-06, "model_type": "siglip_vision_model",
            "num_attention_heads": 16, "num_channels": 3, "num_hidden_layers": 27, "patch_size": 14,
            "vision_use_head": False,
        },
    }


def main(argv):
    flags, args = s.parse_absl_flags(argv, bool_flags=["override_model_architecture"])
    faults = s.load_faults()
    s.announce("to_huggingface")
    s.hold_at_barrier(faults.get("to_huggingface", {}))
    config = s.parse_config(args)
    if config.load_full_state_path != "":
        raise AssertionError("This script expects parameters, not a full state. "
                             "Use generate_param_only_checkpoint first if needed.")
    overall_start = time.time()

    s.log(f"\nLoading Orbax checkpoint from: {config.load_parameters_path}", "to_huggingface.py:265")
    if not config.load_parameters_path:
        raise ValueError("load_parameters_path is required")
    source = s.read_params(config.load_parameters_path, config)
    output_directory = config.base_output_directory

    if config.model_name not in s.HF_IDS:
        raise ValueError(f"Unsupported model name: {config.model_name}. Supported models are: {list(s.HF_IDS)}")
    stock = dict(zip(s.DIM_KEYS, s.MODEL_DIMS[config.model_name]))
    changed = {key: value for key, value in config.model_dims.items() if value != stock[key]}
    if changed and not flags.get("override_model_architecture"):
        raise ValueError(f"MaxText config does not match the Hugging Face config of {config.model_name}: {changed}. "
                         "Pass --override_model_architecture to use the MaxText values.")
    if "fail" in faults.get("to_huggingface", {}):
        raise RuntimeError(faults["to_huggingface"]["fail"])

    s.log("\nSaving HuggingFace model...", "to_huggingface.py:346")
    out = Path(output_directory)
    out.mkdir(parents=True, exist_ok=True)
    hf_config = (gemma3_4b_config(config.model_dims) if config.model_name == "gemma3-4b"
                 else standin_config(config))
    text = hf_config.get("text_config", hf_config)
    text.update(faults.get("to_huggingface", {}).get("config_text_fields", {}))
    (out / "config.json").write_text(json.dumps(hf_config, indent=2))
    write_weights(out, standin_tensors(config.model_name),
                  faults.get("to_huggingface", {}).get("max_shard_size", DEFAULT_MAX_SHARD_SIZE), {
        "format": "pt", "maxtext_standin": "true", "source": config.load_parameters_path,
        "step": source.get("step", 0), "run_name": source.get("run_name", "")})
    (out / "tokenizer.json").write_text(json.dumps({
        "version": "1.0", "truncation": None, "padding": None,
        "added_tokens": [{"id": i, "content": token, "single_word": False, "lstrip": False, "rstrip": False,
                          "normalized": False, "special": True} for i, token in enumerate(SPECIAL_TOKENS)],
        "normalizer": None, "pre_tokenizer": {"type": "Whitespace"}, "post_processor": None, "decoder": None,
        "model": {"type": "WordLevel", "vocab": {token: i for i, token in enumerate(SPECIAL_TOKENS)},
                  "unk_token": "<unk>"},
    }, indent=2))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<bos>", "eos_token": "<eos>",
        "pad_token": "<pad>", "unk_token": "<unk>", "add_bos_token": True, "add_eos_token": False,
        "model_max_length": config.max_target_length,
    }, indent=2))
    (out / "chat_template.jinja").write_text(CHAT_TEMPLATE)

    s.log(f"\u2705 MaxText model successfully saved in HuggingFace format at {output_directory}",
          "to_huggingface.py:355")
    s.log(f"Overall Elapse: {(time.time() - overall_start) / 60:.2f} min", "to_huggingface.py:357")


if __name__ == "__main__":
    main(sys.argv)
