/* The ceiling of our int8 GEMM's inner loop on this core (bench/cpu_kernels.py --step prints the fraction of it
 * our matmuls reach): nothing but the loop's integer products into eight independent sums held in registers, no
 * loads, no unpacking, no scales. Built with the flags of the ISA's kernel library (kernels/cpu_quant.py):
 *   AVX2 (kernels/cpu/quant_avx2.c, 4-bit weights): maddubs (32 byte products into int16 pairs) + an int16 add
 *   AVX-VNNI / its EVEX stand-in on ymm (quant_avxvnni.c): vpdpbusd, 32 byte products into int32
 *   AVX-512 VNNI (quant_avx512vnni.c): vpdpbusd on zmm, 64 byte products
 * G multiply-adds a second over `threads` OpenMP threads, the fastest of three passes (by the wall clock, and by each
 * thread's CPU time). */
#include <immintrin.h>
#include <omp.h>

#if defined(__AVX512VNNI__) && !defined(VNNI_EVEX)
#define V __m512i
#define MACS 64
#define SET1(c) _mm512_set1_epi8((char)(c))
#define ZERO() _mm512_setzero_si512()
#define PRODUCT(s, w, x) _mm512_dpbusd_epi32(s, w, x)
#define FOLD(a, b) _mm512_add_epi32(a, b)
#elif defined(__AVXVNNI__) || defined(VNNI_EVEX)
#define V __m256i
#define MACS 32
#define SET1(c) _mm256_set1_epi8((char)(c))
#define ZERO() _mm256_setzero_si256()
#ifdef VNNI_EVEX
#define PRODUCT(s, w, x) _mm256_dpbusd_epi32(s, w, x)
#else
#define PRODUCT(s, w, x) _mm256_dpbusd_avx_epi32(s, w, x)
#endif
#define FOLD(a, b) _mm256_add_epi32(a, b)
#else
#define V __m256i
#define MACS 32
#define SET1(c) _mm256_set1_epi8((char)(c))
#define ZERO() _mm256_setzero_si256()
#define PRODUCT(s, w, x) _mm256_add_epi16(s, _mm256_maddubs_epi16(w, x))
#define FOLD(a, b) _mm256_add_epi16(a, b)
#endif
/* an empty asm keeps each value in its register and the loop from being folded away */
#define KEEP(v) __asm__ volatile("" : "+x"(v))

static __attribute__((noinline)) V products(long n) {
    V w0 = SET1(3), w1 = SET1(5), w2 = SET1(2), w3 = SET1(4), x0 = SET1(7), x1 = SET1(9);
    V s0 = ZERO(), s1 = s0, s2 = s0, s3 = s0, s4 = s0, s5 = s0, s6 = s0, s7 = s0;
    for (long i = 0; i < n; i++) { /* eight products of distinct operands a pass */
        s0 = PRODUCT(s0, w0, x0); KEEP(s0);
        s1 = PRODUCT(s1, w1, x0); KEEP(s1);
        s2 = PRODUCT(s2, w0, x1); KEEP(s2);
        s3 = PRODUCT(s3, w1, x1); KEEP(s3);
        s4 = PRODUCT(s4, w2, x0); KEEP(s4);
        s5 = PRODUCT(s5, w3, x1); KEEP(s5);
        s6 = PRODUCT(s6, w3, x0); KEEP(s6);
        s7 = PRODUCT(s7, w2, x1); KEEP(s7);
        KEEP(w0); KEEP(w1); KEEP(w2); KEEP(w3); KEEP(x0); KEEP(x1);
    }
    return FOLD(FOLD(FOLD(s0, s1), FOLD(s2, s3)), FOLD(FOLD(s4, s5), FOLD(s6, s7)));
}

#include <time.h>

/* The same loop timed by each thread's own CPU time (CLOCK_THREAD_CPUTIME_ID), summed over the threads: what the
 * core gives while the thread runs, whatever else the host runs (the wall-clock figure above falls with the load). */
double isa_ceiling_cpu_gmacs(long passes, int threads) {
    double best = 0;
    for (int r = 0; r < 3; r++) {
        double rate = 0;
#pragma omp parallel num_threads(threads) reduction(+ : rate)
        {
            struct timespec a, b;
            clock_gettime(CLOCK_THREAD_CPUTIME_ID, &a);
            volatile V sink = products(passes);
            (void)sink;
            clock_gettime(CLOCK_THREAD_CPUTIME_ID, &b);
            rate += (double)passes * 8 * MACS / ((b.tv_sec - a.tv_sec) + (b.tv_nsec - a.tv_nsec) * 1e-9) / 1e9;
        }
        if (rate > best) best = rate;
    }
    return best;
}

double isa_ceiling_gmacs(long passes, int threads) {
    double best = 1e30;
    for (int r = 0; r < 3; r++) {
        const double t0 = omp_get_wtime();
#pragma omp parallel num_threads(threads)
        {
            volatile V sink = products(passes);
            (void)sink;
        }
        const double dt = omp_get_wtime() - t0;
        if (dt < best) best = dt;
    }
    return (double)threads * passes * 8 * MACS / best / 1e9;
}
