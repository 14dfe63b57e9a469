# pip's torch finds its CUDA libraries (NCCL, cuDNN, ...) in site-packages/nvidia/*/lib through its own rpath.
# The linker does not expand that $ORIGIN rpath when it checks libtorch_cuda's dependencies and may pick an
# older copy from the CUDA toolkit instead ("undefined reference to ncclComm..."): point it at the same
# directories with -rpath-link (this only affects linking, not what loads at run time).
# property: INTERFACE_LINK_OPTIONS on the imported fastmha::fastmha, LINK_OPTIONS on an in-tree executable.
function(fastmha_add_torch_rpath_link target property)
  if(NOT TORCH_INSTALL_PREFIX)
    return()
  endif()
  file(GLOB _fastmha_nvidia_dirs LIST_DIRECTORIES true "${TORCH_INSTALL_PREFIX}/../nvidia/*/lib")
  foreach(_dir ${_fastmha_nvidia_dirs})
    get_filename_component(_dir "${_dir}" REALPATH)
    set_property(TARGET ${target} APPEND PROPERTY ${property} "LINKER:-rpath-link,${_dir}")
  endforeach()
endfunction()
