#!/usr/bin/env bash
# The GPU checks in one bounded run, for a CUDA machine where `python3` already has torch
# and nothing can be downloaded (no venv is made; `make gpu-check` runs this with the
# project's venv instead).
#
#   bash scripts/gpu_check.sh                        # every stage: 10 minutes at most
#   bash scripts/gpu_check.sh tests dlrm_lookup      # only these stages, in this order
#   bash scripts/gpu_check.sh --dry-run [STAGE...]   # print stages and time limits only
#
# The stages' limits add up to 600 s, a remote command's whole allowance; on a machine
# lent for 15 minutes run them as two calls (tests dlrm_lookup core_bench, then
# step_modes mnli_bench) so a slow stage cannot cost the others.
#
# Missing Python packages may travel as wheels in .whl/ (installed into /tmp/site, never
# into the system): the GaLore variant of the MNLI bench needs galore-torch and
# bitsandbytes. Each stage runs under its own time limit and a failing stage does not stop
# the next: the summary lists every stage's exit status. Figures land in reports/gpu/ (the
# CPU reports are never touched); where $OUT is set, reports/gpu/ and the logs are packed
# into $OUT/gpu_reports.tar.gz. Stages run in order of what they settle: the GPU-path
# tests, the DLRM lookup (table-batched vs separate), the core benchmark, the step modes
# (CUDA graphs, compile), then the MNLI step bench.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python3}
DRY=0
if [[ "${1:-}" == "--dry-run" ]]; then DRY=1; shift; fi

ALL=(
  "120|tests|$PY -m pytest -q -rs -p no:cacheprovider tests/test_gpu.py"
  "60|dlrm_lookup|$PY -m experiments.dlrm.bench --embedding --device cuda --json"
  "90|core_bench|$PY -m comera.bench --device cuda --json"
  "150|step_modes|$PY -m experiments.step_modes --device cuda --modes sync_free,compile,cuda_graph"
  "180|mnli_bench|$PY -m experiments.mnli --bench --device cuda --json"
)
STAGES=()
if (( $# == 0 )); then STAGES=("${ALL[@]}"); fi
for want in "$@"; do
  found=0
  for s in "${ALL[@]}"; do
    IFS='|' read -r _ name _ <<<"$s"
    if [[ "$name" == "$want" ]]; then STAGES+=("$s"); found=1; fi
  done
  if (( !found )); then
    echo "gpu_check: unknown stage '$want' (stages: tests dlrm_lookup core_bench step_modes mnli_bench)" >&2
    exit 2
  fi
done

if (( DRY )); then
  for s in "${STAGES[@]}"; do IFS='|' read -r limit name cmd <<<"$s"; echo "$name ${limit}s: $cmd"; done
  exit 0
fi

if ! $PY -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  echo "gpu_check: $PY's torch sees no CUDA device here; nothing to check" >&2
  exit 2
fi
LOGS=reports/gpu/logs
mkdir -p "$LOGS"
if compgen -G ".whl/*.whl" >/dev/null; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || echo "gpu_check: could not install .whl/ (going on)"
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 WANDB_MODE=disabled

{
  date -u
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1
  $PY -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, \
'available', torch.cuda.is_available())" 2>&1
} | tee "$LOGS/machine.txt"

for s in "${STAGES[@]}"; do
  IFS='|' read -r limit name cmd <<<"$s"
  echo "== $name (limit ${limit}s): $cmd"
  start=$(date +%s)
  timeout --kill-after=10 "$limit" $cmd >"$LOGS/$name.out" 2>"$LOGS/$name.err"
  rc=$?
  line="$name rc=$rc $(( $(date +%s) - start ))s"
  (( rc == 124 || rc == 137 )) && line="$line (time limit)"
  echo "$line" | tee -a "$LOGS/summary.txt"  # appended: two calls keep both halves
  tail -n 3 "$LOGS/$name.out"
done

if [[ -n "${OUT:-}" ]]; then
  tar -czf "$OUT/gpu_reports.tar.gz" reports/gpu
  echo "packed reports/gpu into $OUT/gpu_reports.tar.gz"
fi
cat "$LOGS/summary.txt"
