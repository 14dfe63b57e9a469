// A TorchScript module defined in C++ whose forward calls fastmha.attention (no Python involved).
#pragma once

#include <torch/csrc/jit/frontend/resolver.h>
#include <torch/csrc/jit/frontend/sugared_value.h>
#include <torch/script.h>

// C++'s TorchScript compiler knows only aten ops by default: resolve the name `fastmha` to our op namespace.
struct FastmhaResolver : torch::jit::Resolver {
  std::shared_ptr<torch::jit::SugaredValue> resolveValue(const std::string& name, torch::jit::GraphFunction& fn,
                                                         const torch::jit::SourceRange& loc) override {
    if (name == "fastmha") {
      return std::make_shared<torch::jit::BuiltinModule>("fastmha");
    }
    return torch::jit::nativeResolver()->resolveValue(name, fn, loc);
  }
  c10::TypePtr resolveType(const std::string& name, const torch::jit::SourceRange& loc) override {
    return torch::jit::nativeResolver()->resolveType(name, loc);
  }
};

inline torch::jit::Module attention_script_module() {
  torch::jit::Module module("Attention");
  module.define(R"JIT(
    def forward(self, q, k, v, mask: Optional[Tensor]):
        out, weights = fastmha.attention(q, k, v, mask, 0.0, True)
        return out
  )JIT",
                std::make_shared<FastmhaResolver>());
  return module;
}
