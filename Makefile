# The course's two commands: `make lab` (start learning) and `make test` (prove it all works).
# Each sets up .venv by itself on a fresh machine: install, then prepare the offline model.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed-stamp
NBVAL  := --nbval --nbval-current-env --nbval-sanitize-with tests/nbval_sanitize.cfg
# pytest workers; each runs torch on one thread (two threads per process on two cores thrash). A third
# worker was tried on 2 cores, in three pairs of runs: its wall time moved either way (674 against 766 s,
# 673 against 683, 715 against 669) and its CPU time was 6% lower, 6% higher and 14% higher
JOBS   ?= 2

.PHONY: lab lint test test-fast model bench clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check --upgrade pip
	$(PY) -m pip install -q --disable-pip-version-check -e .
	touch $(STAMP)

model: $(STAMP)
	$(PY) -m minikv.cli prepare

# Jupyter refuses to start as root unless told to (containers, cloud notebooks): pass --allow-root there.
ALLOW_ROOT := $(if $(filter 0,$(shell id -u)),--allow-root)

# `make lab` opens learners' copies: my_notebooks/ (git-ignored by its own .gitignore) gets a copy of each
# notebook it lacks, so running and saving (JupyterLab autosaves) never rewrites a tracked notebook and
# `git pull` never conflicts; delete a copy to get the course's newest version. Exercises stay in place:
# they are the learner's own work, graded and committed there (classroom/README.md). $(LAB_SETTINGS)
# (overrides.json) makes the widget manager save widget state with the notebook, so a saved notebook
# reopens with its views, never "Error displaying widget: model not found". Kernels get one torch thread
# unless OMP_NUM_THREADS is set (two threads per kernel on a busy 2-core machine thrash, as in `make test`).
LAB_COPIES   := my_notebooks
LAB_SETTINGS := lab/settings

lab: model
	mkdir -p $(LAB_COPIES) && printf '*\n' > $(LAB_COPIES)/.gitignore
	for nb in notebooks/*.ipynb; do test -e $(LAB_COPIES)/$${nb##*/} || cp $$nb $(LAB_COPIES)/; done
	OMP_NUM_THREADS=$${OMP_NUM_THREADS:-1} $(VENV)/bin/jupyter lab --notebook-dir=. $(ALLOW_ROOT) \
	  --LabApp.app_settings_dir=$(CURDIR)/$(LAB_SETTINGS) $(LAB_COPIES)/00_tour.ipynb

# ruff with the rules in pyproject.toml ([tool.ruff]): under a second, so both test targets run it first
lint: $(STAMP)
	$(VENV)/bin/ruff check .

# unit + equivalence + property tests, and every notebook, exercise and solution through nbval
# (--dist loadfile keeps each notebook's cells in order on one worker)
test: lint model
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -n $(JOBS) --dist loadfile $(NBVAL) tests notebooks exercises solutions

test-fast: lint
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -n $(JOBS) --dist loadfile tests -m "not slow"

bench: model
	$(PY) -m minikv.cli bench $(NAME)

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis .ruff_cache
