// Tasks of uneven cost spread over torch's intra-op threads as each thread comes free, not in fixed ranges:
// the chunks of a padded batch cost in proportion to their sequence's visible keys, and a fixed split of
// the tasks can hand one thread most of the long sequences while the other waits.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>

namespace fastmha::cpu {

// Calls worker(claim) once per thread; the worker keeps its own buffers and runs
// `for (int64_t begin, end; claim(begin, end);) for (task = begin; task < end; ++task) ...`, where claim hands
// out the next `grain` tasks of [0, tasks) in order (consecutive tasks share a head: its data stays in cache).
// Each task runs exactly once, so results do not depend on which thread ran it.
// A worker that throws empties the queue, so that the others stop at their next claim; at::parallel_for
// passes the exception on to the caller.
template <typename Worker>
void for_each_task(int64_t tasks, int64_t grain, const Worker& worker) {
  if (tasks <= 0) {
    return;
  }
  grain = std::max<int64_t>(grain, 1);
  std::atomic<int64_t> next{0};
  const auto claim = [&](int64_t& begin, int64_t& end) {
    begin = next.fetch_add(grain, std::memory_order_relaxed);
    end = std::min(begin + grain, tasks);
    return begin < tasks;
  };
  const auto run = [&] {
    try {
      worker(claim);
    } catch (...) {
      next.store(tasks, std::memory_order_relaxed);
      throw;
    }
  };
  const int64_t units = (tasks + grain - 1) / grain;
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), units);
  if (threads <= 1) {
    worker(claim);
    return;
  }
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) { run(); });
}

}  // namespace fastmha::cpu
