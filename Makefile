# spark_hvd: `make demo` and `make test` do all set-up on a fresh Debian/Ubuntu machine.
SHELL := /bin/bash
PY ?= python3
VENV := .venv
VPY := $(VENV)/bin/python
# libgloo-dev and libopenmpi-dev are optional to the build (`pip install .` alone leaves out a
# backend whose library it does not find); installed here so every backend is built and tested.
APT_PACKAGES := libgloo-dev libopenmpi-dev openmpi-bin openssh-client cmake g++ make openjdk-17-jre-headless
# Only the suite needs an sshd binary (tests/multiproc/test_hosts.py runs its own on
# 127.0.0.2); `make test` installs it, `make demo` does not.
TEST_APT_PACKAGES := openssh-server
STAMP_DEPS := $(VENV)/.deps-stamp
STAMP_BUILD := $(VENV)/.build-stamp
# The suite's Azure Blob emulator (tests/_azure.py): Azurite from npm, under .venv/azurite.
# 3.35.0 is the newest release that runs on Node 20 (3.36 needs Node 21, 3.37 Node 22).
AZURITE_VERSION := 3.35.0
STAMP_AZURITE := $(VENV)/azurite/.installed-$(AZURITE_VERSION)
# The CUDA runtime and NCCL as the nvidia-* wheels ship them (headers and libraries, no
# GPU needed), for tests/fakes/test_real_nvidia_libraries.py: api.h against the real
# headers, the loader against the real libraries. Installed with --target beside the venv,
# not into it (spark_hvd in the venv would otherwise find them).
NVIDIA_LIBS := $(VENV)/nvidia-libs
NVIDIA_CU12 := nvidia-cuda-runtime-cu12==12.9.79 nvidia-cuda-nvcc-cu12==12.9.86 \
  nvidia-cuda-cccl-cu12==12.9.27
NVIDIA_CU13 := nvidia-cuda-runtime==13.5.37 nvidia-cuda-crt==13.5.37 \
  nvidia-cuda-cccl==13.3.5.0.6 nvidia-nccl-cu13==2.32.3
STAMP_NVIDIA := $(NVIDIA_LIBS)/.installed-cu12.9-cu13.5-nccl2.32
CORE_SOURCES := $(shell find csrc -type f) spark_hvd/settings.def CMakeLists.txt setup.py pyproject.toml
PYTEST_ARGS ?=

.PHONY: setup apt apt-test apt-install venv compat old-sparks test test-fast test-compat demo bench bench-scale clean wheel docs lint format

setup: apt $(STAMP_BUILD)

# Installs only what is missing (idempotent, no-op when everything is there).
apt:
	@$(MAKE) --no-print-directory apt-install PACKAGES="$(APT_PACKAGES)"

apt-test:
	@$(MAKE) --no-print-directory apt-install PACKAGES="$(TEST_APT_PACKAGES)"

apt-install:
	@missing=""; for p in $(PACKAGES); do dpkg -s $$p >/dev/null 2>&1 || missing="$$missing $$p"; done; \
	if [ -n "$$missing" ] && ! { [ "$$missing" = " openjdk-17-jre-headless" ] && command -v java >/dev/null; }; then \
	  echo "installing:$$missing"; \
	  SUDO=""; [ "$$(id -u)" = 0 ] || SUDO=sudo; \
	  $$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq $$missing; \
	fi

$(VPY):
	$(PY) -m venv $(VENV)
	$(VPY) -m pip install -q --upgrade pip

$(STAMP_DEPS): requirements/dev.txt | $(VPY)
	$(VPY) -m pip install -q -r requirements/dev.txt
	touch $@

$(STAMP_BUILD): $(STAMP_DEPS) $(CORE_SOURCES)
	$(VPY) -m pip install -q --no-build-isolation --no-deps -e .
	touch $@

