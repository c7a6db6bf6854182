"""Shared machinery of the MaxText stand-in: config keys, logging, faults, fake checkpoints.

Faults
------
Read once at start from the JSON file named by env MAXTEXT_STANDIN_FAULTS if
that variable is set, else from /run/localcloud/maxtext-faults.json (the VM
emulator bind-mounts a folder the tests control there). A missing file means
no faults; a malformed one makes every command fail, so a typo cannot pass
silently. All keys are optional:

    {
      "seconds_per_step": 0.02,              # time one training step takes
      "heartbeat_timeout_seconds": 100,      # on a multi-host slice: JAX's heartbeat timeout
      "shutdown_timeout_seconds": 300,       #    and shutdown barrier timeout (their defaults)
      "train_sft": {"crash_at_step": 7},     # or "segfault_at_step" / "stall_at_step" /
                                             #    "out_of_data_at_step" /
                                             #    "partial_checkpoint_at_step" /
                                             #    "partial_checkpoint_exit_at_step" /
                                             #    "loss_nan_from_step" /
                                             #    "eval_loss_rises" (true) /
                                             #    "kill_host_at_step" ({"host": 2, "step": 3})
      "to_maxtext": {"fail": "message"},
      "to_huggingface": {"fail": "message"},  # or "config_text_fields": {FIELD: VALUE}: the
                                             #    export's config.json text_config gets these
                                             #    values (a config MaxText got wrong in a way
                                             #    nobody knows yet)
    }

Not a fault: "to_huggingface": {"max_shard_size": BYTES} sets the export's shard threshold
(see checkpoint_conversion/to_huggingface.py). By default the stand-in's export is sharded, like
MaxText's export of Gemma 3 4B; a threshold above its few bytes of weights gives one
model.safetensors, like a small model's.

For a train_sft fault at step k (only steps this run actually trains count):
  crash_at_step       the step fails after the log line of step k-1 is written:
                      a Python traceback, exit 1, no checkpoint k.
  segfault_at_step    at the same point the process dies of SIGSEGV (a crash in native
                      code, as JAX or a data loader can): no Python exception, exit 139.
  stall_at_step       at the same point the process stops logging and sleeps
                      forever (a hung TPU job).
  out_of_data_at_step the batch for step k is missing: MaxText's "You may have
                      run out of training data" line, then a normal finish with
                      exit 0 at step k-1 (its final checkpoint is k-1).
  partial_checkpoint_at_step
                      step k trains, then its checkpoint is saved only halfway:
                      every file but what completes it (on gs:// the step's
                      commit_success.txt; on a local disk the rename of the
                      temporary directory), and the process stalls as above.
                      A resumed run must not take step k as complete.
  partial_checkpoint_exit_at_step
                      the same half-saved step k, but the process then exits 0
                      (a save that failed without an error reaching the loop).
  loss_nan_from_step  the loss of step k and later is logged as nan (a diverged
                      run); training otherwise finishes normally.
  eval_loss_rises     the held-out eval loss grows with the steps (a fine-tune
                      that makes the model worse); training otherwise finishes normally.
  kill_host_at_step   {"host": H, "step": k}: on a multi-host slice (see maxtext/_distributed.py),
                      the process of host H (its TPU_WORKER_ID, its JAX process id) is
                      SIGKILLed once step k has trained, before it saves step k (a host
                      lost mid-training); the other hosts go on until they need it, and
                      terminate as JAX does when a task stops sending heartbeats (or, for
                      host 0, when the coordination service is gone). A step k checkpoint then
                      has the other hosts' parts but no commit. On a single VM, host 0 is the
                      only process.
The other faults hit every host of a slice alike (each host reads the same fault file).
A converter "fail" raises RuntimeError(message): a traceback and exit 1.
Any of the three may carry "barrier": NAME (see hold_at_barrier): the command
waits at its start, with the Hugging Face token in its environment, until a test
lets it go on.

Logging
-------
Lines go to stderr in absl's format, like MaxText's, e.g.
    I1129 23:29:01.123456  4242 metric_logger.py:196] completed step: 3, seconds: 0.020, ...
The file:line shown is where the real line comes from in MaxText/Tunix.
"""

import datetime
import hashlib
import json
import math
import os
import re
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

from maxtext import _gcs as gcs

