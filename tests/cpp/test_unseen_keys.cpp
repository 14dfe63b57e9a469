// The keys the block leaves unprojected (ops/unseen_keys.h), against the rule written out element by element: a
// key is seen when some head's query row of its batch entry attends it, or when some row of that entry attends
// none (the -1e9 rule spreads that row over every key); masks of every layout and dtype, and the finiteness
// bound that guards the skipped rows.
#include <torch/torch.h>

#include <catch2/catch.hpp>

#include <limits>
#include <optional>
#include <vector>

#include "ops/unseen_keys.h"

namespace {

using fastmha::projections_surely_finite;
using fastmha::split_key_rows;

// Row indices (b * len_k + j) of the seen keys, by the rule, for a mask broadcastable to (batch, h, Lq, Lk).
std::vector<int64_t> seen_by_rule(const at::Tensor& mask, int64_t batch, int64_t len_k) {
  auto visible = mask.ne(0);
  while (visible.dim() < 4) visible = visible.unsqueeze(0);
  visible = visible.expand({batch, -1, -1, len_k}).contiguous();
  const auto m = visible.accessor<bool, 4>();
  std::vector<int64_t> rows;
  for (int64_t b = 0; b < batch; ++b) {
    bool blind = false;
    std::vector<bool> seen(static_cast<size_t>(len_k), false);
    for (int64_t h = 0; h < m.size(1); ++h) {
      for (int64_t i = 0; i < m.size(2); ++i) {
        bool any = false;
        for (int64_t j = 0; j < len_k; ++j) {
          if (m[b][h][i][j]) {
            seen[static_cast<size_t>(j)] = true;
            any = true;
          }
        }
        blind = blind || !any;
      }
    }
    for (int64_t j = 0; j < len_k; ++j) {
      if (blind || seen[static_cast<size_t>(j)]) rows.push_back(b * len_k + j);
    }
  }
  return rows;
}

std::vector<int64_t> as_vector(const at::Tensor& t) {
  REQUIRE(t.scalar_type() == torch::kLong);
  const auto c = t.contiguous();
  return {c.const_data_ptr<int64_t>(), c.const_data_ptr<int64_t>() + c.numel()};
}

// split_key_rows on `mask` for keys and values (batch, len_k, 8) against the rule on `rule_mask` (the same mask by
// default): the seen rows and the others, or nullopt where more than 3/4 of the rows are seen.
void check_split(const at::Tensor& mask, int64_t batch, int64_t len_k, const at::Tensor& rule_mask = {}) {
  const auto key = torch::randn({batch, len_k, 8});
  const auto split = split_key_rows(mask, key, key, /*is_causal=*/false);
  const auto want = seen_by_rule(rule_mask.defined() ? rule_mask : mask, batch, len_k);
  if (static_cast<int64_t>(want.size()) * 4 > batch * len_k * 3) {
    CHECK_FALSE(split.has_value());
    return;
  }
  REQUIRE(split.has_value());
  CHECK(as_vector(split->seen) == want);
  std::vector<int64_t> unseen;
  size_t next = 0;
  for (int64_t r = 0; r < batch * len_k; ++r) {
    if (next < want.size() && want[next] == r) {
      ++next;
    } else {
      unseen.push_back(r);
    }
  }
  CHECK(as_vector(split->unseen) == unseen);
}

at::Tensor padding(const std::vector<int64_t>& kept, int64_t len_k) {
  return (torch::arange(len_k).unsqueeze(0) < torch::tensor(kept).unsqueeze(1)).view({-1, 1, 1, len_k});
}

}  // namespace

TEST_CASE("split_key_rows finds the keys some query sees, in padding, causal and random masks", "[unseen_keys]") {
  torch::manual_seed(0);
  const int64_t batch = 3, len_k = 40;
  const auto pad = padding({5, 9, 40}, len_k);  // the last entry sees every key
  check_split(pad, batch, len_k);
  const auto causal = torch::ones({len_k, len_k}, torch::kBool).tril();
  check_split(pad & causal, batch, len_k);  // (batch, 1, L, L) padding & causal
  // Per-head masks, a shared (1, h, Lq, Lk) one, rows shorter than the keys (Lq 7).
  for (double density : {0.0, 0.002, 0.01, 0.05, 0.5}) {
    INFO("density " << density);
    check_split(torch::rand({batch, 4, 7, len_k}) < density, batch, len_k);
    check_split(torch::rand({1, 4, 7, len_k}) < density, batch, len_k);
    check_split((torch::rand({batch, 1, 7, len_k}) < density) & pad, batch, len_k);
  }
}