# The compat environment (requirements/compat.txt): numpy 1.23, MXNet 1.9.1, pyarrow 14,
# petastorm 0.13.1 and CPU torch, for spark_hvd.mxnet and reader="petastorm". Same Python as
# the main venv, so the _core built above loads there too: spark_hvd comes from this
# checkout through a .pth file (no second build), spark-hvdrun through a two-line script.
# torch is installed without its declared setuptools>=77 (petastorm pins setuptools<70).
VENV_COMPAT := .venv-compat
CPY := $(VENV_COMPAT)/bin/python
COMPAT_NO_DEPS := torch==2.13.0+cpu
STAMP_COMPAT := $(VENV_COMPAT)/.compat-stamp
STAMP_CHECKOUT := $(VENV_COMPAT)/.checkout-stamp

$(STAMP_COMPAT): requirements/compat.txt | $(VPY)
	rm -rf $(VENV_COMPAT)
	$(PY) -m venv $(VENV_COMPAT)
	$(CPY) -m pip install -q -r requirements/compat.txt
	$(CPY) -m pip install -q --no-deps $(COMPAT_NO_DEPS)
	touch $@

$(STAMP_CHECKOUT): $(STAMP_COMPAT) requirements/spark_hvd_checkout.py
	site="$$($(CPY) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"; \
	cp requirements/spark_hvd_checkout.py "$$site/"; \
	printf '%s\nimport spark_hvd_checkout; spark_hvd_checkout.install(%s)\n' "$(CURDIR)" "'$(CURDIR)'" > "$$site/spark_hvd_checkout.pth"
	printf '#!%s\nfrom spark_hvd.runner.launch import main\nmain()\n' "$(CURDIR)/$(CPY)" > $(VENV_COMPAT)/bin/spark-hvdrun
	chmod +x $(VENV_COMPAT)/bin/spark-hvdrun
	touch $@

compat: $(STAMP_BUILD) $(STAMP_CHECKOUT)

