#!/usr/bin/env bash
# Build the offline bundle for the H200 machine and split it into parts that fit one transfer each.
#
# Usage: scripts/gpu_lane/make_bundle.sh [OUTDIR]        (default .gpu; `make gpu-bundle` runs it)
#
# OUTDIR/p0 p1 p2 ...   one part each, the last with SHA256SUMS; a part is 58 MiB less the
# repository's tracked files (PART_MB: a fixed size)
# Contents: vLLM 0.26.0 and the wheels it needs on the machine (wheels.txt, slimmed as below),
# gpupool's own wheel and its dependencies the machine lacks (gpupool-deps.txt), the routing
# bench's peer routers (routing-peers.txt; BUNDLE_PEERS=0 leaves them out: one part fewer for the
# phases that do not need them, as the sleep phases), all cp312.
# Downloads are cached in OUTDIR/cache, so a rebuild after a gpupool change only re-wheels gpupool.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
out=$(mkdir -p "${1:-$root/.gpu}" && cd "${1:-$root/.gpu}" && pwd)
py=${PYTHON:-python3}
plat=(--platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64
      --platform manylinux_2_26_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64
      --platform manylinux2014_x86_64 --platform manylinux_2_5_x86_64 --platform manylinux1_x86_64)
cache=$out/cache
mkdir -p "$cache/whl"
grep -hv '^#' "$here/wheels.txt" "$here/gpupool-deps.txt" "$here/routing-peers.txt" | grep . \
    > "$cache/want.txt"
if ! cmp -s "$cache/want.txt" "$cache/have.txt"; then
    rm -f "$cache"/whl/*.whl
    xargs "$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
        --implementation cp "${plat[@]}" -d "$cache/whl" < "$cache/want.txt"
    # Slim vLLM: FlashAttention-2 (Hopper uses FA3), the vllm-rs binary, deep_gemm for other Pythons.
    zip -q -d "$cache"/whl/vllm-*.whl 'vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so' 'vllm/vllm-rs' \
        'vllm/third_party/deep_gemm/_C.cpython-31[0134]-x86_64-linux-gnu.so' >/dev/null
    cp "$cache/want.txt" "$cache/have.txt"
fi
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
mkdir -p "$work/whl"
cp "$cache"/whl/*.whl "$work/whl/"
if [ "${BUNDLE_PEERS:-1}" = 0 ]; then  # without the routing bench's peer routers (~52 MiB)
    grep -v '^#' "$here/routing-peers.txt" | grep . | while read -r spec; do
        rm -f "$work/whl/$(echo "${spec%%==*}" | tr - _)"-*.whl
    done
fi
"$py" -m pip wheel -q --no-deps --no-build-isolation -w "$work/whl" "$root" 2>/dev/null \
    || "$py" -m pip wheel -q --no-deps -w "$work/whl" "$root"
tar -C "$work/whl" -cf "$work/bundle.tar" .
rm -rf "$out"/p[0-9]*
repo=$(git -C "$root" ls-files -z | (cd "$root" && du -cb --files0-from=-) | tail -1 | cut -f1)
part=$(( ${PART_MB:-0} * 1048576 ))
# 58 MiB less the repository: a part with 63 MiB less it was refused as "larger than 64 MiB" on
# 2026-12-05 (9 MiB repository, 55 MiB part; a 50 MiB part went through the same check)
[ "$part" -gt 0 ] || part=$(( 58 * 1048576 - repo ))
split -b "$part" -d "$work/bundle.tar" "$work/bundle.tar.part"
(cd "$work" && sha256sum bundle.tar.part* > SHA256SUMS)
i=0
for p in "$work"/bundle.tar.part*; do mkdir -p "$out/p$i"; mv "$p" "$out/p$i/"; i=$((i + 1)); done
mv "$work/SHA256SUMS" "$out/p$((i - 1))/"
ls "$work/whl" > "$out/p$((i - 1))/WHEELS"
du -sh "$out"/p[0-9]*
