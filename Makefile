# trainpod: images, wheelhouse, developer setup, lint and tests. `make help` lists the targets.
#
# Images are built with no container registry: `make base` makes the OS base (pulled or
# debootstrapped), `make wheelhouse` resolves the pinned Python packages on the host, and the image
# build installs them from that wheelhouse with pip --no-index.

SHELL := /bin/bash
.SHELLFLAGS := -euo pipefail -c
.DEFAULT_GOAL := help
# Keep the stamp files of the pattern rules below (make would delete them as intermediates).
.SECONDARY:
# Lets a pattern rule's prerequisites name per-flavour settings ($$(call requirements,$$*)).
.SECONDEXPANSION:

PYTHON ?= python3
DOCKER ?= docker
# Each build step prints one line (what, how long) and keeps its output in build/logs/; VERBOSE=1
# shows the output as it comes.
STEP := scripts/step.sh
LOGS := build/logs
# One value per make run (sub-makes inherit it): bench/images.py groups the steps of a build by it.
ifndef STEP_RUN
STEP_RUN := $(shell date +%s)
endif
export STEP_RUN

# The OS base of the images (make base); debian:bookworm-slim where it can be pulled.
BASE_IMAGE ?= trainpod-base:bookworm
PUBLIC_BASE ?= debian:bookworm-slim
# What the images need from the OS, one package a line: make-base.sh debootstraps the base with
# them, and the image build apt-installs any that its base lacks (images/install-os-packages.sh).
OS_PACKAGES_FILE := images/os-packages.txt

# The wheelhouse is resolved for the image's Python (bookworm: 3.11) and C library (glibc 2.36: every
# manylinux tag up to 2_36, since pip takes only the tags it is given), whatever the host runs.
IMAGE_PYTHON ?= 3.11
IMAGE_GLIBC_MINOR ?= 36
ARCH := $(shell uname -m)
PIP_TARGET := --only-binary=:all: --implementation cp --python-version $(IMAGE_PYTHON) \
	--abi cp$(subst .,,$(IMAGE_PYTHON)) \
	$(foreach minor,$(shell seq $(IMAGE_GLIBC_MINOR) -1 5),--platform manylinux_2_$(minor)_$(ARCH)) \
	--platform manylinux2014_$(ARCH) --platform manylinux2010_$(ARCH) --platform manylinux1_$(ARCH)
# Pure-Python packages published only as source distributions: downloaded as such, then built into
# wheels on the host (the image build installs wheels only, with no index).
SOURCE_ONLY := python-etcd
# Downloaded wheels are kept here across wheelhouses and runs (scripts/wheel-cache.py): the CUDA
# flavours' 2.7 GB come from PyPI once. CI keeps this folder between runs where it can.
WHEEL_CACHE ?= $(HOME)/.cache/trainpod/wheels

# Where the CPU build of torch comes from: this machine's wheel directory, else PyTorch's CPU index.
TORCH_VERSION := 2.13.0
ifneq ($(wildcard /opt/wheels),)
TORCH_CPU_SOURCE := --find-links /opt/wheels
else
TORCH_CPU_SOURCE := --extra-index-url https://download.pytorch.org/whl/cpu
endif

# The flavours: `make image-<flavour>` builds trainpod:<flavour>; `make images` (what `make demo` and
# `make test` need) the CPU ones, `make images-cuda` the CUDA ones (`make test-cuda` tests them).
# A new flavour is its name here, its requirements file, and those of its settings that differ
# from the defaults:
#   BASE_IMAGE_<f>     the image's runtime base                                 (BASE_IMAGE)
#   BUILDER_IMAGE_<f>  the base of the stage that builds the venv, e.g. one with a CUDA compiler;
#                      it must have the runtime base's Python version           (BASE_IMAGE_<f>)
#   PIP_SOURCE_<f>     pip options saying where `make wheelhouse` finds torch   (none: PyPI)
#   REQUIREMENTS_<f>   the pinned requirements, starting with -r requirements-common.txt
#                                                                               (images/requirements-<f>.txt)
CPU_FLAVORS := cpu
CUDA_FLAVORS := cuda cuda-apex
FLAVORS := $(CPU_FLAVORS) $(CUDA_FLAVORS)
PIP_SOURCE_cpu := $(TORCH_CPU_SOURCE)
# PyPI's own torch 2.13.0 is the CUDA 13 build, with NVIDIA's runtime as wheels; --isolated leaves
# out this machine's pip configuration, which points at the local CPU build.
PIP_SOURCE_cuda := --isolated
PIP_SOURCE_cuda-apex := --isolated

