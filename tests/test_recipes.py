"""The recipes' commands that can run here, run as the docs print them (issue 52's "recipes that
work as written"): the VM login key and its SSH connection (docs/google-cloud.md); and each managed
Airflow's recipe (docs/deploy-*.md): the wheel published, installed and its DAG files copied as
the service lays them out, then every DAG file parsed there as the service's DAG processor would.
What cannot run here (the services' own commands: `gcloud composer`, `gcloud artifacts`, the
Astro CLI, the S3 upload) is named where it is skipped."""

from __future__ import annotations

import http.server
import json
import os
import re
import shutil
import subprocess
import sys
import threading
import tomllib
import zipfile
from pathlib import Path

from localcloud.cloud import storage_env
from tests.conftest import REPO, local_bucket


def recipe(page: Path, name: str) -> str:
    """The first fenced block after the page's `<!-- recipe: NAME -->` marker, unindented."""
    page = page if page.is_absolute() else REPO / "docs" / page
    text = page.read_text()
    after = text[text.index(f"<!-- recipe: {name} -->"):]
    block = re.search(r"```\n(.*?)\n\s*```", after, re.S).group(1)
    return "\n".join(line.strip() for line in block.splitlines())


def test_the_ssh_connection_recipe_makes_a_connection_whose_key_the_ssh_hook_loads(tmp_path, monkeypatch):
    commands = recipe(REPO / "docs" / "google-cloud.md", "ssh-connection")
    # python3 as a deployment's shell finds one; this interpreter's folder first on PATH.
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    subprocess.run(["bash", "-euo", "pipefail", "-c", commands], cwd=tmp_path, env=env, check=True, timeout=60)
    connection = (tmp_path / "maxtext_sft_vm_ssh.json").read_text()
    assert json.loads(connection)["extra"]["private_key"].startswith("-----BEGIN OPENSSH PRIVATE KEY-----")
    monkeypatch.setenv("AIRFLOW_CONN_MAXTEXT_SFT_VM_SSH", connection)
    from airflow.providers.ssh.hooks.ssh import SSHHook

    hook = SSHHook(ssh_conn_id="maxtext_sft_vm_ssh", remote_host="unused")
    public = (tmp_path / "maxtext_sft_vm_key.pub").read_text().split()
    assert (hook.username, hook.pkey.get_name(), hook.pkey.get_base64()) == ("maxtext", public[0], public[1])


# ----- the managed Airflows' recipes (docs/deploy-composer.md, deploy-mwaa.md, deploy-astro.md) ------

# Every DAG file's DAGs, parsed as a DAG processor parses them (a DagBag over the DAGs folder), in a
# fresh interpreter whose only path to the package is the layout's. One parse after another in one
# interpreter (each DagBag runs the DAG files again; the jobs folder is read at each parse), each
# after its environment changes and its files are removed: an interpreter's imports cost ~7 s of CPU.
PARSE = """
import json, os, sys
from airflow.dag_processing.dagbag import DagBag
import maxtext_sft
from maxtext_sft.run.paths import include_dir
found = []
for parse in json.loads(sys.argv[1]):
    os.environ.update(parse["env"])
    for path in parse["remove"]:
        os.remove(path)
    bag = DagBag(parse["dags"])
    found.append({
        "dags": {dag_id: {"description": dag.description, "tags": sorted(dag.tags),
                          "paused_upon_creation": dag.is_paused_upon_creation} for dag_id, dag in bag.dags.items()},
        "errors": {path.rsplit("/", 1)[-1]: error for path, error in bag.import_errors.items()},
        "package": maxtext_sft.__file__,
        "include": str(include_dir()),
    })
print(json.dumps(found))
"""
REPOSITORY_DAG_IDS = {
    "maxtext_sft", "maxtext_sft_rehearsal", "maxtext_sft_slice", "maxtext_sft_bake_image", "maxtext_sft_janitor",
    "maxtext_sft_sample_generations", "ultrachat_gemma3_nightly",
}
EXAMPLE_JOB = "ultrachat_gemma3_nightly"


