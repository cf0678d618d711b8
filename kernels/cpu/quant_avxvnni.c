/* The quantized matmuls of quant_kernels.h for CPUs with AVX-VNNI (the VEX-encoded `vpdpbusd`, e.g. Alder Lake
 * and later, Sapphire Rapids) but 256-bit vectors: 8 outputs per vector, a panel's 16 as two halves. Built with
 * -mavx2 -mfma -mf16c -mavxvnni; chosen only where cpuid reports AVX-VNNI. */
#define ISA avxvnni
#include "quant_vec256.h"

#define DOT(acc, w, x) _mm256_dpbusd_avx_epi32(acc, w, x)
#define DOT2(acc, w1, x1, w2, x2) _mm256_dpbusd_avx_epi32(_mm256_dpbusd_avx_epi32(acc, w1, x1), w2, x2)
#define DOTQ8(acc, w, x) _mm256_dpbusd_avx_epi32(acc, w, x)
#define Q8_FIXUP 1 /* unsigned weights u = q + 128: the block's sum less 128 x the activations' sum */

#include "quant_kernels.h"
