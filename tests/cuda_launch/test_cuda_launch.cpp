// The host launch code of fastmha's CUDA kernels (ops/cuda/attention_kernels.cuh, the same objects that go
// into libfastmha) against a stand-in CUDA runtime that enforces what the hardware does (large dynamic shared
// memory needs the kernel's own attribute raised first, block and grid limits, no kernel image for an arch
// the build lacks). No kernel runs: pointers are never read. Each TEST_CASE runs in its own process (ctest),
// so each starts from a fresh device: no attribute raised, no launch made.
#define CATCH_CONFIG_MAIN
#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>
#include <c10/util/Half.h>

#include <catch2/catch.hpp>

#include <algorithm>
#include <set>
#include <string>
#include <vector>

#include "ops/cuda/attention_kernels.h"
#include "ops/cuda/flash/flash_forward.h"

extern "C" void fastmha_standin_configure(int sm, size_t optin_shared);
extern "C" int fastmha_standin_launches();
extern "C" void fastmha_standin_archs(std::set<int>* sass, std::set<int>* ptx);

namespace {

using namespace fastmha::cuda_kernels;

constexpr size_t kKiB = 1024;

// Parameters of a (batch 2, 8 heads, Lq 300, Lk 200) call with head size d; the pointers are never read.
template <typename T, typename Acc>
AttentionParams<T, Acc> params(int d, int64_t batch_heads = 16) {
  static char dummy[64];
  AttentionParams<T, Acc> p{};
  p.q = p.k = p.v = reinterpret_cast<const T*>(dummy);
  p.q_stride = p.k_stride = p.v_stride = {8 * 300 * static_cast<int64_t>(d), 300 * static_cast<int64_t>(d), d};
  p.batch_heads = batch_heads;
  p.heads = 8;
  p.len_q = 300;
  p.len_k = 200;
  p.d_k = p.d_v = d;
  p.scale = Acc(0.125);
  p.out = reinterpret_cast<T*>(dummy);
  p.lse = reinterpret_cast<Acc*>(dummy);
  return p;
}

template <typename T, typename Acc>
SoftmaxRowsParams<T, Acc> row_params(int len_k = 200) {
  static char dummy[64];
  SoftmaxRowsParams<T, Acc> p{};
  p.scores = reinterpret_cast<const Acc*>(dummy);
  p.weights = reinterpret_cast<T*>(dummy);
  p.rows = 16 * 300;
  p.heads = 8;
  p.len_q = 300;
  p.len_k = len_k;
  p.scale = Acc(0.125);
  return p;
}

// One launch of the flash forward or backward of dtype T for head size d.
struct Launch {
  std::string name;
  void (*run)(int d);
  int d;
};

template <typename T, typename Acc>
void forward(int d) {
  launch_flash_forward(params<T, Acc>(d), nullptr);
}
template <typename T, typename Acc>
void backward(int d) {
  launch_flash_backward(params<T, Acc>(d), nullptr);
}

template <typename T, int RowTiles>
void forward_mma(int d) {
  launch_flash_forward_mma(params<T, float>(d), RowTiles, nullptr);
}
template <typename T>
void backward_mma(int d) {
  launch_flash_backward_mma(params<T, float>(d), nullptr);
}

// Every flash kernel: 4 dtypes x forward/backward x padded head sizes 64, 128, 256, and the half types' mma
// forwards and backward for 64 and 128.
std::vector<Launch> every_flash_launch() {
  std::vector<Launch> launches;
  for (const int d : {64, 128, 256}) {
    if (d <= kMaxMmaHeadDim) {
      launches.push_back({"half mma forward", &forward_mma<c10::Half, 2>, d});
      launches.push_back({"bfloat16 mma forward", &forward_mma<c10::BFloat16, 2>, d});
      launches.push_back({"half mma16 forward", &forward_mma<c10::Half, 1>, d});
      launches.push_back({"bfloat16 mma16 forward", &forward_mma<c10::BFloat16, 1>, d});
      launches.push_back({"half mma backward", &backward_mma<c10::Half>, d});
      launches.push_back({"bfloat16 mma backward", &backward_mma<c10::BFloat16>, d});
    }
    launches.push_back({"float forward", &forward<float, float>, d});
    launches.push_back({"float backward", &backward<float, float>, d});
    launches.push_back({"double forward", &forward<double, double>, d});
    launches.push_back({"double backward", &backward<double, double>, d});
    launches.push_back({"half forward", &forward<c10::Half, float>, d});
    launches.push_back({"half backward", &backward<c10::Half, float>, d});
    launches.push_back({"bfloat16 forward", &forward<c10::BFloat16, float>, d});
    launches.push_back({"bfloat16 backward", &backward<c10::BFloat16, float>, d});
  }
  return launches;
}

void launch_all(const std::vector<Launch>& launches) {
  for (const auto& launch : launches) {
    INFO(launch.name << " d " << launch.d);
    REQUIRE_NOTHROW(launch.run(launch.d));
  }
}

bool image_expected(int sm) {
  std::set<int> sass, ptx;
  fastmha_standin_archs(&sass, &ptx);
  REQUIRE(!(sass.empty() && ptx.empty()));  // the stand-in read the fat binaries
  for (const int arch : sass) {
    if (arch / 10 == sm / 10 && arch <= sm) return true;
  }
  for (const int arch : ptx) {
    if (arch <= sm) return true;
  }
  return false;
}

// Configures the stand-in as a GPU of arch `sm` and says whether the build holds code it runs. A build for other
// GPUs only (one for the local GPU, say) must then refuse every launch with "no kernel image", which is checked
// here instead of the case's launches.
bool build_runs_on(int sm, size_t optin_shared) {
  fastmha_standin_configure(sm, optin_shared);
  if (image_expected(sm)) {
    REQUIRE(kernel_image_available());
    return true;
  }
  CHECK_FALSE(kernel_image_available());
  REQUIRE_THROWS_WITH((forward<c10::BFloat16, float>(64)), Catch::Contains("no kernel image"));
  REQUIRE_THROWS_WITH(launch_softmax_forward((row_params<float, float>()), nullptr),
                      Catch::Contains("no kernel image"));
  CHECK(fastmha_standin_launches() == 0);
  return false;
}

}  // namespace

