/* The quantized linear of kernels/cpu/quant.c with 512-bit AVX-512 VNNI: tiles of TILE_W weight rows by
   TILE_X activation rows, 64 values (two 32-value sub-blocks) per vpdpbusd.

   Why tiles: a sub-block pair is unpacked (nibbles to bytes, f16 scales to float lanes) once per
   TILE_X activation rows, and an activation row's 64 bytes are loaded once per TILE_W weight rows, as
   ggml's mul_mat reuses its blocks; row by row, the unpacking and the scalar offset terms cost more
   than the dot itself at 4 rows and up.

   Why lanes: everything a sub-block contributes besides the integer dot is laid out per int32 lane of
   vpdpbusd (4 values each) when the activations are quantized, once per call, so the inner step is one
   vpdpbusd, one convert and two or three float ops:
     corr[g] = -offset * sum of the 4 int8 activations of group g   (vpdpbusd starts from it: exact)
     xs[g]   = the scale dx of the activation block of 16 it is in
     xsum[g] = dx * sum of those 4 activations                      (the min term, Q4_1/Q5_1/Q4_K)
   and the weight side as lanes too (ws: the sub-block's scale for lanes 0-3 and 4-7, per 16 values for
   Q6_K; wm: its min, Q4_1/Q5_1/Q4_K), so  acc += float(dot + corr) * ws * xs + wm * xsum. */
#include "quant_formats.h"

#ifdef _OPENMP
#include <omp.h>
#endif

#if QUANT_512
#define TILE_W 2  /* weight rows per tile */
#define TILE_W1 4 /* weight rows per tile at one activation row: more rows in flight, x's lanes loaded once for 4 */
#define TILE_X 8  /* activation rows per tile */
/* How far ahead of a tile its rows are prefetched. At one activation row the weight stream is the whole
   cost and a core's reads in flight must cover DRAM's latency times its bandwidth: one tile ahead (1.2 KB
   of Q8_0) streamed SmolLM2's layers at 13 GB/s on one Zen 5 core, 3 KB at 21, 6 KB at 30, 12 KB at 35
   (a plain read: 42), 16-24 KB no better. */
#define AHEAD_BYTES 12288

/* Bytes of lanes one activation row of K values takes (xs, corr, xsum: K/4 entries of 4 bytes each). */
int64_t quant512_lane_bytes(int64_t K) { return 3 * K; }

/* The lanes of one activation row for type t, from its int8 values q and block scales d (one per 16 values,
   so per 4 lanes). */
void quant512_lanes(int t, const int8_t *q, const float *d, int64_t K, uint8_t *lanes) {
    float *xs = (float *)lanes, *xsum = xs + K / 4;
    int32_t *corr = (int32_t *)(xsum + K / 4);
    const int32_t offset = weight_offset(t);
    /* 64 values (16 groups, four activation blocks) a step: a group's sum is vpdpbusd of ones with its 4
       values, exact; each block's scale spread over its 4 lanes */
    const __m512i ones = _mm512_set1_epi8(1), spread = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
    int64_t g = 0;
    for (; g + 16 <= K / 4; g += 16) {
        const __m512i s4 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), ones, _mm512_loadu_si512(q + 4 * g));
        const __m512 dx = _mm512_permutexvar_ps(spread, _mm512_castps128_ps512(_mm_loadu_ps(d + g / 4)));
        _mm512_storeu_ps(xs + g, dx);
        _mm512_storeu_ps(xsum + g, _mm512_mul_ps(dx, _mm512_cvtepi32_ps(s4)));
        _mm512_storeu_si512(corr + g, _mm512_mullo_epi32(s4, _mm512_set1_epi32(-offset)));
    }
    for (; g < K / 4; g++) { /* an odd count of 32-value blocks: the last one */
        const int32_t s4 = q[4 * g] + q[4 * g + 1] + q[4 * g + 2] + q[4 * g + 3];
        xs[g] = d[g / 4];
        xsum[g] = d[g / 4] * (float)s4;
        corr[g] = -offset * s4;
    }
}

typedef struct {
    const int8_t *q;
    const float *xs, *xsum;
    const int32_t *corr;
} xrow_t;

