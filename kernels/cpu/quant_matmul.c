/* Quantized-weight matmuls for x86 CPUs with AVX2 and FMA, where torch's int4/int8 weight ops have no vectorised
 * kernel (on an AVX2 EPYC they took 8.0 and 5.0 ms for a 3072 x 576 matrix at one row, fp32 0.24 ms).
 *
 * y[r, n] = sum_k x[r, k] * w[n, k]; the activations stay fp32 and weights are widened to fp32 in registers, so no
 * full-precision copy of a matrix exists:
 *   int4: panels of 8 output rows x 32 inputs, {float d[8]; float m[8]; uint8 q[16][8]}, w = d * q + m with q in
 *         0..15 (GGUF's Q4_1 numbers; Q4_0 is m = -8 d). Byte q[g][o] holds input g of output o in its low nibble
 *         and input g + 16 in its high one, so one 8-byte load widens to the 8 outputs' weights at two inputs, and
 *         the product is an outer product: each activation is broadcast and multiplied into 8 outputs at once, no
 *         horizontal sums. A tile of T activation rows x P panels keeps 2 T P accumulators in registers (one for
 *         the low, one for the high inputs: two dependency chains); T P <= 6 of them (1x4, 2x2, 3-6x1).
 *         Against the earlier layout (a weight row's blocks widened for up to 8 activation rows, sums reduced
 *         across lanes) on the AVX2 EPYC: 1.4-1.5x at one row, 1.2-1.3x at 4-16 rows, 1.6-2x at 64-256 rows.
 *   int8: w = scale[n] * q, q int8, one scale per output row: panels of 8 output rows x 32 inputs, int8 q[32][8],
 *         the same outer products on q, the rows' scales applied once to the sums.
 * Activations quantized to int8 as well (llama.cpp's Q8_1 scheme, maddubs dot products) were tried first: about
 * as fast at one row, but SmolLM2's top-1 agreement with the fp32 path fell from 99.2% to 97.5% over 520
 * teacher-forced tokens, so the activations stay fp32.
 *
 * Every output sums its inputs in the same order whatever tile its row falls in: a row's result does not depend on
 * the batch it came in (tested). Output panels are split among OpenMP threads (torch's libgomp, already loaded: one
 * thread pool). Built by kernels/cpu_quant.py with cc -O3 -mavx2 -mfma.
 */
#include <immintrin.h>
#include <stdint.h>

#define QK 32

typedef struct {
    float d[8];
    float m[8];
    uint8_t q[16][8];
} panel_q4; /* 192 bytes: 8 outputs x 32 inputs */

typedef struct {
    int8_t q[QK][8];
} panel_q8; /* 256 bytes; the 8 rows' scales are kept apart, one per output row */

/* A tile of T activation rows (x, stride k) x P panels (w, nb blocks each) into y (stride ldy). WIDEN(P) makes wl##P
 * and wh##P, panel P's weights at inputs g and g + 16 of block b; every output sums its low and its high inputs in
 * two chains, in the same order whatever the tile. */
#define PZ(T, P) __m256 lo##T##P = _mm256_setzero_ps(), hi##T##P = _mm256_setzero_ps();
#define PX(T)                                                                                                   \
    const __m256 xl##T = _mm256_broadcast_ss(x + (size_t)(T) * k + off),                                        \
                 xh##T = _mm256_broadcast_ss(x + (size_t)(T) * k + off + 16);
#define PF(T, P)                                                                                                \
    lo##T##P = _mm256_fmadd_ps(xl##T, wl##P, lo##T##P);                                                         \
    hi##T##P = _mm256_fmadd_ps(xh##T, wh##P, hi##T##P);
#define PS(T, P) _mm256_storeu_ps(y + (size_t)(T) * ldy + 8 * (P), SCALED(_mm256_add_ps(lo##T##P, hi##T##P), P));
/* Written out per tile shape, not as loops over arrays of accumulators: gcc kept those arrays on the stack and
 * stored every accumulator after each FMA (one store per FMA, half the speed). */
#define PANEL_KERNEL(NAME, PANEL, INIT, BODY, STORE)                                                            \
    static void NAME(const float *x, int k, int nb, const void *panels, const float *scale, float *y, int ldy) { \
        const PANEL *w = (const PANEL *)panels;                                                                 \
        const __m256i low = _mm256_set1_epi32(0x0F);                                                            \
        (void)low;                                                                                              \
        (void)scale;                                                                                            \
        INIT                                                                                                    \
        for (int b = 0; b < nb; b++) {                                                                          \
            _Pragma("GCC unroll 2") for (int g = 0; g < 16; g++) {                                              \
                const size_t off = (size_t)b * QK + g;                                                          \
                BODY                                                                                            \
            }                                                                                                   \
        }                                                                                                       \
        STORE                                                                                                   \
    }
