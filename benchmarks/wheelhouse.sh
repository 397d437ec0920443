#!/usr/bin/env bash
# Wheels for a machine that has torch but neither DeepSpeed nor a network (a lent GPU box, an air-gapped node):
# DeepSpeed built here as a pure-Python wheel (no ops compiled in: the repo needs none, DeepSpeed would build
# one just in time), and the packages that DeepSpeed and this repo import which a torch image lacks, at the
# versions installed here.
#
#   bash benchmarks/wheelhouse.sh [DIR] [PYTHON_VERSION]        # defaults: .whl 3.12 (the target's Python)
#
# There, from a copy of the repo with DIR in it:
#   python3 -m pip install -q --no-index --no-deps --target /tmp/site DIR/*.whl && export PYTHONPATH=/tmp/site
#   python3 benchmarks/throughput.py --config configs/gpt2_350m.yaml --ds_config ds_configs/zero2.json \
#       --precisions bf16 data.dir=data/shakespeare_char data.tokenizer=char
#   TEXT=path/to/tinyshakespeare.txt bash benchmarks/record.sh     # the GPU tier of the tests, then every figure
#
# The compiled packages DeepSpeed imports (numpy, psutil, msgpack, ninja) and PyYAML, tiktoken and safetensors
# are expected from the machine's image, as torch's own images ship them; the check at the end of the install
# line below names any that is missing.
set -euo pipefail
case "${1:-}" in -h|--help) awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; exit 0;; esac
fail() { echo "error: $*" >&2; exit 2; }  # bad input ends as in the Python tools: one line, exit 2
dir=${1:-.whl}
python_version=${2:-3.12}
[ -f "$dir" ] && fail "wheel folder $dir is a file, not a folder; fix: name a folder (made if missing)"
[[ "$python_version" =~ ^3\.[0-9]+$ ]] || fail "PYTHON_VERSION $python_version is not of the form 3.N; fix: give" \
                                               "the target's Python, e.g. 3.12"
python=${PYTHON:-python3}
version() { "$python" -c "import importlib.metadata as m; print(m.version('$1'))"; }

mkdir -p "$dir"
DS_BUILD_OPS=0 "$python" -m pip wheel -q --no-deps --no-build-isolation -w "$dir" "deepspeed==$(version deepspeed)"

# pytest and what it needs: the GPU tier of the tests (`python -m pytest -m gpu`), which record.sh runs first.
pure_python=(hjson einops py-cpuinfo packaging tqdm pydantic annotated-types typing-inspection typing-extensions omegaconf
             pytest pluggy iniconfig pygments pytest-xdist execnet)
pins=()
for name in "${pure_python[@]}"; do pins+=("$name==$(version "$name")"); done
"$python" -m pip download -q --no-deps --only-binary=:all: -d "$dir" "${pins[@]}"
if [ "$python_version" = 3.10 ]; then  # what pytest needs before Python 3.11
    "$python" -m pip download -q --no-deps --only-binary=:all: -d "$dir" "exceptiongroup>=1" "tomli>=2"
fi

# pydantic's core and zstandard (tests/conftest.py imports it) are compiled: fetch the builds for the target's Python.
"$python" -m pip download -q --no-deps --only-binary=:all: -d "$dir" \
    --python-version "$python_version" --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    "pydantic-core==$(version pydantic-core)" "zstandard==$(version zstandard)"

ls -1 "$dir"
cat <<EOF

Install there (Python $python_version):
  python3 -m pip install -q --no-index --no-deps --target /tmp/site $dir/*.whl && export PYTHONPATH=/tmp/site
  python3 -c "import numpy, psutil, msgpack, yaml, tiktoken, safetensors, deepspeed, omegaconf, pytest; print('ready')"
EOF