FAULTS_ENV = "MAXTEXT_STANDIN_FAULTS"
DEFAULT_FAULTS_PATH = "/run/localcloud/maxtext-faults.json"
DEFAULT_SECONDS_PER_STEP = 0.02
TOKEN_HASH_FILE = ".standin-hf-token.sha256"
ORBAX_TMP_SUFFIX = ".orbax-checkpoint-tmp"


# ---------------------------------------------------------------- logging

def log(message, where="max_logging.py:23", level="I"):
    """Write one absl-formatted log line to stderr."""
    now = datetime.datetime.now()
    sys.stderr.write(f"{level}{now:%m%d %H:%M:%S.%f} {threading.get_native_id():5d} {where}] {message}\n")
    sys.stderr.flush()


# ---------------------------------------------------------------- faults

_FAULT_KEYS = {
    "train_sft": {
        "crash_at_step",
        "segfault_at_step",
        "stall_at_step",
        "out_of_data_at_step",
        "partial_checkpoint_at_step",
        "partial_checkpoint_exit_at_step",
        "loss_nan_from_step",
        "eval_loss_rises",
        "kill_host_at_step",
        "barrier",
    },
    "to_maxtext": {"fail", "barrier"},
    "to_huggingface": {"fail", "barrier", "max_shard_size", "config_text_fields"},
}


def load_faults():
    """Return the validated fault settings (an empty-ish dict when there is no fault file)."""
    path = os.environ.get(FAULTS_ENV) or DEFAULT_FAULTS_PATH
    try:
        text = Path(path).read_text()
    except FileNotFoundError:
        return {"seconds_per_step": DEFAULT_SECONDS_PER_STEP}
    try:
        faults = json.loads(text)
        if not isinstance(faults, dict):
            raise ValueError("the top level must be an object")
        for key, value in faults.items():
            if key == "seconds_per_step":
                if not isinstance(value, (int, float)) or isinstance(value, bool) or value < 0:
                    raise ValueError("seconds_per_step must be a number >= 0")
            elif key in ("heartbeat_timeout_seconds", "shutdown_timeout_seconds"):
                if not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0:
                    raise ValueError(f"{key} must be a number > 0")
            elif key in _FAULT_KEYS:
                if not isinstance(value, dict) or not set(value) <= _FAULT_KEYS[key]:
                    raise ValueError(f"{key} takes an object with keys among {sorted(_FAULT_KEYS[key])}")
                for name, arg in value.items():
                    if name == "barrier":
                        ok = isinstance(arg, str) and re.fullmatch(r"[A-Za-z0-9._-]+", arg) is not None
                    elif name == "config_text_fields":
                        ok = isinstance(arg, dict) and all(isinstance(k, str) for k in arg)
                    elif name == "eval_loss_rises":
                        ok = arg is True
                    elif name == "kill_host_at_step":
                        ok = (isinstance(arg, dict) and set(arg) == {"host", "step"} and type(arg["host"]) is int
                              and arg["host"] >= 0 and type(arg["step"]) is int and arg["step"] >= 1)
                    else:
                        ok = isinstance(arg, str) if name == "fail" else (type(arg) is int and arg >= 1)
                    if not ok:
                        raise ValueError(f"{key}.{name} has a bad value: {arg!r}")
            else:
                raise ValueError(f"unknown key {key!r}")
    except ValueError as err:  # json.JSONDecodeError is a ValueError too
        raise SystemExit(f"MaxText stand-in: bad fault file {path}: {err}") from None
    faults.setdefault("seconds_per_step", DEFAULT_SECONDS_PER_STEP)
    return faults


def hold_at_barrier(fault):
    """The fault key "barrier": NAME holds the command at its start, its secrets in hand, so a test
    can look at the VM without racing it: it writes /dev/shm/.standin-at-barrier-NAME, then waits
    while /run/localcloud/NAME exists (the test removes that file to let it go on)."""
    name = fault.get("barrier")
    if not name:
        return
    Path("/dev/shm", f".standin-at-barrier-{name}").write_text(str(os.getpid()))
    gate = Path(DEFAULT_FAULTS_PATH).parent / name
    while gate.exists():
        time.sleep(0.05)  # polling interval: the gate file is checked again each time


def announce(command):
    log(f"MaxText stand-in (localcloud): {command} imitates MaxText 0.2.2; no model is loaded or trained.",
        where="_standin.py:1")


# ---------------------------------------------------------------- models