/* Sub-blocks b and b + 1 (only b where !pair) of a weight row: values, scale lanes, min lanes. */
static inline __attribute__((always_inline)) void weight_pair(int t, const uint8_t *row, int64_t b, int pair,
                                                              __m512i *u, __m512 *ws, __m512 *wm) {
    if (t == T_Q8_0) { /* both f16 scales converted in one vcvtph2ps, not two scalar converts and shuffles */
        const uint8_t *p = row + b * 34;
        uint16_t ha, hc = 0;
        memcpy(&ha, p, 2);
        __m256i lo = _mm256_loadu_si256((const __m256i *)(p + 2)), hi = _mm256_setzero_si256();
        if (pair) {
            memcpy(&hc, p + 34, 2);
            hi = _mm256_loadu_si256((const __m256i *)(p + 36));
        }
        const __m512i v = _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
        *u = _mm512_xor_si512(v, _mm512_set1_epi8((char)0x80)); /* int8 + 128 */
        *ws = _mm512_cvtph_ps(_mm256_mask_set1_epi16(_mm256_set1_epi16((short)ha), 0xff00, (short)hc));
        *wm = _mm512_setzero_ps();
        return;
    }
    sub_t a, c = {.s_lo = 0, .s_hi = 0, .m = 0};
    unpack(t, row, b, &a, 0);
    const __m256i lo = unpack_vec(t, row, b);
    __m256i hi = _mm256_setzero_si256();
    if (pair) {
        unpack(t, row, b + 1, &c, 0);
        hi = unpack_vec(t, row, b + 1);
    }
    *u = _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
    const __m256 s0 = _mm256_set_m128(_mm_set1_ps(a.s_hi), _mm_set1_ps(a.s_lo));
    const __m256 s1 = _mm256_set_m128(_mm_set1_ps(c.s_hi), _mm_set1_ps(c.s_lo));
    *ws = _mm512_insertf32x8(_mm512_castps256_ps512(s0), s1, 1);
    *wm = _mm512_insertf32x8(_mm512_castps256_ps512(_mm256_set1_ps(a.m)), _mm256_set1_ps(c.m), 1);
}

/* out[n][r] = dot of weight row w[n] with activation row x[r], for n < nw, r < nx (constants at each call
   site, so the loops unroll; t too, so each format gets its own code). The rows ``ahead`` bytes past each
   weight row are prefetched, a pair's share of a row at a time. */
static inline __attribute__((always_inline)) void tile(int t, int nw, int nx, const uint8_t *const *w, const xrow_t *x,
                                                       int64_t K, int64_t row_bytes, int64_t ahead,
                                                       float out[TILE_W1][TILE_X]) {
    const int64_t nb = K / 32, pair_bytes = row_bytes / ((nb + 1) / 2);
    const int offset = weight_offset(t) != 0, mins = weight_has_min(t);
    __m512 acc[TILE_W1][TILE_X];
    for (int n = 0; n < nw; n++)
        for (int r = 0; r < nx; r++) acc[n][r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b += 2) {
        const int pair = b + 1 < nb; /* an odd count of sub-blocks ends with one: the upper half masked off */
        const __mmask64 bytes = pair ? ~0ULL : 0xffffffffULL;
        const __mmask16 lanes = pair ? 0xffff : 0x00ff;
        __m512i u[TILE_W1];
        __m512 ws[TILE_W1], wm[TILE_W1];
        for (int n = 0; n < nw; n++) {
            const uint8_t *next = w[n] + ahead + (b / 2) * pair_bytes;
            _mm_prefetch((const char *)next, _MM_HINT_T0);
            _mm_prefetch((const char *)next + 63, _MM_HINT_T0);
            weight_pair(t, w[n], b, pair, &u[n], &ws[n], &wm[n]);
        }
        for (int r = 0; r < nx; r++) {
            const __m512i xv = _mm512_maskz_loadu_epi8(bytes, x[r].q + 32 * b);
            const __m512 xs = _mm512_maskz_loadu_ps(lanes, x[r].xs + 8 * b);
            const __m512i start = offset ? _mm512_maskz_loadu_epi32(lanes, x[r].corr + 8 * b) : _mm512_setzero_si512();
            const __m512 xm = mins ? _mm512_maskz_loadu_ps(lanes, x[r].xsum + 8 * b) : _mm512_setzero_ps();
            for (int n = 0; n < nw; n++) {
                const __m512i dot = _mm512_dpbusd_epi32(start, u[n], xv);
                acc[n][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(ws[n], xs), acc[n][r]);
                if (mins) acc[n][r] = _mm512_fmadd_ps(wm[n], xm, acc[n][r]);
            }
        }
    }
    for (int n = 0; n < nw; n++)
        for (int r = 0; r < nx; r++) out[n][r] = _mm512_reduce_add_ps(acc[n][r]);
}

#define FORMATS(NW, NX)                                                                                        \
    switch (t) {                                                                                               \
    case T_Q8_0: tile(T_Q8_0, NW, NX, w, x, K, row_bytes, ahead, out); break;                                  \
    case T_Q4_0: tile(T_Q4_0, NW, NX, w, x, K, row_bytes, ahead, out); break;                                  \
    case T_Q4_1: tile(T_Q4_1, NW, NX, w, x, K, row_bytes, ahead, out); break;                                  \
    case T_Q5_0: tile(T_Q5_0, NW, NX, w, x, K, row_bytes, ahead, out); break;                                  \
    case T_Q5_1: tile(T_Q5_1, NW, NX, w, x, K, row_bytes, ahead, out); break;                                  \
    case T_Q4_K: tile(T_Q4_K, NW, NX, w, x, K, row_bytes, ahead, out); break;                                  \
    case T_Q6_K: tile(T_Q6_K, NW, NX, w, x, K, row_bytes, ahead, out); break;                                  \
    default: tile(T_I8, NW, NX, w, x, K, row_bytes, ahead, out); break;                                        \
    }

