# The two commands the README promises:
#   make run   - the pipeline end to end in the local cloud, through Airflow's real scheduler
#   make test  - the test suite
# Both build the environment from the lock first (uv pip sync: exactly the locked versions).

VENV ?= .venv
PYTHON := $(VENV)/bin/python
UV_VERSION := 0.13.9
RUN_CONF ?= {}
MAXTEXT ?= real

.PHONY: run test venv system-deps lock

venv: $(VENV)/.synced

$(VENV)/.synced: requirements.lock
	@command -v uv >/dev/null || python3 -m pip install -q "uv==$(UV_VERSION)"
	uv venv -q --allow-existing --python 3.11 $(VENV)
	VIRTUAL_ENV=$(VENV) uv pip sync -q requirements.lock
	@touch $@

# Debian packages the local cloud needs: OpenSSH's sshd plays each VM's SSH server.
system-deps:
	@if [ ! -x /usr/sbin/sshd ]; then \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq openssh-server >/dev/null; \
	fi

run: venv system-deps
	$(PYTHON) -m localcloud.run_pipeline --maxtext $(MAXTEXT) --conf '$(RUN_CONF)'

# pytest exits 5 when it collected no test: that must fail, not pass quietly.
test: venv system-deps
	@$(PYTHON) -m pytest $(PYTEST_ARGS); status=$$?; \
	if [ $$status -eq 5 ]; then echo "pytest collected no tests" >&2; exit 1; fi; exit $$status

lock:
	uv pip compile requirements-dev.txt --python-version 3.11 -o requirements.lock
