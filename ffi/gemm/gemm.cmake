# The GEMM targets (jaxquant_gemm_fp8, jaxquant_gemm_dequant): include this file from the top
# CMakeLists.txt and call jaxquant_add_gemm(<module target>) after the module target exists.
#
# * CPU handlers and the registration entry point (ffi/gemm/registrations.h) always.
# * CUDA handlers when the module is built with CUDA (JAXQUANT_WITH_CUDA): the cuBLASLt FP8
#   GEMM and the in-kernel-dequantize wgmma kernel (sm_90a; compiled with the module's -gencode
#   flags, the kernel body only exists for sm_90a). cuBLASLt comes from the pip nvidia-cublas
#   wheel (nvidia/cu13): the imported target jaxquant_cublasLt if the top file made one, else
#   found here; the versioned libcublasLt.so.13 is linked by full path, with an RPATH to its
#   folder. Without cuBLASLt the CUDA GEMM handlers are skipped (the Python side then reports
#   the missing target and takes the reference path).

function(jaxquant_add_gemm target)
  set(dir "${CMAKE_CURRENT_FUNCTION_LIST_DIR}")
  target_sources(${target} PRIVATE "${dir}/registrations.cc" "${dir}/gemm_cpu.cc")
  if(NOT JAXQUANT_WITH_CUDA)
    return()
  endif()

  set(cublaslt jaxquant_cublasLt)
  if(NOT TARGET ${cublaslt})
    execute_process(
      COMMAND "${Python_EXECUTABLE}" -c "import nvidia.cu13; print(nvidia.cu13.__path__[0])"
      OUTPUT_STRIP_TRAILING_WHITESPACE OUTPUT_VARIABLE cu13_root RESULT_VARIABLE cu13_result
      ERROR_QUIET)
    if(cu13_result EQUAL 0 AND EXISTS "${cu13_root}/lib/libcublasLt.so.13")
      add_library(jaxquant_gemm_cublasLt SHARED IMPORTED)
      set_target_properties(jaxquant_gemm_cublasLt PROPERTIES
        IMPORTED_LOCATION "${cu13_root}/lib/libcublasLt.so.13"
        INTERFACE_INCLUDE_DIRECTORIES "${cu13_root}/include")
      set(cublaslt jaxquant_gemm_cublasLt)
    else()
      message(WARNING "jaxquant GEMM: cuBLASLt (pip nvidia-cublas) not found; building the CPU "
                      "GEMM handlers only")
      return()
    endif()
  endif()

  get_target_property(cublaslt_location ${cublaslt} IMPORTED_LOCATION)
  get_filename_component(cublaslt_dir "${cublaslt_location}" DIRECTORY)
  target_sources(${target} PRIVATE
    "${dir}/gemm_cuda.cu"
    "${dir}/dequant_inst_e4m3.cu"
    "${dir}/dequant_inst_e5m2.cu"
    "${dir}/dequant_inst_e2m1.cu")
  target_compile_definitions(${target} PRIVATE JAXQUANT_GEMM_CUDA)
  target_link_libraries(${target} PRIVATE ${cublaslt})
  set_property(TARGET ${target} APPEND PROPERTY BUILD_RPATH "${cublaslt_dir}")
  set_property(TARGET ${target} APPEND PROPERTY INSTALL_RPATH "${cublaslt_dir}")
  message(STATUS "jaxquant GEMM: CUDA handlers with cuBLASLt ${cublaslt_location}")
endfunction()
