#!/usr/bin/env bash
# Bundles what tests/gpu/run_gpu.sh needs from a CUDA build into DEST (default .device): the GPU
# programs and their shared libraries, stripped of debug info to stay small (~26 MiB).
#   tests/gpu/bundle.sh [BUILD_DIR] [DEST]
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
build=${1:-$root/build} dest=${2:-$root/.device}
keep=(device_conformance_test device_peer cuda_device_test kvd_device_bench kvd kvd_probe kvctl kvd_group_bench kvd_bench
      connector_peer)
# device-bundle takes every program of the tree it is given: give it just the ones the GPU run uses.
stage=$(mktemp -d)
trap 'rm -rf "$stage"' EXIT
for p in "${keep[@]}"; do
  found=$(find "$build" -path '*/CMakeFiles' -prune -o -type f -name "$p" -perm -u+x -print -quit)
  [[ -n $found ]] || { echo "bundle.sh: $p is not built in $build" >&2; exit 1; }
  cp -p "$found" "$stage/"
done
# The C API's library, whose dependencies (gRPC, protobuf, Abseil) device-bundle gathers into lib/ with the
# programs': the Python package below carries its own copy, which finds them on LD_LIBRARY_PATH (env.sh).
[[ -f $build/client/libkvd_c.so ]] || { echo "bundle.sh: libkvd_c.so is not built in $build" >&2; exit 1; }
cp -L "$build/client/libkvd_c.so" "$stage/libkvd_c.so.1"
"$root/../shared/tools/device-bundle" "$stage" "$dest" "$root/tests/gpu/run_gpu.sh" >/dev/null
# The Python package (assembled by the kvd_python target, with its native library kvd/libkvd_c.so) and its
# GPU check, for the Python step.
if [[ -d $build/client/python/package ]]; then
  mkdir -p "$dest/python"  # what the package is (a pip install leaves its build/ behind in it)
  cp -a "$build/client/python/package/"{kvd,kvd_vllm,examples,pyproject.toml} "$dest/python/"
  cp "$root/tests/client/python/kvd_cuda_check.py" "$dest/"
fi
# The durable, restart, reshape, release and engines steps: their drivers and the helpers they import.
cp "$root/tests/testing/played_manager.py" "$root/tests/testing/line_peer.py" "$root/tests/gpu/durable_gpu.py" \
  "$root/tests/gpu/restart_torch.py" "$root/tests/gpu/reshape_torch.py" "$root/tests/gpu/release_torch.py" \
  "$root/tests/gpu/engines_torch.py" "$root/tests/gpu/engines_transformers.py" "$root/tests/gpu/arbitrate_torch.py" "$root/tests/gpu/keep_torch.py" \
  "$root/tests/gpu/node_torch.py" \
  "$dest/"
strip --strip-debug "$dest"/bin/* "$dest"/lib/*.so* "$dest"/python/kvd/*.so 2>/dev/null || true
echo "bundle.sh: $(ls "$dest/bin" | wc -l) programs, $(ls "$dest/lib" | wc -l) libraries, $(du -sh "$dest" | cut -f1) in $dest"
