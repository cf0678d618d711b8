/* The quantized matmuls of quant_kernels.h for CPUs with AVX2, FMA and F16C (no VNNI): 8 outputs per 256-bit
 * vector (a panel's 16 outputs as two halves), integer dot products as `maddubs` (unsigned x signed bytes into
 * int16 pairs; no pair can saturate: weights <= 63, activations <= 127) then `madd` into int32 lanes. Q8_0's
 * signed weights take llama.cpp's sign trick (|x| x sign(w, x)). Built with -mavx2 -mfma -mf16c. */
#define ISA avx2
#include "quant_vec256.h"

#define ONES16 _mm256_set1_epi16(1)
#define DOT(acc, w, x) _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), ONES16))
/* two products summed in int16 before the widening (4- and 5-bit weights: |sum| <= 2 x 2 x 31 x 127 < 32768) */
#define DOT2(acc, w1, x1, w2, x2)                                                                                \
    _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_add_epi16(_mm256_maddubs_epi16(w1, x1),                     \
                                                             _mm256_maddubs_epi16(w2, x2)), ONES16))
static inline __m256i dot_q8(__m256i acc, __m256i wu, __m256i x) {
    const __m256i ws = _mm256_xor_si256(wu, _mm256_set1_epi8((char)0x80)); /* u - 128: the file's int8 q */
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_sign_epi8(ws, ws),
                                                                        _mm256_sign_epi8(x, ws)), ONES16));
}
#define DOTQ8(acc, w, x) dot_q8(acc, w, x)
#define Q8_FIXUP 0
/* int16 sums of several maddubs before one widening madd (quant_kernels.h's gemm_tile, I16_*): exact while the true
 * sum fits int16, so it sums 8 products for 4-bit weights (8 x 2 x 15 x 128 = 30720), 4 for 5-bit ones (31744) and
 * 2 for 6-bit ones (32256): a quarter to a half of the widening multiplies. */
#define I16_ZERO() _mm256_setzero_si256()
#define I16_DOT(s, w, x) _mm256_add_epi16(s, _mm256_maddubs_epi16(w, x))
#define I16_WIDEN(acc, s) _mm256_add_epi32(acc, _mm256_madd_epi16(s, ONES16))

#include "quant_kernels.h"
