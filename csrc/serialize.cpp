#include <fastmha/serialize.h>

#include <ATen/core/Dict.h>
#include <c10/util/Exception.h>
#include <torch/serialize.h>

#include <algorithm>
#include <fstream>
#include <iterator>
#include <set>
#include <vector>

namespace fastmha {
namespace {

std::vector<std::pair<std::string, at::Tensor>> named_state(const torch::nn::Module& module) {
  std::vector<std::pair<std::string, at::Tensor>> state;
  for (const auto& item : module.named_parameters(/*recurse=*/true)) state.emplace_back(item.key(), item.value());
  for (const auto& item : module.named_buffers(/*recurse=*/true)) state.emplace_back(item.key(), item.value());
  return state;
}

}  // namespace

void save_state_dict(const torch::nn::Module& module, const std::string& path) {
  // An untyped dict: a typed one is pickled with a type-tag call that torch.load(weights_only=True) refuses.
  c10::impl::GenericDict dict(c10::AnyType::get(), c10::AnyType::get());
  for (const auto& [name, tensor] : named_state(module)) dict.insert(name, tensor.detach());
  const std::vector<char> bytes = torch::pickle_save(c10::IValue(dict));
  std::ofstream file(path, std::ios::binary);
  TORCH_CHECK(file, "fastmha: cannot write the state dict to '", path, "'");
  file.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  TORCH_CHECK(file, "fastmha: failed writing the state dict to '", path, "'");
}

void load_state_dict(torch::nn::Module& module, const std::string& path) {
  std::ifstream file(path, std::ios::binary);
  TORCH_CHECK(file, "fastmha: cannot read a state dict from '", path, "'");
  const std::vector<char> bytes((std::istreambuf_iterator<char>(file)), std::istreambuf_iterator<char>());
  c10::IValue value;
  try {
    value = torch::pickle_load(bytes);
  } catch (const c10::Error& error) {
    // C++'s unpickler knows plain dicts, not the OrderedDict a Python state_dict() is: it fails on one with an
    // internal assertion whose text says nothing useful, so that case is named alone (torch.save stores the pickle
    // uncompressed, where the class's name shows).
    const std::string ordered = "OrderedDict";
    const bool ordered_dict = std::search(bytes.begin(), bytes.end(), ordered.begin(), ordered.end()) != bytes.end();
    TORCH_CHECK(!ordered_dict, "fastmha: '", path, "' holds a Python OrderedDict (what state_dict() returns), ",
                "which C++ cannot read; from Python save a plain dict: torch.save(dict(block.state_dict()), path)");
    TORCH_CHECK(false, "fastmha: cannot read '", path, "' as a dict of tensors; from Python save a plain dict: ",
                "torch.save(dict(block.state_dict()), path). Unpickler said: ", error.what_without_backtrace());
  }
  TORCH_CHECK(value.isGenericDict(), "fastmha: '", path, "' does not hold a dict of tensors (a state_dict)");
  const auto dict = value.toGenericDict();
  auto state = named_state(module);
  std::set<std::string> expected;
  for (const auto& [name, tensor] : state) expected.insert(name);
  for (const auto& entry : dict) {
    const auto key = entry.key().toStringRef();
    TORCH_CHECK(expected.count(key), "fastmha: unexpected key '", key, "' in state dict '", path, "'");
  }
  torch::NoGradGuard no_grad;
  for (auto& [name, tensor] : state) {
    TORCH_CHECK(dict.contains(name), "fastmha: missing key '", name, "' in state dict '", path, "'");
    const at::Tensor source = dict.at(name).toTensor();
    TORCH_CHECK(source.sizes() == tensor.sizes(), "fastmha: '", name, "' has shape ", source.sizes(), " in '", path,
                "' but ", tensor.sizes(), " in the module");
    tensor.copy_(source);
  }
}

}  // namespace fastmha