def parse_dags(dags: Path, plugins: Path, home: Path, *, site: Path | None = None,
               parses: list[tuple[dict, list[Path]]] = (({}, []),)) -> list[dict]:
    """What the DAG processor of a deployment laid out so finds: `site` the installed wheel's
    site-packages (none: the package comes from the plugins folder, which Airflow puts on sys.path).
    One parse for each (environment variables set, files removed) in `parses`, in turn."""
    clean = {k: v for k, v in os.environ.items()
             if k not in ("PYTHONPATH", "MAXTEXT_SFT_INCLUDE_DIR", "MAXTEXT_SFT_JOBS_DIR") and not k.startswith("AIRFLOW__")}
    clean.update(AIRFLOW_HOME=str(home), AIRFLOW__CORE__DAGS_FOLDER=str(dags), AIRFLOW__CORE__PLUGINS_FOLDER=str(plugins),
                 AIRFLOW__CORE__LOAD_EXAMPLES="False")
    if site:
        clean["PYTHONPATH"] = str(site)
    parses = [{"dags": str(dags), "env": env, "remove": [str(path) for path in remove]} for env, remove in parses]
    done = subprocess.run([sys.executable, "-c", PARSE, json.dumps(parses)], env=clean, cwd=home, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.splitlines()[-1])


