/* The weight formats of kernels/cpu/quant.c decoded: a 32-value sub-block's scales, min and offset
   (unpack), and its values as unsigned bytes in a register (unpack_vec). The layouts are in quant.c's
   opening comment. */
#ifndef PDSERVE_QUANT_FORMATS_H
#define PDSERVE_QUANT_FORMATS_H
#include <stdint.h>
#include <string.h>
#if !defined(PDSERVE_QUANT_SCALAR) && ((defined(__AVX512VNNI__) && defined(__AVX512VL__)) || defined(__AVXVNNI__))
#include <immintrin.h>
#define QUANT_VNNI 1
#else
#define QUANT_VNNI 0
#endif
/* AVX2 without VNNI: the same integer dot from vpmaddubsw + vpmaddwd (kernels/cpu/quant_avx2.h) */
#if !defined(PDSERVE_QUANT_SCALAR) && !QUANT_VNNI && defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define QUANT_AVX2 1
#else
#define QUANT_AVX2 0
#endif
#define QUANT_SIMD (QUANT_VNNI || QUANT_AVX2) /* 256-bit integer dots: unpack_vec, dot_u8s8 */
/* 512-bit tiles (kernels/cpu/quant_tile512.c) where AVX-512 VNNI is there with BW/DQ for its masks and lanes */
#if QUANT_VNNI && defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512DQ__)
#define QUANT_512 1
#else
#define QUANT_512 0
#endif

/* Activation values per int8 scale (quant.c's quantize_row): half a weight sub-block of 32, so each form
   applies two activation scales per sub-block, as it applies Q6_K's two weight scales. Rounding in blocks
   of 16 rather than llama.cpp's 32 halves the activations' share of the error (docs/benchmarks.md). */
#define ACT_BLOCK 16
/* Rows of int8 activations per row of x (quant.c's quantize_row), chosen per call by the type tag: tag = format
   + TERMS_TAG * (terms - 1). One term: x rounded (llama.cpp's scheme, with finer blocks). Two: then what that
   rounding left, rounded in its own blocks of 16, so x is carried to 1/64516 of each block's max rather
   than 1/254 (model.quant_activations int16). The forms multiply them as rows of their own, each x row's terms
   adjacent, and add a row's terms into one output row (the first stores, the next adds: term_out below). */
#define TERMS_TAG 16

/* Where quantized activation row i's outputs go: row i / terms of y (ldy floats apart). */
static inline float *term_out(float *y, int64_t ldy, int64_t i, int terms) { return y + i / terms * ldy; }

/* The format decoders: always inlined, so each tile instantiation specializes them (at GCC's own choice
   one of them stopped being inlined once a tile shape was added, and one-row Q4_K ran 1.5x slower) */
#define DECODER static inline __attribute__((always_inline))

enum { T_Q8_0 = 0, T_Q4_0 = 1, T_Q4_1 = 2, T_Q4_K = 3, T_Q6_K = 4, T_I8 = 5, T_Q5_0 = 6, T_Q5_1 = 7 };

/* What unpack() adds to a format's values to make them unsigned bytes (u = w / s + offset). */
static inline int32_t weight_offset(int t) {
    switch (t) {
    case T_Q8_0:
    case T_I8: return 128;
    case T_Q4_0: return 8;
    case T_Q5_0: return 16;
    case T_Q6_K: return 32;
    default: return 0; /* Q4_1, Q5_1, Q4_K: unsigned values and a min */
    }
}

/* Whether a format has an additive min per sub-block (sub_t.m): the min term of quant.c's sum. */
static inline int weight_has_min(int t) { return t == T_Q4_1 || t == T_Q4_K || t == T_Q5_1; }

/* The float16 at p as a float, exactly: F16C's vcvtph2ps in the SIMD builds, else the compiler's _Float16
   conversion (libgcc's exact one), as kernels/cpu/int8_rows.h reads its scales. The intrinsic, not the
   cast, where both exist: with the cast GCC 12 made the one-row Q4_K tiles 1.5x slower (its two f16
   fields per sub-block; quant_linear --base, the other formats level). */
static inline float f16(const uint8_t *p) {
#if QUANT_SIMD && defined(__F16C__)
    uint16_t bits;
    memcpy(&bits, p, 2);
    return _cvtsh_ss(bits);
#else
    _Float16 h;
    memcpy(&h, p, 2);
    return (float)h;
#endif
}

/* One 32-value sub-block of a weight row, unpacked: u = w / s + offset as bytes, its scale per half
   (s_lo for values 0..15, s_hi for 16..31), its additive min and offset. */
