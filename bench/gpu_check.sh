#!/usr/bin/env bash
# GPU check: the gpu-marked tests and the GPU benchmarks, in one go (< 5 minutes on an H100/H200).
#
#   bench/gpu_check.sh                 run on a machine with an NVIDIA GPU
#   bench/gpu_check.sh --fetch-wheels  (on a machine with internet) download into .whl/ the
#                                      wheels a bare GPU machine lacks, for an offline install
#
# Python: $PYTHON if set, else .venv/bin/python if its torch has CUDA, else python3.
# What that Python lacks (cupy, pyzmq, pydantic, ...) is installed into a scratch
# target dir: from .whl/ when present (no network), else from the package index.
# torch itself is never installed here: use a Python whose torch was built with CUDA.
#
# Prints each benchmark's JSON line, then one summary JSON object on its last line.
set -euo pipefail
cd "$(dirname "$0")/.."

NEEDED=(pyzmq msgpack pydantic prometheus-client safetensors aiohttp pytest pytest-asyncio
        pytest-timeout hypothesis)
GPU_NEEDED=(cupy-cuda12x nixl-cu12)

if [[ "${1:-}" == "--fetch-wheels" ]]; then
    # Python 3.12, x86-64 manylinux: what the GPU machines here run (see the device notes).
    mkdir -p .whl
    python3 -m pip download --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux2014_x86_64 -d .whl "${NEEDED[@]}" "${GPU_NEEDED[@]}"
    echo "wheels in .whl/ ($(du -sh .whl | cut -f1)); carry that folder to the GPU machine"
    exit 0
fi

pick_python() {
    if [[ -n "${PYTHON:-}" ]]; then echo "$PYTHON"; return; fi
    if [[ -x .venv/bin/python ]] &&
        .venv/bin/python -c 'import torch,sys; sys.exit(0 if torch.cuda.is_available() else 1)' \
            2>/dev/null; then
        echo .venv/bin/python; return
    fi
    echo python3
}
PY=$(pick_python)
"$PY" -c 'import torch,sys; sys.exit(0 if torch.cuda.is_available() else 1)' || {
    echo "gpu_check: $PY has no CUDA torch or sees no GPU; set PYTHON to one that does" >&2
    exit 2
}

# Install only what is missing, into a scratch dir put first on PYTHONPATH.
SITE=${GPU_CHECK_SITE:-/tmp/kvstack-gpu-site}
missing=()
for pkg in "${NEEDED[@]}"; do
    mod=${pkg//-/_}
    case $pkg in
        pyzmq) mod=zmq ;; prometheus-client) mod=prometheus_client ;;
        pytest-asyncio) mod=pytest_asyncio ;; pytest-timeout) mod=pytest_timeout ;;
    esac
    "$PY" -c "import $mod" 2>/dev/null || missing+=("$pkg")
done
"$PY" -c 'import cupy' 2>/dev/null || missing+=(cupy-cuda12x)
"$PY" -c 'import nixl_cu12' 2>/dev/null || missing+=(nixl-cu12)
source=(--no-index --find-links .whl)
[[ -d .whl ]] || source=()
for pkg in "${missing[@]}"; do  # one at a time: one that cannot be had stops nothing else
    echo "gpu_check: installing $pkg into $SITE"
    "$PY" -m pip install -q "${source[@]}" --target "$SITE" "$pkg" ||
        echo "gpu_check: could not install $pkg; the tests that need it will say so"
done
export PYTHONPATH="$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true

OUT_DIR=${GPU_CHECK_OUT:-$(mktemp -d /tmp/kvstack-gpu-check.XXXXXX)}
status=0
echo "== tests/gpu (gpu-marked: cuda backend, CUDA IPC, async offload race, GPU stacks)"
"$PY" -m pytest -q -m gpu tests/gpu -p no:cacheprovider --timeout 240 \
    2>&1 | tee "$OUT_DIR/tests.log" || status=1
# -m gpu with every test skipped would hide a broken setup: require passes.
grep -Eq '[0-9]+ passed' "$OUT_DIR/tests.log" || { echo "gpu_check: no GPU test passed"; status=1; }

run_bench() {  # name, command...: keep the last line (the JSON object)
    local name=$1; shift
    echo "== $name: $*"
    if timeout 150 "$PY" "$@" >"$OUT_DIR/$name.log" 2>&1; then
        tail -n 1 "$OUT_DIR/$name.log" | tee "$OUT_DIR/$name.json"
    else
        echo "gpu_check: $name failed:"; tail -n 20 "$OUT_DIR/$name.log"; status=1
        echo '{"failed": true}' >"$OUT_DIR/$name.json"
    fi
}
run_bench offload_bw bench/offload_bw.py --backend cuda --repeats 3
run_bench memsvc_ops bench/memsvc_ops.py --backend cuda --iterations 500 --rounds 4
run_bench pd_retract bench/pd_retract.py --backend cuda --repeats 2

"$PY" - "$OUT_DIR" <<'EOF'
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
summary = {name: json.loads((out / f"{name}.json").read_text())
           for name in ("offload_bw", "memsvc_ops", "pd_retract")}
print(json.dumps({"gpu_check": summary, "logs": str(out)}))
EOF
exit $status
