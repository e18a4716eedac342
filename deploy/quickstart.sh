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
#   KVD_SANITIZERS  test mode: OFF skips the sanitizer builds and the fuzzing (default ON)
#   KVD_FUZZ_SECONDS  test mode: how long each fuzz target runs (default 20)
set -euo pipefail

usage() { sed -n '2,17p' "$0" | sed 's/^# \{0,1\}//'; }
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
  python3 python3-protobuf python3-numpy python3-venv  # python3-venv: the install test pip-installs the package
  python3-grpcio  # tests/daemon/arbitration_api_test.py sends raw requests through grpcio
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
  # clang: the thread-safety build below (Debian's clang, whose -Wthread-safety checks the lock annotations);
  # libclang-rt-dev: its sanitizer and libFuzzer runtimes, for the sanitizer builds and the fuzz targets.
  command -v clang++ >/dev/null || missing+=(clang)
  dpkg-query -W -f='${Status}' libclang-rt-dev 2>/dev/null | grep -q 'install ok installed' || missing+=(libclang-rt-dev)
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
    # A failed suite prints each failing test's output again at the very end (ctest's log in DIR), so a log
    # read from its tail says why, not only which.
    suite() {  # dir [ctest args...]
      local dir=$1
      shift
      (cd "$dir" && ctest --output-on-failure -j "$jobs" "$@") && return 0
      awk '/^[0-9]+\/[0-9]+ Testing: / { name = $3; n = 0; next }
           /^Output:$/ { on = 1; next }
           /^<end of output>$/ { on = 0; next }
           on { out[n++] = $0 }
           /^Test (Failed|Not Run)/ {
             printf "\n===== %s failed; the last lines of its output:\n", name
             for (i = (n > 60 ? n - 60 : 0); i < n; i++) print out[i]
           }' "$dir/Testing/Temporary/LastTest.log" >&2
      return 1
    }
    say "running the test suite (tests labelled gpu are skipped without a GPU)"
    suite "$build" "$@"
    [[ ${KVD_SANITIZERS:-ON} == OFF ]] && exit 0

    # Sanitizers and fuzzing (docs/reliability.md): host only, clang. The whole suite under ASan+UBSan
    # with LeakSanitizer on, in a build that also holds the libFuzzer targets; each target fuzzes for
    # KVD_FUZZ_SECONDS from its committed seeds; then the concurrency tests under TSan.
    sanitizer_build() {  # dir sanitizers [extra cmake args...] -- targets...
      local dir=$1 sanitize=$2
      shift 2
      local extra=() targets=()
      while (($#)) && [[ $1 != -- ]]; do extra+=("$1"); shift; done
      (($#)) && shift
      targets=("$@")
      mkdir -p "$dir"
      cmake -S "$root" -B "$dir" -G Ninja -DCMAKE_C_COMPILER=clang -DCMAKE_CXX_COMPILER=clang++ \
        -DKVD_ENABLE_CUDA=OFF -DKVD_ENABLE_HIP=OFF -DKVD_SANITIZE="$sanitize" "${extra[@]}" \
        >"$dir/configure.log" 2>&1 || { cat "$dir/configure.log"; exit 1; }
      cmake --build "$dir" -j "$jobs" ${targets[@]+--target "${targets[@]}"} >"$dir/build.log" 2>&1 ||
        { grep -E 'error|warning' "$dir/build.log" | head -50; say "the $sanitize build failed (log: $dir/build.log)"; exit 1; }
    }
    export ASAN_OPTIONS=detect_leaks=1:strict_string_checks=1:detect_stack_use_after_return=1
    export UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1
    export TSAN_OPTIONS=halt_on_error=1:second_deadlock_stack=1

    asan_build=${KVD_ASAN_BUILD_DIR:-$build-asan}
    step=$SECONDS
    say "ASan+UBSan (LeakSanitizer on) and fuzz build in $asan_build"
    sanitizer_build "$asan_build" address,undefined -DKVD_FUZZ=ON
    say "ASan+UBSan build took $((SECONDS - step)) s; running the suite under it"
    step=$SECONDS
    # deploy_validate and kvd_install_test check files and packaging, not the C++ code: the first run covers them.
    suite "$asan_build" -E '^(deploy_validate|kvd_install_test)$' "$@"
    say "the suite under ASan+UBSan took $((SECONDS - step)) s"

    step=$SECONDS
    for fuzzer in layout_fuzzer rpc_request_fuzzer handle_channel_fuzzer; do
      found=$asan_build/fuzz-findings/$fuzzer
      mkdir -p "$found"
      say "fuzzing $fuzzer for ${KVD_FUZZ_SECONDS:-20} s (new inputs in $found, a crash's input in $asan_build)"
      (cd "$asan_build" && "$asan_build/tests/fuzz/$fuzzer" -max_total_time="${KVD_FUZZ_SECONDS:-20}" \
        -timeout=30 -rss_limit_mb=4096 -print_final_stats=1 "$found" "$root/tests/fuzz/corpus/$fuzzer" \
        >"$found.log" 2>&1) || { tail -60 "$found.log"; say "$fuzzer found a crash (log: $found.log)"; exit 1; }
      say "$fuzzer: $(grep -m1 -o 'stat::number_of_executed_units: *[0-9]*' "$found.log" | grep -o '[0-9]*$') executions, no finding"
    done
    say "fuzzing took $((SECONDS - step)) s"

    tsan_build=${KVD_TSAN_BUILD_DIR:-$build-tsan}
    step=$SECONDS
    # The tests whose programs run many threads against one daemon or manager (run directly: the TSan
    # build holds only these programs and kvd).
    tsan_tests=(daemon/core/pool_manager_test daemon/core/rooms_test handle_channel_test kvd_daemon_test)
    say "TSan build of the concurrency tests (${tsan_tests[*]##*/}) in $tsan_build"
    sanitizer_build "$tsan_build" thread -- "${tsan_tests[@]##*/}" kvd
    for t in "${tsan_tests[@]}"; do
      "$tsan_build/tests/$t" --gtest_brief=1 >"$tsan_build/${t##*/}.log" 2>&1 ||
        { tail -80 "$tsan_build/${t##*/}.log"; say "${t##*/} failed under TSan (log: $tsan_build/${t##*/}.log)"; exit 1; }
      say "${t##*/} under TSan: $(grep -o 'PASSED  \] [0-9]* tests\?' "$tsan_build/${t##*/}.log" | grep -o '[0-9]*'
        ) tests passed, no race"
    done
    say "TSan build and tests took $((SECONDS - step)) s; everything took $((SECONDS - started)) s"
    ;;
esac
