/* 512-bit vector primitives and activation quantization shared by quant_avx512vnni.c and quant_amx.c (AVX-512
 * F/BW/VL/DQ + VNNI: 16 outputs per vector, `vpdpbusd`). */
#ifndef QUANT_VEC512_H
#define QUANT_VEC512_H
#include <immintrin.h>
#include <stdint.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#define LANES 16
#define VBYTES 64
typedef __m512i VI;
typedef __m512 VF;

#define LOADB(p) _mm512_loadu_si512((const void *)(p))
#define STOREB(p, v) _mm512_storeu_si512((void *)(p), v)
#define LOADF(p) _mm512_loadu_ps(p)
#define ANDB(a, b) _mm512_and_si512(a, b)
#define ORB(a, b) _mm512_or_si512(a, b)
#define SRL16(a, n) _mm512_srli_epi16(a, n)
#define SLL16(a, n) _mm512_slli_epi16(a, n)
#define SET1B(c) _mm512_set1_epi8((char)(c))
#define SET1I(v) _mm512_set1_epi32(v)
#define ZEROI() _mm512_setzero_si512()
#define SUBI(a, b) _mm512_sub_epi32(a, b)
#define DOT(acc, w, x) _mm512_dpbusd_epi32(acc, w, x)
#define DOT2(acc, w1, x1, w2, x2) _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(acc, w1, x1), w2, x2)
#define DOTQ8(acc, w, x) _mm512_dpbusd_epi32(acc, w, x)
#define Q8_FIXUP 1
#define CVT(a) _mm512_cvtepi32_ps(a)
#define FMA(a, b, c) _mm512_fmadd_ps(a, b, c)
#define FNMA(a, b, c) _mm512_fnmadd_ps(a, b, c)
#define MUL(a, b) _mm512_mul_ps(a, b)
#define SET1F(v) _mm512_set1_ps(v)
#define ZEROF() _mm512_setzero_ps()
#define STOREF(p, v) _mm512_storeu_ps(p, v)
/* decode attention (quant_attention.h): bf16 -> float, sums, max, and the parts of its exp */
#define LOADBF(p) \
    _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(p))), 16))
#define ADDF(a, b) _mm512_add_ps(a, b)
#define SUBF(a, b) _mm512_sub_ps(a, b)
#define MAXF(a, b) _mm512_max_ps(a, b)
#define MINF(a, b) _mm512_min_ps(a, b)
#define DIVF(a, b) _mm512_div_ps(a, b)
static inline float hsumf(__m512 v) { return _mm512_reduce_add_ps(v); }
static inline float hmaxf(__m512 v) { return _mm512_reduce_max_ps(v); }
#define ROUNDF(v) _mm512_roundscale_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)
/* 2^n for a whole n in float (exponent bits) */
#define POW2F(n) \
    _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23))
#define LOADH(p) _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(p)))
#define LOADU8F(p) _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(p))))
#define LOADI8F(p) _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(p))))
/* float32 mode: chunk C = outputs 4C..4C+3 x 4 inputs */
#define CHUNKF(w, C) _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm512_extracti32x4_epi32(w, C)))
#define DUP(v, C) _mm512_permutexvar_ps(_mm512_set_epi32(4 * (C) + 3, 4 * (C) + 3, 4 * (C) + 3, 4 * (C) + 3,      \
                                                         4 * (C) + 2, 4 * (C) + 2, 4 * (C) + 2, 4 * (C) + 2,      \
                                                         4 * (C) + 1, 4 * (C) + 1, 4 * (C) + 1, 4 * (C) + 1,      \
                                                         4 * (C), 4 * (C), 4 * (C), 4 * (C)), v)
#define XPAT(p) _mm512_broadcast_f32x4(_mm_loadu_ps(p))
/* vector columns per int8 tile of t rows: one panel at 1 row, one stream that quant_kernels.h's fetches run ahead of
 * (four panels at once, the hardware's streams alone: the 1B's 1-row step 0.82x; fetching all four did no better) */
#define VMAX_I8(t) ((t) == 1 ? 1 : (t) == 2 ? 4 : 2)
#define TMAX_F32 4

/* One block of 32 activations -> int8 q, scale d = amax / 127, and the sums of each half. */
static inline void QUANT_BLOCK(const float *x, int8_t *q, float *d, int32_t *s0, int32_t *s1) {
    const __m512 a = _mm512_loadu_ps(x), b = _mm512_loadu_ps(x + 16);
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
    const float dd = amax / 127.0f, id = dd != 0.0f ? 1.0f / dd : 0.0f;
    const __m512i qa = _mm512_cvtps_epi32(_mm512_mul_ps(a, _mm512_set1_ps(id)));
    const __m512i qb = _mm512_cvtps_epi32(_mm512_mul_ps(b, _mm512_set1_ps(id)));
    _mm_storeu_si128((__m128i *)q, _mm512_cvtsepi32_epi8(qa));
    _mm_storeu_si128((__m128i *)(q + 16), _mm512_cvtsepi32_epi8(qb));
    *d = dd;
    *s0 = _mm512_reduce_add_epi32(qa);
    *s1 = _mm512_reduce_add_epi32(qb);
}

#endif
