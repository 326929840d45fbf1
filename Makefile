# One word each: `make demo` (set up + run the main job on the embedded default),
# `make test` (set up + run every test, in parallel), `make check` (the tests not marked
# slow: the edit-test loop), `make stack` (set up + the compose stack as local processes:
# SeaweedFS, seeder, three replicas; Ctrl-C stops it), `make gpu-check` (on a CUDA machine only: the
# GPU checks and the copy timing; nothing else needs a GPU).
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
# pytest-xdist processes (each starts its own S3 servers once): 1.5 per core, at most 8.
# Many tests wait on subprocesses; on 2 cores 3 processes ran the suite in 314 s, 2 in 374 s.
TEST_WORKERS ?= $(shell n=$$(( $$(nproc) * 3 / 2 )); echo $$(( n < 1 ? 1 : n > 8 ? 8 : n )))

# Where pip finds wheels besides its indexes (a local CPU build of torch, on this machine).
FIND_LINKS ?= $(or $(PIP_FIND_LINKS),$(shell $(PYTHON) -m pip config get global.find-links 2>/dev/null))

.PHONY: demo test check gpu-check stack serve bench bench-quick clean

$(BIN)/shardfeed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q uv
	# torch first, pinned: the CPU build on disk, where pip's find-links name one (uv is told
	# them: 9 s against pip's 15 s here); a loose `torch` requirement would pull a multi-GB
	# CUDA build.
ifneq ($(FIND_LINKS),)
	$(BIN)/uv pip install -q --compile-bytecode --python $(BIN)/python --find-links $(FIND_LINKS) torch==2.13.0
else
	$(BIN)/pip install -q torch==2.13.0
endif
	# The rest through uv: about 16 s against pip's 45-60 s here. torch is installed by then,
	# so uv keeps it. Compiled now, as pip does: where PYTHONDONTWRITEBYTECODE is set, every
	# process would compile its imports again (a service start then costs twice the CPU).
	$(BIN)/uv pip install -q --compile-bytecode --python $(BIN)/python -e '.[all]'
	# The peers whose own writers and readers the MDS and LitData tests compare against, with
	# --no-deps: Streaming declares torchvision (no wheel works with the CPU torch), transformers
	# and cloud SDKs, LitData a torch 2.14. Listed by hand instead: what they import, and the
	# codecs Streaming imports at start (zstd, Brotli, snappy); import_streaming stands in for
	# torchvision and transformers. s3torchconnector (the loaders benchmark's one GET per sample)
	# needs only torch and its client's cp311 wheel. About 1 s here (0.7 s from uv's cache, 1.2 s downloading).
	$(BIN)/uv pip install -q --compile-bytecode --python $(BIN)/python --no-deps \
		mosaicml-streaming==0.13.0 litdata==0.2.76 lightning-utilities==0.15.3 catalogue==2.0.10 \
		zstd==1.5.7.2 brotli==1.2.1 python-snappy==0.7.3 cramjam==2.14.0 \
		s3torchconnector==1.5.0 s3torchconnectorclient==1.5.0
	touch $@

demo: $(BIN)/shardfeed
	$(BIN)/shardfeed demo

# Module-scoped fixtures (services, datasets) start once per worker that runs the module's tests.
# make test: --dist loadgroup, each module marked xdist_group on one worker, the rest spread
# test by test (the benchmarks' smoke runs share one module: one worker would run them all).
# make check: --dist loadscope, every module on one worker (the quickest here by a third).
test: $(BIN)/shardfeed
	$(BIN)/pytest -q -n $(TEST_WORKERS) --dist loadgroup

check: $(BIN)/shardfeed
	$(BIN)/pytest -q -n $(TEST_WORKERS) --dist loadscope -m "not slow"

# The checks that need a CUDA device and a CUDA build of torch in $(VENV) (PyPI's Linux wheel is
# one; this machine's find-links give the CPU build): tests/gpu (one host-to-device copy a pinned
# batch, one batched nvJPEG call, pinned DataLoader batches; skipped, with the reason shown by -ra,
# without CUDA or torchvision), then the stall benchmark's copy to the GPU at two small sizes
# (--cuda: it refuses to run, exit 2, without CUDA). A few minutes; no other target needs it.
gpu-check: $(BIN)/shardfeed
	$(BIN)/pytest -q -ra tests/gpu
	$(BIN)/python -m shardfeed.benchmarks.stall --cuda --sizes 10KiB,1MiB --samples 256 \
		--loaders ram,shardfeed-tensors --steps-ms 5 --step-batches 2 --service-workers 4

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
