#!/usr/bin/env bash
# Download the wheels `make gpu-check` needs on a GPU machine without network.
#
#     bash benchmarks/gpu_check_wheels.sh [DIR]        (default DIR: .whl)
#
# Run it on a machine with network (any OS / Python with pip): for every NAME==VERSION of
# benchmarks/gpu_check_requirements.txt (NAME==VERSION, or NAME>=VERSION: the newest) it
# downloads the CPython 3.12 manylinux x86_64 wheel (or the pure-python one) into DIR with
# --no-deps (the list already names each missing dependency), and builds the wheel of a
# package that PyPI has as source only
# (antlr4-python3-runtime; pure python, so the wheel built here installs anywhere).
# Then carry DIR to the GPU machine and run there, from the repository root:
#
#     make gpu-check WHEELS=DIR        (= python3 benchmarks/gpu_check.py --wheels DIR)
#
# The GPU machines of this workplace take at most 64 MiB along with the working tree: the
# script fails when DIR is larger. DIR is not for committing (.gitignore lists .whl/).
# PY_VERSION=3.11 (etc.) downloads for another Python. Not downloaded: torch (the machine's CUDA build is used) and transformer-engine (hundreds
# of MB and built against one torch; without it the local layer spec is used).
set -euo pipefail
cd "$(dirname "$0")/.."
DIR=${1:-.whl}
PYTHON=${PYTHON:-python3}
LIMIT_MIB=${LIMIT_MIB:-64}
REQS=benchmarks/gpu_check_requirements.txt
mkdir -p "$DIR"
PY_VERSION=${PY_VERSION:-3.12}  # the GPU machine's Python (3.12 on this workplace's)
PLATFORM=(--python-version "$PY_VERSION" --implementation cp --abi "cp${PY_VERSION/./}"
          --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64
          --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
for req in $(grep -v '^#' "$REQS" | sed 's/[[:space:]]//g' | grep -v '^$'); do
    name=${req%%[<>=]*}
    if "$PYTHON" -m pip download -q --no-deps --only-binary=:all: "${PLATFORM[@]}" -d "$DIR" "$req" 2>/dev/null; then
        continue
    fi
    if "$PYTHON" -m pip download -q --no-deps --only-binary=:all: --platform any -d "$DIR" "$req" 2>/dev/null; then
        continue
    fi
    echo "gpu_check_wheels: no cp${PY_VERSION/./} manylinux x86_64 or pure wheel of $req on the index; building it from source" >&2
    "$PYTHON" -m pip wheel -q --no-deps --no-binary "$name" -w "$DIR" "$req"
    built=$(ls "$DIR" | grep -i "^$(echo "$name" | tr '-' '_')-" | grep '\.whl$' || true)
    case "$built" in
        *-py3-none-any.whl|*-py2.py3-none-any.whl) ;;
        *) echo "gpu_check_wheels: $req built as '$built', not a pure-python wheel: it would not install on the GPU machine" >&2
           exit 1 ;;
    esac
done
rm -f "$DIR"/*.tar.gz "$DIR"/*.zip
count=$(ls "$DIR"/*.whl | wc -l)
bytes=$(du -cb "$DIR"/*.whl | tail -1 | cut -f1)
echo "gpu_check_wheels: $count wheels, $((bytes / 1024)) KiB in $DIR"
if [ "$bytes" -gt $((LIMIT_MIB * 1024 * 1024)) ]; then
    echo "gpu_check_wheels: $DIR is over ${LIMIT_MIB} MiB, more than the GPU machine takes along" >&2
    exit 1
fi
