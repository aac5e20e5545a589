#!/usr/bin/env bash
# One GPU check of autoloop's harness and train.py on a CUDA machine, in under 8 minutes (one H100/H200):
#
#   1. the GPU, driver, Python, torch / CUDA versions
#   2. python prepare.py                           (timed; offline corpus, default pypackages)
#   3. a 60 s gpu-profile training run             (AUTOLOOP_PROFILE=gpu AUTOLOOP_TIME_BUDGET=60 python train.py,
#                                                   AUTOLOOP_EVAL_ARTIFACT set: train.py saves the model as it
#                                                   does under the controller); its summary, the median tokens/s
#                                                   over the step lines (compilation steps left out), MFU, memory
#   4. python -I -S evaluate.py MODEL --split val  (timed: the controller's own evaluation step: the exported
#                                                   graph loaded without running train.py, scored, probed; the
#                                                   probes' noise figures measure this GPU's kernels)
#   5. pytest -q -m cuda                           (the CUDA-marked tests)
#
# and ends with a "figures" block (key: value lines). Everything is also written under $OUT when it is set
# (gpu_check.log, prepare.log, train.log, eval.log, pytest.log, figures.txt), else under the work directory.
#
#   bash benchmarks/gpu_check.sh                       # on the GPU machine
#   bash benchmarks/gpu_check.sh --dry-run             # here, on a CPU: the same steps with the tiny profile,
#                                                      # a 5 s budget, the pystdlib corpus, no nvidia-smi, and
#                                                      # only a collection of the CUDA tests (well under a minute)
#   bash benchmarks/gpu_check.sh --dataset pystdlib --budget 30
#
# Options: --dry-run, --dataset NAME (or GPU_CHECK_DATASET; default pypackages, dry run pystdlib),
# --budget SECONDS (default 60, dry run 5), --limit SECONDS (or GPU_CHECK_LIMIT_S; the whole check's time,
# default 470: each step gets what is left). PYTHON picks the interpreter (default python3).
#
# The machine may be offline: this script never downloads anything and never installs torch. Python packages
# the project needs that are missing there travel as wheels in .whl/ at the repo root (git-ignored through
# .git/info/exclude) and are installed with `pip install --no-index --no-deps --target` into the work
# directory, which goes first on PYTHONPATH with the repo (the project is not pip-installed there). To make
# them, here (Python 3.12, x86-64 Linux):
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
#     -d .whl GitPython==3.2.1 gitdb==4.0.12 smmap==5.0.3 rustbpe==0.1.0
# A temporary AUTOLOOP_CACHE is used, so no prepared data of the user's is read or written.

set -euo pipefail
export LC_NUMERIC=C

usage() { sed -n '2,/^set -euo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'; }

DRY_RUN=0
DATASET="${GPU_CHECK_DATASET:-}"
BUDGET=""
LIMIT_S="${GPU_CHECK_LIMIT_S:-470}"
while [ $# -gt 0 ]; do
  case "$1" in
    --dry-run) DRY_RUN=1 ;;
    --dataset) DATASET="${2:?--dataset needs a name}"; shift ;;
    --dataset=*) DATASET="${1#*=}" ;;
    --budget) BUDGET="${2:?--budget needs seconds}"; shift ;;
    --budget=*) BUDGET="${1#*=}" ;;
    --limit) LIMIT_S="${2:?--limit needs seconds}"; shift ;;
    --limit=*) LIMIT_S="${1#*=}" ;;
    -h|--help) usage; exit 0 ;;
    *) echo "gpu_check: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
  shift
done

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${PYTHON:-python3}"
if [ "$DRY_RUN" = 1 ]; then
  PROFILE=tiny; DATASET="${DATASET:-pystdlib}"; BUDGET="${BUDGET:-5}"
else
  PROFILE=gpu; DATASET="${DATASET:-pypackages}"; BUDGET="${BUDGET:-60}"
fi

# A clean slate: the caller's AUTOLOOP_* settings would change what is measured.
while IFS= read -r name; do unset "$name"; done < <(compgen -e | grep '^AUTOLOOP_' || true)

WORK="$(mktemp -d "${TMPDIR:-/tmp}/gpu_check.XXXXXX")"
LOGDIR="${OUT:-$WORK/out}"
mkdir -p "$LOGDIR"
CACHE="$WORK/cache"
MODEL="$WORK/model.pt"
exec > >(tee -a "$LOGDIR/gpu_check.log") 2>&1
TEE_PID=$!

