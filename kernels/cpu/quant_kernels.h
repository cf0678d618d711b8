/* The quantized matmuls y (rows, n) = x (rows, k) @ W^T for W in the panel layout (quant_layout.h), written once
 * over vector primitives that each ISA's source defines before including this file (quant_avx2.c,
 * quant_avxvnni.c, quant_avx512vnni.c, quant_amx.c): one vector holds LANES int32 / float lanes, one per output.
 *
 * Two modes:
 *  - int8 (llama.cpp's scheme): each activation row is quantized per block of 32 to int8 with one float scale
 *    (amax / 127, rounded to nearest even), and every block's integer dot products come from the ISA's
 *    instruction (4 unsigned weight bytes x 4 signed activation bytes into one int32 lane: vpdpbusd, or
 *    maddubs + madd); the block's sums are then scaled in float: y += dx (D isum + M xsum). Integer sums are
 *    exact, so every ISA gives the same bits (and a row's result never depends on the other rows of its batch).
 *  - float32 (the exact path): activations stay fp32; each block's weights are widened to fp32 in registers
 *    (w = D q + M, in lanes of (output, 4 consecutive inputs)) and multiplied as they are.
 *
 * Threads: the output columns are split evenly among OpenMP threads (torch's libgomp, already loaded); each
 * thread walks its columns in chunks that stay in cache while every row tile passes over them.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "quant_layout.h"

#ifndef MAXT
#define MAXT 4
#endif
#define NVP (PANEL / LANES) /* vectors per panel: 1 (512-bit) or 2 (256-bit) */
#ifndef GEMM_T
#define GEMM_T 4 /* rows per tile over an unpacked column (accumulators in registers) */
#endif
/* From this many rows a call unpacks each panel once (unpack_panel) and runs its row tiles over that copy; fewer
 * rows, and Q8_0 but where Q8_GEMM_ROWS says (below), keep the vector tiles, which measured faster there
 * (bench/cpu_kernels.py; AVX2 on a Zen 4 EPYC, one thread, weights in cache: from 8 rows Q6_K 1.2-1.3x, Q5_0 1.05-1.1x,
 * Q4_x 1.0-1.07x; at 2-4 rows 0.6-0.9x; Q8_0 0.7-0.9x at every count). */
#ifndef GEMM_MIN_ROWS
#define GEMM_MIN_ROWS 8
#endif
/* The GEMM unpacks and multiplies a panel this many blocks of inputs at a time (rounded to whole records), so the
 * unpacked chunk and its rows' activations stay near the core: over all of a Q6_K down matrix's 8,192 inputs at once
 * (160 KiB unpacked, 128 KiB of 16 rows' activations) the tiles read from L2 (bench/cpu_kernels.py --micro). */
#ifndef GEMM_K_BLOCKS
#define GEMM_K_BLOCKS 32
#endif
/* Q8_0 (nothing to unpack: its copy is its bytes) takes the GEMM from Q8_GEMM_ROWS rows where the ISA says so: on
 * AVX-VNNI's 256-bit vectors its 4-row x 2-vector tile, rows innermost, against the vector tiles' 4 x 1 (8192x576,
 * one thread, in cache: 8 rows 0.92-0.99x, 12 1.09x, 16 1.20-1.22x, 32 1.37x). AVX2's sign trick through the GEMM,
 * its weights' half of the trick done once per call: 0.93x at 16 rows; AVX-512's vector tiles are 4 x 2 already:
 * 0.85x. */
#ifndef Q8_GEMM_ROWS
#define Q8_GEMM_ROWS 0 /* never */
#endif
#define USES_GEMM(fmt, rows) \
    ((fmt) == F_Q8_0 ? Q8_GEMM_ROWS > 0 && (rows) >= Q8_GEMM_ROWS : (rows) >= GEMM_MIN_ROWS)
/* Formats whose GEMM tile takes its rows innermost (gemm_tile): one integer sum per row, vector and block */
#ifdef I16_DOT
#define ROWS_INNER(fmt) (IS_Q4(fmt) || (fmt) == F_Q4_K)
#else
#define ROWS_INNER(fmt) (IS_Q4(fmt) || IS_Q5(fmt) || (fmt) == F_Q4_K || (fmt) == F_Q5_K || (fmt) == F_Q8_0)
#endif
/* A vector tile (1-7 rows) fetches each of its panels' records this many bytes ahead into L2 (0: none): the first
 * row tile over a column reads it from memory, where the hardware prefetcher alone, or prefetchnta a few KiB ahead,
 * left the 1B's 1-row step at about half of the read bandwidth (bench/cpu_kernels.py --step, a Zen 4 EPYC, 2
 * threads, AVX2, against prefetchnta 4 KiB ahead: prefetcht2 16 KiB ahead 1.44-1.99x in three runs, 4 rows 1.36-1.44x;
 * 12-32 KiB 1.36-1.50x; prefetcht1 1.31-1.82x; prefetcht0 0.76x; prefetchnta 8 KiB 0.89x). */
#ifndef GEMV_AHEAD
#define GEMV_AHEAD 16384
#endif
#ifdef _OPENMP /* this thread's number and its team's size inside our own parallel regions */
#define THREAD_ID() omp_get_thread_num()
#define TEAM_SIZE() omp_get_num_threads()
#else
#define THREAD_ID() 0
#define TEAM_SIZE() 1
#endif
#define CHUNK_COLS 4        /* vector columns per cache chunk */
#define PARALLEL_MACS (1 << 18) /* multiply-adds below which one thread does the product */


/* Keeps an integer sum in its register, in the order written: without it GCC reassociates a tile's adds into
 * one tree over all of a block's products (the sums are associative), which needs more registers than AVX2 has, and
 * spills every product to the stack (AVX2, a 4-row tile: 16 rows' matmuls 1.17-1.3x faster with it). */
#define KEEP(v) __asm__("" : "+x"(v))

static inline int32_t load_i32(const void *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return v;
}

/* ---- int8 mode ------------------------------------------------------------------------------------------------ */

