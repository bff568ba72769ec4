# Two commands do all the set-up:  `make demo` (the main job) and `make test` (the tests).
# The development stack (torch 2.14.1 in requirements.txt) needs Python 3.10+; the launcher itself runs on 3.9+.
# PYTHON: the first of these that is 3.10 or newer (make PYTHON=/path/to/python3.x chooses another).
PYTHON ?= $(firstword $(foreach p,python3 python3.13 python3.12 python3.11 python3.10,\
	$(shell command -v $(p) >/dev/null 2>&1 && $(p) -c 'import sys; sys.exit(sys.version_info < (3, 10))' \
	2>/dev/null && echo $(p))))
PYTHON := $(PYTHON)
CHECK_PYTHON = "$(PYTHON)" -c 'import sys; sys.exit(sys.version_info < (3, 10))' 2>/dev/null || { echo \
	"make: the development stack (torch 2.14.1, SageMaker SDK 3.x) needs Python 3.10 or newer; PYTHON='$(PYTHON)' is not one (tried python3, python3.13 ... python3.10): set PYTHON=/path/to/python3.x" >&2; exit 2; }
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
# SDK 3.x (ModelTrainer) cannot share .venv with the 2.x SDK: its notebook's kernel gets its own venv.
VENV_V3  ?= .venv-v3
STAMP_V3 := $(VENV_V3)/.installed

.PHONY: demo test test-fast lint bench clean slurm-packages dist venv venv-v3

$(STAMP): requirements.txt setup.cfg pyproject.toml
	@$(CHECK_PYTHON)
	@echo "make: creating $(VENV) with $(PYTHON) ($$($(PYTHON) --version 2>&1))"
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -r requirements.txt
	$(PY) -m pip install --quiet --no-deps -e .
	touch $(STAMP)

$(STAMP_V3): requirements-v3.txt
	@$(CHECK_PYTHON)
	@echo "make: creating $(VENV_V3) with $(PYTHON) ($$($(PYTHON) --version 2>&1))"
	$(PYTHON) -m venv $(VENV_V3)
	$(VENV_V3)/bin/python -m pip install --quiet --upgrade pip
	$(VENV_V3)/bin/python -m pip install --quiet -r requirements-v3.txt
	touch $(STAMP_V3)

# The environments alone (the notebooks' kernels): .venv (SDK 2.x, torch) and .venv-v3 (SDK 3.x).
venv: $(STAMP)
venv-v3: $(STAMP_V3)

demo: $(STAMP)
	rm -rf runs/demo
	$(PY) -m launcher simulate --hosts 2 --nproc-per-node 1 --workdir runs/demo \
		-- train_scripts/train_digits.py --epochs 30

# The SLURM cluster tests (launcher/simulate/slurm_lab.py) need Debian's slurm-wlm and munge (about 9 s, 46 MB) and
# iproute2, the /tmp cleaner's test systemd-tmpfiles (systemd); installed as root when missing. Without root nothing
# is installed and those tests skip.
slurm-packages:
	@if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1 && \
	    ! { [ -x /usr/sbin/slurmd ] && [ -x /usr/sbin/munged ] && [ -x /usr/sbin/ip -o -x /sbin/ip ] && \
	        [ -x /usr/bin/systemd-tmpfiles ]; }; then \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq slurm-wlm munge iproute2 systemd \
			>/dev/null; \
	fi

# The tests that start no training job (torchrun), lab (SLURM, network namespaces) or notebook run on every
# core (pytest-xdist): under 2 minutes on 2 cores, no .venv-v3 needed (tests/conftest.py fails a test that
# starts one unmarked). The others run one at a time: their jobs and labs share ports and the machine's network.
FAST := not job and not lab and not notebook

test: $(STAMP) $(STAMP_V3) slurm-packages
	$(PY) -m ruff check .
	$(PY) -m pytest -q -n auto -m "$(FAST)"
	$(PY) -m pytest -q --durations=25 -m "not ($(FAST))"

test-fast: $(STAMP)
	$(PY) -m ruff check .
	$(PY) -m pytest -q -n auto -m "$(FAST)"

# What users install (docs/install.md): dist/ddp-launcher.pyz (one file: python ddp-launcher.pyz ... with any
# Python 3.9+ that has torch), the wheel (pip install gives the ddp-launcher command) and the sdist (Vertex AI's
# pythonPackageSpec). Built from this checkout with the venv's setuptools: no download.
dist: $(STAMP)
	rm -rf dist
	$(PY) -m build --no-isolation --outdir dist .
	$(PY) -m launcher zipapp --out dist/ddp-launcher.pyz

# NVIDIA's ft_launcher, run side by side by bench/bench_restart.py, kept out of .venv: its dependency pynvml makes
# every `import torch` print a deprecation warning into the workers' output. 0.4.1: the newest the index offers.
NVRX := .nvrx
$(NVRX)/.installed: $(STAMP)
	$(PY) -m pip install -q --no-deps --target $(NVRX) nvidia-resiliency-ext==0.4.1 defusedxml nvidia-ml-py
	touch $@

bench: $(STAMP) $(NVRX)/.installed
	$(PY) bench/run_all.py

clean:
	rm -rf $(VENV) $(VENV_V3) $(NVRX) runs dist
