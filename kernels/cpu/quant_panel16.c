/* The quantized linear of kernels/cpu/quant.c at many activation rows, every format, AVX-512 VNNI:
   output-major lanes, as ggml's repacked gemm.

   Why: kernels/cpu/quant_tile512.c puts 64 values of one (weight row, activation row) pair in a vector,
   so every vpdpbusd needs its own convert, scale product and accumulate: three float ops per 64
   multiply-adds, the bound at 16 rows and up. Here a vector holds 4 values of 16 weight rows, and the
   activation's 4 values are broadcast: 8 vpdpbusd cover a 32-value block of 16 outputs, and the block's
   scales are applied once per 16 outputs (five or six float ops per 512 multiply-adds: two halves of 16,
   each with its activation scale).

   Per thread and panel of 16 weight rows: the rows are unpacked once into T[block][j][16 lanes of 4
   bytes] (j: the 4-value group) with their scales ws[block][16] and mins wm[block][16]; then each group
   of up to 8 activation rows runs every block against the panel, the 8 sums in registers. The offset
   term (-offset * the half's activation sum) starts each half's integer sum, so it stays exact.

   A block is a 32-value sub-block: Q4_K's has one scale and min, as the 32-value formats. Q6_K's has a
   scale per 16 values (wh[block][16]: the second half's), and the activations have one per 16 in every
   format, so each block is two integer sums, each started from its own half's offset term and scaled by
   its own half's weight and activation scales. */
#include <stdlib.h>

#include "quant_formats.h"

#if QUANT_512
#define PANEL 16   /* weight rows side by side in a vector's lanes */
#define GROUP 8    /* activation rows whose sums stay in registers */
/* Fewer rows of x: quant_tile512.c (the panel's unpacking would not pay), whatever the activations' terms
   per row (EPYC Zen 5, 2026-11-29, SmolLM2's Q8_0/Q4_1 projections with two terms: at 4 rows of x, 8
   activation rows, the tiles took 0.64-0.92 of the panels' time; at 8 rows of x the two were level, at 16
   the panels took half the tiles') */
#define MIN_ROWS 8

int quant16_takes(int t, int64_t rows, int terms) {
    (void)t;
    return rows >= MIN_ROWS * terms;
}

/* A panel of 16 weight rows, unpacked: T[block][j][16 lanes] the 4-value groups j of each block, ws and wh
   each block's scale for its values 0..15 and 16..31 (the same but in Q6_K), wm its min. */
typedef struct {
    int32_t *T;
    float *ws, *wm, *wh;
} panel_t;

/* Activation rows as quant.c's quantize_row lays them (q, d and sum16 per 16 values), and xmin[row][block]
   = d_lo * sum_lo + d_hi * sum_hi: the min term's activation factor, computed once per call rather than
   once per panel (its scalar converts cost the min formats ~10% at 16 rows and up). */
typedef struct {
    const int8_t *q;
    const float *d, *xmin;
    const int32_t *sum16;
} acts_t;

static inline acts_t acts_from(acts_t x, int64_t i0, int64_t K) { /* the rows from i0 on */
    const int64_t nb = K / 32;
    return (acts_t){x.q + i0 * K, x.d + i0 * 2 * nb, x.xmin ? x.xmin + i0 * nb : NULL, x.sum16 + i0 * 2 * nb};
}

/* Rows w[n0 ..n0 + 16) (a row past N repeats row n0) unpacked into the panel. */
static void unpack_panel(int t, const uint8_t *w, int64_t n0, int64_t N, int64_t row_bytes, int64_t nb,
                         const panel_t *p) {
    for (int n = 0; n < PANEL; n++) {
        const uint8_t *row = w + (n0 + n < N ? n0 + n : n0) * row_bytes;
        for (int64_t b = 0; b < nb; b++) {
            sub_t s;
            unpack(t, row, b, &s, 0);
            p->ws[b * PANEL + n] = s.s_lo, p->wm[b * PANEL + n] = s.m, p->wh[b * PANEL + n] = s.s_hi;
            int32_t u[8];
            _mm256_storeu_si256((__m256i *)u, unpack_vec(t, row, b));
            for (int j = 0; j < 8; j++) p->T[(b * 8 + j) * PANEL + n] = u[j];
        }
    }
}

