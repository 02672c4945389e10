# The two commands a newcomer needs: `make run` (the quickstart) and `make test`.
# Both create .venv on first use; they need only Python 3.11+ and pip (npm for the Node.js test).

PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
NODE_CLIENT := tests/clients/node

.PHONY: setup run test lint format clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	touch $@

$(NODE_CLIENT)/node_modules/.package-lock.json: $(NODE_CLIENT)/package-lock.json
	@if command -v npm >/dev/null; then \
		npm ci --prefix $(NODE_CLIENT) --no-audit --no-fund --loglevel=error; \
	else echo "npm not found: the Node.js client test will be skipped"; fi

run: setup
	$(BIN)/seamlessflow run $(CONFIG)

lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

format: setup
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

test: lint $(NODE_CLIENT)/node_modules/.package-lock.json
	$(BIN)/pytest

clean:
	rm -rf $(VENV) $(NODE_CLIENT)/node_modules .pytest_cache .ruff_cache .hypothesis
