# Two commands on a fresh machine:  `make demo`  and  `make test`  (see README.md).
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(VENV)/bin/pip -q
LOCK   := constraints/cpu.txt
DEMO_DATA ?= .cache/data/shakespeare-bpe4k-s128
export TORCH_EXTENSIONS_DIR ?= $(CURDIR)/.cache/torch_extensions

.PHONY: install demo test test-fast clean-demo

# The pinned CPU stack. torch and deepspeed go first: deepspeed builds against the
# installed torch (no build isolation, no compiled ops), and the lock keeps every later
# install from replacing torch.
$(VENV)/.installed: pyproject.toml setup.py $(LOCK)
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --upgrade pip
	$(PIP) install -c $(LOCK) torch torchvision
	DS_BUILD_OPS=0 $(PIP) install -c $(LOCK) --no-build-isolation deepspeed
	$(PIP) install -c $(LOCK) -e '.[test,hf]'
	touch $@

install: $(VENV)/.installed

$(DEMO_DATA)/index.json: | $(VENV)/.installed
	$(VENV)/bin/t2train data prepare --corpus shakespeare --out $(DEMO_DATA) \
	    --seq-length 128 --vocab-size 4096 --overwrite

demo: $(VENV)/.installed $(DEMO_DATA)/index.json
	rm -rf runs/demo
	$(VENV)/bin/t2train train --preset tiny name=demo data.path=$(DEMO_DATA)

test: $(VENV)/.installed
	$(PY) -m pytest -q --durations=25

# The fast tier while you work: no multi-process runs, no SLURM, no long training (docs/testing.md).
test-fast: $(VENV)/.installed
	$(PY) -m pytest -q -m "not slow and not slurm" --durations=10

clean-demo:
	rm -rf runs/demo $(DEMO_DATA)
