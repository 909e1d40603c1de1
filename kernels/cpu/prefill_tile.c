/* One query tile of prefill.c's attention: Q^T packed, then per key tile the three steps prefill.c's
   opening comment draws (scores, online softmax, values), then the output rows. The key rows come as
   pointers (sc->k_rows, v_rows): into a float32 pool, or into the thread's dequantized int8 tile. */
#include <float.h>

#include "prefill.h"

/* Step 1 for one key tile: st[t][r] = k_t . qt[:, r] for t < nk. RV (rows / LANES) is a constant in
   each copy, so the KEY_ROWS x RV accumulators stay in registers. Always inlined into its switch: GCC
   otherwise keeps one copy with RV a run-time value and the accumulators in memory (1.7x slower). */
static inline __attribute__((always_inline)) void key_scores(const float *qt, float *st, const float *const *k_rows,
                                                             int nk, int D, const int RV) {
    const int R = RV * LANES;
    for (int t = 0; t < nk; t += KEY_ROWS) {
        const int kr = nk - t < KEY_ROWS ? nk - t : KEY_ROWS;
        vf acc[KEY_ROWS][MAX_ROWS / LANES]; /* fixed bounds: a variable-length array stays in memory */
        for (int i = 0; i < KEY_ROWS; i++)
            for (int v = 0; v < RV; v++) acc[i][v] = (vf){0};
        const float *key[KEY_ROWS];
        for (int i = 0; i < KEY_ROWS; i++) key[i] = k_rows[t + (i < kr ? i : 0)]; /* a short group repeats */
        for (int d = 0; d < D; d++) {
            const float *qd = qt + d * R;
            vf b[KEY_ROWS];
            for (int i = 0; i < KEY_ROWS; i++) b[i] = splat(key[i][d]);
            for (int v = 0; v < RV; v++) {
                const vf x = loadv(qd + v * LANES);
                for (int i = 0; i < KEY_ROWS; i++) acc[i][v] += b[i] * x;
            }
        }
        for (int i = 0; i < kr; i++)
            for (int v = 0; v < RV; v++) storev(st + (t + i) * R + v * LANES, acc[i][v]);
    }
}

/* Step 3 for one key tile: o[r] = o[r] * alpha[r] + sum_t st[t][r] v_t. C (head_dim / LANES) is a
   constant in each copy, for the same reason. */
static inline __attribute__((always_inline)) void add_values(float *o, const float *st, const float *const *v_rows,
                                                             const float *alpha, int nk, int R, const int C) {
    const int D = C * LANES;
    for (int r = 0; r < R; r += OUT_ROWS) {
        vf acc[OUT_ROWS][MAX_HEAD_DIM / LANES];
        for (int i = 0; i < OUT_ROWS; i++)
            for (int c = 0; c < C; c++) acc[i][c] = loadv(o + (r + i) * D + c * LANES) * alpha[r + i];
        for (int t = 0; t < nk; t++) {
            const float *p = st + t * R + r;
            vf x[MAX_HEAD_DIM / LANES];
            for (int c = 0; c < C; c++) x[c] = loadv(v_rows[t] + c * LANES);
            for (int i = 0; i < OUT_ROWS; i++) {
                const vf pi = splat(p[i]);
                for (int c = 0; c < C; c++) acc[i][c] += pi * x[c];
            }
        }
        for (int i = 0; i < OUT_ROWS; i++)
            for (int c = 0; c < C; c++) storev(o + (r + i) * D + c * LANES, acc[i][c]);
    }
}

static void key_scores_any(const float *qt, float *st, const float *const *k_rows, int nk, int D, int RV) {
    switch (RV) { /* rows / LANES: 16 * group / LANES, group 1-8 */
#define RV_CASE(N) case N: key_scores(qt, st, k_rows, nk, D, N); break;
        RV_CASE(1) RV_CASE(2) RV_CASE(3) RV_CASE(4) RV_CASE(5) RV_CASE(6) RV_CASE(7) RV_CASE(8)
#if LANES < 16
        RV_CASE(10) RV_CASE(12) RV_CASE(14) RV_CASE(16)
#endif
#if LANES < 8
        RV_CASE(20) RV_CASE(24) RV_CASE(28) RV_CASE(32)
#endif
#undef RV_CASE
    }
}

