"""Stand-in for `python3 -m maxtext.checkpoint_conversion.to_maxtext` (see maxtext/__init__.py).

Pretends to convert a Hugging Face checkpoint and writes a small fake Orbax
checkpoint at BASE_OUTPUT_DIRECTORY/0/items (a local folder or gs://). Like MaxText it reads the
converter's own --flags with argparse and hands everything else to the config
parser. Without --hf_model_path pointing at a local folder it needs a Hugging
Face token (hf_access_token=... or env HF_TOKEN), as the gated Gemma repos do;
the token's sha256 goes to BASE_OUTPUT_DIRECTORY/.standin-hf-token.sha256.
"""

import argparse
import os
import sys
import time

from maxtext import _standin as s


def str2bool(value):
    if value.lower() in ("true", "1", "yes", "y", "t"):
        return True
    if value.lower() in ("false", "0", "no", "n", "f"):
        return False
    raise argparse.ArgumentTypeError(f"Boolean value expected, got {value!r}")


def main(argv):
    parser = argparse.ArgumentParser()
    parser.add_argument("--lazy_load_tensors", type=str2bool, default=False)
    parser.add_argument("--eager_load_method", default="transformers", choices=["transformers", "safetensors"])
    parser.add_argument("--hf_model_path", default=None)
    parser.add_argument("--revision", default=None)
    parser.add_argument("--save_dtype", default="bfloat16", choices=["float32", "bfloat16"])
    parser.add_argument("--simulated_cpu_devices_count", type=int, default=16)
    flags, args = parser.parse_known_args(argv[1:])
    faults = s.load_faults()
    s.announce("to_maxtext")
    s.hold_at_barrier(faults.get("to_maxtext", {}))
    overall_start = time.time()

    model_name = next((s.parse_value(arg.split("=", 1)[1]) for arg in args if arg.startswith("model_name=")), None)
    if model_name is None:
        raise ValueError("model_name=... is required")
    if model_name not in s.HF_IDS:
        raise ValueError(f"Unsupported model name: {model_name}. Supported models are: {list(s.HF_IDS)}")

    config = s.parse_config(args)
    output_directory = config.base_output_directory
    model_id = flags.hf_model_path or s.HF_IDS[model_name]
    token = s.record_hf_token(config, output_directory)

    local_model = flags.hf_model_path is not None and os.path.isdir(flags.hf_model_path)
    if flags.hf_model_path and not local_model and flags.hf_model_path.startswith(("/", ".", "~")):
        raise OSError(f"{flags.hf_model_path} is not a local folder and is not a valid model identifier listed on "
                      "'https://huggingface.co/models'")
    if not local_model and not token:
        raise s.gated_repo_error(model_id)
    if flags.lazy_load_tensors and config.use_multimodal:
        raise ValueError("lazy loading of HF tensors is not supported for multimodal models yet.")
    if "fail" in faults.get("to_maxtext", {}):
        raise RuntimeError(faults["to_maxtext"]["fail"])

    if flags.lazy_load_tensors:
        s.log(f"Lazy loading ENABLED. Initializing LazyHFLoader for: {model_id}...", "to_maxtext.py:626")
    else:
        s.log(f"Lazy loading DISABLED. Loading full HuggingFace model: {model_id}...", "to_maxtext.py:632")
    s.log("Weight transformation preparation complete.", "to_maxtext.py:761")
    s.log("Starting checkpoint save" + (" (loading weights just-in-time)..." if flags.lazy_load_tensors else "..."),
          "to_maxtext.py:773")
    if flags.simulated_cpu_devices_count == 1:
        s.log("Single device: Skip sharding", "llama_or_mistral_ckpt.py:1745")

    # Orbax will not save step 0 again when the directory already has a step:
    # MaxText then finishes "successfully" and leaves the old checkpoint alone.
    if s.latest_step(output_directory) is None:
        info = s.params_info(config, source=model_id, save_dtype=flags.save_dtype)
        s.save_step(output_directory, 0, {"items": info}, use_zarr3=config.checkpoint_storage_use_zarr3)
        s.log("saved a checkpoint at step 0", "llama_or_mistral_ckpt.py:1772")
    s.log(f"Conversion complete. Checkpoint saved to {output_directory}", "to_maxtext.py:787")
    s.log(f"Overall Elapse: {(time.time() - overall_start) / 60:.2f} min", "to_maxtext.py:788")


if __name__ == "__main__":
    main(sys.argv)