# The older Sparks' environments (requirements/spark35.txt, spark40.txt): pyspark 3.5 and 4.0
# with the numpy, pandas and pyarrow each supports, for tests/spark_versions. Light: a venv
# without pip holds only what its requirements file lists (installed before anything else is
# on its path, so pip sees an empty venv), then a .pth file adds .venv's site-packages after
# its own: as a path line (spark.run's ranks leave such directories off their PYTHONPATH,
# where they would come before the venv's own numpy) and through site.addsitedir, so .venv's
# .pth files apply too: spark_hvd is .venv's editable install with its built _core (no second
# C++ build), and torch, TensorFlow, py4j, cloudpickle... are .venv's. `pip check` then
# checks every requirement across the two. --no-compile: the tests import a small part of
# what is installed (byte-compiling it all took 6-8 s of each install here).
OLD_SPARKS := spark35 spark40
MAIN_SITE = $(shell $(VPY) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')

.venv-%/.old-spark-stamp: requirements/%.txt | $(STAMP_BUILD)
	rm -rf .venv-$*
	$(PY) -m venv --without-pip .venv-$*
	$(VPY) -m pip --python .venv-$*/bin/python install -q --no-deps --no-compile \
	  -r requirements/$*.txt
	site="$$(.venv-$*/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"; \
	printf "%s\nimport site; site.addsitedir('%s')\n" "$(MAIN_SITE)" "$(MAIN_SITE)" \
	  > "$$site/spark_hvd_main_venv.pth"
	$(VPY) -m pip --python .venv-$*/bin/python check
	touch $@

old-sparks: $(foreach v,$(OLD_SPARKS),.venv-$(v)/.old-spark-stamp)

# What `make test` runs on each of OLD_SPARKS (groups spark35 and spark40), in one pytest
# process and one local[2] session: tests/spark_versions (the TorchDistributor drop-in, a
# TorchEstimator fit and transform whose predictions must equal pyspark 4.3's, Keras and
# Lightning fits and transforms, a Pipeline saved and loaded, the data checks' errors) and,
# from tests/spark, spark.run with an allreduce and with a failing rank, check_launch,
# run_elastic, and transform's Vector <-> array columns (Catalyst relabelling through py4j,
# which differs between Spark versions). Spark Connect runs on 4.0 only (below). Left to 4.3
# (tests/spark_versions' docstring says why): local-cluster runs, faults, restarts, object
# stores, MLflow and notebooks.
SPARK_VERSIONS_TESTS := tests/spark_versions \
  tests/spark/test_run.py::test_local_mode_runs_every_slot_by_default \
  tests/spark/test_run.py::test_local_mode_a_rank_that_never_calls_init_is_lost_for_the_others \
  tests/spark/test_run.py::test_check_launch_is_run_s_checks_without_a_launch \
  tests/spark/test_run_elastic.py::test_an_undisturbed_job_returns_every_rank_s_value_in_rank_order \
  tests/spark/test_vector_columns.py
# Spark Connect (a TorchEstimator fit, transform, save and load; 40 s) on 4.0 only: 3.5 has
# no Spark ML on Connect, and its pip package no Connect server.
SPARK_VERSIONS_ONLY_40 := --deselect tests/spark_versions/test_connect.py

# tests/compat_env runs in the compat environment only (its conftest ignores it elsewhere).
test-compat: compat apt-test
	$(CPY) -m pytest tests/compat_env -q -p no:cacheprovider $(PYTEST_ARGS)

# The wheel for `pip install` on a cluster (docs/databricks.md): `python -m build --wheel` of
# this checkout, then `auditwheel repair`, which grafts the libraries the core needs (Gloo's)
# into the wheel and tags it manylinux. Built without the MPI backend: libmpi must be the
# cluster's own, and a wheel linked to this machine's would not load without it. The CMake
# build folder is the editable install's, and MPI's flags touch only the MPI backend and the
# module (CMakeLists.txt), so the wheel recompiles a few units, not the core (each switch
# back and forth: about 25 s of CPU). tests/wheel/ installs it into a fresh venv.
WHEEL_DIR := dist
STAMP_WHEEL := $(WHEEL_DIR)/.built
PY_SOURCES := $(shell find spark_hvd estimators -name '*.py' -o -name '*.def' -o -name '*.pyi')

wheel: $(STAMP_WHEEL)

$(STAMP_WHEEL): $(STAMP_DEPS) $(CORE_SOURCES) $(PY_SOURCES) README.md
	rm -rf $(WHEEL_DIR) build/wheel-raw
	SPARK_HVD_WITHOUT_MPI=1 $(VPY) -m build --wheel --no-isolation --skip-dependency-check \
	  --outdir build/wheel-raw .
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" $(VPY) -m auditwheel repair \
	  --wheel-dir $(WHEEL_DIR) build/wheel-raw/spark_hvd-*.whl
	touch $@

# The documentation site (MkDocs, Material theme) from docs/ into site/; --strict: a broken
# link or API reference fails the build (`make test` runs it, so CI does too).
docs: $(STAMP_DEPS)
	NO_MKDOCS_2_WARNING=1 $(VPY) -m mkdocs build --strict --site-dir site

# The linters' settings: pyproject.toml [tool.ruff] (pyflakes and pycodestyle, 100 columns) and
# .clang-format (Google's style, 100 columns) for every tracked C++ file. `make format` applies
# what they can fix by themselves.
CXX_FILES = $(shell git ls-files '*.cc' '*.h')

lint: $(STAMP_DEPS)
	$(VENV)/bin/ruff check --quiet .
	@echo "clang-format --dry-run --Werror ($(words $(CXX_FILES)) C++ files)"
	@$(VENV)/bin/clang-format --dry-run --Werror $(CXX_FILES)

format: $(STAMP_DEPS)
	$(VENV)/bin/ruff check --quiet --fix .
	$(VENV)/bin/clang-format -i $(CXX_FILES)

# Suites that start a SparkSession run in their own pytest process (one JVM each:
# a local-cluster session and a local[N] one cannot share a driver). `make test` runs the
# groups one after the other and prints each one's wall time; LANES=2 runs them in two
# lanes side by side instead, for the time each lane leaves a core idle (launches of one
# rank, JVM and interpreter start-ups, waits for peers and timeouts). Lane 1: the groups
# without Spark; lane 2: the docs, the Spark groups (which hold Spark Connect's port 15002
# in turn, never at once), the wheel, the compat environment. `docs` and `compat_env` name
# the docs build and tests/compat_env.
TEST_LANE_1 := "tests/unit tests/fakes tests/compat tests/multiproc tests/torch tests/tensorflow tests/elastic"
TEST_LANE_2 := lint docs "tests/spark" "tests/estimators" $(OLD_SPARKS) "tests/cluster" "tests/wheel" \
  compat_env
TEST_GROUPS := $(TEST_LANE_1) $(TEST_LANE_2)
LANES ?= 1

# npm as the machine has it, or Debian's nodejs and npm where it has none.
$(STAMP_AZURITE):
	@command -v npm >/dev/null || $(MAKE) --no-print-directory apt-install PACKAGES="nodejs npm"
	npm install --prefix $(VENV)/azurite --no-audit --no-fund azurite@$(AZURITE_VERSION)
	touch $@

$(STAMP_NVIDIA): | $(VPY)
	rm -rf $(NVIDIA_LIBS)
	$(VPY) -m pip install -q --no-deps --target $(NVIDIA_LIBS)/cu12 $(NVIDIA_CU12)
	$(VPY) -m pip install -q --no-deps --target $(NVIDIA_LIBS)/cu13 $(NVIDIA_CU13)
	touch $@

# Each group lists its slowest tests at the end (where CI's time goes).
DURATIONS := 25

# Lane 2's output goes to this file while it runs and is printed when both lanes are done;
# each group's wall time is printed after it (`== <group>: N s`).
LANE_2_LOG := build/test-lane-2.log

# spark_hvd's TensorFlow kernels are compiled on first use and cached (per TensorFlow version
# and source); built here first, so that no rank job of the suite waits for the compiler.
test: setup apt-test compat old-sparks $(STAMP_AZURITE) $(STAMP_NVIDIA)
	@if $(VPY) -c "import tensorflow" 2>/dev/null; then \
	  echo "== TensorFlow kernels"; $(VPY) -m spark_hvd.tensorflow.build_kernels || exit 1; fi
	@group() { case "$$1" in \
	    docs) echo "== make docs"; $(MAKE) --no-print-directory docs;; \
	    lint) echo "== make lint"; $(MAKE) --no-print-directory lint;; \
	    spark35|spark40) echo "== pytest tests/spark_versions, 4 tests and test_vector_columns.py of tests/spark (in .venv-$$1)"; \
	      only="$(SPARK_VERSIONS_ONLY_40)"; [ "$$1" = spark35 ] || only=""; \
	      .venv-$$1/bin/python -m pytest $(SPARK_VERSIONS_TESTS) $$only -q -p no:cacheprovider \
	        --durations=$(DURATIONS) $(PYTEST_ARGS);; \
	    compat_env) echo "== pytest tests/compat_env (in $(VENV_COMPAT))"; \
	      $(CPY) -m pytest tests/compat_env -q -p no:cacheprovider --durations=$(DURATIONS) \
	        $(PYTEST_ARGS);; \
	    *) dirs=""; for d in $$1; do [ -d $$d ] && dirs="$$dirs $$d"; done; \
	      [ -n "$$dirs" ] || return 0; echo "== pytest$$dirs"; \
	      $(VPY) -m pytest $$dirs -q -p no:cacheprovider --durations=$(DURATIONS) $(PYTEST_ARGS);; \
	  esac; }; \
	lane() { local s=0 g t; for g in "$$@"; do t=$$SECONDS; group "$$g" || s=1; \
	  echo "== $$g: $$((SECONDS - t)) s"; done; return $$s; }; \
	status=0; start=$$SECONDS; \
	if [ "$(LANES)" = 1 ]; then lane $(TEST_GROUPS) || status=1; else \
	  mkdir -p $(dir $(LANE_2_LOG)); \
	  ( lane $(TEST_LANE_2) ) > $(LANE_2_LOG) 2>&1 & pid=$$!; \
	  lane $(TEST_LANE_1) || status=1; \
	  wait $$pid || status=1; \
	  echo "== lane 2 ($(LANE_2_LOG)):"; cat $(LANE_2_LOG); \
	fi; \
	echo "== make test: $$((SECONDS - start)) s, exit $$status"; exit $$status

