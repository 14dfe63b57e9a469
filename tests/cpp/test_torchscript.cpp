// TorchScript from C++: a model scripted and saved by Python runs here, and a script module defined in C++
// that calls torch.ops.fastmha round-trips through save/load.
#include <torch/script.h>
#include <torch/torch.h>

#include <catch2/catch.hpp>
#include <cstdlib>
#include <filesystem>

#include "oracle.h"
#include "script_module.h"

TEST_CASE("a TorchScript model saved from Python gives Python's outputs", "[.python-model]") {
  const char* dir = std::getenv("FASTMHA_TEST_MODEL_DIR");
  REQUIRE(dir != nullptr);
  const std::filesystem::path root(dir);
  auto model = torch::jit::load((root / "model.pt").string());
  auto data = torch::jit::load((root / "data.pt").string());
  model.eval();
  auto x = data.attr("x").toTensor();
  auto mask = data.attr("mask").toTensor();
  auto expected = data.attr("expected").toTensor();
  auto out = model.forward({x, mask}).toTensor();
  CHECK(torch::allclose(out, expected, 1e-5, 1e-6));
}

TEST_CASE("a script module calling fastmha ops round-trips through save and load", "[torchscript]") {
  auto module = attention_script_module();
  const auto path = std::filesystem::temp_directory_path() / "fastmha_cpp_script_module.pt";
  module.save(path.string());
  auto loaded = torch::jit::load(path.string());
  std::filesystem::remove(path);
  auto q = torch::randn({2, 2, 4, 8}, torch::kFloat64);
  auto kv = torch::randn({2, 2, 6, 8}, torch::kFloat64);
  auto mask = torch::rand({2, 1, 1, 6}) > 0.3;
  auto out = loaded.forward({q, kv, kv, mask}).toTensor();
  CHECK(oracle::close(out, oracle::attention(q, kv, kv, mask).first));
}
