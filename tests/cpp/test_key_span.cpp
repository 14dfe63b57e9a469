// The runs of keys the CPU kernels compute (ops/cpu/key_span.h), checked against their defining properties on
// random and structured masks: every key some row sees lies in a run, runs start and end on such keys, stay
// within the block size, and say `masked` exactly when some row hides a key inside them.
#include <torch/torch.h>

#include <catch2/catch.hpp>

#include <algorithm>
#include <limits>
#include <vector>

#include "ops/cpu/key_span.h"

namespace {

using fastmha::cpu::KeyBlock;
using fastmha::cpu::next_visible_block;

// A (rows, keys) bool mask read through the strides of `view` (a view of it, possibly transposed or broadcast).
struct MaskView {
  at::Tensor view;  // (rows, keys) bool
  const bool* data() const { return view.const_data_ptr<bool>(); }
  int64_t rows() const { return view.size(0); }
  int64_t keys() const { return view.size(1); }
  bool at(int64_t r, int64_t j) const { return data()[r * view.stride(0) + j * view.stride(1)]; }
};

bool seen_by_some_row(const MaskView& m, int64_t j) {
  for (int64_t r = 0; r < m.rows(); ++r) {
    if (m.at(r, j)) return true;
  }
  return false;
}

// Walks all runs of [0, keys) and checks them; returns how many keys the runs hold.
int64_t check_runs(const MaskView& m, int64_t block) {
  const int64_t keys = m.keys();
  std::vector<bool> covered(static_cast<size_t>(keys), false);
  int64_t from = 0, total = 0;
  while (from < keys) {
    const KeyBlock run = next_visible_block(m.data(), m.view.stride(0), m.view.stride(1), m.rows(), from, keys, block);
    if (run.lo == keys) {
      REQUIRE(run.hi == keys);
      for (int64_t j = from; j < keys; ++j) REQUIRE_FALSE(seen_by_some_row(m, j));
      break;
    }
    REQUIRE(from <= run.lo);
    REQUIRE(run.lo < run.hi);
    REQUIRE(run.hi <= keys);
    REQUIRE(run.hi - run.lo <= block);
    for (int64_t j = from; j < run.lo; ++j) REQUIRE_FALSE(seen_by_some_row(m, j));  // only hidden keys skipped
    REQUIRE(seen_by_some_row(m, run.lo));
    REQUIRE(seen_by_some_row(m, run.hi - 1));
    bool hidden = false;
    for (int64_t r = 0; r < m.rows(); ++r) {
      for (int64_t j = run.lo; j < run.hi; ++j) hidden = hidden || !m.at(r, j);
    }
    REQUIRE(run.masked == hidden);
    for (int64_t j = run.lo; j < run.hi; ++j) covered[static_cast<size_t>(j)] = true;
    total += run.hi - run.lo;
    from = run.hi;
  }
  for (int64_t j = 0; j < keys; ++j) {
    if (seen_by_some_row(m, j)) REQUIRE(covered[static_cast<size_t>(j)]);
  }
  return total;
}

}  // namespace

TEST_CASE("runs cover every key some row sees, in random masks of any density and layout", "[key_span]") {
  torch::manual_seed(0);
  for (double density : {0.0, 0.005, 0.05, 0.3, 0.9, 1.0}) {
    for (int64_t block : {1, 7, 64, 300}) {
      const auto mask = torch::rand({37, 500}) < density;
      check_runs({mask}, block);                                    // contiguous
      check_runs({mask.t().contiguous().t()}, block);               // keys 37 apart
      check_runs({mask.narrow(0, 0, 1).expand({37, 500})}, block);  // one row shared (row stride 0)
    }
  }
}

TEST_CASE("runs skip the gaps of structured masks and read no mask where every row sees every key", "[key_span]") {
  const auto rows = torch::arange(256).unsqueeze(1), cols = torch::arange(2048).unsqueeze(0);
  const auto window = ((cols - rows - 1024).abs() <= 64) | (cols < 16);  // rows 1024..1279 of a long window
  CHECK(check_runs({window}, 1024) == 16 + 256 + 128);
  const auto causal = cols <= rows + 512;  // rows 512..767 of a causal triangle
  check_runs({causal}, 1024);
  const KeyBlock first = next_visible_block(causal.const_data_ptr<bool>(), 2048, 1, 256, 0, 2048, 1024);
  CHECK(first.lo == 0);
  CHECK(first.hi == 513);  // every row sees keys 0..512: read without the mask
  CHECK_FALSE(first.masked);
  const auto dilated = (cols % 40 == 0).expand({256, 2048});
  CHECK(check_runs({dilated}, 1024) == (2048 + 39) / 40);
}

