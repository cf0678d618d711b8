/* The quantized matmuls of quant_kernels.h with Intel AMX (tile registers, `tdpbssd`: 16 activation rows x 32
 * inputs x 16 outputs, signed bytes by signed bytes, in one instruction) for rows taken 16 at a time, and the
 * AVX-512 VNNI tiles of quant_avx512vnni.c for the rest (fewer than 16 rows: decode steps of few sequences, the tail
 * of a prefill chunk).
 *
 * Each thread takes a panel (16 outputs) at a time: its weights are unpacked once into signed bytes (Q6_K: q - 32,
 * Q8_0: u - 128, so one instruction serves every format and no sum needs a correction), laid out as AMX B tiles
 * (a block's 8 group rows of 64 bytes, as the panel layout keeps them), and every 16-row group of activations then
 * multiplies that buffer (a prefill chunk's row groups share one unpacking). The loop over a panel's blocks is a
 * pipeline of four stages, one block each (amx_rows16): block u's tile product starts, block u - 2's sums are
 * stored, block u - 3's are scaled in float, and one block of the next panel is unpacked. The previous code took
 * one block at a time through the whole chain (unpack, tile load, product, tile store, vector loads; tile
 * registers are not renamed): ~140 cycles a block at 16 rows, no faster than vpdpbusd. Measured on the 2-vCPU
 * KVM Xeon guest: the tile work and the float scaling still do not overlap (together about the sum of each
 * alone, even interleaved block by block), so the scaling (4 vector operations per row and block, the vector
 * tiles' own, for the same bits) and the tile stores are what bound this path now.
 *
 * Every block's int32 sums are scaled exactly as the vector tiles scale theirs (the same float operations in the
 * same order), so every ISA gives the same bits. Q6_K (a scale per 16 inputs) multiplies half blocks: tiles of 16
 * inputs. From BF16_MIN_ROWS rows the product is made in bf16 tiles instead (amx_bf16_matmul, at the end).
 *
 * Linux grants the tile data state to a process on request (kernels/cpu/cpu_features.c: amx_request, done when the
 * CPU is probed); each thread loads the tile configuration before its first tile instruction and releases it after.
 * Built with the AVX-512 flags plus -mavx512bf16 -mamx-tile -mamx-int8 -mamx-bf16; chosen only where cpuid and
 * XCR0 report all of them. */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#include "quant_layout.h"

#define ISA amx
#define AMX_ROWS 16

#define BIG_ROWS(fmt, mode, rows) ((mode) == 0 ? (rows) / AMX_ROWS * AMX_ROWS : 0)
#define BIG_TILES(fmt, w, pstride, cbeg, cend, nrec, a, big, k, y, n) \
    amx_tiles(fmt, w, pstride, cbeg, cend, nrec, a, big, k, y, n)

#include "quant_vec512.h"

static void amx_tiles(int fmt, const uint8_t *w, size_t pstride, int cbeg, int cend, int nrec, const acts_t *a,
                      int big, int k, float *y, int n);
static int amx_bf16_matmul(int fmt, const float *x, int rows, int k, const uint8_t *w, int n, float *y, int threads);

/* From this many rows (a prefill chunk), int8 mode multiplies in bf16 instead (amx_bf16_matmul, below): measured
 * on the 1B's matrices (2 threads), even with the int8 tiles at 32 rows on gate-up and 1.4x on down (Q6_K), 1.7x
 * and 2.3x at 64; at 16 rows the int8 tiles are 1.6x faster (a panel's bf16 dequantization serves too few rows) */
#define BF16_MIN_ROWS 32
#define WIDE_MATMUL(fmt, mode, x, rows, k, w, n, y, threads) \
    ((mode) == 0 && (rows) >= BF16_MIN_ROWS ? amx_bf16_matmul(fmt, x, rows, k, w, n, y, threads) : 1)

#include "quant_kernels.h"

typedef struct {
    uint8_t palette;
    uint8_t start_row;
    uint8_t reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} __attribute__((aligned(64))) tile_config;

/* uk: inputs per tile product (32; Q6_K 16). tmm0, tmm1: activations (16 rows x uk bytes); tmm2, tmm3: weights
 * (uk / 4 group rows x 64 bytes); tmm4..tmm7: sums (16 rows x 16 int32). */