/* Group j's and group j + 4's values (u8) of vector v of block b: lo, hi. */
#define PAIR(FMT, q, qh, j, lo, hi)                                                                               \
    do {                                                                                                          \
        if ((FMT) == F_Q8_0) {                                                                                    \
            lo = LOADB((q) + (j) * 64);                                                                           \
            hi = LOADB((q) + ((j) + 4) * 64);                                                                     \
        } else {                                                                                                  \
            const VI w_ = LOADB((q) + (j) * 64);                                                                  \
            lo = ANDB(w_, SET1B(0x0F));                                                                           \
            hi = ANDB(SRL16(w_, 4), SET1B(0x0F));                                                                 \
            if ((FMT) == F_Q5_K || IS_Q5(FMT)) {                                                                  \
                lo = ORB(lo, ANDB(SLL16((qh)[0], 4 - (j)), SET1B(0x10)));                                         \
                hi = ORB(hi, ANDB(SRL16((qh)[0], (j)), SET1B(0x10)));                                             \
            } else if ((FMT) == F_Q6_K) {                                                                         \
                if ((j) < 3) {                                                                                    \
                    lo = ORB(lo, ANDB(SLL16((qh)[0], 4 - 2 * (j)), SET1B(0x30)));                                 \
                    hi = ORB(hi, ANDB(SLL16((qh)[1], 4 - 2 * (j)), SET1B(0x30)));                                 \
                } else {                                                                                          \
                    lo = ORB(lo, ANDB(SRL16((qh)[0], 2), SET1B(0x30)));                                           \
                    hi = ORB(hi, ANDB(SRL16((qh)[1], 2), SET1B(0x30)));                                           \
                }                                                                                                 \
            }                                                                                                     \
        }                                                                                                         \
    } while (0)

/* The high bits of block b's values (Q5: 1 bit, Q6_K: 2) for the outputs at byte off of its record, in qh. */
static inline __attribute__((always_inline)) void block_high_bits(const int fmt, const uint8_t *rec, int b, int off,
                                                                  VI qh[2]) {
    if (fmt == F_Q5_K) qh[0] = LOADB(rec + QK5_H + b * 64 + off);
    if (IS_Q5(fmt)) qh[0] = LOADB(rec + Q5_H + off);
    if (fmt == F_Q6_K) {
        qh[0] = LOADB(rec + QK6_H + b * 128 + off);
        qh[1] = LOADB(rec + QK6_H + b * 128 + 64 + off);
    }
}

/* Block b's scale D and offset M as float vectors for the LANES outputs from lane o of its record (int8 mode:
 * y += dx (D isum + M xsum)); Q6_K has no offset, and M is its high half's D; Q8_0's M is zero. */
static inline __attribute__((always_inline)) void block_scales(const int fmt, const uint8_t *rec, int b, int o, VF *D,
                                                               VF *M) {
    *M = ZEROF();
    if (IS_Q4(fmt) || IS_Q5(fmt)) {
        *D = LOADH(rec + Q4_D + 2 * o);
        *M = LOADH(rec + Q4_M + 2 * o);
    } else if (fmt == F_Q8_0) {
        *D = LOADH(rec + Q8_D + 2 * o);
    } else if (fmt == F_Q4_K || fmt == F_Q5_K) {
        *D = MUL(LOADH(rec + QK4_D + 2 * o), LOADU8F(rec + QK4_SC + b * 16 + o));
        *M = MUL(LOADH(rec + QK4_DMIN + 2 * o), LOADU8F(rec + QK4_M + b * 16 + o));
    } else {
        const VF d = LOADH(rec + QK6_D + 2 * o);
        *D = MUL(d, LOADI8F(rec + QK6_SC + (2 * b) * 16 + o));
        *M = MUL(d, LOADI8F(rec + QK6_SC + (2 * b + 1) * 16 + o));
    }
}

/* The 4 chunks of a vector of group values: chunk c = LANES / 4 outputs x 4 inputs, widened to float. */
#define FOR_CHUNKS(BODY) \
    do {                 \
        BODY(0);         \
        BODY(1);         \
        BODY(2);         \
        BODY(3);         \
    } while (0)

/* Block b's float weights as w = D q + M for its low groups (inputs 0..15) and Dh q + Mh for the high ones (16..31),
 * q its unsigned values, for the LANES outputs from lane o of its record (float32 mode; AMX's bf16 panels): each
 * factor in chunk order (Dd[c]: chunk c's outputs, each for its 4 inputs). */
static inline __attribute__((always_inline)) void block_affine(const int fmt, const uint8_t *rec, int b, int o,
                                                               VF Dd[4], VF Md[4], VF Dhd[4], VF Mhd[4]) {
    VF D, M, Dh, Mh;
    if (IS_Q4(fmt) || IS_Q5(fmt)) {
        D = Dh = LOADH(rec + Q4_D + 2 * o);
        M = Mh = LOADH(rec + Q4_M + 2 * o);
    } else if (fmt == F_Q8_0) {
        D = Dh = LOADH(rec + Q8_D + 2 * o);
        M = Mh = MUL(D, SET1F(-128.0f));
    } else if (fmt == F_Q4_K || fmt == F_Q5_K) {
        D = Dh = MUL(LOADH(rec + QK4_D + 2 * o), LOADU8F(rec + QK4_SC + b * 16 + o));
        M = Mh = MUL(MUL(LOADH(rec + QK4_DMIN + 2 * o), LOADU8F(rec + QK4_M + b * 16 + o)), SET1F(-1.0f));
    } else {
        const VF d = LOADH(rec + QK6_D + 2 * o);
        D = MUL(d, LOADI8F(rec + QK6_SC + (2 * b) * 16 + o));
        Dh = MUL(d, LOADI8F(rec + QK6_SC + (2 * b + 1) * 16 + o));
        M = MUL(D, SET1F(-32.0f));
        Mh = MUL(Dh, SET1F(-32.0f));
    }
#define DUPS(C)          \
    Dd[C] = DUP(D, C);   \
    Md[C] = DUP(M, C);   \
    Dhd[C] = DUP(Dh, C); \
    Mhd[C] = DUP(Mh, C);
    FOR_CHUNKS(DUPS);
#undef DUPS
}