typedef struct {
    uint8_t u[32];
    float s_lo, s_hi, m;
    int off;
} sub_t;

DECODER void nibbles(const uint8_t *qs, uint8_t *u) { /* 16 bytes -> 32 values, low nibbles first */
    for (int i = 0; i < 16; i++) {
        u[i] = qs[i] & 15;
        u[i + 16] = qs[i] >> 4;
    }
}

/* Q5_0/Q5_1's fifth bits: bit i of the 4 bytes at qh is value i's 16 (ggml's dequantize_row_q5_0). */
DECODER void fifth_bits(const uint8_t *qh, uint8_t *u) {
    uint32_t h;
    memcpy(&h, qh, 4);
    for (int i = 0; i < 32; i++) u[i] |= ((h >> i) & 1) << 4;
}

DECODER void q4k_scale_min(int j, const uint8_t *q, int *sc, int *m) { /* ggml's get_scale_min_k4 */
    if (j < 4) {
        *sc = q[j] & 63;
        *m = q[j + 4] & 63;
    } else {
        *sc = (q[j + 4] & 15) | ((q[j - 4] >> 6) << 4);
        *m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
    }
}

/* Sub-block b (of 32 values) of a row in type t: its scales, and with ``bytes`` its values in s->u. */
DECODER void unpack(int t, const uint8_t *row, int64_t b, sub_t *s, int bytes) {
    switch (t) {
    case T_Q8_0: {
        const uint8_t *p = row + b * 34;
        s->s_lo = s->s_hi = f16(p);
        s->m = 0, s->off = 128;
        for (int i = 0; bytes && i < 32; i++) s->u[i] = p[2 + i] ^ 0x80; /* int8 + 128 */
        break;
    }
    case T_Q4_0: {
        const uint8_t *p = row + b * 18;
        s->s_lo = s->s_hi = f16(p);
        s->m = 0, s->off = 8;
        if (bytes) nibbles(p + 2, s->u);
        break;
    }
    case T_Q4_1: {
        const uint8_t *p = row + b * 20;
        s->s_lo = s->s_hi = f16(p);
        s->m = f16(p + 2), s->off = 0;
        if (bytes) nibbles(p + 4, s->u);
        break;
    }
    case T_Q5_0: { /* f16 d, qh[4], qs[16]: w = d (q - 16), q = nibble | fifth bit << 4 */
        const uint8_t *p = row + b * 22;
        s->s_lo = s->s_hi = f16(p);
        s->m = 0, s->off = 16;
        if (bytes) nibbles(p + 6, s->u), fifth_bits(p + 2, s->u);
        break;
    }
    case T_Q5_1: { /* f16 d, f16 m, qh[4], qs[16]: w = d q + m */
        const uint8_t *p = row + b * 24;
        s->s_lo = s->s_hi = f16(p);
        s->m = f16(p + 2), s->off = 0;
        if (bytes) nibbles(p + 8, s->u), fifth_bits(p + 4, s->u);
        break;
    }
    case T_Q4_K: {
        const uint8_t *p = row + (b / 8) * 144;
        int j = (int)(b % 8), sc, mn;
        q4k_scale_min(j, p + 4, &sc, &mn);
        s->s_lo = s->s_hi = f16(p) * sc;
        s->m = -f16(p + 2) * mn, s->off = 0;
        const uint8_t *q = p + 16 + 32 * (j / 2); /* 64 values per 32 bytes: low nibbles, then high */
        const int shift = 4 * (j % 2);
        for (int i = 0; bytes && i < 32; i++) s->u[i] = (q[i] >> shift) & 15;
        break;
    }
    case T_Q6_K: {
        const uint8_t *p = row + (b / 8) * 210;
        int j = (int)(b % 8), half = j / 4, g = j % 4; /* 128 values per half, 4 groups of 32 in it */
        const uint8_t *ql = p + 64 * half + 32 * (g & 1), *qh = p + 128 + 32 * half;
        const int8_t *sc = (const int8_t *)(p + 192);
        float d = f16(p + 208);
        s->s_lo = d * sc[2 * j], s->s_hi = d * sc[2 * j + 1];
        s->m = 0, s->off = 32;
        const int lshift = 4 * (g >> 1), hshift = 2 * g;
        for (int i = 0; bytes && i < 32; i++) s->u[i] = ((ql[i] >> lshift) & 15) | (((qh[i] >> hshift) & 3) << 4);
        break;
    }
    default: { /* T_I8: b indexes 32 values after the row's float scale */
        float sc;
        memcpy(&sc, row, 4);
        s->s_lo = s->s_hi = sc;
        s->m = 0, s->off = 128;
        for (int i = 0; bytes && i < 32; i++) s->u[i] = row[4 + b * 32 + i] ^ 0x80;
        break;
    }
    }
}