def run_recipe(commands: str, cwd: Path, env: dict | None = None) -> str:
    done = subprocess.run(["bash", "-euo", "pipefail", "-c", commands], cwd=cwd, env={**os.environ, **(env or {})},
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, (commands, done.stdout[-2000:], done.stderr[-3000:])
    return done.stdout


def runnable(commands: str, *not_here: str) -> str:
    """The recipe's lines but those of the services' own tools, which cannot run here; each of
    those must be there as printed (a changed recipe must change this test)."""
    lines = commands.splitlines()
    for prefix in not_here:
        assert [line for line in lines if line.startswith(prefix)], f"no {prefix!r} line: {commands}"
    return "\n".join(line for line in lines if not line.startswith(not_here))


def assert_the_example_job_says_what_it_is(found: dict, *, example: bool) -> None:
    job = found["dags"][EXAMPLE_JOB]
    assert job["paused_upon_creation"] is True
    assert job["description"].startswith("The package's example job.") is example, job
    assert ("example" in job["tags"]) is example, job


def installed(wheel: Path, site: Path) -> Path:
    """The wheel installed as pip installs it, without its dependencies (the test's venv has them)."""
    subprocess.run(["uv", "pip", "install", "-q", "--no-deps", "--python", sys.executable, "--target", str(site), str(wheel)],
                   check=True, timeout=120)
    return site


def test_the_composer_recipe_parses_every_dag_from_the_bucket_with_the_installed_wheel(wheel, local_cloud, tmp_path):
    # Step 4, as printed: the DAG files to the environment's bucket, here the local cloud's.
    bucket = local_bucket(local_cloud, "composer-env-bucket")
    env = storage_env(local_cloud.storage_url)
    run_recipe(recipe(Path("deploy-composer.md"), "composer-dags").replace("gs://BUCKET/", f"gs://{bucket.name}/"), REPO, env)
    # Composer mounts the bucket at /home/airflow/gcs on every component: its dags/ is the DAGs folder.
    mount = tmp_path / "home" / "airflow" / "gcs"
    for blob in bucket.client.list_blobs(bucket.name):
        target = mount / blob.name
        target.parent.mkdir(parents=True, exist_ok=True)
        blob.download_to_filename(target)
    assert sorted(p.name for p in (mount / "dags").iterdir()) == sorted(p.name for p in (REPO / "dags").glob("*.py"))
    # Steps 2-3: the wheel from the repository, installed by the environment's pip; no plugins folder.
    site = installed(wheel, tmp_path / "site-packages")
    empty = tmp_path / "plugins"
    empty.mkdir()
    # Step 5, as printed: the team's jobs to data/jobs, and the variable that names the folder
    # (its `gcloud composer` line sets it on the environment; here it is set on the parse).
    jobs = recipe(Path("deploy-composer.md"), "composer-jobs")
    [variable] = re.findall(r"--update-env-variables MAXTEXT_SFT_JOBS_DIR=(\S+)", jobs)
    run_recipe(runnable(jobs, "gcloud composer ").replace("gs://BUCKET/", f"gs://{bucket.name}/"), REPO, env)
    for blob in bucket.client.list_blobs(bucket.name, prefix="data/"):
        (mount / blob.name).parent.mkdir(parents=True, exist_ok=True)
        blob.download_to_filename(mount / blob.name)
    jobs_folder = mount / Path(variable).relative_to("/home/airflow/gcs")
    before, after, missing = parse_dags(mount / "dags", empty, tmp_path, site=site, parses=[
        ({}, []),
        ({"MAXTEXT_SFT_JOBS_DIR": str(jobs_folder)}, []),
        ({}, [jobs_folder / "ultrachat-gemma3-nightly.yaml"]),
    ])
    # Before step 5: every DAG, from the wheel alone; the example job's loader reads the example
    # the wheel carries, and says so.
    assert before["errors"] == {}
    assert set(before["dags"]) == REPOSITORY_DAG_IDS
    assert Path(before["package"]).is_relative_to(site) and Path(before["include"]) == site / "maxtext_sft" / "include"
    assert_the_example_job_says_what_it_is(before, example=True)
    # After it: the team's file.
    assert after["errors"] == {} and set(after["dags"]) == REPOSITORY_DAG_IDS
    assert_the_example_job_says_what_it_is(after, example=False)
    # A loader whose job is not in the team's folder is an import error naming both.
    [error] = missing["errors"].values()
    assert f"ultrachat-gemma3-nightly.yaml: no such job in {jobs_folder}" in error, error
    assert set(missing["dags"]) == REPOSITORY_DAG_IDS - {EXAMPLE_JOB}


class UploadCapture(http.server.BaseHTTPRequestHandler):
    """One package repository's upload endpoint, as far as this test reads it: it keeps what each
    POST sent (the legacy upload API's multipart form, which uv and twine send) and answers 200."""

    uploads: list[dict] = []

    def do_POST(self):  # noqa: N802 - the standard library's name
        body = self.rfile.read(int(self.headers["Content-Length"]))
        self.uploads.append({"path": self.path, "authorization": self.headers.get("Authorization", ""), "body": body})
        self.send_response(200)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args):
        pass


def test_the_composer_recipe_publishes_the_wheel_with_the_token_in_the_environment(tmp_path):
    import base64

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), UploadCapture)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    UploadCapture.uploads = []
    try:
        commands = runnable(recipe(Path("deploy-composer.md"), "composer-publish"), "gcloud artifacts ")
        url = f"http://127.0.0.1:{server.server_address[1]}/PROJECT/ml-airflow/"
        # The access token as gcloud prints it for the signed-in account; the wheel built beside the
        # repository's dist/ (DIST), not in it.
        run_recipe(commands.replace("https://REGION-python.pkg.dev/PROJECT/ml-airflow/", url), REPO,
                   {"CLOUDSDK_AUTH_ACCESS_TOKEN": "ya29.recipe-test", "CLOUDSDK_CORE_DISABLE_PROMPTS": "1",
                    "DIST": str(tmp_path / "dist")})
    finally:
        server.shutdown()
    [upload] = UploadCapture.uploads
    assert upload["path"] == "/PROJECT/ml-airflow/"
    assert upload["authorization"] == "Basic " + base64.b64encode(b"oauth2accesstoken:ya29.recipe-test").decode()
    [wheel] = (tmp_path / "dist").glob("*.whl")
    assert wheel.read_bytes() in upload["body"] and f'filename="{wheel.name}"'.encode() in upload["body"]
    # The token was on no command line: the recipe exports it.
    assert "ya29" not in commands and "--password" not in commands


