"""Makes the toy inputs of a rehearsal, all locally: nothing is downloaded.

Run with the MaxText venv's own python (torch, transformers and MaxText live there, never in the
project's venv):  python make_toy_inputs.py TOY_DIR  (TOY_DIR must not exist yet). Two users:
include/vm/prepare_rehearsal.sh makes a rehearsal VM's kit with it (WORK_DIR/rehearsal-kit, whose
extra MaxText args are toy_args.json beside this file), and the local cloud's image builder
(localcloud/images.py) the real image's toy/.

TOY_DIR gets:
  model/       a gemma3-4b-shaped Hugging Face checkpoint (Gemma3ForConditionalGeneration): 34
               layers, because MaxText's converters hard-code gemma3-4b's layer count, and tiny
               widths; random weights from a fixed seed. (No tokenizer: to_maxtext reads none.)
  tokenizer/   the sentencepiece tokenizer shipped in the maxtext wheel, in Hugging Face format,
               with a Gemma-style chat template (SFT needs one).
  hf_home/hub/ a Hugging Face hub cache in which `google/gemma-3-4b-it` (MaxText's id for
               gemma3-4b: to_maxtext's default checkpoint, train_sft's default tokenizer_path,
               to_huggingface's tokenizer) resolves offline to the toy model and tokenizer.
  datasets/ultrachat_200k/   chats in UltraChat 200k's layout (data/{split}-00000-of-00001.parquet,
                             column `messages`), enough that packing never runs out in the toy runs.
  datasets/ultrachat_small/  the same layout, deliberately too small: SFT stops early.
  toy.json     the toy's sizes, dataset folders (relative to TOY_DIR) and the extra MaxText args
               each pipeline command needs with these inputs.
"""

import hashlib
import json
import os
import random
import shutil
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import torch
import transformers

import maxtext
from maxtext.checkpoint_conversion.utils.hf_model_configs import HF_MODEL_CONFIGS

MODEL_NAME = "gemma3-4b"
HUB_ID = "google/gemma-3-4b-it"  # maxtext.utils.globals.HF_IDS["gemma3-4b"]
SEED = 20261129

# MaxText names (the extra args' keys) -> Hugging Face text_config names. The layer count and
# vocabulary stay gemma3-4b's: the converters and the tokenizer depend on them.
TEXT_DIMS = {"base_emb_dim": 64, "base_mlp_dim": 128, "base_num_query_heads": 2, "base_num_kv_heads": 1, "head_dim": 32}
HF_TEXT_NAMES = {"base_emb_dim": "hidden_size", "base_mlp_dim": "intermediate_size",
                 "base_num_query_heads": "num_attention_heads", "base_num_kv_heads": "num_key_value_heads",
                 "head_dim": "head_dim"}
# The vision tower is never used (use_multimodal=False) but is part of the checkpoint class;
# shrunk so the toy stays small. 56 px / 14 px patches = 4x4 patches, pooled to 2x2 = 4 tokens.
VISION_DIMS = {"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2,
               "image_size": 56}
MM_TOKENS_PER_IMAGE = 4

# The extra MaxText args each pipeline command needs with these inputs served from the hub cache
# (HF_HUB_CACHE=TOY_DIR/hf_home/hub, as the local cloud's image does), found by running the three
# commands by hand and dropping each arg in turn (hardware=cpu, tokenizer_path, --hf_model_path and
# HF_TOKEN turned out unnecessary). A rehearsal kit names its files instead: toy_args.json.
_DIM_ARGS = ["override_model_config=True", *(f"{key}={value}" for key, value in TEXT_DIMS.items())]
EXTRA_ARGS = {
    # The checkpoint itself comes from the hub cache (HF_IDS["gemma3-4b"]); one simulated device
    # instead of 16 takes the conversion from ~1:45 to ~0:20.
    "convert": ["--simulated_cpu_devices_count=1", *_DIM_ARGS],
    # dot_product: the default attention picks a TPU kernel ("Only interpret mode is supported on
    # CPU backend"); 256 tokens instead of 2048 keeps a step ~1.5 s and the RSS under 5 GB.
    "train": ["attention=dot_product", "skip_jax_distributed_system=true", "max_target_length=256", *_DIM_ARGS],
    "export": ["skip_jax_distributed_system=true", *_DIM_ARGS],
}

