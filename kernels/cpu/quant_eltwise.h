/* The eager forward's element-wise ops on a CPU (models/forward_ops.py's TorchOps where the model multiplies with our
 * kernels: prefill, mixed steps, and decode before its compiled step is ready), each one pass over memory where
 * torch's make two to five and allocate a fresh tensor for every intermediate: the residual add with RMSNorm, and
 * SiLU(gate) x up. Included by quant_kernels.h, over each ISA's vectors. Not bit for bit torch's (the sums' order),
 * within float32 rounding of them (tests/test_cpu_eager_ops.py). */

/* Rows first..last of h (rows, dim): h += delta where delta is given (in place, the residual stream), then
 * out = h / sqrt(mean(h^2) + eps) * weight, as torch's rms_norm orders it. */
static void add_rms_norm_share(int id, int nt, float *h, const float *delta, const float *weight, long rows, long dim,
                               float eps, float *out) {
    const long first = rows * id / nt, last = rows * (id + 1) / nt;
    for (long r = first; r < last; r++) {
        float *hr = h + r * dim, *o = out + r * dim;
        const float *dr = delta ? delta + r * dim : 0;
        VF s0 = ZEROF(), s1 = ZEROF(); /* two sums: half the add chain's latency */
        long i = 0;
        for (; i + 2 * LANES <= dim; i += 2 * LANES) {
            VF a = LOADF(hr + i), b = LOADF(hr + i + LANES);
            if (dr) {
                a = ADDF(a, LOADF(dr + i));
                b = ADDF(b, LOADF(dr + i + LANES));
                STOREF(hr + i, a);
                STOREF(hr + i + LANES, b);
            }
            s0 = FMA(a, a, s0);
            s1 = FMA(b, b, s1);
        }
        float ss = hsumf(ADDF(s0, s1));
        for (; i < dim; i++) {
            const float v = dr ? hr[i] + dr[i] : hr[i];
            hr[i] = v;
            ss += v * v;
        }
        const float inv = 1.0f / sqrtf(ss / (float)dim + eps);
        const VF vi = SET1F(inv);
        for (i = 0; i + LANES <= dim; i += LANES) STOREF(o + i, MUL(MUL(LOADF(hr + i), vi), LOADF(weight + i)));
        for (; i < dim; i++) o[i] = hr[i] * inv * weight[i];
    }
}

/* Rows first..last: out (rows, inter) = silu(gu[:, :inter]) * gu[:, inter:], silu(g) = g / (1 + e^-g) (e^-g
 * capped at e^88, below float's overflow: g / inf would be -0 anyway) */
static void silu_mul_share(int id, int nt, const float *gu, long rows, long inter, float *out) {
    const long first = rows * id / nt, last = rows * (id + 1) / nt;
    for (long r = first; r < last; r++) {
        const float *g = gu + r * 2 * inter, *u = g + inter;
        float *o = out + r * inter;
        long i = 0;
        for (; i + LANES <= inter; i += LANES) {
            const VF gv = LOADF(g + i);
            const VF e = vexpf(MINF(SUBF(ZEROF(), gv), SET1F(88.0f)));
            STOREF(o + i, MUL(DIVF(gv, ADDF(SET1F(1.0f), e)), LOADF(u + i)));
        }
        for (; i < inter; i++) o[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
    }
}

/* Values below which one thread does the whole op (a parallel region costs a few us to start and join). */
#define PARALLEL_ELEMS (1L << 15)

int CAT(ISA, add_rms_norm)(float *h, const float *delta, const float *weight, long rows, long dim, float eps,
                           float *out, int threads) {
    if (rows <= 0 || dim <= 0) return -1;
    if (threads > 1 && rows > 1 && rows * dim >= PARALLEL_ELEMS) {
#pragma omp parallel num_threads(threads)
        add_rms_norm_share(THREAD_ID(), TEAM_SIZE(), h, delta, weight, rows, dim, eps, out);
    } else {
        add_rms_norm_share(0, 1, h, delta, weight, rows, dim, eps, out);
    }
    return 0;
}

int CAT(ISA, silu_mul)(const float *gate_up, long rows, long inter, float *out, int threads) {
    if (rows <= 0 || inter <= 0) return -1;
    if (threads > 1 && rows > 1 && rows * inter >= PARALLEL_ELEMS) {
#pragma omp parallel num_threads(threads)
        silu_mul_share(THREAD_ID(), TEAM_SIZE(), gate_up, rows, inter, out);
    } else {
        silu_mul_share(0, 1, gate_up, rows, inter, out);
    }
    return 0;
}
