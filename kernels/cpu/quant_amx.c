/* The quantized matmuls of quant_kernels.h with Intel AMX (tile registers, `tdpbsud`: 16 activation rows x 32
 * inputs x 16 outputs, signed activation bytes by unsigned weight bytes, in one instruction) for rows taken 16 at a
 * time, and the AVX-512 VNNI tiles of quant_avx512vnni.c for the rest (fewer than 16 rows: decode steps of few
 * sequences, the tail of a prefill chunk). A panel's group rows of one block are an AMX B tile as they lie (8 rows
 * of 16 outputs x 4 inputs); 4- and 5-bit weights are unpacked to bytes first. Each block's int32 sums are scaled
 * exactly as the vector tiles scale theirs, so every ISA still gives the same bits. Formats with one scale per 32
 * inputs take this path; Q6_K (a scale per 16) and float32 activations keep the vector tiles.
 *
 * Linux grants the tile data state to a process on request (kernels/cpu/cpu_features.c: amx_request, done when the
 * CPU is probed); each thread loads the tile configuration before its first tile instruction and releases it after.
 * Built with the AVX-512 flags plus -mamx-tile -mamx-int8; chosen only where cpuid and XCR0 report AMX. */
#include <immintrin.h>
#include <stdint.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#include "quant_layout.h"

#define ISA amx
#define AMX_ROWS 16

#define BIG_ROWS(fmt, mode, rows) ((mode) == 0 && amx_format(fmt) ? (rows) / AMX_ROWS * AMX_ROWS : 0)
#define BIG_TILES(fmt, w, pstride, cbeg, cend, nrec, a, big, k, y, n) \
    amx_tiles(fmt, w, pstride, cbeg, cend, nrec, a, big, k, y, n)

static inline int amx_format(int fmt) { return fmt != F_Q6_K; }

#include "quant_vec512.h"

typedef struct {
    uint8_t palette;
    uint8_t start_row;
    uint8_t reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} __attribute__((aligned(64))) tile_config;

static void amx_configure(void) {
    tile_config cfg = {0};
    cfg.palette = 1;
    cfg.rows[0] = AMX_ROWS; /* tmm0: activations, 16 rows x 32 bytes */
    cfg.colsb[0] = QK;
    cfg.rows[1] = QK / 4; /* tmm1: weights, 8 group rows x 64 bytes */
    cfg.colsb[1] = 64;
    cfg.rows[2] = AMX_ROWS; /* tmm2: sums, 16 rows x 16 int32 */
    cfg.colsb[2] = 64;
    _tile_loadconfig(&cfg);
}

/* The block's 8 group rows of one panel as bytes (w: the block's first group row; qh: its fifth-bit plane). */
static inline void unpack_block(int fmt, const uint8_t *q, const uint8_t *qh, uint8_t out[8][64]) {
    if (fmt == F_Q8_0) {
        for (int j = 0; j < 8; j++) _mm512_store_si512(out[j], _mm512_loadu_si512(q + j * 64));
        return;
    }
    const __m512i m4 = _mm512_set1_epi8(0x0F), b4 = _mm512_set1_epi8(0x10);
    __m512i h = _mm512_setzero_si512();
    if (qh) h = _mm512_loadu_si512(qh);
    for (int j = 0; j < 4; j++) {
        const __m512i v = _mm512_loadu_si512(q + j * 64);
        __m512i lo = _mm512_and_si512(v, m4), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), m4);
        if (qh) {
            lo = _mm512_or_si512(lo, _mm512_and_si512(_mm512_slli_epi16(h, 4 - j), b4));
            hi = _mm512_or_si512(hi, _mm512_and_si512(_mm512_srli_epi16(h, j), b4));
        }
        _mm512_store_si512(out[j], lo);
        _mm512_store_si512(out[j + 4], hi);
    }
}

