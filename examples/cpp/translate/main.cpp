// Greedy translation in C++ with a TorchScript model saved from Python (examples/python/demo.py): the model's
// exported `translate(src, max_len)` method runs the encoder once and the decoder step by step, all through
// fastmha's ops.
//   usage: translate MODEL.pt MAX_LEN DIGITS...     e.g. translate translator.pt 11 31415 2718281
#include <torch/script.h>

#include <iostream>
#include <string>
#include <vector>

namespace {

constexpr int64_t kPad = 0, kEos = 2, kFirstDigit = 3;  // the Python model's vocabulary

std::string to_digits(const at::Tensor& row) {
  std::string out;
  for (int64_t i = 0; i < row.size(0); ++i) {
    const int64_t token = row[i].item<int64_t>();
    if (token == kEos || token == kPad) break;
    out += token >= kFirstDigit ? static_cast<char>('0' + token - kFirstDigit) : '?';
  }
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 4) {
    std::cerr << "usage: " << argv[0] << " MODEL.pt MAX_LEN DIGITS...\n";
    return 2;
  }
  try {
    torch::jit::Module model = torch::jit::load(argv[1]);
    model.eval();
    const int64_t max_len = std::stoll(argv[2]);
    std::vector<std::string> inputs(argv + 3, argv + argc);
    size_t longest = 0;
    for (const auto& text : inputs) longest = std::max(longest, text.size());
    auto src = torch::full({static_cast<int64_t>(inputs.size()), static_cast<int64_t>(longest)}, kPad, torch::kLong);
    for (size_t i = 0; i < inputs.size(); ++i) {
      for (size_t j = 0; j < inputs[i].size(); ++j) {
        const char c = inputs[i][j];
        if (c < '0' || c > '9') throw std::invalid_argument("input '" + inputs[i] + "' is not a digit string");
        src[i][j] = kFirstDigit + (c - '0');
      }
    }
    torch::NoGradGuard no_grad;
    const auto out = model.run_method("translate", src, max_len).toTensor();
    for (size_t i = 0; i < inputs.size(); ++i) {
      std::cout << inputs[i] << " -> " << to_digits(out[i]) << "\n";
    }
    return 0;
  } catch (const std::exception& error) {
    std::cerr << "translate: " << error.what() << "\n";
    return 1;
  }
}
