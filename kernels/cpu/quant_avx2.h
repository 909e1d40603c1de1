/* The integer dot of kernels/cpu/quant.c on AVX2 CPUs without VNNI (Zen 2/3, Intel before Alder Lake and
   Sapphire Rapids): the int32 lanes vpdpbusd gives, from vpmaddubsw (u8 x s8 pairs to s16) and vpmaddwd
   (s16 pairs to s32), as ggml's mul_sum_us8_pairs_float does. Included by quant_formats.h, which
   decides the instruction level (QUANT_AVX2).

   dot_u8s8(t, u, x): lane k = sum of u[4k + i] * x[4k + i] for i < 4, u unsigned bytes as unpack_vec()
   lays them (w + offset), x int8 activations in [-127, 127] (quant.c's quantize_row: round(x * 127 /
   max|x|)). The sums are exact, the same bits as vpdpbusd's, because no s16 pair saturates:
     - Q4_0, Q4_1, Q4_K (u <= 15), Q5_0, Q5_1 (u <= 31) and Q6_K (u <= 63): a pair is at most
       2 * 63 * 127 = 16002 < 32767,
       so vpmaddubsw takes u and x as they are.
     - Q8_0 and I8 (u = w + 128 up to 255) could reach 2 * 255 * 127 = 64770: so the signed weight
       w = u - 128 in [-128, 127] goes in with the sign trick, |w| as the unsigned byte (|-128| = 128
       fits one) and x with w's sign (|x| <= 127: negating never wraps), a pair at most
       2 * 128 * 127 = 32512 < 32767; then the offset's 128 * x comes back as its own exact lanes
       (a pair of 128 * x at most 32512 too), added in int32. */
#ifndef PDSERVE_QUANT_AVX2_H
#define PDSERVE_QUANT_AVX2_H
#include <immintrin.h>

/* Sums of each 4 adjacent u8 x s8 products as int32 lanes; every pair sum must fit an s16 (see above). */
static inline __m256i sum4_u8s8(__m256i u, __m256i x) {
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, x), _mm256_set1_epi16(1));
}

static inline __m256i dot_u8s8(int t, __m256i u, __m256i x) {
    if (weight_offset(t) != 128) return sum4_u8s8(u, x); /* u <= 63 */
    const __m256i flip = _mm256_set1_epi8((char)0x80);
    const __m256i w = _mm256_xor_si256(u, flip); /* u - 128 as int8 */
    const __m256i signed_part = sum4_u8s8(_mm256_abs_epi8(w), _mm256_sign_epi8(x, w));
    return _mm256_add_epi32(signed_part, sum4_u8s8(flip, x)); /* + 128 * x: flip is 128 as a u8 */
}

#endif
