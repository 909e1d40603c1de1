/* x @ w^T on CPU, fp32, for the rows of a decode step: out[m][n] = sum_k x[m][k] * w[n][k] (+ bias[n]).

   The weight is read from a copy in this kernel's own layout, made once at load (pdserve_linear_pack_f32):

       packed[n / NR][k][n % NR] = w[n][k]        (NR outputs side by side for each k)

   so one pass over the weight is one sequential stream, and a step of k is NV full vectors of NR outputs.
   A register tile of MR rows of x by NR outputs keeps MR * NV accumulators; each k loads NV weight
   vectors and broadcasts MR values of x, so there is no horizontal reduction and every output is one
   sum in k order (the same bits whichever tile, row count or thread computes it: batch-invariant).

   Whole-model weight passes (every projection and the LM head of the `small` model, cold in cache),
   2026-11-25, 2-core AMD EPYC (AVX-512), one thread, ms; the dense-layout kernel this replaced walked
   MT rows of x against NT weight rows with a lane reduction per tile:

       rows              1     2     4     8    16    32    64
       dense layout   10.5  11.5  13.7  15.5  23.0  39.8  74.1
       this            6.8   6.1   6.6   8.2  15.0  25.6  49.0
       torch F.linear 14.3  25.6  23.3  26.0  32.8  45.8  73.6

   On two threads at 64 rows it ran at 204 GFLOP/s, above the 176 of a 512-row torch.mm there. Past
   ~128 rows a GEMM needs cache blocking this kernel does not do, so prefill keeps oneDNN's
   (engine/model/cpu_linear.py). */
#include "vector.h"

/* NV vectors of outputs by MR rows: MR * NV accumulators, NV weight vectors and one broadcast in
   registers (AVX-512 has 32: 24 + 4 + 1; AVX2 and SSE 16: 12 + 2 + 1). */
#if LANES == 16
#define NV 4
#else
#define NV 2
#endif
#define MR 6
#define NR (NV * LANES)
#define OUT_MULTIPLE 64 /* every NR above divides it: one shape rule for every build */
#define LINE 16           /* floats in a cache line */
#define STREAM_AHEAD 4096 /* floats (16 KiB): how far ahead of its reads a lone tile prefetches */

/* Prefetches into L2 for the first pf_steps steps of k: pf_stride floats per step from pf, a line at a
   time (see pdserve_linear_f32 for what they fetch). */
#define DEFINE_TILE(ROWS)                                                                               \
    static void tile_##ROWS(const float *x, int64_t K, const float *wp, float *out, int64_t N,          \
                            const float *pf, int64_t pf_steps, int64_t pf_stride) {                    \
        vf acc[ROWS][NV];                                                                              \
        for (int i = 0; i < ROWS; i++)                                                                 \
            for (int v = 0; v < NV; v++) acc[i][v] = (vf){0};                                         \
        for (int64_t k = 0; k < K; k++) {                                                             \
            for (int64_t l = 0; k < pf_steps && l < pf_stride; l += LINE)                              \
                __builtin_prefetch(pf + pf_stride * k + l, 0, 2);                                      \
            vf w[NV];                                                                                  \
            for (int v = 0; v < NV; v++) w[v] = loadv(wp + k * NR + v * LANES);                       \
            for (int i = 0; i < ROWS; i++) {                                                          \
                const vf xb = splat(x[i * K + k]);                                                    \
                for (int v = 0; v < NV; v++) acc[i][v] += xb * w[v];                                  \
            }                                                                                          \
        }                                                                                              \
        for (int i = 0; i < ROWS; i++)                                                                 \
            for (int v = 0; v < NV; v++) storev(out + i * N + v * LANES, acc[i][v]);                  \
    }
DEFINE_TILE(6)
DEFINE_TILE(4)
DEFINE_TILE(2)
DEFINE_TILE(1)

