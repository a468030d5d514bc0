# Two commands do everything on a fresh machine: `make demo` and `make test`.
# Both create .venv when it is missing: torch==2.13.0 first (a local CPU wheel on these
# machines; a looser pin would download a multi-GB CUDA build), then the project with its extras.

PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: demo test venv bench clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/autopar profiles
	$(PY) benchmarks/collectives.py --profile dgx-h100 --role large --role heldout --role small
	$(VENV)/bin/autopar collective --cluster dgx-h100 --nodes 16 --kind all_reduce --ranks 0-127:8 --size 1MiB 64MiB 1GiB

test: $(STAMP)
	$(PY) -m pytest -q tests

bench: $(STAMP)
	$(PY) benchmarks/collectives.py

clean:
	rm -rf $(VENV) build *.egg-info
