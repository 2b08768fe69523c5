// The per-layer pointer table of sluice_decode_stack, defined once.
//
// Each layer passes one int64 per field, in this order. The C++ enum below and the
// names the library reports (sluice_decode_stack_field) both come from this list, and
// the Python side (sluice/kernels/decode_stack.py) orders each layer's name -> pointer
// mapping by those names, so adding, removing or moving a field here is the whole
// change: a name Python does not fill, or fills without the library knowing it, is an
// error there instead of a silently shifted table.
//
// A linear is (packed, hbits, scale, min, super, format), format saying which kernel
// reads it:
//   4: the int4 kernel (q4_matmul.h): fp16 scales and minimums per 32, hbits null;
//   8: the per-channel int8 kernel (q8_matmul.h): fp32 channel scales, hbits and min null;
//   bits * 100 + group (432, 416, 532, 516, 632, 616, 832, 816): the qblock kernel
//      (qblock.h), hbits null unless bits is 5 or 6, min null for a symmetric weight,
//      super (integer scales' fp16 multipliers) null for fp16 scales.
// super is null for the int4 and int8 kernels.
// The format is an integer stored in the table, not a pointer. GGUF files mix formats
// per linear (Q4_K_M: Q6_K ffn_down in some layers), so each linear carries its own.
// The QKV bias may be null; so are the QK-norm weights (q_norm, k_norm) of a model
// without one (the stack's qk_norm argument says which shape they have).
// A Mixture-of-Experts layer has a router (fp32 [experts, hidden]; null in a dense
// layer) and its gate_up and down fields hold every expert's stacked weight (qblock
// formats only: expert e is rows e * 2 * inter .. and e * hidden ..), expert_tokens an
// int64 [experts] counter of the rows each expert has been given (it is added to).
// gpt-oss's parts, null (0) in every other model: sinks, each head's sink logit (fp32
// [heads]); window, the layer's sliding window in tokens (an integer; 0: none; Mistral's
// too); o_bias, the output projection's bias (activations' type [hidden]); router_bias
// (fp32 [experts]); gate_up_bias and down_bias, every expert's biases (activations' type,
// [experts, 2 * moe_inter] gate then up, and [experts, hidden]).
// Each linear's LoRA slots (lora.h: A [slots, slices * rank, in], B^T [slots, rank,
// out], the activations' type, or int8 where the scale field, fp32 [slots, slices *
// rank], is not null; each slot's rank here, int32 [slots]) are null where LoRA is
// off or the linear is not adapted.
#pragma once

// X(enum suffix, field name)
#define SLUICE_DECODE_STACK_FIELDS(X) \
  X(InputNorm, input_norm)            \
  X(QkvPacked, qkv_packed)            \
  X(QkvHbits, qkv_hbits)              \
  X(QkvScale, qkv_scale)              \
  X(QkvMin, qkv_min)                  \
  X(QkvSuper, qkv_super)              \
  X(QkvFormat, qkv_format)            \
  X(QkvBias, qkv_bias)                \
  X(QNorm, q_norm)                    \
  X(KNorm, k_norm)                    \
  X(Sinks, sinks)                     \
  X(Window, window)                   \
  X(OPacked, o_packed)                \
  X(OHbits, o_hbits)                  \
  X(OScale, o_scale)                  \
  X(OMin, o_min)                      \
  X(OSuper, o_super)                  \
  X(OFormat, o_format)                \
  X(OBias, o_bias)                    \
  X(PostNorm, post_norm)              \
  X(Router, router)                   \
  X(ExpertTokens, expert_tokens)      \
  X(RouterBias, router_bias)          \
  X(GateUpBias, gate_up_bias)         \
  X(DownBias, down_bias)              \
  X(GateUpPacked, gate_up_packed)     \
  X(GateUpHbits, gate_up_hbits)       \
  X(GateUpScale, gate_up_scale)       \
  X(GateUpMin, gate_up_min)           \
  X(GateUpSuper, gate_up_super)       \
  X(GateUpFormat, gate_up_format)     \
  X(DownPacked, down_packed)          \
  X(DownHbits, down_hbits)            \
  X(DownScale, down_scale)            \
  X(DownMin, down_min)                \
  X(DownSuper, down_super)            \
  X(DownFormat, down_format)          \
  X(KCache, k_cache)                  \
  X(VCache, v_cache)                  \
  X(QkvLoraA, qkv_lora_a)             \
  X(QkvLoraBt, qkv_lora_bt)           \
  X(QkvLoraRanks, qkv_lora_ranks)     \
  X(QkvLoraScale, qkv_lora_scale)     \
  X(OLoraA, o_lora_a)                 \
  X(OLoraBt, o_lora_bt)               \
  X(OLoraRanks, o_lora_ranks)         \
  X(OLoraScale, o_lora_scale)         \
  X(GateUpLoraA, gate_up_lora_a)      \
  X(GateUpLoraBt, gate_up_lora_bt)    \
  X(GateUpLoraRanks, gate_up_lora_ranks)\
  X(GateUpLoraScale, gate_up_lora_scale)\
  X(DownLoraA, down_lora_a)           \
  X(DownLoraBt, down_lora_bt)         \
  X(DownLoraRanks, down_lora_ranks)   \
  X(DownLoraScale, down_lora_scale)
