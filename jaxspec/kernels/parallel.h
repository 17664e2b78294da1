// Run fn(0..num_tasks-1) on the calling thread and XLA's intra-op pool, tasks claimed atomically.
//
// A thread only ever waits for tasks another running thread has claimed, so this cannot deadlock
// even when every pool thread is busy; helpers that start late find nothing left and return.
#pragma once

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>

#include "xla/ffi/api/ffi.h"

namespace jaxspec {

inline void CpuRelax() {
#if defined(__x86_64__) || defined(__i386__)
  _mm_pause();
#endif
}

inline void ParallelFor(xla::ffi::ThreadPool& pool, int64_t num_tasks,
                        std::function<void(int64_t)> fn) {
  struct Shared {
    std::function<void(int64_t)> fn;
    int64_t num_tasks;
    std::atomic<int64_t> next{0};
    std::atomic<int64_t> done{0};
    void Run() {
      for (int64_t t; (t = next.fetch_add(1, std::memory_order_relaxed)) < num_tasks;) {
        fn(t);
        done.fetch_add(1, std::memory_order_release);
      }
    }
  };
  auto shared = std::make_shared<Shared>();
  shared->fn = std::move(fn);
  shared->num_tasks = num_tasks;
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  const int64_t helpers = std::min(threads, num_tasks) - 1;
  for (int64_t h = 0; h < helpers; ++h) pool.Schedule([shared] { shared->Run(); });
  shared->Run();
  while (shared->done.load(std::memory_order_acquire) < num_tasks) CpuRelax();
}

}  // namespace jaxspec