TEST_CASE("a mask broadcast over the keys is one value per row", "[key_span]") {
  const auto per_row = torch::tensor({false, true, false}).unsqueeze(1).expand({3, 100});
  const KeyBlock run = next_visible_block(per_row.const_data_ptr<bool>(), per_row.stride(0), 0, 3, 10, 100, 64);
  CHECK(run.lo == 10);
  CHECK(run.hi == 74);
  CHECK(run.masked);
  const auto none = torch::zeros({3, 1}, torch::kBool).expand({3, 100});
  CHECK(next_visible_block(none.const_data_ptr<bool>(), 1, 0, 3, 0, 100, 64).lo == 100);
}

TEST_CASE("the kernel choice's share of computed keys", "[key_span]") {
  using fastmha::cpu::computed_key_fraction;
  CHECK(computed_key_fraction(torch::ones({1, 1, 1, 1000}, torch::kBool), 2, 8, 300, 1000) == 1.0);
  const auto padding = (torch::arange(1000) < 250).reshape({1, 1, 1, 1000});
  CHECK(computed_key_fraction(padding, 2, 8, 300, 1000) == Approx(0.25));
  CHECK(computed_key_fraction(padding.to(torch::kFloat32), 2, 8, 300, 1000) == Approx(0.25));
  CHECK(computed_key_fraction(torch::zeros({300, 1000}, torch::kInt64), 2, 8, 300, 1000) == 1.0);  // uniform rows
  const auto blocks = torch::arange(1024).unsqueeze(1) / 64 == torch::arange(1024).unsqueeze(0) / 64;
  CHECK(computed_key_fraction(blocks, 1, 1, 1024, 1024) == Approx(64.0 / 1024));
}

TEST_CASE("the share of computed keys reads a mask of every dtype as nonzero attends", "[key_span]") {
  using fastmha::cpu::computed_key_fraction;
  // Padding that differs per batch element and row, read through a transposed (non-unit column stride) view.
  auto mask = (torch::rand({2, 1, 400, 300}) > 0.5).logical_and(torch::arange(300) < 90);
  mask.select(0, 1).narrow(-1, 0, 40).fill_(true);
  const double want = computed_key_fraction(mask, 2, 8, 400, 300);
  REQUIRE(want > 0.0);
  REQUIRE(want < 0.5);
  const auto transposed = mask.transpose(2, 3).contiguous().transpose(2, 3);
  CHECK(computed_key_fraction(transposed, 2, 8, 400, 300) == want);
  for (const auto dtype : {torch::kUInt8, torch::kInt8, torch::kInt16, torch::kInt32, torch::kInt64, torch::kFloat16,
                           torch::kBFloat16, torch::kFloat32, torch::kFloat64, torch::kUInt16}) {
    INFO("dtype " << c10::toString(dtype));
    CHECK(computed_key_fraction(mask.to(dtype), 2, 8, 400, 300) == want);
    CHECK(computed_key_fraction(transposed.to(dtype), 2, 8, 400, 300) == want);
    // Values other than 0 and 1 attend as well.
    CHECK(computed_key_fraction((mask.to(torch::kInt64) * 7).to(dtype), 2, 8, 400, 300) == want);
  }
  // NaN is nonzero: it attends, as the kernels read it.
  const auto nan_mask = torch::where(mask, std::numeric_limits<float>::quiet_NaN(), 0.0f);
  CHECK(computed_key_fraction(nan_mask, 2, 8, 400, 300) == want);
}

TEST_CASE("a run bridges gaps under 32 keys and splits off visible prefixes of 64 keys or more", "[key_span]") {
  auto run_of = [](const at::Tensor& mask) {
    return next_visible_block(mask.const_data_ptr<bool>(), mask.stride(0), 1, mask.size(0), 0, mask.size(1), 1024);
  };
  auto keys = torch::zeros({2, 200}, torch::kBool);
  keys.narrow(1, 0, 10).fill_(true);
  keys.narrow(1, 30, 10).fill_(true);  // a gap of 20 keys: one masked run over it
  KeyBlock run = run_of(keys);
  CHECK(run.hi == 40);
  CHECK(run.masked);
  keys.narrow(1, 80, 10).fill_(true);  // a gap of 40 keys: the run ends before it
  CHECK(run_of(keys).hi == 40);
  auto prefix = torch::ones({2, 200}, torch::kBool);
  prefix[1].narrow(0, 40, 160).fill_(false);  // 40 keys every row sees, then one row only: one masked run
  run = run_of(prefix);
  CHECK((run.hi == 200 && run.masked));
  prefix = torch::ones({2, 200}, torch::kBool);
  prefix[1].narrow(0, 100, 100).fill_(false);  // 100 keys every row sees: a run of its own, no mask read
  run = run_of(prefix);
  CHECK((run.hi == 100 && !run.masked));
}

