"""The export's config.json against the base model's (results/export_config.py)."""

from __future__ import annotations

import copy
import importlib.util
import sys

import pytest

from localcloud.connections import LOCAL_HUB_MODEL_CONFIG
from maxtext_sft.results.export_config import ExportConfigError, check_export_config, requested_architecture

from tests.conftest import REPO


def maxtext_gemma3_4b_config(**dims) -> dict:
    """What MaxText 0.2.2 exports for gemma3-4b, as the stand-in writes it (its `maxtext` package
    is imported for this and forgotten again: the project's venv has no MaxText)."""
    sys.path.insert(0, str(REPO / "localcloud" / "maxtext_standin"))
    try:
        from maxtext import _standin
        from maxtext.checkpoint_conversion.to_huggingface import gemma3_4b_config

        return gemma3_4b_config({**dict(zip(_standin.DIM_KEYS, _standin.MODEL_DIMS["gemma3-4b"])), **dims})
    finally:
        sys.path.remove(str(REPO / "localcloud" / "maxtext_standin"))
        for name in [name for name in sys.modules if name == "maxtext" or name.startswith("maxtext.")]:
            del sys.modules[name]

def text_only(config: dict) -> dict:
    """The config.json export_to_hf.sh publishes for a text-only Gemma 3 export (include/vm/text_only_export.py)."""
    spec = importlib.util.spec_from_file_location("text_only_export", REPO / "include" / "vm" / "text_only_export.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.text_config(config)

TOY_ARGS = ["override_model_config=True", "base_emb_dim=64", "base_mlp_dim=128", "base_num_query_heads=2",
            "base_num_kv_heads=1", "head_dim=32"]


def test_the_known_wrong_activation_is_corrected_naming_its_source():
    config, fixes = check_export_config(maxtext_gemma3_4b_config(), LOCAL_HUB_MODEL_CONFIG, {})
    assert config["text_config"]["hidden_activation"] == "gelu_pytorch_tanh"
    assert config["text_config"]["rope_parameters"]["full_attention"]["rope_theta"] == 1_000_000.0
    assert config["vision_config"] == maxtext_gemma3_4b_config()["vision_config"]  # nothing else changes
    assert {fix["field"]: (fix["was"], fix["now"]) for fix in fixes} == {
        "hidden_activation": ("gelu", "gelu_pytorch_tanh"), "rope_theta": (10_000.0, 1_000_000.0)}
    assert [fix["source"] for fix in fixes if fix["field"] == "hidden_activation"] == ["AI-Hypercomputer/maxtext#2867"]


def test_a_correct_export_needs_no_correction_and_is_not_changed():
    export = maxtext_gemma3_4b_config()
    export["text_config"]["hidden_activation"] = "gelu_pytorch_tanh"
    export["text_config"]["rope_parameters"]["full_attention"]["rope_theta"] = 1_000_000.0
    config, fixes = check_export_config(export, LOCAL_HUB_MODEL_CONFIG, {})
    assert (config, fixes) == (export, [])


@pytest.mark.parametrize("field, value", [("rms_norm_eps", 1e-5), ("sliding_window", 512), ("hidden_size", 64)])
def test_an_unknown_mismatch_fails_naming_the_field_and_both_values(field, value):
    export = maxtext_gemma3_4b_config()
    export["text_config"][field] = value
    with pytest.raises(ExportConfigError) as raised:
        check_export_config(export, LOCAL_HUB_MODEL_CONFIG, {})
    base = {"rms_norm_eps": 1e-6, "sliding_window": 1024, "hidden_size": 2560}[field]
    assert str(raised.value) == f"{field}: the export has {value!r}, the base model's {base!r}"


def test_a_known_wrong_field_with_a_value_nobody_knows_is_not_corrected():
    export = maxtext_gemma3_4b_config()
    export["text_config"]["hidden_activation"] = "silu"
    with pytest.raises(ExportConfigError, match="hidden_activation: the export has 'silu'"):
        check_export_config(export, LOCAL_HUB_MODEL_CONFIG, {})


def test_the_dimensions_the_run_asked_for_are_compared_with_the_request_not_the_base_model():
    requested = requested_architecture(TOY_ARGS)
    assert requested == {"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 2,
                         "num_key_value_heads": 1, "head_dim": 32, "query_pre_attn_scalar": 32}
    toy = maxtext_gemma3_4b_config(base_emb_dim=64, base_mlp_dim=128, base_num_query_heads=2, base_num_kv_heads=1,
                                   head_dim=32)
    config, fixes = check_export_config(toy, LOCAL_HUB_MODEL_CONFIG, requested)
    assert config["text_config"]["hidden_size"] == 64 and len(fixes) == 2
    wider = copy.deepcopy(toy)
    wider["text_config"]["hidden_size"] = 128  # not what the run asked for
    with pytest.raises(ExportConfigError, match="hidden_size: the export has 128, the run's MaxText arguments 64"):
        check_export_config(wider, LOCAL_HUB_MODEL_CONFIG, requested)


def test_rope_written_by_either_transformers_compares_equal():
    # The base model's legacy form (rope_scaling, rope_theta left at its default) and an export
    # written by a transformers 4 (rope_theta, rope_local_base_freq): the same model.
    export = copy.deepcopy(LOCAL_HUB_MODEL_CONFIG)
    text = export["text_config"]
    text.update(rope_theta=1_000_000.0, rope_local_base_freq=10_000.0, rope_scaling={"type": "linear", "factor": 8.0})
    assert check_export_config(export, LOCAL_HUB_MODEL_CONFIG, {})[1] == []


def test_maxtexts_text_vocabulary_is_accepted_and_no_other_vocabulary_is():
    # The base model's config leaves vocab_size at Gemma3TextConfig's 262208; MaxText exports its
    # 262144 text tokens. Accepted as they are (nothing to correct), never another size.
    assert "vocab_size" not in LOCAL_HUB_MODEL_CONFIG["text_config"]
    export = maxtext_gemma3_4b_config()
    assert export["text_config"]["vocab_size"] == 262_144
    config, fixes = check_export_config(export, LOCAL_HUB_MODEL_CONFIG, {})
    assert config["text_config"]["vocab_size"] == 262_144 and "vocab_size" not in {fix["field"] for fix in fixes}
    export["text_config"]["vocab_size"] = 262_000
    with pytest.raises(ExportConfigError, match="vocab_size: the export has 262000, the base model's 262208"):
        check_export_config(export, LOCAL_HUB_MODEL_CONFIG, {})


def test_the_text_only_config_published_for_a_text_only_export_is_checked_and_corrected_the_same_way():
    # export_to_hf.sh publishes MaxText's text-only export as Gemma3ForCausalLM, its config the
    # text config alone: the same fields are compared with the base model's text config.
    multimodal = maxtext_gemma3_4b_config()
    exported = text_only(multimodal)
    assert (exported["architectures"], "text_config" in exported) == (["Gemma3ForCausalLM"], False)
    config, fixes = check_export_config(exported, LOCAL_HUB_MODEL_CONFIG, {})
    assert fixes == check_export_config(multimodal, LOCAL_HUB_MODEL_CONFIG, {})[1] and len(fixes) == 2
    assert config["hidden_activation"] == "gelu_pytorch_tanh"
    assert config["rope_parameters"]["full_attention"]["rope_theta"] == 1_000_000.0
    assert config == {**exported, "hidden_activation": "gelu_pytorch_tanh",
                      "rope_parameters": config["rope_parameters"]}  # nothing else changes
    exported["rms_norm_eps"] = 1e-5
    with pytest.raises(ExportConfigError, match="rms_norm_eps: the export has 1e-05, the base model's 1e-06"):
        check_export_config(exported, LOCAL_HUB_MODEL_CONFIG, {})
