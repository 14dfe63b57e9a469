// The CPU kernels' task queue (ops/cpu/task_queue.h): every task runs exactly once, in claims of the given
// grain taken in order, whatever the thread count, the grain, or whether it is called inside a parallel region.
#include <ATen/Parallel.h>

#include <catch2/catch.hpp>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <mutex>
#include <set>
#include <thread>
#include <vector>

#include "ops/cpu/task_queue.h"

namespace {

// Runs for_each_task and returns how often each task ran; checks each claim's shape.
std::vector<int> run_counts(int64_t tasks, int64_t grain) {
  std::vector<std::atomic<int>> counts(static_cast<size_t>(tasks));
  std::atomic<int> workers{0};
  std::atomic<bool> bad_claim{false};
  fastmha::cpu::for_each_task(tasks, grain, [&](const auto& claim) {
    ++workers;
    int64_t last_begin = -1;
    for (int64_t begin, end; claim(begin, end);) {
      const int64_t g = grain < 1 ? 1 : grain;
      if (begin % g != 0 || end - begin > g || end <= begin || begin <= last_begin) bad_claim = true;
      last_begin = begin;
      for (int64_t t = begin; t < end; ++t) ++counts[static_cast<size_t>(t)];
    }
  });
  CHECK_FALSE(bad_claim.load());
  CHECK(workers.load() <= std::max(at::get_num_threads(), 1));
  std::vector<int> out;
  for (const auto& c : counts) out.push_back(c.load());
  return out;
}

}  // namespace

TEST_CASE("every task runs exactly once", "[task_queue]") {
  for (const int64_t tasks : {0, 1, 2, 3, 7, 64, 1000}) {
    for (const int64_t grain : {0, 1, 2, 3, 16, 5000}) {
      INFO("tasks " << tasks << ", grain " << grain);
      CHECK(run_counts(tasks, grain) == std::vector<int>(static_cast<size_t>(tasks), 1));
    }
  }
}

TEST_CASE("with two threads or more, tasks run on more than one thread", "[task_queue]") {
  if (at::get_num_threads() < 2) {
    WARN("one intra-op thread: nothing to check");
    return;
  }
  std::mutex lock;
  std::set<std::thread::id> threads;
  fastmha::cpu::for_each_task(64, 1, [&](const auto& claim) {
    for (int64_t begin, end; claim(begin, end);) {
      std::this_thread::sleep_for(std::chrono::microseconds(500));
      std::lock_guard<std::mutex> guard(lock);
      threads.insert(std::this_thread::get_id());
    }
  });
  CHECK(threads.size() > 1);
}

TEST_CASE("inside a parallel region the calling thread runs every task", "[task_queue]") {
  std::mutex lock;
  std::vector<std::vector<int>> results;
  at::parallel_for(0, 4, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      auto counts = run_counts(100, 3);
      std::lock_guard<std::mutex> guard(lock);
      results.push_back(std::move(counts));
    }
  });
  REQUIRE(results.size() == 4);
  for (const auto& counts : results) CHECK(counts == std::vector<int>(100, 1));
}

TEST_CASE("an exception in a task reaches the caller, and the other threads stop claiming", "[task_queue]") {
  std::atomic<int64_t> ran{0};
  auto throwing = [&](const auto& claim) {
    for (int64_t begin, end; claim(begin, end);) {
      if (begin == 10) throw std::runtime_error("task failed");
      std::this_thread::sleep_for(std::chrono::microseconds(200));
      ++ran;
    }
  };
  CHECK_THROWS_WITH(fastmha::cpu::for_each_task(1000, 1, throwing), "task failed");
  CHECK(ran.load() < 500);  // about 10: the queue was emptied
}
