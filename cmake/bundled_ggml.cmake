# ggml built here, patched, for a package that must carry the batch-invariance patch on its
# own (CMakeLists.txt includes this when no ggml of this patch set is installed): the same
# llama-cpp-python sdist scripts/setup.sh builds from, its ggml patched with
# dflash_gguf/data/ggml-patches (every hunk exactly: patch --fuzz=0), compiled with the
# set-up's options and installed beside libdflash as dflash_gguf/ggml/libdflash-ggml*.so.
# The renamed libraries keep a llama-cpp-python ggml loaded in the same process (its
# tokenizer) apart from this one.
#
# DFLASH_LLAMA_CPP_SDIST names the sdist's .tar.gz (offline builds); otherwise pip fetches it
# from the package index. Backends follow ggml's own options: CMAKE_ARGS="-DGGML_VULKAN=ON"
# pip install . gives a Vulkan build, as for llama-cpp-python.
set(DFLASH_LLAMA_CPP_PYTHON_VERSION 0.3.36)  # scripts/setup.sh's llama_cpp_python_version

set(sdist_dir "${CMAKE_BINARY_DIR}/llama-cpp-python-sdist")
set(src "${CMAKE_BINARY_DIR}/llama_cpp_python-${DFLASH_LLAMA_CPP_PYTHON_VERSION}-${DFLASH_GGML_PATCH_KEY}")
if(NOT EXISTS "${src}/vendor/llama.cpp/ggml/src/dflash-patch-key.h")
  if(DEFINED ENV{DFLASH_LLAMA_CPP_SDIST})
    set(sdist "$ENV{DFLASH_LLAMA_CPP_SDIST}")
  else()
    set(sdist "${sdist_dir}/llama_cpp_python-${DFLASH_LLAMA_CPP_PYTHON_VERSION}.tar.gz")
    if(NOT EXISTS "${sdist}")
      message(STATUS "dflash: fetching the llama-cpp-python ${DFLASH_LLAMA_CPP_PYTHON_VERSION} sdist (ggml's sources)")
      execute_process(
        COMMAND "${Python3_EXECUTABLE}" -m pip download -q --disable-pip-version-check --no-deps
                --no-binary llama-cpp-python --dest "${sdist_dir}" "llama-cpp-python==${DFLASH_LLAMA_CPP_PYTHON_VERSION}"
        RESULT_VARIABLE rc)
      if(NOT rc EQUAL 0 OR NOT EXISTS "${sdist}")
        message(FATAL_ERROR "dflash: could not fetch the llama-cpp-python ${DFLASH_LLAMA_CPP_PYTHON_VERSION} sdist "
                "with pip (ggml's sources, to build it with the batch-invariance patch); download it and "
                "name it in DFLASH_LLAMA_CPP_SDIST, or run scripts/setup.sh")
      endif()
    endif()
  endif()
  find_program(PATCH_EXE patch)
  if(NOT PATCH_EXE)
    message(FATAL_ERROR "dflash: building ggml with the batch-invariance patch needs the `patch` program")
  endif()
  set(unpacked "${CMAKE_BINARY_DIR}/llama-cpp-python-unpack")
  file(REMOVE_RECURSE "${unpacked}" "${src}")
  file(ARCHIVE_EXTRACT INPUT "${sdist}" DESTINATION "${unpacked}")
  set(tree "${unpacked}/llama_cpp_python-${DFLASH_LLAMA_CPP_PYTHON_VERSION}")
  foreach(p IN LISTS DFLASH_GGML_PATCHES)
    execute_process(COMMAND "${PATCH_EXE}" -s -p1 --fuzz=0 --no-backup-if-mismatch -d "${tree}" -i "${p}"
                    RESULT_VARIABLE rc)
    if(NOT rc EQUAL 0)
      get_filename_component(name "${p}" NAME)
      message(FATAL_ERROR "dflash: ${name} does not apply to llama-cpp-python ${DFLASH_LLAMA_CPP_PYTHON_VERSION}'s sources")
    endif()
  endforeach()
  file(WRITE "${tree}/vendor/llama.cpp/ggml/src/dflash-patch-key.h"
       "#define DFLASH_GGML_PATCH_KEY \"${DFLASH_GGML_PATCH_KEY}\"\n")
  file(RENAME "${tree}" "${src}")  # whole or not at all
  file(REMOVE_RECURSE "${unpacked}")
endif()

# scripts/setup.sh's options: shared libraries, the RPC backend, no AMX (ggml's AMX kernels
# are not patched, and crash on small matrices on some CPUs)
set(BUILD_SHARED_LIBS ON)
set(GGML_BACKEND_DL OFF CACHE BOOL "" FORCE)
set(GGML_RPC ON CACHE BOOL "")
set(GGML_BUILD_TESTS OFF CACHE BOOL "")
set(GGML_BUILD_EXAMPLES OFF CACHE BOOL "")
include(CheckCCompilerFlag)
check_c_compiler_flag(-mno-amx-tile DFLASH_HAS_NO_AMX)
if(DFLASH_HAS_NO_AMX)
  add_compile_options(-mno-amx-tile -mno-amx-int8 -mno-amx-bf16)
endif()
add_subdirectory("${src}/vendor/llama.cpp/ggml" "${CMAKE_BINARY_DIR}/ggml" EXCLUDE_FROM_ALL)
if(NOT TARGET ggml::ggml-base)
  add_library(ggml::ggml-base ALIAS ggml-base)
endif()

set(DFLASH_BUNDLED_GGML_TARGETS "")
foreach(t ggml ggml-base ggml-cpu ggml-rpc ggml-vulkan ggml-cuda ggml-metal ggml-blas)
  if(TARGET ${t})
    # one file a library (a wheel holds no symbolic links), found beside each other
    set_property(TARGET ${t} PROPERTY VERSION)
    set_property(TARGET ${t} PROPERTY SOVERSION)
    set_target_properties(${t} PROPERTIES OUTPUT_NAME "dflash-${t}" INSTALL_RPATH "$ORIGIN"
                                          BUILD_WITH_INSTALL_RPATH TRUE)
    list(APPEND DFLASH_BUNDLED_GGML_TARGETS ${t})
  endif()
endforeach()
message(STATUS "dflash: ggml built here with patch set ${DFLASH_GGML_PATCH_KEY} (${DFLASH_BUNDLED_GGML_TARGETS})")
