/* The weight layout the CPU kernels read (kernels/cpu_layout.py says why, and packs it): GGUF block formats in
 * panels of 16 output rows, one record per super-block of SB inputs per panel, records of a panel consecutive.
 * Within a record each block of 32 inputs keeps its weights as "group rows" of 64 bytes, byte 4 o + i = input
 * 4 j + i of output o; 4-bit values two to a byte (group j low nibble, group j + 4 high nibble). */
#ifndef QUANT_LAYOUT_H
#define QUANT_LAYOUT_H

#include <stddef.h>
#include <stdint.h>

#define PANEL 16
#define QK 32
#define QK_K 256

enum { F_Q4_0 = 0, F_Q4_1 = 1, F_Q8_0 = 2, F_Q4_K = 3, F_Q5_K = 4, F_Q6_K = 5, F_Q5_0 = 6, F_Q5_1 = 7, F_COUNT = 8 };

/* Q4_0, Q4_1: q[4][64] | d fp16[16] | m fp16[16]                       w = d q + m */
#define Q4_RB 320
#define Q4_D 256
#define Q4_M 288
/* Q5_0, Q5_1: Q4's record | qh[64] (bit j: 5th bit of group j's value)   w = d q + m (Q5_0: m = -16 d) */
#define Q5_RB 384
#define Q5_H 320
/* Q8_0: q[8][64] (u8 = q + 128) | d fp16[16]                          w = d (u - 128) */
#define Q8_RB 544
#define Q8_D 512
/* Q4_K: q[8][4][64] | d fp16[16] | dmin fp16[16] | sc u8[8][16] | m u8[8][16]   w = (d sc) q - (dmin m) */
#define QK4_RB 2368
#define QK4_D 2048
#define QK4_DMIN 2080
#define QK4_SC 2112
#define QK4_M 2240
/* Q5_K: Q4_K's record | qh[8][64] (bit j: 5th bit of group j's value, bit 4 + j: of group j + 4's) */
#define QK5_RB 2880
#define QK5_H 2368
/* Q6_K: q[8][4][64] low 4 bits | qh[8][2][64] (bits 2j, 2j + 1: bits 4, 5 of group j (half 0) / j + 4 (half 1))
 *       | d fp16[16] | sc i8[16][16]                                  w = (d sc_s) (q - 32), sc_s per 16 inputs */
#define QK6_RB 3360
#define QK6_H 2048
#define QK6_D 3072
#define QK6_SC 3104

/* Activations quantized per block of 32 (llama.cpp's scheme): what the int8 kernels multiply by. */
typedef struct {
    int8_t *q;    /* rows x k */
    float *d;     /* rows x nb: the block's scale (amax / 127) */
    float *dm;    /* rows x nb: scale x sum of the block's q */
    int32_t *s;   /* rows x nb: sum of the block's q */
    int32_t *s16; /* rows x 2 nb: sums of its two halves */
} acts_t;

static const int RECORD_BYTES[F_COUNT] = {Q4_RB, Q4_RB, Q8_RB, QK4_RB, QK5_RB, QK6_RB, Q5_RB, Q5_RB};
static const int SUPER_BLOCK[F_COUNT] = {QK, QK, QK, QK_K, QK_K, QK_K, QK, QK};
/* X(F) for every format: a switch that calls a kernel specialised by a constant format (`switch (fmt) {
 * EACH_FORMAT(CASE) }`) */
#define EACH_FORMAT(X) X(F_Q4_0) X(F_Q4_1) X(F_Q8_0) X(F_Q4_K) X(F_Q5_K) X(F_Q6_K) X(F_Q5_0) X(F_Q5_1)
#define IS_Q4(F) ((F) == F_Q4_0 || (F) == F_Q4_1)
#define IS_Q5(F) ((F) == F_Q5_0 || (F) == F_Q5_1)

