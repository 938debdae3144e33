# The two commands of the README. Both set everything up on a fresh machine first.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.poseidon-installed

.PHONY: main test bench clean

$(STAMP): pyproject.toml setup.py _ext/codec.pyx _ext/receive.pyx _ext/tally.pyx poseidon_aio/wire/_ccodec.pxd scripts/setup.sh
	scripts/setup.sh $(VENV)
	touch $(STAMP)

# The main job: 4 local workers (torchrun underneath) train a CNN on scikit-learn's digits, beside
# a single-process run of the same global batches.
main: $(STAMP)
	$(VENV)/bin/poseidon-aio run -n 4 examples/digits.py

# The whole suite on uvloop and asyncio's loop, in asyncio debug mode, with the compiled codec,
# receive core and shard tally; then the wire, connection, transport, same-host link and shard
# tests again with their pure-Python twins. Two pytest workers: much of a multi-process test is spent waiting on its
# children and timeouts, so two at a time take a quarter off the wall time even on two cores
# (TEST_WORKERS=0 runs everything in this process).
TEST_WORKERS ?= 2
test: $(STAMP)
	$(PY) -m poseidon_aio.cli info --require-extension
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	PYTHONASYNCIODEBUG=1 $(PY) -m pytest -q -n $(TEST_WORKERS) --dist load
	POSEIDON_NO_EXTENSIONS=1 PYTHONASYNCIODEBUG=1 $(PY) -m pytest -q -n $(TEST_WORKERS) --dist load tests/test_codec.py tests/test_connection.py tests/test_transport.py tests/test_same_host.py tests/test_shard.py

bench: $(STAMP)
	$(PY) -m bench transport

clean:
	rm -rf $(VENV) build *.egg-info poseidon_aio/wire/_ccodec*.so poseidon_aio/net/_creceive*.so poseidon_aio/ps/_ctally*.so _ext/*.c