static inline __attribute__((always_inline)) void tile_i8(const int fmt, const int T, const int V, const uint8_t *w,
                                                          size_t pstride, int c0, int nrec, const acts_t *a, int r0,
                                                          int k, float *y, int ldy) {
    const int rb = RECORD_BYTES[fmt], sbk = SUPER_BLOCK[fmt] / QK, nb = k / QK;
    VF acc[MAXT][4];
    VI isum[MAXT][4], isumb[MAXT][4];
    const uint8_t *pb[4];
    int hv[4];
#pragma GCC unroll 4
    for (int v = 0; v < V; v++) {
        pb[v] = w + (size_t)((c0 + v) / NVP) * pstride;
        hv[v] = (c0 + v) % NVP;
#pragma GCC unroll 4
        for (int t = 0; t < T; t++) {
            acc[t][v] = ZEROF();
            isum[t][v] = ZEROI();
            isumb[t][v] = ZEROI();
        }
    }
    for (int s = 0; s < nrec; s++) {
        if (GEMV_AHEAD)
#pragma GCC unroll 4
            for (int v = 0; v < V; v++)
                if (v == 0 || hv[v] == 0) /* each panel once */
                    for (int l = 0; l < rb; l += 64) __builtin_prefetch(pb[v] + (size_t)s * rb + GEMV_AHEAD + l, 0, 1);
        for (int b = 0; b < sbk; b++) {
            const int blk = s * sbk + b;
            const uint8_t *qb[4];
            VI qh[4][2];
#pragma GCC unroll 4
            for (int v = 0; v < V; v++) {
                const uint8_t *rec = pb[v] + (size_t)s * rb;
                qb[v] = rec + b * 256 + hv[v] * VBYTES;
                block_high_bits(fmt, rec, b, hv[v] * VBYTES, qh[v]);
            }
#pragma GCC unroll 4
            for (int j = 0; j < 4; j++) {
                VI lo[4], hi[4];
#pragma GCC unroll 4
                for (int v = 0; v < V; v++) PAIR(fmt, qb[v], qh[v], j, lo[v], hi[v]);
#pragma GCC unroll 4
                for (int t = 0; t < T; t++) {
                    const int8_t *xr = a->q + (size_t)(r0 + t) * k + blk * QK;
                    const VI xl = SET1I(load_i32(xr + 4 * j)), xh = SET1I(load_i32(xr + 16 + 4 * j));
#pragma GCC unroll 4
                    for (int v = 0; v < V; v++) {
                        if (fmt == F_Q8_0) {
                            isum[t][v] = DOTQ8(isum[t][v], lo[v], xl);
                            isum[t][v] = DOTQ8(isum[t][v], hi[v], xh);
                        } else if (fmt == F_Q6_K) {
                            isum[t][v] = DOT(isum[t][v], lo[v], xl);
                            isumb[t][v] = DOT(isumb[t][v], hi[v], xh);
                        } else {
                            isum[t][v] = DOT2(isum[t][v], lo[v], xl, hi[v], xh);
                        }
                        KEEP(isum[t][v]);
                        if (fmt == F_Q6_K) KEEP(isumb[t][v]);
                    }
                }
            }
            /* the block's sums, scaled: y += dx (D isum + M xsum) */
#pragma GCC unroll 4
            for (int v = 0; v < V; v++) {
                const uint8_t *rec = pb[v] + (size_t)s * rb;
                const int o = hv[v] * LANES;
                VF D, M; /* Q6_K: M is the high half's D */
                block_scales(fmt, rec, b, o, &D, &M);
#pragma GCC unroll 4
                for (int t = 0; t < T; t++) {
                    const size_t ri = (size_t)(r0 + t) * nb + blk;
                    const VF dx = SET1F(a->d[ri]);
                    if (fmt == F_Q8_0) {
                        VI is = isum[t][v];
                        if (Q8_FIXUP) is = SUBI(is, SET1I(128 * a->s[ri])); /* unsigned weights: u = q + 128 */
                        acc[t][v] = FMA(CVT(is), MUL(D, dx), acc[t][v]);
                    } else if (fmt == F_Q6_K) {
                        const VI ia = SUBI(isum[t][v], SET1I(32 * a->s16[2 * ri]));
                        const VI ib = SUBI(isumb[t][v], SET1I(32 * a->s16[2 * ri + 1]));
                        acc[t][v] = FMA(CVT(ia), MUL(D, dx), acc[t][v]);
                        acc[t][v] = FMA(CVT(ib), MUL(M, dx), acc[t][v]);
                        isumb[t][v] = ZEROI();
                    } else {
                        acc[t][v] = FMA(CVT(isum[t][v]), MUL(D, dx), acc[t][v]);
                        if (IS_Q4(fmt) || IS_Q5(fmt))
                            acc[t][v] = FMA(M, SET1F(a->dm[ri]), acc[t][v]);
                        else
                            acc[t][v] = FNMA(M, SET1F(a->dm[ri]), acc[t][v]);
                    }
                    isum[t][v] = ZEROI();
                }
            }
        }
    }
#pragma GCC unroll 4
    for (int t = 0; t < T; t++)
#pragma GCC unroll 4
        for (int v = 0; v < V; v++) STOREF(y + (size_t)t * ldy + v * LANES, acc[t][v]);
}


/* ---- int8 mode, 2 rows and more: each weight block unpacked once per call ------------------------------------ */

/* V vector columns from c (a panel, or the part of one a thread owns: 256-bit vectors hold half a panel) unpacked
 * once into `ub` (per block and vector: its 8 group vectors of values, lo j = 0..3 then hi j = 0..3) and their block
 * scales into `sc` (per block and vector: D, then M or Q6_K's second D, as float vectors computed as tile_i8
 * computes them), so every row tile of the step multiplies from L1/L2 without unpacking again, and each
 * activation broadcast serves the V vectors. */
