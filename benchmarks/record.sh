#!/usr/bin/env bash
# Everything to commit for a device, in one command: first the GPU tier of the tests (`python -m pytest -m gpu`,
# its result line kept), then for each preset in bf16 with one ds_config on one process: throughput (DeepSpeed
# against the plain-PyTorch loop, MFU against the datasheet peak), eager and with train.compile; the memory plan
# beside the measured peak and per-rank memory against the ZeRO theory (MEMORY=0 leaves both out: the tier checks
# the plan at ZeRO 0-3); for the presets of $SWEEP (default gpt2_124m; empty for none) the step's levers, a train.py
# run each (benchmarks/sweep.py: the micro-batches of $SWEEP_MICRO, default 16 32 64, at $SWEEP_GLOBAL windows a step,
# default 64, then eager (the presets compile), ZeRO-0, the flash and cuDNN attention kernels first and inductor's
# autotuned matmuls at the fastest). $SETTINGS adds run-config overrides to the throughput rows and the memory plan
# (ds.* for the ds_config).
# As JSON under benchmarks/results/<device>/ (device name, software versions and date are in each file), and a
# markdown table of it at the end. On one H200 the tier took 3 min 20 s, a throughput row 30 s eager and 50 s
# compiled, a sweep row 30 to 40 s. PROFILE=N profiles N more steps of each compiled row: its top kernels, in its JSON.
#
#   bash benchmarks/record.sh [PRESET ...]      # default: gpt2_124m llama_124m, context 1024, ZeRO-1
#   DS_CONFIG=ds_configs/zero2.json TEXT=path/to/tinyshakespeare.txt bash benchmarks/record.sh gpt2_350m encoder_1b
#   SWEEP= MEMORY=0 SETTINGS="ds.train_micro_batch_size_per_gpu=64" bash benchmarks/record.sh   # in 7 minutes
#
# The character-level Shakespeare data stands in for the BPE data (the BPE needs a download; the presets keep
# their vocabulary, a bpe:N tokenizer's as N ids, so parameter counts and FLOPs are the real ones). It is prepared
# from $TEXT when missing. Exit status: 1 if the GPU tier failed (the figures are recorded all the same).
set -euo pipefail
case "${1:-}" in -h|--help) awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; exit 0;; esac
fail() { echo "error: $*" >&2; exit 2; }  # bad input ends as in the Python tools: one line, exit 2
cd "$(dirname "$0")/.."
presets=("$@")
[ ${#presets[@]} -eq 0 ] && presets=(gpt2_124m llama_124m)
ds_config=${DS_CONFIG:-ds_configs/zero1.json}
read -r -a settings <<< "${SETTINGS:-}"
read -r -a sweep_micro <<< "${SWEEP_MICRO:-16 32 64}"
sweep_global=${SWEEP_GLOBAL:-64}
data=data/shakespeare_char
python=${PYTHON:-python3}

stage=$(basename "$ds_config" .json)
if ! "$python" -c "import sys; from benchmarks.memory import STAGES; sys.exit('$stage' not in STAGES)"; then
    fail "DS_CONFIG=$ds_config: the memory benchmark measures ds_configs/<name>.json for the names in" \
         "benchmarks/memory.py's STAGES (zero0 ... zero2_offload); fix: pick one of those"
fi
for preset in "${presets[@]}"; do  # all of them before the first one's minutes of measuring
    [ -f "configs/$preset.yaml" ] || fail "preset configs/$preset.yaml does not exist; fix: name a file of configs/" \
                                          "without .yaml"
done
if [ ! -f "$data/train.bin" ]; then
    [ -f "${TEXT:-}" ] || fail "the text TEXT=${TEXT:-} does not exist, and $data is not prepared; fix: set TEXT to" \
                               "tinyshakespeare.txt"
    "$python" -m data.prepare --tokenizer char --input "$TEXT" --out_dir "$data"
fi
device=$("$python" -c "from benchmarks.report import device_slug; print(device_slug())")
results=benchmarks/results/$device
mkdir -p "$results"

# The GPU tier (tests/test_gpu*.py) prepares its own dataset from $SHAKESPEARE_TXT (else $TEXT, else where
# tests/conftest.py looks).
[ -n "${TEXT:-}" ] && export SHAKESPEARE_TXT=${SHAKESPEARE_TXT:-$TEXT}
# First the checks that time the device, alone on it; then the rest over $GPU_WORKERS workers (default 4), which
# train each run that several checks read once (tests/test_gpu.py's Runs).
tier=0 workers=${GPU_WORKERS:-4}
tier_pass() {
    local rc=0
    "$python" -m pytest tests/test_gpu.py tests/test_gpu_probes.py -p no:cacheprovider -q --durations=8 "$@" 2>&1 \
        | tee -a "$results/gpu_tests.log" || rc=$?
    summary+=("$(tail -n 1 "$results/gpu_tests.log")")
    return $rc
}
: > "$results/gpu_tests.log"
summary=()
tier_pass -m "gpu and timed" -n 0 || tier=1
tier_pass -m "gpu and not timed" -n "$workers" --dist load || tier=1
{ date +%F; echo "timed alone: ${summary[0]}; the rest over $workers workers: ${summary[1]}"; } \
    > "$results/gpu_tests.txt"
echo "record.sh: the GPU tier ended at ${SECONDS}s"

probe() { "$python" -c "from benchmarks.gpu_probes import main; main()" "$@"; }
for preset in "${presets[@]}"; do
    # the last line: DeepSpeed's accelerator warning may come first on stdout
    vocab=$("$python" -c "from benchmarks.gpu_figures import preset_vocab; print(preset_vocab('configs/$preset.yaml'))" \
            | tail -n 1)
    data_overrides=(data.dir="$data" data.tokenizer=char model.vocab_size="$vocab")
    overrides=("${data_overrides[@]}" "${settings[@]}")
    for compiled in false true; do
        name=throughput_${preset}_$stage$([ "$compiled" = true ] && echo _compiled || true)
        profile=$([ "$compiled" = true ] && echo "${PROFILE:-0}" || echo 0)
        "$python" benchmarks/throughput.py --config "configs/$preset.yaml" --ds_config "$ds_config" \
            --precisions bf16 --steps 20 --profile "$profile" --json "$results/$name.json" "${overrides[@]}" \
            train.compile=$compiled
    done
    if [ "${MEMORY:-1}" != 0 ]; then  # eager, as the tier checks the plan: the live-tensor count runs the loss eagerly
        probe memory "$results/memory_plan_${preset}_$stage.json" "configs/$preset.yaml" "$ds_config" \
            "${overrides[@]}" train.compile=false
        "$python" benchmarks/memory.py --config "configs/$preset.yaml" --nprocs 1 --stages "$stage" \
            --json "$results/memory_${preset}_$stage.json" "${overrides[@]}" train.compile=false
    fi
    if [[ " ${SWEEP-gpt2_124m} " == *" $preset "* ]]; then
        "$python" benchmarks/sweep.py --config "configs/$preset.yaml" --ds_config "$ds_config" \
            --global_batch "$sweep_global" --micro "${sweep_micro[@]}" --steps 20 --levers train.compile=false \
            ds_config=ds_configs/zero0.json train.sdpa_backend=flash train.sdpa_backend=cudnn \
            env:TORCHINDUCTOR_MAX_AUTOTUNE_GEMM=1 \
            --work_dir out/benchmarks/sweep --json "$results/sweep_${preset}_$stage.json" "${data_overrides[@]}" || true
    fi
    echo "record.sh: $preset ended at ${SECONDS}s"
done
"$python" -c "from benchmarks.gpu_figures import main; main()" "$results" "${presets[@]}"
ls -l "$results"
exit $tier
