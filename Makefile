# livemig — two commands: `make demo` and `make test`. Everything else is a step of them.
SHELL := /bin/bash
.ONESHELL:
.SHELLFLAGS := -eu -o pipefail -c

PY        ?= python3
VENV      := .venv
BIN       := $(VENV)/bin
QEMU      := build/qemu/qemu-system-x86_64
GUEST     := build/guest/vmlinuz build/guest/initrd.img
PYTEST_ARGS ?=
DEMO_ARGS ?= --memory 1G --workload mem:size=384M,rate=96M,hot=90/10 --bandwidth 128M \
             --max-time 240 --report reports/demo.json

.PHONY: help setup deps venv qemu qemu-upstream guest rootfs demo test test-long lint unit qtest clean \
        install-qemu

help:
	@echo "make demo    migrate a busy VM with live progress, verify it, write reports/demo.json"
	@echo "make test    lint + unit + integration tests (real QEMU, real guests) +"
	@echo "             QEMU's migration qtests (one per patch, three of upstream's)"
	@echo "make test-long  the long matrices (crash/fault matrix, evacuation, soak) and"
	@echo "             the qtests' whole quick set: run before an issue is called resolved"
	@echo "make setup   install packages, build QEMU and the guest image, put livemig on PATH"
	@echo "make qtest   QEMU's own migration qtests (quick set) against build/qemu"
	@echo "make install-qemu  the built QEMU under /opt/livemig/qemu for libvirt domains (no -L;"
	@echo "             INSTALL_ARGS=\"--prefix DIR\" or \"--uninstall\"; docs/install.md)"

deps:
	@bash .ci/deps.sh

venv: $(BIN)/.stamp
$(BIN)/.stamp: pyproject.toml
	@echo "== python venv ($(VENV))"
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[dev,libvirt]'
	ln -sf "$(CURDIR)/$(BIN)/livemig" /usr/local/bin/livemig
	touch $@

qemu:
	@bash qemu/build.sh

qemu-upstream:
	@bash qemu/build.sh --unpatched

# the built QEMU where a libvirt domain names it as <emulator> with no -L
# (docs/install.md); e.g. INSTALL_ARGS="--prefix /opt/livemig/qemu" or "--uninstall"
INSTALL_ARGS ?=
install-qemu: venv
	$(BIN)/livemig install-qemu $(INSTALL_ARGS)

guest:
	@bash guest/build.sh

# the service guests' Debian root filesystems (pgbench:, redis: workloads)
rootfs: guest
	@bash guest/rootfs/build.sh redis
	@bash guest/rootfs/build.sh --param scale=20 postgres

setup: deps venv qemu qemu-upstream guest rootfs
	@echo "== setup done: $$(command -v livemig)"

demo: setup
	mkdir -p reports
	livemig migrate $(DEMO_ARGS)

# lint-imports: the import contracts in pyproject.toml (the engine imports none of its
# callers; the policies only policy, errors and units); mypy --strict on src
lint: venv
	$(BIN)/ruff check src tests
	$(BIN)/lint-imports --no-cache
	$(BIN)/mypy

unit: venv
	$(BIN)/pytest -q tests/unit $(PYTEST_ARGS)

test: setup lint
	$(BIN)/pytest -v --durations=40 -m "not long" $(PYTEST_ARGS)
	@bash qemu/run-qtests.sh --representative

# the matrices `make test` keeps one representative case of
test-long: setup lint
	$(BIN)/pytest -v --durations=15 -m long $(PYTEST_ARGS)
	@bash qemu/run-qtests.sh

qtest: qemu
	@bash qemu/run-qtests.sh

clean:
	rm -rf build $(VENV) reports .pytest_cache .ruff_cache
