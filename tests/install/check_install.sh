#!/usr/bin/env bash
# Installs libautomagic into a temporary prefix and builds examples/quickstart.c
# against it twice: through pkg-config and through find_package(automagic).
# Both programs must run and print the same final line. A C++ program
# including the header must build with warnings as errors and run.
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
# A C++ consumer (C++ trainers are users too): the installed header
# compiles as C++11 with every warning an error, and the call links and runs.
cat > "$tmp/cxx.cpp" <<'CXX'
#include <automagic.h>
#include <cstdio>
int main() {
    am_shape shape{};
    shape.ndim = 2;
    shape.dims[0] = 4;
    shape.dims[1] = 6;
    am_state_sizes sizes{};
    am_status st = am_state_get_sizes(&shape, &sizes);
    std::printf("%s\n", am_status_string(st));
    return st == AM_OK ? 0 : 1;
}
CXX
# shellcheck disable=SC2046
c++ -std=c++11 -Wall -Wextra -pedantic -Werror "$tmp/cxx.cpp" \
  $(pkg-config --cflags --libs automagic) -Wl,-rpath,"$tmp/prefix/lib" -o "$tmp/cxx"
"$tmp/cxx" >/dev/null || { echo "install: the C++ consumer failed"; exit 1; }
mkdir -p "$tmp/consumer"
cat > "$tmp/consumer/CMakeLists.txt" <<CM
cmake_minimum_required(VERSION 3.18)
project(consumer C)
find_package(automagic 0.3 REQUIRED)
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
# A shared-only consumer where libcjson's development files are missing
# (pkg-config's search path holds only this prefix): pkg-config and the
# CMake target automagic::automagic must work, and only COMPONENTS static
# must report automagic as not found (both were refused before).
# shellcheck disable=SC2046
PKG_CONFIG_LIBDIR="$tmp/prefix/lib/pkgconfig" PKG_CONFIG_PATH= \
  cc "$root/examples/quickstart.c" $(PKG_CONFIG_LIBDIR="$tmp/prefix/lib/pkgconfig" \
  PKG_CONFIG_PATH= pkg-config --cflags --libs automagic) \
  -Wl,-rpath,"$tmp/prefix/lib" -o "$tmp/qs_shared_pc"
mkdir -p "$tmp/consumer2" "$tmp/consumer3"
cat > "$tmp/consumer2/CMakeLists.txt" <<CM
cmake_minimum_required(VERSION 3.18)
project(consumer2 C)
find_package(automagic 0.3 REQUIRED)
add_executable(qs_shared "$root/examples/quickstart.c")
target_link_libraries(qs_shared PRIVATE automagic::automagic)
CM
cat > "$tmp/consumer3/CMakeLists.txt" <<CM
cmake_minimum_required(VERSION 3.18)
project(consumer3 C)
find_package(automagic 0.3 COMPONENTS static)
if(automagic_FOUND)
  message(FATAL_ERROR "automagic found with its static component, libcjson hidden")
endif()
CM
PKG_CONFIG_LIBDIR="$tmp/prefix/lib/pkgconfig" PKG_CONFIG_PATH= \
  cmake -S "$tmp/consumer2" -B "$tmp/consumer2/b" -DCMAKE_PREFIX_PATH="$tmp/prefix" >/dev/null
cmake --build "$tmp/consumer2/b" >/dev/null
PKG_CONFIG_LIBDIR="$tmp/prefix/lib/pkgconfig" PKG_CONFIG_PATH= \
  cmake -S "$tmp/consumer3" -B "$tmp/consumer3/b" -DCMAKE_PREFIX_PATH="$tmp/prefix" \
  >/dev/null 2>"$tmp/consumer3.err" ||
  { cat "$tmp/consumer3.err"; echo "install: COMPONENTS static configure failed"; exit 1; }
grep -q "needs libcjson's pkg-config file" "$tmp/consumer3.err" ||
  { cat "$tmp/consumer3.err"; echo "install: no reason given for the missing static component"; exit 1; }
c=$("$tmp/qs_shared_pc" | tail -n 1)
d=$("$tmp/consumer2/b/qs_shared" | tail -n 1)
[ "$a" = "$c" ] && [ "$a" = "$d" ] ||
  { echo "install: shared-only consumers differ: '$a', '$c', '$d'"; exit 1; }
# A cJSON in a prefix of its own (not in the linker's default path): the
# .pc file's Libs.private must carry its -L, or `pkg-config --static`
# users could not link (configured only: the .pc is written at configure
# time; linking could not tell, the system's cJSON being found anyway).
cjdir=$(pkg-config --variable=libdir libcjson)
mkdir -p "$tmp/cjson/lib/pkgconfig"
ln -s "$cjdir"/libcjson.so* "$tmp/cjson/lib/"
cat > "$tmp/cjson/lib/pkgconfig/libcjson.pc" <<PC
libdir=$tmp/cjson/lib
Name: libcjson
Description: cJSON in a prefix of its own (check_install.sh)
Version: $(pkg-config --modversion libcjson)
Libs: -L\${libdir} -lcjson
Cflags: $(pkg-config --cflags libcjson)
PC
PKG_CONFIG_PATH="$tmp/cjson/lib/pkgconfig" cmake -S "$root" -B "$tmp/build_cj" \
  -DAM_BUILD_TESTS=OFF -DAM_BUILD_EXAMPLES=OFF -DAM_BUILD_DEMO=OFF -DAM_CUDA=OFF >/dev/null
# (-ldl where CMake's CMAKE_DL_LIBS names it: src/pin_self.c's dlopen)
grep -qxE "Libs.private: -L$tmp/cjson/lib -lcjson -lz -lm -pthread( -ldl)?" "$tmp/build_cj/automagic.pc" ||
  { grep Libs "$tmp/build_cj/automagic.pc"; echo "install: cJSON's -L missing from Libs.private"; exit 1; }
grep -qxE "Libs.private: -lcjson -lz -lm -pthread( -ldl)?" "$tmp/prefix/lib/pkgconfig/automagic.pc" ||
  { grep Libs "$tmp/prefix/lib/pkgconfig/automagic.pc"; echo "install: Libs.private changed"; exit 1; }
echo "install: pkg-config and CMake consumers built and ran: $a"
echo "install: a C++11 consumer of the header built (-Wall -Wextra -pedantic -Werror) and ran"
echo "install: shared-only consumers without libcjson's pkg-config file built and ran"
echo "install: a cJSON in its own prefix is named in automagic.pc's Libs.private"