static void amx_configure(int uk) {
    tile_config cfg = {0};
    cfg.palette = 1;
    for (int t = 0; t < 2; t++) {
        cfg.rows[t] = AMX_ROWS;
        cfg.colsb[t] = (uint16_t)uk;
        cfg.rows[t + 2] = (uint8_t)(uk / 4);
        cfg.colsb[t + 2] = 64;
    }
    for (int t = 4; t < 8; t++) {
        cfg.rows[t] = AMX_ROWS;
        cfg.colsb[t] = 64;
    }
    _tile_loadconfig(&cfg);
}

/* Block blk of a panel as signed bytes (8 group rows of 64 bytes: an AMX B tile, or two of 16 inputs) at out. */
static inline __attribute__((always_inline)) void unpack_block(const int fmt, const uint8_t *panel, int blk,
                                                               int8_t *out) {
    const int sbk = SUPER_BLOCK[fmt] / QK, s = blk / sbk, b = blk % sbk;
    const uint8_t *rec = panel + (size_t)s * RECORD_BYTES[fmt], *qb = rec + b * 256;
    VI qh[2];
    block_high_bits(fmt, rec, b, 0, qh);
#pragma GCC unroll 4
    for (int j = 0; j < 4; j++) {
        VI lo, hi;
        PAIR(fmt, qb, qh, j, lo, hi);
        if (fmt == F_Q6_K) {
            lo = _mm512_sub_epi8(lo, SET1B(32));
            hi = _mm512_sub_epi8(hi, SET1B(32));
        } else if (fmt == F_Q8_0) {
            lo = _mm512_xor_si512(lo, SET1B(0x80));
            hi = _mm512_xor_si512(hi, SET1B(0x80));
        }
        _mm512_store_si512(out + j * 64, lo);
        _mm512_store_si512(out + (j + 4) * 64, hi);
    }
}

/* Unit u's sums (16 rows x 16 outputs, int32) scaled into acc as the vector tiles scale a block's (Q6_K: unit
 * 2 b + h is half h of block b, its own scale; the halves in order, as the vector tiles add them). */
static inline __attribute__((always_inline)) void scale_unit(const int fmt, const uint8_t *panel, int u,
                                                             const int32_t (*in)[16], const acts_t *a, int r0,
                                                             int nb, VF *acc) {
    const int U = fmt == F_Q6_K ? 2 : 1, blk = u / U, sbk = SUPER_BLOCK[fmt] / QK, b = blk % sbk;
    const uint8_t *rec = panel + (size_t)(blk / sbk) * RECORD_BYTES[fmt];
    VF D, M;
    if (IS_Q4(fmt) || IS_Q5(fmt)) {
        D = LOADH(rec + Q4_D);
        M = LOADH(rec + Q4_M);
    } else if (fmt == F_Q8_0) {
        D = LOADH(rec + Q8_D);
    } else if (fmt == F_Q4_K || fmt == F_Q5_K) {
        D = MUL(LOADH(rec + QK4_D), LOADU8F(rec + QK4_SC + b * 16));
        M = MUL(LOADH(rec + QK4_DMIN), LOADU8F(rec + QK4_M + b * 16));
    } else {
        D = MUL(LOADH(rec + QK6_D), LOADI8F(rec + QK6_SC + (u % (2 * sbk)) * 16));
    }
    const float *d = a->d + (size_t)r0 * nb + blk, *dm = a->dm + (size_t)r0 * nb + blk;
#pragma GCC unroll 16
    for (int r = 0; r < AMX_ROWS; r++) {
        acc[r] = FMA(CVT(_mm512_load_si512(in[r])), MUL(D, SET1F(d[(size_t)r * nb])), acc[r]);
        if (IS_Q4(fmt) || IS_Q5(fmt))
            acc[r] = FMA(M, SET1F(dm[(size_t)r * nb]), acc[r]);
        else if (fmt == F_Q4_K || fmt == F_Q5_K)
            acc[r] = FNMA(M, SET1F(dm[(size_t)r * nb]), acc[r]);
    }
}

/* One step of the pipeline, for unit u (tile registers by literal number: step I of 4, u = I mod 4): unit u's
 * product starts (A in tmm(I & 1), B in tmm(2 + (I & 1)), C in tmm(4 + I)); unit u - 2's sums (long computed) go
 * out to the ring of sums; unit u - 3's (stored a step ago) are scaled; one block of the next panel is unpacked
 * and a slice of the panel after it prefetched. Tile registers are not renamed, so each stage works on a unit
 * the stage before finished with. */
