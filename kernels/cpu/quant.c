/* y = x @ W^T on CPU straight from quantized weight rows (GGUF blocks, or per-channel int8), without
   dequantizing the model: llama.cpp's scheme. Each call quantizes every row of x once to int8 blocks of
   32 (one float scale per block, the sum of each 16 values kept for the offset and min terms), then
   each 32-value sub-block of a weight row is unpacked to unsigned bytes u = w + offset and multiplied
   with the int8 activations as integers:

       sum_i w_i x_i = dx * s * (sum_i u_i q_i - offset * sum_i q_i) + dx * m * sum_i q_i

   where s is the sub-block's scale (per 16 values for Q6_K), m its additive min (Q4_1, Q4_K) and dx
   the activation block's scale. With AVX-512 VNNI (or AVX-VNNI) the integer dot is one vpdpbusd per
   32 values; otherwise plain C (the PDSERVE_QUANT_SCALAR build, which the tests also build). OpenMP
   splits the output rows.

   Row layouts (bytes per 32 or 256 values), as GGUF stores them and gguf.quants.dequantize reads them:
     Q8_0  (32):  f16 d, int8 q[32]                            w = d q
     Q4_0  (32):  f16 d, u8 qs[16] (low nibbles 0..15, high 16..31)   w = d (q - 8)
     Q4_1  (32):  f16 d, f16 m, u8 qs[16]                      w = d q + m
     Q4_K (256):  f16 d, f16 dmin, u8 scales[12], u8 qs[128]   w = d sc_j q - dmin m_j (6-bit sc, m per 32)
     Q6_K (256):  u8 ql[128], u8 qh[64], int8 sc[16], f16 d    w = d sc_j (q - 32)     (sc per 16)
     I8    (row): f32 s, int8 q[in]                            w = s q  (--quantization int8) */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>
#ifdef _OPENMP
#include <omp.h>
#endif
#if !defined(PDSERVE_QUANT_SCALAR) && ((defined(__AVX512VNNI__) && defined(__AVX512VL__)) || defined(__AVXVNNI__))
#include <immintrin.h>
#define QUANT_VNNI 1
#else
#define QUANT_VNNI 0
#endif

enum { T_Q8_0 = 0, T_Q4_0 = 1, T_Q4_1 = 2, T_Q4_K = 3, T_Q6_K = 4, T_I8 = 5 };

static inline float f16(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
#if QUANT_VNNI && defined(__F16C__)
    return _cvtsh_ss(h);
#endif
    uint32_t sign = (uint32_t)(h >> 15) << 31, exp = (h >> 10) & 31, man = h & 1023, bits;
    if (exp == 0) { /* zero or subnormal: exact as a float */
        float v = ldexpf((float)man, -24);
        return sign ? -v : v;
    }
    if (exp == 31) bits = sign | 0x7f800000u | (man << 13);
    else bits = sign | ((exp + 112) << 23) | (man << 13);
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

/* One 32-value sub-block of a weight row, unpacked: u = w / s + offset as bytes, its scale per half
   (s_lo for values 0..15, s_hi for 16..31), its additive min and offset. */
typedef struct {
    uint8_t u[32];
    float s_lo, s_hi, m;
    int off;
} sub_t;

static inline void nibbles(const uint8_t *qs, uint8_t *u) { /* 16 bytes -> 32 values, low nibbles first */
    for (int i = 0; i < 16; i++) {
        u[i] = qs[i] & 15;
        u[i + 16] = qs[i] >> 4;
    }
}

static inline void q4k_scale_min(int j, const uint8_t *q, int *sc, int *m) { /* ggml's get_scale_min_k4 */
    if (j < 4) {
        *sc = q[j] & 63;
        *m = q[j + 4] & 63;
    } else {
        *sc = (q[j + 4] & 15) | ((q[j - 4] >> 6) << 4);
        *m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
    }
}

/* Sub-block b (of 32 values) of a row in type t: its scales, and with ``bytes`` its values in s->u. */
static inline void unpack(int t, const uint8_t *row, int64_t b, sub_t *s, int bytes) {
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

#if QUANT_VNNI
/* The values of sub-block b as unpack() lays them in s->u, straight into a register: built in memory byte
   by byte, the 32-byte reload waited on two 16-byte stores (no store forwarding), 10x slower for Q4_0. */
static inline __m256i unpack_vec(int t, const uint8_t *row, int64_t b) {
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

/* Row i of x as int8 blocks of 32: q[i*K ..], scale d[i*K/32 ..], sums of each 16 sum16[i*K/16 ..]. */
static void quantize_row(const float *x, int64_t K, int8_t *q, float *d, int32_t *sum16) {
    for (int64_t b = 0; b < K / 32; b++) {
        const float *xb = x + 32 * b;
        float amax = 0;
        for (int i = 0; i < 32; i++) amax = fmaxf(amax, fabsf(xb[i]));
        const float scale = amax / 127, inv = amax > 0 ? 127 / amax : 0;
        d[b] = scale;
        int32_t lo = 0, hi = 0;
        for (int i = 0; i < 32; i++) {
            int v = (int)lrintf(xb[i] * inv);
            q[32 * b + i] = (int8_t)v;
            if (i < 16) lo += v;
            else hi += v;
        }
        sum16[2 * b] = lo, sum16[2 * b + 1] = hi;
    }
}

#define ROWS_AT_ONCE 4 /* rows of x each unpacked weight sub-block is multiplied with */

/* Outputs of one weight row (type t, K values) for R <= ROWS_AT_ONCE quantized rows of x: each
   sub-block is unpacked once for all of them. */
static void dot_rows(int t, const uint8_t *row, int64_t K, int R, const int8_t *q, const float *d,
                     const int32_t *sum16, float *out, int64_t out_stride) {
    float rest[ROWS_AT_ONCE] = {0};
    sub_t s;
    const int64_t nb = K / 32;
#if QUANT_VNNI
    __m256 acc[ROWS_AT_ONCE];
    for (int r = 0; r < ROWS_AT_ONCE; r++) acc[r] = _mm256_setzero_ps();
#endif
    for (int64_t b = 0; b < nb; b++) {
#if QUANT_VNNI
        unpack(t, row, b, &s, 0);
        const __m256i u = unpack_vec(t, row, b);
#else
        unpack(t, row, b, &s, 1);
#endif
        for (int r = 0; r < R; r++) {
            const float dx = d[r * nb + b];
            const int32_t lo = sum16[r * 2 * nb + 2 * b], hi = sum16[r * 2 * nb + 2 * b + 1];
            const int8_t *xq = q + r * K + 32 * b;
            rest[r] += dx * (s.m * (float)(lo + hi) - s.off * (s.s_lo * lo + s.s_hi * hi));
#if QUANT_VNNI
            const __m256i xv = _mm256_loadu_si256((const __m256i *)xq);
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
            const __m256i dot = _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, xv);
#else
            const __m256i dot = _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), u, xv);
#endif
            /* lanes 0..3 hold values 0..15, lanes 4..7 values 16..31 */
            const __m256 scale = _mm256_set_m128(_mm_set1_ps(dx * s.s_hi), _mm_set1_ps(dx * s.s_lo));
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), scale, acc[r]);
#else
            int32_t dlo = 0, dhi = 0;
            for (int i = 0; i < 16; i++) dlo += (int32_t)s.u[i] * xq[i];
            for (int i = 16; i < 32; i++) dhi += (int32_t)s.u[i] * xq[i];
            rest[r] += dx * (s.s_lo * (float)dlo + s.s_hi * (float)dhi);
#endif
        }
    }
    for (int r = 0; r < R; r++) {
#if QUANT_VNNI
        __m128 h = _mm_add_ps(_mm256_castps256_ps128(acc[r]), _mm256_extractf128_ps(acc[r], 1));
        h = _mm_add_ps(h, _mm_movehl_ps(h, h));
        h = _mm_add_ss(h, _mm_movehdup_ps(h));
        rest[r] += _mm_cvtss_f32(h);
#endif
        out[r * out_stride] += rest[r];
    }
}

