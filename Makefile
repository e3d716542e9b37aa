# gelastic: `make demo` runs a real multi-node job on this host; `make test` runs every test;
# `make check` only the fast tiers (lint, types, unit and service tests), for every change;
# `make fuzz` hunts with the property tests for longer, at random.
# Each creates its own virtualenv in .venv and installs what it needs.

PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
PROTO  := protos/gelastic/v1/gelastic.proto
ETCD_PROTO := protos/etcd/rpc.proto

.PHONY: setup netns-tools etcd-server slurm browser protos check-protos fmt lint typecheck check test test-fast test-gpu fuzz demo bench clean

setup: $(STAMP) netns-tools etcd-server slurm browser

# The network-fault test builds namespaces with `ip`; install it when we may (root, apt). Checked
# on every `make test`, not only when the virtualenv is made: under CI that test fails, not skips,
# without it.
netns-tools:
	@command -v ip >/dev/null 2>&1 || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1 && \
		(apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq iproute2 >/dev/null) \
		|| echo "note: iproute2 is not installed; the network-namespace test will skip (and fail under CI)"; }

# The etcd store's tests start a real etcd (Debian's etcd-server, 3.4.x on bookworm); installed
# like `ip` above. Under CI those tests fail, not skip, without it.
etcd-server:
	@command -v etcd >/dev/null 2>&1 || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1 && \
		(apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq etcd-server >/dev/null) \
		|| echo "note: etcd is not installed; the etcd store tests will skip (and fail under CI)"; }

# `gelastic run` under srun is tested against a private single-host Slurm (Debian's slurm-wlm,
# 22.05.x on bookworm, and munge; tests/_slurm.py starts its own daemons and touches none of the
# system's); installed like `ip` above. Under CI those tests fail, not skip, without it.
slurm:
	@PATH="$$PATH:/usr/sbin:/sbin"; command -v slurmctld >/dev/null 2>&1 && \
		command -v munged >/dev/null 2>&1 || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1 && \
		(apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq slurm-wlm munge >/dev/null) \
		|| echo "note: Slurm is not installed; the Slurm tests will skip (and fail under CI)"; }

# The dashboard's browser tests drive the system Chromium through Playwright (never Playwright's
# own browser download); installed like `ip` above. Under CI those tests fail, not skip, without it.
browser:
	@command -v chromium >/dev/null 2>&1 || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1 && \
		(apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null) \
		|| echo "note: chromium is not installed; the dashboard's browser tests will skip (and fail under CI)"; }

# The editable install puts the checkout on sys.path with a plain .pth line (`compat`), not
# setuptools' import hook: the hook imports pathlib, urllib and more at every interpreter start,
# about 10 ms of each worker's CPU that a wheel install never pays, so benchmarks would measure it.
EDITABLE := --config-settings editable_mode=compat

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[dev,torch,gpu]' $(EDITABLE)
	@touch $(STAMP)

protos: $(STAMP)
	$(PY) -m grpc_tools.protoc -I. --python_out=. --pyi_out=. --grpc_python_out=. $(PROTO)
	$(PY) -m grpc_tools.protoc -I. --python_out=. --pyi_out=. --grpc_python_out=. $(ETCD_PROTO)

# Regenerate into a scratch tree and fail on any difference from the committed code.
check-protos: $(STAMP)
	@rm -rf .protos-check && mkdir -p .protos-check
	@$(PY) -m grpc_tools.protoc -I. --python_out=.protos-check --pyi_out=.protos-check \
		--grpc_python_out=.protos-check $(PROTO) $(ETCD_PROTO)
	@for f in gelastic/v1/gelastic_pb2.py gelastic/v1/gelastic_pb2.pyi gelastic/v1/gelastic_pb2_grpc.py \
		etcd/rpc_pb2.py etcd/rpc_pb2.pyi etcd/rpc_pb2_grpc.py; do \
		diff -q .protos-check/protos/$$f protos/$$f >/dev/null || \
		{ echo "check-protos: protos/$$f is out of date; run 'make protos'"; rm -rf .protos-check; exit 1; }; \
	done
	@rm -rf .protos-check
	@echo "check-protos: generated code matches $(PROTO) $(ETCD_PROTO)"

fmt: $(STAMP)
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

typecheck: $(STAMP)
	$(VENV)/bin/mypy

# -rsx: every skip and expected failure prints its reason. The ci hypothesis profile is derandomized (tests/conftest.py).
# Exit 5 (no test collected) fails like any other: a suite that ran nothing checked nothing.
# tests/gpu (real GPUs, NCCL) is not collected on a host without an NVIDIA GPU, where a skip
# would fail CI; `make test` says so in one line, and `make test-gpu` runs it on its own.
PYTEST_ARGS ?= tests
test: $(STAMP) netns-tools etcd-server slurm browser check-protos lint typecheck
	@$(PY) -c 'import sys; from tests.gpu import nvidia_gpu_present; sys.exit(not nvidia_gpu_present())' \
		|| echo "tests/gpu: not run, no NVIDIA GPU"
	GELASTIC_HYPOTHESIS_PROFILE=ci $(PY) -m pytest -q -rsx --durations=25 -p no:cacheprovider $(PYTEST_ARGS); \
		rc=$$?; [ $$rc -ne 5 ] || echo "make test: pytest collected no tests (exit 5): failing"; \
		exit $$rc

# The fast tiers, for every change: lint, types, tests/unit and tests/service (in-process
# servers, a real etcd), in under 3 minutes on 2 cores. `make test` (CI) runs the whole suite.
check: $(STAMP) etcd-server lint typecheck
	$(PY) -m pytest -q -rsx -p no:cacheprovider tests/unit tests/service

# The GPU end-to-end test alone (2+ NVIDIA GPUs, NCCL); without them it skips and says why.
test-gpu: $(STAMP)
	GELASTIC_GPU_TESTS=1 $(PY) -m pytest -q -rsx -p no:cacheprovider tests/gpu

test-fast: $(STAMP)
	$(PY) -m pytest -q -rsx -p no:cacheprovider tests/unit

# Ten times the examples, random, failures kept in .hypothesis/ for the next run. A case may take
# longer than the suite's per-test timeout; FUZZ_TIMEOUT bounds it instead.
FUZZ_TESTS   ?= tests/unit/test_cluster_fuzz.py tests/service/test_fuzz_service.py \
                tests/security/test_spec_fuzz.py
FUZZ_TIMEOUT ?= 3600
fuzz: $(STAMP)
	GELASTIC_HYPOTHESIS_PROFILE=fuzz $(PY) -m pytest -q -rsx -p no:cacheprovider \
		--timeout=$(FUZZ_TIMEOUT) $(FUZZ_TESTS)

# DEMO_ARGS: e.g. "--steps 10 --events" (see examples/demo.py).
DEMO_ARGS ?=
demo: $(STAMP)
	$(PY) examples/demo.py $(DEMO_ARGS)

bench: $(STAMP)
	$(PY) -m pip install --quiet -e '.[bench]' $(EDITABLE)
	$(PY) -m bench

clean:
	rm -rf $(VENV) .protos-check .pytest_cache .mypy_cache .ruff_cache .hypothesis
