#!/usr/bin/env bash
# Installs libautomagic into a temporary prefix and builds examples/quickstart.c
# against it twice: through pkg-config and through find_package(automagic).
# Both programs must run and print the same final line.
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
cmake -S "$root" -B "$tmp/build" -DAM_BUILD_TESTS=OFF -DAM_BUILD_EXAMPLES=OFF \
  -DAM_BUILD_DEMO=OFF -DAM_CUDA=OFF >/dev/null
cmake --build "$tmp/build" -j"$(nproc)" >/dev/null
cmake --install "$tmp/build" --prefix "$tmp/prefix" >/dev/null
for f in include/automagic.h lib/libautomagic.a lib/libautomagic.so \
         lib/pkgconfig/automagic.pc lib/cmake/automagic/automagicConfig.cmake; do
  [ -e "$tmp/prefix/$f" ] || { echo "install: missing $f"; exit 1; }
done
# The exported package names its dependencies, not this machine's paths (it
# linked /usr/lib/x86_64-linux-gnu/libm.so, so the prefix could not move)
if grep -n '"/[^"]*\.so' "$tmp"/prefix/lib/cmake/automagic/*.cmake; then
  echo "install: the exported CMake package holds absolute library paths"; exit 1
fi
export PKG_CONFIG_PATH="$tmp/prefix/lib/pkgconfig"
# shellcheck disable=SC2046
cc "$root/examples/quickstart.c" $(pkg-config --cflags --libs automagic) \
  -Wl,-rpath,"$tmp/prefix/lib" -o "$tmp/qs_pkgconfig"
mkdir -p "$tmp/consumer"
cat > "$tmp/consumer/CMakeLists.txt" <<CM
cmake_minimum_required(VERSION 3.18)
project(consumer C)
find_package(automagic 0.2 REQUIRED)
add_executable(qs_cmake "$root/examples/quickstart.c")
target_link_libraries(qs_cmake PRIVATE automagic::automagic_static)
CM
cmake -S "$tmp/consumer" -B "$tmp/consumer/b" -DCMAKE_PREFIX_PATH="$tmp/prefix" >/dev/null
cmake --build "$tmp/consumer/b" >/dev/null
a=$("$tmp/qs_pkgconfig" | tail -n 1)
b=$("$tmp/consumer/b/qs_cmake" | tail -n 1)
[ "$a" = "$b" ] || { echo "install: the two consumers differ: '$a' vs '$b'"; exit 1; }
# The quickstart fits a linear layer: its last line is "step mse lr", and the
# fit must have converged (it reaches ~1e-7 in 600 steps).
mse=$(echo "$a" | awk '{print $2}')
awk -v m="$mse" 'BEGIN { exit !(m + 0 < 1e-3) }' ||
  { echo "install: the quickstart did not converge (final mse $mse)"; exit 1; }
echo "install: pkg-config and CMake consumers built and ran: $a"