TEST_CASE("split_key_rows ors every head's rows, heads that see different keys", "[unseen_keys]") {
  const int64_t batch = 2, heads = 4, rows = 7, len_k = 40;
  auto mask = torch::zeros({batch, heads, rows, len_k}, torch::kBool);
  for (int64_t h = 0; h < heads; ++h) {
    for (int64_t i = 0; i < rows; ++i) {
      mask[0][h][i][(7 * h + i) % 13] = true;           // entry 0 sees keys 0..12
      mask[1][h][i][20 + (5 * h + 2 * i) % 11] = true;  // entry 1 sees keys 20..30
    }
  }
  const auto split = split_key_rows(mask, torch::randn({batch, len_k, 8}), torch::randn({batch, len_k, 8}), false);
  REQUIRE(split.has_value());
  CHECK(split->seen.numel() == 13 + 11);
  check_split(mask, batch, len_k);
  check_split(mask.select(0, 0).unsqueeze(0), batch, len_k);  // one entry's mask shared by the batch
}

TEST_CASE("split_key_rows counts every key of an entry with a row that sees none as seen", "[unseen_keys]") {
  const int64_t batch = 2, len_k = 64;
  auto mask = padding({4, 6}, len_k).expand({batch, 2, 5, len_k}).clone();
  mask[0][1][3].fill_(false);  // entry 0, head 1, row 3 sees no key: all of entry 0's keys weigh something
  const auto split = split_key_rows(mask, torch::randn({batch, len_k, 8}), torch::randn({batch, len_k, 8}), false);
  REQUIRE(split.has_value());
  std::vector<int64_t> want;
  for (int64_t j = 0; j < len_k; ++j) want.push_back(j);
  for (int64_t j = 0; j < 6; ++j) want.push_back(len_k + j);
  CHECK(as_vector(split->seen) == want);
  check_split(mask, batch, len_k);
}

TEST_CASE("split_key_rows reads masks through their strides and in every dtype as nonzero attends", "[unseen_keys]") {
  torch::manual_seed(1);
  const int64_t batch = 2, len_k = 50;
  const auto mask = (torch::rand({batch, 1, 6, len_k}) < 0.03) | padding({3, 7}, len_k);
  check_split(mask.transpose(2, 3).contiguous().transpose(2, 3), batch, len_k);    // keys 6 apart
  check_split(padding({3, 7}, len_k).expand({batch, 8, 6, len_k}), batch, len_k);  // heads and rows of stride 0
  check_split(padding({4}, len_k).expand({batch, 1, 1, len_k}), batch, len_k);     // batch of stride 0
  check_split(padding({4}, len_k).view({len_k}), batch, len_k);                    // a 1-d mask over the keys
  for (const auto dtype : {torch::kUInt8, torch::kInt32, torch::kInt64, torch::kFloat32, torch::kBFloat16}) {
    INFO("dtype " << c10::toString(dtype));
    check_split(mask.to(dtype) * 3, batch, len_k);  // values other than 0 and 1 attend
  }
  const auto nan_mask = torch::where(mask, std::numeric_limits<float>::quiet_NaN(), 0.0f);
  check_split(nan_mask, batch, len_k);  // NaN is nonzero: it attends
  // Bool bytes other than 0 and 1 (a bool view of other bytes) attend as well.
  const auto bytes = mask.to(torch::kUInt8) * torch::randint(1, 256, mask.sizes(), torch::kUInt8);
  check_split(bytes.view(torch::kBool), batch, len_k, bytes);
}

