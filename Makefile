# The two commands a new user needs: `make demo` and `make test`.
# Each creates .venv if missing and installs kvstack with its test and cluster extras,
# with the CPU build of torch pinned by constraints.txt, and the system library the
# cluster extra's Mooncake wheel loads (libibverbs1) when it is missing.

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo selfcheck test lint bench docs clean libibverbs

$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -c constraints.txt -e '.[test,cluster]'
	@$(MAKE) --no-print-directory libibverbs
	touch $(STAMP)

# Mooncake's wheel (the cluster extra) loads libibverbs.so.1 even over TCP: Debian's
# libibverbs1, installed when missing by apt-get, which needs root (CI runs as root);
# otherwise a message says what to run (the Mooncake tests fail without it).
libibverbs:
	@if { ldconfig -p 2>/dev/null || /sbin/ldconfig -p; } | grep -q 'libibverbs\.so\.1 '; then \
	  :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	  echo "installing libibverbs1 (the Mooncake wheel loads libibverbs.so.1)"; \
	  export DEBIAN_FRONTEND=noninteractive; \
	  apt-get install -y -qq --no-install-recommends libibverbs1 >/dev/null 2>&1 || \
	  { apt-get update -qq && apt-get install -y -qq --no-install-recommends libibverbs1; }; \
	else \
	  echo "*** libibverbs.so.1 is missing and this user cannot apt-get it: run" \
	    "'sudo apt-get install libibverbs1' (Debian/Ubuntu), else the Mooncake tests fail" >&2; \
	fi

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
