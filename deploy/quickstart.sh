#!/usr/bin/env bash
# kvd quickstart: from a fresh Debian 12 / Ubuntu 24.04 machine to a running daemon or a passing test
# suite, in one command each.
#
#   deploy/quickstart.sh run    install what is missing, build, start kvd in the foreground
#                               (extra arguments go to kvd; see build/daemon/kvd --help)
#   deploy/quickstart.sh test   install what is missing, build, run the whole test suite
#   deploy/quickstart.sh build  install what is missing and build, nothing else
#
# Idempotent: packages already installed are not touched and the build is incremental. Installing
# needs root; run it as root or as a user with sudo. Environment:
#   KVD_BUILD_DIR   build directory (default: build/ in the checkout)
#   KVD_CUDA, KVD_HIP   ON/OFF to force a vendor backend (default: ON when its compiler is present;
#                   the test command under CI=true requires both, so vendor code always compiles)
#   KVD_JOBS        parallel build jobs (default: nproc)
set -euo pipefail

usage() { sed -n '2,16p' "$0" | sed 's/^# \{0,1\}//'; }
mode=${1:-}
case $mode in
  run | test | build) shift ;;
  -h | --help) usage; exit 0 ;;
  *) usage >&2; exit 2 ;;
esac

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
build=${KVD_BUILD_DIR:-$root/build}
jobs=${KVD_JOBS:-$(nproc)}
say() { printf '\033[1mquickstart:\033[0m %s\n' "$*" >&2; }
started=$SECONDS

# --- 1. Debian packages ---------------------------------------------------------------------------
packages=(
  build-essential cmake ninja-build pkg-config file
  libgrpc++-dev protobuf-compiler-grpc libprotobuf-dev protobuf-compiler
  libabsl-dev libspdlog-dev libcli11-dev prometheus-cpp-dev libsystemd-dev
  libgtest-dev libgmock-dev libbenchmark-dev
  hipcc libamdhip64-dev
  python3 python3-grpcio python3-protobuf python3-numpy
  prometheus  # promtool and a real Prometheus server for the metrics tests
  systemd yamllint  # tests/deploy/validate.sh: systemd-analyze, systemd-sysusers, yamllint
)
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || missing+=("$p")
done
# tests/deploy/validate.sh checks the Kubernetes manifests with npm packages: the test mode needs node and
# npm, Debian's unless some are already on the PATH (e.g. NodeSource's nodejs, which bundles npm).
if [[ $mode == test ]]; then
  # clang: the thread-safety build below (Debian's clang, whose -Wthread-safety checks the lock annotations).
  command -v clang++ >/dev/null || missing+=(clang)
  command -v node >/dev/null || missing+=(nodejs)
  command -v npm >/dev/null || missing+=(npm)
fi
if ((${#missing[@]})); then
  say "installing ${#missing[@]} missing packages: ${missing[*]}"
  sudo=()
  if ((EUID != 0)); then
    command -v sudo >/dev/null || { say "need root to install packages: run as root or install sudo"; exit 1; }
    sudo=(sudo)
  fi
  export DEBIAN_FRONTEND=noninteractive
  "${sudo[@]}" apt-get update -qq
  "${sudo[@]}" apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
else
  say "all ${#packages[@]} packages present"
fi

# --- 2. Configure and build -------------------------------------------------------------------------
nvcc=$(command -v nvcc || true)
[[ -z $nvcc && -x /usr/local/cuda/bin/nvcc ]] && nvcc=/usr/local/cuda/bin/nvcc
cuda=${KVD_CUDA:-$([[ -n $nvcc ]] && echo ON || echo OFF)}
hip=${KVD_HIP:-$(command -v hipcc >/dev/null && echo ON || echo OFF)}
if [[ $mode == test && ${CI:-} == true && ($cuda != ON || $hip != ON) ]]; then
  say "CI must build both vendor backends (CUDA=$cuda, HIP=$hip): nvcc and hipcc are required"
  exit 1
fi
args=(-S "$root" -B "$build" -G Ninja -DKVD_ENABLE_CUDA="$cuda" -DKVD_ENABLE_HIP="$hip")
[[ $cuda == ON && -n $nvcc ]] && args+=(-DCMAKE_CUDA_COMPILER="$nvcc")
say "configuring $build (CUDA backend $cuda, HIP backend $hip)"
mkdir -p "$build"
cmake "${args[@]}" >"$build/configure.log" 2>&1 || { cat "$build/configure.log"; exit 1; }
say "building with $jobs jobs"
cmake --build "$build" -j "$jobs"
say "set-up took $((SECONDS - started)) s"

# --- 3. Run or test ---------------------------------------------------------------------------------
case $mode in
  build) ;;
  run)
    # kvd's default socket is /run/kvd/gpu<N>.sock, which needs root; elsewhere use the user's runtime
    # directory unless a --socket was given.
    args=("$@")
    if ((EUID != 0)) && [[ " $* " != *" --socket"* ]]; then
      args+=("--socket=${XDG_RUNTIME_DIR:-/tmp}/kvd/gpu0.sock")
    fi
    say "starting $build/daemon/kvd ${args[*]} (Ctrl-C stops it)"
    exec "$build/daemon/kvd" "${args[@]}"
    ;;
  test)
    # The lock annotations, checked by the compiler: the whole tree (tests too, and the vendor backends
    # that are built above) built with clang and -Wthread-safety as errors.
    clang_build=${KVD_CLANG_BUILD_DIR:-$build-clang}
    say "thread-safety build with clang in $clang_build"
    mkdir -p "$clang_build"
    clang_args=(-S "$root" -B "$clang_build" -G Ninja -DCMAKE_C_COMPILER=clang -DCMAKE_CXX_COMPILER=clang++
                -DKVD_ENABLE_CUDA="$cuda" -DKVD_ENABLE_HIP="$hip")
    [[ $cuda == ON && -n $nvcc ]] && clang_args+=(-DCMAKE_CUDA_COMPILER="$nvcc")
    cmake "${clang_args[@]}" >"$clang_build/configure.log" 2>&1 ||
      { cat "$clang_build/configure.log"; exit 1; }
    cmake --build "$clang_build" -j "$jobs" >"$clang_build/build.log" 2>&1 ||
      { grep -E 'error|warning' "$clang_build/build.log" | head -50; say "the clang thread-safety build failed (log: $clang_build/build.log)"; exit 1; }
    say "thread-safety build clean; set-up took $((SECONDS - started)) s"
    say "running the test suite (tests labelled gpu are skipped without a GPU)"
    cd "$build"
    ctest --output-on-failure -j "$jobs" "$@"
    ;;
esac
