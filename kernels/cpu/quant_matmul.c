/* Quantized-weight matmuls for x86 CPUs with AVX2 and FMA, where torch's int4/int8 weight ops have no vectorised
 * kernel (on an AVX2 EPYC they took 8.0 and 5.0 ms for a 3072 x 576 matrix at one row, fp32 0.24 ms).
 *
 * y[r, n] = sum_k x[r, k] * w[n, k]; the activations stay fp32 and each weight block is widened to fp32 in
 * registers, then multiplied into every activation row of the tile, so no full-precision copy of a matrix exists:
 *   int4: a block of 32 is {float d; float m; uint8 qs[16]}, w = d * q + m, q in 0..15; byte j holds element j in
 *         its low nibble and element j + 16 in its high one (GGUF's Q4 layout; Q4_0 is m = -8 d).
 *   int8: w = scale[n] * q, q int8, one scale per output row.
 * Activations quantized to int8 as well (llama.cpp's Q8_1 scheme, maddubs dot products) were tried first: about
 * as fast at one row, but SmolLM2's top-1 agreement with the fp32 path fell from 99.2% to 97.5% over 520
 * teacher-forced tokens, so the activations stay fp32.
 *
 * Output rows are split among OpenMP threads (torch's libgomp, already loaded: one thread pool). A thread widens a
 * weight block once per tile of up to 8 activation rows (against 4: 10-12% faster at 8 and 16 rows, the same at 1).
 * Built by kernels/cpu_quant.py with cc -O3 -mavx2 -mfma.
 */
#include <immintrin.h>
#include <stdint.h>

#define QK 32

typedef struct {
    float d;
    float m;
    uint8_t qs[QK / 2];
} block_q4; /* 24 bytes */

static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* The 32 weights of int4 block b, widened: w[0..3] hold elements 0-7, 8-15, 16-23, 24-31. */
static inline void widen_q4(const block_q4 *blk, __m256 w[4]) {
    const __m128i packed = _mm_loadu_si128((const __m128i *)blk->qs);
    const __m128i low = _mm_set1_epi8(0x0F);
    const __m128i lo = _mm_and_si128(packed, low);
    const __m128i hi = _mm_and_si128(_mm_srli_epi16(packed, 4), low);
    const __m256 d = _mm256_set1_ps(blk->d), m = _mm256_set1_ps(blk->m);
    w[0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo)), d, m);
    w[1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8))), d, m);
    w[2] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi)), d, m);
    w[3] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8))), d, m);
}

static inline void widen_q8(const int8_t *q, __m256 w[4]) {
    for (int i = 0; i < 4; i++)
        w[i] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(q + 8 * i))));
}

/* T activation rows (x, stride k) against one weight row. Two accumulators per row hide the FMA latency; every tile
 * size sums a row in the same order, so a row's result does not depend on the batch it came in (tested). */
#define A 2
#define DOT_TILE(NAME, T, WIDEN)                                                                              \
    static inline void NAME(const float *x, int k, int nb, const void *wrow, float *out) {                       \
        __m256 acc[T][A];                                                                                        \
        for (int t = 0; t < T; t++)                                                                              \
            for (int a = 0; a < A; a++) acc[t][a] = _mm256_setzero_ps();                                         \
        for (int b = 0; b < nb; b++) {                                                                           \
            __m256 w[4];                                                                                         \
            WIDEN;                                                                                               \
            for (int t = 0; t < T; t++) {                                                                        \
                const float *xb = x + (size_t)t * k + (size_t)b * QK;                                            \
                for (int i = 0; i < 4; i++)                                                                      \
                    acc[t][i % A] = _mm256_fmadd_ps(w[i], _mm256_loadu_ps(xb + 8 * i), acc[t][i % A]);           \
            }                                                                                                    \
        }                                                                                                        \
        for (int t = 0; t < T; t++) {                                                                            \
            __m256 s = acc[t][0];                                                                                \
            for (int a = 1; a < A; a++) s = _mm256_add_ps(s, acc[t][a]);                                         \
            out[t] = hsum(s);                                                                                    \
        }                                                                                                        \
    }

#define W4 widen_q4((const block_q4 *)wrow + b, w)
#define W8 widen_q8((const int8_t *)wrow + (size_t)b * QK, w)

DOT_TILE(q4_dot1, 1, W4)
DOT_TILE(q4_dot2, 2, W4)
DOT_TILE(q4_dot3, 3, W4)
DOT_TILE(q4_dot4, 4, W4)
DOT_TILE(q4_dot5, 5, W4)
DOT_TILE(q4_dot6, 6, W4)
DOT_TILE(q4_dot7, 7, W4)
DOT_TILE(q4_dot8, 8, W4)
DOT_TILE(q8_dot1, 1, W8)
DOT_TILE(q8_dot2, 2, W8)
DOT_TILE(q8_dot3, 3, W8)
DOT_TILE(q8_dot4, 4, W8)
DOT_TILE(q8_dot5, 5, W8)
DOT_TILE(q8_dot6, 6, W8)
DOT_TILE(q8_dot7, 7, W8)
DOT_TILE(q8_dot8, 8, W8)
typedef void (*dot_fn)(const float *, int, int, const void *, float *);
static const dot_fn Q4_DOTS[9] = {0, q4_dot1, q4_dot2, q4_dot3, q4_dot4, q4_dot5, q4_dot6, q4_dot7, q4_dot8};
static const dot_fn Q8_DOTS[9] = {0, q8_dot1, q8_dot2, q8_dot3, q8_dot4, q8_dot5, q8_dot6, q8_dot7, q8_dot8};

static int linear(const dot_fn *dots, const float *x, int rows, int k, const uint8_t *w, size_t row_bytes,
                  const float *scale, int n, float *y, int threads) {
    if (k % QK != 0 || rows <= 0 || n <= 0) return -1;
    const int nb = k / QK;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int o = 0; o < n; o++) {
        const uint8_t *wrow = w + (size_t)o * row_bytes;
        float out[8];
        for (int r0 = 0; r0 < rows; r0 += 8) {
            const int tile = rows - r0 < 8 ? rows - r0 : 8;
            dots[tile](x + (size_t)r0 * k, k, nb, wrow, out);
            const float s = scale ? scale[o] : 1.0f;
            for (int t = 0; t < tile; t++) y[(size_t)(r0 + t) * n + o] = out[t] * s;
        }
    }
    return 0;
}

/* y (rows, n) = x (rows, k) @ w^T for int4 blocks w (n, k / 32). */
int q4_linear(const float *x, int rows, int k, const block_q4 *w, int n, float *y, int threads) {
    return linear(Q4_DOTS, x, rows, k, (const uint8_t *)w, sizeof(block_q4) * (size_t)(k / QK), 0, n, y, threads);
}

/* y (rows, n) = x (rows, k) @ (scale[:, None] * w)^T for int8 rows w (n, k). */
int q8_linear(const float *x, int rows, int k, const int8_t *w, const float *scale, int n, float *y, int threads) {
    return linear(Q8_DOTS, x, rows, k, (const uint8_t *)w, (size_t)k, scale, n, y, threads);
}
