#include "ops/kernel_choice.h"

#include <ATen/Context.h>
#include <ATen/Parallel.h>
#include <c10/util/Exception.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <sstream>

#include "ops/cpu/attention_params.h"
#include "ops/cpu/cpu_capability.h"
#include "ops/cpu/float_gemm.h"
#include "ops/cpu/half_gemm.h"
#include "ops/cpu/key_span.h"
#include "ops/cuda/flash/kernel_common.h"
#include "ops/stock/stock_attention.h"

namespace fastmha {
namespace {

CudaFactsProvider& cuda_facts_provider() {
  static CudaFactsProvider provider = nullptr;
  return provider;
}

// The value of a switch, or "auto". Read at every call, so set it before the first forward: a backward must
// see what its forward saw.
std::string switch_value(const char* name) {
  const char* value = std::getenv(name);
  return value == nullptr || *value == '\0' ? "auto" : value;
}

bool has_empty_input(const AttentionCall& call) {
  return call.query.numel() == 0 || call.key.numel() == 0 || call.value.numel() == 0;
}

// The share of the keys fastmha's CPU kernel computes for a call, estimated from a sample of its mask once per
// choice and only when a rule asks (1 without a mask).
class ComputedKeyShare {
 public:
  explicit ComputedKeyShare(const AttentionCall& call) : call_(call) {}
  double get() {
    if (!share_.has_value()) {
      const auto& q = call_.query;
      share_ = call_.mask.has_value()
                   ? cpu::computed_key_fraction(*call_.mask, q.size(0), q.size(1), q.size(2), call_.key.size(2))
                   : 1.0;
    }
    return *share_;
  }

