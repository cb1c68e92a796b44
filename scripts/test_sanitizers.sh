#!/usr/bin/env bash
# The C test suite under the dynamic checkers (called by scripts/test.sh):
#   1. AddressSanitizer + UndefinedBehaviorSanitizer (gcc): every CTest test,
#      any report fails the run (-fno-sanitize-recover, leak check on).
#   2. valgrind memcheck: every CTest test, any error or definite/indirect
#      leak fails the run.
#   3. ThreadSanitizer (gcc): the thread and batch tests (CTest names matching
#      "thread|batch"), any race report fails the run.
# Usage: scripts/test_sanitizers.sh [asan|valgrind|tsan]...   (default: all)
# Tests labelled "no_valgrind" are skipped under valgrind only (for tests
# too slow under a 20-50x slowdown); none of the reliability tests are.
set -euo pipefail
cd "$(dirname "$0")/.."
JOBS=${AM_JOBS:-2}
STEPS=${*:-asan valgrind tsan}
WERROR=${AM_WERROR:-ON}

configure() { # dir, extra cmake args...
  local dir=$1
  shift
  # AM_CUDA=OFF: the checkers cover the C code (the CUDA plan through
  # test_cuda_emul); nvcc output is compiled and tested by test.sh's build.
  cmake -S . -B "$dir" -DAM_BUILD_EXAMPLES=OFF -DAM_CUDA=OFF -DAM_WERROR="$WERROR" "$@" >/dev/null
  cmake --build "$dir" -j"$JOBS" >/dev/null
}

for step in $STEPS; do
  case $step in
  asan)
    echo "== sanitizers: AddressSanitizer + UndefinedBehaviorSanitizer"
    SAN="-fsanitize=address,undefined -fno-sanitize-recover=all -fno-omit-frame-pointer"
    # allocator_may_return_null: the bad-input matrix asks for an
    # unallocatable parameter and expects AM_ERR_OUT_OF_MEMORY, not a crash.
    configure build/asan -DCMAKE_BUILD_TYPE=Debug -DCMAKE_C_FLAGS="$SAN -O1" \
      -DCMAKE_EXE_LINKER_FLAGS="$SAN" -DCMAKE_SHARED_LINKER_FLAGS="$SAN" \
      -DAM_TEST_LAUNCHER=""
    ASAN_OPTIONS=detect_leaks=1:halt_on_error=1:allocator_may_return_null=1:strict_string_checks=1:detect_stack_use_after_return=1 \
    UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
      ctest --test-dir build/asan --output-on-failure -j"$JOBS"
    ;;
  valgrind)
    echo "== sanitizers: valgrind memcheck"
    command -v valgrind >/dev/null || { echo "valgrind is not installed (scripts/setup_env.sh)"; exit 1; }
    VG="valgrind;--error-exitcode=1;--leak-check=full;--errors-for-leak-kinds=definite,indirect"
    VG="$VG;--show-leak-kinds=definite,indirect;--quiet"
    # -O2 (CMakeLists.txt, AM_RELWITHDEBINFO_O3): valgrind cannot translate
    # some of the -O3 AVX2 code
    configure build/valgrind -DCMAKE_BUILD_TYPE=RelWithDebInfo -DAM_RELWITHDEBINFO_O3=OFF \
      -DAM_TEST_LAUNCHER="$VG"
    ctest --test-dir build/valgrind --output-on-failure -j"$JOBS" -LE no_valgrind
    ;;
  tsan)
    echo "== sanitizers: ThreadSanitizer"
    TS="-fsanitize=thread"
    configure build/tsan -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCMAKE_C_FLAGS="$TS" \
      -DCMAKE_EXE_LINKER_FLAGS="$TS" -DCMAKE_SHARED_LINKER_FLAGS="$TS" -DAM_TEST_LAUNCHER=""
    # Some kernels map memory where TSan cannot shadow it (high mmap ASLR
    # entropy); running without address randomisation avoids that.
    RUN=""
    if command -v setarch >/dev/null && setarch "$(uname -m)" -R true 2>/dev/null; then
      RUN="setarch $(uname -m) -R"
    fi
    TSAN_OPTIONS="halt_on_error=1:second_deadlock_stack=1:suppressions=$PWD/scripts/tsan.supp" \
      $RUN ctest --test-dir build/tsan --output-on-failure -j"$JOBS" -R 'thread|batch'
    ;;
  *)
    echo "unknown step $step (asan, valgrind, tsan)"
    exit 2
    ;;
  esac
done