# Day-to-day: the groups without Spark, multi-rank tests at one rank count (FAST_NP;
# tests/conftest.py's --np). CI runs `make test`.
FAST_NP ?= 2
FAST_DIRS := tests/unit tests/fakes tests/compat tests/multiproc tests/torch tests/tensorflow tests/elastic

test-fast: setup apt-test $(STAMP_AZURITE) $(STAMP_NVIDIA)
	$(VPY) -m pytest $(FAST_DIRS) -q -p no:cacheprovider --np=$(FAST_NP) --durations=$(DURATIONS) \
	  $(PYTEST_ARGS)

demo: setup
	$(VPY) examples/demo.py

# The cluster in a box (tests/cluster/box.py; docs/getting-started.md): CLUSTER_HOSTS hosts
# as network namespaces on a bridge, each with an sshd and a Spark Worker with fake GPUs, a
# Spark master beside them; CLUSTER_RATE caps every host's link (tc units: 1gbit). Needs
# root. It stays up until `make cluster-down`, which also removes what a killed run left.
CLUSTER_HOSTS ?= 4
CLUSTER_RATE ?=
BOX := tests/cluster/box.py

.PHONY: cluster-up cluster-down demo-cluster
cluster-up: setup apt-test
	$(VPY) $(BOX) up --hosts $(CLUSTER_HOSTS) $(if $(CLUSTER_RATE),--rate $(CLUSTER_RATE))