#define STEP(I, TA, TB, TC, TS)                                                                                    \
    do {                                                                                                           \
        const int u = u4 + (I);                                                                                    \
        if (u < nu) {                                                                                              \
            _tile_loadd(TA, x + u * uk, k);                                                                        \
            _tile_loadd(TB, buf + (size_t)u * uk * 16, 64);                                                        \
            _tile_zero(TC);                                                                                        \
            _tile_dpbssd(TC, TA, TB);                                                                              \
        }                                                                                                          \
        if (u >= 2 && u - 2 < nu) _tile_stored(TS, ring[((I) + 2) & 3], 64);                                       \
        if (u >= 3 && u - 3 < nu)                                                                                  \
            scale_unit(fmt, panel, u - 3, (const int32_t(*)[16])ring[((I) + 1) & 3], a, r0, nb, acc);               \
        if (next && u < nb) unpack_block(fmt, next, u, nbuf + (size_t)u * 512);                                    \
        if (pf && u < nu)                                                                                          \
            for (int l_ = 0; l_ < pf_lines; l_++) {                                                                \
                const size_t o_ = ((size_t)u * pf_lines + l_) * 64;                                                \
                if (o_ < pstride) _mm_prefetch((const char *)pf + o_, _MM_HINT_T1);                                \
            }                                                                                                      \
    } while (0)

/* Rows r0..r0+15 x one panel (its weights unpacked in buf): y (16, 16), row stride ldy. Where next is given, the
 * next panel's weights are unpacked into nbuf meanwhile. */
static inline __attribute__((always_inline)) void amx_rows16(const int fmt, const uint8_t *panel, const int8_t *buf,
                                                             const acts_t *a, int r0, int k, float *y, int ldy,
                                                             const uint8_t *next, int8_t *nbuf, const uint8_t *pf,
                                                             size_t pstride) {
    const int uk = fmt == F_Q6_K ? QK / 2 : QK, nu = k / uk, nb = k / QK;
    const int8_t *x = a->q + (size_t)r0 * k;
    const int pf_lines = (int)((pstride / 64 + nu - 1) / nu);
    int32_t ring[4][AMX_ROWS][16] __attribute__((aligned(64)));
    VF acc[AMX_ROWS];
#pragma GCC unroll 16
    for (int r = 0; r < AMX_ROWS; r++) acc[r] = ZEROF();
    for (int u4 = 0; u4 < nu + 3; u4 += 4) {
        STEP(0, 0, 2, 4, 6);
        STEP(1, 1, 3, 5, 7);
        STEP(2, 0, 2, 6, 4);
        STEP(3, 1, 3, 7, 5);
    }
#pragma GCC unroll 16
    for (int r = 0; r < AMX_ROWS; r++) STOREF(y + (size_t)r * ldy, acc[r]);
}

static inline __attribute__((always_inline)) void amx_panels(const int fmt, const uint8_t *w, size_t pstride,
                                                             int cbeg, int cend, int nrec, const acts_t *a, int big,
                                                             int k, float *y, int n, int8_t *bufs) {
    const size_t bsize = (size_t)(k / QK) * 512;
    (void)nrec;
    for (int blk = 0; blk < k / QK; blk++) unpack_block(fmt, w + (size_t)cbeg * pstride, blk, bufs + (size_t)blk * 512);
    for (int c = cbeg; c < cend; c++) {
        const uint8_t *panel = w + (size_t)c * pstride;
        const int8_t *buf = bufs + (c - cbeg) % 2 * bsize;
        int8_t *nbuf = bufs + (c - cbeg + 1) % 2 * bsize;
        for (int r0 = 0; r0 < big; r0 += AMX_ROWS) {
            const uint8_t *next = r0 == 0 && c + 1 < cend ? panel + pstride : 0;
            /* the panel after that into L2 meanwhile, a slice a step: at 16 rows the weights come from memory
             * once a step, and the hardware prefetcher alone left ~15% of the time waiting for them */
            const uint8_t *pf = r0 == 0 && c + 2 < cend ? panel + 2 * pstride : 0;
            if ((c + 1) * PANEL > n) { /* the padded last panel */
                float tmp[AMX_ROWS][PANEL];
                amx_rows16(fmt, panel, buf, a, r0, k, &tmp[0][0], PANEL, next, nbuf, pf, pstride);
                for (int r = 0; r < AMX_ROWS; r++)
                    for (int o = c * PANEL; o < n; o++) y[(size_t)(r0 + r) * n + o] = tmp[r][o - c * PANEL];
            } else {
                amx_rows16(fmt, panel, buf, a, r0, k, y + (size_t)r0 * n + (size_t)c * PANEL, n, next, nbuf, pf,
                           pstride);
            }
        }
    }
}