#if QUANT_SIMD
/* 16 in byte i where bit i of the 4 bytes at qh is set, else 0: Q5_0/Q5_1's fifth bits as bytes. */
DECODER __m256i fifth_bits_vec(const uint8_t *qh) {
    uint32_t h;
    memcpy(&h, qh, 4);
#if defined(__AVX512BW__) && defined(__AVX512VL__)
    return _mm256_maskz_mov_epi8(h, _mm256_set1_epi8(16));
#else /* ggml's bytes_from_bits_32: byte i takes byte i / 8 of h, then tests its bit i % 8 */
    const __m256i spread = _mm256_shuffle_epi8(
        _mm256_set1_epi32((int)h), _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202, 0x0101010101010101, 0));
    const __m256i all_but_bit = _mm256_set1_epi64x(0x7fbfdfeff7fbfdfe);
    const __m256i set = _mm256_cmpeq_epi8(_mm256_or_si256(spread, all_but_bit), _mm256_set1_epi64x(-1));
    return _mm256_and_si256(set, _mm256_set1_epi8(16));
#endif
}

/* The values of sub-block b as unpack() lays them in s->u, straight into a register: built in memory byte
   by byte, the 32-byte reload waited on two 16-byte stores (no store forwarding), 10x slower for Q4_0. */
DECODER __m256i unpack_vec(int t, const uint8_t *row, int64_t b) {
    const __m256i low4 = _mm256_set1_epi8(15), flip = _mm256_set1_epi8((char)0x80);
    switch (t) {
    case T_Q8_0:
        return _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(row + b * 34 + 2)), flip);
    case T_Q4_0:
    case T_Q4_1: {
        const __m128i v = _mm_loadu_si128((const __m128i *)(row + b * (t == T_Q4_0 ? 18 : 20) + (t == T_Q4_0 ? 2 : 4)));
        const __m256i both = _mm256_set_m128i(_mm_srli_epi16(v, 4), v); /* high nibbles are values 16..31 */
        return _mm256_and_si256(both, low4);
    }
    case T_Q5_0:
    case T_Q5_1: {
        const uint8_t *p = row + b * (t == T_Q5_0 ? 22 : 24), *qh = p + (t == T_Q5_0 ? 2 : 4);
        const __m128i v = _mm_loadu_si128((const __m128i *)(qh + 4));
        const __m256i both = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(v, 4), v), low4);
        return _mm256_or_si256(both, fifth_bits_vec(qh));
    }
    case T_Q4_K: {
        const int j = (int)(b % 8);
        const __m256i q = _mm256_loadu_si256((const __m256i *)(row + (b / 8) * 144 + 16 + 32 * (j / 2)));
        return _mm256_and_si256(j % 2 ? _mm256_srli_epi16(q, 4) : q, low4);
    }
    case T_Q6_K: {
        const uint8_t *p = row + (b / 8) * 210;
        const int j = (int)(b % 8), half = j / 4, g = j % 4;
        const __m256i ql = _mm256_loadu_si256((const __m256i *)(p + 64 * half + 32 * (g & 1)));
        const __m256i qh = _mm256_loadu_si256((const __m256i *)(p + 128 + 32 * half));
        const __m256i lo = _mm256_and_si256(_mm256_srl_epi16(ql, _mm_cvtsi32_si128(4 * (g >> 1))), low4);
        const __m256i hi = _mm256_and_si256(_mm256_srl_epi16(qh, _mm_cvtsi32_si128(2 * g)), _mm256_set1_epi8(3));
        return _mm256_or_si256(lo, _mm256_slli_epi16(hi, 4)); /* hi <= 3: the shift stays in its byte */
    }
    default:
        return _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(row + 4 + b * 32)), flip);
    }
}
#endif

/* dot_u8s8(t, u, x): int32 lane k = sum of u[4k + i] * x[4k + i], i < 4 (vpdpbusd from zero), for unpack_vec's
   u of format t and int8 activations x in [-127, 127]; the AVX2 build gets the same bits (quant_avx2.h). */
#if QUANT_VNNI
static inline __m256i dot_u8s8(int t, __m256i u, __m256i x) {
    (void)t;
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, x);
#else
    return _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), u, x);
#endif
}
#elif QUANT_AVX2
#include "quant_avx2.h"
#endif

#endif