# The models the stand-in knows: Hugging Face id and the dimensions from
# MaxText's configs/models/<name>.yml. "default" is base.yml's own model.
HF_IDS = {
    "gemma2-2b": "google/gemma-2-2b",
    "gemma3-4b": "google/gemma-3-4b-it",
    "gemma3-12b": "google/gemma-3-12b-it",
    "gemma3-27b": "google/gemma-3-27b-it",
    "qwen3-0.6b": "Qwen/Qwen3-0.6B",
    "llama3.1-8b": "meta-llama/Llama-3.1-8B",
}
DIM_KEYS = ("base_num_decoder_layers", "base_emb_dim", "base_num_query_heads", "base_num_kv_heads",
            "base_mlp_dim", "head_dim", "vocab_size")
MODEL_DIMS = {
    "default": (16, 2048, 16, 16, 7168, 128, 32000),
    "gemma2-2b": (13, 2304, 8, 4, 9216, 256, 256128),
    "gemma3-4b": (34, 2560, 8, 4, 10240, 256, 262144),
    "gemma3-12b": (48, 3840, 16, 8, 15360, 256, 262144),
    "gemma3-27b": (62, 5376, 32, 16, 21504, 128, 262144),
    "qwen3-0.6b": (28, 1024, 16, 8, 3072, 128, 151936),
    "llama3.1-8b": (32, 4096, 32, 8, 14336, 128, 128256),
}


# ---------------------------------------------------------------- config keys

# The curated subset of MaxText 0.2.2 config keys (configs/types.py, base.yml)
# the stand-in accepts, with their base.yml defaults. Kinds follow the
# pydantic field types: "str?" allows None; a tuple lists the allowed values.
DTYPES = ("bfloat16", "float32", "float16")
KEYS = {
    # run and checkpointing
    "run_name": ("str", ""),
    "model_name": (tuple(MODEL_DIMS), "default"),
    "override_model_config": ("bool", False),
    "log_config": ("bool", True),
    "base_output_directory": ("str", ""),
    "load_parameters_path": ("str", ""),
    "load_full_state_path": ("str", ""),
    "enable_checkpointing": ("bool", True),
    "async_checkpointing": ("bool", True),
    "checkpoint_period": ("int", 10_000),
    "checkpoint_storage_use_ocdbt": ("bool", True),
    "checkpoint_storage_use_zarr3": ("bool", True),
    "checkpoint_storage_concurrent_gb": ("int", 96),
    "hf_access_token": ("str?", None),
    # hardware and model
    "hardware": (("tpu", "gpu", "gpu_multiprocess", "cpu"), "tpu"),
    "skip_jax_distributed_system": ("bool", False),
    "jax_distributed_initialization_timeout": ("int", 300),
    "scan_layers": ("bool", True),
    "param_scan_axis": ("int", 1),
    "use_multimodal": ("bool", False),
    "dtype": (DTYPES, "bfloat16"),
    "weight_dtype": (DTYPES, "float32"),
    "attention": ("str", "autoselected"),
    "remat_policy": ("str", "full"),
    **{name: ("int", value) for name, value in zip(DIM_KEYS, MODEL_DIMS["default"])},
    "ici_fsdp_parallelism": ("int", -1),
    "ici_data_parallelism": ("int", 1),
    "ici_tensor_parallelism": ("int", 1),
    "dcn_data_parallelism": ("int", -1),
    # training
    "per_device_batch_size": ("number", 12.0),
    "max_target_length": ("int", 2048),
    "max_prefill_predict_length": ("int", 64),
    "steps": ("int", 150_001),
    "learning_rate": ("float", 3.0e-5),
    "learning_rate_schedule_steps": ("int", -1),
    "warmup_steps_fraction": ("float", 0.1),
    "learning_rate_final_fraction": ("float", 0.1),
    "gradient_accumulation_steps": ("int", 1),
    "gradient_clipping_threshold": ("float", 1.0),
    "opt_type": (("adamw", "adam_pax", "sgd", "muon"), "adamw"),
    "adam_b1": ("float", 0.9),
    "adam_b2": ("float", 0.95),
    "adam_eps": ("float", 1.0e-8),
    "adam_weight_decay": ("float", 0.1),
    "enable_dropout": ("bool", True),
    "abort_on_nan_loss": ("bool", True),
    "abort_on_inf_loss": ("bool", True),
    # data
    "dataset_type": (("synthetic", "hf", "grain", "tfds", "c4_mlperf", "olmo_grain"), "tfds"),
    "hf_path": ("str", ""),
    "hf_name": ("str?", None),
    "hf_data_dir": ("str?", None),
    "hf_train_files": ("str?", None),
    "hf_eval_files": ("str?", None),
    "hf_eval_split": ("str?", None),
    "train_split": ("str", "train"),
    "train_data_columns": ("list", ["text"]),
    "eval_data_columns": ("list", ["text"]),
    "tokenizer_path": ("str?", None),
    "tokenizer_type": (("sentencepiece", "huggingface", "tiktoken"), "sentencepiece"),
    "use_chat_template": ("bool", False),
    "chat_template_path": ("str", ""),
    "packing": ("bool", True),
    "use_sft": ("bool", False),
    "sft_train_on_completion_only": ("bool", False),
    "num_epoch": ("int", 1),
    "data_shuffle_seed": ("int", 0),
    "enable_data_shuffling": ("bool", True),
    "reuse_example_batch": ("int", 0),
    # evaluation
    "eval_interval": ("int", -1),
    "eval_steps": ("int", -1),
    "target_eval_loss": ("float", 0.0),
    # profiling and metrics
    "profiler": (("", "xplane", "nsys"), ""),
    "skip_first_n_steps_for_profiler": ("int", 1),
    "profiler_steps": ("int", 5),
    "hide_profiler_step_metric": ("bool", False),
    "upload_all_profiler_results": ("bool", False),
    "enable_tensorboard": ("bool", True),
    "log_period": ("int", 100),
    "metrics_file": ("str?", None),
    "enable_goodput_recording": ("bool", False),
    "monitor_goodput": ("bool", False),
    "jax_cache_dir": ("str?", "~/jax_cache"),
}

