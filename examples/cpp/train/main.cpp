// Trains a tiny model in pure C++: a fastmha::MultiHeadAttention block and a linear head learn to output,
// at every position, the mean of the sequence's first vector and its own (attention must find position 0).
// Gradients flow through fastmha's C++ Autograd kernel. Writes OUT_DIR/attention.pt (the block's state
// dict) and OUT_DIR/probe.pt (an input and the block's output on it), which Python reads with
// fastmha.load_cpp_state_dict (torch.load's weights_only mode refuses the C++ pickler's type tags).
//   usage: train OUT_DIR [STEPS [INIT.pt]]   (INIT.pt: the block's state dict saved by Python's torch.save)
#include <torch/torch.h>

#include <fastmha/fastmha.h>
#include <filesystem>
#include <fstream>
#include <iostream>

namespace {

struct Model : torch::nn::Module {
  Model() {
    attention = register_module("attention", fastmha::MultiHeadAttention(fastmha::MultiHeadAttentionOptions(32, 4)));
    head = register_module("head", torch::nn::Linear(32, 32));
  }
  at::Tensor forward(const at::Tensor& x) { return head(attention(x, x, x) + x); }
  fastmha::MultiHeadAttention attention{nullptr};
  torch::nn::Linear head{nullptr};
};

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) {
    std::cerr << "usage: " << argv[0] << " OUT_DIR [STEPS [INIT.pt]]\n";
    return 2;
  }
  const std::filesystem::path out_dir(argv[1]);
  const int steps = argc > 2 ? std::stoi(argv[2]) : 300;
  std::filesystem::create_directories(out_dir);
  torch::manual_seed(0);
  Model model;
  if (argc > 3) {
    try {
      fastmha::load_state_dict(*model.attention, argv[3]);  // weights from Python
    } catch (const std::exception& error) {
      std::cerr << error.what() << "\n";
      return 1;
    }
  }
  torch::optim::Adam optimizer(model.parameters(), torch::optim::AdamOptions(3e-3));
  double first = 1, last = 1;
  for (int step = 0; step < steps; ++step) {
    auto x = torch::randn({16, 12, 32});
    auto target = 0.5 * (x.select(1, 0).unsqueeze(1) + x);
    optimizer.zero_grad();
    auto loss = torch::mse_loss(model.forward(x), target);
    loss.backward();
    optimizer.step();
    if (step == 0) first = loss.item<double>();
    last = loss.item<double>();
    if (step % 50 == 0 || step == steps - 1) std::cout << "step " << step << " loss " << last << "\n";
  }
  model.eval();
  fastmha::save_state_dict(*model.attention, (out_dir / "attention.pt").string());
  torch::NoGradGuard no_grad;
  auto probe = torch::randn({2, 7, 32});
  c10::impl::GenericDict saved(c10::AnyType::get(), c10::AnyType::get());  // as save_state_dict writes its dict
  saved.insert("input", probe);
  saved.insert("output", model.attention(probe, probe, probe));
  const auto bytes = torch::pickle_save(c10::IValue(saved));
  std::ofstream((out_dir / "probe.pt").string(), std::ios::binary).write(bytes.data(), bytes.size());
  std::cout << "loss " << first << " -> " << last << (last < 0.5 * first ? " (learned)" : " (did not learn)")
            << "\nwrote " << (out_dir / "attention.pt").string() << " and probe.pt\n";
  return last < 0.5 * first ? 0 : 1;
}
