// Moving weights between Python and C++: a module's parameters and buffers as a name -> tensor dict in the
// format of Python's torch.save. Python reads the file with fastmha.load_cpp_state_dict (torch.load in its
// safe weights_only mode), and a state_dict written by Python's torch.save loads here.
//
//   fastmha::save_state_dict(*mha, "mha.pt");  // Python: block.load_state_dict(fastmha.load_cpp_state_dict("mha.pt"))
//   fastmha::load_state_dict(*mha, "py.pt");  // Python: torch.save(dict(block.state_dict()), "py.pt")
// (a plain dict: C++'s unpickler does not know the OrderedDict that state_dict() returns)
#pragma once

#include <torch/nn/module.h>

#include <string>

namespace fastmha {

void save_state_dict(const torch::nn::Module& module, const std::string& path);

// Strict, like Python's default: the file must hold exactly the module's names, each with the same shape.
void load_state_dict(torch::nn::Module& module, const std::string& path);

}  // namespace fastmha