# Extensions compiled from source in the image build (the Dockerfile's cuda-devel and extensions
# stages), for the flavours that name them:
#   EXTENSIONS_<f>          what is compiled; today only apex (NVIDIA Apex, not on PyPI)
#   DEVEL_REQUIREMENTS_<f>  the wheels that compile it: nvcc from NVIDIA's PyPI wheels, at torch's
#                           CUDA version; they stay in the build stage
#   APEX_SOURCE, APEX_REF   where Apex comes from: a git URL and a commit (tag, branch), a tarball or
#                           a directory (images/fetch-source.sh); no reachable source fails at once
#   TORCH_CUDA_ARCH_LIST    the GPU architectures compiled for ("8.0;9.0": A100 and H100; each one
#                           adds build time)
#   APEX_EXTENSIONS         only these of Apex's extensions (e.g. "apex_C amp_C fused_layer_norm_cuda",
#                           what the examples use: a third of the build time); empty: all of them
#   MAX_JOBS                compilers at a time (default: the CPUs; each nvcc takes up to 1.5 GB)
EXTENSIONS_cuda-apex := apex
DEVEL_REQUIREMENTS_cuda-apex := images/requirements-devel-cu13.txt
APEX_SOURCE ?= https://github.com/NVIDIA/apex.git
APEX_REF ?= 6424da3b4faa6c8f062da4a48c424fff3f02d42d
TORCH_CUDA_ARCH_LIST ?= 9.0
APEX_EXTENSIONS ?=
MAX_JOBS ?=
# What the one line of an unreachable Apex source suggests: the copy CI keeps beside the checkout.
APEX_EXAMPLE := $(or $(firstword $(wildcard ../shared/vendor/apex-*.tar.gz)),path/to/apex.tar.gz)
# The wheels of the torch image trainpod-torch:<f> (images/Dockerfile.torch, build context
# build/torch/<f>/): torch, what it runs on (NVIDIA's CUDA wheels for a CUDA flavour) and what it
# imports or compiles with.
TORCH_WHEELS := torch triton nvidia_* cuda_* typing_extensions setuptools

base-image = $(or $(BASE_IMAGE_$(1)),$(BASE_IMAGE))
builder-image = $(or $(BUILDER_IMAGE_$(1)),$(call base-image,$(1)))
requirements = $(or $(REQUIREMENTS_$(1)),images/requirements-$(1).txt)
IMAGES := $(FLAVORS:%=image-%)

VERSION := $(shell sed -n 's/^version *= *"\(.*\)"/\1/p' entrypoint/pyproject.toml)
VCS_REF := $(shell git describe --always --dirty 2>/dev/null || echo unknown)
TRAINPOD_SRC := $(shell find entrypoint -type f -not -path '*/__pycache__/*' \
	-not -path '*.egg-info/*' -not -path 'entrypoint/build/*')

.PHONY: help setup base wheelhouse images images-cuda $(IMAGES) $(FLAVORS:%=source-%) dev lint docs test test-cuda demo \
	bench soak clean clean-images job-protocols demo-slurm demo-elastic FORCE

help: ## list the targets
	@grep -E '^([a-z-]+|\$$\(IMAGES\)):.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' \
		'{ sub(/^\$$\(IMAGES\)$$/, "image-<flavour>", $$1); printf "  make %-16s %s\n", $$1, $$2 }'

