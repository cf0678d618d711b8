/* 256-bit vector primitives and activation quantization shared by quant_avx2.c and quant_avxvnni.c (which
 * define ISA, the integer dot products DOT, DOT2, DOTQ8 and Q8_FIXUP, then include this and quant_kernels.h). */
#include <immintrin.h>
#include <stdint.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#define LANES 8
#define VBYTES 32
typedef __m256i VI;
typedef __m256 VF;

#define LOADB(p) _mm256_loadu_si256((const __m256i *)(p))
#define STOREB(p, v) _mm256_storeu_si256((__m256i *)(p), v)
#define LOADF(p) _mm256_loadu_ps(p)
#define ANDB(a, b) _mm256_and_si256(a, b)
#define ORB(a, b) _mm256_or_si256(a, b)
#define SRL16(a, n) _mm256_srli_epi16(a, n)
#define SLL16(a, n) _mm256_slli_epi16(a, n)
#define SET1B(c) _mm256_set1_epi8((char)(c))
#define SET1I(v) _mm256_set1_epi32(v)
#define ZEROI() _mm256_setzero_si256()
#define SUBI(a, b) _mm256_sub_epi32(a, b)
#define CVT(a) _mm256_cvtepi32_ps(a)
#define FMA(a, b, c) _mm256_fmadd_ps(a, b, c)
#define FNMA(a, b, c) _mm256_fnmadd_ps(a, b, c)
#define MUL(a, b) _mm256_mul_ps(a, b)
#define SET1F(v) _mm256_set1_ps(v)
#define ZEROF() _mm256_setzero_ps()
#define STOREF(p, v) _mm256_storeu_ps(p, v)
#define LOADH(p) _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p)))
#define LOADU8F(p) _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(p))))
#define LOADI8F(p) _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(p))))
/* float32 mode: chunk C = outputs 2C, 2C+1 x 4 inputs */
#define CHUNKF(w, C) _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_set1_epi64x(_mm256_extract_epi64(w, C))))
#define DUP(v, C) _mm256_permutevar8x32_ps(v, _mm256_setr_epi32(2 * (C), 2 * (C), 2 * (C), 2 * (C),               \
                                                                2 * (C) + 1, 2 * (C) + 1, 2 * (C) + 1, 2 * (C) + 1))
#define XPAT(p) _mm256_broadcast_ps((const __m128 *)(p))
/* decode attention (quant_attention.h): bf16 -> float, sums, max, and the parts of its exp */
#define LOADBF(p) \
    _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(p))), 16))
#define ADDF(a, b) _mm256_add_ps(a, b)
#define SUBF(a, b) _mm256_sub_ps(a, b)
#define MAXF(a, b) _mm256_max_ps(a, b)
#define MINF(a, b) _mm256_min_ps(a, b)
#define DIVF(a, b) _mm256_div_ps(a, b)
static inline float hsumf(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
static inline float hmaxf(__m256 v) {
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_max_ss(s, _mm_movehdup_ps(s)));
}
#define ROUNDF(v) _mm256_round_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)
/* 2^n for a whole n in float (exponent bits) */
#define POW2F(n) \
    _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23))
#define VMAX_I8(t) ((t) <= 2 ? 2 : 1)
#define TMAX_F32 2

static inline int32_t hsum8(__m256i v) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
    return _mm_cvtsi128_si32(s);
}

/* One block of 32 activations -> int8 q, scale d = amax / 127, and the sums of each half (llama.cpp's packing). */
static inline void QUANT_BLOCK(const float *x, int8_t *q, float *d, int32_t *s0, int32_t *s1) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    __m256 v0 = _mm256_loadu_ps(x), v1 = _mm256_loadu_ps(x + 8), v2 = _mm256_loadu_ps(x + 16),
           v3 = _mm256_loadu_ps(x + 24);
    __m256 m = _mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sign, v0), _mm256_andnot_ps(sign, v1)),
                             _mm256_max_ps(_mm256_andnot_ps(sign, v2), _mm256_andnot_ps(sign, v3)));
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    h = _mm_max_ss(h, _mm_movehdup_ps(h));
    const float amax = _mm_cvtss_f32(h);
    const float dd = amax / 127.0f, id = dd != 0.0f ? 1.0f / dd : 0.0f;
    const __m256 mul = _mm256_set1_ps(id);
    const __m256i i0 = _mm256_cvtps_epi32(_mm256_mul_ps(v0, mul)), i1 = _mm256_cvtps_epi32(_mm256_mul_ps(v1, mul)),
                  i2 = _mm256_cvtps_epi32(_mm256_mul_ps(v2, mul)), i3 = _mm256_cvtps_epi32(_mm256_mul_ps(v3, mul));
    *s0 = hsum8(_mm256_add_epi32(i0, i1));
    *s1 = hsum8(_mm256_add_epi32(i2, i3));
    __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(i0, i1), _mm256_packs_epi32(i2, i3));
    p = _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    _mm256_storeu_si256((__m256i *)q, p);
    *d = dd;
}

