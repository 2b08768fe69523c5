#!/usr/bin/env bash
# Prints the CMake flags that build ggml's CPU backend for this CPU's instruction-set
# level, or for a lower one forced by SLUICE_CPU_ISA (generic, avx2, avx512), the same
# levels sluice's own kernels run at. Never -march=native (GGML_NATIVE=OFF): a native
# build on a shared home dies with an illegal instruction on another machine.
# (ggml can also build every variant and pick at run time, GGML_BACKEND_DL=ON with
# GGML_CPU_ALL_VARIANTS=ON, but that compiles its CPU backend about eight times: over an
# hour on 2 cores.)
set -euo pipefail
flags=$(grep -m1 '^flags' /proc/cpuinfo 2>/dev/null || true)
has() { [[ " $flags " == *" $1 "* ]]; }
level=generic
if has avx2 && has fma && has f16c; then level=avx2; fi
if [ "$level" = avx2 ] && has avx512f && has avx512bw && has avx512vl && has avx512dq \
   && has avx512_vnni; then level=avx512; fi
case "${SLUICE_CPU_ISA:-}" in
  generic) level=generic ;;
  avx2) [ "$level" = generic ] || level=avx2 ;;
esac
common="-DGGML_NATIVE=OFF"
# No GGML_AMX_INT8 on AMX CPUs: that build's llama-bench died with SIGILL at its first
# tile instruction on 2 cores of an AMX Xeon (this llama.cpp loads a tile configuration
# the compiler may not have written; llama.cpp PR #26954), so there llama.cpp runs its
# AVX-512 kernels.
case "$level" in
  avx512)
    out="$common -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=ON"
    out="$out -DGGML_AVX512_VNNI=ON"
    if has avx512_bf16; then out="$out -DGGML_AVX512_BF16=ON"; fi ;;
  avx2) out="$common -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON" ;;
  *) out="$common -DGGML_AVX=OFF -DGGML_AVX2=OFF -DGGML_BMI2=OFF -DGGML_FMA=OFF -DGGML_F16C=OFF" ;;
esac
echo "$out"
