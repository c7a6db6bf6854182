"""The rehearsal kit's place on the VM and its extra MaxText arguments (include/rehearsal/toy_args.json)."""

from __future__ import annotations

import ast
import json

import pytest

from maxtext_sft.run.maxtext_args import OWNED_KEYS
from maxtext_sft.run.rehearsal_kit import KIT_FOLDER, kit_path, toy_args, toy_args_file
from tests.conftest import REPO

STEPS = ("convert", "train", "export")


@pytest.mark.parametrize(
    ("work_dir", "expected"),
    [
        ("~", "rehearsal-kit"),
        ("~/", "rehearsal-kit"),
        ("~/x", "x/rehearsal-kit"),
        ("~/x/y/", "x/y/rehearsal-kit"),
        ("/abs", "/abs/rehearsal-kit"),
        ("/abs/", "/abs/rehearsal-kit"),
        ("/dev/shm", "/dev/shm/rehearsal-kit"),
    ],
)
def test_kit_path_is_seen_from_the_logins_home(work_dir, expected):
    assert KIT_FOLDER == "rehearsal-kit"
    assert kit_path(work_dir) == expected


def test_toy_args_come_from_include_rehearsal(monkeypatch):
    monkeypatch.delenv("MAXTEXT_SFT_INCLUDE_DIR", raising=False)
    assert toy_args_file() == REPO / "include" / "rehearsal" / "toy_args.json"


def test_toy_args_follow_the_include_folder_override(monkeypatch, tmp_path):
    (tmp_path / "rehearsal").mkdir()
    (tmp_path / "rehearsal" / "toy_args.json").write_text(json.dumps({"train": ["tokenizer_path={kit}/t"]}))
    monkeypatch.setenv("MAXTEXT_SFT_INCLUDE_DIR", str(tmp_path))
    assert toy_args("/w") == {"train": ["tokenizer_path=/w/rehearsal-kit/t"]}


@pytest.mark.parametrize(("work_dir", "kit"), [("~", "rehearsal-kit"), ("~/x", "x/rehearsal-kit"), ("/abs", "/abs/rehearsal-kit")])
def test_every_kit_path_is_substituted(monkeypatch, work_dir, kit):
    monkeypatch.delenv("MAXTEXT_SFT_INCLUDE_DIR", raising=False)
    raw = json.loads(toy_args_file().read_text())
    args = toy_args(work_dir)
    assert set(args) == {*STEPS, "dataset"}
    assert "{kit}" not in json.dumps(args)
    # The same arguments, only the placeholder replaced.
    assert json.dumps(args) == json.dumps(raw).replace("{kit}", kit)
    assert args["dataset"] == {"path": f"{kit}/datasets/ultrachat_200k", "split": "train_sft", "eval_split": "test_sft"}
    # The kit's checkpoint and tokenizer, not google/gemma-3-4b-it from the Hub.
    assert f"--hf_model_path={kit}/model" in args["convert"]
    assert f"tokenizer_path={kit}/tokenizer" in args["train"]


def test_toy_args_set_no_key_the_pipeline_owns(monkeypatch):
    monkeypatch.delenv("MAXTEXT_SFT_INCLUDE_DIR", raising=False)
    args = toy_args("~")
    for step in STEPS:
        keys = {arg.split("=", 1)[0].removeprefix("--") for arg in args[step]}
        assert not keys & OWNED_KEYS[step], step


def test_toy_args_give_every_step_the_toy_models_widths():
    """The widths make_toy_inputs.py builds the toy with (read from its source: it imports torch)."""
    tree = ast.parse((REPO / "include" / "rehearsal" / "make_toy_inputs.py").read_text())
    [dims] = [ast.literal_eval(node.value) for node in tree.body
              if isinstance(node, ast.Assign) and [t.id for t in node.targets if isinstance(t, ast.Name)] == ["TEXT_DIMS"]]
    expected = ["override_model_config=True", *(f"{key}={value}" for key, value in dims.items())]
    args = toy_args("~")
    for step in STEPS:
        assert [arg for arg in args[step] if arg in expected] == expected, step
