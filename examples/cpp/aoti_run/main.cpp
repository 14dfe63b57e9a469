// Runs an AOTInductor package of a model that uses fastmha ops, from C++ only, and compares its output with
// the one Python computed.
//   usage: aoti_run MODEL.pt2 DATA.pt   (DATA.pt: a scripted module with buffers x, mask, expected)
#include <torch/csrc/inductor/aoti_package/model_package_loader.h>
#include <torch/script.h>

#include <iostream>

int main(int argc, char** argv) {
  if (argc != 3) {
    std::cerr << "usage: " << argv[0] << " MODEL.pt2 DATA.pt\n";
    return 2;
  }
  try {
    torch::inductor::AOTIModelPackageLoader loader(argv[1]);
    torch::jit::Module data = torch::jit::load(argv[2]);
    torch::NoGradGuard no_grad;
    std::vector<at::Tensor> inputs = {data.attr("x").toTensor(), data.attr("mask").toTensor()};
    const auto outputs = loader.run(inputs);
    const double max_diff = (outputs.at(0) - data.attr("expected").toTensor()).abs().max().item<double>();
    std::cout << "AOTInductor output " << outputs.at(0).sizes() << ", max |C++ - Python| = " << max_diff << "\n";
    return max_diff < 1e-4 ? 0 : 1;
  } catch (const std::exception& error) {
    std::cerr << "aoti_run: " << error.what() << "\n";
    return 1;
  }
}
