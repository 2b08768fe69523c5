// Bytes a thread will read soon, prefetched one cache line per weight row of the matmul
// it runs meanwhile. A decode step's LoRA adapter is read in short runs (0.5-25 KB of
// int8 A rows and B^T tiles a thread, each linear) that no cache holds after the base
// weights streamed past: started cold, they waited on the memory's latency and read at
// a fifth of the rate the weights stream at. Queued here before a linear, they arrive
// during its matmul instead, a line at a time, so the queue never stalls the weight
// loop on fill buffers (prefetching a layer's adapter in one burst did).
//
// The queue is the calling thread's own; the decode stack sets it before a matmul and
// clears it after, and the matmul kernels' row loops (qb_rows_pass, q4_rows, q8_rows)
// take one step per weight row. A prefetch never faults and never changes a result.
#pragma once
#include <cstdint>

namespace sluice {

struct SidePrefetch {
  static constexpr int kRanges = 2;
  const char* next[kRanges];
  int64_t left[kRanges];  // bytes still to prefetch from next[k]
};

inline thread_local SidePrefetch side_prefetch_queue{};

inline void side_prefetch_set(int k, const void* p, int64_t bytes) {
  side_prefetch_queue.next[k] = static_cast<const char*>(p);
  side_prefetch_queue.left[k] = bytes;
}

inline void side_prefetch_clear() {
  for (int k = 0; k < SidePrefetch::kRanges; ++k) side_prefetch_queue.left[k] = 0;
}

// One line of the first range with bytes left (into L2: read within the matmul's time).
inline void side_prefetch_step() {
  SidePrefetch& q = side_prefetch_queue;
  for (int k = 0; k < SidePrefetch::kRanges; ++k)
    if (q.left[k] > 0) {
      __builtin_prefetch(q.next[k], 0, 2);
      q.next[k] += 64;
      q.left[k] -= 64;
      return;
    }
}

}  // namespace sluice
