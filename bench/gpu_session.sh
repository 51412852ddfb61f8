#!/usr/bin/env bash
# One GPU session's checks as one command, for a lent GPU machine with a bare CUDA image (run from the
# repository root; everything it measured lands in OUT_DIR, at most 8 files):
#   1. the wheels that image lacks, carried in .whl/ (`bash ../shared/gpu/fetch-wheels.sh .whl`; an
#      older datasets in .whl/fallback/ is taken when the newest cannot import there), into .site/;
#   2. bench/cuda_constants.py: CUDA context and library memory, small allocation histories (then
#      DeepSpeed's CPU Adam builds in the background);
#   3. the gpu-marked tests that run on one GPU (tests/, `-m gpu`; the distillation e2e one is left to
#      a longer session: its shared fixture trains a dozen runs first);
#   4. bench/gpu_check.py: the offload and QLoRA zoo capped at 8 GiB, each run's allocation history kept.
# Usage: bash bench/gpu_session.sh OUT_DIR [TOTAL_SECONDS] [gpu_check.py args ...]
# A shorter session: CONSTANTS="NAME ..." (bench/cuda_constants.py --only) and GPU_TESTS=0 skip parts.
set -uo pipefail
out=${1:?usage: bash bench/gpu_session.sh OUT_DIR [TOTAL_SECONDS] [gpu_check.py args ...]}
total=${2:-560}
shift $(( $# >= 2 ? 2 : 1 ))
start=$(date +%s)
left() { echo $(( total - ($(date +%s) - start) )); }
mkdir -p "$out" /tmp/gpu-session
log=/tmp/gpu-session
python3 -m pip install -q --no-index --no-deps --no-compile --target .site .whl/*.whl || exit 1
export PYTHONPATH=$PWD/.site:$PWD PYTHONUNBUFFERED=1
if ! python3 -c "import datasets" >"$log/datasets-import.txt" 2>&1 && ls .whl/fallback/*.whl >/dev/null 2>&1; then
  echo "datasets from .whl/ does not import here; taking .whl/fallback/"
  python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target .site .whl/fallback/*.whl
fi
python3 - <<'PY' | tee "$log/versions.txt"
import importlib.metadata as md, torch
print("torch", torch.__version__, "cuda", torch.version.cuda, "gpu", torch.cuda.get_device_name(0) if torch.cuda.is_available() else None)
for name in ["transformers", "accelerate", "peft", "bitsandbytes", "deepspeed", "datasets", "pyarrow", "pydantic", "nvidia-ml-py", "nvidia-nccl-cu13"]:
    try: print(name, md.version(name))
    except md.PackageNotFoundError: print(name, "missing")
PY
nvidia-smi > "$log/nvidia-smi.txt" 2>&1
echo "== cuda constants ($(left) s left)"
timeout 120 python3 bench/cuda_constants.py --out "$log/micro" ${CONSTANTS:+--only $CONSTANTS}
# DeepSpeed's CPU Adam JIT build (a minute of CPU) beside the tests, not beside the device-wide readings above.
python3 -m orchestrate.backends.prebuild >"$log/prebuild.txt" 2>&1 &
prebuild=$!
echo "== gpu-marked tests ($(left) s left)"
if [ "${GPU_TESTS:-1}" = 1 ]; then
  timeout 90 python3 -m pytest -q -m gpu -k "not offloaded_teacher" -p no:cacheprovider tests/ 2>&1 | tail -25
fi
wait $prebuild; tail -2 "$log/prebuild.txt"
budget=$(( $(left) - 30 ))  # what is left, less the packing below
echo "== gpu check, budget ${budget} s"
timeout $(( budget + 25 )) python3 bench/gpu_check.py --skip-gpu-tests --budget-s "$budget" --keep "$log/zoo" \
  --json "$out/gpu_check.json" "$@"
echo "gpu_check exit $?"
# What comes back: the results, logs, plans and metrics in one archive, the allocation histories in another.
(cd "$log" && find . -name '*.json.gz' > traces.list && tar czf "$out/traces.tgz" -T traces.list)
if [ "$(stat -c %s "$out/traces.tgz")" -gt $(( 15 * 2**20 )) ]; then  # one file comes back up to 16 MiB
  split -b 15m -a 1 "$out/traces.tgz" "$out/traces.tgz.part-" && rm "$out/traces.tgz"
fi
(cd "$log" && find . \( -name '*.log' -o -name '*.txt' -o -name 'cuda_constants.json' -o -name plan.json \
  -o -name metrics.jsonl -o -name '*.config.json' \) -size -20M > logs.list && tar czf "$out/logs.tgz" -T logs.list)
ls -la "$out"