static inline __attribute__((always_inline)) void unpack_panel(const int fmt, const int V, const uint8_t *w,
                                                               size_t pstride, int c, int s0, int s1, uint8_t *ub,
                                                               float *sc) {
    const int rb = RECORD_BYTES[fmt], sbk = SUPER_BLOCK[fmt] / QK;
    const uint8_t *pb = w + (size_t)(c / NVP) * pstride;
    for (int s = s0; s < s1; s++) {
        const uint8_t *rec = pb + (size_t)s * rb;
        if (s + 1 < s1) __builtin_prefetch(rec + rb, 0, 0);
        for (int b = 0; b < sbk; b++) {
            const int blk = (s - s0) * sbk + b;
#pragma GCC unroll 2
            for (int v = 0; v < V; v++) {
                const int hv = (c + v) % NVP, o = hv * LANES;
                const uint8_t *qb = rec + b * 256 + hv * VBYTES;
                VI qh[2];
                block_high_bits(fmt, rec, b, hv * VBYTES, qh);
                uint8_t *dst = ub + ((size_t)blk * V + v) * 8 * VBYTES;
#pragma GCC unroll 4
                for (int j = 0; j < 4; j++) {
                    VI lo, hi;
                    PAIR(fmt, qb, qh, j, lo, hi);
                    STOREB(dst + j * VBYTES, lo);
                    STOREB(dst + (4 + j) * VBYTES, hi);
                }
                VF D, M;
                block_scales(fmt, rec, b, o, &D, &M);
                float *sv = sc + ((size_t)blk * V + v) * 2 * LANES;
                STOREF(sv, D);
                STOREF(sv + LANES, M);
            }
        }
    }
}

/* T rows x V vectors from unpack_panel's buffers (blocks blk0 .. blk0 + nblk - 1 of the rows, the buffers' 0 ..
 * nblk - 1): per block, the same integer sums and the same float steps, in the same order, as tile_i8 (so the same
 * bits). resume: the sums so far are in y (the blocks before blk0), carried on from there. */
static inline __attribute__((always_inline)) void gemm_tile(const int fmt, const int T, const int V, const uint8_t *ub,
                                                            const float *sc, int blk0, int nblk, const acts_t *a,
                                                            int r0, int k, float *y, int ldy, int resume) {
    const int nb = k / QK;
    a = &(acts_t){a->q + blk0 * QK, a->d + blk0, a->dm + blk0, a->s + blk0, a->s16 + 2 * blk0};
    VF acc[GEMM_T][2];
#pragma GCC unroll 8
    for (int t = 0; t < T; t++)
#pragma GCC unroll 2
        for (int v = 0; v < V; v++) acc[t][v] = resume ? LOADF(y + (size_t)t * ldy + v * LANES) : ZEROF();
    if (ROWS_INNER(fmt)) {
        /* rows innermost: each weight vector loaded once for the tile's T rows instead of once a row (half the
         * loads of a block), a sum per row and vector across the whole block (AVX2: 4-bit weights, whose 8
         * products fit one int16 sum; VNNI: any 4- or 5-bit weights, and Q8_0 where it takes the GEMM) */
        for (int blk = 0; blk < nblk; blk++) {
            const uint8_t *wb = ub + (size_t)blk * V * 8 * VBYTES;
            const float *sb = sc + (size_t)blk * V * 2 * LANES;
            VI bs[GEMM_T][2];
#pragma GCC unroll 8
            for (int t = 0; t < T; t++)
#pragma GCC unroll 2
                for (int v = 0; v < V; v++) bs[t][v] = ZEROI();
#pragma GCC unroll 4
            for (int j = 0; j < 4; j++) {
                VI lo[2], hi[2];
#pragma GCC unroll 2
                for (int v = 0; v < V; v++) {
                    lo[v] = LOADB(wb + v * 8 * VBYTES + j * VBYTES);
                    hi[v] = LOADB(wb + v * 8 * VBYTES + (4 + j) * VBYTES);
                }
#pragma GCC unroll 8
                for (int t = 0; t < T; t++) {
                    const int8_t *xr = a->q + (size_t)(r0 + t) * k + blk * QK;
                    const VI xl = SET1I(load_i32(xr + 4 * j)), xh = SET1I(load_i32(xr + 16 + 4 * j));
#pragma GCC unroll 2
                    for (int v = 0; v < V; v++) {
#ifdef I16_DOT
                        bs[t][v] = I16_DOT(I16_DOT(bs[t][v], lo[v], xl), hi[v], xh);
#else
                        if (fmt == F_Q8_0)
                            bs[t][v] = DOTQ8(DOTQ8(bs[t][v], lo[v], xl), hi[v], xh);
                        else
                            bs[t][v] = DOT2(bs[t][v], lo[v], xl, hi[v], xh);
#endif
                        KEEP(bs[t][v]);
                    }
                }
            }
#pragma GCC unroll 8
            for (int t = 0; t < T; t++) {
                const size_t ri = (size_t)(r0 + t) * nb + blk;
                const VF dx = SET1F(a->d[ri]);
#pragma GCC unroll 2
                for (int v = 0; v < V; v++) {
                    const VF D = LOADF(sb + v * 2 * LANES), M = LOADF(sb + v * 2 * LANES + LANES);
#ifdef I16_DOT
                    const VI is = I16_WIDEN(ZEROI(), bs[t][v]);
#else
                    VI is = bs[t][v];
                    if (fmt == F_Q8_0 && Q8_FIXUP) is = SUBI(is, SET1I(128 * a->s[ri]));
#endif
                    acc[t][v] = FMA(CVT(is), MUL(D, dx), acc[t][v]);
                    if (IS_Q4(fmt) || IS_Q5(fmt))
                        acc[t][v] = FMA(M, SET1F(a->dm[ri]), acc[t][v]);
                    else if (fmt != F_Q8_0) /* Q8_0: no offset */
                        acc[t][v] = FNMA(M, SET1F(a->dm[ri]), acc[t][v]);
                }
            }
        }
    } else
    for (int blk = 0; blk < nblk; blk++) {
        const uint8_t *wb = ub + (size_t)blk * V * 8 * VBYTES;
        const float *sb = sc + (size_t)blk * V * 2 * LANES;
#pragma GCC unroll 8
        for (int t = 0; t < T; t++) {
            const int8_t *xr = a->q + (size_t)(r0 + t) * k + blk * QK;
            const size_t ri = (size_t)(r0 + t) * nb + blk;
            VI isum[2], isumb[2];
#pragma GCC unroll 2
            for (int v = 0; v < V; v++) isum[v] = isumb[v] = ZEROI();
#ifdef I16_DOT
            if (fmt != F_Q8_0) { /* int16 sums, widened once per run (see quant_avx2.c for the bounds) */
                const int run = fmt == F_Q6_K ? 2 : (IS_Q5(fmt) || fmt == F_Q5_K) ? 2 : 4; /* j per widening */
                VI s16[2], s16b[2];
#pragma GCC unroll 2
                for (int v = 0; v < V; v++) s16[v] = s16b[v] = I16_ZERO();
#pragma GCC unroll 4
                for (int j = 0; j < 4; j++) {
                    const VI xl = SET1I(load_i32(xr + 4 * j)), xh = SET1I(load_i32(xr + 16 + 4 * j));
#pragma GCC unroll 2
                    for (int v = 0; v < V; v++) {
                        const uint8_t *wv = wb + v * 8 * VBYTES;
                        s16[v] = I16_DOT(s16[v], LOADB(wv + j * VBYTES), xl);
                        if (fmt == F_Q6_K)
                            s16b[v] = I16_DOT(s16b[v], LOADB(wv + (4 + j) * VBYTES), xh);
                        else
                            s16[v] = I16_DOT(s16[v], LOADB(wv + (4 + j) * VBYTES), xh);
                        KEEP(s16[v]);
                        if (fmt == F_Q6_K) KEEP(s16b[v]);
                        if ((j + 1) % run == 0) {
                            isum[v] = I16_WIDEN(isum[v], s16[v]);
                            s16[v] = I16_ZERO();
                            if (fmt == F_Q6_K) {
                                isumb[v] = I16_WIDEN(isumb[v], s16b[v]);
                                s16b[v] = I16_ZERO();
                            }
                        }
                    }
                }
            } else
#endif
#pragma GCC unroll 4
            for (int j = 0; j < 4; j++) {
                const VI xl = SET1I(load_i32(xr + 4 * j)), xh = SET1I(load_i32(xr + 16 + 4 * j));
#pragma GCC unroll 2
                for (int v = 0; v < V; v++) {
                    const uint8_t *wv = wb + v * 8 * VBYTES;
                    const VI lo = LOADB(wv + j * VBYTES), hi = LOADB(wv + (4 + j) * VBYTES);
                    if (fmt == F_Q8_0) {
                        isum[v] = DOTQ8(isum[v], lo, xl);
                        isum[v] = DOTQ8(isum[v], hi, xh);
                    } else if (fmt == F_Q6_K) {
                        isum[v] = DOT(isum[v], lo, xl);
                        isumb[v] = DOT(isumb[v], hi, xh);
                    } else {
                        isum[v] = DOT2(isum[v], lo, xl, hi, xh);
                    }
                    KEEP(isum[v]);
                    if (fmt == F_Q6_K) KEEP(isumb[v]);
                }
            }
            const VF dx = SET1F(a->d[ri]);
#pragma GCC unroll 2
            for (int v = 0; v < V; v++) {
                const VF D = LOADF(sb + v * 2 * LANES), M = LOADF(sb + v * 2 * LANES + LANES);
                if (fmt == F_Q8_0) {
                    VI is = isum[v];
                    if (Q8_FIXUP) is = SUBI(is, SET1I(128 * a->s[ri]));
                    acc[t][v] = FMA(CVT(is), MUL(D, dx), acc[t][v]);
                } else if (fmt == F_Q6_K) {
                    const VI ia = SUBI(isum[v], SET1I(32 * a->s16[2 * ri]));
                    const VI ib = SUBI(isumb[v], SET1I(32 * a->s16[2 * ri + 1]));
                    acc[t][v] = FMA(CVT(ia), MUL(D, dx), acc[t][v]);
                    acc[t][v] = FMA(CVT(ib), MUL(M, dx), acc[t][v]);
                } else {
                    acc[t][v] = FMA(CVT(isum[v]), MUL(D, dx), acc[t][v]);
                    if (IS_Q4(fmt) || IS_Q5(fmt))
                        acc[t][v] = FMA(M, SET1F(a->dm[ri]), acc[t][v]);
                    else
                        acc[t][v] = FNMA(M, SET1F(a->dm[ri]), acc[t][v]);
                }
            }
        }
    }
#pragma GCC unroll 8
    for (int t = 0; t < T; t++)
#pragma GCC unroll 2
        for (int v = 0; v < V; v++) STOREF(y + (size_t)t * ldy + v * LANES, acc[t][v]);
}

