/* The quantized matmuls of quant_kernels.h for CPUs with AVX-VNNI (the VEX-encoded `vpdpbusd`, e.g. Alder Lake
 * and later, Sapphire Rapids) but 256-bit vectors: 8 outputs per vector, a panel's 16 as two halves. Built with
 * -mavx2 -mfma -mf16c -mavxvnni; chosen only where cpuid reports AVX-VNNI.
 *
 * Built with -DVNNI_EVEX (and -mavx512vnni -mavx512vl -mprefer-vector-width=256 instead of -mavxvnni) it is the
 * stand-in a CPU with AVX-512 VNNI but no AVX-VNNI (AMD Zen 4, Ice Lake servers) runs where asked for avxvnni:
 * the same source and the same instruction, EVEX-encoded on the same ymm registers, no zmm register anywhere
 * (tests/test_cpu_quant.py reads the library's code), so these kernels are tested and measured on such a CPU. */
#define ISA avxvnni
#include "quant_vec256.h"

#ifdef VNNI_EVEX
#define DPBUSD(acc, w, x) _mm256_dpbusd_epi32(acc, w, x)
#else
#define DPBUSD(acc, w, x) _mm256_dpbusd_avx_epi32(acc, w, x)
#endif
#define DOT(acc, w, x) DPBUSD(acc, w, x)
#define DOT2(acc, w1, x1, w2, x2) DPBUSD(DPBUSD(acc, w1, x1), w2, x2)
#define DOTQ8(acc, w, x) DPBUSD(acc, w, x)
#define Q8_FIXUP 1 /* unsigned weights u = q + 128: the block's sum less 128 x the activations' sum */
#define Q8_GEMM_ROWS 12 /* Q8_0 from 12 rows through the GEMM's 4 x 2 tile (quant_kernels.h, USES_GEMM) */

#include "quant_kernels.h"
