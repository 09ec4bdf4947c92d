# The course's two commands: `make lab` (start learning) and `make test` (prove it all works).
# Each sets up .venv by itself on a fresh machine: install, then prepare the offline model.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed-stamp
NBVAL  := --nbval --nbval-current-env --nbval-sanitize-with tests/nbval_sanitize.cfg
# pytest workers; each runs torch on one thread (two threads per process on two cores thrash)
JOBS   ?= 2

.PHONY: lab test test-fast model bench clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check --upgrade pip
	$(PY) -m pip install -q --disable-pip-version-check -e .
	touch $(STAMP)

model: $(STAMP)
	$(PY) -m minikv.cli prepare

# Jupyter refuses to start as root unless told to (containers, cloud notebooks): pass --allow-root there.
ALLOW_ROOT := $(if $(filter 0,$(shell id -u)),--allow-root)

lab: model
	$(VENV)/bin/jupyter lab --notebook-dir=. $(ALLOW_ROOT) notebooks/00_tour.ipynb

# unit + equivalence + property tests, and every notebook, exercise and solution through nbval
# (--dist loadfile keeps each notebook's cells in order on one worker)
test: model
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -n $(JOBS) --dist loadfile $(NBVAL) tests notebooks exercises solutions

test-fast: $(STAMP)
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -n $(JOBS) --dist loadfile tests -m "not slow"

bench: model
	$(PY) -m minikv.cli bench $(NAME)

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