TEST_CASE("split_key_rows leaves a mask with the same value at every key alone", "[unseen_keys]") {
  const int64_t batch = 2, len_k = 64;
  // An expanded key dimension (stride 0): every key of a row seen, or none (then all count as seen).
  check_split(torch::ones({batch, 1, 6, 1}, torch::kBool).expand({batch, 1, 6, len_k}), batch, len_k);
  check_split((torch::rand({batch, 1, 6, 1}) < 0.5).expand({batch, 1, 6, len_k}), batch, len_k);
  check_split(torch::zeros({batch, 1, 6, 1}, torch::kBool).expand({batch, 1, 6, len_k}), batch, len_k);
  check_split(torch::tensor(true).expand({len_k}), batch, len_k);
  check_split(torch::zeros({batch, 1, 6, 1}, torch::kInt64).expand({batch, 1, 6, len_k}), batch, len_k);
}

TEST_CASE("split_key_rows declines calls it does not serve", "[unseen_keys]") {
  const auto key = torch::randn({2, 30, 8});
  const auto pad = padding({3, 4}, 30);
  CHECK_FALSE(split_key_rows(std::nullopt, key, key, false).has_value());
  CHECK_FALSE(split_key_rows(pad, key, key, /*is_causal=*/true).has_value());
  CHECK_FALSE(split_key_rows(torch::ones({2, 1, 1, 1}, torch::kBool), key, key, false).has_value());  // no key dim
  CHECK_FALSE(split_key_rows(padding({25, 30}, 30), key, key, false).has_value());  // over 3/4 of the rows seen
  CHECK(split_key_rows(pad, key, key, false).has_value());
}

TEST_CASE("projections_surely_finite bounds the skipped rows' products, reading a shared key and value once",
          "[unseen_keys]") {
  const auto x = torch::randn({2, 10, 16});
  const auto w = torch::randn({16, 16});
  const auto rows = torch::tensor({3, 4, 15}, torch::kLong);
  CHECK(projections_surely_finite(x, w, x, w, rows));
  CHECK(projections_surely_finite(x, w, x, w, torch::empty({0}, torch::kLong)));
  for (const float bad : {std::numeric_limits<float>::infinity(), std::numeric_limits<float>::quiet_NaN(), 1e38f}) {
    INFO("value " << bad);
    auto value = x.clone();
    value[1][5][7] = bad;  // row 15: a skipped row of the value alone
    CHECK_FALSE(projections_surely_finite(x, w, value, w, rows));
    CHECK_FALSE(projections_surely_finite(value, w, value, w, rows));
    CHECK(projections_surely_finite(value, w, value, w, torch::tensor({3, 4}, torch::kLong)));  // not skipped
    auto weight = w.clone();
    weight[2][9] = bad;
    CHECK_FALSE(projections_surely_finite(x, w, x, weight, rows));
  }
  CHECK_FALSE(projections_surely_finite(x, w.to(torch::kFloat64), x, w, rows));  // dtypes differ: no bound
  for (const auto dtype : {torch::kFloat16, torch::kFloat64}) {
    INFO("dtype " << c10::toString(dtype));
    const auto xd = x.to(dtype), wd = w.to(dtype);
    CHECK(projections_surely_finite(xd, wd, xd, wd, rows));
    for (const double bad : {std::numeric_limits<double>::infinity(), std::numeric_limits<double>::quiet_NaN(),
                             -std::numeric_limits<double>::infinity()}) {
      auto value = xd.clone();
      value[1][5][7] = bad;  // row 15
      CHECK_FALSE(projections_surely_finite(xd, wd, value, wd, rows));
    }
  }
  auto overflowing = x.to(torch::kFloat16);
  overflowing[1][5][0] = 5000;  // times a row sum near 13: beyond half of float16's largest value (65504)
  CHECK_FALSE(projections_surely_finite(overflowing, w.to(torch::kFloat16), overflowing, w.to(torch::kFloat16), rows));
  const auto half = x.to(torch::kBFloat16);
  CHECK(projections_surely_finite(half, w.to(torch::kBFloat16), half, w.to(torch::kBFloat16), rows));
  auto big = half.clone();
  big[0][4][0] = 1e30;  // times weights' row sums near 1e11: beyond half of bfloat16's largest value
  CHECK_FALSE(projections_surely_finite(big, w.to(torch::kBFloat16) * 1e10, big, w.to(torch::kBFloat16), rows));
}
