/* y = x @ W^T on CPU straight from quantized weight rows (GGUF blocks, or per-channel int8), without
   dequantizing the model: llama.cpp's scheme of integer dot products against int8 activations. Each call
   quantizes every row of x once to int8 blocks of 16 (a float32 scale per 16 values, and their sum): x
   rounded, and with two terms (the type tag's, quant_formats.h: model.quant_activations int16) then what
   that rounding left, rounded again, as a second int8 row. Each 32-value sub-block of a weight row is
   unpacked to unsigned bytes u = w + offset and multiplied with each int8 row as integers, each half of 16
   values apart:

       sum_i w_i x_i = sum over terms, halves h of  dx_h * s_h * (sum_i u_i q_i - offset * sum_i q_i) + dx_h * m * sum_i q_i

   where s_h is the sub-block's scale (the same for both halves but in Q6_K), m its additive min (Q4_1,
   Q5_1, Q4_K) and dx_h the term's scale for that half. The forms below multiply the terms as activation
   rows of their own and add a row's terms into one output row (quant_formats.h's term_out).

   Why blocks of 16: llama.cpp's Q8 activation blocks put 32 values under one scale, whose step the larger
   max of 32 sets: with 16 the activations' rounding costs about half as much KL divergence from the float
   model. Why a second term: that rounding, not the weights', is still most of the quantized model's
   distance from the float one (SmolLM2's Q8_0 file on the AMD EPYC Zen 5, 2026-11-29: mean KL divergence
   from F32 0.0026 with one term, 0.0011 with two, which is the weights' own; llama.cpp 0.0039). It
   doubles the integer work per row of x: nearly free at a row or few, where streaming the weights is the
   cost, up to 1.7x the time at 64 rows (docs/benchmarks.md, GGUF accuracy and speed).

   With AVX-512 VNNI and BW/DQ, tiles of weight rows by activation rows at 64 values per vpdpbusd
   (kernels/cpu/quant_tile512.c) and, from 8 activation rows, 16-row panels (quant_panel16.c); with
   AVX-VNNI alone one vpdpbusd per 32 values, a weight row at a time; with AVX2 alone the same integer
   sums from vpmaddubsw (quant_avx2.h); otherwise plain C (the PDSERVE_QUANT_SCALAR build, which the
   tests also build). OpenMP splits the output rows.

   Row layouts (bytes per 32 or 256 values), as GGUF stores them and gguf.quants.dequantize reads them:
     Q8_0  (32):  f16 d, int8 q[32]                            w = d q
     Q4_0  (32):  f16 d, u8 qs[16] (low nibbles 0..15, high 16..31)   w = d (q - 8)
     Q4_1  (32):  f16 d, f16 m, u8 qs[16]                      w = d q + m
     Q5_0  (32):  f16 d, u8 qh[4], u8 qs[16]                   w = d (q - 16)  (q = nibble | bit i of qh << 4)
     Q5_1  (32):  f16 d, f16 m, u8 qh[4], u8 qs[16]            w = d q + m
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
#include "quant_formats.h"

/* Row x of K values as `terms` int8 rows in blocks of 16, term j's values at q[j*K ..], scales at
   d[j*K/16 ..], sums of 16 at sum16[j*K/16 ..]: the first x rounded (d = max|x| / 127 over the block,
   q = x * 127 / max|x| to nearest, halves to even), each next what the terms before left, x - d q, rounded
   the same way. engine/quant/act_blocks.py computes the same values (so its residual x - d q is a product
   then a difference, each rounded: the library is built with -ffp-contract=off, kernels/cpu/quant.py). */