def test_the_mwaa_recipe_installs_the_wheel_from_plugins_zip_and_every_dag_parses(wheel, tmp_path):
    checkout = tmp_path / "checkout"
    (checkout / "dist").mkdir(parents=True)
    shutil.copy(wheel, checkout / "dist")
    run_recipe(recipe(Path("deploy-mwaa.md"), "mwaa-package"), checkout)
    # MWAA writes plugins.zip's contents to /usr/local/airflow/plugins on each container and pip
    # installs requirements.txt's lines: `root` stands for a container's /.
    root = tmp_path / "container"
    plugins = root / "usr" / "local" / "airflow" / "plugins"
    with zipfile.ZipFile(checkout / "build" / "mwaa" / "plugins.zip") as archive:
        archive.extractall(plugins)
    [requirement] = (checkout / "build" / "mwaa" / "requirements.txt").read_text().split()
    site = installed(root / requirement.lstrip("/"), tmp_path / "site-packages")
    dags = root / "usr" / "local" / "airflow" / "dags"
    (dags / "jobs").mkdir(parents=True)
    for dag_file in (REPO / "dags").glob("*.py"):
        shutil.copy(dag_file, dags)
    for job in (REPO / "include" / "jobs").glob("*.yaml"):
        shutil.copy(job, dags / "jobs")
    # The startup script's export, as a shell runs it.
    startup = recipe(Path("deploy-mwaa.md"), "mwaa-startup")
    folder = run_recipe(f"{startup}\necho \"$MAXTEXT_SFT_JOBS_DIR\"", tmp_path).strip()
    [found] = parse_dags(dags, plugins, tmp_path, site=site, parses=[({"MAXTEXT_SFT_JOBS_DIR": str(root / folder.lstrip("/"))}, [])])
    assert found["errors"] == {} and set(found["dags"]) == REPOSITORY_DAG_IDS
    assert Path(found["package"]).is_relative_to(site)
    assert_the_example_job_says_what_it_is(found, example=False)


def test_the_astro_recipe_builds_a_project_of_its_own_and_leaves_the_repositorys_files(tmp_path):
    # A checkout of the repository's files (its venv aside), where the recipe runs as printed.
    checkout = tmp_path / "checkout"
    files = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                           capture_output=True, check=True).stdout.decode().split("\0")
    for name in filter(None, files):
        if (REPO / name).is_file():
            (checkout / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, checkout / name)
    before = {name: (checkout / name).read_bytes() for name in ("Dockerfile", "requirements.txt")}
    project = Path(run_recipe(recipe(Path("deploy-astro.md"), "astro-project") + "\npwd", checkout).splitlines()[-1])
    assert project == checkout / "build" / "astro"
    assert {name: (checkout / name).read_bytes() for name in before} == before
    # Astro's image: the runtime's FROM line alone, and the distribution's requirements without Airflow.
    assert [line for line in (project / "Dockerfile").read_text().splitlines() if line and not line.startswith("#")] == [
        "FROM astrocrpublic.azurecr.io/runtime:3.3-2"]
    declared = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    listed = [line for line in (project / "requirements.txt").read_text().splitlines() if line and not line.startswith("#")]
    assert listed == [line for line in declared if not line.startswith("apache-airflow>")]
    assert not list(project.rglob("__pycache__"))
    # Astro's components: the project folder's dags/ and plugins/, the package from plugins/ alone.
    [found] = parse_dags(project / "dags", project / "plugins", tmp_path)
    assert found["errors"] == {} and set(found["dags"]) == REPOSITORY_DAG_IDS
    assert Path(found["package"]).is_relative_to(project / "plugins") and Path(found["include"]) == project / "include"
    assert_the_example_job_says_what_it_is(found, example=False)