/* nw: TILE_W1 for a single row of x (nx its 1 or 2 terms), else TILE_W */
static void tile_any(int t, int nw, int nx, const uint8_t *const *w, const xrow_t *x, int64_t K, int64_t row_bytes,
                     int64_t ahead, float out[TILE_W1][TILE_X]) {
    if (nw == TILE_W1 && nx == 2) {
        FORMATS(TILE_W1, 2)
    } else if (nw == TILE_W1) {
        FORMATS(TILE_W1, 1)
    } else if (nx == TILE_X) {
        FORMATS(TILE_W, TILE_X)
    } else if (nx == 4) {
        FORMATS(TILE_W, 4)
    } else if (nx == 2) {
        FORMATS(TILE_W, 2)
    } else {
        FORMATS(TILE_W, 1)
    }
}

/* y[rows / terms][n] = x @ W^T (+ bias) for the output rows n of [n_begin, n_end). q: the quantized
   activations (rows * K int8, each row of x's terms adjacent), lanes: quant512_lanes of each row (rows *
   quant512_lane_bytes(K)); ldy: floats between y's rows. */
void quant512_span(int t, const int8_t *q, const uint8_t *lanes, int64_t rows, int terms, int64_t K,
                   const uint8_t *w, int64_t n_begin, int64_t n_end, int64_t ldy, int64_t row_bytes,
                   const float *bias, float *y) {
    const int64_t ahead = AHEAD_BYTES, nw = rows == terms ? TILE_W1 : TILE_W;
    /* the span's first bytes: the tiles' own prefetches start ``ahead`` past them */
    for (int64_t at = 0; at < ahead && at < (n_end - n_begin) * row_bytes; at += 64)
        _mm_prefetch((const char *)(w + n_begin * row_bytes + at), _MM_HINT_T0);
    for (int64_t n0 = n_begin; n0 < n_end; n0 += nw) {
        const uint8_t *wr[TILE_W1];
        for (int n = 0; n < nw; n++) wr[n] = w + (n0 + n < n_end ? n0 + n : n0) * row_bytes; /* past: a repeat */
        for (int64_t i0 = 0; i0 < rows;) { /* the tile's weight rows stay in cache for every group of x's rows */
            const int64_t left = rows - i0;
            const int nx = left >= TILE_X ? TILE_X : left >= 4 ? 4 : left >= 2 ? 2 : 1;
            xrow_t x[TILE_X];
            for (int r = 0; r < nx; r++) {
                const float *lane = (const float *)(lanes + (i0 + r) * quant512_lane_bytes(K));
                x[r] = (xrow_t){q + (i0 + r) * K, lane, lane + K / 4, (const int32_t *)(lane + K / 2)};
            }
            float out[TILE_W1][TILE_X];
            tile_any(t, (int)nw, nx, wr, x, K, row_bytes, ahead, out);
            for (int n = 0; n < nw && n0 + n < n_end; n++)
                for (int r = 0; r < nx; r++) {
                    float *at = term_out(y, ldy, i0 + r, terms) + n0 + n; /* a row's first term stores, the next adds */
                    *at = ((i0 + r) % terms ? *at : bias ? bias[n0 + n] : 0) + out[n][r];
                }
            i0 += nx;
        }
    }
}

/* quant512_span over all N output rows inside quant.c's parallel region: each thread one run of rows
   (its prefetches run ahead within it), a multiple of the widest tile. */
void quant512_rows(int t, const int8_t *q, const uint8_t *lanes, int64_t rows, int terms, int64_t K, const uint8_t *w,
                   int64_t N, int64_t row_bytes, const float *bias, float *y, int64_t ldy) {
#ifdef _OPENMP
    const int64_t threads = omp_get_num_threads();
#else
    const int64_t threads = 1;
#endif
    const int64_t tiles = (N + TILE_W1 - 1) / TILE_W1;
#pragma omp for schedule(static)
    for (int64_t c = 0; c < threads; c++) {
        const int64_t begin = c * tiles / threads * TILE_W1, end = (c + 1) * tiles / threads * TILE_W1;
        if (begin < N) quant512_span(t, q, lanes, rows, terms, K, w, begin, end < N ? end : N, ldy, row_bytes, bias, y);
    }
}
#endif
