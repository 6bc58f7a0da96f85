# The two set-up commands of the README: `make train` and `make test`. Both create the virtual environment on
# first use and reinstall only when the pinned requirements change.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python

$(VENV)/.runtime: requirements.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -r requirements.txt
	touch $@

$(VENV)/.test: requirements-test.txt $(VENV)/.runtime
	$(PY) -m pip install -q -r requirements-test.txt
	touch $@

.PHONY: train test bench
train: $(VENV)/.runtime
	$(PY) run_train.py --recipe recipes/tiny.yaml

test: $(VENV)/.test
	$(PY) -m pytest -q -p no:cacheprovider -n 2 --dist loadfile --no-loadscope-reorder tests

bench: $(VENV)/.test
	$(PY) -m bench.train_throughput