TEST_CASE("each mask row's visible keys and the keys up to the last one any row shows, in any layout", "[key_span]") {
  using fastmha::cpu::keys_up_to_last_visible;
  using fastmha::cpu::mask_row_extents;
  torch::manual_seed(1);
  // Oracle of one row: its first and last visible key, and whether it hides one between them.
  auto check_extents = [](const at::Tensor& view) {  // (B, H, Lq, Lk) bool view
    const auto rows = mask_row_extents(view);
    REQUIRE(!rows.extents.empty());
    for (int64_t b = 0; b < view.size(0); ++b) {
      for (int64_t h = 0; h < view.size(1); ++h) {
        for (int64_t q = 0; q < view.size(2); ++q) {
          const auto row = view[b][h][q].contiguous();
          const auto& got =
              rows.extents.at(static_cast<size_t>(b * rows.stride[0] + h * rows.stride[1] + q * rows.stride[2]));
          const auto visible = row.nonzero().flatten();
          INFO("row " << b << ", " << h << ", " << q);
          if (visible.numel() == 0) {
            CHECK(got.first > got.last);
            continue;
          }
          const int64_t first = visible[0].item<int64_t>(), last = visible[-1].item<int64_t>();
          CHECK(got.first == first);
          CHECK(got.last == last);
          CHECK(got.holes == (visible.numel() < last - first + 1));
        }
      }
    }
    return rows;
  };
  // Oracle: one past the last key some row sees; all keys when some row sees none.
  auto expected = [](const MaskView& m) {
    int64_t keys = 0;
    for (int64_t r = 0; r < m.rows(); ++r) {
      int64_t last = -1;
      for (int64_t j = 0; j < m.keys(); ++j) last = m.at(r, j) ? j : last;
      if (last < 0) return m.keys();
      keys = std::max(keys, last + 1);
    }
    return keys;
  };
  auto got = [&](const MaskView& m) {
    const auto rows = check_extents(m.view.unsqueeze(0).unsqueeze(0));
    return keys_up_to_last_visible(rows.extents.data(), rows.stride[2], m.rows(), m.keys());
  };
  const auto cols = torch::arange(300).unsqueeze(0), rows = torch::arange(40).unsqueeze(1);
  for (int64_t length : {1, 37, 64, 200, 300}) {
    for (double density : {0.3, 1.0}) {
      auto mask = (cols < length) & (torch::rand({40, 300}) < density);
      mask.select(1, 0).fill_(true);  // every row sees key 0
      for (const auto& m :
           {mask, mask & (cols <= rows * 3), mask.t().contiguous().t(), mask.narrow(0, 5, 1).expand({40, 300})}) {
        INFO("length " << length << " density " << density);
        CHECK(got({m}) == expected({m}));
      }
    }
  }
  auto early_row_reaches_furthest = (cols < 10).expand({40, 300}).clone();
  early_row_reaches_furthest[0][250] = true;
  CHECK(got({early_row_reaches_furthest}) == 251);
  auto row_without_key = (cols < 10).expand({40, 300}).clone();
  row_without_key[17].fill_(false);  // uniform over all keys
  CHECK(got({row_without_key}) == 300);
  // Broadcast batch, head and query dimensions are found once: their stride is 0.
  const auto padding = (torch::arange(50).unsqueeze(0) < torch::tensor({7, 50, 0}).unsqueeze(1)).view({3, 1, 1, 50});
  auto broadcast = check_extents(padding.expand({3, 4, 6, 50}));
  CHECK((broadcast.extents.size() == 3 && broadcast.stride[0] == 1 && broadcast.stride[1] == 0 &&
         broadcast.stride[2] == 0));
  check_extents((padding & (torch::rand({3, 4, 6, 50}) < 0.5)).transpose(2, 3).contiguous().transpose(2, 3));
  CHECK(mask_row_extents(padding.narrow(3, 0, 1).expand({3, 4, 6, 50})).extents.empty());  // no key stride
  CHECK(mask_row_extents(at::Tensor()).extents.empty());
  check_extents(torch::rand({2, 3, 1, 50}) < 0.3);  // one query row of its own per head
  CHECK(mask_row_extents(torch::ones({2, 1, 0, 5}, torch::kBool)).extents.empty());  // no query
  CHECK(mask_row_extents(torch::ones({2, 1, 3, 0}, torch::kBool)).extents.empty());  // no key
}