static void add_values_any(float *o, const float *st, const float *const *v_rows, const float *alpha, int nk, int R,
                           int D) {
    switch (D) {
    case 16: add_values(o, st, v_rows, alpha, nk, R, 16 / LANES); break;
    case 32: add_values(o, st, v_rows, alpha, nk, R, 32 / LANES); break;
    case 64: add_values(o, st, v_rows, alpha, nk, R, 64 / LANES); break;
    case 128: add_values(o, st, v_rows, alpha, nk, R, 128 / LANES); break;
    }
}

/* Packs query tile `tile` (its first, n, pos0 set) of kv head kv_head: Q^T scaled, O zero, the rows'
   positions, the softmax state empty. G query heads per kv head, D = head_dim. */
void prefill_start_tile(const Task *task, QueryTile *tile, int64_t kv_head, int G, int D) {
    const int R = QUERY_TILE * G, RV = R / LANES;
    const int64_t n = tile->n;
    for (int j = 0; j < QUERY_TILE; j++)
        for (int g = 0; g < G; g++) {
            const float *row = task->q + (tile->first + (j < n ? j : n - 1)) * task->q_stride + (kv_head * G + g) * D;
            for (int d = 0; d < D; d++) tile->qt[d * R + j * G + g] = row[d] * task->scale;
        }
    memset(tile->o, 0, sizeof(float) * R * D);
    /* Row r = j * G + g holds query j: its position, to mask the keys after it. Rows past n repeat
       the last query (their results are dropped), so every row sees key 0 and no row is all masked. */
    for (int v = 0; v < RV; v++)
        for (int i = 0; i < LANES; i++) {
            const int j = (v * LANES + i) / G;
            tile->row_pos[v][i] = (int32_t)(tile->pos0 + (j < n ? j : n - 1));
        }
    for (int v = 0; v < RV; v++) tile->m[v] = splat(-FLT_MAX), tile->l[v] = (vf){0};
}

/* Steps 1-3 of one query tile over keys t0 .. t0 + nk - 1 (sc->k_rows / v_rows). */
void prefill_attend_keys(Scratch *sc, QueryTile *tile, int64_t t0, int nk, int G, int D) {
    const int R = QUERY_TILE * G, RV = R / LANES;
    float *st = sc->st, *alpha = sc->alpha;
    /* 1. S^T = K Q^T. */
    key_scores_any(tile->qt, st, sc->k_rows, nk, D, RV);
    /* 2. The causal mask and the online softmax, along the rows. */
    const int masked = t0 + nk - 1 > tile->pos0; /* some key here lies after some query's position */
    for (int v = 0; v < RV; v++) {
        vf tile_max = splat(-FLT_MAX);
        for (int t = 0; t < nk; t++) {
            vf s = loadv(st + t * R + v * LANES);
            if (masked) {
                s = select(tile->row_pos[v] >= (int32_t)(t0 + t), s, splat(-FLT_MAX));
                storev(st + t * R + v * LANES, s);
            }
            tile_max = select(s > tile_max, s, tile_max);
        }
        const vf m_new = select(tile_max > tile->m[v], tile_max, tile->m[v]);
        storev(alpha + v * LANES, exp_nonpositive(tile->m[v] - m_new));
        vf sum = (vf){0};
        for (int t = 0; t < nk; t++) {
            const vf s = loadv(st + t * R + v * LANES);
            vf p = exp_nonpositive(s - m_new);
            if (masked) p = select(s > splat(-FLT_MAX), p, (vf){0});
            storev(st + t * R + v * LANES, p);
            sum += p;
        }
        tile->l[v] = tile->l[v] * loadv(alpha + v * LANES) + sum;
        tile->m[v] = m_new;
    }
    /* 3. O = O * alpha + P V. */
    add_values_any(tile->o, st, sc->v_rows, alpha, nk, R, D);
}

void prefill_finish_tile(const Task *task, const QueryTile *tile, int64_t kv_head, int G, int D) {
    for (int j = 0; j < tile->n; j++)
        for (int g = 0; g < G; g++) {
            const int r = j * G + g;
            const float inv = 1.0f / tile->l[r / LANES][r % LANES];
            float *row = task->out + (tile->first + j) * task->out_stride + (kv_head * G + g) * D;
            for (int d = 0; d < D; d++) row[d] = tile->o[r * D + d] * inv;
        }
}

