# Two entry points: `make repro` runs the whole pipeline, `make test` runs the tests.
# Both create .venv and install what is missing on first use.
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: repro cost test test-fast bench bench-batch bench-baseline-noise bench-wait bench-gpu gpu-wheels bench-load bench-cut bench-oracle bench-joint bench-scaling conformance conformance-eagle interop dflash-check install mlflow-ui

$(BIN)/python:
	@command -v $(PY) >/dev/null 2>&1 || { echo "need $(PY) on PATH (or run: make PY=python3 ...)"; exit 1; }
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

# torch first and pinned: a bare `torch` requirement would pull a CUDA build.
$(STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[dev]'
	$(BIN)/pip check
	touch $(STAMP)

install: $(STAMP)

# OVERRIDES: Hydra overrides composed into params.yaml (e.g. OVERRIDES="profile=smoke");
# ARGS: passed to dvc repro (e.g. ARGS="train@hydra").
repro: $(STAMP)
	$(BIN)/python -m pipelines.params $(OVERRIDES)
	PATH=$(CURDIR)/$(BIN):$$PATH $(BIN)/dvc repro $(ARGS)

# what `make repro` will cost here, in under a minute: this machine's plain step and weight-read floor measured, each
# stage's work for the config (same OVERRIDES) times its rate from the committed run (analysis/cost_rates.json)
cost: $(STAMP)
	$(BIN)/python -m pipelines.cost $(OVERRIDES)

# one worker per core, each on one torch thread (tests/conftest.py), a test file to a worker (its module fixtures
# built once): on a 2-core AVX2 machine the suite took 21 min on one process and 11 on two
test: $(STAMP)
	$(BIN)/python -m pytest -q -n auto --dist loadfile $(ARGS)

test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -n auto --dist loadfile -m "not slow" $(ARGS)

bench: $(STAMP)
	$(BIN)/python -m pipelines.bench.verify

# batched decoding's throughput against batch size (MT-Bench questions; OVERRIDES e.g. "heads=hydra
# +bench_batch.sizes=[1,4,8]" to time a drafter too)
bench-batch: $(STAMP)
	$(BIN)/python -m pipelines.bench.batch heads=none $(OVERRIDES)

# what sharing one baseline between the evaluate stages would cost the paired intervals (two references runs)
bench-baseline-noise: $(STAMP)
	$(BIN)/python -m pipelines.bench.baseline_noise $(OVERRIDES)

# what OpenMP's wait policy costs a decoding step on a quiet machine, paired (run it with the cores free)
bench-wait: $(STAMP)
	$(BIN)/python -m pipelines.bench.wait_policy $(OVERRIDES)

# step costs on the device at hand (a GPU: the 7B and SmolLM2 shapes, random weights) before and after the host
# settings; OVERRIDES e.g. "+bench_gpu.shapes=[vicuna_7b] +bench_gpu.repeats=5" (+bench_gpu.profile_drafting=true:
# a torch.profiler record of each drafter's draft(), kernel time against wall time)
bench-gpu: $(STAMP)
	$(BIN)/python -m pipelines.bench.gpu $(OVERRIDES)

# what a lent GPU (Python 3.12, its own torch and transformers) lacks, as wheels in .whl (git-ignored), carried to it
# with pipelines/bench/gpu_session.sh (docs/engine.md, "A device session")
GPU_WHEELS = hydra-core==1.3.8 omegaconf==2.3.1 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19
gpu-wheels: $(STAMP)
	mkdir -p .whl && (grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo /.whl/ >> .git/info/exclude)
	$(BIN)/python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
		--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl $(GPU_WHEELS)
	$(BIN)/python -m pip wheel -q --no-deps -w .whl antlr4-python3-runtime==4.9.3

# decoding speed with other processes on the same cores, per OpenMP setting; OVERRIDES e.g.
# OVERRIDES="+bench.policies=[default,passive,spin10000,passive@1]"
bench-load: $(STAMP)
	$(BIN)/python -m pipelines.bench.load $(OVERRIDES)

# per-step cut replay of trained heads on MT-Bench (after `make repro`); HEADS: which heads folders
HEADS ?= medusa1 hydra hydra_pp
bench-cut: $(STAMP)
	for h in $(HEADS); do $(BIN)/python -m pipelines.bench.cut heads=$$h $(OVERRIDES) || exit 1; done

# our decoder step by step against the authors' Medusa code, in its own .venv-conformance (docs/conformance.md)
conformance: $(STAMP)
	$(BIN)/python -m pipelines.conformance $(ARGS)

# our EAGLE-1 decoder step by step against the authors' eagle-llm 1.2.1, in its own .venv-conformance-eagle
conformance-eagle: $(STAMP)
	$(BIN)/python -m pipelines.conformance_eagle $(ARGS)

# a seeded EAGLE-3 export loaded and run by the speculators library, in its own .venv-speculators; writes the
# golden file tests/test_speculators_format.py replays (docs/conformance.md#speculators-interop)
interop: $(STAMP)
	$(BIN)/python -m pipelines.interop $(ARGS)

# our DFlash export loaded by the authors' dflash 0.1.0 (DFlashDraftModel), in its own .venv-dflash; then DFlash's and
# DSpark's speculators exports run by the speculators library (.venv-speculators)
dflash-check: $(STAMP)
	$(BIN)/python -m pipelines.dflash_check $(ARGS)

# the tree grown per step against a tree of its size chosen in hindsight, replayed along evaluate@<heads>'s own
# records (after `dvc repro evaluate@<heads>`); OVERRIDES e.g. "+oracle.settings=[[5,10,59]]"
ORACLE_HEADS ?= eagle eagle3
bench-oracle: $(STAMP)
	for h in $(ORACLE_HEADS); do $(BIN)/python -m pipelines.bench.tree_oracle heads=$$h $(OVERRIDES) || exit 1; done

# what Medusa-2's joint stage does to head 0 against its joint positions (after `dvc repro train@medusa2`);
# OVERRIDES e.g. "+joint.mode=heads_only +joint.limit=null"
bench-joint: $(STAMP)
	$(BIN)/python -m pipelines.bench.joint heads=medusa2 $(OVERRIDES)

# draft quality against training data: families retrained on the first N conversations into a probe folder
# (after `make repro`); OVERRIDES e.g. "+scaling.heads=[hydra_pp,eagle3] +scaling.samples=[312,624]"
bench-scaling: $(STAMP)
	$(BIN)/python -m pipelines.bench.scaling +scaling.run=true $(OVERRIDES)

mlflow-ui: $(STAMP)
	$(BIN)/mlflow ui --backend-store-uri $${MLFLOW_TRACKING_URI:-sqlite:///mlflow.db} --port 5000