# What configs/post_train/sft.yml changes on top of base.yml; train_sft uses it by default.
SFT_YML = {
    "use_sft": True,
    "sft_train_on_completion_only": True,
    "packing": True,
    "learning_rate": 2.0e-5,
    "dataset_type": "hf",
    "hf_path": "HuggingFaceH4/ultrachat_200k",
    "train_split": "train_sft",
    "hf_eval_split": "test_sft",
    "train_data_columns": ["messages"],
    "eval_data_columns": ["messages"],
}

# Lower bounds from the pydantic field constraints.
_MINIMUM = {"steps": -1, "learning_rate": 0, "gradient_accumulation_steps": 1, "gradient_clipping_threshold": 0,
            "warmup_steps_fraction": 0}

# MaxText turns "" into None for these keys (pyconfig._prepare_for_pydantic).
_EMPTY_IS_NONE = {"hf_train_files", "hf_eval_files", "hf_access_token", "hf_name", "hf_data_dir", "hf_eval_split",
                  "tokenizer_path"}


class ValidationError(ValueError):
    """Stands in for pydantic's ValidationError on MaxTextConfig."""


def _split_flow_list(text):
    """Split the inside of a YAML flow list on top-level commas."""
    parts, depth, quote, current = [], 0, None, ""
    for char in text:
        if quote:
            quote = None if char == quote else quote
        elif char in "'\"":
            quote = char
        elif char == "[":
            depth += 1
        elif char == "]":
            depth -= 1
        elif char == "," and depth == 0:
            parts.append(current)
            current = ""
            continue
        current += char
    if current.strip():
        parts.append(current)
    return parts


def parse_value(text):
    """Parse a command-line value the way OmegaConf's YAML loader does (the common cases)."""
    t = text.strip()
    if len(t) >= 2 and t[0] in "'\"" and t[-1] == t[0]:
        return t[1:-1]
    if t.startswith("[") and t.endswith("]"):
        return [parse_value(part) for part in _split_flow_list(t[1:-1])]
    if t in ("null", "Null", "NULL", "~"):
        return None
    if t in ("true", "True", "TRUE"):
        return True
    if t in ("false", "False", "FALSE"):
        return False
    if re.fullmatch(r"[-+]?[0-9][0-9_]*", t):
        return int(t.replace("_", ""))
    if re.fullmatch(r"[-+]?([0-9][0-9_]*\.?[0-9]*|\.[0-9]+)([eE][-+]?[0-9]+)?", t) and re.search(r"[.eE]", t):
        return float(t.replace("_", ""))
    return text


def _invalid(key, message, value):
    return ValidationError(f"1 validation error for MaxTextConfig\n{key}\n  {message} "
                           f"[input_value={value!r}, input_type={type(value).__name__}]")


