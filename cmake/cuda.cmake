# libautomagic_cuda: the whole CPU library plus the CUDA kernels
# (src/cuda/*.cu), in its own shared library so that libautomagic never
# depends on CUDA. The CUDA runtime is linked statically: the library needs
# only the driver (libcuda.so.1) at run time, and loads on machines without
# one (am_cuda_device_count then reports 0 devices).
#
# AM_CUDA defaults to ON when a CUDA compiler is found. Architectures:
# sm_75 (T4, RTX 20xx), sm_80 (A100) and sm_90 (H100/H200) machine code plus
# compute_90 PTX that newer GPUs JIT-compile; override with
# -DCMAKE_CUDA_ARCHITECTURES=... (sm_75 is the oldest CUDA 13's nvcc builds
# for; the kernels' __match_any_sync needs sm_70).
include(CheckLanguage)
# check_language caches a CUDA compiler it did not find: nvcc installed
# after the first configure was never seen, and AM_CUDA kept the OFF it was
# given then (found by a review, thirty-third session). A NOTFOUND is looked
# for again at every configure, and AM_CUDA follows the finding unless it
# was set to something else than the last automatic choice (-DAM_CUDA=...).
if(DEFINED CACHE{CMAKE_CUDA_COMPILER} AND NOT CMAKE_CUDA_COMPILER)
  unset(CMAKE_CUDA_COMPILER CACHE)
endif()
check_language(CUDA)
if(CMAKE_CUDA_COMPILER)
  set(AM_CUDA_DEFAULT ON)
else()
  set(AM_CUDA_DEFAULT OFF)
endif()
if(DEFINED CACHE{AM_CUDA} AND DEFINED CACHE{AM_CUDA_AUTO_CHOICE}
   AND "${AM_CUDA}" STREQUAL "${AM_CUDA_AUTO_CHOICE}")
  set(AM_CUDA ${AM_CUDA_DEFAULT} CACHE BOOL "Build libautomagic_cuda (needs nvcc)" FORCE)
endif()
option(AM_CUDA "Build libautomagic_cuda (needs nvcc)" ${AM_CUDA_DEFAULT})
set(AM_CUDA_AUTO_CHOICE ${AM_CUDA_DEFAULT} CACHE INTERNAL "AM_CUDA's last automatic value")
if(NOT AM_CUDA)
  if(CMAKE_CUDA_COMPILER)
    message(STATUS "automagic: CUDA OFF (AM_CUDA=OFF; nvcc found at ${CMAKE_CUDA_COMPILER})")
  else()
    message(STATUS "automagic: CUDA OFF (no CUDA compiler found: libautomagic_cuda not built)")
  endif()
endif()

if(AM_CUDA)
  if(NOT CMAKE_CUDA_ARCHITECTURES)
    set(CMAKE_CUDA_ARCHITECTURES "75-real;80-real;90")
  endif()
  enable_language(CUDA)
  set(CMAKE_CUDA_STANDARD 17)
  set(CMAKE_CUDA_STANDARD_REQUIRED ON)
  message(STATUS "automagic: CUDA ON (${CMAKE_CUDA_COMPILER_VERSION}, "
                 "architectures ${CMAKE_CUDA_ARCHITECTURES})")

  add_library(automagic_cuda SHARED $<TARGET_OBJECTS:automagic_obj>
    src/cuda/update_cuda.cu)
  target_include_directories(automagic_cuda
    PUBLIC $<BUILD_INTERFACE:${CMAKE_CURRENT_SOURCE_DIR}/include>
           $<INSTALL_INTERFACE:${CMAKE_INSTALL_INCLUDEDIR}>
    PRIVATE ${CMAKE_CURRENT_SOURCE_DIR}/src ${CMAKE_CURRENT_SOURCE_DIR}/src/cuda)
  # Rounding identical to the CPU: no FMA contraction, IEEE division and
  # square root, no flush-to-zero (am_math.h). The host side of the .cu
  # gets the C flags' no-contraction too.
  set(AM_CUDA_FLAGS --fmad=false -prec-div=true -prec-sqrt=true -ftz=false
      -Xcompiler=-ffp-contract=off,-fno-fast-math,-Wall,-Wextra
      --Werror=all-warnings)
  if(NOT AM_WERROR)
    list(REMOVE_ITEM AM_CUDA_FLAGS --Werror=all-warnings)
  endif()
  target_compile_options(automagic_cuda PRIVATE
    $<$<COMPILE_LANGUAGE:CUDA>:${AM_CUDA_FLAGS}>)
  set_target_properties(automagic_cuda PROPERTIES
    CUDA_RUNTIME_LIBRARY Static
    CUDA_VISIBILITY_PRESET hidden
    C_VISIBILITY_PRESET hidden
    VERSION ${PROJECT_VERSION} SOVERSION ${PROJECT_VERSION_MAJOR}.${PROJECT_VERSION_MINOR})
  # The checkpoint code of the CPU objects needs cJSON and zlib.
  target_link_libraries(automagic_cuda PRIVATE PkgConfig::AM_CJSON ZLIB::ZLIB)
  if(AM_LIBM)
    target_link_libraries(automagic_cuda PUBLIC $<BUILD_INTERFACE:${AM_LIBM}>
                          $<INSTALL_INTERFACE:m>)
  endif()
  if(AM_HAVE_NODELETE)  # its pool as the CPU library's (CMakeLists.txt)
    target_link_options(automagic_cuda PRIVATE "-Wl,-z,nodelete")
  endif()
  add_library(automagic::automagic_cuda ALIAS automagic_cuda)
endif()

# The GPU benchmark (scripts/gpu_check.sh runs it); not a test.
if(AM_CUDA AND AM_BUILD_TESTS)
  find_package(CUDAToolkit REQUIRED)
  add_executable(bench_cuda bench/bench_cuda.c)
  target_link_libraries(bench_cuda PRIVATE automagic_cuda CUDA::cudart_static)
  target_compile_options(bench_cuda PRIVATE ${AM_C_FLAGS})
endif()
