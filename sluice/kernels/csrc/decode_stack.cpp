// A Llama-family decoder stack for a few rows (decode steps), all layers in one call.
//
// A 1-token step through the Python model makes about ten kernel calls per layer, each
// paying Python, ctypes and OpenMP fork/join costs that together were as large as the
// arithmetic (~5 ms of a ~10 ms step on 2 cores). Here every layer runs inside one
// parallel region: the matmuls and attention share their work out with orphaned
// `omp for` loops, and the small elementwise steps run on one thread between barriers.
//
// It calls the same kernels, in the same order and with the same roundings, as the
// eager model with its weights on our kernels (int4, int8, or GGUF blocks kept in
// qblock layouts, each linear in its own format; sluice/models/llama.py), so its output
// is bit-identical to that path (tests/test_decode_stack.py checks it).
//
// LoRA adapters (sluice/layers/lora.py): with a row-to-slot index, each adapted
// linear's output gets each row's adapter product (lora.h) right where the eager
// Linear adds it, so adapters keep the one-call path and its exactness.
//
// QK-norm (Qwen3 per head, OLMoE over the whole projections) and Mixture-of-Experts
// MLPs (sluice/models/moe.py: the router, its top k, each chosen expert's gate/up and
// down in one grouped qblock pass over the step's (row, expert) pairs, the weighted sum
// in expert order) run here too, with the eager layers' kernels and roundings; so do
// gpt-oss's parts (attention sinks, per-layer sliding windows, the output projection's,
// router's and experts' biases, routing by a softmax over the top k, the clamped
// SwiGLU), each a field or Shape member that is null or off in other models.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include <omp.h>

#include "decode_stack_fields.h"
#include "dtype.h"
#include "isa.h"
#include "fused_ops.h"
#include "lora.h"
#include "paged_attention.h"
#include "q4_matmul.h"
#include "q8_matmul.h"
#include "qblock.h"
#include "qblock_gemm_amx.h"
#include "qpanel.h"
#include "side_prefetch.h"

