// Bytes a thread will read soon, prefetched one cache line per weight row of the matmul
// it runs meanwhile. A decode step's LoRA adapter is read in short runs (0.5-25 KB of
// int8 A rows and B^T tiles a thread, each linear) that no cache holds after the base
// weights streamed past: started cold, they waited on the memory's latency and read at
// a fifth of the rate the weights stream at. Queued here before a linear, they arrive
// during its matmul instead, a line at a time, so the queue never stalls the weight
// loop on fill buffers (prefetching a layer's adapter in one burst did).
//
// The queue is the calling thread's own; the decode stack sets it before a matmul and
// clears it after, and the matmul kernels' weight-row loops (qb_rows_pass, q4_rows,
// q8_rows, q8f_rows) take one step per weight row. A prefetch never faults and never
// changes a result.
#pragma once
#include <cstdint>

namespace sluice {

// Two runs of bytes: the current one (next, left) and the one after it (then,
// then_left), so an empty queue costs its loop one compare of a register.
struct SidePrefetch {
  const char* next;
  int64_t left;  // bytes still to prefetch from next
  const char* then;
  int64_t then_left;
};

inline thread_local SidePrefetch side_prefetch_queue{};

// A queue of the two runs (a run of 0 bytes: none).
inline SidePrefetch side_prefetch_runs(const void* first, int64_t first_bytes, const void* second,
                                       int64_t second_bytes) {
  const bool one = first_bytes > 0;
  return {static_cast<const char*>(one ? first : second), one ? first_bytes : second_bytes,
          static_cast<const char*>(second), one ? second_bytes : 0};
}

// Queue the two runs, replacing what was queued.
inline void side_prefetch_set(const void* first, int64_t first_bytes, const void* second,
                              int64_t second_bytes) {
  side_prefetch_queue = side_prefetch_runs(first, first_bytes, second, second_bytes);
}

inline void side_prefetch_clear() { side_prefetch_queue = {}; }

// One line of the queue (into L2: read within the matmul's time).
// The loops step a copy, taken before they start and stored back after: in the shared
// library each reach for a thread_local is a call to __tls_get_addr, which GCC made
// again in every iteration for a reference taken outside the loop.
inline void side_prefetch_step(SidePrefetch& q) {
  if (__builtin_expect(q.left <= 0, 1)) return;
  __builtin_prefetch(q.next, 0, 2);
  q.next += 64;
  q.left -= 64;
  if (q.left <= 0) {
    q.next = q.then;
    q.left = q.then_left;
    q.then_left = 0;
  }
}

}  // namespace sluice
