# Cross build for 64-bit ARM Linux with Debian's cross compiler
# (crossbuild-essential-arm64), the libraries of the arm64 architecture
# (dpkg --add-architecture arm64; libcmocka-dev:arm64, libcjson-dev:arm64,
# zlib1g-dev:arm64) and qemu-user to run the tests: CTest starts every test
# through AM_TEST_LAUNCHER (scripts/test_aarch64.sh sets it to the same
# command as CMAKE_CROSSCOMPILING_EMULATOR below).
set(CMAKE_SYSTEM_NAME Linux)
set(CMAKE_SYSTEM_PROCESSOR aarch64)
set(CMAKE_C_COMPILER aarch64-linux-gnu-gcc)
set(CMAKE_CROSSCOMPILING_EMULATOR qemu-aarch64;-L;/usr/aarch64-linux-gnu)
# Multiarch: arm64 libraries in /usr/lib/aarch64-linux-gnu, headers shared.
set(CMAKE_LIBRARY_ARCHITECTURE aarch64-linux-gnu)
set(ENV{PKG_CONFIG_LIBDIR} "/usr/lib/aarch64-linux-gnu/pkgconfig:/usr/share/pkgconfig")
set(ENV{PKG_CONFIG_PATH} "")