setup: ## provision this machine (Docker engine, Compose v2, debootstrap, host Python tools): only what is missing
	@$(STEP) "provisioning what is missing (Docker, Compose, debootstrap, host tools)" $(LOGS)/setup.log \
		bash .ci/provision.sh

base: ## OS base image trainpod-base:bookworm: pull debian:bookworm-slim, else debootstrap it
	@$(STEP) "the OS base image $(BASE_IMAGE)" $(LOGS)/base.log env IMAGE=$(BASE_IMAGE) PUBLIC_BASE=$(PUBLIC_BASE) \
		OS_PACKAGES_FILE=$(OS_PACKAGES_FILE) DOCKER=$(DOCKER) bash images/make-base.sh

# Each build/wheelhouse/<flavour> is the build context of trainpod:<flavour>.
wheelhouse: $(FLAVORS:%=build/wheelhouse/%/.trainpod) $(FLAVORS:%=build/wheelhouse/%/.os) $(FLAVORS:%=build/wheelhouse/%/.ext) \
	$(FLAVORS:%=build/torch/%/.context) ## pinned wheels for the images, in build/wheelhouse/<flavour>

# Third-party wheels, for the image's Python and platform, plus the requirements files (the
# flavour's as requirements-<flavour>.txt, which the Dockerfile installs). --no-deps: the
# requirements files are the complete lock; a dependency missing there fails the image build.
# torch and the wheels it brings (TORCH_WHEELS) go to build/torch/<f>/torch/, the torch image's
# context. Every images/requirements-*.txt goes along, for the `-r` lines (cuda-apex includes cuda's).
build/wheelhouse/%/.deps: $(wildcard images/requirements-*.txt) $$(call requirements,$$*)
	@rm -rf $(@D) build/torch/$* && mkdir -p $(@D) build/torch/$*/torch
	@$(PYTHON) scripts/wheel-cache.py seed $(WHEEL_CACHE) $(@D) $(call requirements,$*) > $(LOGS)/wheel-cache-$*.log
	@$(STEP) "the $* wheelhouse (pinned wheels, downloaded once)" $(LOGS)/wheelhouse-$*.log \
		$(PYTHON) -m pip download --disable-pip-version-check --no-deps $(PIP_TARGET) $(PIP_SOURCE_$*) \
		-d $(@D) $(SOURCE_ONLY:%=--no-binary %) -r $(call requirements,$*)
	@set -- $(@D)/*.tar.gz; [ ! -e "$$1" ] || { $(STEP) "wheels of the source-only packages ($(SOURCE_ONLY))" \
		$(LOGS)/sdist-$*.log $(PYTHON) -m pip wheel --disable-pip-version-check --no-deps -w $(@D) "$$@" && rm "$$@"; }
	@$(PYTHON) scripts/wheel-cache.py save $(WHEEL_CACHE) $(@D)
	@find $(@D) -maxdepth 1 \( $(foreach w,$(TORCH_WHEELS),-name '$(w)-*.whl' -o) -false \) -exec mv -t build/torch/$*/torch {} +
	@cp images/requirements-*.txt $(@D)/
	@cp $(call requirements,$*) $(@D)/requirements-$*.txt
	@touch $@

# A flavour's requirements file is written by hand: say so when it is missing.
images/requirements-%.txt:
	@echo "make: $@ is missing: write the requirements of flavour $* (see images/requirements-cpu.txt)," \
		"or point REQUIREMENTS_$* at a file" >&2
	@exit 1

# The OS package list and the script that installs it, for both stages of the Dockerfile (after
# .deps, which empties the folder).
build/wheelhouse/%/.os: $(OS_PACKAGES_FILE) images/install-os-packages.sh build/wheelhouse/%/.deps
	@cp $(OS_PACKAGES_FILE) $(@D)/os-packages.txt
	@cp images/install-os-packages.sh $(@D)/
	@touch $@