def _coerce(key, kind, value):
    """Convert a parsed value to the key's type with pydantic's lax rules, or raise ValidationError."""
    if isinstance(value, str) and value.lower() == "none":
        value = None
    if value is None:
        if kind == "str?":
            return None
        if key == "run_name":
            return ""
        raise _invalid(key, "Input should not be None", value)
    if isinstance(kind, tuple):
        if value in kind and isinstance(value, str):
            return value
        allowed = ", ".join(repr(choice) for choice in kind)
        raise _invalid(key, f"Input should be one of {allowed}", value)
    if kind == "bool":
        if isinstance(value, bool):
            return value
        if isinstance(value, (int, float)) and value in (0, 1):
            return bool(value)
        if isinstance(value, str) and value.lower() in ("1", "on", "t", "true", "y", "yes", "0", "off", "f",
                                                        "false", "n", "no"):
            return value.lower() in ("1", "on", "t", "true", "y", "yes")
        raise _invalid(key, "Input should be a valid boolean", value)
    if kind in ("int", "float", "number"):
        number = value
        if isinstance(value, str):
            number = parse_value(value)
        if isinstance(number, bool) or not isinstance(number, (int, float)):
            raise _invalid(key, f"Input should be a valid {'integer' if kind == 'int' else 'number'}", value)
        if kind == "int":
            if number != int(number):
                raise _invalid(key, "Input should be a valid integer, got a number with a fractional part", value)
            number = int(number)
        elif kind == "float":
            number = float(number)
        if key in _MINIMUM and number < _MINIMUM[key]:
            raise _invalid(key, f"Input should be greater than or equal to {_MINIMUM[key]}", value)
        return number
    if kind in ("str", "str?"):
        if not isinstance(value, str):
            raise _invalid(key, "Input should be a valid string", value)
        return value
    if kind == "list":
        if not isinstance(value, list) or not all(isinstance(item, str) for item in value):
            raise _invalid(key, "Input should be a valid list of strings", value)
        return value
    raise AssertionError(f"unknown kind {kind!r}")


def parse_config(args, defaults=None):
    """Build the config from key=value arguments like maxtext.configs.pyconfig.initialize.

    `defaults` are the command's config file values on top of base.yml (train_sft uses
    sft.yml). A leading *.yml argument names the config file; the stand-in knows only
    base.yml and post_train/sft.yml.
    """
    args = list(args)
    if args and args[0].endswith(".yml"):
        name = args.pop(0)
        if os.path.basename(name) == "base.yml":
            defaults = None
        elif os.path.basename(name) == "sft.yml":
            defaults = SFT_YML
        else:
            raise ValueError(f"MaxText stand-in: config file {name!r} is not supported (only base.yml, sft.yml)")

    overrides = {}
    for arg in args:
        key, sep, text = arg.partition("=")
        if not sep:
            raise ValueError(f"Invalid command-line argument {arg!r}: expected key=value")
        overrides[key] = parse_value(text)
    for key in overrides:
        if key not in KEYS:
            # MaxText logs this warning, then fails listing every valid field.
            log(f"Ignoring invalid/unsupported field from YAML/CLI: {key!r}", where="pyconfig.py:207", level="W")
            raise ValueError(f"{key!r} not in {', '.join(map(repr, KEYS))}.")

    raw = {key: default for key, (_, default) in KEYS.items()}
    raw.update(defaults or {})
    model_name = overrides.get("model_name", raw["model_name"])
    if model_name in MODEL_DIMS and model_name != "default":
        model_values = dict(zip(DIM_KEYS, MODEL_DIMS[model_name]))
        if not overrides.get("override_model_config", raw["override_model_config"]):
            twice = [key for key in model_values if key in overrides]
            if twice:
                raise ValueError(f"Keys {twice} are overridden by both model config and CLI/kwargs."
                                 "This is not allowed, unless setting `override_model_config=True`.")
        raw.update(model_values)
    raw.update(overrides)

    # pyconfig fills these in when they are not given.
    if not raw["base_output_directory"]:
        log("base_output_directory is not provided; Using local directory called maxtext_output",
            where="pyconfig.py:110", level="W")
        raw["base_output_directory"] = os.path.abspath("maxtext_output")
    if not raw["hf_access_token"] and os.environ.get("HF_TOKEN"):
        raw["hf_access_token"] = os.environ["HF_TOKEN"]

    values = {}
    for key, (kind, _) in KEYS.items():
        value = raw[key]
        if key in _EMPTY_IS_NONE and value == "":
            value = None
        values[key] = _coerce(key, kind, value)

    config = SimpleNamespace(**values)
    if not config.run_name:
        config.run_name = f"{config.model_name}_{datetime.datetime.now():%Y-%m-%d-%H-%M}"
    if config.tokenizer_path is None:
        config.tokenizer_path = HF_IDS.get(config.model_name, "assets/tokenizers/tokenizer.llama2")
    if config.steps == -1:
        config.steps = config.learning_rate_schedule_steps
    if config.eval_interval > 0 and not config.hf_eval_split:
        raise ValueError("Please specify hf_eval_split or set eval_interval to <=0.")
    output_dir = os.path.join(config.base_output_directory, config.run_name)
    config.checkpoint_dir = os.path.join(output_dir, "checkpoints", "")
    config.tensorboard_dir = os.path.join(output_dir, "tensorboard", "")
    config.model_dims = {key: values[key] for key in DIM_KEYS}

    if config.log_config:
        for key in sorted(values):
            if key != "hf_access_token":  # MaxText never logs the token
                log(f"Config param {key}: {getattr(config, key)}", where="pyconfig.py:449")
    return config


