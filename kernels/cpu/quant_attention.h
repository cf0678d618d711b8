/* Decode attention for the compiled step (kernels/cpu/quant_op.cpp's quant_cpu::decode_attention): one query token
 * per row over its slot's cached keys and values, positions 0..positions[b], grouped query heads (head j reads kv
 * head j / group), the cache in float32 or bfloat16. Included by quant_kernels.h, so every ISA's library has it, over
 * that ISA's vectors (quant_vec256.h / quant_vec512.h: LOADBF, hsumf, hmaxf, ROUNDF, POW2F).
 *
 * Why ours: Inductor's loops for the same sums reduced each score across the vector horizontally, one position at a
 * time, and spent a fifth of a 16-row SmolLM2 step there (AVX2: ~5 ms of 27). Here each task (row, kv head) keeps
 * its scores in a small buffer: the dot products (one horizontal sum each), the softmax over whole vectors with a
 * vector exp, and the weighted sum of values vertically (no horizontal sums at all). */

/* e^x for x <= 88 (softmax's shifted scores, quant_eltwise.h's SiLU): 2^n e^r, |r| <= ln2 / 2, a degree-6
 * polynomial (relative error ~1e-7); below -87 it gives 0, as expf underflows */
static inline VF vexpf(VF x) {
    x = MAXF(x, SET1F(-87.0f));
    const VF n = ROUNDF(MUL(x, SET1F(1.44269504f)));
    VF r = FNMA(n, SET1F(0.693359375f), x);
    r = FNMA(n, SET1F(-2.12194440e-4f), r);
    VF p = SET1F(1.0f / 720);
    p = FMA(p, r, SET1F(1.0f / 120));
    p = FMA(p, r, SET1F(1.0f / 24));
    p = FMA(p, r, SET1F(1.0f / 6));
    p = FMA(p, r, SET1F(0.5f));
    p = FMA(p, r, SET1F(1.0f));
    p = FMA(p, r, SET1F(1.0f));
    return MUL(p, POW2F(n));
}

static inline VF load_kv(const void *base, size_t i, int bf16) {
    return bf16 ? LOADBF((const uint16_t *)base + i) : LOADF((const float *)base + i);
}

/* o[g * hd + i * LANES ..] = inv[g] x sum_t s[g * stride + t] v_t (vector i of position t's values) for G heads,
 * GI vectors of the values a pass. */
static inline __attribute__((always_inline)) void weigh_values(const int NV, const int G, const float *s, long stride,
                                                               long len, const void *v_cache, int bf16, size_t base,
                                                               int hd, const float *inv, float *o) {
    enum { GI_MAX = 8 };
    /* GI sums per head, GI values and a weight in AVX2's 16 registers: GI (G + 1) < 16, a power of 2 */
    const int fit = 15 / (G + 1), GI_FIT = fit >= 8 ? 8 : fit >= 4 ? 4 : fit >= 2 ? 2 : 1;
    const int GI = NV < GI_FIT ? NV : GI_FIT;
    for (int i = 0; i < NV; i += GI) {
        VF acc[8][GI_MAX];
#pragma GCC unroll 8
        for (int g = 0; g < G; g++)
#pragma GCC unroll 8
            for (int ii = 0; ii < GI; ii++) acc[g][ii] = ZEROF();
        for (long t = 0; t < len; t++) {
            VF v[GI_MAX];
#pragma GCC unroll 8
            for (int ii = 0; ii < GI; ii++) v[ii] = load_kv(v_cache, base + (size_t)t * hd + (i + ii) * LANES, bf16);
#pragma GCC unroll 8
            for (int g = 0; g < G; g++) {
                const VF p = SET1F(s[(size_t)g * stride + t]);
#pragma GCC unroll 8
                for (int ii = 0; ii < GI; ii++) acc[g][ii] = FMA(p, v[ii], acc[g][ii]);
            }
        }
#pragma GCC unroll 8
        for (int g = 0; g < G; g++)
#pragma GCC unroll 8
            for (int ii = 0; ii < GI; ii++) STOREF(o + g * hd + (i + ii) * LANES, MUL(acc[g][ii], SET1F(inv[g])));
    }
}

/* One task: query heads h * group .. + group of row r over their kv head's positions 0..len-1, into o. NV (vectors
 * per head) is a constant in each caller's copy (attention_share's switch), so a key's or a value's vectors and the
 * accumulators stay in registers: with a run-time count they lived on the stack, and each value step's FMAs waited
 * on a store and a reload (the 16-row SmolLM2 step's attention 1.5-2.4 ms on AVX2 before, ... after). */