static void quantize_row(const float *x, int64_t K, int terms, int8_t *q, float *d, int32_t *sum16) {
#if QUANT_512
    /* The same values 16 at a time: max is exact in any order, x * inv the same product, and vcvtps2dq rounds
       to nearest even as lrintf does. In C, fmaxf stayed a libm call per value: a few microseconds a layer. */
    for (int64_t b = 0; b < K / ACT_BLOCK; b++) {
        __m512 v = _mm512_loadu_ps(x + ACT_BLOCK * b);
        for (int j = 0; j < terms; j++) {
            const float amax = _mm512_reduce_max_ps(_mm512_abs_ps(v));
            const float inv = amax > 0 ? 127 / amax : 0, scale = amax / 127;
            const __m512i iv = _mm512_cvtps_epi32(_mm512_mul_ps(v, _mm512_set1_ps(inv)));
            d[j * (K / ACT_BLOCK) + b] = scale;
            _mm_storeu_si128((__m128i *)(q + j * K + ACT_BLOCK * b), _mm512_cvtepi32_epi8(iv));
            sum16[j * (K / ACT_BLOCK) + b] = _mm512_reduce_add_epi32(iv);
            v = _mm512_sub_ps(v, _mm512_mul_ps(_mm512_cvtepi32_ps(iv), _mm512_set1_ps(scale)));
        }
    }
#else
    for (int64_t b = 0; b < K / ACT_BLOCK; b++) {
        float v[ACT_BLOCK];
        memcpy(v, x + ACT_BLOCK * b, sizeof v);
        for (int j = 0; j < terms; j++) {
            float amax = 0;
            for (int i = 0; i < ACT_BLOCK; i++) amax = fmaxf(amax, fabsf(v[i]));
            const float scale = amax / 127, inv = amax > 0 ? 127 / amax : 0;
            d[j * (K / ACT_BLOCK) + b] = scale;
            int32_t sum = 0;
            for (int i = 0; i < ACT_BLOCK; i++) {
                const int qi = (int)lrintf(v[i] * inv);
                q[j * K + ACT_BLOCK * b + i] = (int8_t)qi;
                sum += qi;
                v[i] -= (float)qi * scale;
            }
            sum16[j * (K / ACT_BLOCK) + b] = sum;
        }
    }
#endif
}

#if !QUANT_512
#define ROWS_AT_ONCE 4 /* quantized activation rows each unpacked weight sub-block is multiplied with */

/* Outputs of one weight row (type t, K values) for R <= ROWS_AT_ONCE quantized activation rows, the first
   of them row `first`, added into their rows of out (term_out): each sub-block is unpacked once for all. */
static void dot_rows(int t, const uint8_t *row, int64_t K, int R, const int8_t *q, const float *d,
                     const int32_t *sum16, int64_t first, int terms, float *out, int64_t out_stride) {
    float rest[ROWS_AT_ONCE] = {0};
    sub_t s;
    const int64_t nb = K / 32;
#if QUANT_SIMD
    __m256 acc[ROWS_AT_ONCE];
    for (int r = 0; r < ROWS_AT_ONCE; r++) acc[r] = _mm256_setzero_ps();
#endif
    for (int64_t b = 0; b < nb; b++) {
#if QUANT_SIMD
        unpack(t, row, b, &s, 0);
        const __m256i u = unpack_vec(t, row, b);
#else
        unpack(t, row, b, &s, 1);
#endif
        for (int r = 0; r < R; r++) {
            /* each half of the sub-block has its own activation scale: values 0..15 and 16..31 */
            const float dlo = d[r * 2 * nb + 2 * b], dhi = d[r * 2 * nb + 2 * b + 1];
            const int32_t lo = sum16[r * 2 * nb + 2 * b], hi = sum16[r * 2 * nb + 2 * b + 1];
            const int8_t *xq = q + r * K + 32 * b;
            rest[r] += s.m * (dlo * (float)lo + dhi * (float)hi) - s.off * (dlo * s.s_lo * lo + dhi * s.s_hi * hi);
#if QUANT_SIMD
            const __m256i dot = dot_u8s8(t, u, _mm256_loadu_si256((const __m256i *)xq));
            /* lanes 0..3 hold values 0..15, lanes 4..7 values 16..31 */
            const __m256 scale = _mm256_set_m128(_mm_set1_ps(dhi * s.s_hi), _mm_set1_ps(dlo * s.s_lo));
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), scale, acc[r]);
#else
            int32_t ulo = 0, uhi = 0;
            for (int i = 0; i < 16; i++) ulo += (int32_t)s.u[i] * xq[i];
            for (int i = 16; i < 32; i++) uhi += (int32_t)s.u[i] * xq[i];
            rest[r] += dlo * s.s_lo * (float)ulo + dhi * s.s_hi * (float)uhi;
#endif
        }
    }
    for (int r = 0; r < R; r++) {
#if QUANT_SIMD
        __m128 h = _mm_add_ps(_mm256_castps256_ps128(acc[r]), _mm256_extractf128_ps(acc[r], 1));
        h = _mm_add_ps(h, _mm_movehl_ps(h, h));
        h = _mm_add_ss(h, _mm_movehdup_ps(h));
        rest[r] += _mm_cvtss_f32(h);
#endif
        *term_out(out, out_stride, first + r, terms) += rest[r];
    }
}
#endif

