/* y = x @ W^T (+ bias) on CPU straight from 16-bit weight rows (GGUF's F16 and BF16 tensors, as
   convert_hf_to_gguf.py --outtype f16|bf16 writes them), so such a file streams its own 2 bytes per
   weight a token rather than the 4 of a float32 copy made at load.

   BF16 with AVX-512 BF16 (Zen 4/5, Cooper Lake, Sapphire Rapids): vdpbf16ps multiplies pairs of bf16
   and adds them into float32 lanes, 32 products an instruction. It takes bf16 activations, so each row
   of x is split once per call into two bf16 rows, hi = bf16(x) and lo = bf16(x - hi), and every weight
   row is multiplied with both: hi + lo holds x to 16 significant bits (a relative error of at most
   2^-17, against bf16's 2^-9 alone), at twice the dot work, which a decode step hides behind the weight
   stream (llama.cpp rounds x to bf16 once: HALF_BF16_ONCE, kept to measure the two against each other,
   benchmarks/engine/half_linear.py). Without AVX512-BF16 each bf16 weight becomes a float32 by a shift
   and meets the float32 hi + lo (exact in float32) in an FMA: the same function, other roundings.
   F16 weights are converted by vcvtph2ps (F16C) and meet x as it is, in float32.

   Denormal bf16 activation halves are flushed to zero in every build, as vdpbf16ps reads them, so all
   builds compute one function up to the order of float32 sums (tests/test_half_kernels.py bounds that).
   AVX-512F/BW tiles of HALF_TW weight rows by up to HALF_TX activation rows, AVX2 + FMA + F16C the same
   tiles at 8 lanes, plain C otherwise (the PDSERVE_HALF_SCALAR build the tests compare too); OpenMP
   splits the output rows into one run per thread, each streaming its part of W once for every row of x.
   The entry points take kernels/cpu/quant.c's arguments, so the fused decode step (decode_step.c) calls
   them through the same pointer types. */
#include <stdint.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif
#include "half_tiles.h"

/* f32 -> bf16, rounded to nearest even (as vcvtneps2bf16 and torch round); a denormal result is 0 */
static inline uint16_t bf16_of(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40); /* NaN stays a quiet NaN */
    u += 0x7fffu + ((u >> 16) & 1);
    if ((u & 0x7f800000u) == 0) return (uint16_t)((u >> 16) & 0x8000); /* vdpbf16ps reads denormals as 0 */
    return (uint16_t)(u >> 16);
}