static inline __attribute__((always_inline)) void attend_task(const int NV, const float *qh, int group, int hd,
                                                              const void *k_cache, const void *v_cache, int bf16,
                                                              size_t base, long len, long stride, float scale,
                                                              float *sc, float *o) {
    /* scores: q . k / sqrt(hd), each key's vectors loaded once for the group's heads; two sums per dot product
     * (halves the FMA chain's latency) */
    for (long t = 0; t < len; t++) {
        VF kv[NV];
#pragma GCC unroll 32
        for (int i = 0; i < NV; i++) kv[i] = load_kv(k_cache, base + (size_t)t * hd + i * LANES, bf16);
        for (int g = 0; g < group; g++) {
            VF a0 = ZEROF(), a1 = ZEROF();
#pragma GCC unroll 32
            for (int i = 0; i + 1 < NV; i += 2) {
                a0 = FMA(LOADF(qh + g * hd + i * LANES), kv[i], a0);
                a1 = FMA(LOADF(qh + g * hd + (i + 1) * LANES), kv[i + 1], a1);
            }
            if (NV % 2) a0 = FMA(LOADF(qh + g * hd + (NV - 1) * LANES), kv[NV - 1], a0);
            sc[(size_t)g * stride + t] = hsumf(ADDF(a0, a1)) * scale;
        }
    }
    float inv[8];
    for (int g = 0; g < group; g++) {
        float *s = sc + (size_t)g * stride;
        /* softmax: exp(s - max) over whole vectors, the tail padded with -inf (exp 0) */
        const long padded = (len + LANES - 1) / LANES * LANES;
        for (long t = len; t < padded; t++) s[t] = -INFINITY;
        VF m = SET1F(-INFINITY);
        for (long t = 0; t < padded; t += LANES) m = MAXF(m, LOADF(s + t));
        const VF mx = SET1F(hmaxf(m));
        VF sum = ZEROF();
        for (long t = 0; t < padded; t += LANES) {
            const VF e = vexpf(SUBF(LOADF(s + t), mx));
            STOREF(s + t, e);
            sum = ADDF(sum, e);
        }
        const float iv = 1.0f / hsumf(sum);
        if (group > 8) { /* out = sum_t p_t v_t / sum, head by head */
            weigh_values(NV, 1, s, stride, len, v_cache, bf16, base, hd, &iv, o + g * hd);
        } else {
            inv[g] = iv;
        }
    }
    /* out = sum_t p_t v_t / sum for the group's heads at once: each value vector loaded (and widened from bfloat16)
     * once for all of them, in passes of as many vectors as the heads' sums leave registers for; each head's sums in
     * the same order as one head at a time (the same bits) */
#define WEIGH(G) weigh_values(NV, G, sc, stride, len, v_cache, bf16, base, hd, inv, o)
    switch (group) {
    case 1: WEIGH(1); break;
    case 2: WEIGH(2); break;
    case 3: WEIGH(3); break;
    case 4: WEIGH(4); break;
    case 5: WEIGH(5); break;
    case 6: WEIGH(6); break;
    case 7: WEIGH(7); break;
    case 8: WEIGH(8); break;
    default: break; /* done above */
    }
#undef WEIGH
}

/* Share `id` of `nt` of the tasks (row, kv head), in one contiguous run (id 0 of 1: all of them). */
static void attention_share(int id, int nt, const float *q, int b, int n_heads, int n_kv, int hd, const void *k_cache,
                            const void *v_cache, int bf16, long slot_stride, long head_stride, long longest,
                            const int64_t *slot_ids, const int64_t *positions, float *out, int *bad) {
    const int group = n_heads / n_kv, nv = hd / LANES, tasks = b * n_kv;
    const float scale = 1.0f / sqrtf((float)hd);
    const long stride = longest + LANES;
    float *sc = (float *)malloc(sizeof(float) * (size_t)group * (size_t)stride);
    if (!sc) {
#pragma omp atomic write
        *bad = 1;
        return;
    }
    const int first = (int)((long)tasks * id / nt), last = (int)((long)tasks * (id + 1) / nt);
    for (int task = first; task < last; task++) {
        const int r = task / n_kv, h = task % n_kv;
        const long len = positions[r] + 1;
        const size_t base = (size_t)slot_ids[r] * slot_stride + (size_t)h * head_stride;
        const float *qh = q + ((size_t)r * n_heads + (size_t)h * group) * hd;
        float *o = out + ((size_t)r * n_heads + (size_t)h * group) * hd;
#define ATTEND(N) attend_task(N, qh, group, hd, k_cache, v_cache, bf16, base, len, stride, scale, sc, o)
        switch (nv) { /* head sizes 64 and 128 (and 32, 256) in 256- and 512-bit vectors */
        case 2: ATTEND(2); break;
        case 4: ATTEND(4); break;
        case 8: ATTEND(8); break;
        case 16: ATTEND(16); break;
        case 32: ATTEND(32); break;
        default: ATTEND(nv); break;
        }
#undef ATTEND
    }
    free(sc);
}

/* out (b, n_heads * hd) from q (b, n_heads, hd); caches (slots, n_kv, positions, hd) with strides in elements
 * slot_stride, head_stride (a position's hd values contiguous). Returns 0, or < 0 for shapes it does not take. */
int CAT(ISA, decode_attention)(const float *q, int b, int n_heads, int n_kv, int hd, const void *k_cache,
                               const void *v_cache, int bf16, long slot_stride, long head_stride, long max_pos,
                               const int64_t *slot_ids, const int64_t *positions, float *out, int threads) {
    if (b <= 0 || n_kv <= 0 || n_heads % n_kv || hd % LANES || hd > 256) return -1;
    const int group = n_heads / n_kv;
    long longest = 0;
    for (int r = 0; r < b; r++) {
        if (positions[r] < 0 || positions[r] >= max_pos) return -2;
        if (positions[r] + 1 > longest) longest = positions[r] + 1;
    }
    int bad = 0;
    /* one thread for a small step: waking the second costs more than it saves (a plain call, not `if (0)`: see
     * quantize_rows) */
    if (threads > 1 && (long)b * n_kv * longest * hd * group >= (1L << 16)) {
#pragma omp parallel num_threads(threads)
        attention_share(THREAD_ID(), TEAM_SIZE(), q, b, n_heads, n_kv, hd, k_cache, v_cache, bf16, slot_stride,
                        head_stride, longest, slot_ids, positions, out, &bad);
    } else {
        attention_share(0, 1, q, b, n_heads, n_kv, hd, k_cache, v_cache, bf16, slot_stride, head_stride, longest,
                        slot_ids, positions, out, &bad);
    }
    return bad ? -3 : 0;
}