/* The tile shapes: 1x4, 2x2 and 1-6 rows x 1 panel (2 T P <= 12 accumulators, the rest of the 16 registers for
 * the widened weights and the broadcast activations). */
#define PANEL_KERNELS(PREFIX, PANEL)                                                                            \
    PANEL_KERNEL(PREFIX##_1x1, PANEL, PZ(0, 0), PX(0) WIDEN(0) PF(0, 0), PS(0, 0))                              \
    PANEL_KERNEL(PREFIX##_1x4, PANEL, PZ(0, 0) PZ(0, 1) PZ(0, 2) PZ(0, 3),                                      \
                 PX(0) WIDEN(0) PF(0, 0) WIDEN(1) PF(0, 1) WIDEN(2) PF(0, 2) WIDEN(3) PF(0, 3),                 \
                 PS(0, 0) PS(0, 1) PS(0, 2) PS(0, 3))                                                           \
    PANEL_KERNEL(PREFIX##_2x1, PANEL, PZ(0, 0) PZ(1, 0), WIDEN(0) PX(0) PF(0, 0) PX(1) PF(1, 0),              \
                 PS(0, 0) PS(1, 0))                                                                             \
    PANEL_KERNEL(PREFIX##_2x2, PANEL, PZ(0, 0) PZ(1, 0) PZ(0, 1) PZ(1, 1),                                      \
                 PX(0) PX(1) WIDEN(0) PF(0, 0) PF(1, 0) WIDEN(1) PF(0, 1) PF(1, 1),                             \
                 PS(0, 0) PS(1, 0) PS(0, 1) PS(1, 1))                                                           \
    PANEL_KERNEL(PREFIX##_3x1, PANEL, PZ(0, 0) PZ(1, 0) PZ(2, 0),                                               \
                 WIDEN(0) PX(0) PF(0, 0) PX(1) PF(1, 0) PX(2) PF(2, 0), PS(0, 0) PS(1, 0) PS(2, 0))            \
    PANEL_KERNEL(PREFIX##_4x1, PANEL, PZ(0, 0) PZ(1, 0) PZ(2, 0) PZ(3, 0),                                      \
                 WIDEN(0) PX(0) PF(0, 0) PX(1) PF(1, 0) PX(2) PF(2, 0) PX(3) PF(3, 0),                         \
                 PS(0, 0) PS(1, 0) PS(2, 0) PS(3, 0))                                                           \
    PANEL_KERNEL(PREFIX##_5x1, PANEL, PZ(0, 0) PZ(1, 0) PZ(2, 0) PZ(3, 0) PZ(4, 0),                             \
                 WIDEN(0) PX(0) PF(0, 0) PX(1) PF(1, 0) PX(2) PF(2, 0) PX(3) PF(3, 0) PX(4) PF(4, 0),          \
                 PS(0, 0) PS(1, 0) PS(2, 0) PS(3, 0) PS(4, 0))                                                  \
    PANEL_KERNEL(PREFIX##_6x1, PANEL, PZ(0, 0) PZ(1, 0) PZ(2, 0) PZ(3, 0) PZ(4, 0) PZ(5, 0),                    \
                 WIDEN(0) PX(0) PF(0, 0) PX(1) PF(1, 0) PX(2) PF(2, 0) PX(3) PF(3, 0) PX(4) PF(4, 0)           \
                 PX(5) PF(5, 0),                                                                                \
                 PS(0, 0) PS(1, 0) PS(2, 0) PS(3, 0) PS(4, 0) PS(5, 0))

/* int4: w = d * q + m per output and block, applied as each weight is widened. */
#define WIDEN(P)                                                                                                \
    __m256 wl##P, wh##P;                                                                                        \
    {                                                                                                           \
        const panel_q4 *bk = w + (size_t)(P) * nb + b;                                                          \
        const __m256 d = _mm256_loadu_ps(bk->d), m = _mm256_loadu_ps(bk->m);                                    \
        const __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)bk->q[g]));                    \
        wl##P = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(v, low)), d, m);                            \
        wh##P = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(v, 4)), d, m);                             \
    }
#define SCALED(v, P) (v)
PANEL_KERNELS(q4, panel_q4)
#undef WIDEN
#undef SCALED

