// Loads a TorchScript model built with fastmha.MultiHeadAttentionBlock in Python, runs it on the inputs
// saved beside it, and compares with the output Python computed.
//   usage: run_scripted MODEL.pt DATA.pt   (DATA.pt: a scripted module with buffers x, mask, expected)
#include <torch/script.h>

#include <iostream>

int main(int argc, char** argv) {
  if (argc != 3) {
    std::cerr << "usage: " << argv[0] << " MODEL.pt DATA.pt\n";
    return 2;
  }
  try {
    torch::jit::Module model = torch::jit::load(argv[1]);
    torch::jit::Module data = torch::jit::load(argv[2]);
    model.eval();
    torch::NoGradGuard no_grad;
    const auto x = data.attr("x").toTensor();
    const auto mask = data.attr("mask").toTensor();
    const auto expected = data.attr("expected").toTensor();
    const auto output = model.forward({x, mask}).toTensor();
    const double max_diff = (output - expected).abs().max().item<double>();
    std::cout << "C++ output " << output.sizes() << ", max |C++ - Python| = " << max_diff << "\n";
    return max_diff < 1e-4 ? 0 : 1;
  } catch (const std::exception& error) {
    std::cerr << "run_scripted: " << error.what() << "\n";
    return 1;
  }
}
