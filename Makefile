# One word each: `make demo` (set up + run the main job on the embedded default),
# `make test` (set up + run the tests), `make stack` (set up + the compose stack as local
# processes: SeaweedFS, seeder, three replicas; Ctrl-C stops it).
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin

.PHONY: demo test stack serve bench bench-quick clean

$(BIN)/shardfeed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# The CPU build on disk; a loose `torch` requirement would pull a multi-GB CUDA build.
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[all]'
	touch $@

demo: $(BIN)/shardfeed
	$(BIN)/shardfeed demo

test: $(BIN)/shardfeed
	$(BIN)/pytest -q

stack: $(BIN)/shardfeed
	$(BIN)/shardfeed stack

serve: $(BIN)/shardfeed
	$(BIN)/shardfeed serve

bench-quick: $(BIN)/shardfeed
	$(BIN)/shardfeed bench --quick

bench: $(BIN)/shardfeed
	$(BIN)/shardfeed bench --out benchmarks/results

clean:
	rm -rf $(VENV) build *.egg-info