static void amx_tiles(int fmt, const uint8_t *w, size_t pstride, int cbeg, int cend, int nrec, const acts_t *a,
                      int big, int k, float *y, int n) {
    int8_t *buf = aligned_alloc(64, (size_t)(k / QK) * 1024); /* this panel's and the next one's */
    if (!buf) { /* no room to unpack: the vector tiles take these rows too */
        for (int c = cbeg; c < cend; c++)
            for (int r0 = 0; r0 < big; r0 += 4) {
                float tmp[4 * LANES];
                float *yt = (c + 1) * PANEL > n ? tmp : y + (size_t)r0 * n + (size_t)c * LANES;
                TILES_I8[fmt][4][0](w, pstride, c, nrec, a, r0, k, yt, yt == tmp ? LANES : n);
                if (yt == tmp)
                    for (int r = 0; r < 4; r++)
                        for (int o = c * LANES; o < n; o++) y[(size_t)(r0 + r) * n + o] = tmp[r * LANES + o - c * LANES];
            }
        return;
    }
    amx_configure(fmt == F_Q6_K ? QK / 2 : QK);
    switch (fmt) {
#define CASE(F)                                                                  \
    case F:                                                                      \
        amx_panels(F, w, pstride, cbeg, cend, nrec, a, big, k, y, n, buf);       \
        break;
        EACH_FORMAT(CASE)
#undef CASE
    }
    _tile_release();
    free(buf);
}

/* ---- bf16 tiles for many rows ----------------------------------------------------------------------------------
 *
 * A prefill chunk (BF16_MIN_ROWS rows and more) is multiplied in bf16: each panel's weights dequantized once to
 * float (gguf's values) and rounded to bf16, the activations rounded to bf16, `tdpbf16ps` summing in float across
 * the whole input. The int8 tiles above scale every block's sums in float (four vector operations per row and
 * block), which the tile products do not overlap; here the sums stay in the tile registers across 2,048 inputs, and
 * the dequantization is paid once per panel for every row of the chunk. Numbers: a weight differs from gguf's by its
 * bf16 rounding (2^-9 relative), an activation likewise; int8 mode's per-block quantization errs by up to 1/254 of
 * a block's largest value. Each row's result still depends on that row alone (the same order of sums for every
 * row of any batch of this size class).
 *
 * Blocking: a thread takes two panels (32 outputs) at a time; their weights for BF16_KC inputs are dequantized
 * into a buffer that stays in L1/L2, and BF16_MC activation rows (kept in L2) pass over it 32 at a time, four C
 * tiles (2 row groups x 2 panels) fed by two A and two B tile loads per 32 inputs. Inputs past BF16_KC go round
 * again, the sums carried in y. */
#define BF16_MC 256
#define BF16_KC 2048

static void amx_configure_bf16(void) {
    tile_config cfg = {0};
    cfg.palette = 1;
    for (int t = 0; t < 8; t++) {
        cfg.rows[t] = 16;
        cfg.colsb[t] = 64;
    }
    _tile_loadconfig(&cfg);
}

/* Block blk of a panel as bf16 in tdpbf16ps's B layout: 16 rows, row p = inputs 2p and 2p + 1 of each of the 16
 * outputs (1 KB). The float weights are computed as the float32 mode's tiles compute them (block_affine). */
