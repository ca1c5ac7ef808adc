# Two commands on a fresh machine:  `make demo`  and  `make test`  (see README.md).
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(VENV)/bin/pip -q
LOCK   := constraints/cpu.txt
# transformers 5 beside the lock's 4.x, for the test that exports load under both
TRANSFORMERS5 := constraints/transformers5.txt
DEMO_DATA ?= .cache/data/shakespeare-bpe4k-s128
export TORCH_EXTENSIONS_DIR ?= $(CURDIR)/.cache/torch_extensions

.PHONY: install demo heldout-data check test test-record test-fast test-mutations clean-demo \
	gpu-bundle gpu-check \
	gpu-check-multi

# The pinned CPU stack. torch and deepspeed go first: deepspeed builds against the
# installed torch (no build isolation, no compiled ops), and the lock keeps every later
# install from replacing torch.
$(VENV)/.installed: pyproject.toml setup.py $(LOCK) $(TRANSFORMERS5)
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --upgrade pip
	$(PIP) install -c $(LOCK) torch torchvision
	DS_BUILD_OPS=0 $(PIP) install -c $(LOCK) --no-build-isolation deepspeed
	$(PIP) install -c $(LOCK) -e '.[test,check,hf,eval,wandb,fp8]'
	rm -rf $(VENV)/transformers5
	$(PIP) install --no-deps --target $(VENV)/transformers5 -r $(TRANSFORMERS5)
	touch $@

install: $(VENV)/.installed

DEMO_PREPARE = $(VENV)/bin/t2train data prepare --corpus shakespeare --seq-length 128 \
	--vocab-size 4096 --overwrite

# The demo's data: validation samples drawn at random from the same plays as training.
$(DEMO_DATA)/index.json: | $(VENV)/.installed
	$(DEMO_PREPARE) --out $(DEMO_DATA)

# The same corpus with whole plays held out as the validation split (both editions of each
# play, so none of its text is trained on): what `t2train experiment compare` evaluates on
# (docs/benchmarks.md). `make heldout-data`, then data.path=$(HELDOUT_DATA).
HELDOUT_DATA ?= .cache/data/shakespeare-heldout-bpe4k-s128
HELDOUT_PLAYS ?= hamlet_* macbeth_* tempest_*
$(HELDOUT_DATA)/index.json: | $(VENV)/.installed
	$(DEMO_PREPARE) --out $(HELDOUT_DATA) $(foreach play,$(HELDOUT_PLAYS),--val-files '$(play)')

heldout-data: $(HELDOUT_DATA)/index.json

demo: $(VENV)/.installed $(DEMO_DATA)/index.json
	rm -rf runs/demo
	$(VENV)/bin/t2train train --preset tiny name=demo data.path=$(DEMO_DATA)

# Lint, format check and type check (pyproject.toml's [tool.ruff] and [tool.mypy]); CI runs
# it before the tests. `$(VENV)/bin/ruff format .` applies the format.
check: $(VENV)/.installed
	$(VENV)/bin/ruff check .
	@! grep -rnE --include='*.py' 'noqa: PLC0415 *$$' t2train launch kernels data \
		|| { echo "a deferred import says why: # noqa: PLC0415 - <why>"; exit 1; }
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy --python-executable $(PY)

# Two workers, each given whole test files (module fixtures are built once); the multi-process
# tests leave a core idle much of the time. TEST_WORKERS=0 runs in this process. Files go out
# in collection order (tests/conftest.py puts the longest recorded first), not xdist's default
# of the files with the most tests first, which left the one-test soak file to run alone.
TEST_WORKERS ?= 2
XDIST = -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder

# --budget: fail when a test file or the suite is over its time budget (tests/suite_budget.py).
test: $(VENV)/.installed
	$(PY) -m pytest -q $(XDIST) --durations=25 --budget

# The last full run's per-file durations become the record the budget judges against
# (tests/durations.json; each file at the slowest of it and the full runs in EARLIER, a list
# of saved last-full.json files), and the README's figure is rewritten from it.
EARLIER ?=
test-record: $(VENV)/.installed
	$(PY) tests/suite_budget.py record $(EARLIER)

# The fast tier while you work: no multi-process runs, no SLURM, no long training (docs/testing.md).
test-fast: $(VENV)/.installed
	$(PY) -m pytest -q $(XDIST) -m "not slow and not slurm" --durations=10

# Each named mistake of tests/mutations/catalog.py against the fast math tests (docs/testing.md).
test-mutations: $(VENV)/.installed
	$(PY) -m tests.mutations

clean-demo:
	rm -rf runs/demo $(DEMO_DATA) $(HELDOUT_DATA)

# The GPU check (docs/gpu/README.md). Here, with network: the offline bundle it installs from.
gpu-bundle: $(VENV)/.installed
	$(PY) -m tools.gpu_check.bundle --out .gpu-bundle --max-mib 48

# On the GPU machine: `make gpu-check OUT=dir` (or `python3 -m tools.gpu_check dir`, no make needed).
# Here: `make gpu-check DRY_RUN=1 OUT=dir`, the same plan on the CPU at tiny shapes.
# QUICK=1: the baseline and the targeted variants only (about 3.5 minutes on a GPU).
# STACK=1: the rest of the stack (tests, resume, DeepSpeed, planner memory, export), its own command.
OUT ?= runs/gpu-check
GPU_CHECK_FLAGS := $(if $(QUICK),--quick) $(if $(STACK),--stack)
gpu-check:
ifdef DRY_RUN
	$(PY) -m tools.gpu_check.check --dry-run --out $(OUT) $(GPU_CHECK_FLAGS)
else
	python3 -m tools.gpu_check $(OUT) $(GPU_CHECK_FLAGS)
endif

# On a machine with 2 or more GPUs: install the bundle, then TP = 2, PP = 2 (exact-size hops,
# the depth cache), DP = 2 and ZeRO across 2 GPUs against one process (tests/test_multi_gpu.py).
gpu-check-multi:
	python3 -m tools.gpu_check.install --bundle .gpu-bundle
	python3 -m pytest -v -m multi_gpu tests/test_multi_gpu.py
