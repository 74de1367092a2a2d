# `make demo` and `make test` do all the setup on a fresh machine (Python >= 3.11 and pip):
# they create .venv, install tokenmill with pinned dependencies, then run.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# Rules call the `tokenmill` command: the venv must come first on PATH.
export PATH := $(abspath $(BIN)):$(PATH)
export HF_HUB_OFFLINE ?= 1

.PHONY: demo test lint bench clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[test]'
	touch $@

# The whole pipeline on the bundled sample data, with the CPU reference engine.
demo: $(VENV)/.installed
	$(BIN)/snakemake --profile profiles/local
	$(BIN)/snakemake --profile profiles/local --report results/report.html

# The whole test suite (lint and format checks included).
test: $(VENV)/.installed
	$(BIN)/pytest -q
	# The two-node runs through the real SLURM plugin need the two-node cluster's config in
	# /etc/slurm, where the session above keeps its single-node cluster: a session of their own
	# (as root; tests/test_slurm_multinode.py skips them elsewhere).
	if [ "$$(id -u)" = 0 ]; then \
		TOKENMILL_SLURM_NODES=2 TOKENMILL_SLURM_ETC=/etc/slurm \
		$(BIN)/pytest -q -m slurm tests/test_slurm_multinode.py; \
	fi

lint: $(VENV)/.installed
	$(BIN)/ruff check . && $(BIN)/ruff format --check .
	$(BIN)/snakefmt --check Snakefile workflow/rules
	$(BIN)/snakemake --lint

bench: $(VENV)/.installed
	$(BIN)/python benchmarks/bench_tokenize.py
	$(BIN)/python benchmarks/bench_client.py
	$(BIN)/python benchmarks/bench_merge.py
	$(BIN)/python benchmarks/bench_journal.py

# Outputs and Snakemake's state only: the generation journal (journal/, samples already paid
# for) is kept on purpose. Delete it by hand (rm -rf journal) to generate everything anew.
clean:
	rm -rf results .snakemake