/* ---- float32 mode --------------------------------------------------------------------------------------------- */

static inline __attribute__((always_inline)) void tile_f32(const int fmt, const int T, const uint8_t *w,
                                                           size_t pstride, int c0, int nrec, const float *x, int r0,
                                                           int k, float *y, int ldy) {
    const int rb = RECORD_BYTES[fmt], sbk = SUPER_BLOCK[fmt] / QK;
    const uint8_t *pb = w + (size_t)(c0 / NVP) * pstride;
    const int hv = c0 % NVP, o = hv * LANES;
    VF acc[MAXT][4];
#pragma GCC unroll 4
    for (int t = 0; t < T; t++) acc[t][0] = acc[t][1] = acc[t][2] = acc[t][3] = ZEROF();
    for (int s = 0; s < nrec; s++) {
        const uint8_t *rec = pb + (size_t)s * rb;
        for (int b = 0; b < sbk; b++) {
            const int blk = s * sbk + b;
            const uint8_t *qb = rec + b * 256 + hv * VBYTES;
            VI qh[2];
            block_high_bits(fmt, rec, b, hv * VBYTES, qh);
            VF Dd[4], Md[4], Dhd[4], Mhd[4];
            block_affine(fmt, rec, b, o, Dd, Md, Dhd, Mhd);
#pragma GCC unroll 4
            for (int j = 0; j < 4; j++) {
                VI lo, hi;
                PAIR(fmt, qb, qh, j, lo, hi);
#define MAC(C)                                                                                        \
    {                                                                                                 \
        const VF wl = FMA(CHUNKF(lo, C), Dd[C], Md[C]), wh = FMA(CHUNKF(hi, C), Dhd[C], Mhd[C]);      \
        for (int t = 0; t < T; t++) {                                                                 \
            const float *xr = x + (size_t)(r0 + t) * k + blk * QK;                                    \
            acc[t][C] = FMA(wl, XPAT(xr + 4 * j), acc[t][C]);                                         \
            acc[t][C] = FMA(wh, XPAT(xr + 16 + 4 * j), acc[t][C]);                                    \
        }                                                                                             \
    }
                FOR_CHUNKS(MAC);
#undef MAC
            }
        }
    }
    /* lanes (output, input i of 4) -> outputs: ((i0 + i1) + (i2 + i3)), the same order for every row */
    for (int t = 0; t < T; t++) {
        float buf[4][LANES];
        for (int c = 0; c < 4; c++) STOREF(buf[c], acc[t][c]);
        for (int c = 0; c < 4; c++)
            for (int u = 0; u < LANES / 4; u++)
                y[(size_t)t * ldy + c * (LANES / 4) + u] =
                    (buf[c][4 * u] + buf[c][4 * u + 1]) + (buf[c][4 * u + 2] + buf[c][4 * u + 3]);
    }
}