int pdserve_quant_vnni(void) { return QUANT_VNNI; }
int pdserve_quant_avx2(void) { return QUANT_AVX2; } /* AVX2 without VNNI: kernels/cpu/quant_avx2.h */
int pdserve_quant_tiles512(void) { return QUANT_512; }

#if QUANT_512
int64_t quant512_lane_bytes(int64_t K);
void quant512_lanes(int t, const int8_t *q, const float *d, int64_t K, uint8_t *lanes);
void quant512_rows(int t, const int8_t *q, const uint8_t *lanes, int64_t rows, int terms, int64_t K,
                   const uint8_t *w, int64_t N, int64_t row_bytes, const float *bias, float *y, int64_t ldy);
int quant16_takes(int t, int64_t rows, int terms);
void quant16_rows(int t, const int8_t *q, const float *d, const int32_t *sum16, const uint8_t *lanes, int64_t rows,
                  int terms, int64_t K, const uint8_t *w, int64_t N, int64_t row_bytes, const float *bias, float *y,
                  int64_t ldy);
#endif

/* Row i of x quantized into the scratch's q, d, sum16 and (the 512-bit tiles) lanes: its `terms` quantized
   rows, i * terms on. */
static void quantize_lanes(int t, const float *x, int64_t i, int64_t K, int terms, int8_t *q, float *d,
                           int32_t *sum16, uint8_t *lanes) {
    const int64_t first = i * terms;
    quantize_row(x + i * K, K, terms, q + first * K, d + first * (K / ACT_BLOCK), sum16 + first * (K / ACT_BLOCK));
#if QUANT_512
    for (int64_t j = first; j < first + terms; j++)
        quant512_lanes(t, q + j * K, d + j * (K / ACT_BLOCK), K, lanes + j * quant512_lane_bytes(K));
#else
    (void)t, (void)lanes;
#endif
}

/* Bytes of scratch pdserve_quant_linear needs for `rows` quantized rows of K values (rows of x times their
   terms): their int8 values, block scales (float per 16), sums of 16 and (the 512-bit tiles) lanes of 3 K
   bytes. */
int64_t pdserve_quant_scratch_bytes(int64_t rows, int64_t K) { return rows * (K + K / 4 + K / 4 + 3 * K); }

/* The body of pdserve_quant_linear for every thread of an enclosing team (its worksharing binds to that
   team's region): kernels/cpu/decode_step_team.c runs a decode step's projections this way in one region.
   own_scratch: scratch is this thread's alone, and each thread quantizes every row itself rather than
   one thread doing it while the others wait at a barrier -- at a row or few the barrier costs more than
   the rows (the same values either way: the quantization is per row).
   ldy: floats from one row of y to the next (N, or more where y is a column range of a wider output: a
   projection whose parts are in different formats writes each part's columns with its own call). */