static inline __attribute__((always_inline)) void dequant_block_bf16(const int fmt, const uint8_t *panel, int blk,
                                                                     uint16_t *out) {
    const int sbk = SUPER_BLOCK[fmt] / QK, b = blk % sbk;
    const uint8_t *rec = panel + (size_t)(blk / sbk) * RECORD_BYTES[fmt], *qb = rec + b * 256;
    VI qh[2];
    block_high_bits(fmt, rec, b, 0, qh);
    VF Dd[4], Md[4], Dhd[4], Mhd[4];
    block_affine(fmt, rec, b, 0, Dd, Md, Dhd, Mhd);
    /* a group's floats in lanes (output 4C + l / 4, input l % 4) -> bf16 pairs (output, inputs 0-1 | 2-3) in
     * 32-bit units, outputs 0..7 then 8..15 -> the group's two B rows */
    const __m512i even = _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
    const __m512i odd = _mm512_set_epi32(31, 29, 27, 25, 23, 21, 19, 17, 15, 13, 11, 9, 7, 5, 3, 1);
#pragma GCC unroll 4
    for (int j = 0; j < 4; j++) {
        VI lo, hi;
        PAIR(fmt, qb, qh, j, lo, hi);
#define GROUP_ROWS(V, G, DD, MM)                                                                                   \
    {                                                                                                              \
        const VF f0 = FMA(CHUNKF(V, 0), DD[0], MM[0]), f1 = FMA(CHUNKF(V, 1), DD[1], MM[1]);                       \
        const VF f2 = FMA(CHUNKF(V, 2), DD[2], MM[2]), f3 = FMA(CHUNKF(V, 3), DD[3], MM[3]);                       \
        const __m512i p01 = (__m512i)_mm512_cvtne2ps_pbh(f1, f0), p23 = (__m512i)_mm512_cvtne2ps_pbh(f3, f2);      \
        _mm512_store_si512(out + (2 * (G)) * 32, _mm512_permutex2var_epi32(p01, even, p23));                       \
        _mm512_store_si512(out + (2 * (G) + 1) * 32, _mm512_permutex2var_epi32(p01, odd, p23));                    \
    }
        GROUP_ROWS(lo, j, Dd, Md);
        GROUP_ROWS(hi, j + 4, Dhd, Mhd);
#undef GROUP_ROWS
    }
}

/* Four C tiles: rows r..r+15 (A in tmm4) and r+16..r+31 (tmm5) x panel buffers b0 (tmm6) and b1 (tmm7), over nkb
 * blocks of 32 inputs; xa: the first row group's first A tile, ldx: elements from one row group's tiles to the next
 * one's; c[t] / ldc[t] (bytes) where each C tile is loaded (unless first) and stored. */
static inline __attribute__((always_inline)) void bf16_tiles_2x2(const uint16_t *xa, size_t ldx, const uint16_t *b0,
                                                                 const uint16_t *b1, int nkb, float *const c[4],
                                                                 const size_t ldc[4], int first) {
    if (first) {
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
    } else {
        _tile_loadd(0, c[0], ldc[0]);
        _tile_loadd(1, c[1], ldc[1]);
        _tile_loadd(2, c[2], ldc[2]);
        _tile_loadd(3, c[3], ldc[3]);
    }
    const uint16_t *xb = xa + 16 * ldx / 2;
    for (int kb = 0; kb < nkb; kb++) {
        _tile_loadd(4, xa + kb * 32, ldx);
        _tile_loadd(6, b0 + kb * 512, 64);
        _tile_dpbf16ps(0, 4, 6);
        _tile_loadd(5, xb + kb * 32, ldx);
        _tile_dpbf16ps(1, 5, 6);
        _tile_loadd(7, b1 + kb * 512, 64);
        _tile_dpbf16ps(2, 4, 7);
        _tile_dpbf16ps(3, 5, 7);
    }
    _tile_stored(0, c[0], ldc[0]);
    _tile_stored(1, c[1], ldc[1]);
    _tile_stored(2, c[2], ldc[2]);
    _tile_stored(3, c[3], ldc[3]);
}

