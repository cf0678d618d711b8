/* What this CPU can run, from the cpuid instruction itself (not /proc/cpuinfo, which a hardened unit may hide,
 * and not the build machine's flags), with the operating system's consent read from XCR0 (xgetbv): AVX state,
 * AVX-512 state, AMX tile state. Built with no ISA flags, so it loads on any x86-64. */
#include <cpuid.h>
#include <stdint.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

enum {
    CPU_AVX2 = 1 << 0, CPU_FMA = 1 << 1, CPU_F16C = 1 << 2, CPU_AVXVNNI = 1 << 3, CPU_AVX512F = 1 << 4,
    CPU_AVX512BW = 1 << 5, CPU_AVX512VL = 1 << 6, CPU_AVX512DQ = 1 << 7, CPU_AVX512VNNI = 1 << 8,
    CPU_AVX512BF16 = 1 << 9, CPU_AVX512FP16 = 1 << 10, CPU_AMXTILE = 1 << 11, CPU_AMXINT8 = 1 << 12,
    CPU_AMXBF16 = 1 << 13, CPU_OS_AVX = 1 << 14, CPU_OS_AVX512 = 1 << 15, CPU_OS_AMX = 1 << 16,
};

static uint64_t xcr0(void) {
    uint32_t lo, hi;
    __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    return ((uint64_t)hi << 32) | lo;
}

int cpu_features(void) {
    unsigned a, b, c, d;
    int f = 0;
    if (!__get_cpuid(1, &a, &b, &c, &d)) return 0;
    const int osxsave = (c >> 27) & 1;
    if (c & (1u << 12)) f |= CPU_FMA;
    if (c & (1u << 29)) f |= CPU_F16C;
    if (osxsave) {
        const uint64_t x = xcr0();
        if ((x & 0x6) == 0x6) f |= CPU_OS_AVX;              /* SSE + AVX state */
        if ((x & 0xE6) == 0xE6) f |= CPU_OS_AVX512;         /* + opmask, ZMM_Hi256, Hi16_ZMM */
        if ((x & 0x60000) == 0x60000) f |= CPU_OS_AMX;      /* XTILECFG + XTILEDATA */
    }
    if (__get_cpuid_max(0, 0) < 7) return f;
    __cpuid_count(7, 0, a, b, c, d);
    if (b & (1u << 5)) f |= CPU_AVX2;
    if (b & (1u << 16)) f |= CPU_AVX512F;
    if (b & (1u << 17)) f |= CPU_AVX512DQ;
    if (b & (1u << 30)) f |= CPU_AVX512BW;
    if (b & (1u << 31)) f |= CPU_AVX512VL;
    if (c & (1u << 11)) f |= CPU_AVX512VNNI;
    if (d & (1u << 23)) f |= CPU_AVX512FP16;
    if (d & (1u << 22)) f |= CPU_AMXBF16;
    if (d & (1u << 24)) f |= CPU_AMXTILE;
    if (d & (1u << 25)) f |= CPU_AMXINT8;
    __cpuid_count(7, 1, a, b, c, d);
    if (a & (1u << 4)) f |= CPU_AVXVNNI;
    if (a & (1u << 5)) f |= CPU_AVX512BF16;
    return f;
}

/* The processor's brand string (cpuid 0x80000002..4), 48 bytes + NUL into out. */
int cpu_brand(char *out) {
    unsigned r[12];
    memset(out, 0, 49);
    if (__get_cpuid_max(0x80000000, 0) < 0x80000004) return -1;
    for (unsigned i = 0; i < 3; i++) __cpuid(0x80000002 + i, r[4 * i], r[4 * i + 1], r[4 * i + 2], r[4 * i + 3]);
    memcpy(out, r, 48);
    return 0;
}

/* Linux grants the AMX tile data state per process on request (arch_prctl ARCH_REQ_XCOMP_PERM); 0 when granted. */
int amx_request(void) {
#ifdef SYS_arch_prctl
    return (int)syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XFEATURE_XTILEDATA */);
#else
    return -1;
#endif
}
