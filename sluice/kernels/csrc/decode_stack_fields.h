// The per-layer pointer table of sluice_decode_stack, defined once.
//
// Each layer passes one int64 per field, in this order. The C++ enum below and the
// names the library reports (sluice_decode_stack_field) both come from this list, and
// the Python side (sluice/kernels/decode_stack.py) orders each layer's name -> pointer
// mapping by those names, so adding, removing or moving a field here is the whole
// change: a name Python does not fill, or fills without the library knowing it, is an
// error there instead of a silently shifted table.
//
// A linear is (packed, scale, min): int4 blocks with fp16 scales and minimums, or int8
// offset bytes with fp32 channel scales (min unused, null). The QKV bias may be null.
#pragma once

// X(enum suffix, field name)
#define SLUICE_DECODE_STACK_FIELDS(X) \
  X(InputNorm, input_norm)            \
  X(QkvPacked, qkv_packed)            \
  X(QkvScale, qkv_scale)              \
  X(QkvMin, qkv_min)                  \
  X(QkvBias, qkv_bias)                \
  X(OPacked, o_packed)                \
  X(OScale, o_scale)                  \
  X(OMin, o_min)                      \
  X(PostNorm, post_norm)              \
  X(GateUpPacked, gate_up_packed)     \
  X(GateUpScale, gate_up_scale)       \
  X(GateUpMin, gate_up_min)           \
  X(DownPacked, down_packed)          \
  X(DownScale, down_scale)            \
  X(DownMin, down_min)                \
  X(KCache, k_cache)                  \
  X(VCache, v_cache)