/* acc[r] (16 outputs) for the nx activation rows of x against the panel. Each block's two halves of 16
   values are summed apart: each has its own activation scale (d, one per 16) and, for Q6_K, its own
   weight scale (wh; the same as ws in the other formats). Each half's sum starts from its offset term. */
static inline __attribute__((always_inline)) void panel_rows(int t, int nx, const panel_t *p, acts_t x, int64_t K,
                                                             __m512 *acc) {
    const int64_t nb = K / 32;
    const int32_t offset = weight_offset(t);
    const int mins = weight_has_min(t);
    for (int r = 0; r < nx; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        __m512i tj[8];
        for (int j = 0; j < 8; j++) tj[j] = _mm512_loadu_si512(p->T + (b * 8 + j) * PANEL);
        const __m512 lo_scale = _mm512_loadu_ps(p->ws + b * PANEL), hi_scale = _mm512_loadu_ps(p->wh + b * PANEL);
        const __m512 wmv = mins ? _mm512_loadu_ps(p->wm + b * PANEL) : _mm512_setzero_ps();
        for (int r = 0; r < nx; r++) {
            const int32_t *xq = (const int32_t *)(x.q + r * K + 32 * b);
            const float dlo = x.d[r * 2 * nb + 2 * b], dhi = x.d[r * 2 * nb + 2 * b + 1];
            __m512i lo = _mm512_setzero_si512(), hi = _mm512_setzero_si512();
            if (offset) {
                lo = _mm512_set1_epi32(-offset * x.sum16[r * 2 * nb + 2 * b]);
                hi = _mm512_set1_epi32(-offset * x.sum16[r * 2 * nb + 2 * b + 1]);
            }
            for (int j = 0; j < 4; j++) lo = _mm512_dpbusd_epi32(lo, tj[j], _mm512_set1_epi32(xq[j]));
            for (int j = 4; j < 8; j++) hi = _mm512_dpbusd_epi32(hi, tj[j], _mm512_set1_epi32(xq[j]));
            if (t == T_Q6_K) {
                acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(lo), _mm512_mul_ps(lo_scale, _mm512_set1_ps(dlo)), acc[r]);
                acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(hi), _mm512_mul_ps(hi_scale, _mm512_set1_ps(dhi)), acc[r]);
            } else { /* one weight scale for both halves: the activations' two first, then it, a float op fewer */
                const __m512 x_lo = _mm512_mul_ps(_mm512_cvtepi32_ps(lo), _mm512_set1_ps(dlo));
                acc[r] = _mm512_fmadd_ps(_mm512_fmadd_ps(_mm512_cvtepi32_ps(hi), _mm512_set1_ps(dhi), x_lo), lo_scale,
                                         acc[r]);
            }
            if (mins) acc[r] = _mm512_fmadd_ps(wmv, _mm512_set1_ps(x.xmin[r * nb + b]), acc[r]);
        }
    }
}

#define FORMATS(NX)                                                                                            \
    switch (t) {                                                                                               \
    case T_Q8_0: panel_rows(T_Q8_0, NX, p, x, K, acc); break;                                                  \
    case T_Q4_0: panel_rows(T_Q4_0, NX, p, x, K, acc); break;                                                  \
    case T_Q4_1: panel_rows(T_Q4_1, NX, p, x, K, acc); break;                                                  \
    case T_Q5_0: panel_rows(T_Q5_0, NX, p, x, K, acc); break;                                                  \
    case T_Q5_1: panel_rows(T_Q5_1, NX, p, x, K, acc); break;                                                  \
    case T_Q4_K: panel_rows(T_Q4_K, NX, p, x, K, acc); break;                                                  \
    case T_Q6_K: panel_rows(T_Q6_K, NX, p, x, K, acc); break;                                                  \
    default: panel_rows(T_I8, NX, p, x, K, acc); break;                                                        \
    }