DATASET_ROWS = 400  # ~130 packed 256-token sequences: far more than the toy runs' steps
SMALL_DATASET_ROWS = 16  # ~700 tokens, about 3 packed 256-token sequences: SFT runs out early
TEST_ROWS = 20

# Gemma's turn format, written for this toy: a system message (if any) is folded into the first
# user turn; the generation prompt is exactly how a model turn starts (MaxText checks that).
CHAT_TEMPLATE = (
    "{{- bos_token -}}"
    "{%- set state = namespace(system='') -%}"
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'system' -%}"
    "{%- set state.system = (message['content'] | trim) + '\n\n' -%}"
    "{%- else -%}"
    "{%- set role = 'model' if message['role'] == 'assistant' else 'user' -%}"
    "{{- '<start_of_turn>' + role + '\n' -}}"
    "{%- if role == 'user' -%}{{- state.system -}}{%- set state.system = '' -%}{%- endif -%}"
    "{{- (message['content'] | trim) + '<end_of_turn>\n' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<start_of_turn>model\n' -}}{%- endif -%}"
)


def toy_hf_config() -> transformers.Gemma3Config:
    """MaxText's own gemma3-4b Hugging Face config with the toy's widths: every other field
    (rope, sliding window, token ids) stays as the converters expect it."""
    base = HF_MODEL_CONFIGS[MODEL_NAME].to_dict()
    text = dict(base.pop("text_config"))
    vision = dict(base.pop("vision_config"))
    for key, value in TEXT_DIMS.items():
        text[HF_TEXT_NAMES[key]] = value
    text["query_pre_attn_scalar"] = TEXT_DIMS["head_dim"]  # gemma3 scales queries by head_dim**-0.5
    vision.update(VISION_DIMS)
    for key in ("transformers_version", "_name_or_path", "id2label", "label2id"):
        base.pop(key, None)
    base["mm_tokens_per_image"] = MM_TOKENS_PER_IMAGE
    return transformers.Gemma3Config(text_config=text, vision_config=vision, **base)


def make_model(out: Path) -> transformers.Gemma3Config:
    config = toy_hf_config()
    torch.manual_seed(SEED)
    model = transformers.Gemma3ForConditionalGeneration(config).to(torch.bfloat16)
    model.save_pretrained(out)
    return config


def make_tokenizer(out: Path) -> transformers.PreTrainedTokenizerBase:
    sentencepiece_model = Path(maxtext.__file__).parent / "assets" / "tokenizers" / "tokenizer.gemma3"
    staging = out.parent / ".tokenizer-staging"
    staging.mkdir()
    shutil.copyfile(sentencepiece_model, staging / "tokenizer.model")
    # transformers converts a directory's tokenizer.model (sentencepiece) to a fast tokenizer.
    tokenizer = transformers.GemmaTokenizer.from_pretrained(staging)
    shutil.rmtree(staging)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<start_of_turn>", "<end_of_turn>"]})
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(out)
    # tokenizer.json holds the whole tokenizer; drop the staging path and load-time flags.
    config_path = out / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    for key in ("vocab_file", "is_local", "local_files_only"):
        config.pop(key, None)
    config_path.write_text(json.dumps(config, indent=2) + "\n")
    if len(tokenizer) != 262144:
        raise RuntimeError(f"the gemma3 tokenizer has {len(tokenizer)} tokens, not 262144")
    return tokenizer


def make_hub_cache(hub: Path, files: list[Path]) -> str:
    """A hub cache entry for HUB_ID: refs/main names a snapshot holding `files` (hard links
    where possible). Plain files in the snapshot, not links to blobs: loaders only read it."""
    digest = hashlib.sha1()
    for path in sorted(files):
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    revision = digest.hexdigest()
    repo = hub / ("models--" + HUB_ID.replace("/", "--"))
    snapshot = repo / "snapshots" / revision
    snapshot.mkdir(parents=True)
    for path in files:
        try:
            os.link(path, snapshot / path.name)
        except OSError:
            shutil.copyfile(path, snapshot / path.name)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(revision)
    return revision


# Chat generators: short, varied, deterministic conversations with checkable answers.
NAMES = ["Ada", "Bo", "Chen", "Dara", "Eli", "Femi", "Gus", "Hana", "Ivo", "Juno"]
COLORS = ["red", "green", "blue", "yellow", "purple", "orange", "black", "white"]
THINGS = ["apples", "books", "cups", "stones", "coins", "shells", "pens", "keys"]