finish() {
  local rc=$?
  if [ "${GPU_CHECK_KEEP:-0}" = 1 ]; then
    echo "gpu_check: work directory kept: $WORK"
  else
    rm -rf "$CACHE" "$MODEL" "$WORK/site"
    [ -n "${OUT:-}" ] && rm -rf "$WORK"
  fi
  exec 1>&- 2>&-
  wait "$TEE_PID" 2>/dev/null || true
  exit "$rc"
}
trap finish EXIT

now() { echo "${EPOCHREALTIME:-$(date +%s.%N)}"; }
T_START="$(now)"
since() { awk -v a="$1" -v b="$(now)" 'BEGIN { printf "%.1f", b - a }'; }
left() { awk -v a="$T_START" -v b="$(now)" -v l="$LIMIT_S" 'BEGIN { printf "%d", l - (b - a) }'; }
# The time limit of a step: its cap, or what is left of the whole check (less a reserve for the rest).
limit_for() { local cap="$1" reserve="${2:-0}" rest; rest=$(( $(left) - reserve )); echo $(( cap < rest ? cap : rest )); }
section() { printf '\n== %s ==\n' "$*"; }
die() { printf '\ngpu_check: FAILED: %s\n' "$*" >&2; exit 1; }

FAILED=()
declare -A FIG=()
FIG_ORDER=()
figure() { FIG_ORDER+=("$1"); FIG[$1]="$2"; }

# run_step NAME LIMIT LOG CMD...: run CMD in the repo with its output to LOG (tail shown); sets STEP_RC, STEP_S.
run_step() {
  local name="$1" limit="$2" log="$3"; shift 3
  if [ "$limit" -le 0 ]; then
    echo "gpu_check: no time left for $name (limit ${LIMIT_S}s): skipped"
    STEP_RC=124; STEP_S=0; return 0
  fi
  local t0; t0="$(now)"
  set +e
  (cd "$REPO" && timeout -k 10 "$limit" "$@") >"$log" 2>&1
  STEP_RC=$?
  set -e
  STEP_S="$(since "$t0")"
  if [ "$STEP_RC" = 124 ] || [ "$STEP_RC" = 137 ]; then
    echo "gpu_check: $name timed out after ${limit}s (exit $STEP_RC); last lines of $log:"
    tail -n 15 "$log" | sed 's/^/  | /'
  elif [ "$STEP_RC" != 0 ]; then
    echo "gpu_check: $name failed (exit $STEP_RC) after ${STEP_S}s; last lines of $log:"
    tail -n 25 "$log" | sed 's/^/  | /'
  fi
}

RUN_ENV=(AUTOLOOP_PROFILE="$PROFILE" AUTOLOOP_DATASET="$DATASET" AUTOLOOP_CACHE="$CACHE" PYTHONUNBUFFERED=1)
[ "$DRY_RUN" = 1 ] && RUN_ENV+=(AUTOLOOP_DEVICE=cpu)

# ---------------------------------------------------------------------------------------------------------------
section "machine"
echo "repo: $REPO | work: $WORK | logs: $LOGDIR"
echo "mode: $([ "$DRY_RUN" = 1 ] && echo "DRY RUN (CPU, tiny profile)" || echo "GPU") | profile $PROFILE | dataset $DATASET | budget ${BUDGET}s | limit ${LIMIT_S}s"
command -v "$PY" >/dev/null || die "no $PY on PATH (set PYTHON=/path/to/python)"
if [ "$DRY_RUN" = 1 ]; then
  echo "gpu: (dry run: nvidia-smi not asked)"
  figure gpu "none (dry run)"
else
  command -v nvidia-smi >/dev/null || die "nvidia-smi not found: is this the GPU machine? (--dry-run checks the rest on a CPU)"
  nvidia-smi -L || die "nvidia-smi -L failed: no usable NVIDIA driver"
  nvidia-smi --query-gpu=index,name,driver_version,memory.total,clocks.max.sm,power.limit --format=csv \
    || echo "(nvidia-smi --query-gpu failed; going on)"
  figure gpu "$(nvidia-smi --query-gpu=name --format=csv,noheader | head -n 1)"
  figure driver "$(nvidia-smi --query-gpu=driver_version --format=csv,noheader | head -n 1)"
  figure driver_cuda "$(nvidia-smi | sed -n 's/.*CUDA Version: *\([0-9.]*\).*/\1/p' | head -n 1)"