 private:
  const AttentionCall& call_;
  std::optional<double> share_;
};

// The most keys at which a float32 or float64 forward takes fastmha's kernel without a mask that pays for it: from
// 1024 keys the two kernels are about even, and torch's stays the default there.
constexpr int64_t kOwnForwardUpToKeys = 512;
// The most keys at which a backward in a half type that torch's kernels multiply on AMX tiles takes fastmha's
// kernel: torch's backward costs several times more at short lengths, but leads from 1024 keys.
constexpr int64_t kOwnHalfBackwardOnTilesUpToKeys = 512;
// Whether a bfloat16 forward without a mask that pays for it, or a backward over more keys than that, takes
// fastmha's kernel with its products native where torch's kernels multiply on AMX tiles: measured at head sizes 64
// and 128; others stay with torch's.
constexpr bool own_half_on_tiles_head_size(int64_t d) { return d == 64 || d == 128; }
// The most query rows per head at which a bfloat16 backward over more keys than that takes fastmha's kernel at any
// head size, whatever its products (measured at 1-128 rows and 1024-4096 keys).
constexpr int64_t kOwnHalfBackwardOnTilesUpToQueries = 128;
// The fewest query rows per head at which a longer float32 forward with its P V on brgemm takes fastmha's kernel
// where its kernels run no AVX-512 (with AVX-512 any number does): measured from 1024 (as many queries as keys). Fewer
// rows (decoding steps, short query blocks) make a new product shape at every length, which past the shapes the process
// runs on brgemm (cpu/float_gemm.h) multiply on the BLAS again; so do other calls whose lengths keep changing, at their
// last key block.
constexpr int64_t kOwnForwardOnBrgemmFromQueries = 1024;

// float_on_brgemm: a float32 forward would run its P V on oneDNN's brgemm (cpu/float_gemm.h). half_on_native: whether
// fastmha's kernel would multiply this half-type call on the CPU's own instructions (cpu/half_gemm.h); asked only
// where torch's kernels multiply the type on AMX tiles.
KernelChoice choose_cpu(const AttentionCall& call, ComputedKeyShare& key_share, bool float_on_brgemm,
                        const std::function<bool()>& half_on_native) {
  const auto mode = switch_value("FASTMHA_CPU_KERNELS");
  TORCH_CHECK(mode == "auto" || mode == "own" || mode == "stock",
              "fastmha: FASTMHA_CPU_KERNELS must be auto, own or stock, got '", mode, "'");
  using K = AttentionKernel;
  if (call.need_weights) {
    return {K::kOwnCpu, "the weights are kept: only fastmha's kernel returns them from a fused pass"};
  }
  if (call.dropout_p > 0) {
    if (call.pass == Pass::kBackward && call.weights_at_hand) {
      return {K::kOwnCpu,
              "dropout: torch's CPU flash kernel has none; fastmha's kernel takes the softmax from the kept weights "
              "instead of recomputing the scores"};
    }
    return {K::kOwnCpu, "dropout: torch's CPU flash kernel has none"};
  }
  if (has_empty_input(call)) {
    return {K::kOwnCpu, "an empty input"};
  }
  if (call.query.size(3) != call.value.size(3)) {
    return {K::kOwnCpu, "d_k != d_v: torch's CPU flash kernel takes one head size"};
  }
  if (mode == "own") {
    return {K::kOwnCpu, "FASTMHA_CPU_KERNELS=own"};
  }
  if (mode == "stock") {
    return {K::kStockCpu, "FASTMHA_CPU_KERNELS=stock"};
  }
  if (call.pass == Pass::kBackward && call.weights_at_hand) {
    // Measured on Zen 3: 1.36x torch's flash backward at 4096 keys, 1.48x at 2048 (without a mask). This rule stays
    // above the mask's scan: weights_serve_backward asks it on tensors that may hold no data (a graph being traced).
    return {K::kOwnCpu,
            "the backward of a call that kept its weights without dropout: fastmha's kernel takes the "
            "softmax from them instead of recomputing the scores"};
  }
  // Measured with benchmarks/bench_kernel_choice.py and bench_cpu_backward_kernels.py (kernels interleaved in one
  // run; the results are in benchmarks/results/). Without a mask, fastmha's float32 forward (keys in cache-sized
  // blocks, an online softmax) is faster than torch's flash kernel up to 512 keys and about even from 1024 to 8192
  // keys, within the machines' noise; the longer forward then stays with torch's (except in half types torch's
  // kernel multiplies without AMX tiles, and with is_causal, below). fastmha's blocked backward measured faster at
  // every length (float32 1.03-1.28x torch's at 1024-8192 keys, float64 1.24-1.28x). In half types it wins unless
  // torch's kernels run them on AMX tiles (torch's forward faster at every length there, its backward from 1024
  // keys); without tiles torch's half-type kernels are no faster than its float32 ones, also where the processor
  // has AVX512-BF16 (Zen 4). A mask turns the choice around:
  // fastmha's kernel computes only the runs of keys some query of a chunk sees (padding, causal or block-sparse masks),
  // torch's computes all (3.7x faster or more with 10-25% of the keys visible, float32).
  const auto dtype = call.query.scalar_type();
  const bool half = dtype == at::kBFloat16 || dtype == at::kHalf;
  const bool torch_on_tiles = cpu::torch_half_on_tiles(dtype);
  const double span = key_share.get();
  // The largest share of the keys at which skipping the rest pays off: fastmha's kernel against torch's as
  // measured without a mask (about even in float32 from 1024 keys, faster below). Where torch multiplies half
  // types on AMX tiles, fastmha's widened forward took 3-5x torch's time on the first Xeon measured, 1.7-2.6x on an
  // Emerald Rapids (so 20%). Its native products there (AMX too), bfloat16 with a padding mask: forward 0.60-0.82x
  // torch's time with 70% of the keys visible (512-4096 keys, d_k 64 and 128; about even at 1024), 0.75-1.16x with
  // 85%; backward 0.79-0.80x with 70%, 0.88-1.10x with 85% (2048-4096 keys); float16 on AMX-FP16 follows untested.
  // Half types torch multiplies without tiles take fastmha's kernel at any share.
  const bool pass_forward = call.pass == Pass::kForward;
  const double own_pays_below = torch_on_tiles && !half_on_native() ? 0.2 : 0.75;
  // Built only where that rule decides: most calls take another.
  const auto skipped = [&] {
    return "a mask that leaves " + std::to_string(static_cast<int>(span * 100 + 0.5)) +
           "% of the keys to compute: fastmha's kernel skips the rest";
  };
  if (pass_forward) {
    if (span <= own_pays_below) {
      return {K::kOwnCpu, skipped()};
    }
    if (half && !torch_on_tiles) {
      // fastmha's forward, widened to fp32 for sgemm a head at a time in its tasks, measured on Zen 3 against
      // torch's: float16 1.3-2.1x faster at 128-8192 keys, d_k 64 and 128; bfloat16 1.2-1.6x faster at 128-512
      // keys and even at 1024-4096. On Zen 4 (AVX512-BF16) bfloat16 1.3x at 128 keys widened and 1.7-1.8x at
      // 256-4096 keys in native products; float16 (widened) 1.6-3.2x.
      const std::string type = dtype == at::kHalf ? "float16" : "bfloat16";
      return {K::kOwnCpu, type + " forward without AMX tiles for " + type +
                              " in torch's CPU flash kernel: fastmha's kernel is as fast or faster"};
    }
    if (dtype == at::kBFloat16 && own_half_on_tiles_head_size(call.query.size(3)) && half_on_native()) {
      // Measured on an Intel Xeon with AMX-BF16 (family 6, model 167 as reported) without a mask, once its weights'
      // exp ran as its own polynomial: fastmha's native forward took 0.70-0.80x torch's time at 128-4096 keys with
      // d_k 64 (is_causal 0.70-0.75x from 512 keys, 0.96x at 128); with d_k 128 0.79-0.88x at 512-4096 keys
      // (is_causal 0.81-0.85x) and 0.83-0.99x at 128-256 (one run 1.21x at 128 keys, within this machine's noise).
      return {K::kOwnCpu, "bfloat16 forward with a head size of " + std::to_string(call.query.size(3)) +
                              " in native products: fastmha's kernel is faster than torch's there, also on AMX tiles"};
    }
    if (call.is_causal && !half) {  // other half types on AMX tiles stay with torch's
      // Measured on Zen 4 against torch's forward: float32 1.15-1.42x at 128-1024 keys, even at 4096 (d_k 64 and
      // 128); float64 1.03-1.88x at 128-2048 keys.
      return {K::kOwnCpu,
              "is_causal: fastmha's kernel skips the keys above the diagonal chunk by chunk of queries, faster than "
              "torch's"};
    }
    if (!half && call.key.size(2) <= kOwnForwardUpToKeys) {
      // Measured without a mask: on Zen 4 fastmha's float32 forward took 0.84-0.95x torch's time at 64-512 keys
      // with d_k 64 (two runs), 0.89-0.99x with d_k 128, 0.94-1.00x at 1024 keys; float64 0.94-1.01x. On Zen 3
      // float32 0.89x at 128 keys and 0.96x at 512.
      return {K::kOwnCpu, "forward over at most " + std::to_string(kOwnForwardUpToKeys) +
                              " keys: fastmha's kernel is as fast as torch's or faster there"};
    }
    if (dtype == at::kFloat && cpu::capability() == cpu::Capability::AVX512) {
      // Measured on an Intel Xeon with AMX-BF16 (family 6, model 167 as reported) without a mask, once the softmax's
      // exp ran as fastmha's own polynomial: fastmha's float32 forward took 0.89-0.93x torch's time at 1024-8192 keys
      // with d_k 64 and 0.91-0.96x with d_k 128 (as many queries as keys, two runs each), 0.82-0.83x at 256 query
      // rows over 2048-4096 keys; with 1-128 query rows per head (decoding steps, short query blocks; a single row
      // on gemm's vector loops) 0.69-1.03x at 1024-4096 keys, d_k 64 and 128 (interleaved timings). On Zen 4 (P V
      // on brgemm) 0.87-0.90x at 1024-8192 keys with as many queries, and at 1024-4096 keys 0.54-0.98x with 1 query
      // row per head, 0.64-0.93x with 16 (d_k 64 and 128).
      return {K::kOwnCpu, "float32 forward on AVX-512: fastmha's kernel is faster than torch's beyond " +
                              std::to_string(kOwnForwardUpToKeys) + " keys too"};
    }
    if (float_on_brgemm && call.query.size(2) >= kOwnForwardOnBrgemmFromQueries) {
      // Measured on Zen 4 without a mask: fastmha's float32 forward with its P V on brgemm took 0.87-0.90x the time
      // of torch's (behind the layer) at 1024-8192 keys with d_k 64, 0.94x at 1024-4096 with d_k 128; with P V on
      // the BLAS, in the same rounds, 0.93-1.01x and 1.00-1.04x.
      return {K::kOwnCpu, "float32 forward with its P V on oneDNN's brgemm over " +
                              std::to_string(kOwnForwardOnBrgemmFromQueries) +
                              " query rows or more: fastmha's kernel is faster than torch's beyond " +
                              std::to_string(kOwnForwardUpToKeys) + " keys too"};
    }
    return {K::kStockCpu, "forward without kept weights or dropout: torch's CPU flash kernel is as fast or faster"};
  }
  if (span <= own_pays_below) {
    return {K::kOwnCpu, skipped()};
  }
  if (torch_on_tiles) {
    // Measured on an Intel Xeon with AMX-BF16 (bfloat16, fastmha's products native from 256 keys): fastmha's
    // backward took 0.26-0.42x torch's time at 128 keys, 0.65-0.78x at 256 and 0.88-0.95x at 512 (d_k 64 and 128),
    // but 1.04-1.21x at 1024-4096 keys, where torch's kernel keeps its AMX tiles busier.
    // With d_k 64 and its products native (packing and stores in AVX-512), forward + backward with fastmha's
    // forward and backward ran 1.07-1.10x SDPA's speed at 1024-2048 keys, 1.02x at 4096, 1.03x at 8192 (torch's
    // backward behind the layer: 0.98-1.00x). With d_k 128 fastmha's backward alone (native) took 0.70-0.96x the
    // time of torch's at 1024-8192 keys (backward kernels interleaved on the same saved tensors, three runs).
    // With at most 128 query rows per head fastmha's backward took 0.43-0.83x torch's time at 1024-4096 keys (bfloat16,
    // 1-128 rows, d_k 64, 96 and 128, products as `auto` picks them).
    const int64_t head_size = call.query.size(3);
    const bool own_heads = dtype == at::kBFloat16 && own_half_on_tiles_head_size(head_size) && half_on_native();
    const bool few_rows = dtype == at::kBFloat16 && call.query.size(2) <= kOwnHalfBackwardOnTilesUpToQueries;
    if (call.key.size(2) > kOwnHalfBackwardOnTilesUpToKeys && !own_heads) {
      if (few_rows) {
        return {K::kOwnCpu,
                "bfloat16 backward with at most " + std::to_string(kOwnHalfBackwardOnTilesUpToQueries) +
                    " query rows per head: fastmha's kernel is faster than torch's there, also on AMX tiles"};
      }
      return {K::kStockCpu,
              "backward in a half type torch's CPU flash kernel multiplies on AMX tiles, over more than " +
                  std::to_string(kOwnHalfBackwardOnTilesUpToKeys) + " keys"};
    }
    if (call.key.size(2) > kOwnHalfBackwardOnTilesUpToKeys) {
      return {K::kOwnCpu, "bfloat16 backward with a head size of " + std::to_string(head_size) +
                              " in native products: fastmha's kernel is as fast as torch's or faster, also on AMX "
                              "tiles"};
    }
    return {K::kOwnCpu, "backward over at most " + std::to_string(kOwnHalfBackwardOnTilesUpToKeys) +
                            " keys: fastmha's kernel is faster than torch's there, also on AMX tiles"};
  }
  return {K::kOwnCpu, "fastmha's backward is as fast as torch's or faster"};
}

KernelChoice choose_cuda_kernel(const AttentionCall& call) {
  using K = AttentionKernel;
  const auto mode = switch_value("FASTMHA_CUDA_KERNELS");
  TORCH_CHECK(mode == "auto" || mode == "own" || mode == "aten",
              "fastmha: FASTMHA_CUDA_KERNELS must be auto, own or aten, got '", mode, "'");
  if (call.drawn == DropoutDraw::kTorch) {  // only torch's backward replays torch's draw
    TORCH_CHECK(!call.need_weights,
                "fastmha: a weights gradient for a call whose dropout torch's kernel drew (FASTMHA_CUDA_DROPOUT=sdpa), "
                "which keeps no weights");
    return {K::kStockCuda,
            "the forward's dropout was drawn by SDPA's memory-efficient kernel (FASTMHA_CUDA_DROPOUT=sdpa): its "
            "backward replays it",
            stock::CudaBackend::kEfficient};
  }
  if (mode == "aten") {
    return {K::kAten, "FASTMHA_CUDA_KERNELS=aten"};
  }
  if (has_empty_input(call)) {
    return {K::kAten, "an empty input"};
  }
  const auto provider = cuda_facts_provider();
  TORCH_CHECK(provider != nullptr,
              "fastmha was built without CUDA kernels; rebuild it with a CUDA toolkit (nvcc) "
              "to run on ",
              call.query.device());
  const auto facts = provider(call.query.device());
  const bool head_fits =
      call.query.size(3) <= cuda_kernels::kMaxFlashHeadDim && call.value.size(3) <= cuda_kernels::kMaxFlashHeadDim;
  if (call.need_weights) {
    if (!facts.has_kernel_image) {
      return {K::kAten, "the weights are kept, and this library holds no code for " + facts.device_name};
    }
    return {K::kOwnCuda, "the weights are kept: cuBLAS scores and fastmha's fused softmax row kernels"};
  }
  // Why fastmha's flash kernels cannot run this call, or empty when they can.
  const auto flash_refusal = [&]() -> std::string {
    if (!facts.has_kernel_image) {
      return "this library holds no code for " + facts.device_name;
    }
    if (!facts.own_kernels_fit) {
      return facts.device_name + " gives a block less shared memory than fastmha's flash tiles need";
    }
    if (!head_fits) {
      return "fastmha's flash kernels take head sizes up to 256";
    }
    if (at::globalContext().deterministicAlgorithms()) {
      return "deterministic algorithms are requested and fastmha's flash backward adds dQ with atomics";
    }
    return "";
  };
  if (mode == "own") {
    const auto refusal = flash_refusal();
    if (!refusal.empty()) {
      return {K::kAten, "FASTMHA_CUDA_KERNELS=own, but " + refusal};
    }
    return {K::kOwnCuda, "FASTMHA_CUDA_KERNELS=own"};
  }
  // fastmha's flash kernels take the calls below that the layer cannot hand to torch's, in the half types where
  // they were measured. float32 and float64 keep the composite: unmeasured, and its backward has no atomics
  // (gradcheck's reentrancy test).
  const auto dtype = call.query.scalar_type();
  const bool half = dtype == at::kHalf || dtype == at::kBFloat16;
  std::string why;
  const bool training = call.pass == Pass::kBackward || call.query.requires_grad() || call.key.requires_grad() ||
                        call.value.requires_grad();
  // `auto` keeps masked and dropout calls off the layer until a GPU run proves those paths; `sdpa` sends them there.
  const auto backend =
      stock::cuda_backend(call.query, call.key, call.value, call.mask, call.is_causal, call.dropout_p, training,
                          /*take_masks=*/switch_value("FASTMHA_CUDA_MASKED") == "sdpa",
                          /*take_dropout=*/cuda_dropout_on_sdpa() && call.drawn != DropoutDraw::kFastmha, &why);
  if (backend.has_value()) {
    static const char* const names[] = {"", "flash", "memory-efficient", "cuDNN"};
    const std::string what = call.dropout_p > 0 ? "dropout with FASTMHA_CUDA_DROPOUT=sdpa (torch's own dropout masks, "
                                                  "reproducible under torch.manual_seed, not the CPU's): "
                                                : "no kept weights or dropout: ";
    return {K::kStockCuda, what + "SDPA's fused " + names[static_cast<int>(*backend)] + " kernel for this call",
            backend};
  }
  if (call.dropout_p > 0) {
    // torch's fused kernels draw other masks. On an H200 (bf16, 1024-16384 keys) the flash kernels ran 1.3-1.8x
    // the composite's speed forward, 1.1-1.2x forward and backward, in a fraction of its memory.
    const auto refusal = half ? flash_refusal() : "the composite keeps float32 and float64";
    if (!refusal.empty()) {
      return {K::kAten,
              "dropout: the ATen composite draws fastmha's reproducible Philox stream (the CPU's masks); " + refusal};
    }
    return {K::kOwnCuda,
            "dropout: fastmha's flash kernels draw its reproducible Philox stream (the CPU's masks) without an "
            "Lq x Lk buffer"};
  }
  // On an H200 in bf16 (1024-16384 keys, no mask) fastmha's flash kernels ran the forward 1.3-1.9x the
  // composite's speed (2.5-4.3x with is_causal), forward and backward 1.1-1.4x, with no Lq x Lk buffer.
  if (half && flash_refusal().empty()) {
    return {K::kOwnCuda, "torch's kernels are not used (" + why +
                             "): fastmha's flash kernels, faster than the ATen composite and without its buffer"};
  }
  return {K::kAten, "torch's kernels are not used (" + why + "): the ATen composite"};
}

// Which of fastmha's flash kernels run a call without kept weights (FASTMHA_CUDA_FLASH): `mma`, the
// register-resident kernels (float16 and bfloat16, head sizes up to 128) with 32 query rows per warp in the
// forward, `mma16` the same with 16 rows per warp and Q kept in registers (the backward is the same), or `wmma`,
// the shared-memory tile kernels. `auto` is `wmma` for now: the mma kernels are checked on the CPU emulator but
// have not yet run on a GPU.
KernelChoice choose_cuda(const AttentionCall& call) {
  // Checked at every CUDA call, as FASTMHA_CUDA_FLASH is below: a misspelt value fails whichever kernel runs.
  for (const char* name : {"FASTMHA_CUDA_MASKED", "FASTMHA_CUDA_DROPOUT"}) {
    const auto value = switch_value(name);
    TORCH_CHECK(value == "auto" || value == "sdpa", "fastmha: ", name, " must be auto or sdpa, got '", value, "'");
  }
  auto choice = choose_cuda_kernel(call);
  const auto variant = switch_value("FASTMHA_CUDA_FLASH");
  TORCH_CHECK(variant == "auto" || variant == "wmma" || variant == "mma" || variant == "mma16",
              "fastmha: FASTMHA_CUDA_FLASH must be auto, wmma, mma or mma16, got '", variant, "'");
  if (choice.kernel != AttentionKernel::kOwnCuda || call.need_weights || (variant != "mma" && variant != "mma16")) {
    return choice;
  }
  const bool forward = call.pass == Pass::kForward;
  const auto dtype = call.query.scalar_type();
  if ((dtype == at::kHalf || dtype == at::kBFloat16) && call.query.size(3) <= cuda_kernels::kMaxMmaHeadDim &&
      call.value.size(3) <= cuda_kernels::kMaxMmaHeadDim) {
    if (forward) {
      choice.mma_row_tiles = variant == "mma" ? 2 : 1;
    } else {
      choice.mma_backward = true;
    }
    choice.reason += std::string("; ") + (forward ? "forward" : "backward") +
                     ": the mma kernel (FASTMHA_CUDA_FLASH=" + variant + ")";
  } else {
    choice.reason += "; the wmma kernels (the mma kernels take float16/bfloat16 with head sizes up to 128)";
  }
  return choice;
}

}  // namespace

const char* kernel_name(AttentionKernel kernel) {
  switch (kernel) {
    case AttentionKernel::kOwnCpu:
      return "fastmha-cpu";
    case AttentionKernel::kStockCpu:
      return "torch-cpu-flash";
    case AttentionKernel::kOwnCuda:
      return "fastmha-cuda";
    case AttentionKernel::kStockCuda:
      return "torch-cuda-sdpa";
    case AttentionKernel::kAten:
      return "aten-composite";
  }
  return "unknown";
}

void set_cuda_facts_provider(CudaFactsProvider provider) { cuda_facts_provider() = provider; }

bool cuda_dropout_on_sdpa() { return switch_value("FASTMHA_CUDA_DROPOUT") == "sdpa"; }

KernelChoice choose_kernel(const AttentionCall& call) {
  if (call.query.is_cpu()) {
    // Checked at every CPU call, as FASTMHA_CPU_KERNELS is: a misspelt value fails in any dtype.
    const auto half_mode = cpu::half_gemm_mode();
    const auto float_mode = cpu::float_gemm_mode();
    ComputedKeyShare key_share(call);
    const auto dtype = call.query.scalar_type();
    const bool float_on_brgemm = dtype == at::kFloat && cpu::choose_float_products(float_mode).on_brgemm;
    // Only `auto` on a CPU with native products, with enough query rows, reads the mask's sample for the keys.
    const auto half_products = [&] {
      const int64_t len_k = call.key.size(2);
      const bool forward = call.pass == Pass::kForward;
      const int64_t len_q = call.query.size(2);
      const int64_t chunk =
          cpu::online_query_chunk(len_q, call.query.size(0) * call.query.size(1), at::get_num_threads());
      return cpu::choose_half_products(dtype, half_mode, forward, forward && !call.need_weights, len_q, chunk, [&] {
        return static_cast<int64_t>(std::llround(static_cast<double>(len_k) * key_share.get()));
      });
    };
    auto choice = choose_cpu(call, key_share, float_on_brgemm, [&] {
      const auto products = half_products();
      return products.in_half_type && products.vnni;  // not ATen's reference GEMM
    });
    if (choice.kernel == AttentionKernel::kOwnCpu && (dtype == at::kBFloat16 || dtype == at::kHalf)) {
      const auto products = half_products();
      choice.half_products = products.in_half_type;
      choice.half_products_vnni = products.vnni;
      choice.reason += "; " + products.note;
    }
    // The forward's P V in float32 and in half types widened to it; the blocked backward's products in float32.
    const bool forward = call.pass == Pass::kForward;
    if (choice.kernel == AttentionKernel::kOwnCpu && (forward ? dtype != at::kDouble : dtype == at::kFloat) &&
        !choice.half_products) {
      const auto products = cpu::choose_float_products(float_mode, !forward);
      choice.float_brgemm = products.on_brgemm;
      if (!products.note.empty()) {
        choice.reason += "; " + products.note;
      }
    }
    return choice;
  }
  if (call.query.is_cuda()) {
    return choose_cuda(call);
  }
  TORCH_CHECK(false, "fastmha: no kernels for device ", call.query.device());
}

bool weights_serve_backward(const AttentionCall& forward_call) {
  // The kept weights have the query's dtype and device.
  const auto& query = forward_call.query;
  if (!forward_call.need_weights || !query.device().is_cpu() ||
      !weights_stand_for_softmax(query.scalar_type(), forward_call.dropout_p) ||
      (forward_call.dropout_p > 0 && query.scalar_type() != at::kFloat)) {
    return false;
  }
  const auto symbolic = [](const at::Tensor& t) { return t.unsafeGetTensorImpl()->has_symbolic_sizes_strides(); };
  if (symbolic(forward_call.query) || symbolic(forward_call.key) || symbolic(forward_call.value)) {
    return switch_value("FASTMHA_CPU_KERNELS") != "stock";
  }
  AttentionCall backward = forward_call;
  backward.need_weights = false;
  backward.pass = Pass::kBackward;
  backward.weights_at_hand = true;
  return choose_kernel(backward).kernel == AttentionKernel::kOwnCpu;
}

KernelChoice choose_kernel_logged(const AttentionCall& call) {
  auto choice = choose_kernel(call);
  const char* what = call.pass == Pass::kForward ? "forward" : "backward";
  const char* log = std::getenv("FASTMHA_LOG_KERNELS");
  if (log != nullptr && std::strcmp(log, "1") == 0) {
    std::ostringstream line;
    line << "fastmha: " << what << " " << call.query.scalar_type() << " q" << call.query.sizes() << " k"
         << call.key.sizes() << (call.mask.has_value() ? " masked" : "") << (call.is_causal ? " causal" : "")
         << " dropout " << call.dropout_p << (call.need_weights ? " weights kept" : "") << " -> "
         << kernel_name(choice.kernel) << " (" << choice.reason << ")\n";
    std::fputs(line.str().c_str(), stderr);
  }
  return choice;
}

}  // namespace fastmha