static inline __attribute__((always_inline)) void bf16_panels(const int fmt, const uint8_t *w, size_t pstride,
                                                              int pbeg, int pend, const uint16_t *xb, int rows,
                                                              int rpad, int k, float *y, int n, uint16_t *bbuf) {
    float scratch[4][16][16] __attribute__((aligned(64)));
    for (int kc0 = 0; kc0 < k; kc0 += BF16_KC) {
        const int kc = k - kc0 < BF16_KC ? k - kc0 : BF16_KC, kb0 = kc0 / QK, nkb = kc / QK;
        for (int m0 = 0; m0 < rpad; m0 += BF16_MC) {
            const int m1 = m0 + BF16_MC < rpad ? m0 + BF16_MC : rpad;
            for (int p = pbeg; p < pend; p += 2) {
                const int two = p + 1 < pend;
                uint16_t *b0 = bbuf, *b1 = two ? bbuf + (size_t)nkb * 512 : bbuf;
                for (int kb = 0; kb < nkb; kb++) dequant_block_bf16(fmt, w + (size_t)p * pstride, kb0 + kb, b0 + kb * 512);
                if (two)
                    for (int kb = 0; kb < nkb; kb++)
                        dequant_block_bf16(fmt, w + (size_t)(p + 1) * pstride, kb0 + kb, b1 + kb * 512);
                for (int r = m0; r < m1; r += 32) {
                    float *c[4];
                    size_t ldc[4];
                    int valid_rows[4], valid_cols[4], col0[4], row0[4];
                    for (int t = 0; t < 4; t++) {
                        row0[t] = r + (t & 1) * 16;
                        col0[t] = (p + (t >> 1)) * PANEL;
                        valid_rows[t] = rows - row0[t] < 16 ? (rows - row0[t] > 0 ? rows - row0[t] : 0) : 16;
                        valid_cols[t] = (t >> 1) && !two ? 0 : (n - col0[t] < 16 ? n - col0[t] : 16);
                        if (valid_rows[t] == 16 && valid_cols[t] == 16) {
                            c[t] = y + (size_t)row0[t] * n + col0[t];
                            ldc[t] = (size_t)n * 4;
                        } else {
                            c[t] = &scratch[t][0][0];
                            ldc[t] = 64;
                            if (kc0 > 0) {
                                memset(scratch[t], 0, sizeof scratch[t]);
                                for (int i = 0; i < valid_rows[t]; i++)
                                    for (int o = 0; o < valid_cols[t]; o++)
                                        scratch[t][i][o] = y[(size_t)(row0[t] + i) * n + col0[t] + o];
                            }
                        }
                    }
                    bf16_tiles_2x2(xb + (size_t)r * k + kc0, (size_t)k * 2, b0, b1, nkb, c, ldc, kc0 == 0);
                    for (int t = 0; t < 4; t++)
                        if (c[t] == &scratch[t][0][0])
                            for (int i = 0; i < valid_rows[t]; i++)
                                for (int o = 0; o < valid_cols[t]; o++)
                                    y[(size_t)(row0[t] + i) * n + col0[t] + o] = scratch[t][i][o];
                }
            }
        }
    }
}

/* y (rows, n) = x (rows, k) @ W^T in bf16 tiles. Returns 0, or 1 where it cannot (no memory: the int8 tiles take
 * the product). */
static int amx_bf16_matmul(int fmt, const float *x, int rows, int k, const uint8_t *w, int n, float *y, int threads) {
    const int nrec = k / SUPER_BLOCK[fmt], panels = (n + PANEL - 1) / PANEL, rpad = (rows + 31) / 32 * 32;
    const size_t pstride = (size_t)nrec * RECORD_BYTES[fmt];
    uint16_t *xb = aligned_alloc(64, (size_t)rpad * k * 2);
    if (!xb) return 1;
    /* the activations as bf16 A tiles, each 16 rows x 32 inputs in 1 KB of its own (row group g, block kb at
     * (g k / 32 + kb) * 512 elements): a tile load then reads one contiguous KB, not 16 rows a page apart */
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int r = 0; r < rpad; r++)
        for (int i = 0; i < k; i += 32) {
            __m512i v = _mm512_setzero_si512();
            if (r < rows)
                v = (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(x + (size_t)r * k + i + 16),
                                                 _mm512_loadu_ps(x + (size_t)r * k + i));
            _mm512_store_si512(xb + (size_t)r * k + i, v);
        }
    int failed = 0;
#pragma omp parallel num_threads(threads) reduction(| : failed)
    {
        int nt = 1, id = 0;
#ifdef _OPENMP
        nt = omp_get_num_threads();
        id = omp_get_thread_num();
#endif
        /* whole pairs of panels to each thread */
        const int pairs = (panels + 1) / 2;
        const int pbeg = 2 * (int)((long)pairs * id / nt), pend0 = 2 * (int)((long)pairs * (id + 1) / nt);
        const int pend = pend0 < panels ? pend0 : panels;
        const int kc = k < BF16_KC ? k : BF16_KC;
        uint16_t *bbuf = pbeg < pend ? aligned_alloc(64, (size_t)kc * 64) : 0;
        if (pbeg < pend && !bbuf) failed = 1;
        if (bbuf) {
            amx_configure_bf16();
            switch (fmt) {
#define CASE(F)                                                                  \
    case F:                                                                      \
        bf16_panels(F, w, pstride, pbeg, pend, xb, rows, rpad, k, y, n, bbuf);   \
        break;
                EACH_FORMAT(CASE)
#undef CASE
            }
            _tile_release();
            free(bbuf);
        }
    }
    free(xb);
    return failed;
}