# ---------------------------------------------------------------- absl-style flags

_ABSL_VALUE_FLAGS = {"verbosity", "v", "log_dir", "stderrthreshold", "minloglevel"}
_ABSL_BOOL_FLAGS = {"logtostderr", "alsologtostderr", "showprefixforinfo"}


def parse_absl_flags(argv, bool_flags=()):
    """Split argv[1:] into known --flags and the remaining key=value args, as absl's app.run does.

    Returns (flags, args). An unknown flag ends the program as absl does.
    """
    known_bool = set(bool_flags) | _ABSL_BOOL_FLAGS
    flags, args = {}, []
    rest = list(argv[1:])
    while rest:
        arg = rest.pop(0)
        if arg == "--":
            args.extend(rest)
            break
        if not arg.startswith("-") or arg == "-":
            args.append(arg)
            continue
        name, sep, value = arg.lstrip("-").partition("=")
        if name in known_bool:
            flags[name] = True if not sep else value.lower() in ("1", "true", "t", "yes", "y")
        elif name.startswith("no") and name[2:] in known_bool and not sep:
            flags[name[2:]] = False
        elif name in _ABSL_VALUE_FLAGS:
            flags[name] = value if sep else (rest.pop(0) if rest else "")
        else:
            sys.stderr.write(f"FATAL Flags parsing error: Unknown command line flag '{name}'\n"
                             "Pass --helpshort or --helpfull to see help on flags.\n")
            sys.exit(1)
    return flags, args


# ---------------------------------------------------------------- fake Orbax checkpoints

COMMIT_FILE = "commit_success.txt"


def _item_part_files(info, process, array_metadata):
    """{relative path: bytes} of one process's part of an item: its OCDBT sub-database
    (`ocdbt.process_<N>/`, tensorstore_utils.PROCESS_SUBDIR_PREFIX in Orbax 0.11.39) and, on a
    slice, its array metadata (`array_metadatas/process_<N>`, array_metadata_store.PathResolver;
    the single-host layout has always been without it)."""
    files = {f"ocdbt.process_{process}/d/{_item_blob(info)}": b"maxtext-standin\n",
             f"ocdbt.process_{process}/manifest.ocdbt": b""}
    if array_metadata:
        files[f"array_metadatas/process_{process}"] = json.dumps({"array_metadatas": []}).encode()
    return files


def _item_blob(info):
    return hashlib.sha256(json.dumps(info, sort_keys=True).encode()).hexdigest()[:32]


def _pytree_item_files(info, use_zarr3, with_part=True):
    """{relative path: bytes} of an Orbax OCDBT PyTree item, with `info` in _METADATA for the
    stand-in; _METADATA comes last, as Orbax writes it after the array data. `with_part=False`
    leaves out process 0's part (on a slice each process writes its own: _item_part_files)."""
    metadata = {"tree_metadata": {}, "use_zarr3": use_zarr3, "store_array_data_equal_to_fill_value": True,
                "maxtext_standin": info}
    return {
        f"d/{_item_blob(info)}": b"maxtext-standin\n",
        **(_item_part_files(info, 0, array_metadata=False) if with_part else {}),
        "manifest.ocdbt": b"",
        "_sharding": b"{}",
        "_METADATA": json.dumps(metadata, indent=1).encode(),
    }


