// Whether the block's data-dependent shortcuts may read a tensor's values.
#pragma once

#include <ATen/ATen.h>

namespace fastmha {

// A dense CPU tensor with data. Elsewhere a read would synchronize a device, or there is no data to read (meta
// tensors, and the fake tensors of graph capture, which dispatch through Python).
inline bool readable_on_cpu(const at::Tensor& t) {
  return t.device().is_cpu() && t.layout() == at::kStrided && t.has_storage() &&
         !t.key_set().has(c10::DispatchKey::Python);
}

}  // namespace fastmha