/* int8: q as it is; the output row's scale multiplies the finished sum. */
#define WIDEN(P)                                                                                                \
    __m256 wl##P, wh##P;                                                                                        \
    {                                                                                                           \
        const panel_q8 *bk = w + (size_t)(P) * nb + b;                                                          \
        wl##P = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)bk->q[g])));          \
        wh##P = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)bk->q[g + 16])));     \
    }
#define SCALED(v, P) _mm256_mul_ps((v), _mm256_loadu_ps(scale + 8 * (P)))
PANEL_KERNELS(q8, panel_q8)
#undef WIDEN
#undef SCALED

#define TMAX 6
#define GROUP_PANELS 4 /* a thread's unit of work: 32 outputs */
static const int WIDTH[TMAX + 1] = {0, 4, 2, 1, 1, 1, 1}; /* panels per call of a tile of T rows */

/* One matmul over panels of either kind: ONE[t] and WIDE[t] are the tile functions of t rows, `bytes` a panel
 * block's size, scale (per output row, or NULL) passed on at each panel's outputs. */
typedef void (*tile_fn)(const float *, int, int, const void *, const float *, float *, int);

static int panel_linear(const tile_fn *one, const tile_fn *wide, size_t bytes, const float *x, int rows, int k,
                        const uint8_t *w, const float *scale, int n, float *y, int threads) {
    if (k % QK != 0 || rows <= 0 || n <= 0) return -1;
    const int nb = k / QK, np = (n + 7) / 8;
    const int tiles = (rows + TMAX - 1) / TMAX; /* row tiles as even as they can be: 8 rows are 4 + 4, not 6 + 2 */
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int p0 = 0; p0 < np; p0 += GROUP_PANELS) {
        const int end = np - p0 < GROUP_PANELS ? np : p0 + GROUP_PANELS;
        for (int i = 0, r0 = 0; i < tiles; i++) {
            const int t = rows / tiles + (i < rows % tiles);
            const float *xt = x + (size_t)r0 * k;
            float *yt = y + (size_t)r0 * n;
            for (int p = p0; p < end;) {
                const uint8_t *wp = w + (size_t)p * nb * bytes;
                const float *sp = scale ? scale + 8 * p : 0;
                if (8 * (p + 1) > n) { /* the padded last panel: n % 8 of its outputs are real */
                    float tmp[TMAX * 8];
                    one[t](xt, k, nb, wp, sp, tmp, 8);
                    for (int r = 0; r < t; r++)
                        for (int o = 0; o < n - 8 * p; o++) yt[(size_t)r * n + 8 * p + o] = tmp[r * 8 + o];
                    p++;
                } else if (WIDTH[t] > 1 && p + WIDTH[t] <= end && 8 * (p + WIDTH[t]) <= n) {
                    wide[t](xt, k, nb, wp, sp, yt + 8 * p, n);
                    p += WIDTH[t];
                } else {
                    one[t](xt, k, nb, wp, sp, yt + 8 * p, n);
                    p++;
                }
            }
            r0 += t;
        }
    }
    return 0;
}

#define TILES(PREFIX)                                                                                           \
    static const tile_fn PREFIX##_ONE[TMAX + 1] = {0,          PREFIX##_1x1, PREFIX##_2x1, PREFIX##_3x1,        \
                                                   PREFIX##_4x1, PREFIX##_5x1, PREFIX##_6x1};                  \
    static const tile_fn PREFIX##_WIDE[TMAX + 1] = {0, PREFIX##_1x4, PREFIX##_2x2, 0, 0, 0, 0};
TILES(q4)
TILES(q8)

/* y (rows, n) = x (rows, k) @ w^T for int4 panels w (ceil(n / 8), k / 32). */
int q4_linear(const float *x, int rows, int k, const panel_q4 *w, int n, float *y, int threads) {
    return panel_linear(q4_ONE, q4_WIDE, sizeof(panel_q4), x, rows, k, (const uint8_t *)w, 0, n, y, threads);
}

/* y (rows, n) = x (rows, k) @ (scale[:, None] * q)^T for int8 panels w (ceil(n / 8), k / 32) and scale
 * (8 ceil(n / 8)). */
int q8_linear(const float *x, int rows, int k, const panel_q8 *w, const float *scale, int n, float *y, int threads) {
    return panel_linear(q8_ONE, q8_WIDE, sizeof(panel_q8), x, rows, k, (const uint8_t *)w, scale, n, y, threads);
}
