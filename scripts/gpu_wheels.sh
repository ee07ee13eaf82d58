#!/usr/bin/env bash
# The wheels the server needs on a GPU host that has no package index and lacks them: pydantic (the OpenAI
# request models) with its dependencies, and llguidance (structured outputs, tool calls). Downloads them
# from PyPI for CPython 3.12 on manylinux x86-64 (the host's Python) into DIR (default .whl, ignored by git);
# scripts/gpu_check.sh installs them into a target folder when DIR is there.
#
# Usage: scripts/gpu_wheels.sh [--dest DIR] [--python-version X.Y]
#   --python-version: for another interpreter (the tests fetch them for the Python that runs them).
# Fails if the set is over LIMIT_MIB: it travels with the source tree, 64 MiB in all.
set -euo pipefail
cd "$(dirname "$0")/.."

DEST=.whl
PYVER=3.12
LIMIT_MIB=16
# One version of each (two versions of a package stop the whole install there); pydantic pins pydantic-core
# exactly. typing-extensions is on the host, but maybe older than pydantic needs: it travels too.
WHEELS=(
    pydantic==2.13.4
    pydantic-core==2.46.4
    annotated-types==0.7.0
    typing-inspection==0.4.2
    typing-extensions==4.16.0
    llguidance==1.9.1
)
while [ $# -gt 0 ]; do
    case "$1" in
        --dest) DEST="$2"; shift 2 ;;
        --python-version) PYVER="$2"; shift 2 ;;
        *) echo "usage: $0 [--dest DIR] [--python-version X.Y]" >&2; exit 2 ;;
    esac
done
PLATFORMS=()
for p in manylinux_2_39 manylinux_2_35 manylinux_2_34 manylinux_2_31 manylinux_2_28 manylinux_2_27 manylinux_2_24 \
    manylinux_2_17 manylinux2014 manylinux1; do
    PLATFORMS+=(--platform "${p}_x86_64")
done
mkdir -p "$DEST"
rm -f "$DEST"/*.whl
${PYTHON:-python3} -m pip download --quiet --disable-pip-version-check --no-deps --only-binary=:all: \
    --python-version "$PYVER" --implementation cp "${PLATFORMS[@]}" -d "$DEST" "${WHEELS[@]}"
count=$(ls "$DEST"/*.whl | wc -l)
if [ "$count" != "${#WHEELS[@]}" ]; then
    echo "error: expected ${#WHEELS[@]} wheels in $DEST, found $count" >&2
    exit 1
fi
bytes=$(cat "$DEST"/*.whl | wc -c)
ls -l "$DEST"/*.whl | awk '{printf "%10d  %s\n", $5, $NF}'
echo "total: $count wheels, $bytes bytes ($(( (bytes + 1048575) / 1048576 )) MiB) for CPython $PYVER"
if [ "$bytes" -gt $(( LIMIT_MIB * 1048576 )) ]; then
    echo "error: over $LIMIT_MIB MiB: the tree and the wheels travel in 64 MiB" >&2
    exit 1
fi
