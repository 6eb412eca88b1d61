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

# The OS base of the images (make base); debian:bookworm-slim where it can be pulled.
BASE_IMAGE ?= trainpod-base:bookworm
PUBLIC_BASE ?= debian:bookworm-slim
# What the images need from the OS, one package a line: make-base.sh debootstraps the base with
# them, and the image build apt-installs any that its base lacks (images/install-os-packages.sh).
OS_PACKAGES_FILE := images/os-packages.txt

# The wheelhouse is resolved for the image's Python (bookworm: 3.11), whatever the host runs.
IMAGE_PYTHON ?= 3.11
ARCH := $(shell uname -m)
PIP_TARGET := --only-binary=:all: --implementation cp --python-version $(IMAGE_PYTHON) \
	--abi cp$(subst .,,$(IMAGE_PYTHON)) --platform manylinux_2_28_$(ARCH) \
	--platform manylinux_2_17_$(ARCH) --platform manylinux2014_$(ARCH)

# Where the CPU build of torch comes from: this machine's wheel directory, else PyTorch's CPU index.
TORCH_VERSION := 2.13.0
ifneq ($(wildcard /opt/wheels),)
TORCH_CPU_SOURCE := --find-links /opt/wheels
else
TORCH_CPU_SOURCE := --extra-index-url https://download.pytorch.org/whl/cpu
endif

# The flavours: `make images` builds trainpod:<flavour> for each, `make image-<flavour>` one of them.
# A new flavour is its name here, its requirements file, and those of its settings that differ
# from the defaults:
#   BASE_IMAGE_<f>     the image's runtime base                                 (BASE_IMAGE)
#   BUILDER_IMAGE_<f>  the base of the stage that builds the venv, e.g. one with a CUDA compiler;
#                      it must have the runtime base's Python version           (BASE_IMAGE_<f>)
#   PIP_SOURCE_<f>     pip options saying where `make wheelhouse` finds torch   (none: PyPI)
#   REQUIREMENTS_<f>   the pinned requirements, starting with -r requirements-common.txt
#                                                                               (images/requirements-<f>.txt)
FLAVORS := cpu
PIP_SOURCE_cpu := $(TORCH_CPU_SOURCE)

base-image = $(or $(BASE_IMAGE_$(1)),$(BASE_IMAGE))
builder-image = $(or $(BUILDER_IMAGE_$(1)),$(call base-image,$(1)))
requirements = $(or $(REQUIREMENTS_$(1)),images/requirements-$(1).txt)
IMAGES := $(FLAVORS:%=image-%)

VERSION := $(shell sed -n 's/^version *= *"\(.*\)"/\1/p' entrypoint/pyproject.toml)
VCS_REF := $(shell git describe --always --dirty 2>/dev/null || echo unknown)
TRAINPOD_SRC := $(shell find entrypoint -type f -not -path '*/__pycache__/*' \
	-not -path '*.egg-info/*' -not -path 'entrypoint/build/*')

.PHONY: help setup base wheelhouse images $(IMAGES) dev lint test demo bench clean clean-images job-protocols demo-slurm

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
wheelhouse: $(FLAVORS:%=build/wheelhouse/%/.trainpod) $(FLAVORS:%=build/wheelhouse/%/.os) ## pinned wheels for the images, in build/wheelhouse/<flavour>

# Third-party wheels, for the image's Python and platform, plus the requirements files (the
# flavour's as requirements-<flavour>.txt, which the Dockerfile installs). --no-deps: the
# requirements files are the complete lock; a dependency missing there fails the image build.
build/wheelhouse/%/.deps: images/requirements-common.txt $$(call requirements,$$*)
	@rm -rf $(@D) && mkdir -p $(@D)
	@$(STEP) "the $* wheelhouse (pinned wheels, downloaded once)" $(LOGS)/wheelhouse-$*.log \
		$(PYTHON) -m pip download --disable-pip-version-check --no-deps $(PIP_TARGET) $(PIP_SOURCE_$*) \
		-d $(@D) -r $(call requirements,$*)
	@cp images/requirements-common.txt $(@D)/
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
# changed: build/image-<flavour>.ids holds the IDs of the runtime base, the builder base and the
# image it made, and is remade when the Dockerfile or the build context is newer, or when those IDs
# are not the current ones. The builder stage is tagged trainpod-builder:<flavour> (about 1.2 GB)
# so that its layers stay the build cache; after a build, this project's dangling images (builders
# and images it replaced) are pruned, and only those.
image-ids = echo $$($(DOCKER) image inspect -f '{{.Id}}' $(call base-image,$(1)) \
	$(call builder-image,$(1)) trainpod:$(1) 2>/dev/null)
image-build-args = -f images/Dockerfile --build-arg BASE_IMAGE=$(call base-image,$(1)) \
	--build-arg BUILDER_IMAGE=$(call builder-image,$(1)) --build-arg FLAVOR=$(1) \
	--build-arg VERSION=$(VERSION) --build-arg VCS_REF=$(VCS_REF) build/wheelhouse/$(1)

build/image-%.ids: images/Dockerfile build/wheelhouse/%/.trainpod build/wheelhouse/%/.os
	@$(STEP) "the $* builder stage (the venv)" $(LOGS)/builder-$*.log \
		$(DOCKER) build --target builder -t trainpod-builder:$* $(call image-build-args,$*)
	@$(STEP) "the image trainpod:$*" $(LOGS)/image-$*.log $(DOCKER) build -t trainpod:$* $(call image-build-args,$*)
	@$(DOCKER) image prune -f --filter label=org.opencontainers.image.title=trainpod >/dev/null
	@$(call image-ids,$*) > $@

$(IMAGES): image-%: base build/wheelhouse/%/.trainpod build/wheelhouse/%/.os ## trainpod:<flavour>, for a flavour in FLAVORS
	@[ "$$($(call image-ids,$*))" = "$$(cat build/image-$*.ids 2>/dev/null)" ] \
		|| rm -f build/image-$*.ids
	@$(MAKE) --no-print-directory build/image-$*.ids
	@echo "==> trainpod:$* $$($(DOCKER) image inspect -f '{{.Size}}' trainpod:$* | awk '{ printf "%.2f GB", $$1 / 1e9 }')"

images: base $(IMAGES) ## every image: the base, then trainpod:<flavour> for each flavour in FLAVORS

dev: build/dev.stamp ## host setup: trainpod (editable), dev tools, CPU torch

build/dev.stamp: requirements-dev.txt entrypoint/pyproject.toml
	$(PYTHON) -m pip install --disable-pip-version-check $(TORCH_CPU_SOURCE) \
		-e ./entrypoint -r requirements-dev.txt torch==$(TORCH_VERSION)+cpu
	@mkdir -p $(@D) && touch $@

lint: ## ruff and hadolint
	@$(PYTHON) -m ruff check entrypoint tests bench
	@hadolint --config .hadolint.yaml images/Dockerfile* compose/*/Dockerfile

test: setup images lint ## provision, build the images, lint, then the whole test suite
	$(PYTHON) -m pytest tests

demo: setup images ## provision, build the images, run a 2-node CPU training job with docker compose
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

bench: images ## benchmarks
	$(PYTHON) bench/run.py

clean: ## remove build/ and caches
	rm -rf build .pytest_cache .ruff_cache entrypoint/build
	find . -name __pycache__ -type d -prune -not -path './.git/*' -exec rm -rf {} +

clean-images: ## remove the trainpod images (make base starts again)
	-$(DOCKER) image rm $(FLAVORS:%=trainpod:%) $(FLAVORS:%=trainpod-builder:%) $(BASE_IMAGE)
