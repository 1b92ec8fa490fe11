# The two commands a new user needs: `make demo` and `make test`.
# Each creates .venv if missing and installs kvstack with its test extras,
# with the CPU build of torch pinned by constraints.txt.

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo selfcheck test lint bench docs clean

$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -c constraints.txt -e '.[test]'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/kvstack demo

selfcheck: $(STAMP)
	$(BIN)/python -m memsvc.selfcheck

# Test files are spread over PYTEST_WORKERS processes, each file's tests kept in one
# (their module fixtures start a stack once); the suite waits on processes as much as
# it computes, so two workers suit CI's two cores.
PYTEST_WORKERS ?= 2

test: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/lint-imports
	$(BIN)/python -m pytest -n $(PYTEST_WORKERS) --dist loadfile

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

bench: $(STAMP)
	$(BIN)/python bench/offload_bw.py

# The reference pages of docs/ as a site (mkdocs-material), into build/site (git-ignored).
# --strict: a broken link or anchor fails, as in tests/test_docs.py.
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .hypothesis