cluster-down:
	$(if $(wildcard $(VPY)),$(VPY),$(PY)) $(BOX) down

# The demo's fit on a box of its own (CLUSTER_HOSTS hosts, 2 ranks each), printing which
# rank ran on which host; the box goes when it ends.
demo-cluster: setup apt-test
	$(VPY) examples/demo_cluster.py --hosts $(CLUSTER_HOSTS) --num-proc $$(( 2 * $(CLUSTER_HOSTS) )) \
	  $(if $(CLUSTER_RATE),--rate $(CLUSTER_RATE))

# Every benchmark of docs/benchmarks.md's table, one after the other (each prints its own
# side-by-side ratios); BENCH=name runs one, e.g. `make bench BENCH=torch_step`.
BENCHES := allreduce torch_step keras_step spark_launch reader transform fit_e2e
BENCH ?= $(BENCHES)

bench: setup
	@for b in $(BENCH); do echo "== bench/$$b.py"; \
	  PYTHONPATH=. $(VPY) bench/$$b.py || exit 1; \
	done

# docs/scaling.md's measured part and docs/scaling.png: jobs of N rank processes on this
# machine in simulated hosts (bench/scale.py --help), each mode and N in turn (about 30 min on
# 2 cores); a job not through init after 5 minutes, or running 10, is killed and larger N
# are skipped. NP=2,8,64 another list of N; SCALE_ARGS more options (--backend tcp --merge).
NP ?=
SCALE_ARGS ?=

bench-scale: setup
	PYTHONPATH=. $(VPY) bench/scale.py $(if $(NP),--np $(NP)) $(SCALE_ARGS)

clean:
	rm -rf build *.egg-info spark_hvd/_core*.so $(WHEEL_DIR) site $(VENV_COMPAT) $(OLD_SPARKS:%=.venv-%)