namespace {

// Per layer, kLayerFields pointers (decode_stack_fields.h lists them; the Python side
// fills them by name, sluice/kernels/decode_stack.py).
#define SLUICE_FIELD_ENUM(suffix, name) k##suffix,
enum Field { SLUICE_DECODE_STACK_FIELDS(SLUICE_FIELD_ENUM) kLayerFields };
#undef SLUICE_FIELD_ENUM

// linear() finds a linear's hbits, scale, min, super and format right after its packed
// weight.
#define SLUICE_LINEAR_FIELDS(p)                                                          \
  static_assert(k##p##Hbits == k##p##Packed + 1 && k##p##Scale == k##p##Packed + 2 &&    \
                    k##p##Min == k##p##Packed + 3 && k##p##Super == k##p##Packed + 4 &&  \
                    k##p##Format == k##p##Packed + 5,                                    \
                #p " fields");
SLUICE_LINEAR_FIELDS(Qkv)
SLUICE_LINEAR_FIELDS(O)
SLUICE_LINEAR_FIELDS(GateUp)
SLUICE_LINEAR_FIELDS(Down)
#undef SLUICE_LINEAR_FIELDS
// lora_begin() and lora_end() find a linear's B^T, slot ranks and int8 scales right
// after its A.
static_assert(kQkvLoraBt == kQkvLoraA + 1 && kOLoraBt == kOLoraA + 1 &&
                  kGateUpLoraBt == kGateUpLoraA + 1 && kDownLoraBt == kDownLoraA + 1 &&
                  kQkvLoraRanks == kQkvLoraA + 2 && kOLoraRanks == kOLoraA + 2 &&
                  kGateUpLoraRanks == kGateUpLoraA + 2 && kDownLoraRanks == kDownLoraA + 2 &&
                  kQkvLoraScale == kQkvLoraA + 3 && kOLoraScale == kOLoraA + 3 &&
                  kGateUpLoraScale == kGateUpLoraA + 3 && kDownLoraScale == kDownLoraA + 3,
              "LoRA fields");

// A linear's format field (decode_stack_fields.h): the int4 kernel, the per-channel
// int8 kernel, or qblock's bits * 100 + group, plus kFormatPanels for a weight stored
// in panel order (qpanel.h).
constexpr int64_t kFormatInt4 = 4, kFormatInt8 = 8, kFormatPanels = 10000;

#define SLUICE_FIELD_NAME(suffix, name) #name,
constexpr const char* kFieldNames[] = {SLUICE_DECODE_STACK_FIELDS(SLUICE_FIELD_NAME)};
#undef SLUICE_FIELD_NAME
static_assert(sizeof(kFieldNames) / sizeof(kFieldNames[0]) == kLayerFields, "field names");

// QK-norm: none, an RMSNorm of each q and k head (Qwen3), or of the whole q and whole k
// projections (OLMoE).
enum QkNorm { kNoQkNorm = 0, kQkNormPerHead = 1, kQkNormWhole = 2 };

struct Shape {
  int layers, hidden, heads, kv_heads, head_dim, inter, block_size;
  float eps, scale;
  bool kv_int8;  // the K/V pools are int8 rows (kv_int8.h), else the activations' type
  int qk_norm;   // QkNorm
  // Mixture-of-Experts layers (those with a router): experts, chosen per row, each
  // expert's intermediate size, whether the top k's weights are renormalized to sum 1.
  int experts, top_k, moe_inter;
  bool renormalize;
  // The k largest logits first, then a softmax over them (Granite-MoE, gpt-oss), in
  // place of a softmax over all experts then the top k.
  bool softmax_after_top_k;
  // The experts' activation: gpt-oss's clamped SwiGLU (fused_ops.h) where swiglu_limit
  // > 0, else SiLU(gate) * up.
  float swiglu_alpha, swiglu_limit;
  int lora_rank;  // the LoRA slots' rank per slice (0: no LoRA)
  // Each sublayer's output times this before it joins the residual stream, rounded to
  // the activations' type as the eager layer rounds it (Granite's residual_multiplier).
  float residual_scale;
  // Rows from which a qblock linear (and an expert, by its own rows) takes the int8 GEMM
  // (qblock_gemm.h) in place of the block kernel, as the eager layers do for a model
  // with int8 prompts (block_quant.GEMM_MIN_ROWS); 0: never.
  int gemm_min_rows;
  // That GEMM on AMX-INT8 tiles (qblock_gemm_amx.h: the same sums), as eager runs it at
  // the amx level.
  bool gemm_tiles;
};

struct Batch {
  int rows;                 // M tokens
  const int64_t* slots;     // [M] cache slot of each new token
  const int64_t* tables;    // [S, max_blocks]
  int64_t max_blocks;
  const int64_t* q_start;   // [S + 1]
  const int64_t* ctx_end;   // [S]
  int seqs;
  const int32_t* lora_slots;  // [M] each row's LoRA slot (-1: none); null: no adapter
  int32_t lora_block_slot;    // the slot where the adapter rows are one block, else -1
};

// The slot of a step's adapter rows where they form one block of the LoRA kernels (one
// slot, at most kLoraRows rows: a stream or two of one adapter), else -1.
int32_t lora_block_slot(const int32_t* lora_slots, int rows) {
  if (lora_slots == nullptr) return -1;
  int32_t slot = -1;
  int count = 0;
  for (int t = 0; t < rows; ++t) {
    if (lora_slots[t] < 0) continue;
    if (slot >= 0 && lora_slots[t] != slot) return -1;
    slot = lora_slots[t];
    ++count;
  }
  return count <= sluice::kLoraRows ? slot : -1;
}

template <typename T>
const T* at(const int64_t* layer, Field f) {
  return reinterpret_cast<const T*>(layer[f]);
}

// A linear's LoRA: its A and B^T fields, its output slices' first columns.
struct LoraLinear {
  Field a;
  std::vector<int32_t> offsets;
};

// Whether this step runs a linear's adapter slots (some row has an adapter and the
// linear has slots).
bool lora_on(const int64_t* L, const Batch& b, const LoraLinear& lin) {
  return b.lora_slots != nullptr && L[lin.a] != 0;
}

// A linear's int8 slots' scales (lora.h's `scale`); null where the slots hold the
// activations' type.
const float* lora_scale(const int64_t* L, const LoraLinear& lin) {
  return at<float>(L, Field(lin.a + 3));
}

// A linear's adapter work comes in two halves around its base matmul (every thread
// calls both): lora_begin's shrink of x [M, K] into u needs no barrier of its own, the
// matmul's closes it; lora_end adds each row's B u to y [M, N], a barrier after.
// No-ops where lora_on is false.
template <typename T>
void lora_begin(const Shape& s, const int64_t* L, const Batch& b, const LoraLinear& lin,
                const T* x, int M, int K, std::vector<float>& u) {
  if (!lora_on(L, b, lin)) return;
  const int n_slices = static_cast<int>(lin.offsets.size()) - 1;
  const int r_total = n_slices * s.lora_rank;
  const int32_t* ranks = at<int32_t>(L, Field(lin.a + 2));
  sluice::lora_shrink_stored(x, M, K, reinterpret_cast<const void*>(L[lin.a]),
                             lora_scale(L, lin), r_total, s.lora_rank, b.lora_slots, ranks,
                             u.data());
}

template <typename T>
void lora_end(const Shape& s, const int64_t* L, const Batch& b, const LoraLinear& lin, int M,
              const std::vector<float>& u, T* y) {
  if (!lora_on(L, b, lin)) return;
  const int n_slices = static_cast<int>(lin.offsets.size()) - 1;
  sluice::lora_expand_stored(u.data(), M, s.lora_rank, n_slices, lin.offsets.data(),
                             reinterpret_cast<const void*>(L[lin.a + 1]),
                             lora_scale(L, lin) != nullptr, lin.offsets.back(), b.lora_slots,
                             at<int32_t>(L, Field(lin.a + 2)), y);
}

// Before a linear's matmul, where the step's adapter rows are one block: queue this
// thread's run of the linear's B^T (its expand follows the matmul) and of the next
// adapted linear's A (`next` in the layer `next_L`, input width next_k: the next
// sublayer's shrink) for the matmul to prefetch (side_prefetch.h). A step of more
// blocks reads each adapter row once for several rows, and it is their arithmetic, not
// the reads, that it waits on.
template <typename T>
void lora_queue(const Shape& s, const Batch& b, const int64_t* L, const LoraLinear& lin,
                const int64_t* next_L, const LoraLinear* next, int next_k) {
  const int64_t slot = b.lora_block_slot;
  if (slot < 0) return;  // then no linear of this step queues anything
  sluice::LoraRun expand{nullptr, 0}, shrink{nullptr, 0};
  const int thread = omp_get_thread_num(), threads = omp_get_num_threads();
  if (lora_on(L, b, lin)) {
    const int n_slices = static_cast<int>(lin.offsets.size()) - 1;
    const int64_t tiles = sluice::lora_tiles(n_slices, lin.offsets.data());
    const int64_t tile_bytes = static_cast<int64_t>(s.lora_rank) * sluice::kLoraTile *
                               (lora_scale(L, lin) != nullptr ? 1 : sizeof(T));
    const char* bt = reinterpret_cast<const char*>(L[lin.a + 1]) + slot * tiles * tile_bytes;
    expand = sluice::lora_thread_run(bt, tiles, tile_bytes, thread, threads);
  }
  if (next != nullptr && lora_on(next_L, b, *next)) {
    const int64_t r_total = static_cast<int64_t>(next->offsets.size() - 1) * s.lora_rank;
    const int64_t row_bytes = next_k * (lora_scale(next_L, *next) != nullptr ? 1 : sizeof(T));
    const char* a = reinterpret_cast<const char*>(next_L[next->a]) + slot * r_total * row_bytes;
    shrink = sluice::lora_thread_run(a, r_total, row_bytes, thread, threads);
  }
  sluice::side_prefetch_set(expand.start, expand.bytes, shrink.start, shrink.bytes);
}

// The weight of the linear (or stacked experts) whose fields start at `packed`.
inline sluice::QbWeight qb_weight(const int64_t* L, Field packed) {
  return sluice::QbWeight{at<uint8_t>(L, packed), at<uint8_t>(L, Field(packed + 1)),
                          at<void>(L, Field(packed + 2)), at<void>(L, Field(packed + 3)),
                          at<uint16_t>(L, Field(packed + 4))};
}

// Whether a linear's format field names a qblock layout (not the int4 or int8 kernel).
inline bool is_qblock(int64_t format) { return format != kFormatInt4 && format != kFormatInt8; }

// Whether the weight at `packed` is in panel order (qpanel.h), and its qblock format
// (bits * 100 + group) without that mark.
inline bool on_panels(const int64_t* layer, Field packed) {
  return layer[packed + 5] >= kFormatPanels;
}
inline int64_t qblock_code(const int64_t* layer, Field packed) {
  return layer[packed + 5] % kFormatPanels;
}

// Whether the linear at `packed` takes the int8 GEMM for M rows, or the panel kernel
// (at every M): it then needs no xa.
inline bool on_gemm(const Shape& s, const int64_t* layer, Field packed, int M) {
  if (on_panels(layer, packed)) return true;
  return is_qblock(layer[packed + 5]) && s.gemm_min_rows > 0 && M >= s.gemm_min_rows;
}

// y [M, N] = x @ W.T for the linear whose fields start at `packed`, on the kernel its
// format names (that kernel's orphaned omp for, barrier at the end): from
// s.gemm_min_rows rows a qblock weight takes the int8 GEMM on x (which it quantizes
// itself into ga), else the block kernel on xa.
template <typename T>
void linear(const Shape& s, const int64_t* layer, Field packed,
            const sluice::QBlockActivations& xa, const T* x, sluice::GemmActivations& ga,
            int M, int K, int N, T* y) {
  const auto* q = at<uint8_t>(layer, packed);
  const int64_t format = layer[packed + 5];
  if (on_panels(layer, packed)) {
    const int64_t code = qblock_code(layer, packed);
    sluice::qpanel_matmul(x, M, K, static_cast<int>(code / 100), static_cast<int>(code % 100),
                          qb_weight(layer, packed), N, sluice::qb_out(y), ga);
  } else if (on_gemm(s, layer, packed, M))
    sluice::qblock_gemm_on(s.gemm_tiles, x, M, K, static_cast<int>(format / 100),
                           static_cast<int>(format % 100), qb_weight(layer, packed), N,
                           sluice::qb_out(y), ga);
  else if (format == kFormatInt4)
    sluice::q4_rows(xa, M, K, q, at<uint16_t>(layer, Field(packed + 2)),
                    at<uint16_t>(layer, Field(packed + 3)), N, y);
  else if (format == kFormatInt8)
    sluice::q8_rows(xa, M, K, q, at<float>(layer, Field(packed + 2)), N, y);
  else
    sluice::qblock_rows(xa, M, K, static_cast<int>(format / 100), static_cast<int>(format % 100),
                        sluice::QbWeight{q, at<uint8_t>(layer, Field(packed + 1)),
                                         at<void>(layer, Field(packed + 2)),
                                         at<void>(layer, Field(packed + 3)),
                                         at<uint16_t>(layer, Field(packed + 4))},
                        N, y);
}

// x [M, K] quantized as the linear at `packed` reads it (QBlockActivations::quantize):
// group 0 for the int4 and int8 kernels, else its qblock group, and one scale per 256
// values where its scales are integers.
template <typename T>
void quantize_for(sluice::QBlockActivations& xa, const int64_t* layer, Field packed, const T* x,
                  int M, int K) {
  const int64_t format = layer[packed + 5];
  const bool qblock = is_qblock(format);
  xa.quantize(x, M, K, qblock ? static_cast<int>(format % 100) : 0,
              qblock && layer[packed + 4] != 0);
}

// The QK-norm of M rows of qkv (row stride qkv_n), in place, as the eager layer's fused
// RMSNorm over contiguous copies computes it.
template <typename T>
void qk_norm(const Shape& s, const int64_t* L, T* qkv, int M, int qkv_n) {
  const T* qw = at<T>(L, kQNorm);
  const T* kw = at<T>(L, kKNorm);
  const int q_size = s.heads * s.head_dim;
  for (int r = 0; r < M; ++r) {
    T* q = qkv + static_cast<int64_t>(r) * qkv_n;
    if (s.qk_norm == kQkNormPerHead) {
      sluice::add_rms_norm<T>(nullptr, q, qw, q, s.heads, s.head_dim, s.eps);
      sluice::add_rms_norm<T>(nullptr, q + q_size, kw, q + q_size, s.kv_heads, s.head_dim, s.eps);
    } else {
      sluice::add_rms_norm<T>(nullptr, q, qw, q, 1, q_size, s.eps);
      sluice::add_rms_norm<T>(nullptr, q + q_size, kw, q + q_size, 1, s.kv_heads * s.head_dim,
                              s.eps);
    }
  }
}

// A linear's bias [n] (null: a no-op) added to M rows of y [M, n], each sum rounded to T
// as the eager Linear's `y + bias`.
template <typename T>
void add_bias(const T* bias, T* y, int M, int n) {
  if (bias == nullptr) return;
  for (int r = 0; r < M; ++r)
    for (int i = 0; i < n; ++i) {
      T* p = y + static_cast<int64_t>(r) * n + i;
      *p = sluice::round_to(p, sluice::to_float(*p) + sluice::to_float(bias[i]));
    }
}

// A Mixture-of-Experts step's scratch, sized for M rows.
template <typename T>
struct MoeScratch {
  std::vector<float> logits, weights, sums;
  std::vector<int64_t> ids, start, expert;
  std::vector<int> order;  // the (row, slot) pairs (row * k + slot) by expert, stably
  std::vector<T> xs, gate_up, act, y;
  int groups = 0;

  MoeScratch(const Shape& s, int M) {
    if (s.experts == 0) return;
    const size_t pairs = static_cast<size_t>(M) * s.top_k;
    logits.resize(static_cast<size_t>(M) * s.experts);
    weights.resize(pairs);
    ids.resize(pairs);
    order.resize(pairs);
    start.resize(s.experts + 1);
    expert.resize(s.experts);
    xs.resize(pairs * s.hidden);
    gate_up.resize(pairs * 2 * s.moe_inter);
    act.resize(pairs * s.moe_inter);
    y.resize(pairs * s.hidden);
    sums.resize(static_cast<size_t>(M) * s.hidden);
  }

  // Route (weights, ids), group the pairs by expert, count each expert's rows.
  void group(const Shape& s, int M, int64_t* tokens) {
    const int pairs = M * s.top_k;
    sluice::route_top_k(logits.data(), M, s.experts, s.top_k, s.renormalize,
                        s.softmax_after_top_k, weights.data(), ids.data());
    int n = 0;
    groups = 0;
    start[0] = 0;
    for (int e = 0; e < s.experts; ++e) {
      const int first = n;
      for (int p = 0; p < pairs; ++p)
        if (ids[p] == e) order[n++] = p;
      if (n == first) continue;
      tokens[e] += n - first;
      expert[groups++] = e;
      start[groups] = n;
    }
  }
};

// The experts of stacked weight `packed` over the grouped rows xa holds (K values each,
// N outputs per expert), into y; ends with a barrier.
template <typename T>
void experts(const Shape& s, const int64_t* L, Field packed, const sluice::QBlockActivations& xa,
             const T* x, sluice::GemmActivations& ga, const MoeScratch<T>& m, int K, int N,
             T* y) {
  const int64_t format = qblock_code(L, packed);
  const int bits = static_cast<int>(format / 100), group = static_cast<int>(format % 100);
  const sluice::QbWeight w = qb_weight(L, packed);
  if (on_panels(L, packed)) {  // every group on the panels, at any row count
    const int rows = static_cast<int>(m.start[m.groups]);
    sluice::gemm_quantize(x, rows, K, sluice::kQbSuper, group, sluice::qb_implied(bits),
                          w.m == nullptr, ga);
    sluice::qpanel_experts(ga, K, bits, group, w, N, m.groups, m.start.data(),
                           m.expert.data(), sluice::qb_out(y));
    return;
  }
  // An expert with as many rows as a linear takes the GEMM from does so, as eager's
  // experts do (sluice/layers/experts.py); the rest share the grouped kernel.
  const int many = s.gemm_min_rows;
  for (int j = 0; many > 0 && j < m.groups; ++j) {
    const int64_t r0 = m.start[j], rows = m.start[j + 1] - r0;
    if (rows >= many)
      sluice::qblock_gemm_on(s.gemm_tiles, x + r0 * K, static_cast<int>(rows), K, bits, group,
                             sluice::qblock_expert_weight(w, K, bits, group, m.expert[j] * N),
                             N, sluice::qb_out(y + r0 * N), ga);
  }
  sluice::qblock_experts(xa, K, bits, group, w, N, m.groups, m.start.data(), m.expert.data(), y,
                         /*skip_from=*/many);
#pragma omp barrier
}

// out [M, H] = each row's expert outputs y times their weights, summed in expert order,
// as the eager layer's `y * weight.to(T)` then `zeros.index_add_`: torch's index_add_
// sums a row's terms in fp32 in source order and rounds to T once (its scatter-add
// path), and each term is rounded to T first. The terms go through memory (m.y) before
// they are summed: -ffast-math would otherwise fuse product and sum into one FMA in fp32.
template <typename T>
void weighted_sum(int M, int H, int k, MoeScratch<T>& m, T* out) {
  const int pairs = M * k;
  for (int i = 0; i < pairs; ++i) {
    const float w = sluice::to_float(sluice::round_to(out, m.weights[m.order[i]]));
    T* yi = m.y.data() + static_cast<int64_t>(i) * H;
    for (int j = 0; j < H; ++j) yi[j] = sluice::round_to(yi, sluice::to_float(yi[j]) * w);
  }
  std::vector<float>& acc = m.sums;
  std::fill(acc.begin(), acc.end(), 0.f);
  for (int i = 0; i < pairs; ++i) {
    const T* yi = m.y.data() + static_cast<int64_t>(i) * H;
    float* a = acc.data() + static_cast<int64_t>(m.order[i] / k) * H;
    for (int j = 0; j < H; ++j) a[j] += sluice::to_float(yi[j]);
  }
  for (int64_t i = 0; i < static_cast<int64_t>(M) * H; ++i) out[i] = sluice::round_to(out, acc[i]);
}

// Each grouped row of y [rows, N] plus its expert's bias (bias [experts, N]; null: a
// no-op), rounded to T, as the eager experts' `y + bias[row_expert]`.
template <typename T>
void add_expert_bias(const MoeScratch<T>& m, const T* bias, int N, T* y) {
  for (int j = 0; bias != nullptr && j < m.groups; ++j)
    add_bias(bias + m.expert[j] * N, y + m.start[j] * N, static_cast<int>(m.start[j + 1] - m.start[j]),
             N);
}

// out [M, H] = the Mixture-of-Experts MLP of x [M, H] (every thread calls it), as
// sluice/models/moe.py's SparseMoE.forward.
template <typename T>
void moe(const Shape& s, const int64_t* L, int M, const T* x, T* out, MoeScratch<T>& m,
         sluice::QBlockActivations& xa, sluice::GemmActivations& ga) {
  const int H = s.hidden, I = s.moe_inter, k = s.top_k, pairs = M * k;
  sluice::router_logits(x, M, H, at<float>(L, kRouter), at<float>(L, kRouterBias), s.experts,
                        m.logits.data());
#pragma omp single
  {
    m.group(s, M, reinterpret_cast<int64_t*>(L[kExpertTokens]));
    for (int i = 0; i < pairs; ++i)
      std::memcpy(m.xs.data() + static_cast<int64_t>(i) * H,
                  x + static_cast<int64_t>(m.order[i] / k) * H, H * sizeof(T));
    if (!on_panels(L, kGateUpPacked)) quantize_for(xa, L, kGateUpPacked, m.xs.data(), pairs, H);
  }
  experts(s, L, kGateUpPacked, xa, m.xs.data(), ga, m, H, 2 * I, m.gate_up.data());
#pragma omp single
  {
    add_expert_bias(m, at<T>(L, kGateUpBias), 2 * I, m.gate_up.data());
    if (s.swiglu_limit > 0.f)
      sluice::clamped_swiglu(m.gate_up.data(), m.act.data(), pairs, I, s.swiglu_alpha,
                             s.swiglu_limit);
    else
      sluice::silu_and_mul(m.gate_up.data(), m.act.data(), pairs, I);
    if (!on_panels(L, kDownPacked)) quantize_for(xa, L, kDownPacked, m.act.data(), pairs, I);
  }
  experts(s, L, kDownPacked, xa, m.act.data(), ga, m, I, H, m.y.data());
#pragma omp single
  {
    add_expert_bias(m, at<T>(L, kDownBias), H, m.y.data());
    weighted_sum(M, H, k, m, out);
  }
}

// This step's new K/V rows (token stride `stride`) into layer L's pools.
template <typename T>
void write_kv(const Shape& s, const int64_t* L, const Batch& b, const T* k, const T* v,
              int64_t stride, int rows) {
  void* kc = reinterpret_cast<void*>(L[kKCache]);
  void* vc = reinterpret_cast<void*>(L[kVCache]);
  if (s.kv_int8)
    sluice::write_kv_int8(k, v, stride, static_cast<sluice::kv8*>(kc),
                          static_cast<sluice::kv8*>(vc), b.slots, rows, s.kv_heads,
                          s.block_size, s.head_dim);
  else
    sluice::write_kv(k, v, stride, kc, vc, b.slots, rows, s.kv_heads, s.block_size, s.head_dim,
                     sizeof(T));
}

// A sublayer's output h [n values] times the Shape's residual_scale (nothing at 1).
template <typename T>
void scale_residual(const Shape& s, T* h, int64_t n) {
  if (s.residual_scale == 1.f) return;
  for (int64_t i = 0; i < n; ++i)
    h[i] = sluice::round_to(h, sluice::to_float(h[i]) * s.residual_scale);
}

template <typename T>
void run(const Shape& s, const int64_t* fields, const Batch& b, T* h, const T* cos,
         const T* sin) {
  const int M = b.rows, H = s.hidden;
  const int q_size = s.heads * s.head_dim, kv_size = s.kv_heads * s.head_dim;
  const int qkv_n = q_size + 2 * kv_size;
  std::vector<T> residual(static_cast<size_t>(M) * H), x(residual.size());
  std::vector<T> qkv(static_cast<size_t>(M) * qkv_n), attn(static_cast<size_t>(M) * q_size);
  std::vector<T> gate_up(static_cast<size_t>(M) * 2 * s.inter), act(static_cast<size_t>(M) * s.inter);
  sluice::QBlockActivations xa;
  sluice::GemmActivations ga;  // the int8 GEMM's rows (Shape::gemm_min_rows)
  MoeScratch<T> moe_scratch(s, M);
  const LoraLinear lora_qkv{kQkvLoraA, {0, q_size, q_size + kv_size, qkv_n}};
  const LoraLinear lora_o{kOLoraA, {0, H}};
  const LoraLinear lora_gate_up{kGateUpLoraA, {0, s.inter, 2 * s.inter}};
  const LoraLinear lora_down{kDownLoraA, {0, H}};
  std::vector<float> lora_u(b.lora_slots ? static_cast<size_t>(M) * 3 * s.lora_rank : 0);
#pragma omp parallel
  for (int l = 0; l < s.layers; ++l) {
    const int64_t* L = fields + static_cast<int64_t>(l) * kLayerFields;
#pragma omp single
    {
      if (l == 0) {  // the embeddings are the residual stream's start
        std::memcpy(residual.data(), h, residual.size() * sizeof(T));
        sluice::add_rms_norm<T>(nullptr, residual.data(), at<T>(L, kInputNorm), x.data(), M, H,
                                s.eps);
      } else {
        scale_residual(s, h, static_cast<int64_t>(M) * H);  // the last layer's MLP output
        sluice::add_rms_norm<T>(h, residual.data(), at<T>(L, kInputNorm), x.data(), M, H, s.eps);
      }
      if (!on_gemm(s, L, kQkvPacked, M)) quantize_for(xa, L, kQkvPacked, x.data(), M, H);
    }
    lora_begin(s, L, b, lora_qkv, x.data(), M, H, lora_u);
    lora_queue<T>(s, b, L, lora_qkv, L, &lora_o, q_size);
    linear(s, L, kQkvPacked, xa, x.data(), ga, M, H, qkv_n, qkv.data());
    const bool qkv_lora = lora_on(L, b, lora_qkv);
    if (qkv_lora) {
      // The bias first, as the eager Linear adds it (a pass of its own: folded into the
      // expand's loop, -ffast-math may add bias and product first in fp32). Without a
      // bias, no pass: the matmul's barrier is the expand's start.
      if (L[kQkvBias] != 0) {
#pragma omp single
        add_bias(at<T>(L, kQkvBias), qkv.data(), M, qkv_n);
      }
      lora_end(s, L, b, lora_qkv, M, lora_u, qkv.data());
    }
#pragma omp single
    {
      if (!qkv_lora) add_bias(at<T>(L, kQkvBias), qkv.data(), M, qkv_n);
      if (s.qk_norm != kNoQkNorm) qk_norm(s, L, qkv.data(), M, qkv_n);
      // q and k heads rotate together; then k and v go to the cache before attention.
      sluice::rotary(qkv.data(), M, qkv_n, s.heads + s.kv_heads, s.head_dim, cos, sin);
      write_kv<T>(s, L, b, qkv.data() + q_size, qkv.data() + q_size + kv_size, qkv_n, M);
    }
    if (s.kv_int8)
      sluice::attend_tasks(qkv.data(), at<sluice::kv8>(L, kKCache), at<sluice::kv8>(L, kVCache),
                           b.tables, b.max_blocks, b.q_start, b.ctx_end, attn.data(), b.seqs,
                           s.heads, s.kv_heads, s.head_dim, s.block_size, s.scale,
                           static_cast<int64_t>(qkv_n), L[kWindow], at<float>(L, kSinks));
    else
      sluice::attend_tasks(qkv.data(), at<T>(L, kKCache), at<T>(L, kVCache), b.tables,
                           b.max_blocks, b.q_start, b.ctx_end, attn.data(), b.seqs, s.heads,
                           s.kv_heads, s.head_dim, s.block_size, s.scale,
                           static_cast<int64_t>(qkv_n), L[kWindow], at<float>(L, kSinks));
#pragma omp single
    if (!on_gemm(s, L, kOPacked, M)) quantize_for(xa, L, kOPacked, attn.data(), M, q_size);
    lora_begin(s, L, b, lora_o, attn.data(), M, q_size, lora_u);
    lora_queue<T>(s, b, L, lora_o, L, &lora_gate_up, H);
    linear(s, L, kOPacked, xa, attn.data(), ga, M, q_size, H, h);
    if (L[kOBias] != 0) {  // the bias before the adapter, as the eager Linear adds them
#pragma omp single
      add_bias(at<T>(L, kOBias), h, M, H);
    }
    lora_end(s, L, b, lora_o, M, lora_u, h);
    const bool sparse = L[kRouter] != 0;  // a Mixture-of-Experts layer
#pragma omp single
    {
      scale_residual(s, h, static_cast<int64_t>(M) * H);  // the attention's output
      sluice::add_rms_norm<T>(h, residual.data(), at<T>(L, kPostNorm), x.data(), M, H, s.eps);
      if (!sparse && !on_gemm(s, L, kGateUpPacked, M))
        quantize_for(xa, L, kGateUpPacked, x.data(), M, H);
    }
    if (sparse) {
      moe(s, L, M, x.data(), h, moe_scratch, xa, ga);
      continue;
    }
    lora_begin(s, L, b, lora_gate_up, x.data(), M, H, lora_u);
    lora_queue<T>(s, b, L, lora_gate_up, L, &lora_down, s.inter);
    linear(s, L, kGateUpPacked, xa, x.data(), ga, M, H, 2 * s.inter, gate_up.data());
    lora_end(s, L, b, lora_gate_up, M, lora_u, gate_up.data());
#pragma omp single
    {
      sluice::silu_and_mul(gate_up.data(), act.data(), M, s.inter);
      if (!on_gemm(s, L, kDownPacked, M)) quantize_for(xa, L, kDownPacked, act.data(), M, s.inter);
    }
    lora_begin(s, L, b, lora_down, act.data(), M, s.inter, lora_u);
    const bool last = l + 1 == s.layers;
    lora_queue<T>(s, b, L, lora_down, L + kLayerFields, last ? nullptr : &lora_qkv, H);
    linear(s, L, kDownPacked, xa, act.data(), ga, M, s.inter, H, h);
    sluice::side_prefetch_clear();  // nothing after the stack may fetch what is left
    lora_end(s, L, b, lora_down, M, lora_u, h);
  }
  // The model's output is the last layer's MLP output plus the residual stream.
  scale_residual(s, h, static_cast<int64_t>(M) * H);
  for (int64_t i = 0; i < static_cast<int64_t>(M) * H; ++i)
    h[i] = sluice::round_to(h, sluice::to_float(h[i]) + sluice::to_float(residual[i]));
}

}  // namespace

extern "C" {

int sluice_decode_stack_fields() { return kLayerFields; }

// The name of field i of a layer's row (decode_stack_fields.h); null past the end.
const char* sluice_decode_stack_field(int i) {
  return i >= 0 && i < kLayerFields ? kFieldNames[i] : nullptr;
}

// h [rows, hidden]: the embeddings in, the stack's output (before the final norm) out.
// cos/sin [rows, head_dim / 2]; slots, tables, q_start, ctx_end as for the paged kernel;
// kv_int8: the layers' K/V pools are int8 rows (kv_int8.h). qk_norm: QkNorm; experts,
// top_k, moe_inter, renormalize: the Mixture-of-Experts layers' routing and sizes (0
// experts in a dense model). lora_slots [rows] int32: each row's LoRA slot (-1: none),
// null where no row has an adapter; lora_rank: the slots' rank per slice.
// residual_scale: each sublayer's output factor (Shape's; 1 for all but Granite).
// gemm_min_rows: rows from which qblock linears and experts take the int8 GEMM (0: never);
// gemm_tiles: that GEMM on AMX-INT8 tiles (the caller holds the tile state).
// softmax_after_top_k: the routing's order (Shape's); swiglu_alpha, swiglu_limit: the
// experts' clamped SwiGLU where the limit is > 0 (gpt-oss), else SiLU.
void sluice_decode_stack(int bf16, const int64_t* fields, int layers, int hidden, int heads,
                         int kv_heads, int head_dim, int inter, int block_size, float eps,
                         float scale, void* h, const void* cos, const void* sin, int rows,
                         const int64_t* slots, const int64_t* tables, int64_t max_blocks,
                         const int64_t* q_start, const int64_t* ctx_end, int seqs,
                         int kv_int8, int qk_norm, int experts, int top_k, int moe_inter,
                         int renormalize, const int32_t* lora_slots, int lora_rank,
                         float residual_scale, int gemm_min_rows, int gemm_tiles,
                         int softmax_after_top_k, float swiglu_alpha, float swiglu_limit) {
  const Shape s{layers, hidden,     heads, kv_heads, head_dim,         inter,
                block_size, eps,    scale, kv_int8 != 0, qk_norm,   experts,
                top_k,  moe_inter, renormalize != 0, softmax_after_top_k != 0,
                swiglu_alpha, swiglu_limit, lora_rank, residual_scale,
                gemm_min_rows, gemm_tiles != 0};
  const Batch b{rows,  slots, tables,     max_blocks,
                q_start, ctx_end, seqs, lora_slots, lora_block_slot(lora_slots, rows)};
  if (bf16)
    run(s, fields, b, static_cast<uint16_t*>(h), static_cast<const uint16_t*>(cos),
        static_cast<const uint16_t*>(sin));
  else
    run(s, fields, b, static_cast<float*>(h), static_cast<const float*>(cos),
        static_cast<const float*>(sin));
}
}