int pdserve_linear_supported(int64_t in_features, int64_t out_features) {
    return in_features > 0 && out_features > 0 && out_features % OUT_MULTIPLE == 0;
}

/* NR: the packed copy of an [N, K] weight is an [N / NR, K, NR] array. */
int64_t pdserve_linear_block(void) { return NR; }

/* w: [N, K] contiguous -> wp: the layout above. The caller checks pdserve_linear_supported(K, N). */
void pdserve_linear_pack_f32(const float *w, int64_t N, int64_t K, float *wp, int num_threads) {
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t nb = 0; nb < N / NR; nb++)
        for (int64_t j = 0; j < NR; j++) {
            const float *row = w + (nb * NR + j) * K;
            float *dst = wp + nb * K * NR + j;
            for (int64_t k = 0; k < K; k++) dst[k * NR] = row[k];
        }
}

/* x: [M, K] contiguous; wp: a packed [N, K] weight; bias: [N] or NULL; out: [M, N] contiguous. Each
   thread takes whole blocks of NR outputs and runs every row of x over them while they are in cache. */
void pdserve_linear_f32(const float *x, int64_t M, int64_t K, const float *wp, int64_t N, const float *bias,
                        float *out, int num_threads) {
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t nb = 0; nb < N / NR; nb++) {
        const float *w = wp + nb * K * NR;
        float *o = out + nb * NR;
        /* With more rows than one tile, every tile after the first reads this block from L2 while the
           memory bus idles: each tile prefetches its share of the next block meanwhile (two lines per
           step of k). Whole decode steps of the `small` model, 2-core Xeon, 2026-11-27, fastest of 5 x 20
           steps in three alternated runs, ms: 8 sequences 11.2-13.3 -> 7.4-9.2, 16: 14.3-15.5 ->
           10.9-14.2, 32: 23.2-25.1 -> 20.8-24.5 (fetching 4 lines per step in the later tiles only:
           9.1-9.7, 13.3-13.8, 22.3-22.5).
           With rows for one tile (a decode step of a few sequences), the first tile streams the block
           from memory and prefetches its own stream STREAM_AHEAD floats ahead of its reads. Whole decode
           steps on two threads (benchmarks.engine.step_profile: fastest of 3 x 40 steps, three alternated
           runs), same machine and day, ms: 2 sequences 6.4-8.3 -> 6.0-6.2, 4: 8.2-9.2 -> 6.8-7.7, 6:
           9.0-11.9 -> 7.1-8.5; 1 and 8 the same (one sequence already runs at the memory's speed). On
           the EPYC (2026-11-25) prefetching the stream had slowed the kernel; not measured there since. */
        const int64_t lines = K * NR / LINE; /* cache lines of a block */
        int64_t fetched = nb + 1 < N / NR && M > MR ? 0 : lines; /* of the next block */
        const float *next = w + K * NR;
        int64_t m = 0;
#define TILE(ROWS)                                                                                      \
    do {                                                                                               \
        if (m == 0 && M <= MR) {                                                                       \
            tile_##ROWS(x, K, w, o, N, w + STREAM_AHEAD, K, NR);                                       \
        } else {                                                                                       \
            const int64_t steps = (lines - fetched < 2 * K ? lines - fetched : 2 * K) / 2;             \
            tile_##ROWS(x + m * K, K, w, o + m * N, N, next + LINE * fetched, steps, 2 * LINE);        \
            fetched += 2 * steps;                                                                      \
        }                                                                                              \
    } while (0)
        for (; m + MR <= M; m += MR) TILE(6);
        for (; m + 4 <= M; m += 4) TILE(4);
        for (; m + 2 <= M; m += 2) TILE(2);
        for (; m < M; m++) TILE(1);
#undef TILE
        if (bias != NULL)
            for (int64_t r = 0; r < M; r++)
                for (int64_t n = 0; n < NR; n++) o[r * N + n] += bias[nb * NR + n];
    }
}
