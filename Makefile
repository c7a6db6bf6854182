# The commands the README promises:
#   make run   - the pipeline end to end in the local cloud, through Airflow's real scheduler
#                (the real MaxText at toy size; MAXTEXT=fast: the stand-in; RUN_CONF='{"steps": 10}')
#   make run DAG=maxtext_sft_slice - the multi-host slice DAG (v6e-16, 4 hosts) the same way, on the stand-in
#   make rehearse - the rehearsal DAG (a CPU VM at toy size) end to end in the local cloud
#   make test  - the test suite
#   make dist  - the installable wheel (pyproject.toml) in dist/, for a managed Airflow
#   make publish PUBLISH_URL=... - that wheel to a Python package repository (Cloud Composer's recipe)
#   make astro-project - an Astro project of its own in build/astro (Astro's recipe)
#   make bench - the benchmark's one table (bench/run.py; BENCH_ARGS="--snapshots 2 --capacity 1" shrinks it)
# All three build the environment from the lock first (uv pip sync: exactly the locked versions).

VENV ?= .venv
PYTHON := $(VENV)/bin/python
UV_VERSION := 0.13.9
RUN_CONF ?= {}
DAG ?= maxtext_sft
# Empty: run_pipeline's default for the DAG (real; the slice's is fast, its only choice).
MAXTEXT ?=

.PHONY: run rehearse test bench venv system-deps bytecode lock dist publish publish-url astro-project test-floor params-page uv

# uv builds every environment here: the one on PATH, else one of the project's own in
# .uv-bootstrap (a virtualenv made with Debian's python3-venv, its uv linked into
# .uv-bootstrap/bin, which goes on PATH for every recipe and the tests they run). Never installed
# into the system Python: Debian's is EXTERNALLY-MANAGED (PEP 668), its pip refuses.
UV_BOOTSTRAP ?= $(CURDIR)/.uv-bootstrap
ifeq ($(shell command -v uv 2>/dev/null),)
export PATH := $(UV_BOOTSTRAP)/bin:$(PATH)
endif

uv:
	@command -v uv >/dev/null || { \
		python3 -c "import ensurepip" 2>/dev/null || { \
			echo "Installing Debian's python3-venv (apt-get) ..."; \
			apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq python3-venv >/dev/null; }; \
		echo "Installing uv $(UV_VERSION) into $(UV_BOOTSTRAP) ..."; \
		python3 -m venv "$(UV_BOOTSTRAP)/venv" && "$(UV_BOOTSTRAP)/venv/bin/pip" install -q "uv==$(UV_VERSION)" && \
		mkdir -p "$(UV_BOOTSTRAP)/bin" && ln -sf ../venv/bin/uv "$(UV_BOOTSTRAP)/bin/uv"; }

venv: uv $(VENV)/.synced

# The packages' bytecode compiled ahead: every Python process here (each test worker, Airflow
# component and task) would otherwise compile its imports from source when PYTHONDONTWRITEBYTECODE
# is set, as it is on this machine kind: measured, half the CPU of a pipeline run in the tests
# (compute_v1 alone is several seconds a process). Not the providers' optional dependencies that
# nothing here imports (NEVER_IMPORTED: no bytecode of theirs was read in a whole test run, by
# its files' access times): half the venv's sources, 97 s of CPU for all (uv's --compile-bytecode)
# against 64 s without them. A process that imports one compiles it from source.
NEVER_IMPORTED = /site-packages/(scipy|sklearn|ray|litellm|openai|vertexai|agentplatform|google/ads|google/cloud/aiplatform[a-z0-9_]*|google/genai|google/analytics)/
$(VENV)/.synced: requirements-dev.lock Makefile
	@echo "Installing the locked Python packages into $(VENV) (uv pip sync; about a minute on a fresh machine) ..."
	@started=$$(date +%s) && \
	uv venv -q --allow-existing --python 3.11 $(VENV) && \
	VIRTUAL_ENV=$(VENV) uv pip sync -q requirements-dev.lock && \
	$(PYTHON) -m compileall -q -j 0 -x '$(NEVER_IMPORTED)' $(VENV)/lib/python3.11/site-packages >/dev/null && \
	echo "Python packages installed in $$(( $$(date +%s) - started )) s"
	@touch $@

