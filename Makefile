# `make demo` and `make test` do all the setup on a fresh machine (Python >= 3.11 and pip):
# they create .venv, install tokenmill with pinned dependencies, then run.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# The rules find their own package (workflow/rules/common.smk); the venv first on PATH is for
# the commands the tests run by name (tokenmill, snakemake).
export PATH := $(abspath $(BIN)):$(PATH)
export HF_HUB_OFFLINE ?= 1

.PHONY: demo check test test-deps lint bench bench-hidden-states clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[test]'
	touch $@

# The whole pipeline on the bundled sample data, with the CPU reference engine.
demo: $(VENV)/.installed
	$(BIN)/snakemake --profile profiles/local
	$(BIN)/snakemake --profile profiles/local --report results/report.html

# Lint and format gates, outside pytest: seconds. The first step of `make check` and `make test`.
lint: $(VENV)/.installed
	$(BIN)/python tests/lint.py

# Day-to-day: lint, then the unit and fake-server tests (no real SLURM, no real engines, no
# trainers, no end-to-end Snakemake runs: see the markers in pyproject.toml).
CHECK_MARKERS := not (e2e or slow or engines or slurm or trainers)
# One xdist worker per core (pytest-xdist is in the test extra). Nothing from apt is needed:
# the container tests skip without bubblewrap (they fail only under CI=true).
check: lint
	$(BIN)/pytest -q -n auto -m "$(CHECK_MARKERS)" --durations=25

# The whole test suite: lint, what the suites need from apt, then three pytest sessions at
# once (tests/run_sessions.py): the single-node SLURM module, the two-node SLURM module (each on
# its own real cluster; both mostly wait on SLURM) and everything else on three xdist workers.
# Each session's log is printed when it ends; the exit status says whether any failed.
# Without root the SLURM modules skip, and under CI=true they fail.
test: lint test-deps
	$(BIN)/python tests/run_sessions.py

# Packages from apt that the suites need (as root, Debian/Ubuntu): bubblewrap for the container
# test (tests/test_fake_apptainer.py), chromium for the report test (tests/test_report_browser.py)
# (under CI=true the absence of either is a failure) and the SLURM clusters' packages
# (tests/slurm/cluster.sh install: once, before both SLURM sessions start).
test-deps:
	@if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
		export DEBIAN_FRONTEND=noninteractive; \
		if ! command -v bwrap >/dev/null; then \
			echo "apt-get install bubblewrap"; \
			apt-cache show bubblewrap >/dev/null 2>&1 || apt-get update -qq >/dev/null; \
			apt-get install -y -qq --no-install-recommends bubblewrap >/dev/null; \
		fi; \
		bash tests/slurm/cluster.sh install; \
	fi
	@if ! command -v chromium >/dev/null && [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
		echo "apt-get install chromium"; \
		export DEBIAN_FRONTEND=noninteractive; \
		apt-cache show chromium >/dev/null 2>&1 || apt-get update -qq >/dev/null; \
		apt-get install -y -qq --no-install-recommends chromium >/dev/null; \
	fi

# The CPU benchmarks of the pipeline's stages (README, Benchmarks, lists each with its command).
# The hidden-states benchmark starts vLLM when its venv exists (minutes): its own target.
bench: $(VENV)/.installed
	$(BIN)/python benchmarks/bench_tokenize.py
	$(BIN)/python benchmarks/bench_client.py
	$(BIN)/python benchmarks/bench_merge.py
	$(BIN)/python benchmarks/bench_journal.py
	$(BIN)/python benchmarks/bench_conversation_memory.py --template non-exact --shapes 1000x4,1000x16

bench-hidden-states: $(VENV)/.installed
	$(BIN)/python benchmarks/bench_hidden_states.py

# Outputs and Snakemake's state only: the generation journal (journal/, samples already paid
# for) is kept on purpose. Delete it by hand (rm -rf journal) to generate everything anew.
clean:
	rm -rf results .snakemake