void pdserve_quant_linear_team_into(int t, const float *x, int64_t rows, int64_t K, const uint8_t *w, int64_t N,
                                    int64_t row_bytes, const float *bias, float *y, int64_t ldy, uint8_t *scratch,
                                    int own_scratch) {
    const int terms = 1 + t / TERMS_TAG; /* the kernels below run over qrows, adding terms into y's rows */
    const int64_t qrows = rows * terms;
    t %= TERMS_TAG;
    int8_t *q = (int8_t *)scratch;
    float *d = (float *)(scratch + qrows * K);
    int32_t *sum16 = (int32_t *)(scratch + qrows * K + qrows * (K / ACT_BLOCK) * 4);
    uint8_t *lanes = scratch + qrows * (K + K / 4 + K / 4);
    if (own_scratch) {
        for (int64_t i = 0; i < rows; i++) quantize_lanes(t, x, i, K, terms, q, d, sum16, lanes);
    } else {
#pragma omp for schedule(static)
        for (int64_t i = 0; i < rows; i++) quantize_lanes(t, x, i, K, terms, q, d, sum16, lanes);
    }
#if QUANT_512
    if (quant16_takes(t, qrows, terms))
        quant16_rows(t, q, d, sum16, lanes, qrows, terms, K, w, N, row_bytes, bias, y, ldy);
    else quant512_rows(t, q, lanes, qrows, terms, K, w, N, row_bytes, bias, y, ldy);
#else
    (void)lanes;
    /* chunks of output rows: each thread streams its own part of W once, for every row of x */
#pragma omp for schedule(static)
    for (int64_t n = 0; n < N; n++) {
        const uint8_t *row = w + n * row_bytes;
        for (int64_t i = 0; i < rows; i++) y[i * ldy + n] = bias ? bias[n] : 0;
        for (int64_t i = 0; i < qrows; i += ROWS_AT_ONCE) {
            const int R = qrows - i < ROWS_AT_ONCE ? (int)(qrows - i) : ROWS_AT_ONCE;
            const int64_t at = i * (K / ACT_BLOCK);
            dot_rows(t, row, K, R, q + i * K, d + at, sum16 + at, i, terms, y + n, ldy);
        }
    }
#endif
}

void pdserve_quant_linear_team(int t, const float *x, int64_t rows, int64_t K, const uint8_t *w, int64_t N,
                               int64_t row_bytes, const float *bias, float *y, uint8_t *scratch, int own_scratch) {
    pdserve_quant_linear_team_into(t, x, rows, K, w, N, row_bytes, bias, y, N, scratch, own_scratch);
}

/* y[rows][N] = x[rows][K] @ W^T (+ bias), W as N rows of row_bytes each; K a multiple of 32 (256 for
   the K-quants). scratch: pdserve_quant_scratch_bytes(rows, K). */
void pdserve_quant_linear(int t, const float *x, int64_t rows, int64_t K, const uint8_t *w, int64_t N,
                          int64_t row_bytes, const float *bias, float *y, uint8_t *scratch, int threads) {
#pragma omp parallel num_threads(threads)
    pdserve_quant_linear_team_into(t, x, rows, K, w, N, row_bytes, bias, y, N, scratch, 0);
}

/* pdserve_quant_linear into y's rows ldy floats apart (pdserve_quant_linear_team_into's ldy). */
void pdserve_quant_linear_into(int t, const float *x, int64_t rows, int64_t K, const uint8_t *w, int64_t N,
                               int64_t row_bytes, const float *bias, float *y, int64_t ldy, uint8_t *scratch,
                               int threads) {
#pragma omp parallel num_threads(threads)
    pdserve_quant_linear_team_into(t, x, rows, K, w, N, row_bytes, bias, y, ldy, scratch, 0);
}

/* Rows [n0, n0 + count) of W as float32 into out[count][K]: the prefill path's panel. */
void pdserve_quant_dequantize(int t, const uint8_t *w, int64_t n0, int64_t count, int64_t K, int64_t row_bytes,
                              float *out, int threads) {
    t %= TERMS_TAG; /* the activations' terms do not concern the weights */
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
