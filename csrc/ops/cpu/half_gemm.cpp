#include "ops/cpu/half_gemm.h"

#include <ATen/Context.h>
#include <ATen/native/CPUBlas.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "ops/cpu/cpu_capability.h"
#ifdef FASTMHA_CPU_X86
#include "ops/cpu/half_packing_avx512.h"
#endif

namespace fastmha::cpu {
namespace {

// Whether the AVX-512 packers and panel stores run (the processor runs fastmha's AVX512 kernels).
bool avx512_moves() {
#ifdef FASTMHA_CPU_X86
  return capability() == Capability::AVX512;
#else
  return false;
#endif
}

using Packer = void (*)(const uint16_t*, int64_t, int64_t, int64_t, bool, uint16_t*);
#ifdef FASTMHA_CPU_X86
constexpr Packer kFastTransposed = avx512::pack_transposed, kFastRows = avx512::pack_rows;
#else
constexpr Packer kFastTransposed = nullptr, kFastRows = nullptr;
#endif

// `fast` (an AVX-512 packer) where it runs and takes operands of row stride ld and d elements, else `portable`.
Packer packer(Packer fast, Packer portable, int64_t ld, int64_t d) {
#ifdef FASTMHA_CPU_X86
  return avx512_moves() && avx512::packs(ld, d) ? fast : portable;
#else
  return portable;
#endif
}

uint16_t half_bits(HalfKind kind, float x) { return kind == HalfKind::kBFloat16 ? c10::BFloat16(x).x : c10::Half(x).x; }

// One panel of kPanel columns of a product, one depth piece: out (rows x kPanel, row stride ldc) (+)= left right
// (left rows lda apart).
void panel_product(HalfKind kind, bool vnni, int64_t rows, int64_t piece, const uint16_t* left, int64_t lda,
                   const uint16_t* right, float* out, int64_t ldc, bool add) {
  if (kind == HalfKind::kBFloat16) {
    at::native::cpublas::brgemm(rows, kPanel, piece, lda, kPanel, ldc, add, reinterpret_cast<const at::BFloat16*>(left),
                                reinterpret_cast<const at::BFloat16*>(right), out, vnni);
  } else {
    at::native::cpublas::brgemm(rows, kPanel, piece, lda, kPanel, ldc, add, reinterpret_cast<const at::Half*>(left),
                                reinterpret_cast<const at::Half*>(right), out, vnni);
  }
}

}  // namespace

bool half_products_probe(HalfKind kind, bool vnni) {
  constexpr int64_t m = 16, n = kPanel + 8, d = kDepthMultiple;
  std::vector<uint16_t> a(static_cast<size_t>(m * d)), b(static_cast<size_t>(d * n));
  std::vector<float> expected(static_cast<size_t>(m * n), 0.0f), got(static_cast<size_t>(m * n), 0.0f);
  for (int64_t r = 0; r < m; ++r) {
    for (int64_t k = 0; k < d; ++k) a[r * d + k] = half_bits(kind, static_cast<float>((r + 2 * k) % 7 - 3));
  }
  for (int64_t k = 0; k < d; ++k) {
    for (int64_t c = 0; c < n; ++c) b[k * n + c] = half_bits(kind, static_cast<float>((3 * k + c) % 5 - 2));
  }
  for (int64_t r = 0; r < m; ++r) {
    for (int64_t c = 0; c < n; ++c) {
      for (int64_t k = 0; k < d; ++k) expected[r * n + c] += ((r + 2 * k) % 7 - 3) * ((3 * k + c) % 5 - 2);
    }
  }
  std::vector<uint16_t> left(static_cast<size_t>(left_size(m, d))), right(static_cast<size_t>(packed_size(d, n)));
  pad_rows(a.data(), d, m, d, left.data());
  pack_rows(b.data(), n, d, n, vnni, right.data());
  try {
    HalfProductsTask task(vnni);
    half_gemm(kind, vnni, m, n, d, left.data(), {right.data(), d}, got.data(), n, false);
  } catch (const std::exception&) {
    return false;
  }
  return got == expected;
}

HalfGemmMode half_gemm_mode() {
  // Read at every call, as the other switches: set it before the first forward.
  const char* value = std::getenv("FASTMHA_CPU_HALF_GEMM");
  const std::string mode = value == nullptr || *value == '\0' ? "auto" : value;
  if (mode == "auto") return HalfGemmMode::kAuto;
  if (mode == "widen") return HalfGemmMode::kWiden;
  if (mode == "native") return HalfGemmMode::kNative;
  if (mode == "reference") return HalfGemmMode::kReference;
  TORCH_CHECK(false, "fastmha: FASTMHA_CPU_HALF_GEMM must be auto, widen, native or reference, got '", mode, "'");
}

bool native_half_products(at::ScalarType dtype) {
  if (!at::hasMKLDNN() || !at::globalContext().userEnabledMkldnn()) {
    return false;  // brgemm would refuse VNNI operands
  }
  if (dtype == at::kBFloat16) {
    static const bool works = native_bfloat16_products() && half_products_probe(HalfKind::kBFloat16, true);
    return works;
  }
  if (dtype == at::kHalf) {
    // With AVX512-FP16 but no AMX-FP16, oneDNN computes float16 through fp32 and reads B row-major.
    static const bool works =
        at::native::cpublas::could_pack(at::kHalf) && half_products_probe(HalfKind::kFloat16, true);
    return works;
  }
  return false;
}

HalfProducts choose_half_products(at::ScalarType dtype, HalfGemmMode mode, bool forward, bool online, int64_t rows,
                                  int64_t chunk_rows, const std::function<int64_t()>& keys) {
  if (dtype != at::kBFloat16 && dtype != at::kHalf) {
    return {};
  }
  const std::string type = dtype == at::kBFloat16 ? "bfloat16" : "float16";
  const auto widened = [&](const std::string& why) {
    return HalfProducts{false, true, type + " products widened to float32" + why};
  };
  // The backward that keeps whole score rows always widens: a gradient of the weights, or a forward output it
  // cannot use (none, or not finite in float16).
  const std::string unless = forward ? "" : " (widened when the weights get a gradient)";
  const HalfProducts native{true, true, type + " products on this CPU's own instructions (oneDNN brgemm)" + unless};
  const std::string no_native = ": this CPU has no native " + type + " products";
  switch (mode) {
    case HalfGemmMode::kReference:
      return {true, false, type + " products in ATen's reference GEMM (FASTMHA_CPU_HALF_GEMM=reference)" + unless};
    case HalfGemmMode::kNative:
      return native_half_products(dtype) ? native : widened(no_native);
    case HalfGemmMode::kAuto: {
      if (!native_half_products(dtype)) {
        return widened(no_native);
      }
      const bool tiles = at::native::cpublas::could_pack(dtype);
      // Without tiles the lower limits hold where the operands are packed in AVX-512 (as measured); with the
      // portable packers native products lost at fewer than 256 rows or keys.
      const bool packed_fast = !tiles && avx512_moves();
      // A chunk's products run on its rows rounded up to a multiple of 16 (computed_rows): at most an eighth more
      // from 128 rows on.
      const bool rows_on_tiles = tiles && (online ? chunk_rows >= kNativeOnlineOnTilesFromRows
                                                  : !forward && rows >= kNativeBackwardOnTilesFromRows);
      const int64_t fewest_rows = packed_fast ? kNativeWithoutTilesFromRows : kNativeFromRows;
      if (rows < fewest_rows && !rows_on_tiles) {
        const std::string on_tiles =
            !tiles ? ""
            : online
                ? " (on AMX tiles " + std::to_string(kNativeOnlineOnTilesFromRows) + " in chunks of as many or more)"
            : !forward ? " (on AMX tiles " + std::to_string(kNativeBackwardOnTilesFromRows) + ")"
                       : "";
        return widened(": fewer than " + std::to_string(fewest_rows) + " query rows" + on_tiles +
                       ", where native products pay less than widening");
      }
      const int64_t fewest = !tiles && !packed_fast ? kNativeFromKeys
                             : online               ? 0
                             : forward              ? kNativeFromKeys
                             : tiles                ? kNativeBackwardOnTilesFromKeys
                                                    : kNativeBackwardWithoutTilesFromKeys;
      if (fewest > 0 && keys() < fewest) {
        return widened(": fewer than " + std::to_string(fewest) +
                       " keys a row multiplies, where native products pay less than widening");
      }
      return native;
    }
    case HalfGemmMode::kWiden:
      break;
  }
  return widened(" (FASTMHA_CPU_HALF_GEMM=widen)");
}

void pack_transposed(const uint16_t* src, int64_t ld, int64_t n, int64_t d, bool vnni, uint16_t* dst) {
  packer(kFastTransposed, portable::pack_transposed, ld, d)(src, ld, n, d, vnni, dst);
}

void pack_rows(const uint16_t* src, int64_t ld, int64_t n, int64_t d, bool vnni, uint16_t* dst) {
  packer(kFastRows, portable::pack_rows, ld, d)(src, ld, n, d, vnni, dst);
}

namespace portable {

void pack_transposed(const uint16_t* src, int64_t ld, int64_t n, int64_t d, bool vnni, uint16_t* dst) {
  const int64_t depth = padded_depth(d);
  std::fill(dst, dst + packed_size(depth, n), uint16_t{0});
  for (int64_t j = 0; j < n; ++j) {
    const uint16_t* row = src + j * ld;
    if (vnni && d % 2 == 0) {  // a pair of elements of a key is one 32-bit word: a transpose of words
      uint16_t* column = dst + packed_index(0, j, depth, true);
      for (int64_t p = 0; p < d / 2; ++p) std::memcpy(column + p * kPanel * 2, row + 2 * p, sizeof(uint32_t));
    } else {
      for (int64_t r = 0; r < d; ++r) dst[packed_index(r, j, depth, vnni)] = row[r];
    }
  }
}

void pack_rows(const uint16_t* src, int64_t ld, int64_t n, int64_t d, bool vnni, uint16_t* dst) {
  const int64_t depth = padded_depth(n);
  std::fill(dst, dst + packed_size(depth, d), uint16_t{0});
  for (int64_t r = 0; r < n; ++r) {
    const uint16_t* row = src + r * ld;
    for (int64_t c0 = 0; c0 < d; c0 += kPanel) {
      const int64_t width = std::min(kPanel, d - c0);
      if (vnni) {
        uint16_t* out = dst + packed_index(r, c0, depth, true);
        for (int64_t c = 0; c < width; ++c) out[2 * c] = row[c0 + c];
      } else {
        std::memcpy(dst + packed_index(r, c0, depth, false), row + c0, static_cast<size_t>(width) * sizeof(uint16_t));
      }
    }
  }
}

}  // namespace portable

namespace {

// Rows from..to of a left operand of m rows, d columns deep: zeros from column `valid(r)` to padded_depth(d).
template <typename Valid>
void zero_left_rows(int64_t m, int64_t d, int64_t from, int64_t to, const Valid& valid, uint16_t* dst) {
  const int64_t depth = padded_depth(d);
  for (int64_t k0 = 0; k0 < depth; k0 += kMaxDepthPiece) {
    const int64_t end = std::min(kMaxDepthPiece, depth - k0);  // columns of this piece that are read
    for (int64_t r = from; r < to; ++r) {
      uint16_t* row = dst + left_index(r, k0, m);
      std::fill(row + std::clamp<int64_t>(valid(r) - k0, 0, end), row + end, uint16_t{0});
    }
  }
}

}  // namespace

void zero_left_padding(int64_t m, int64_t d, uint16_t* dst) {
  zero_left_rows(
      m, d, 0, computed_rows(m), [&](int64_t r) { return r < m ? d : int64_t{0}; }, dst);
}

void zero_padding_rows(int64_t m, int64_t d, uint16_t* dst) {
  zero_left_rows(
      m, d, m, computed_rows(m), [](int64_t) { return int64_t{0}; }, dst);
}

void pad_rows(const uint16_t* src, int64_t ld, int64_t m, int64_t d, uint16_t* dst) {
  for (int64_t r = 0; r < m; ++r) {
    for (int64_t k0 = 0; k0 < d; k0 += kMaxDepthPiece) {
      const int64_t width = std::min(kMaxDepthPiece, d - k0);
      std::memcpy(dst + left_index(r, k0, m), src + r * ld + k0, static_cast<size_t>(width) * sizeof(uint16_t));
    }
  }
  zero_left_padding(m, d, dst);
}

void half_gemm(HalfKind kind, bool vnni, int64_t m, int64_t n, int64_t depth, const uint16_t* a, PackedRight b,
               float* c, int64_t ldc, bool add_c, float alpha) {
  TORCH_INTERNAL_ASSERT(b.rows >= depth, "a packed right operand of ", b.rows, " rows for a depth of ", depth);
  if (m == 0 || n == 0) {
    return;
  }
  if (depth == 0) {  // an empty sum
    for (int64_t r = 0; r < m && !add_c; ++r) std::fill(c + r * ldc, c + r * ldc + n, 0.0f);
    return;
  }
  if (alpha == 1.0f && computed_rows(m) == m && n % kPanel == 0) {  // C has every row and column the kernel writes
    half_gemm_in_place(kind, vnni, m, n, depth, a, b, c, ldc, add_c);
    return;
  }
  thread_local CacheLineVector<float> panel_out;  // one panel of C for all padded rows
  const int64_t rows = padded_rows(m);
  hold_at_least(panel_out, rows * kPanel);
  for (int64_t c0 = 0; c0 < n; c0 += kPanel) {
    const int64_t width = std::min(kPanel, n - c0);
    half_gemm_in_place(kind, vnni, m, width, depth, a, {b.data + packed_index(0, c0, b.rows, vnni), b.rows},
                       panel_out.data(), kPanel);
#ifdef FASTMHA_CPU_X86
    if (avx512_moves()) {
      avx512::store_panel(panel_out.data(), m, width, c + c0, ldc, add_c, alpha);
      continue;
    }
#endif
    for (int64_t r = 0; r < m; ++r) {
      const float* from = panel_out.data() + r * kPanel;
      float* to = c + r * ldc + c0;
      if (add_c) {
        for (int64_t j = 0; j < width; ++j) to[j] += alpha * from[j];
      } else {
        for (int64_t j = 0; j < width; ++j) to[j] = alpha * from[j];
      }
    }
  }
}

void half_gemm_in_place(HalfKind kind, bool vnni, int64_t m, int64_t n, int64_t depth, LeftOperand a, PackedRight b,
                        float* c, int64_t ldc, bool add_c) {
  TORCH_INTERNAL_ASSERT(b.rows >= depth && depth > 0 && ldc >= (n + kPanel - 1) / kPanel * kPanel,
                        "an in-place product of ", n, " columns, depth ", depth, ", row stride ", ldc);
  TORCH_INTERNAL_ASSERT(a.ld == 0 || (computed_rows(m) == m && depth % kDepthMultiple == 0),
                        "a left operand read in place with ", m, " rows, depth ", depth);
  const int64_t rows = computed_rows(m);
  for (int64_t r0 = 0, block = 0; r0 < rows; r0 += block) {
    block = kRowMultiple;
    while (2 * block <= rows - r0) block *= 2;
    for (int64_t c0 = 0; c0 < n; c0 += kPanel) {
      for (int64_t k0 = 0; k0 < depth; k0 += kMaxDepthPiece) {
        const int64_t piece = std::min(kMaxDepthPiece, depth - k0);
        const uint16_t* right = b.data + packed_index(k0, c0, b.rows, vnni);
        panel_product(kind, vnni, block, piece, a.piece(k0, m) + r0 * a.row_stride(), a.row_stride(), right,
                      c + r0 * ldc + c0, ldc, add_c || k0 > 0);
      }
    }
  }
}

HalfProductsTask::~HalfProductsTask() {
  if (vnni_) {
    at::native::cpublas::brgemm_release(true);
  }
}

}  // namespace fastmha::cpu
