# Suanli: `make run` runs the whole product on its embedded PostgreSQL and Redis; `make test` runs the suite.
SHELL := /bin/bash
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml | cksum | cut -d' ' -f1)

.PHONY: run test lint format bench messages stop clean chaos chaos-ci load

$(STAMP): pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	@$(BIN)/python -m pip install --quiet --upgrade pip
	@$(BIN)/python -m pip install --quiet -e '.[dev]'
	@rm -f $(VENV)/.installed-*; touch $@

run: $(STAMP)
	@$(BIN)/python -m portal.stack

test: $(STAMP)
	@$(BIN)/python -m pytest $(PYTEST_ARGS)

lint: $(STAMP)
	@$(BIN)/ruff check .
	@$(BIN)/ruff format --check .
	@$(BIN)/lint-imports --no-cache

format: $(STAMP)
	@$(BIN)/ruff format .
	@$(BIN)/ruff check --fix .

bench: $(STAMP)
	@for script in bench/*.py; do echo "== $$script"; $(BIN)/python $$script || exit 1; done

chaos: $(STAMP)
	@$(BIN)/python -m chaos.run

chaos-ci: $(STAMP)
	@$(BIN)/python -m chaos.run --short

load: $(STAMP)
	@$(BIN)/python -m load.run

messages: $(STAMP)
	@$(BIN)/python manage.py makemessages -l zh_Hans --ignore=.venv --ignore=.data --ignore=agents
	@$(BIN)/python manage.py compilemessages -l zh_Hans --ignore=.venv

stop:
	@$(BIN)/python -m portal.embedded stop

clean:
	rm -rf .data test-artifacts .pytest_cache .ruff_cache