fi

# Wheels for what the machine lacks: installed next to the work directory, never torch, never from an index.
SITE=""
WHEELS=()
if [ -d "$REPO/.whl" ]; then
  for w in "$REPO"/.whl/*.whl; do
    [ -e "$w" ] || continue
    case "$(basename "$w")" in
      torch-*|nvidia_*|nvidia-*|triton-*) echo "gpu_check: ignoring $(basename "$w"): the installed torch stack is used" ;;
      *) WHEELS+=("$w") ;;
    esac
  done
fi
if [ "${#WHEELS[@]}" -gt 0 ]; then
  echo "wheels in .whl/: $(for w in "${WHEELS[@]}"; do basename "$w"; done | tr '\n' ' ')"
  if [ "$DRY_RUN" = 1 ]; then
    # Python here may differ from the GPU machine's (3.12): check they install for 3.12 without using them.
    PIP_ROOT_USER_ACTION=ignore "$PY" -m pip install -q --disable-pip-version-check --no-index --no-deps --no-compile --no-cache-dir --target "$WORK/site-check" \
      --only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux2014_x86_64 \
      --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 "${WHEELS[@]}" \
      || die "the wheels in .whl/ do not install for CPython 3.12 on x86-64 Linux"
    echo "wheels: install for CPython 3.12 x86-64 (checked into $WORK/site-check; not used in a dry run)"
    rm -rf "$WORK/site-check"
  else
    SITE="$WORK/site"
    PIP_ROOT_USER_ACTION=ignore "$PY" -m pip install -q --disable-pip-version-check --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "${WHEELS[@]}" \
      || die "pip could not install the wheels in .whl/ (offline, --no-deps) into $SITE"
    echo "wheels: installed into $SITE"
  fi
fi
export PYTHONPATH="$REPO${SITE:+:$SITE}${PYTHONPATH:+:$PYTHONPATH}"
if ! command -v git >/dev/null; then
  export GIT_PYTHON_REFRESH=quiet  # GitPython imports without the git program (the CUDA tests need no git)
  echo "note: no git program here; GIT_PYTHON_REFRESH=quiet"
fi

"$PY" - <<'EOF' || die "Python packages are missing (above): carry their wheels in .whl/ (see the header of benchmarks/gpu_check.sh)"
import importlib, importlib.util, sys
need = ["torch", "numpy", "git", "psutil", "pandas", "pyarrow", "click", "rustbpe", "tiktoken", "matplotlib",
        "pytest", "pytest_timeout"]
missing = [m for m in need if importlib.util.find_spec(m) is None]
if missing:
    print("missing:", ", ".join(missing))
    sys.exit(1)
broken = []
for m in need:
    try:
        importlib.import_module(m)
    except Exception as e:  # e.g. a wheel built for another Python
        broken.append(f"{m} ({type(e).__name__}: {e})")
if broken:
    print("cannot import:", "; ".join(broken))
    sys.exit(1)
print("python packages: all present")
EOF

TORCH_INFO="$("$PY" - "$DRY_RUN" <<'EOF'
import platform, sys
import torch
dry = sys.argv[1] == "1"
print(f"python {platform.python_version()} ({sys.executable})")
print(f"torch {torch.__version__} | built for CUDA {torch.version.cuda} | cuDNN {torch.backends.cudnn.version()} | "
      f"CUDA available: {torch.cuda.is_available()}")
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print(f"device 0: {p.name} | capability {p.major}.{p.minor} | {p.multi_processor_count} SMs | "
          f"{p.total_memory / 2**30:.1f} GiB | {torch.cuda.device_count()} device(s) visible")
elif not dry:
    sys.exit("torch cannot use CUDA here")
EOF
)" || die "torch: ${TORCH_INFO:-cannot be imported} (this check never installs torch)"
echo "$TORCH_INFO"
figure python "$("$PY" -c 'import platform; print(platform.python_version())')"
figure torch "$("$PY" -c 'import torch; print(torch.__version__)')"
figure torch_cuda "$("$PY" -c 'import torch; print(torch.version.cuda)')"

# ---------------------------------------------------------------------------------------------------------------
section "prepare ($DATASET, profile $PROFILE)"
run_step prepare "$(limit_for 210 150)" "$LOGDIR/prepare.log" env "${RUN_ENV[@]}" "$PY" prepare.py
figure prepare_s "$STEP_S"
if [ "$STEP_RC" != 0 ]; then
  if grep -q "neither a known dataset nor a directory" "$LOGDIR/prepare.log"; then
    echo "gpu_check: this prepare.py does not know the dataset '$DATASET'; choose one with --dataset (e.g. pystdlib)"
  fi
  die "prepare.py (exit $STEP_RC): see $LOGDIR/prepare.log"
fi
tail -n 4 "$LOGDIR/prepare.log"
echo "prepare: ${STEP_S}s"

# ---------------------------------------------------------------------------------------------------------------
section "train.py: ${BUDGET}s budget, profile $PROFILE"
run_step train "$(limit_for $((${BUDGET%.*} + 200)) 60)" "$LOGDIR/train.log" \
  env "${RUN_ENV[@]}" AUTOLOOP_TIME_BUDGET="$BUDGET" AUTOLOOP_EVAL_ARTIFACT="$MODEL" "$PY" train.py
TRAIN_RC=$STEP_RC
figure train_wall_s "$STEP_S"
if [ "$TRAIN_RC" = 0 ]; then
  sed -n '1,2p' "$LOGDIR/train.log"
  grep -E '^step ' "$LOGDIR/train.log" | sed -n '1,3p;$p' | sed 's/^/  /' || true
  sed -n '/^---$/,$p' "$LOGDIR/train.log"
  echo "train.py process: ${STEP_S}s"
else
  FAILED+=(train)
fi

# ---------------------------------------------------------------------------------------------------------------
section "harness evaluation: evaluate.py model.pt --split val"
if [ "$TRAIN_RC" != 0 ]; then
  echo "gpu_check: skipped: train.py failed"; FAILED+=(evaluate)
elif [ ! -s "$MODEL" ]; then
  echo "gpu_check: train.py saved no model at $MODEL (AUTOLOOP_EVAL_ARTIFACT): does it still call prepare.evaluate_bpb?"
  FAILED+=(evaluate)
else
  ls -l "$MODEL" | awk '{ printf "model.pt: %.1f MB\n", $5 / 1e6 }'
  run_step evaluate "$(limit_for 150 45)" "$LOGDIR/eval.log" \
    env "${RUN_ENV[@]}" AUTOLOOP_TIME_BUDGET="$BUDGET" "$PY" -I -S evaluate.py "$MODEL" --split val
  figure harness_eval_s "$STEP_S"
  grep '^AUTOLOOP_EVAL ' "$LOGDIR/eval.log" || true
  echo "harness evaluation: ${STEP_S}s"
  [ "$STEP_RC" = 0 ] && grep -q '^AUTOLOOP_EVAL {' "$LOGDIR/eval.log" || FAILED+=(evaluate)
fi
rm -f "$MODEL"

# ---------------------------------------------------------------------------------------------------------------
section "pytest -q -m cuda"
PYTEST_ENV=(env -u AUTOLOOP_PROFILE -u AUTOLOOP_DATASET -u AUTOLOOP_CACHE -u AUTOLOOP_DEVICE)
if [ "$DRY_RUN" = 1 ]; then
  echo "(dry run: collecting the CUDA tests only)"
  run_step pytest "$(limit_for 120)" "$LOGDIR/pytest.log" \
    "${PYTEST_ENV[@]}" "$PY" -m pytest -q -m cuda -p no:cacheprovider --collect-only
else
  run_step pytest "$(limit_for 400 5)" "$LOGDIR/pytest.log" \
    "${PYTEST_ENV[@]}" "$PY" -m pytest -q -m cuda -p no:cacheprovider
fi
tail -n 6 "$LOGDIR/pytest.log"
figure pytest "$(grep -E '([0-9]+ (passed|failed|skipped|error|errors|deselected|selected|tests? collected))|no tests ran' \
  "$LOGDIR/pytest.log" | tail -n 1 | sed 's/^=* *//; s/ *=*$//') (exit $STEP_RC, ${STEP_S}s)"
