#!/usr/bin/env bash
# The figures to commit for a device: throughput (DeepSpeed against the plain loop, MFU against the measured
# peak) and per-rank memory of each preset with one ds_config, on one process, as JSON under
# benchmarks/results/<device>/ (device name, software versions and date are in each file).
#
#   bash benchmarks/record.sh [PRESET ...]      # default: gpt2_124m gpt2_350m encoder_1b
#   DS_CONFIG=ds_configs/zero3.json TEXT=path/to/tinyshakespeare.txt bash benchmarks/record.sh gpt2_1.5b
#
# The character-level Shakespeare data stands in for the BPE data (the BPE needs a download; the presets keep
# the GPT-2 vocabulary, so parameter counts and FLOPs are the real ones). It is prepared from $TEXT when missing.
set -euo pipefail
case "${1:-}" in -h|--help) awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; exit 0;; esac
fail() { echo "error: $*" >&2; exit 2; }  # bad input ends as in the Python tools: one line, exit 2
cd "$(dirname "$0")/.."
presets=("$@")
[ ${#presets[@]} -eq 0 ] && presets=(gpt2_124m gpt2_350m encoder_1b)
ds_config=${DS_CONFIG:-ds_configs/zero2.json}
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
overrides=(data.dir="$data" data.tokenizer=char)
for preset in "${presets[@]}"; do
    "$python" benchmarks/throughput.py --config "configs/$preset.yaml" --ds_config "$ds_config" --precisions bf16 \
        --steps 20 --json "$results/throughput_${preset}_$stage.json" "${overrides[@]}"
    "$python" benchmarks/memory.py --config "configs/$preset.yaml" --nprocs 1 --stages "$stage" \
        --json "$results/memory_${preset}_$stage.json" "${overrides[@]}"
done
ls -l "$results"
