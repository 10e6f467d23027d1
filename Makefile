# The two commands of the README: `make decode` (set up, then decode on the
# embedded default model with every variant) and `make test` (set up, then the
# default test suite). `make test-slow` runs the deeper sweeps marked slow.
PYTHON ?= python3

.PHONY: setup decode test test-slow

setup:
	PYTHON=$(PYTHON) bash scripts/setup.sh

decode: setup
	$(PYTHON) harness/decode.py --variant all

test: setup
	$(PYTHON) -m pytest -q

test-slow: setup
	$(PYTHON) -m pytest -q -m slow