[ "$STEP_RC" = 0 ] || FAILED+=(pytest)

# ---------------------------------------------------------------------------------------------------------------
section "figures"
{
  for key in "${FIG_ORDER[@]}"; do
    case "$key" in train_wall_s|harness_eval_s|pytest) continue ;; esac
    echo "$key: ${FIG[$key]}"
  done
  echo "profile: $PROFILE"
  echo "dataset: $DATASET"
  echo "budget_s: $BUDGET"
  "$PY" - "$LOGDIR/train.log" "$LOGDIR/eval.log" "$LOGDIR/prepare.log" "${FIG[train_wall_s]:-}" <<'EOF'
import json, re, statistics, sys
train_log, eval_log, prepare_log, wall = sys.argv[1:5]
read = lambda p: open(p, errors="replace").read() if __import__("os").path.exists(p) else ""
out = read(train_log)
m = re.search(r"Done in [\d.]+s: (?:evaluation )?(\d+) validation", read(prepare_log))
if m:
    print(f"eval_tokens_prepared: {m.group(1)}")
summary = {}
if "\n---\n" in out:
    summary = dict(re.findall(r"^(\w+):\s+(\S+)\s*$", out[out.rindex("\n---\n"):], re.M))
head = re.search(r"^device: .*$", out, re.M)
if head:
    print(f"train_setup: {head.group(0)}")