/* fp16 bits -> float (scalar, exact) */
static inline float half_to_float(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16;
    uint32_t exp = (h >> 10) & 0x1F, man = h & 0x3FF, bits;
    if (exp == 0) {
        if (man == 0) {
            bits = sign;
        } else { /* subnormal: normalise */
            exp = 127 - 15 + 1;
            while (!(man & 0x400)) {
                man <<= 1;
                exp--;
            }
            bits = sign | (exp << 23) | ((man & 0x3FF) << 13);
        }
    } else if (exp == 0x1F) {
        bits = sign | 0x7F800000 | (man << 13);
    } else {
        bits = sign | ((exp + 127 - 15) << 23) | (man << 13);
    }
    float f;
    __builtin_memcpy(&f, &bits, 4);
    return f;
}

static inline uint16_t rd16(const uint8_t *p) { return (uint16_t)(p[0] | (p[1] << 8)); }

/* The value (0..255) of input `i` (0..31) of output lane `o` in block `b` of a record, and the float weight,
 * computed as gguf's reference does (float32, the same order of operations). Scalar: rows() and tests. */
static inline float weight_at(int fmt, const uint8_t *rec, int b, int o, int i) {
    const int g = i / 4, lane = 4 * o + i % 4;
    int q;
    switch (fmt) {
    case F_Q4_0:
    case F_Q4_1:
    case F_Q5_0:
    case F_Q5_1: {
        const uint8_t byte = rec[(g & 3) * 64 + lane];
        q = g < 4 ? byte & 0x0F : byte >> 4;
        if (fmt == F_Q5_0 || fmt == F_Q5_1) q |= ((rec[Q5_H + lane] >> g) & 1) << 4;
        return half_to_float(rd16(rec + Q4_D + 2 * o)) * (float)q + half_to_float(rd16(rec + Q4_M + 2 * o));
    }
    case F_Q8_0:
        q = (int)rec[g * 64 + lane] - 128;
        return (float)q * half_to_float(rd16(rec + Q8_D + 2 * o));
    case F_Q4_K:
    case F_Q5_K: {
        const uint8_t byte = rec[b * 256 + (g & 3) * 64 + lane];
        q = g < 4 ? byte & 0x0F : byte >> 4;
        if (fmt == F_Q5_K) q |= ((rec[QK5_H + b * 64 + lane] >> g) & 1) << 4;
        const float dl = half_to_float(rd16(rec + QK4_D + 2 * o)) * (float)rec[QK4_SC + b * 16 + o];
        const float ml = half_to_float(rd16(rec + QK4_DMIN + 2 * o)) * (float)rec[QK4_M + b * 16 + o];
        return dl * (float)q - ml;
    }
    case F_Q6_K: {
        const uint8_t byte = rec[b * 256 + (g & 3) * 64 + lane];
        q = g < 4 ? byte & 0x0F : byte >> 4;
        q |= ((rec[QK6_H + b * 128 + (g >> 2) * 64 + lane] >> (2 * (g & 3))) & 3) << 4;
        const float dl = half_to_float(rd16(rec + QK6_D + 2 * o)) * (float)(int8_t)rec[QK6_SC + (2 * b + g / 4) * 16 + o];
        return dl * (float)(q - 32);
    }
    }
    return 0.0f;
}

/* out (count, k) float32: the weights of output rows ids[] of a matrix (n outputs, k inputs) in the layout. */
static inline int layout_rows(int fmt, const uint8_t *w, int n, int k, const int64_t *ids, int count, float *out) {
    if (fmt < 0 || fmt >= F_COUNT || k % SUPER_BLOCK[fmt]) return -1;
    const int sb = SUPER_BLOCK[fmt], nrec = k / sb, rb = RECORD_BYTES[fmt];
    for (int r = 0; r < count; r++) {
        const int64_t id = ids[r];
        if (id < 0 || id >= n) return -2;
        const uint8_t *panel = w + (size_t)(id / PANEL) * nrec * rb;
        const int o = (int)(id % PANEL);
        for (int s = 0; s < nrec; s++)
            for (int b = 0; b < sb / QK; b++)
                for (int i = 0; i < QK; i++)
                    out[(size_t)r * k + (size_t)s * sb + b * QK + i] = weight_at(fmt, panel + (size_t)s * rb, b, o, i);
    }
    return 0;
}

#endif