static inline float f32_of_bf16(uint16_t h) {
    const uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* Row i of x as the kernels read it: hi/lo bf16 halves for BF16 (lo zero for HALF_BF16_ONCE), and their
   float32 sum xr for the builds without vdpbf16ps. F16 reads x itself. */
static void prepare_row(int t, const float *x, int64_t K, uint16_t *hi, uint16_t *lo, float *xr) {
    for (int64_t k = 0; k < K; k++) {
        const uint16_t h = bf16_of(x[k]);
        const uint16_t l = t == HALF_BF16 ? bf16_of(x[k] - f32_of_bf16(h)) : 0;
        hi[k] = h, lo[k] = l;
        xr[k] = f32_of_bf16(h) + f32_of_bf16(l); /* exact: lo is below hi's last bit */
    }
}

int64_t pdserve_half_scratch_bytes(int64_t rows, int64_t K) { return rows * K * 8; }
int pdserve_half_path(void) { return HALF_PATH; } /* half_tiles.h: 3 vdpbf16ps, 2 AVX-512F, 1 AVX2, 0 C */

/* out[n][r] for weight rows n < nw of run `w` and rows r of x: the SIMD tiles, or C in order of k. */
static void dot_tile(int t, int nw, int nx, const uint16_t *const *w, const half_x *x, int64_t K,
                     float out[HALF_TW][HALF_TX]) {
#if HALF_PATH
    half_tile(t, nw, nx, w, x, K, out);
#else
    for (int n = 0; n < nw; n++)
        for (int r = 0; r < nx; r++) {
            float acc = 0;
            if (t == HALF_F16)
                for (int64_t k = 0; k < K; k++) acc += half_f16_to_f32(w[n][k]) * x[r].x[k];
            else
                for (int64_t k = 0; k < K; k++) acc += f32_of_bf16(w[n][k]) * x[r].xr[k];
            out[n][r] = acc;
        }
#endif
}

/* Rows of x a weight tile meets before the next tile: their bf16 halves (4 bytes a value) stay in L2 while
   the thread's run of weight rows streams past them once per block. Unblocked, a 256-token prefill chunk's
   halves (590 KB at K 576, 1.5 MB at 1536) left L2 between tiles: 3072x576 at 256 rows ran at 50 GMAC/s
   on one Zen 5 core against 90 at 64 rows. */
#define HALF_ROW_BLOCK 64

/* y[i_begin:i_end, begin:end] for the output rows [begin, end) and rows [i_begin, i_end) of x: tiles of
   HALF_TW weight rows by groups of x's rows. scratch holds all `rows` rows' halves. */
static void span_block(int t, const float *x, const uint8_t *scratch, int64_t rows, int64_t i_begin, int64_t i_end,
                       int64_t K, const uint8_t *w, int64_t begin, int64_t end, int64_t row_bytes, const float *bias,
                       float *y, int64_t ldy) {
    const uint16_t *hi = (const uint16_t *)scratch, *lo = hi + rows * K;
    const float *xr = (const float *)(lo + rows * K);
#if HALF_PATH
    /* the span's first bytes: the tiles' own prefetches start HALF_AHEAD past them */
    for (int64_t at = 0; at < HALF_AHEAD && at < (end - begin) * row_bytes; at += 64)
        _mm_prefetch((const char *)(w + begin * row_bytes + at), _MM_HINT_T0);
#endif
    for (int64_t n0 = begin; n0 < end; n0 += HALF_TW) {
        const int nw = end - n0 < HALF_TW ? (int)(end - n0) : HALF_TW;
        const uint16_t *wr[HALF_TW];
        for (int n = 0; n < HALF_TW; n++) wr[n] = (const uint16_t *)(w + (n0 + (n < nw ? n : 0)) * row_bytes);
        for (int64_t i0 = i_begin; i0 < i_end;) {
            const int nx = i_end - i0 >= HALF_TX ? HALF_TX : (int)(i_end - i0);
            half_x xs[HALF_TX];
            for (int r = 0; r < nx; r++) {
                const int64_t i = i0 + r;
                xs[r] = (half_x){x + i * K, xr + i * K, hi + i * K, lo + i * K};
            }
            float out[HALF_TW][HALF_TX];
            dot_tile(t, nw, nx, wr, xs, K, out);
            for (int n = 0; n < nw; n++)
                for (int r = 0; r < nx; r++) y[(i0 + r) * ldy + n0 + n] = (bias ? bias[n0 + n] : 0) + out[n][r];
            i0 += nx;
        }
    }
}

/* y[:, n] for the output rows [begin, end): tiles of HALF_TW weight rows by groups of x's rows, a block
   of x's rows at a time. */
static void span(int t, const float *x, const uint8_t *scratch, int64_t rows, int64_t K, const uint8_t *w,
                 int64_t begin, int64_t end, int64_t row_bytes, const float *bias, float *y, int64_t ldy) {
    for (int64_t i = 0; i < rows; i += HALF_ROW_BLOCK)
        span_block(t, x, scratch, rows, i, i + HALF_ROW_BLOCK < rows ? i + HALF_ROW_BLOCK : rows, K, w, begin, end,
                   row_bytes, bias, y, ldy);
}

/* The body of pdserve_half_linear_into for every thread of an enclosing team, as quant.c's
   pdserve_quant_linear_team_into (decode_step_team.c): own_scratch, each thread prepares every row of x
   in its own scratch rather than waiting at a barrier for one shared copy. */
void pdserve_half_linear_team_into(int t, const float *x, int64_t rows, int64_t K, const uint8_t *w, int64_t N,
                                   int64_t row_bytes, const float *bias, float *y, int64_t ldy, uint8_t *scratch,
                                   int own_scratch) {
    uint16_t *hi = (uint16_t *)scratch, *lo = hi + rows * K;
    float *xr = (float *)(lo + rows * K);
    if (t != HALF_F16) {
        if (own_scratch) {
            for (int64_t i = 0; i < rows; i++) prepare_row(t, x + i * K, K, hi + i * K, lo + i * K, xr + i * K);
        } else {
#pragma omp for schedule(static)
            for (int64_t i = 0; i < rows; i++) prepare_row(t, x + i * K, K, hi + i * K, lo + i * K, xr + i * K);
        }
    }
#ifdef _OPENMP
    const int64_t threads = omp_get_num_threads();
#else
    const int64_t threads = 1;
#endif
    /* one run of whole tiles per thread: its prefetches run ahead within it */
    const int64_t tiles = (N + HALF_TW - 1) / HALF_TW;
#pragma omp for schedule(static)
    for (int64_t c = 0; c < threads; c++) {
        const int64_t begin = c * tiles / threads * HALF_TW, end = (c + 1) * tiles / threads * HALF_TW;
        if (begin < N) span(t, x, scratch, rows, K, w, begin, end < N ? end : N, row_bytes, bias, y, ldy);
    }
}

/* y[rows][N] (rows ldy floats apart) = x[rows][K] @ W^T (+ bias), W as N rows of row_bytes (2 K) bytes.
   scratch: pdserve_half_scratch_bytes(rows, K). */
void pdserve_half_linear_into(int t, const float *x, int64_t rows, int64_t K, const uint8_t *w, int64_t N,
                              int64_t row_bytes, const float *bias, float *y, int64_t ldy, uint8_t *scratch,
                              int threads) {
#pragma omp parallel num_threads(threads)
    pdserve_half_linear_team_into(t, x, rows, K, w, N, row_bytes, bias, y, ldy, scratch, 0);
}

/* Rows [n0, n0 + count) of W as float32 into out[count][K]: the panel form's weights (exact). */
void pdserve_half_dequantize(int t, const uint8_t *w, int64_t n0, int64_t count, int64_t K, int64_t row_bytes,
                             float *out, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t n = 0; n < count; n++) {
        const uint16_t *row = (const uint16_t *)(w + (n0 + n) * row_bytes);
        for (int64_t k = 0; k < K; k++)
            out[n * K + k] = t == HALF_F16 ? half_f16_to_f32(row[k]) : f32_of_bf16(row[k]);
    }
}
