# The README's two commands: `make train` (the 2x2 training run) and `make test` (lint and
# the whole suite). Both set up the local environment .venv first when it is missing or
# older than pyproject.toml; the manual steps are in the README.
#
#   make train ARGS="train.steps=5"        Hydra overrides for examples/train.py
#   make test ARGS="--worlds 4"            arguments of python -m physicsnemo_foldcp.testing.suite

PYTHON ?= python3
VENV ?= .venv
EXTRAS ?= test,lint,plot,boltz
NPROC ?= 4
CP ?= [2,2]
ARGS ?=

VENV_PYTHON := $(VENV)/bin/python
# Written after a complete install; older than pyproject.toml means the install is stale.
STAMP := $(VENV)/.installed

.DEFAULT_GOAL := help
.PHONY: help venv install train test lint

help:
	@echo "make train   set up $(VENV) if needed, then train on a $(CP) CP mesh of $(NPROC) processes"
	@echo "make test    set up $(VENV) if needed, then lint and run the whole test suite"
	@echo "make lint    ruff check"
	@echo "make venv    set up $(VENV) only (python3 -m venv, pip install -e '.[$(EXTRAS)]')"
	@echo "ARGS=...     passed on: Hydra overrides for train, suite arguments for test"

venv install: $(STAMP)

$(STAMP): pyproject.toml
	[ -x $(VENV_PYTHON) ] || $(PYTHON) -m venv $(VENV)
	$(VENV_PYTHON) -m pip install --upgrade pip
	$(VENV_PYTHON) -m pip install -e '.[$(EXTRAS)]'
	touch $(STAMP)

train: $(STAMP)
	$(VENV_PYTHON) -m torch.distributed.run --standalone --nproc-per-node $(NPROC) examples/train.py 'mesh.cp=$(CP)' $(ARGS)

lint: $(STAMP)
	$(VENV_PYTHON) -m ruff check physicsnemo_foldcp examples test benchmarks

test: lint
	$(VENV_PYTHON) -m physicsnemo_foldcp.testing.suite $(ARGS)
