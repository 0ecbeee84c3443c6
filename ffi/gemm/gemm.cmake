# The GEMM targets (jaxquant_gemm_fp8, jaxquant_gemm_dequant): include this file from the top
# CMakeLists.txt and call jaxquant_add_gemm(<module target>) after the module target exists.
#
# * CPU handlers always (their table: ffi/gemm/handlers.h).
# * CUDA handlers when the module is built with CUDA (JAXQUANT_WITH_CUDA): the cuBLASLt FP8
#   GEMM and the in-kernel-dequantize wgmma kernel (sm_90a; compiled with the module's -gencode
#   flags, the kernel body only exists for sm_90a). cuBLASLt comes from the pip nvidia-cublas
#   wheel (nvidia/cu13): the imported target jaxquant_cublasLt the top file makes; the
#   versioned libcublasLt.so.13 is linked by full path, with an RPATH to its folder. With -DJAXQUANT_GEMM=OFF the CUDA GEMM handlers are skipped (the Python side then
#   reports the missing target and the build option, and takes another path); the top file
#   stops the configuration when cuBLASLt is missing otherwise.

function(jaxquant_add_gemm target)
  set(dir "${CMAKE_CURRENT_FUNCTION_LIST_DIR}")
  target_sources(${target} PRIVATE "${dir}/gemm_cpu.cc")
  if(NOT JAXQUANT_WITH_CUDA)
    return()
  endif()

  if(NOT JAXQUANT_GEMM)
    message(STATUS "jaxquant GEMM: JAXQUANT_GEMM=OFF; building the CPU GEMM handlers only")
    return()
  endif()
  set(cublaslt jaxquant_cublasLt)
  if(NOT TARGET ${cublaslt})
    message(FATAL_ERROR "jaxquant GEMM: the top CMakeLists.txt defines no jaxquant_cublasLt "
                        "target; include this file after the cuBLASLt discovery")
  endif()

  get_target_property(cublaslt_location ${cublaslt} IMPORTED_LOCATION)
  get_filename_component(cublaslt_dir "${cublaslt_location}" DIRECTORY)
  target_sources(${target} PRIVATE
    "${dir}/gemm_cublaslt.cu"
    "${dir}/dequant_gemm.cu"
    "${dir}/dequant_inst_e4m3.cu"
    "${dir}/dequant_inst_e5m2.cu"
    "${dir}/dequant_inst_e2m1.cu")
  target_compile_definitions(${target} PRIVATE JAXQUANT_GEMM_CUDA)
  target_link_libraries(${target} PRIVATE ${cublaslt})
  set_property(TARGET ${target} APPEND PROPERTY BUILD_RPATH "${cublaslt_dir}")
  set_property(TARGET ${target} APPEND PROPERTY INSTALL_RPATH "${cublaslt_dir}")
  message(STATUS "jaxquant GEMM: CUDA handlers with cuBLASLt ${cublaslt_location}")
endfunction()