def _step_files(items, use_zarr3, with_part=True):
    files = {}
    for name, info in items.items():
        files.update({f"{name}/{rel}": data for rel, data in _pytree_item_files(info, use_zarr3, with_part).items()})
    now_ns = time.time_ns()
    files["_CHECKPOINT_METADATA"] = json.dumps({
        "item_handlers": {name: "orbax.checkpoint._src.handlers.pytree_checkpoint_handler.PyTreeCheckpointHandler"
                          for name in items},
        "metrics": {}, "performance_metrics": {}, "init_timestamp_nsecs": now_ns,
        "commit_timestamp_nsecs": now_ns, "custom_metadata": {}}).encode()
    return files


def _write_gcs_step(step_url, files, commit):
    """A step's files straight to gs:// (no renames there): each item gets its commit_success.txt
    after its _METADATA, and `commit` writes the step's commit_success.txt last."""
    for rel, data in files.items():
        gcs.write(gcs.join(step_url, rel), data)
        item, _, rest = rel.partition("/")
        if rest == "_METADATA":
            gcs.write(gcs.join(step_url, item, COMMIT_FILE), f"Checkpoint commit was successful to "
                                                             f"{gcs.join(step_url, item)}")
    if commit:
        gcs.write(gcs.join(step_url, COMMIT_FILE), f"Checkpoint commit was successful to {step_url}")


def _write_local_files(folder, files):
    for rel, data in files.items():
        (folder / rel).parent.mkdir(parents=True, exist_ok=True)
        (folder / rel).write_bytes(data)


def _temporary_step_dir(root, step):
    return Path(root) / f"{step}{ORBAX_TMP_SUFFIX}-{time.time_ns() // 1000}"


def save_step(root, step, items, use_zarr3=True, commit=True, runtime=None):
    """Save checkpoint `step` under `root` as Orbax does.

    On a local disk everything is written into `<step>.orbax-checkpoint-tmp-<ts>` first and
    the directory is then renamed to `<step>`, so a step directory never exists half written.
    On gs:// (no renames there) the files go straight to `<step>/`; each item gets its
    commit_success.txt after its files, and `<step>/commit_success.txt` comes last: a step
    without it is incomplete. `commit=False` stops before that point (the temporary
    directory is not renamed, or the marker is not written): a save cut short.
    With a `runtime` (a multi-host slice, maxtext/_distributed.py): save_step_on_slice.
    """
    if runtime is not None:
        save_step_on_slice(root, step, items, runtime, use_zarr3, commit)
        return
    files = _step_files(items, use_zarr3)
    if gcs.is_gcs(root):
        _write_gcs_step(gcs.join(root, str(step)), files, commit)
        return
    tmp = _temporary_step_dir(root, step)
    _write_local_files(tmp, files)
    if commit:
        os.rename(tmp, Path(root) / str(step))


def save_step_on_slice(root, step, items, runtime, use_zarr3=True, commit=True):
    """Orbax's save on a multi-host slice, every process calling it: each writes its own part of
    every item (_item_part_files); once every part is written (a barrier: Orbax merges and commits
    only after all processes' writes, base_pytree_checkpoint_handler._finalize_async after its
    sync), process 0 alone writes what the processes share (the merged OCDBT manifest, as
    ocdbt_utils.merge_ocdbt_per_process_files, _sharding, _METADATA, _CHECKPOINT_METADATA) and
    commits the step: on gs:// its commit_success.txt last; on a local disk the rename of the
    temporary directory it made for all of them (atomicity.create_all: the primary host creates
    it between two syncs). A process lost before its part is written leaves a step that is never
    committed."""
    me = runtime.process_id
    part = {f"{name}/{rel}": data for name, info in items.items()
            for rel, data in _item_part_files(info, me, array_metadata=True).items()}
    shared = _step_files(items, use_zarr3, with_part=False)
    if gcs.is_gcs(root):
        step_url = gcs.join(root, str(step))
        for rel, data in part.items():
            gcs.write(gcs.join(step_url, rel), data)
        runtime.barrier(f"checkpoint {step}: every part written")
        if me == 0:
            _write_gcs_step(step_url, shared, commit)
        return
    tmp_name = None
    if me == 0:
        tmp = _temporary_step_dir(root, step)
        tmp.mkdir(parents=True)
        tmp_name = tmp.name
    tmp = Path(root) / runtime.barrier(f"checkpoint {step}: temporary directory", tmp_name)
    _write_local_files(tmp, part)
    runtime.barrier(f"checkpoint {step}: every part written")
    if me == 0:
        _write_local_files(tmp, shared)
        if commit:
            os.rename(tmp, Path(root) / str(step))