# What compiles extensions from source (EXTENSIONS_<f>), in build/ext/<f>/, outside the wheelhouse
# folder that .deps empties. The source first: build/ext/<f>/source.sha changes only when the source
# does. source-<f> (phony, so that make runs it in order, before the base and the download) is the
# first prerequisite of image-<f>: an unreachable source fails at once, in one line.
fetch-source = mkdir -p build/ext/$(1)/src && $(if $(filter apex,$(EXTENSIONS_$(1))),bash images/fetch-source.sh Apex \
	APEX_SOURCE "$(APEX_SOURCE)" "$(APEX_REF)" build/ext/$(1)/src/apex build/ext/$(1)/source.sha $(APEX_EXAMPLE), \
	{ [ -f build/ext/$(1)/source.sha ] || : > build/ext/$(1)/source.sha; })
$(FLAVORS:%=source-%): source-%:
	@$(call fetch-source,$*)
build/ext/%/source.sha: FORCE
	@$(call fetch-source,$*)

# The build arguments that change what is compiled, in a file that changes only when they do (make
# then rebuilds the image; Docker's cache keys on them by itself).
build/ext/%/settings: FORCE
	@mkdir -p $(@D)
	@settings="$(if $(EXTENSIONS_$*),TORCH_CUDA_ARCH_LIST=$(TORCH_CUDA_ARCH_LIST) APEX_EXTENSIONS=$(APEX_EXTENSIONS))"; \
		[ -f $@ ] && [ "$$(cat $@)" = "$$settings" ] || echo "$$settings" > $@

# nvcc and the rest of DEVEL_REQUIREMENTS_<f>, pinned wheels like the wheelhouse's.
build/ext/%/devel/.deps: $$(DEVEL_REQUIREMENTS_$$*)
	@rm -rf $(@D) && mkdir -p $(@D)
	@$(if $(DEVEL_REQUIREMENTS_$*),$(PYTHON) scripts/wheel-cache.py seed $(WHEEL_CACHE) $(@D) $< > $(LOGS)/wheel-cache-devel-$*.log \
		&& $(STEP) "the $* compilers' wheels (nvcc, from PyPI)" $(LOGS)/wheelhouse-devel-$*.log \
		$(PYTHON) -m pip download --disable-pip-version-check --no-deps $(PIP_TARGET) --isolated -d $(@D) -r $< \
		&& $(PYTHON) scripts/wheel-cache.py save $(WHEEL_CACHE) $(@D) && cp $< $(@D)/requirements-devel.txt,:)
	@touch $@

# The build context's ext/ (the Dockerfile's cuda-devel and extensions stages).
build/wheelhouse/%/.ext: build/wheelhouse/%/.deps build/ext/%/source.sha build/ext/%/devel/.deps images/cuda-devel.sh \
		images/build-extensions.sh images/build-packages.txt images/install-os-packages.sh
	@rm -rf $(@D)/ext && mkdir -p $(@D)/ext/devel $(@D)/ext/src
	@cp images/cuda-devel.sh images/build-packages.txt images/install-os-packages.sh $(@D)/ext/devel/
	@cp -al build/ext/$*/devel/. $(@D)/ext/devel/ && rm -f $(@D)/ext/devel/.deps
	@cp images/build-extensions.sh $(@D)/ext/src/
	@cp -a build/ext/$*/src/. $(@D)/ext/src/
	@touch $@

# The torch image's build context, beside the wheelhouse (images/Dockerfile.torch says why).
build/torch/%/.context: build/wheelhouse/%/.deps $(OS_PACKAGES_FILE) images/install-os-packages.sh images/venv-layers.py
	@[ -d $(@D)/torch ] || { mkdir -p $(@D) && mv build/wheelhouse/$*/torch $(@D)/; }  # a wheelhouse made before build/torch/
	@cp $(OS_PACKAGES_FILE) $(@D)/os-packages.txt
	@cp images/install-os-packages.sh images/venv-layers.py $(@D)/
	@touch $@