/* ---- instantiation and the driver ------------------------------------------------------------------------------ */

typedef void (*tile_i8_fn)(const uint8_t *, size_t, int, int, const acts_t *, int, int, float *, int);
typedef void (*tile_f32_fn)(const uint8_t *, size_t, int, int, const float *, int, int, float *, int);

#define DEF_I8(F, T, V)                                                                                     \
    static void ti8_##F##_##T##_##V(const uint8_t *w, size_t ps, int c0, int nrec, const acts_t *a, int r0, \
                                    int k, float *y, int ldy) {                                             \
        tile_i8(F, T, V, w, ps, c0, nrec, a, r0, k, y, ldy);                                                \
    }
#define DEF_F32(F, T)                                                                                       \
    static void tf32_##F##_##T(const uint8_t *w, size_t ps, int c0, int nrec, const float *x, int r0, int k, \
                               float *y, int ldy) {                                                         \
        tile_f32(F, T, w, ps, c0, nrec, x, r0, k, y, ldy);                                                  \
    }
/* Only the tile shapes this ISA's width_for asks for are made (each is fully unrolled: compile time). */
#if VMAX_I8(1) >= 4
#define DEF_I8_WIDE1(F) DEF_I8(F, 1, 4)
#define I8_WIDE1(F) ti8_##F##_1_4
#else
#define DEF_I8_WIDE1(F)
#define I8_WIDE1(F) 0
#endif
#if VMAX_I8(2) >= 4
#define DEF_I8_WIDE2(F) DEF_I8(F, 2, 4)
#define I8_WIDE2(F) ti8_##F##_2_4
#else
#define DEF_I8_WIDE2(F)
#define I8_WIDE2(F) 0
#endif
#if VMAX_I8(3) >= 2
#define DEF_I8_TALL(F, T) DEF_I8(F, T, 2)
#define I8_TALL(F, T) ti8_##F##_##T##_2
#else
#define DEF_I8_TALL(F, T)
#define I8_TALL(F, T) 0
#endif
#if TMAX_F32 >= 3
#define DEF_F32_TALL(F) DEF_F32(F, 3) DEF_F32(F, 4)
#define F32_TALL(F) tf32_##F##_3, tf32_##F##_4
#else
#define DEF_F32_TALL(F)
#define F32_TALL(F) 0, 0
#endif
#define DEF_FMT(F)                                                                                          \
    DEF_I8(F, 1, 1) DEF_I8(F, 1, 2) DEF_I8_WIDE1(F) DEF_I8(F, 2, 1) DEF_I8(F, 2, 2) DEF_I8_WIDE2(F)         \
    DEF_I8(F, 3, 1) DEF_I8_TALL(F, 3) DEF_I8(F, 4, 1) DEF_I8_TALL(F, 4)                                      \
    DEF_F32(F, 1) DEF_F32(F, 2) DEF_F32_TALL(F)
DEF_FMT(1) /* Q4_0 and Q4_1 share one kernel (Q4_0's m is -8 d), Q5_0 and Q5_1 another */
DEF_FMT(2)
DEF_FMT(3)
DEF_FMT(4)
DEF_FMT(5)
DEF_FMT(6)

typedef void (*unpack_fn)(const uint8_t *, size_t, int, int, int, uint8_t *, float *);
typedef void (*gemm_fn)(const uint8_t *, const float *, int, int, const acts_t *, int, int, float *, int, int);
#define DEF_GEMM_T(F, T, V)                                                                                 \
    static void gemm_##F##_##T##_##V(const uint8_t *ub, const float *sc, int blk0, int nblk, const acts_t *a, \
                                     int r0, int k, float *y, int ldy, int resume) {                        \
        gemm_tile(F, T, V, ub, sc, blk0, nblk, a, r0, k, y, ldy, resume);                                   \
    }
#define DEF_GEMM_V(F, V)                                                                                    \
    static void unpack_##F##_##V(const uint8_t *w, size_t ps, int c, int s0, int s1, uint8_t *ub, float *sc) { \
        unpack_panel(F, V, w, ps, c, s0, s1, ub, sc);                                                       \
    }                                                                                                       \
    DEF_GEMM_T(F, 1, V) DEF_GEMM_T(F, 2, V) DEF_GEMM_T(F, 3, V) DEF_GEMM_T(F, 4, V)