static void panel_any(int t, int nx, const panel_t *p, acts_t x, int64_t K, __m512 *acc) {
    if (nx == GROUP) {
        FORMATS(GROUP)
    } else if (nx >= 4) {
        FORMATS(4)
    } else {
        FORMATS(1)
    }
}

/* xmin (acts_t) of every row: rows * K / 32 floats. */
static void min_factors(const float *d, const int32_t *sum16, int64_t rows, int64_t K, float *xmin) {
    for (int64_t i = 0; i < rows * (K / 32); i++)
        xmin[i] = d[2 * i] * (float)sum16[2 * i] + d[2 * i + 1] * (float)sum16[2 * i + 1];
}

void quant512_span(int t, const int8_t *q, const uint8_t *lanes, int64_t rows, int terms, int64_t K,
                   const uint8_t *w, int64_t n_begin, int64_t n_end, int64_t ldy, int64_t row_bytes,
                   const float *bias, float *y);

/* y[rows / terms][N] = x @ W^T (+ bias) inside quant.c's parallel region, the threads splitting the
   panels; rows: the quantized activation rows, `terms` per row of x (quant512_span's).
   ldy: floats between y's rows. q, d, sum16: the activations as quant.c's quantize_row lays them; lanes:
   quant512_lanes', for a thread whose panel memory cannot be had (it then runs quant_tile512.c's kernel). */
void quant16_rows(int t, const int8_t *q, const float *d, const int32_t *sum16, const uint8_t *lanes, int64_t rows,
                  int terms, int64_t K, const uint8_t *w, int64_t N, int64_t row_bytes, const float *bias, float *y,
                  int64_t ldy) {
    const int64_t nb = K / 32, panel_bytes = nb * PANEL * (8 * 4 + 12); /* T, ws, wm, wh: a multiple of 64 */
    const int64_t xmin_bytes = weight_has_min(t) ? (rows * nb * 4 + 63) / 64 * 64 : 0;
    uint8_t *space = aligned_alloc(64, (size_t)(panel_bytes + xmin_bytes));
    acts_t x = {q, d, NULL, sum16};
    if (space != NULL && xmin_bytes) {
        min_factors(d, sum16, rows, K, (float *)(space + panel_bytes));
        x.xmin = (const float *)(space + panel_bytes);
    }
#pragma omp for schedule(static)
    for (int64_t n0 = 0; n0 < N; n0 += PANEL) {
        if (space == NULL) {
            quant512_span(t, q, lanes, rows, terms, K, w, n0, n0 + PANEL < N ? n0 + PANEL : N, ldy, row_bytes, bias, y);
            continue;
        }
        const panel_t p = {(int32_t *)space, (float *)(space + nb * 8 * PANEL * 4),
                           (float *)(space + nb * 9 * PANEL * 4), (float *)(space + nb * 10 * PANEL * 4)};
        unpack_panel(t, w, n0, N, row_bytes, nb, &p);
        const __mmask16 keep = N - n0 >= PANEL ? 0xffff : (__mmask16)((1u << (N - n0)) - 1);
        const __m512 b16 = bias ? _mm512_maskz_loadu_ps(keep, bias + n0) : _mm512_setzero_ps();
        for (int64_t i0 = 0; i0 < rows;) {
            const int64_t left = rows - i0;
            const int nx = left >= GROUP ? GROUP : left >= 4 ? 4 : 1;
            __m512 acc[GROUP];
            panel_any(t, nx, &p, acts_from(x, i0, K), K, acc);
            for (int r = 0; r < nx; r++) { /* a row's first term stores, the next adds */
                float *at = term_out(y, ldy, i0 + r, terms) + n0;
                const __m512 base = (i0 + r) % terms ? _mm512_maskz_loadu_ps(keep, at) : b16;
                _mm512_mask_storeu_ps(at, keep, _mm512_add_ps(base, acc[r]));
            }
            i0 += nx;
        }
    }
    free(space);
}
#endif
