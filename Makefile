# Kernels to Clusters — the two commands: `make grade` and `make test`.
# Both create .venv with the course and its dependencies when it is missing.

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
SUBMISSION ?= solutions
LAB ?= all
INSTALLED := $(VENV)/.installed
INSTALLED_DEV := $(VENV)/.installed-dev
# setuptools notes on every editable install that a folder named like a package may
# shadow it (information, not a problem here): keep the install's output to what matters.
EDITABLE := PYTHONWARNINGS="ignore:Editable installation" $(BIN)/python -m pip install --quiet -e

.PHONY: grade test docs doctor sync clean isolation

grade: $(INSTALLED) isolation
	$(BIN)/k2c grade $(LAB) --submission $(SUBMISSION)

# pytest-xdist, one worker per core: notebooks one file per worker (their cells
# run in order), then tests one by one (the docs-site tests share one build, and
# a lab's buggy or alternative fixtures one grader process); the slowest 25
# tests (and 10 slowest cells) are listed at the end of each run.
# The notebooks go first: the docs site shows the lectures as nbval just ran them
# (course/executed.py) instead of running them again.
test: $(INSTALLED_DEV) isolation
	$(BIN)/k2c sync --check
	$(BIN)/python -m pytest course/lectures solutions --nbval-lax --nbval-current-env -n auto --dist loadfile --durations=10
	$(BIN)/python -m pytest tests -n auto --dist loadgroup --durations=25

docs: $(INSTALLED_DEV)
	$(BIN)/sphinx-build -W --keep-going -b html docs docs/_build/html

doctor: $(INSTALLED)
	$(BIN)/k2c doctor

sync: $(INSTALLED)
	$(BIN)/k2c sync

$(BIN)/python:
	@$(PYTHON) -m venv $(VENV) || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	    echo "python3 -m venv failed: installing Debian's python3-venv"; rm -rf $(VENV); \
	    apt-get update -qq && apt-get install -y -qq python3-venv && $(PYTHON) -m venv $(VENV); \
	  else \
	    echo "python3 -m venv failed: install your system's venv package (Debian/Ubuntu: sudo apt-get install python3-venv)"; exit 1; \
	  fi; }
	$(BIN)/python -m pip install --quiet --upgrade pip

$(INSTALLED): pyproject.toml | $(BIN)/python
	$(EDITABLE) .
	@touch $@

$(INSTALLED_DEV): pyproject.toml | $(BIN)/python
	$(EDITABLE) '.[dev]'
	@touch $@ $(INSTALLED)

# Student code is graded in bubblewrap's namespaces. As root on Debian/Ubuntu it is installed
# here when missing, as python3-venv is: without it, student code runs as nobody, who cannot
# read a Python under /root (pyenv, conda) or a checkout in a private folder, and the grader
# refuses to grade (exit 2, saying so) rather than give zeros.
isolation:
	@command -v bwrap >/dev/null || [ "$$(uname)" != Linux ] || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	    echo "bubblewrap is missing: installing Debian's bubblewrap, which isolates student code in grading"; \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq bubblewrap >/dev/null 2>&1 \
	      || echo "could not install bubblewrap: 'k2c doctor' says whether this machine can grade without it"; \
	  else \
	    echo "note: bubblewrap is not installed, so student code runs without namespaces (sudo apt-get install bubblewrap)"; \
	  fi; }

clean:
	rm -rf docs/_build docs/_generated build *.egg-info
