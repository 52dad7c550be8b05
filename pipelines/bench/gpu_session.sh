#!/usr/bin/env bash
# One call on a lent GPU: the CUDA tests of the static step (spans, EAGLE-3's taps, fused element-wise parts) and of
# the drafts replayed as graphs (fixed trees, the grown tree at fixed shapes, accepted on the device), then
# make bench-gpu at the 7B shape: plain step against transformers' compiled static one (profiled), each method's
# step on the 63-node tree, a chain, EAGLE-2's grown tree and a fixed tree of as many tokens, in plain steps.
#
#   make gpu-wheels                   # here, once: what the GPU's image lacks, into .whl (git-ignored)
#   device run: carry [".whl"], command "SOURCE_COMMIT=<git rev-parse HEAD, here> bash pipelines/bench/gpu_session.sh",
#               timeout_s 480 (the tests get 90 s, the bench 330: 420 in all, a rerun's worth left of 15 minutes)
#   DRY_RUN=1 SOURCE_COMMIT=x bash pipelines/bench/gpu_session.sh    # on any machine: every test it names collected,
#                                     # every bench setting it passes read and checked; nothing run (tests/test_gpu_session.py)
#
# Everything lands in $OUT (reports/bench here when OUT is unset): pytest_cuda_session.txt, gpu_h200_vicuna_7b.json
# and the bench's log. The tests run first, under a time limit, so a hang there still leaves the bench its time.
set -o pipefail
: "${SOURCE_COMMIT:?set SOURCE_COMMIT to the commit this tree is (the device copy has no git metadata, and the bench file must name it)}"
export SOURCE_COMMIT
if [ -d .whl ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        && export PYTHONPATH="/tmp/site:$PWD" || exit 1
elif ! python3 -c "import hydra, omegaconf" 2>/dev/null; then
    echo "no .whl folder and no hydra-core here: run 'make gpu-wheels' and carry [\".whl\"]" >&2
    exit 1
fi
export PYTHONUNBUFFERED=1
OUT="${OUT:-reports/bench}"
mkdir -p "$OUT"
TESTS=(tests/test_graphed_growth.py tests/test_static_taps.py tests/test_fused.py tests/test_static_step.py
       tests/test_graphed_draft.py tests/test_cuda.py)
SELECT="not recipe and not train_stage and not stage"
BENCH=("+bench_gpu.shapes=[vicuna_7b]" "+bench_gpu.settings=[host_settings,static_step,static_drafts]"
       +bench_gpu.repeats=5 +bench_gpu.profile_step=true)
if [ -n "${DRY_RUN:-}" ]; then
    python3 -m pytest -q --collect-only -p no:cacheprovider "${TESTS[@]}" -k "$SELECT" || exit 1
    exec python3 -m pipelines.bench.gpu "${BENCH[@]}" +bench_gpu.dry_run=true "+bench_gpu.out=$OUT/dry_run.json"
fi
device=$(python3 -c "import torch; print(torch.cuda.get_device_name(0).split()[1].lower() if torch.cuda.is_available() else 'cpu')")
echo "# pytest on $device, $(date -u +%F), torch $(python3 -c 'import torch; print(torch.__version__)'), commit $SOURCE_COMMIT" \
    > "$OUT/pytest_cuda_session.txt"
timeout 90 python3 -m pytest -q -rfEs -p no:cacheprovider "${TESTS[@]}" -k "$SELECT" 2>&1 | tee -a "$OUT/pytest_cuda_session.txt"
timeout 330 python3 -m pipelines.bench.gpu "${BENCH[@]}" "+bench_gpu.out=$OUT/gpu_${device}_vicuna_7b.json" 2>&1 \
    | tee "$OUT/bench_gpu_log.txt"
