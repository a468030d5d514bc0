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
	$(VENV)/bin/autopar plan --model llama3-70b --cluster dgx-h100 --nodes 16 --global-batch 512 --seq-len 8192 --plots out/llama3-70b
	$(VENV)/bin/autopar plan --model gpt3-175b --cluster dgx-a100-80g --nodes 128 --global-batch 1536 --seq-len 2048 --dtype fp16 --plots out/gpt3-175b
	$(PY) benchmarks/collectives.py --profile dgx-h100 --role large --role heldout --role small

# one-process tests on two workers; the multi-rank ones (each launch already runs a process
# per rank) one at a time
test: $(STAMP)
	$(PY) -m pytest -q -n 2 tests/unit
	$(PY) -m pytest -q tests/distributed

bench: $(STAMP)
	$(PY) benchmarks/collectives.py

clean:
	rm -rf $(VENV) build *.egg-info
