#!/usr/bin/env bash
# The GPU checks, bounded, for a CUDA machine where `python3` already has torch and
# nothing can be downloaded (no venv is made; `make gpu-check` runs this with the
# project's venv instead).
#
#   bash scripts/gpu_check.sh                        # every stage
#   bash scripts/gpu_check.sh tests dlrm_lookup      # only these stages, in this order
#   bash scripts/gpu_check.sh --dry-run [STAGE...]   # print stages and time limits only
#   bash scripts/gpu_check.sh --group 1              # stages of one remote call (1 or 2)
#
# Each stage runs under its own time limit, a failing stage does not stop the next, and the
# script exits 1 if any stage failed. A remote call that allows 600 s in all should run one
# group: group 1 (tests, DLRM lookup, core bench, paper-size step modes) and group 2
# (smoke step modes with compile, MNLI step bench) each stay under 520 s of limits, which
# leaves room for start-up, the kill grace and packing.
#
# Missing Python packages may travel as wheels in .whl/ (installed into /tmp/site, never
# into the system): the GaLore variant of the MNLI bench needs galore-torch, which imports
# bitsandbytes and transformers (the CUDA image has transformers; without galore-torch the
# bench leaves GaLore out). Figures land in reports/gpu/
# (the CPU reports are never touched); where $OUT is set, reports/gpu/ is packed into
# $OUT/gpu_reports.tar.gz after every stage, so a call cut short still returns what ran.
set -uo pipefail
set -f  # no globbing of the stage arguments below
cd "$(dirname "$0")/.."
PY=${PY:-python3}

G=reports/gpu
ALL=(
  "1|120|tests|-m pytest -q -rs -p no:cacheprovider tests/gpu/test_gpu.py"
  "1|60|dlrm_lookup|-m benchmarks.dlrm_step --embedding --device cuda --json"
  "1|90|core_bench|-m benchmarks.core --device cuda --json"
  "1|240|step_modes_paper|-m benchmarks.step_modes --device cuda --models paper,paper_dense --modes sync_free,cuda_graph --out $G/step_modes_paper"
  "2|240|step_modes_smoke|-m benchmarks.step_modes --device cuda --models smoke --modes sync_free,cuda_graph,compile --point-timeout 150 --out $G/step_modes_smoke"
  "2|240|mnli_bench|-m benchmarks.mnli_step --device cuda --json"
)
NAMES=$(for s in "${ALL[@]}"; do IFS='|' read -r _ _ name _ <<<"$s"; printf '%s ' "$name"; done)
usage() { echo "gpu_check: $1 (usage: [--dry-run] [--group 1|2 | STAGE...]; stages: $NAMES)" >&2; exit 2; }

DRY=0 GROUP="" WANT=()
while (( $# )); do
  case $1 in
    --dry-run) DRY=1; shift ;;
    --group) (( $# >= 2 )) || usage "--group takes 1 or 2"; GROUP=$2; shift 2 ;;
    -*) usage "unknown option '$1'" ;;
    *) WANT+=("$1"); shift ;;
  esac
done
STAGES=()
if [[ -n "$GROUP" ]]; then
  (( ${#WANT[@]} == 0 )) || usage "give --group or stage names, not both"
  for s in "${ALL[@]}"; do if [[ "${s%%|*}" == "$GROUP" ]]; then STAGES+=("$s"); fi; done
  (( ${#STAGES[@]} )) || usage "--group takes 1 or 2"
elif (( ${#WANT[@]} == 0 )); then
  STAGES=("${ALL[@]}")
fi
for want in ${WANT[@]+"${WANT[@]}"}; do
  found=0
  for s in "${ALL[@]}"; do
    IFS='|' read -r _ _ name _ <<<"$s"
    if [[ "$name" == "$want" ]]; then STAGES+=("$s"); found=1; fi
  done
  (( found )) || usage "unknown stage '$want'"
done

if (( DRY )); then
  for s in "${STAGES[@]}"; do
    IFS='|' read -r group limit name args <<<"$s"
    echo "$name ${limit}s group $group: $PY $args"
  done
  exit 0
fi

if ! "$PY" -c "import torch" 2>/dev/null; then
  echo "gpu_check: $PY cannot import torch; set PY to a python that has a CUDA torch" >&2
  exit 2
fi
if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  echo "gpu_check: $PY's torch sees no CUDA device here; nothing to check" >&2
  exit 2
fi
LOGS=$G/logs
mkdir -p "$LOGS"
set +f; whls=(.whl/*.whl); set -f  # the wheels, expanded (the rest of the script is -f)
wanted=0  # only the MNLI bench (GaLore) needs them
for s in "${STAGES[@]}"; do if [[ "$s" == *"|mnli_bench|"* ]]; then wanted=1; fi; done
if (( wanted )) && [[ -e "${whls[0]}" ]]; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site "${whls[@]}" || echo "gpu_check: could not install .whl/ (going on)"
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 WANDB_MODE=disabled

packed=""
pack() {  # a new archive replaces the last one only once it is whole
  [[ -n "${OUT:-}" ]] || return 0
  if tar -czf "$OUT/.gpu_reports.tmp" "$G" && mv -f "$OUT/.gpu_reports.tmp" "$OUT/gpu_reports.tar.gz"; then
    packed="packed $G into $OUT/gpu_reports.tar.gz"
  else
    packed="gpu_check: packing into \$OUT failed"; failed=1
  fi
}

{
  echo "== gpu_check run $(date -u +%FT%TZ): ${#STAGES[@]} stage(s)"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1
  "$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'tf32 matmul', torch.backends.cuda.matmul.allow_tf32)" 2>&1
  env | grep -E '^(NVIDIA_TF32_OVERRIDE|TORCH_ALLOW_TF32_CUBLAS_OVERRIDE)=' || true
} | tee -a "$LOGS/summary.txt"

failed=0
pack  # the machine's description, before any stage
for s in "${STAGES[@]}"; do
  IFS='|' read -r _ limit name args <<<"$s"
  echo "== $name (limit ${limit}s): $PY $args"
  start=$(date +%s)
  # shellcheck disable=SC2086  # args is a word list without quoting inside
  timeout --kill-after=10 "$limit" "$PY" $args >"$LOGS/$name.out" 2>"$LOGS/$name.err"
  rc=$?
  line="$name rc=$rc $(( $(date +%s) - start ))s"
  if (( rc == 124 )); then line="$line (time limit)"; fi
  if (( rc == 137 )); then line="$line (killed: time limit, or out of memory)"; fi
  echo "$line" | tee -a "$LOGS/summary.txt"
  tail -n 3 "$LOGS/$name.out"
  if (( rc != 0 )); then failed=1; tail -n 20 "$LOGS/$name.err"; fi
  pack
done
if [[ -n "$packed" ]]; then echo "$packed"; fi
exit $failed
