/* x @ w^T on CPU, fp32, for the few rows of a decode step: out[m][n] = sum_k x[m][k] * w[n][k] (+ bias[n]).

   With a handful of rows the product is a stream over the weight: every weight byte is read once and
   used for only a few multiply-adds, so the memory read is the floor. oneDNN's and MKL's products read
   the small-model weights at well under what one core can stream (a whole-model pass, one thread,
   2026-11-24 Xeon: 4 rows 9.7 ms packed, 15.1 dense, against 6.6 here; memory floor ~6.3). This kernel
   walks the weight in its own [out, in] layout (the dense one: no second copy in another layout),
   prefetching the next tile's rows while it computes this one. With more rows the product becomes
   arithmetic and oneDNN's blocked GEMM wins (from ~32 rows here): engine/cpu_linear.py times both.

   Tiles: MT rows of x against NT rows of w, MT * NT = LANES dot products, each a vector of partial
   sums over k, reduced together by sum_lanes. Per OpenMP task a block of NBLOCK weight rows, every x
   row passing over each of its tiles while that tile is in L1.
*/
#include "cpu_vector.h"

#define NBLOCK 64 /* weight rows per task */

#define DEFINE_TILE(MT, NT)                                                                             \
    static void tile_##MT(const float *x, int64_t K, const float *w, float *out, int64_t N) {         \
        vf acc[LANES] = {0};                                                                           \
        for (int64_t k = 0; k < K; k += LANES) {                                                       \
            vf wv[NT];                                                                                 \
            for (int j = 0; j < NT; j++) wv[j] = loadv(w + j * K + k);                                \
            /* a line of each of the next tile's rows: 4 rows took 11.2 ms without, 7.0 with */ \
            for (int j = 0; j < NT; j++) __builtin_prefetch(w + (NT + j) * K + k);                     \
            for (int i = 0; i < MT; i++) {                                                             \
                const vf xv = loadv(x + i * K + k);                                                    \
                for (int j = 0; j < NT; j++) acc[i * NT + j] += wv[j] * xv;                            \
            }                                                                                          \
        }                                                                                              \
        float sums[LANES];                                                                             \
        storev(sums, sum_lanes(acc));                                                                  \
        for (int i = 0; i < MT; i++)                                                                   \
            for (int j = 0; j < NT; j++) out[i * N + j] = sums[i * NT + j];                            \
    }
DEFINE_TILE(4, LANES / 4)
DEFINE_TILE(2, LANES / 2)
DEFINE_TILE(1, LANES)

int pdserve_linear_supported(int64_t in_features, int64_t out_features) {
    return in_features > 0 && out_features > 0 && in_features % LANES == 0 && out_features % NBLOCK == 0;
}

/* x: [M, K] contiguous; w: [N, K] contiguous; bias: [N] or NULL; out: [M, N] contiguous.
   The caller checks pdserve_linear_supported(K, N) once per weight. */
void pdserve_linear_f32(const float *x, int64_t M, int64_t K, const float *w, int64_t N, const float *bias,
                        float *out, int num_threads) {
    const int64_t m4 = M / 4 * 4, m2 = m4 + (M - m4) / 2 * 2; /* rows [0, m4) in fours, [m4, m2) in twos */
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t n0 = 0; n0 < N; n0 += NBLOCK) {
        for (int64_t n = n0; n < n0 + NBLOCK; n += LANES / 4)
            for (int64_t m = 0; m < m4; m += 4) tile_4(x + m * K, K, w + n * K, out + m * N + n, N);
        for (int64_t n = n0; n < n0 + NBLOCK; n += LANES / 2)
            for (int64_t m = m4; m < m2; m += 2) tile_2(x + m * K, K, w + n * K, out + m * N + n, N);
        for (int64_t n = n0; n < n0 + NBLOCK; n += LANES)
            for (int64_t m = m2; m < M; m++) tile_1(x + m * K, K, w + n * K, out + m * N + n, N);
        if (bias != NULL)
            for (int64_t m = 0; m < M; m++)
                for (int64_t n = n0; n < n0 + NBLOCK; n++) out[m * N + n] += bias[n];
    }
}