#if NVP > 1
#define DEF_GEMM(F) DEF_GEMM_V(F, 1) DEF_GEMM_V(F, 2)
#define GEMM_V2(F, T) gemm_##F##_##T##_2
#define UNPACK_V2(F) unpack_##F##_2
#else
#define DEF_GEMM(F) DEF_GEMM_V(F, 1)
#define GEMM_V2(F, T) 0
#define UNPACK_V2(F) 0
#endif
DEF_GEMM(1)
DEF_GEMM(2)
DEF_GEMM(3)
DEF_GEMM(4)
DEF_GEMM(5)
DEF_GEMM(6)
#define GEMM_ROW(F)                                                                                          \
    {{0, gemm_##F##_1_1, gemm_##F##_2_1, gemm_##F##_3_1, gemm_##F##_4_1},                                     \
     {0, GEMM_V2(F, 1), GEMM_V2(F, 2), GEMM_V2(F, 3), GEMM_V2(F, 4)}}
#define UNPACK_ROW(F) {unpack_##F##_1, UNPACK_V2(F)}
/* [fmt][V - 1] and [fmt][V - 1][T] */
static const unpack_fn UNPACK[F_COUNT][2] = {UNPACK_ROW(1), UNPACK_ROW(1), UNPACK_ROW(2), UNPACK_ROW(3),
                                             UNPACK_ROW(4), UNPACK_ROW(5), UNPACK_ROW(6), UNPACK_ROW(6)};
static const gemm_fn GEMM[F_COUNT][2][GEMM_T + 1] = {GEMM_ROW(1), GEMM_ROW(1), GEMM_ROW(2), GEMM_ROW(3),
                                                     GEMM_ROW(4), GEMM_ROW(5), GEMM_ROW(6), GEMM_ROW(6)};

/* [fmt][T][V]: V 1, 2, 4 at index 0, 1, 2 (0 where the tile shape is not made) */
#define I8_ROW(F)                                                                                           \
    {{0, 0, 0},                                                                                             \
     {ti8_##F##_1_1, ti8_##F##_1_2, I8_WIDE1(F)},                                                           \
     {ti8_##F##_2_1, ti8_##F##_2_2, I8_WIDE2(F)},                                                           \
     {ti8_##F##_3_1, I8_TALL(F, 3), 0},                                                                     \
     {ti8_##F##_4_1, I8_TALL(F, 4), 0}}
static const tile_i8_fn TILES_I8[F_COUNT][5][3] = {I8_ROW(1), I8_ROW(1), I8_ROW(2), I8_ROW(3),
                                                   I8_ROW(4), I8_ROW(5), I8_ROW(6), I8_ROW(6)};
#define F32_ROW(F) {0, tf32_##F##_1, tf32_##F##_2, F32_TALL(F)}
static const tile_f32_fn TILES_F32[F_COUNT][5] = {F32_ROW(1), F32_ROW(1), F32_ROW(2), F32_ROW(3), F32_ROW(4),
                                                  F32_ROW(5), F32_ROW(6), F32_ROW(6)};

static inline void quantize_row(const float *x, int r, int k, acts_t *a) {
    const int nb = k / QK;
    for (int b = 0; b < nb; b++) {
        const size_t i = (size_t)r * nb + b;
        int32_t s0, s1;
        QUANT_BLOCK(x + (size_t)r * k + b * QK, a->q + (size_t)r * k + b * QK, &a->d[i], &s0, &s1);
        a->s16[2 * i] = s0;
        a->s16[2 * i + 1] = s1;
        a->s[i] = s0 + s1;
        a->dm[i] = a->d[i] * (float)(s0 + s1);
    }
}

/* A region that would run on one thread is a plain call, never `omp parallel if (0)`: libgomp makes a team of one
 * for that, with a futex call (measured 0.6 us each; a SmolLM2 step made ~150 of them at one row). */
static void quantize_rows(const float *x, int rows, int k, acts_t *a, int threads) {
    if (rows >= 8 && threads > 1) {
#pragma omp parallel for num_threads(threads) schedule(static)
        for (int r = 0; r < rows; r++) quantize_row(x, r, k, a);
    } else {
        for (int r = 0; r < rows; r++) quantize_row(x, r, k, a);
    }
}

#ifndef BIG_ROWS /* no 16-row tiles in this ISA */
#define BIG_ROWS(fmt, mode, rows) 0
#define BIG_TILES(fmt, w, pstride, cbeg, cend, nrec, a, big, k, y, n) (void)0
#endif

#define CAT_(a, b) a##_##b
#define CAT(a, b) CAT_(a, b)

/* The largest tile width (vector columns) for a tile of t rows, by mode. */
static inline int width_for(int mode, int t) { return mode == 0 ? VMAX_I8(t) : 1; }

/* Share `id` of `nt` of the output columns (id 0 of 1: all of them). The caller says which, so a call outside our
 * own region never takes an enclosing team's numbers. */
static void matmul_share(int id, int nt, int fmt, int mode, const float *x, int rows, int k, const uint8_t *w, int n,
                         float *y, int nrec, int ncols, size_t pstride, const acts_t *a, int big, int tiles) {
    const int rest = rows - big;
    const int cbeg = (int)((long)ncols * id / nt), cend = (int)((long)ncols * (id + 1) / nt);
    if (big > 0 && cbeg < cend) BIG_TILES(fmt, w, pstride, cbeg, cend, nrec, a, big, k, y, n);
    /* 8 rows and more: each panel (the thread's share of it) unpacked once, a chunk of its inputs at a time, then
     * every row tile multiplies from that copy */
    const int sbk = SUPER_BLOCK[fmt] / QK;
    const int crec = GEMM_K_BLOCKS / sbk > 0 ? GEMM_K_BLOCKS / sbk : 1, chunks = (nrec + crec - 1) / crec;
    uint8_t *ub = 0;
    float *sc = 0, *yb = 0;
    if (mode == 0 && USES_GEMM(fmt, rest) && cbeg < cend) {
        const size_t cblk = (size_t)(crec < nrec ? crec : nrec) * sbk, wbytes = cblk * NVP * 8 * VBYTES;
        const size_t sbytes = cblk * NVP * 2 * LANES * sizeof(float);
        ub = (uint8_t *)aligned_alloc(64, wbytes + sbytes + (chunks > 1 ? (size_t)rest * NVP * LANES * sizeof(float)
                                                                         : 0));
        sc = ub ? (float *)(ub + wbytes) : 0;
        yb = ub && chunks > 1 ? (float *)(ub + wbytes + sbytes) : 0;
    }
    const int gtiles = (rest + GEMM_T - 1) / GEMM_T;
    for (int c = cbeg; ub && c < cend;) {
        int v = NVP - c % NVP; /* to the end of this panel */
        if (v > cend - c) v = cend - c;
        /* the next panel's records are fetched into L2 while the row tiles multiply this one (a share before
         * each tile), so its unpacking does not wait on memory: without, memory idles while we multiply and
         * the core idles while we read (16 rows streamed ran at a third of the speed with weights in cache) */
        const uint8_t *next = c + v < cend ? w + (size_t)((c + v) / NVP) * pstride : 0;
        const size_t lines = next ? (pstride + 63) / 64 : 0, steps = (size_t)chunks * gtiles;
        const int partial = (c + v) * LANES > n;
        for (int ch = 0; ch < chunks; ch++) {
            const int s0 = ch * crec, s1 = s0 + crec < nrec ? s0 + crec : nrec;
            UNPACK[fmt][v - 1](w, pstride, c, s0, s1, ub, sc);
            for (int i = 0, r0 = big; i < gtiles; i++) {
                const int t = rest / gtiles + (i < rest % gtiles);
                const size_t step = (size_t)ch * gtiles + i;
                for (size_t l = lines * step / steps; l < lines * (step + 1) / steps; l++)
                    __builtin_prefetch(next + l * 64, 0, 2);
                float tmp[GEMM_T * 2 * LANES];
                /* several chunks: each tile's sums wait in yb between them (a float stored and loaded back is the
                 * same float, so the bits are those of one pass) */
                float *yt = yb ? yb + (size_t)(r0 - big) * v * LANES
                               : partial ? tmp : y + (size_t)r0 * n + (size_t)c * LANES;
                const int ldy = yb || partial ? v * LANES : n;
                GEMM[fmt][v - 1][t](ub, sc, s0 * sbk, (s1 - s0) * sbk, a, r0, k, yt, ldy, ch > 0);
                if (partial || yb) {
                    const int o1 = (c + v) * LANES < n ? (c + v) * LANES : n;
                    if (!yb || ch == chunks - 1)
                        for (int r = 0; r < t; r++)
                            memcpy(y + (size_t)(r0 + r) * n + c * LANES, yt + (size_t)r * ldy,
                                   (size_t)(o1 - c * LANES) * sizeof(float));
                }
                r0 += t;
            }
        }
        c += v;
    }
    for (int cc = cbeg; cc < cend && tiles > 0 && !ub; cc += CHUNK_COLS) {
        const int cstop = cc + CHUNK_COLS < cend ? cc + CHUNK_COLS : cend;
        for (int i = 0, r0 = big; i < tiles; i++) {
            const int t = rest / tiles + (i < rest % tiles);
            for (int c = cc; c < cstop;) {
                int v = width_for(mode, t);
                while (v > cstop - c) v >>= 1;
                float tmp[MAXT * 4 * LANES];
                const int partial = (c + v) * LANES > n;
                float *yt = partial ? tmp : y + (size_t)r0 * n + (size_t)c * LANES;
                const int ldy = partial ? v * LANES : n;
                if (mode == 0)
                    TILES_I8[fmt][t][v == 4 ? 2 : v - 1](w, pstride, c, nrec, a, r0, k, yt, ldy);
                else
                    TILES_F32[fmt][t](w, pstride, c, nrec, x, r0, k, yt, ldy);
                if (partial)
                    for (int r = 0; r < t; r++)
                        for (int o = c * LANES; o < n; o++) y[(size_t)(r0 + r) * n + o] = tmp[r * ldy + o - c * LANES];
                c += v;
            }
            r0 += t;
        }
    }
    free(ub);
}

/* y (rows, n) = x (rows, k) @ W^T, W (n, k) in format fmt; mode 0: int8 activations, 1: float32. Returns 0, or
 * a negative number for arguments the kernels cannot take. */
int CAT(ISA, matmul)(int fmt, int mode, const float *x, int rows, int k, const uint8_t *w, int n, float *y,
                     int threads) {
    if (fmt < 0 || fmt >= F_COUNT || (mode != 0 && mode != 1) || rows <= 0 || n <= 0 || k <= 0) return -1;
    if (k % SUPER_BLOCK[fmt]) return -2;
    const int nrec = k / SUPER_BLOCK[fmt], panels = (n + PANEL - 1) / PANEL, ncols = panels * NVP;
    const size_t pstride = (size_t)nrec * RECORD_BYTES[fmt];
    const int tmax = mode == 0 ? MAXT : TMAX_F32;
#ifdef WIDE_MATMUL /* an ISA's own product for many rows (AMX: bf16 tiles); 1 where it declines */
    if (WIDE_MATMUL(fmt, mode, x, rows, k, w, n, y, threads) == 0) return 0;
#endif
    acts_t a = {0};
    void *buf = 0;
    if (mode == 0) {
        const size_t nb = (size_t)rows * (k / QK);
        buf = malloc((size_t)rows * k + nb * (2 * sizeof(float) + 3 * sizeof(int32_t)) + 64);
        if (!buf) return -3;
        a.d = (float *)buf;
        a.dm = a.d + nb;
        a.s = (int32_t *)(a.dm + nb);
        a.s16 = a.s + nb;
        a.q = (int8_t *)(a.s16 + 2 * nb);
        quantize_rows(x, rows, k, &a, threads);
    }
    /* an ISA with 16-row tiles (AMX) takes the rows in whole 16s; the rest go through the vector tiles */
    const int big = BIG_ROWS(fmt, mode, rows), rest = rows - big;
    const int tiles = rest > 0 ? (rest + tmax - 1) / tmax : 0; /* row tiles as even as they can be */
    /* a small product runs on one thread: waking a second costs more than it saves (and, on a shared CPU, a
     * descheduled thread holds the barrier for a time slice) */
    if (threads > 1 && (double)rows * n * k >= PARALLEL_MACS) {
#pragma omp parallel num_threads(threads)
        matmul_share(THREAD_ID(), TEAM_SIZE(), fmt, mode, x, rows, k, w, n, y, nrec, ncols, pstride, &a, big, tiles);
    } else {
        matmul_share(0, 1, fmt, mode, x, rows, k, w, n, y, nrec, ncols, pstride, &a, big, tiles);
    }
    free(buf);
    return 0;
}

/* out (count, k): rows ids[] of W dequantized to float32, gguf's numbers exactly. */
int CAT(ISA, rows)(int fmt, const uint8_t *w, int n, int k, const int64_t *ids, int count, float *out) {
    return layout_rows(fmt, w, n, k, ids, count, out);
}

/* Activation quantization alone (tests compare it with the Python reference). */
int CAT(ISA, quantize)(const float *x, int rows, int k, int8_t *q, float *d, int32_t *s16) {
    if (k % QK) return -1;
    const int nb = k / QK;
    for (int r = 0; r < rows; r++)
        for (int b = 0; b < nb; b++) {
            const size_t i = (size_t)r * nb + b;
            QUANT_BLOCK(x + (size_t)r * k + b * QK, q + (size_t)r * k + b * QK, &d[i], &s16[2 * i], &s16[2 * i + 1]);
        }
    return 0;
}

#include "quant_attention.h"
#include "quant_eltwise.h"