# trainpod's own wheel, built from a clean copy of entrypoint/ (no stale build/ or egg-info), in a
# folder of its own: the image installs it in a layer after the third-party wheels, so a change to
# trainpod reuses the cached layer with torch instead of reinstalling everything.
build/wheelhouse/%/.trainpod: build/wheelhouse/%/.deps $(TRAINPOD_SRC)
	@rm -rf build/src/$* $(@D)/trainpod && mkdir -p build/src/$* $(@D)/trainpod
	@tar -C entrypoint --exclude=./build --exclude='*.egg-info' --exclude=__pycache__ -cf - . \
		| tar -C build/src/$* -xf -
	@$(STEP) "trainpod's wheel" $(LOGS)/wheel-$*.log \
		$(PYTHON) -m pip wheel --disable-pip-version-check --no-deps -w $(@D)/trainpod build/src/$*
	@rm -rf build/src
	@touch $@

# trainpod:<flavour>, built from build/wheelhouse/<flavour>. The build is skipped when nothing
# changed: build/image-<flavour>.ids holds the IDs of the runtime base, the builder base, the torch
# image and the image it made, and is remade when the Dockerfile or the build context is newer, or when those IDs
# are not the current ones. The builder stage is tagged trainpod-builder:<flavour> (about 1.2 GB)
# so that its layers stay the build cache; after a build, this project's dangling images (builders
# and images it replaced) are pruned, and only those.
image-ids = echo $$($(DOCKER) image inspect -f '{{.Id}}' $(call base-image,$(1)) \
	$(call builder-image,$(1)) trainpod-torch:$(1) trainpod:$(1) 2>/dev/null)
torch-ids = echo $$($(DOCKER) image inspect -f '{{.Id}}' $(call builder-image,$(1)) trainpod-torch:$(1) 2>/dev/null)
image-build-args = -f images/Dockerfile --build-arg BASE_IMAGE=$(call base-image,$(1)) \
	--build-arg BUILDER_IMAGE=$(call builder-image,$(1)) --build-arg TORCH_IMAGE=trainpod-torch:$(1) --build-arg FLAVOR=$(1) \
	--build-arg "TORCH_CUDA_ARCH_LIST=$(TORCH_CUDA_ARCH_LIST)" --build-arg "APEX_EXTENSIONS=$(APEX_EXTENSIONS)" \
	$(if $(MAX_JOBS),--build-arg MAX_JOBS=$(MAX_JOBS)) \
	--build-arg VERSION=$(VERSION) --build-arg VCS_REF=$(VCS_REF) build/wheelhouse/$(1)

# trainpod-torch:<flavour> (images/Dockerfile.torch), remade when its context or its base changed.
build/torch-%.ids: images/Dockerfile.torch build/torch/%/.context
	@$(STEP) "the $* torch image trainpod-torch:$* (the venv with torch)" $(LOGS)/torch-$*.log \
		$(DOCKER) build -f images/Dockerfile.torch --build-arg BUILDER_IMAGE=$(call builder-image,$*) \
		-t trainpod-torch:$* build/torch/$*
	@$(call torch-ids,$*) > $@

# The extensions stage is tagged too (trainpod-extensions:<flavour>): untagged, the next prune would
# take the compiled Apex with it.
build/image-%.ids: images/Dockerfile build/torch-%.ids build/wheelhouse/%/.trainpod build/wheelhouse/%/.os \
		build/wheelhouse/%/.ext build/ext/%/settings
	@$(STEP) "the $* builder stage (the venv)" $(LOGS)/builder-$*.log \
		$(DOCKER) build --target builder -t trainpod-builder:$* $(call image-build-args,$*)
	@$(STEP) "the $* extensions stage ($(or $(EXTENSIONS_$*),none) compiled from source)" $(LOGS)/extensions-$*.log \
		$(DOCKER) build --target extensions -t trainpod-extensions:$* $(call image-build-args,$*)
	@$(STEP) "the image trainpod:$*" $(LOGS)/image-$*.log $(DOCKER) build -t trainpod:$* $(call image-build-args,$*)
	@$(DOCKER) image prune -f --filter label=org.opencontainers.image.title=trainpod >/dev/null
	@$(call image-ids,$*) > $@