# Debian packages the local cloud and the tests need (`make run` and `make rehearse` only sshd and
# sudo, the first two of SYSTEM_DEBS): OpenSSH's sshd plays each VM's SSH server; Debian's sudo is
# each VM's sudo (its users get root through it, with its default env_reset and secure_path);
# PostgreSQL is the metadata database of the tests that run a real scheduler (each session starts
# a private server of its own, localcloud/postgres.py). The package would create and start a
# system-wide "main" cluster that nothing here uses: a createcluster.d setting stops that.
# Redis is the Celery broker of the deployment-shaped test (it starts a private server of its
# own); chromium and chromium-driver run the trigger-form test; docker-compose 1.29 validates
# docker-compose.yaml (`config` needs no Docker engine).
SYSTEM_DEBS ?= openssh-server sudo postgresql redis-server chromium chromium-driver docker-compose
run rehearse: SYSTEM_DEBS = openssh-server sudo
system-deps:
	@missing=""; \
	for deb in $(SYSTEM_DEBS); do \
		case $$deb in \
			openssh-server) [ -x /usr/sbin/sshd ];; \
			sudo) [ -u /usr/bin/sudo ];; \
			postgresql) ls /usr/lib/postgresql/*/bin/pg_ctl >/dev/null 2>&1;; \
			redis-server) [ -x /usr/bin/redis-server ];; \
			chromium) [ -x /usr/bin/chromium ];; \
			chromium-driver) [ -x /usr/bin/chromedriver ];; \
			docker-compose) [ -x /usr/bin/docker-compose ];; \
		esac || missing="$$missing $$deb"; \
	done; \
	if [ -n "$$missing" ]; then \
		echo "Installing Debian packages:$$missing (apt-get) ..."; \
		case "$$missing" in *postgresql*) \
			mkdir -p /etc/postgresql-common/createcluster.d && \
			echo "create_main_cluster = false" > /etc/postgresql-common/createcluster.d/maxtext-sft-no-main-cluster.conf;; \
		esac; \
		started=$$(date +%s); \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing >/dev/null && \
		echo "Debian packages installed in $$(( $$(date +%s) - started )) s"; \
	fi

# The project's own modules compiled ahead too (the venv's are, by --compile-bytecode): each DAG
# parse and each task process imports them, and with PYTHONDONTWRITEBYTECODE set would compile
# them from source every time. Up-to-date files are skipped; a stale one is only recompiled.
bytecode: venv
	@$(PYTHON) -m compileall -q dags plugins localcloud bench tests >/dev/null

run: venv system-deps bytecode
	$(PYTHON) -m localcloud.run_pipeline --dag $(DAG) $(if $(MAXTEXT),--maxtext $(MAXTEXT)) --conf '$(RUN_CONF)'

# The rehearsal DAG (maxtext_sft_rehearsal) end to end in the local cloud, as `run` does the real one.
rehearse: venv system-deps bytecode
	$(PYTHON) -m localcloud.run_pipeline --rehearsal $(if $(MAXTEXT),--maxtext $(MAXTEXT)) --conf '$(RUN_CONF)'

# Four pytest-xdist workers on two cores: much of a test is waiting on a VM, a scheduler or a
# poll, and more workers fill those waits (fresh clones here: 30 min 53 s with two workers, 24 min
# 22 s with three; d838750, the floor's run included, 25 min 28 s with three, 20 min 10 s with
# four; docs/testing.md). A file's tests stay on one worker unless the file is marked `spread`
# (tests/conftest.py). The 15 slowest tests are listed at the end. PYTEST_WORKERS=0: one process.
# pytest exits 5 when it collected no test: that must fail, not pass quietly.
PYTEST_WORKERS ?= 4
test: venv system-deps bytecode
	@$(PYTHON) -m pytest -n $(PYTEST_WORKERS) --dist loadgroup --durations=15 $(PYTEST_ARGS); status=$$?; \
	if [ $$status -eq 5 ]; then echo "pytest collected no tests" >&2; exit 1; fi; exit $$status

# Cold run, repeat run and backfill in the local cloud with the fast stand-in, then the DAG
# processor's parse cost: one table, and bench-results.json (git-ignored) with the numbers behind it.
BENCH_ARGS ?=
bench: venv system-deps bytecode
	$(PYTHON) -m bench $(BENCH_ARGS)

# The wheel a managed Airflow installs (Cloud Composer, MWAA, Astro): the package, its run-time
# files and its plugins' entry point. Built with the locked build backend, without a download.
DIST ?= dist
dist: venv
	uv build -q --wheel --no-build-isolation --python $(PYTHON) -o $(DIST) .

# That wheel to a Python package repository (Cloud Composer's: Artifact Registry) with the pinned
# uv. The credentials come from UV_PUBLISH_USERNAME and UV_PUBLISH_PASSWORD, never a command line
# (docs/deploy-composer.md). PUBLISH_ARGS=--dry-run checks the files without uploading.
PUBLISH_URL ?=
PUBLISH_ARGS ?=
publish: publish-url dist
	uv publish $(PUBLISH_ARGS) --publish-url "$(PUBLISH_URL)" $(DIST)/maxtext_sft_airflow-$$(sed -n 's/^version = "\(.*\)"/\1/p' pyproject.toml)-py3-none-any.whl

publish-url:
	@test -n "$(PUBLISH_URL)" || { echo "PUBLISH_URL is required: the repository's upload URL, e.g. https://REGION-python.pkg.dev/PROJECT/REPOSITORY/" >&2; exit 2; }

# An Astro project of its own (docs/deploy-astro.md): deploy/astro's Dockerfile and requirements.txt
# beside copies of dags/, plugins/ and include/, in ASTRO_PROJECT, where `astro dev start` and
# `astro deploy` run. The repository's Dockerfile and requirements.txt (the compose file's) are
# not touched; ASTRO_PROJECT's dags/, plugins/ and include/ are replaced on each run (edit them here).
ASTRO_PROJECT ?= build/astro
astro-project:
	@mkdir -p "$(ASTRO_PROJECT)" && rm -rf "$(ASTRO_PROJECT)/dags" "$(ASTRO_PROJECT)/plugins" "$(ASTRO_PROJECT)/include" && \
	cp deploy/astro/Dockerfile deploy/astro/requirements.txt deploy/astro/.dockerignore "$(ASTRO_PROJECT)/" && \
	tar -c --exclude=__pycache__ --exclude='*.pyc' dags plugins include | tar -x -C "$(ASTRO_PROJECT)" && \
	echo "An Astro project in $(ASTRO_PROJECT): astro dev start (or astro deploy) there"

# The declared floor (requirements-floor.txt: Airflow 3.3.1 with MWAA 3.3.1's providers), with the
# package installed from its wheel, not from plugins/ (pytest's pythonpath is only the repository):
# the DAGs parse and the pipeline runs under dag.test() with the stand-in, the triggers and the
# listener loaded from the wheel. `make test` runs it too (tests/test_floor_run.py).
FLOOR_VENV ?= .venv-floor
FLOOR_TESTS ?= tests/dags/test_maxtext_sft_dag.py tests/dags/test_pipeline_e2e.py tests/dags/test_floor_slice.py tests/plugins/test_vm_ssh_hook.py \
	tests/plugins/test_training_trigger.py tests/plugins/test_capacity_start_trigger.py tests/test_floor.py
# Left out on the floor (the suite runs them on the lock): each DAG file's parse in a process of its
# own (dag_bag parses them all, import errors asserted), the pipeline's fault runs that exercise
# this package's logic rather than Airflow's or a provider's, and a 10-second SSH silence.
FLOOR_DESELECT ?= parses_without_network or create_that_fails or retried_create or stops_early or invalid_conf \
	or silent_for_longer
test-floor: dist system-deps
	uv venv -q --allow-existing --python 3.11 $(FLOOR_VENV)
	# No --compile-bytecode (57 s of CPU, mostly for modules never imported): the floor's processes
	# write the bytecode of what they import, once, even where PYTHONDONTWRITEBYTECODE is set
	# (measured on a fresh floor venv: 71 s of CPU -> 64 s).
	VIRTUAL_ENV=$(FLOOR_VENV) uv pip sync -q requirements-floor.lock
	VIRTUAL_ENV=$(FLOOR_VENV) uv pip install -q --no-deps --reinstall $(DIST)/maxtext_sft_airflow-*.whl
	env -u PYTHONDONTWRITEBYTECODE MAXTEXT_SFT_FLOOR=1 MAXTEXT_SFT_JOBS_DIR=$(CURDIR)/include/jobs $(FLOOR_VENV)/bin/python -m pytest -o pythonpath=. -p no:cacheprovider -k "not ($(FLOOR_DESELECT))" $(FLOOR_TESTS)

# docs/params.md from the Params' declarations (tests/test_docs.py fails when they differ).
params-page: venv
	PYTHONPATH=plugins $(PYTHON) -m maxtext_sft.run.params_page docs/params.md

lock: uv
	uv pip compile requirements.txt --python-version 3.11 -o requirements.lock
	uv pip compile requirements-dev.txt --python-version 3.11 --constraints requirements.lock -o requirements-dev.lock