def _arithmetic(rng):
    a, b = rng.randint(2, 99), rng.randint(2, 99)
    return [("user", f"What is {a} plus {b}?"), ("assistant", f"{a} plus {b} is {a + b}.")]


def _counting(rng):
    name, thing = rng.choice(NAMES), rng.choice(THINGS)
    a, b = rng.randint(1, 20), rng.randint(1, 20)
    return [("user", f"{name} has {a} {thing} and finds {b} more. How many {thing} does {name} have now?"),
            ("assistant", f"{name} now has {a + b} {thing}: {a} to start with, plus {b}.")]


def _colors(rng):
    first, second = rng.sample(COLORS, 2)
    return [("user", f"My favourite colour is {first}. Remember it."),
            ("assistant", f"Noted: your favourite colour is {first}."),
            ("user", f"Actually it is {second}. What is my favourite colour?"),
            ("assistant", f"Your favourite colour is {second}.")]


def _reverse(rng):
    words = rng.sample(["river", "cloud", "lamp", "garden", "window", "violin", "pepper", "ladder"], 3)
    return [("user", "Reverse the order of these words: " + " ".join(words)),
            ("assistant", " ".join(reversed(words)))]


def _story(rng):
    name, thing = rng.choice(NAMES), rng.choice(THINGS)
    return [("user", f"Write one sentence about {name} and some {thing}."),
            ("assistant", f"{name} lined up the {thing} on the windowsill and counted them twice."),
            ("user", "Now make it shorter."),
            ("assistant", f"{name} counted the {thing}.")]


GENERATORS = [_arithmetic, _counting, _colors, _reverse, _story]


def chat_rows(count: int, seed: int) -> list[dict]:
    """Rows in UltraChat 200k's schema: prompt, prompt_id, messages [{content, role}]."""
    rng = random.Random(seed)
    rows = []
    for _ in range(count):
        turns = rng.choice(GENERATORS)(rng)
        prompt = turns[0][1]
        rows.append({
            "prompt": prompt,
            "prompt_id": hashlib.sha256(prompt.encode()).hexdigest(),
            "messages": [{"content": content, "role": role} for role, content in turns],
        })
    return rows


def write_dataset(root: Path, splits: dict[str, list[dict]]) -> None:
    schema = pa.schema([
        ("prompt", pa.string()), ("prompt_id", pa.string()),
        ("messages", pa.list_(pa.struct([("content", pa.string()), ("role", pa.string())]))),
    ])
    (root / "data").mkdir(parents=True)
    for split, rows in splits.items():
        pq.write_table(pa.Table.from_pylist(rows, schema=schema), root / "data" / f"{split}-00000-of-00001.parquet")


def main(toy: Path) -> None:
    toy.mkdir(parents=True)
    config = make_model(toy / "model")
    tokenizer = make_tokenizer(toy / "tokenizer")
    hub_files = [*(toy / "tokenizer").iterdir(), *(toy / "model").iterdir()]
    revision = make_hub_cache(toy / "hf_home" / "hub", hub_files)
    write_dataset(toy / "datasets" / "ultrachat_200k", {
        "train_sft": chat_rows(DATASET_ROWS, SEED), "test_sft": chat_rows(TEST_ROWS, SEED + 1)})
    write_dataset(toy / "datasets" / "ultrachat_small", {"train_sft": chat_rows(SMALL_DATASET_ROWS, SEED + 2)})
    text = config.text_config
    (toy / "toy.json").write_text(json.dumps({
        "model_name": MODEL_NAME,
        "maxtext_dims": TEXT_DIMS,
        "num_hidden_layers": text.num_hidden_layers,
        "vocab_size": text.vocab_size,
        "hub_id": HUB_ID,
        "hub_revision": revision,
        "tokenizer_size": len(tokenizer),
        "dataset_rows": {"ultrachat_200k": DATASET_ROWS, "ultrachat_small": SMALL_DATASET_ROWS},
        "datasets": {"ultrachat_200k": "datasets/ultrachat_200k", "ultrachat_small": "datasets/ultrachat_small"},
        "extra_args": EXTRA_ARGS,
    }, indent=2) + "\n")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
