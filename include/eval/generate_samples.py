"""Generate a few lines from a Hugging Face model folder, one per prompt; print them as JSON.

Runs in an environment with torch and transformers (not Airflow's), e.g. MaxText's own venv:
    python generate_samples.py MODEL_DIR PROMPTS_FILE [MAX_NEW_TOKENS]
Greedy decoding, so the same model gives the same lines. The model's chat template wraps each
prompt when it has one (a tuned chat model expects its turns). The weights are one
model.safetensors or, as MaxText exports a model above 3 GiB, model.safetensors.index.json and
its shards: transformers reads either. Weights the model expects but the files lack would be
left randomly initialised (transformers only warns): the output names them as missing_weights.
"""

import json
import sys

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer


def main(model_dir: str, prompts_file: str, max_new_tokens: int = 24) -> None:
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model, loading = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32,
                                                          output_loading_info=True)
    model.eval()
    prompts = [line.strip() for line in open(prompts_file, encoding="utf-8") if line.strip()]
    samples = []
    for prompt in prompts:
        if tokenizer.chat_template:
            text = tokenizer.apply_chat_template(
                [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True
            )
        else:
            text = prompt
        inputs = tokenizer(text, return_tensors="pt", add_special_tokens=not tokenizer.chat_template)
        with torch.no_grad():
            output = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False)
        new_tokens = output[0][inputs["input_ids"].shape[1]:]
        samples.append({
            "prompt": prompt,
            "completion": tokenizer.decode(new_tokens, skip_special_tokens=True),
            "new_tokens": int(new_tokens.shape[0]),
        })
    print(json.dumps({"samples": samples, "missing_weights": sorted(loading["missing_keys"])}))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], *(int(arg) for arg in sys.argv[3:4]))
