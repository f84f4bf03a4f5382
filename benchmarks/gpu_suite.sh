#!/usr/bin/env bash
# The GPU suite on a lent GPU machine, in ONE `device` run (issue 32 step 2): install what the machine lacks
# from carried wheels, build mmidx's Cython kernels there, run benchmarks/gpu_suite.py into $OUT.
#
# The machine (KINDS.md, nvidia-h100-x1 / nvidia-h200): Python 3.12 at /opt/torch/.venv, torch 2.11 +
# torchvision, Cython, setuptools, numpy, Pillow, pyarrow, transformers, tqdm, pyyaml, xxhash, pytest; no
# internet. mmidx's core dependencies it lacks: simplejpeg and av (PyAV), carried as wheels.
#
# Before the call, here, in the repository root (once per checkout; .whl/ and .bagel/ are git-ignored):
#
#   python -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#       --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
#       -d .whl "simplejpeg>=1.9,<2" "av>=12"          # ~35 MB: simplejpeg 1.9.0 (needs numpy), av 19.0.2
#   # BAGEL's mask code, for item 1's comparison (optional): the `fetch` tool (github:ByteDance-Seed/Bagel)
#   # puts a snapshot at /work/.mirror/ByteDance-Seed+Bagel/repo; copy two files of it, never commit them
#   B=/work/.mirror/ByteDance-Seed+Bagel/repo; mkdir -p .bagel/data
#   for f in __init__.py data_utils.py; do git --git-dir=$B show HEAD:data/$f > .bagel/data/$f; done
#   git --git-dir=$B rev-parse HEAD > .bagel/COMMIT
#
# Then the one call, from a checkout of main (the suite's H100 budget is 475 s with the install and the CUDA
# tests, item by item in gpu_suite.py's docstring; 540 s leaves a rerun of the failed items,
# `bash benchmarks/gpu_suite.sh --items NAME ...`, inside the 15 minutes with the machine's start):
#
#   run(command="bash benchmarks/gpu_suite.sh", carry=[".whl", ".bagel"], timeout_s=540)
#
# Arguments are passed to gpu_suite.py (e.g. --items decode step). Everything it writes lands in
# $OUT: report.md, report.json, pytest.txt (the CUDA tests) and suite.log.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu-suite}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
PYTHON=${PYTHON:-python3}
start=$(date +%s)
step() { echo "gpu_suite.sh: $* ($(( $(date +%s) - start )) s)"; }

nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
step "installing the carried wheels"
$PYTHON -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --find-links .whl simplejpeg av || exit 2
step "building mmidx's kernels (pip install --no-build-isolation --no-deps -e .)"
$PYTHON -m pip install -q --no-build-isolation --no-deps --no-cache-dir -e . || exit 3
$PYTHON -c "import mmidx._packing, simplejpeg, av, torch; print('mmidx imports; torch', torch.__version__, \
'CUDA', torch.version.cuda, torch.cuda.is_available())" || exit 4

bagel=()
[ -f .bagel/data/data_utils.py ] && bagel=(--bagel-src "$PWD/.bagel")
step "the suite"
$PYTHON benchmarks/gpu_suite.py "$OUT" "${bagel[@]}" "$@" 2>&1 | tee "$OUT/suite.log"
suite=${PIPESTATUS[0]}
if [ $# -eq 0 ]; then  # the CUDA tests step 2 must see green (skipped without CUDA elsewhere)
    step "the CUDA tests"
    $PYTHON -m pytest -q -p no:cacheprovider -n 0 tests/test_gpu_cuda.py tests/test_device_decode.py 2>&1 \
        | tee "$OUT/pytest.txt" | tail -n 15
fi
step "done (suite exit $suite)"
exit "$suite"
