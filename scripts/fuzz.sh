#!/usr/bin/env bash
# Fuzzes the checkpoint loader and the API's argument handling with libFuzzer
# (clang, ASan + UBSan), starting from the committed seed corpus. Not part of
# scripts/test.sh (the committed corpus is replayed there instead).
# Usage: scripts/fuzz.sh [SECONDS_PER_TARGET] [TARGET...]
#   default: 120 seconds, targets fuzz_checkpoint fuzz_api fuzz_equal.
# New interesting inputs go to build/fuzz/corpus/<target> (merge them into
# fuzz/corpus/<target> with -merge=1 if they add coverage); crashes to
# build/fuzz/crash-*. The last line per target is libFuzzer's
# "Done N runs in T second(s)".
set -euo pipefail
cd "$(dirname "$0")/.."
SECS=${1:-120}
shift || true
TARGETS=${*:-fuzz_checkpoint fuzz_api fuzz_equal}

# clang with libFuzzer (Debian: clang + libclang-rt-14-dev); only this script
# needs them.
need=""
command -v clang >/dev/null || need="$need clang"
dpkg -s libclang-rt-14-dev >/dev/null 2>&1 || need="$need libclang-rt-14-dev"
if [ -n "$need" ]; then
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq $need >/dev/null
fi
bash scripts/setup_env.sh >/dev/null

OUT=build/fuzz
mkdir -p "$OUT"
# FUZZING_BUILD_MODE_UNSAFE_FOR_PRODUCTION: the loader skips its CRC check so
# mutations reach the validation behind it (src/checkpoint.c).
FLAGS="-std=c11 -g -O1 -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=all
  -fno-omit-frame-pointer -ffp-contract=off -DFUZZING_BUILD_MODE_UNSAFE_FOR_PRODUCTION
  -Iinclude -Isrc $(pkg-config --cflags libcjson)"
LIBS="$(pkg-config --libs libcjson) -lz -lm"
# Each SIMD file with its own ISA flags, as CMakeLists.txt builds them
# (without them they compile to stubs and the fuzzer would run the portable
# kernels only; until the thirty-third session it did).
isa_flags() {
  case "$(uname -m):$1" in
    x86_64:src/kernels_avx2.c|x86_64:src/kernels_avx2_mats.c|x86_64:src/kernels_avx2_narrow.c)
      echo "-mavx2 -mf16c -mpopcnt" ;;
    x86_64:src/philox_avx512.c) echo "-mavx512f" ;;
    x86_64:src/kernels_avx512.c|x86_64:src/kernels_avx512_mats.c) echo "-mavx512f -mavx512bw" ;;
  esac
}

# The library once for every target, and again only where its source or a
# header is newer than the object (the AVX-512 files take 15-20 minutes
# under the sanitizers; after a change of FLAGS, remove build/fuzz/obj).
# src/cuda/workspace.c is the host part of the CUDA plan that fuzz_equal
# emulates.
mkdir -p "$OUT/obj"
objs=""
for src in src/*.c src/cuda/workspace.c; do
  obj="$OUT/obj/$(basename "$src" .c).o"
  if [ ! -e "$obj" ] || [ -n "$(find "$src" include/*.h src/*.h src/cuda/*.h src/cuda/*.cuh -newer "$obj" 2>/dev/null | head -1)" ]; then
    # shellcheck disable=SC2086
    clang $FLAGS $(isa_flags "$src") -c -o "$obj.tmp" "$src"
    mv "$obj.tmp" "$obj"
  fi
  objs="$objs $obj"
done

for t in $TARGETS; do
  echo "== fuzz: $t for ${SECS}s"
  # shellcheck disable=SC2086
  clang $FLAGS -o "$OUT/$t" "fuzz/$t.c" $objs $LIBS
  mkdir -p "$OUT/corpus/$t"
  # One process (-jobs not used): the machine is shared. RSS limit well above
  # what the bounded targets need.
  ASAN_OPTIONS=allocator_may_return_null=1:detect_leaks=1 \
    "$OUT/$t" -max_total_time="$SECS" -rss_limit_mb=2048 -max_len=8192 \
    -print_final_stats=1 -artifact_prefix="$OUT/" \
    "$OUT/corpus/$t" "fuzz/corpus/$t" 2>&1 | tee "$OUT/$t.log" | grep -E "^Done|ERROR|SUMMARY|stat::number_of_executed_units" || true
  if grep -q "ERROR: libFuzzer\|ERROR: AddressSanitizer\|runtime error" "$OUT/$t.log"; then
    echo "fuzz: $t found a problem, see $OUT/$t.log"
    exit 1
  fi
done