int pdserve_quant_vnni(void) { return QUANT_VNNI; }

/* y[rows][N] = x[rows][K] @ W^T (+ bias), W as N rows of row_bytes each; K a multiple of 32 (256 for
   the K-quants). scratch: rows * (K + K/32 * 4 + K/16 * 4) bytes. */
void pdserve_quant_linear(int t, const float *x, int64_t rows, int64_t K, const uint8_t *w, int64_t N,
                          int64_t row_bytes, const float *bias, float *y, uint8_t *scratch, int threads) {
    int8_t *q = (int8_t *)scratch;
    float *d = (float *)(scratch + rows * K);
    int32_t *sum16 = (int32_t *)(scratch + rows * K + rows * (K / 32) * 4);
#pragma omp parallel num_threads(threads)
    {
#pragma omp for schedule(static)
        for (int64_t i = 0; i < rows; i++) quantize_row(x + i * K, K, q + i * K, d + i * (K / 32), sum16 + i * (K / 16));
        /* chunks of output rows: each thread streams its own part of W once, for every row of x */
#pragma omp for schedule(static)
        for (int64_t n = 0; n < N; n++) {
            const uint8_t *row = w + n * row_bytes;
            for (int64_t i = 0; i < rows; i++) y[i * N + n] = bias ? bias[n] : 0;
            for (int64_t i = 0; i < rows; i += ROWS_AT_ONCE) {
                const int R = rows - i < ROWS_AT_ONCE ? (int)(rows - i) : ROWS_AT_ONCE;
                dot_rows(t, row, K, R, q + i * K, d + i * (K / 32), sum16 + i * (K / 16), y + i * N + n, N);
            }
        }
    }
}

/* Rows [n0, n0 + count) of W as float32 into out[count][K]: the prefill path's panel. */
void pdserve_quant_dequantize(int t, const uint8_t *w, int64_t n0, int64_t count, int64_t K, int64_t row_bytes,
                              float *out, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t n = 0; n < count; n++) {
        const uint8_t *row = w + (n0 + n) * row_bytes;
        float *o = out + n * K;
        sub_t s;
        for (int64_t b = 0; b < K / 32; b++) {
            unpack(t, row, b, &s, 1);
            for (int i = 0; i < 32; i++) o[32 * b + i] = (i < 16 ? s.s_lo : s.s_hi) * (float)(s.u[i] - s.off) + s.m;
        }
    }
}