/* 16 rows (r0..r0+15) x one panel: the block sums by tdpbsud, then scaled in the vector tiles' order. */
static void amx_tile16(int fmt, const uint8_t *panel, int nrec, const acts_t *a, int r0, int k, float *y, int ldy) {
    const int rb = RECORD_BYTES[fmt], sbk = SUPER_BLOCK[fmt] / QK, nb = k / QK;
    uint8_t wbuf[8][64] __attribute__((aligned(64)));
    int32_t sums[AMX_ROWS][16] __attribute__((aligned(64)));
    __m512 acc[AMX_ROWS];
    for (int r = 0; r < AMX_ROWS; r++) acc[r] = _mm512_setzero_ps();
    for (int s = 0; s < nrec; s++) {
        const uint8_t *rec = panel + (size_t)s * rb;
        for (int b = 0; b < sbk; b++) {
            const int blk = s * sbk + b;
            const uint8_t *qh = fmt == F_Q5_K ? rec + QK5_H + b * 64 : IS_Q5(fmt) ? rec + Q5_H : 0;
            unpack_block(fmt, rec + b * 256, qh, wbuf);
            _tile_loadd(0, a->q + (size_t)r0 * k + blk * QK, k);
            _tile_loadd(1, wbuf, 64);
            _tile_zero(2);
            _tile_dpbsud(2, 0, 1);
            _tile_stored(2, sums, 64);
            __m512 D, M;
            if (IS_Q4(fmt) || IS_Q5(fmt)) {
                D = LOADH(rec + Q4_D);
                M = LOADH(rec + Q4_M);
            } else if (fmt == F_Q8_0) {
                D = LOADH(rec + Q8_D);
                M = _mm512_setzero_ps();
            } else {
                D = MUL(LOADH(rec + QK4_D), LOADU8F(rec + QK4_SC + b * 16));
                M = MUL(LOADH(rec + QK4_DMIN), LOADU8F(rec + QK4_M + b * 16));
            }
            for (int r = 0; r < AMX_ROWS; r++) {
                const size_t ri = (size_t)(r0 + r) * nb + blk;
                __m512i is = _mm512_load_si512(sums[r]);
                const __m512 dx = SET1F(a->d[ri]);
                if (fmt == F_Q8_0) {
                    is = SUBI(is, SET1I(128 * a->s[ri]));
                    acc[r] = FMA(CVT(is), MUL(D, dx), acc[r]);
                } else {
                    acc[r] = FMA(CVT(is), MUL(D, dx), acc[r]);
                    if (IS_Q4(fmt) || IS_Q5(fmt))
                        acc[r] = FMA(M, SET1F(a->dm[ri]), acc[r]);
                    else
                        acc[r] = FNMA(M, SET1F(a->dm[ri]), acc[r]);
                }
            }
        }
    }
    for (int r = 0; r < AMX_ROWS; r++) STOREF(y + (size_t)r * ldy, acc[r]);
}

static void amx_tiles(int fmt, const uint8_t *w, size_t pstride, int cbeg, int cend, int nrec, const acts_t *a,
                      int big, int k, float *y, int n) {
    amx_configure();
    for (int c = cbeg; c < cend; c++) {
        for (int r0 = 0; r0 < big; r0 += AMX_ROWS) {
            if ((c + 1) * PANEL > n) { /* the padded last panel */
                float tmp[AMX_ROWS][PANEL];
                amx_tile16(fmt, w + (size_t)c * pstride, nrec, a, r0, k, &tmp[0][0], PANEL);
                for (int r = 0; r < AMX_ROWS; r++)
                    for (int o = c * PANEL; o < n; o++) y[(size_t)(r0 + r) * n + o] = tmp[r][o - c * PANEL];
            } else {
                amx_tile16(fmt, w + (size_t)c * pstride, nrec, a, r0, k, y + (size_t)r0 * n + (size_t)c * PANEL, n);
            }
        }
    }
    _tile_release();
}

#include "quant_kernels.h"
