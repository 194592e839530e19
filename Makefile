# aenv: `make run` (demo) and `make test` are the two commands a new user needs.
# Every target is idempotent; `install` does only what is missing.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
APT_PACKAGES := debootstrap nftables iproute2 procps libc-bin binutils btrfs-progs docker-registry skopeo apache2-utils busybox-static zstd libfuse2 libseccomp2 etcd-server etcd-client
STAMP := $(VENV)/.installed
BUNDLE := /opt/aenv/runtime/py311/.complete
CRIU := /usr/local/sbin/criu
CRIU_VERSION := 4.2.1
# The e2e suites run a second time against the qemu runtime (AENV_TEST_RUNTIME=qemu).
E2E_QEMU := tests/e2e/test_sdk_sync.py tests/e2e/test_sdk_async.py tests/e2e/test_pause_resume.py \
	tests/e2e/test_snapshot_fork.py tests/e2e/test_restart.py tests/e2e/test_isolation.py \
	tests/e2e/test_cli.py tests/e2e/test_api_errors.py tests/e2e/test_websocket.py \
	tests/e2e/test_proxy_wire.py

.PHONY: install criu run test test-fast test-js bench lint clean vm test-vm test-e2e-qemu bench-vm soak fuzz-long

install: $(STAMP) $(BUNDLE) criu vm

# The qemu runtime: QEMU, the guest kernel and the VM artefacts (idempotent, seconds when done).
vm: $(STAMP) $(BUNDLE)
	@PY=$(PY) bash scripts/install-vm.sh

# CRIU for checkpoint/restore (pause, resume, snapshot, fork): built from source, ~70 s once.
criu:
	@bash scripts/install-criu.sh

$(STAMP): pyproject.toml
	@missing=$$(for p in $(APT_PACKAGES); do dpkg-query -W -f='$${Status}\n' $$p 2>/dev/null | grep -q "ok installed" || echo $$p; done); \
	if [ -n "$$missing" ]; then \
	  echo "installing apt packages: $$missing"; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing >/dev/null; \
	fi
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check -e '.[test,rollouts]'
	@touch $(STAMP)

$(BUNDLE): $(STAMP) $(shell find src/aenv/envd -name "*.py" 2>/dev/null) src/aenv/runtime/pybundle.py src/aenv/runtime/container/zygote.py src/aenv/runtime/container/linux.py
	$(PY) -m aenv.runtime.pybundle build

run: install
	$(PY) scripts/demo.py

test: install
	$(PY) -m pytest -q -ra
	$(MAKE) test-js

# The official JavaScript SDK (npm e2b, pinned in tests/js/package-lock.json) against a real
# server: tests/js/*.test.mjs under node's test runner. Needs Node >= 20.18.1 (e2b's engines;
# Debian 12's nodejs is 18: install Node 20 from nodejs.org or NodeSource).
JS_DEPS := tests/js/node_modules/.package-lock.json
test-js: install $(JS_DEPS)
	$(PY) tests/js/run.py

$(JS_DEPS): tests/js/package.json tests/js/package-lock.json
	@node -e 'const [a,b]=process.versions.node.split(".").map(Number); process.exit(a>20||(a===20&&b>=18)?0:1)' \
	  || { echo "make test-js: Node >= 20.18.1 is needed (found $$(node --version 2>/dev/null || echo none))"; exit 1; }
	cd tests/js && npm ci --no-audit --no-fund

test-fast: install
	$(PY) -m pytest -q -ra -m "not slow"

# The qemu runtime's own suite, then the SDK e2e suites again with every sandbox a microVM.
test-vm: install
	$(PY) -m pytest -q -ra tests/vm
	$(MAKE) test-e2e-qemu

test-e2e-qemu: install
	AENV_TEST_RUNTIME=qemu $(PY) -m pytest -q -ra $(E2E_QEMU)

bench-vm: install
	$(PY) -m aenv.bench.vm_bench

bench: install
	$(PY) -m aenv.bench

# A bounded soak under server kill -9 (aenv.bench.soak; figures in docs/reliability.md).
# SOAK_ARGS to change it, e.g. make soak SOAK_ARGS="--minutes 5 --sandboxes 2".
SOAK_ARGS ?= --minutes 30 --sandboxes 4 --kill-every 180 --kill-mode anywhere
SOAK_JSON ?= /tmp/aenv-soak.json
soak: install
	$(PY) -m aenv.bench.soak $(SOAK_ARGS) --json $(SOAK_JSON)

# The long run of envd's parser fuzz (20x the examples of the one in `make test`).
fuzz-long: install
	AENV_FUZZ_LONG=1 $(PY) -m pytest -q -ra tests/envd/test_fuzz_parsers.py -k long

lint: install
	$(VENV)/bin/ruff check src tests
	$(VENV)/bin/mypy

clean:
	rm -rf $(VENV) build *.egg-info