$(IMAGES): image-%: source-% base build/torch/%/.context build/wheelhouse/%/.trainpod build/wheelhouse/%/.os build/wheelhouse/%/.ext ## trainpod:<flavour>, for a flavour in FLAVORS
	@[ "$$($(call torch-ids,$*))" = "$$(cat build/torch-$*.ids 2>/dev/null)" ] || rm -f build/torch-$*.ids
	@[ "$$($(call image-ids,$*))" = "$$(cat build/image-$*.ids 2>/dev/null)" ] \
		|| rm -f build/image-$*.ids
	@$(MAKE) --no-print-directory build/image-$*.ids
	@echo "==> trainpod:$* $$($(DOCKER) image inspect -f '{{.Size}}' trainpod:$* | awk '{ printf "%.2f GB", $$1 / 1e9 }')"

images: base $(CPU_FLAVORS:%=image-%) ## the CPU image trainpod:cpu (and the base), what the demo and the tests run

images-cuda: $(CUDA_FLAVORS:%=source-%) base $(CUDA_FLAVORS:%=image-%) ## the CUDA images trainpod:cuda and trainpod:cuda-apex (APEX_SOURCE, ...)

# The stamp stands for an editable install of this checkout: where `import trainpod` finds another one (a clone's
# `make setup` repointed it), the install is redone.
dev: ## host setup: trainpod (editable), dev tools, CPU torch
	@$(PYTHON) -c 'import sys, trainpod; sys.exit(not trainpod.__file__.startswith("$(CURDIR)/entrypoint/"))' 2>/dev/null \
		|| rm -f build/dev.stamp
	@$(MAKE) --no-print-directory build/dev.stamp

build/dev.stamp: requirements-dev.txt entrypoint/pyproject.toml
	$(PYTHON) -m pip install --disable-pip-version-check $(TORCH_CPU_SOURCE) \
		-e ./entrypoint -r requirements-dev.txt torch==$(TORCH_VERSION)+cpu
	@mkdir -p $(@D) && touch $@

