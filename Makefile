# aenv: `make run` (demo) and `make test` are the two commands a new user needs.
# Every target is idempotent; `install` does only what is missing.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
APT_PACKAGES := debootstrap nftables iproute2 procps libc-bin binutils
STAMP := $(VENV)/.installed
BUNDLE := /opt/aenv/runtime/py311/.complete
CRIU := /usr/local/sbin/criu
CRIU_VERSION := 4.2.1

.PHONY: install criu run test test-fast bench lint clean

install: $(STAMP) $(BUNDLE) criu

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
	$(PY) -m pip install -q --disable-pip-version-check -e '.[test]'
	@touch $(STAMP)

$(BUNDLE): $(STAMP) $(shell find src/aenv/envd -name "*.py" 2>/dev/null) src/aenv/runtime/pybundle.py src/aenv/runtime/container/zygote.py src/aenv/runtime/container/linux.py
	$(PY) -m aenv.runtime.pybundle build

run: install
	$(PY) scripts/demo.py

test: install
	$(PY) -m pytest -q -ra

test-fast: install
	$(PY) -m pytest -q -ra -m "not slow"

bench: install
	$(PY) -m aenv.bench

lint: install
	$(VENV)/bin/ruff check src tests
	$(VENV)/bin/mypy

clean:
	rm -rf $(VENV) build *.egg-info