startup = re.search(r"startup ([\d.]+)s", out)
steps = [(int(s), float(p), float(r.replace(",", "")), float(u) if u else None)
         for s, p, r, u in re.findall(r"^step (\d+) \(([\d.]+)%\).*?tok/sec: ([\d,]+)(?:.*?mfu: ([\d.]+)%)?", out, re.M)]
counted = [x for x in steps if x[1] > 0.0][1:]  # 0.0%: steps before the clock runs (compilation, warm-up)
if len(counted) < 3:
    counted = steps[1:] or steps
print(f"train_wall_s: {wall or '-'}")
print(f"startup_s (printed, main() to the first step): {startup.group(1) if startup else '-'}")
for key in ("training_seconds", "total_seconds", "num_steps", "total_tokens_M", "num_params_M", "dtype", "device"):
    print(f"{key}: {summary.get(key, '-')}")
try:
    print(f"fixed_s (train.py wall - training_seconds): {float(wall) - float(summary['training_seconds']):.1f}")
except (KeyError, ValueError):
    pass
if counted:
    print(f"tokens_per_s_median: {statistics.median(r for _, _, r, _ in counted):,.0f} "
          f"(over {len(counted)} step lines; {len(steps) - len(counted)} early lines left out)")
    mfus = [u for _, _, _, u in counted if u is not None]
    print(f"mfu_percent_median_lines: {statistics.median(mfus):.1f}" if mfus else "mfu_percent_median_lines: -")
else:
    print("tokens_per_s_median: - (no step lines)")
for key in ("mfu_percent", "peak_tflops", "peak_source", "peak_vram_mb", "memory_kind", "eval_vram_mb", "val_bpb"):
    if key in summary or key in ("mfu_percent", "peak_vram_mb", "val_bpb"):
        print(f"{key}{' (train.py printed)' if key == 'val_bpb' else ''}: {summary.get(key, '-')}")
line = next((ln for ln in read(eval_log).splitlines() if ln.startswith("AUTOLOOP_EVAL ")), None)
result = json.loads(line.split(" ", 1)[1]) if line else {}
print(f"harness_val_bpb: {result.get('val_bpb', result.get('error', '-'))}")
print(f"harness_eval_tokens: {result.get('eval_tokens', '-')}")
print(f"harness_eval_scoring_s: {result.get('seconds', '-')} (scoring and {result.get('probes', '-')} probed rows, "
      f"{result.get('probe_seconds', '-')}s of it probing)")
probe = result.get("probe") or {}
print("harness_probe_noise: " + (", ".join(f"{k} {v:.3g}" for k, v in probe.items()) if probe else "-"))
m = re.search(r"model exported for the autoloop harness in ([\d.]+)s", read(train_log))
print(f"export_s: {m.group(1) if m else '-'}")
EOF
  echo "harness_eval_s: ${FIG[harness_eval_s]:--}"
  echo "pytest_cuda: ${FIG[pytest]:--}"
  echo "total_s: $(since "$T_START")"
  if [ "${#FAILED[@]}" -gt 0 ]; then echo "result: FAILED (${FAILED[*]})"; else echo "result: OK"; fi
} | tee "$LOGDIR/figures.txt"

[ "${#FAILED[@]}" -eq 0 ] || exit 1