def latest_step(root):
    """The highest complete step under `root`, or None. Temporary directories are not steps,
    nor on gs:// a step without commit_success.txt."""
    if gcs.is_gcs(root):
        steps = [int(name) for name in gcs.list_dirs(root) if name.isdigit()]
        return next((step for step in sorted(steps, reverse=True)
                     if gcs.exists(gcs.join(root, str(step), COMMIT_FILE))), None)
    root = Path(root)
    if not root.is_dir():
        return None
    steps = [int(entry.name) for entry in root.iterdir() if entry.name.isdigit() and entry.is_dir()]
    return max(steps, default=None)


def write_file(path, data):
    """Write a whole file, on a local disk or gs://."""
    if gcs.is_gcs(path):
        gcs.write(path, data)
        return
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_bytes(data if isinstance(data, bytes) else data.encode())


def read_params(path, config):
    """Check that `path` holds a complete parameter checkpoint for this config; return its stand-in info.

    Fails the way MaxText does when Orbax finds no checkpoint there, and with a
    shape-mismatch error when the checkpoint was made for other model dimensions.
    """
    if gcs.is_gcs(path):
        metadata = gcs.read(gcs.join(path, "_METADATA"))
    else:
        item = Path(path) / "_METADATA"
        metadata = item.read_bytes() if ORBAX_TMP_SUFFIX not in str(item) and item.is_file() else None
    if metadata is None:
        log(f"ERROR: No valid Orbax checkpoint found at '{path}'. Please check your load_parameters_path, the "
            "path may be missing, empty, or point to a parent directory rather than the checkpoint step directory ",
            where="model_creation_utils.py:804")
        raise ValueError(f"No valid Orbax checkpoint found at '{path}'. Please check your load_parameters_path.")
    info = json.loads(metadata).get("maxtext_standin", {})
    wanted = {"model_name": config.model_name, "scan_layers": config.scan_layers, **config.model_dims}
    for key, value in wanted.items():
        if key in info and info[key] != value:
            raise ValueError(f"Shape mismatch restoring '{path}': the checkpoint has {key}={info[key]!r}, "
                             f"the config has {key}={value!r}.")
    return info


def params_info(config, **extra):
    """What the stand-in records about a parameter checkpoint (checked again on load)."""
    return {"model_name": config.model_name, "scan_layers": config.scan_layers, **config.model_dims, **extra}


# ---------------------------------------------------------------- misc

def record_hf_token(config, output_directory):
    """Return the Hugging Face token, writing its sha256 (never the token) next to the output."""
    token = config.hf_access_token
    if token:
        write_file(os.path.join(output_directory, TOKEN_HASH_FILE), hashlib.sha256(token.encode()).hexdigest() + "\n")
    return token


def gated_repo_error(repo_id):
    return OSError(
        f"You are trying to access a gated repo.\nMake sure to have access to it at https://huggingface.co/{repo_id}.\n"
        f"401 Client Error. (Request ID: standin)\n\nCannot access gated repo for url "
        f"https://huggingface.co/{repo_id}/resolve/main/config.json.\nAccess to model {repo_id} is restricted. "
        "You must have access to it and be authenticated to access it. Please log in.")


def approx_params(dims):
    """Rough parameter count of a decoder-only transformer (for the TFLOP/s figure)."""
    d = dims
    attention = d["base_emb_dim"] * d["head_dim"] * (2 * d["base_num_query_heads"] + 2 * d["base_num_kv_heads"])
    mlp = 3 * d["base_emb_dim"] * d["base_mlp_dim"]
    return d["base_num_decoder_layers"] * (attention + mlp) + d["vocab_size"] * d["base_emb_dim"]


def fake_loss(step, seed):
    """A smoothly falling loss with a little deterministic jitter."""
    jitter = int(hashlib.sha256(f"{seed}/{step}".encode()).hexdigest()[:8], 16) / 0xFFFFFFFF - 0.5
    return 0.9 + 1.6 * math.exp(-step / 300) + 0.05 * jitter
