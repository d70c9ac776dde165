#!/usr/bin/env bash
# GPU path of the training workload: NCCL + use_gpu, world size 1, then a
# relaunch under the same name that must restore the checkpoint on the GPU.
# Runs on a machine with an NVIDIA GPU and a Python that has torch; Ray is
# installed from wheels in .gpu-wheels/ when missing (such machines may have
# no registry). Writes logs to ${OUT:-/tmp/gpu-smoke}.
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-/tmp/gpu-smoke}"
mkdir -p "$out"
export RAY_USAGE_STATS_ENABLED=0 PYTHONPATH="$PWD"
py="${PYTHON:-python3}"
{
  nvidia-smi -L
  "$py" -c 'import torch; print("torch", torch.__version__, "cuda", torch.cuda.is_available(), torch.cuda.get_device_name(0))'
  if ! "$py" -c 'import ray' 2>/dev/null && [ -d .gpu-wheels ]; then
    "$py" -m pip install --quiet --no-index --no-deps .gpu-wheels/*.whl
  fi
  "$py" -c 'import ray, ray.train.torch; print("ray", ray.__version__)'
} > "$out/env.txt" 2>&1
cat "$out/env.txt"
storage=$(mktemp -d)
run() {
  "$py" workloads/fsdp_train.py --ray-address local --name gpu-smoke --storage-path "$storage" \
    --world-size 1 --cpus-per-worker 1 --gpus-per-worker 1 --timeout-s 60 --checkpoint-every 5 "$@"
}
run --steps 10 > "$out/first.log" 2>&1; first=$?
run --steps 20 > "$out/resume.log" 2>&1; second=$?
grep -h RAYPROOF_EVENT "$out/first.log" "$out/resume.log" | grep -E '"(start|worker_group_started|checkpoint_restored|finish|failure)"' | sort -u
echo "first run exit $first, relaunch exit $second"
tail -n 30 "$out/resume.log"