TEST_CASE("H100: every flash kernel launches, forward then backward, each dtype and head size", "[launch]") {
  if (!build_runs_on(90, 227 * kKiB)) return;
  const auto launches = every_flash_launch();
  launch_all(launches);
  launch_all(launches);  // and again, once every attribute is set
  CHECK(fastmha_standin_launches() == 2 * static_cast<int>(launches.size()));
}

TEST_CASE("H100: every flash kernel launches, backward first and head sizes descending", "[launch]") {
  if (!build_runs_on(90, 227 * kKiB)) return;
  auto launches = every_flash_launch();
  std::reverse(launches.begin(), launches.end());
  launch_all(launches);
}

TEST_CASE("A100: every flash kernel fits its 163 KiB of shared memory", "[launch]") {
  if (!build_runs_on(80, 163 * kKiB)) return;
  launch_all(every_flash_launch());
}

TEST_CASE("The weights-kept row kernels launch without opting in", "[launch]") {
  if (!build_runs_on(90, 227 * kKiB)) return;
  // Rows in registers (one warp up to 512 keys, two up to 1024, eight up to 8192) and a block per longer row.
  const int lengths[] = {200, 1000, 5000, 9000};
  for (const int len_k : lengths) {
    INFO("Lk " << len_k);
    REQUIRE_NOTHROW(launch_softmax_forward((row_params<float, float>(len_k)), nullptr));
    REQUIRE_NOTHROW(launch_softmax_backward((row_params<c10::BFloat16, float>(len_k)), nullptr));
    REQUIRE_NOTHROW(launch_softmax_forward((row_params<double, double>(len_k)), nullptr));
    REQUIRE_NOTHROW(launch_softmax_backward((row_params<c10::Half, float>(len_k)), nullptr));
  }
  CHECK(fastmha_standin_launches() == 4 * 4);
}

template <int DP>
void check_fits_99_kib() {
  const size_t bytes = ForwardTiles<float, float, DP>::kSharedBytes;
  INFO("float forward d " << DP << ": " << bytes << " bytes of shared memory");
  if (bytes <= 99 * kKiB) {
    REQUIRE_NOTHROW((forward<float, float>(DP)));
  } else {
    REQUIRE_THROWS_WITH((forward<float, float>(DP)),
                        Catch::Contains("cudaFuncSetAttribute") && Catch::Contains("invalid argument"));
  }
}

TEST_CASE("A GPU with 99 KiB of shared memory per block refuses the tiles that do not fit", "[launch]") {
  // sm_86/89 parts: the kernel choice sends them to ATen (own_kernels_fit); a launch would fail like this.
  if (!build_runs_on(86, 99 * kKiB)) return;
  check_fits_99_kib<64>();
  check_fits_99_kib<128>();
  check_fits_99_kib<256>();
}

TEST_CASE("A GPU newer than every SASS in the build runs the PTX, or reports no image", "[launch]") {
  fastmha_standin_configure(100, 227 * kKiB);
  const bool expected = image_expected(100);
  CHECK(kernel_image_available() == expected);
  if (expected) {
    REQUIRE_NOTHROW((forward<c10::BFloat16, float>(128)));
  } else {
    REQUIRE_THROWS_WITH((forward<c10::BFloat16, float>(128)), Catch::Contains("no kernel image"));
  }
}

TEST_CASE("A GPU older than the build's archs gets no kernel image, said clearly", "[launch]") {
  fastmha_standin_configure(75, 64 * kKiB);
  REQUIRE_FALSE(image_expected(75));
  CHECK_FALSE(kernel_image_available());
  REQUIRE_THROWS_WITH(
      launch_softmax_forward((row_params<float, float>()), nullptr),
      Catch::Contains("fastmha: launching the attention softmax failed") && Catch::Contains("no kernel image"));
  CHECK(fastmha_standin_launches() == 0);
}

TEST_CASE("The mma kernels refuse head sizes they have no kernel for", "[launch]") {
  if (!build_runs_on(90, 227 * kKiB)) return;
  REQUIRE_THROWS_WITH((forward_mma<c10::BFloat16, 2>(kMaxMmaHeadDim + 8)), Catch::Contains("head sizes up to 128"));
  REQUIRE_THROWS_WITH(backward_mma<c10::Half>(kMaxMmaHeadDim + 8), Catch::Contains("head sizes up to 128"));
  CHECK(fastmha_standin_launches() == 0);
}

TEST_CASE("A grid beyond one launch is refused before launching", "[launch]") {
  if (!build_runs_on(90, 227 * kKiB)) return;
  const auto p = params<float, float>(64, int64_t{1} << 31);
  REQUIRE_THROWS_WITH(launch_flash_forward(p, nullptr), Catch::Contains("CUDA blocks, more than one launch allows"));
  CHECK(fastmha_standin_launches() == 0);
}
