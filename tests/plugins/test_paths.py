"""One include/ folder for VM scripts, declared jobs and eval: beside plugins/, or where
MAXTEXT_SFT_INCLUDE_DIR says (Composer's data/ folder)."""

from __future__ import annotations

from maxtext_sft.builders.jobs import jobs_dir
from maxtext_sft.run.paths import include_dir
from maxtext_sft.vm.steps import script_files, vm_scripts_dir
from tests.conftest import REPO


def test_the_default_is_the_include_folder_beside_plugins(monkeypatch):
    monkeypatch.delenv("MAXTEXT_SFT_INCLUDE_DIR", raising=False)
    monkeypatch.delenv("MAXTEXT_SFT_JOBS_DIR", raising=False)
    assert include_dir() == REPO / "include"
    assert vm_scripts_dir() == REPO / "include" / "vm"
    assert jobs_dir() == REPO / "include" / "jobs"
    assert "lib.sh" in script_files()


def test_one_variable_moves_scripts_and_jobs_together(monkeypatch, tmp_path):
    monkeypatch.delenv("MAXTEXT_SFT_JOBS_DIR", raising=False)
    (tmp_path / "vm").mkdir()
    (tmp_path / "vm" / "only_here.sh").write_text("true\n")
    monkeypatch.setenv("MAXTEXT_SFT_INCLUDE_DIR", str(tmp_path))
    assert script_files() == {"only_here.sh": b"true\n"}
    assert jobs_dir() == tmp_path / "jobs"
