# Two commands on a fresh machine: `make demo` and `make test`. Each sets itself up.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
CHECKOV_VENV := $(VENV)/tools/checkov
# NVRx as the training image pins it. Its wheels are cp312/cp314 only, but every module is pure Python
# apart from the CUPTI extension (straggler detection, unused here): the cp312 wheel's files go into a
# folder that a .pth file puts on this venv's path; its console scripts ft_launcher and nvrx-control
# (the rendezvous store) are written as the wheel's entry points declare them.
NVRX_VERSION := 0.7.0
NVRX_DIR := $(abspath $(VENV))/nvrx-$(NVRX_VERSION)
export JSII_SILENCE_WARNING_DEPRECATED_NODE_VERSION := 1
export JSII_SILENCE_WARNING_END_OF_LIFE_NODE_VERSION := 20
export PIP_DISABLE_PIP_VERSION_CHECK := 1

# $(call console_script,NAME,MODULE): .venv/bin/NAME runs nvidia_resiliency_ext.fault_tolerance.MODULE:main
define console_script
	printf '#!%s\nimport sys\nfrom nvidia_resiliency_ext.fault_tolerance.$(2) import main\nsys.exit(main())\n' \
		$(abspath $(PY)) > $(VENV)/bin/$(1)
	chmod +x $(VENV)/bin/$(1)
endef

.PHONY: setup demo demo-hf test synth manifests bench clean

# The three installs are independent: side by side, one's unpacking overlaps another's downloads.
setup:
	$(MAKE) --jobs=3 --output-sync=target $(VENV)/.installed $(CHECKOV_VENV)/.installed node_modules/.installed

$(VENV)/.installed: requirements.txt Makefile  # a changed recipe (e.g. a new console script) reinstalls
	@# mkdir first: the checkov venv, made beside this one, creates .venv/ too, and venv's own makedirs
	@# fails with 'File exists' when that lands between its check and its mkdir
	mkdir -p $(VENV)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@# the pinned pip first: it installs the rest faster than the one venv brings
	$(PY) -m pip install --quiet $$(grep '^pip==' requirements.txt)
	@# pip compiles the modules it installs on one core; compileall uses every core. It exits 1 when a file
	@# does not compile (a package's Python 2 fixture), which pip skips too.
	$(PY) -m pip install --quiet --no-compile -r requirements.txt
	$(PY) -m compileall -qq -j 0 $$($(PY) -c "import sysconfig; print(sysconfig.get_paths()['purelib'])") || true
	$(PY) -m pip uninstall --quiet --yes nvidia-resiliency-ext pynvml  # an older NVRx, its pynvml shim
	rm -rf $(VENV)/nvrx-*
	$(PY) -m pip install --quiet --no-deps --only-binary=:all: --implementation cp --python-version 3.12 \
		--platform manylinux_2_39_x86_64 --target $(NVRX_DIR) nvidia-resiliency-ext==$(NVRX_VERSION)
	$(PY) -c "import site, sys; open(site.getsitepackages()[0] + '/nvrx.pth', 'w').write(sys.argv[1] + '\\n')" $(NVRX_DIR)
	$(call console_script,ft_launcher,launcher)
	$(call console_script,nvrx-control,control_plane)
	$(PY) -c "import importlib.metadata as m, sys; v = m.version('nvidia-resiliency-ext'); sys.exit(0 if v == '$(NVRX_VERSION)' else 'NVRx ' + v + ' is not $(NVRX_VERSION)')"
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

# Every test on four workers (pytest-xdist; loadgroup keeps an xdist_group's tests on one worker): two cores
# stay busy while local-cluster runs wait (a timeout, a replacement's delay), which forked commands
# (training.pod.forked) make cheap in CPU time. Then those marked alone, one at a time: their time bounds
# assume the machine is theirs; that pass collects only the files that mark one. Each part lists its slowest
# tests, so a suite that grows names what grew.
ALONE_FILES = $(shell grep -rl --include='test_*.py' 'pytest.mark.alone' tests)
test: setup
	$(PY) -m pytest -q -m "not alone" -n 4 --dist loadgroup --durations=20
	$(PY) -m pytest -q -m alone --durations=5 $(ALONE_FILES)

synth: setup
	rm -rf cdk.out
	npx cdk synth --quiet

# make manifests MANIFESTS_ARGS="--train-config k8s/train-replicas.yaml": replica groups (docs/replica-groups.md)
manifests: setup
	$(PY) k8s/main.py $(MANIFESTS_ARGS)

demo: $(VENV)/.installed
	$(PY) -m training.local --demo

# The demo on a Hugging Face model: a tiny Llama that the command writes itself (config.json and seeded
# model.safetensors, nothing downloaded), trained from those weights through the same faults.
HF_DEMO_MODEL := runs/tiny-hf-llama
demo-hf: $(VENV)/.installed
	$(PY) -m training.models tiny $(HF_DEMO_MODEL) --family llama
	$(PY) -m training.local --demo model.source=huggingface model.path=$(HF_DEMO_MODEL)

# make bench BENCH_ARGS=--quick: the short profile (< 3 min)
bench: $(VENV)/.installed
	$(PY) -m bench.run $(BENCH_ARGS)

clean:
	rm -rf cdk.out dist runs .pytest_cache
