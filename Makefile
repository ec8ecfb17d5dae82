# Two commands on a fresh machine: `make demo` and `make test`. Each sets itself up.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
CHECKOV_VENV := $(VENV)/tools/checkov
export JSII_SILENCE_WARNING_DEPRECATED_NODE_VERSION := 1
export JSII_SILENCE_WARNING_END_OF_LIFE_NODE_VERSION := 20
export PIP_DISABLE_PIP_VERSION_CHECK := 1

.PHONY: setup demo test synth manifests bench clean

setup: $(VENV)/.installed $(CHECKOV_VENV)/.installed node_modules/.installed

$(VENV)/.installed: requirements.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet -r requirements.txt
	@# A CUDA torch in .venv means the pin was bypassed: stop rather than test the wrong build.
	$(PY) -c "import torch, sys; v = torch.__version__; sys.exit(0 if v.startswith('2.13.0') and torch.version.cuda is None else 'torch ' + v + ' is not the 2.13.0 CPU build')"
	touch $@

$(CHECKOV_VENV)/.installed: requirements-checkov.txt
	test -x $(CHECKOV_VENV)/bin/python || $(PYTHON) -m venv $(CHECKOV_VENV)
	$(CHECKOV_VENV)/bin/pip install --quiet -r requirements-checkov.txt
	touch $@

node_modules/.installed: package.json package-lock.json
	npm ci --no-audit --no-fund --loglevel=error
	touch $@

test: setup
	$(PY) -m pytest -q

synth: setup
	rm -rf cdk.out
	npx cdk synth --quiet

manifests: setup
	$(PY) k8s/main.py

demo: $(VENV)/.installed
	$(PY) -m training.local --demo

# make bench BENCH_ARGS=--quick: the short profile (< 3 min)
bench: $(VENV)/.installed
	$(PY) -m bench.run $(BENCH_ARGS)

clean:
	rm -rf cdk.out dist runs .pytest_cache