lint: docs ## ruff, hadolint, and the manual's strict build (make docs)
	@$(PYTHON) -m ruff check entrypoint tests bench docs/hooks
	@hadolint --config .hadolint.yaml images/Dockerfile* compose/*/Dockerfile

# The manual (mkdocs.yml, docs/): --strict fails on a broken link or anchor, and docs/hooks/reference.py on a
# flag of the CLI that the settings reference leaves out. Nothing is fetched while it builds.
docs: ## the manual, built with --strict into build/site (mkdocs.yml, docs/)
	NO_MKDOCS_2_WARNING=1 $(PYTHON) -m mkdocs build --strict -d build/site

# The test suite in two layers (issue 25), each on several processes (pytest-xdist): the quick unit tests first,
# stopping at the first failure (-x; worksteal evens out their long tail); then the slow ones (-m slow): the unit
# tests that take seconds (a job, processes, a store, timers) beside the integration tests, which are all slow. One
# run for both: a layer's start (every worker imports torch and collects every test) is paid once less, and the unit
# tests fill the cores while the integration tests wait on their timers and containers. The tests that share a
# module fixture, a compose cluster or a subnet run on one worker, one after another (pytest.mark.xdist_group,
# --dist loadgroup). Measured on 2 cores (docs/results.md, "The test suite"): 4 unit workers beat 3, which left the
# cores idle a fifth of the time while tests waited on timers and processes. 3 integration workers: 2 leave the cores idle while
# tests wait, and 4 on a slower machine ran 6 times as many processes as cores (load 12-14) and a 3-node compose job
# there took longer to start than its rendezvous' and checks' bounds; on this one 4 were no faster than 3 (the cores
# were already busy: docs/results.md, "The test suite"). The integration layer ends with its 25 slowest tests, where
# the suite's time goes. PYTEST_ARGS: more of pytest's flags, for both layers.
UNIT_WORKERS ?= 4
INTEGRATION_WORKERS ?= 3
PYTEST_ARGS ?=
test: setup images lint ## provision, build the images, lint, then the quick unit tests, then the slow ones and the integration tests (but the CUDA images')
	$(PYTHON) -m pytest tests/unit -x -n $(UNIT_WORKERS) --dist worksteal -m "not slow and not cuda_images" $(PYTEST_ARGS)
	$(PYTHON) -m pytest tests/integration tests/unit -n $(INTEGRATION_WORKERS) --dist loadgroup --no-loadscope-reorder \
		-m "slow and not cuda_images" --durations=25 $(PYTEST_ARGS)

# The CUDA images without a GPU (tests/integration/test_cuda_images.py): built, then smoke-tested.
# CI runs it after `make test`, with Apex's source from ../shared/vendor and only the Apex extensions
# the examples use (.ci/run; docs/images.md, "In CI", says why).
test-cuda: setup images-cuda ## provision, build the CUDA images, then their smoke tests (no GPU needed)
	$(PYTHON) -m pytest tests -m cuda_images

# The demo builds only the image it runs: TRAINPOD_IMAGE (compose/pai-2node), trainpod:cpu by default.
DEMO_FLAVOR := $(patsubst trainpod:%,%,$(or $(TRAINPOD_IMAGE),trainpod:cpu))
demo: setup $(if $(filter $(DEMO_FLAVOR),$(FLAVORS)),image-$(DEMO_FLAVOR)) ## provision, build the image, run a 2-node training job with docker compose (TRAINPOD_IMAGE)
	@bash compose/demo.sh

# Each protocol's header names the `trainpod job openpai` command that renders it; the unit tests
# fail when a committed file differs from what that command prints now.
job-protocols: ## regenerate job_protocols/*.yaml from the example registry (trainpod job openpai)
	for file in job_protocols/*.yaml; do \
		command=$$(sed -n 's/^# Generated by `trainpod job \(.*\)`:$$/\1/p' "$$file"); \
		[ -n "$$command" ] || { echo "make: $$file has no 'Generated by' line" >&2; exit 1; }; \
		eval "PYTHONPATH=entrypoint $(PYTHON) -m trainpod job $$command" > "$$file.new" && mv "$$file.new" "$$file"; \
	done

demo-slurm: setup images ## a real SLURM cluster (compose/slurm): sbatch of `trainpod job slurm cifar10-ddp --nodes 2`
	bash compose/demo-slurm.sh

# The example is one variable (TRAINPOD_EXAMPLE, its flags TRAINPOD_EXAMPLE_ARGS), in compose/demo-elastic.sh.
demo-elastic: setup images ## an elastic job (compose/elastic: 3 etcd members, 3 nodes, --nnodes 2:4): rank 0's node killed mid-run, the others finish
	bash compose/demo-elastic.sh

bench: images ## benchmarks
	$(PYTHON) bench/run.py

# bench/soak.py: the uninterrupted reference run, then each configuration (restart and in-process recovery, warm start
# on and off) for about SOAK_MINUTES of training under a fault schedule: about 4 x SOAK_MINUTES in all. SOAK_ARGS: more
# of its flags (--configs, --reference CHECKSUM to skip the reference run).
SOAK_MINUTES ?= 30
SOAK_ARGS ?=
soak: images ## the soak test: the 2-node job under a fault schedule, SOAK_MINUTES per configuration (4 x that in all)
	$(PYTHON) bench/soak.py --minutes $(SOAK_MINUTES) $(SOAK_ARGS)

clean: ## remove build/ and caches
	rm -rf build .pytest_cache .ruff_cache entrypoint/build
	find . -name __pycache__ -type d -prune -not -path './.git/*' -exec rm -rf {} +

clean-images: ## remove the trainpod images (make base starts again)
	-$(DOCKER) image rm $(FLAVORS:%=trainpod:%) $(FLAVORS:%=trainpod-builder:%) $(FLAVORS:%=trainpod-extensions:%) \
		$(FLAVORS:%=trainpod-torch:%) $(BASE_IMAGE)
