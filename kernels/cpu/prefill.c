/* Prefill attention on CPU, fp32: each request's chunk of queries over its paged K/V, causal, in tiles.

   The torch path (paged_prefill.py) gathers each request's pages into a contiguous copy and runs SDPA
   on it: the copy is one more pass over the K/V, and with a cached prefix (a later chunk, a prefix-cache
   hit) SDPA takes an explicit mask and computes the whole [chunk, context] box. On the 2-core Xeon,
   one thread, attention was 39% of a 2048-token prefill (411 of 1053 ms) at ~85 GFLOP/s.

   This kernel reads K and V straight from the pool through the block table and skips the key tiles
   past a query tile's last position. One OpenMP task per (request, kv head, tile of QUERY_TILE
   queries); its rows are the (query, head of the group) pairs, so each K/V row it loads serves the
   whole query group (GQA). Flash-attention style, per tile of KEY_TILE keys:
     1. S^T[t][r] = k_t . (q_r * scale): the keys' elements broadcast against Q^T, packed once per task,
        so that the softmax below runs along the rows r, LANES at a time, and needs no transpose;
     2. online softmax: m_r = max(m_r, max_t S), p = e^(S - m_r), l_r = l_r e^(m_old - m_r) + sum_t p;
     3. O[r] = O[r] e^(m_old - m_r) + sum_t p[t][r] v_t; at the end out_r = O[r] / l_r.
   Keys past a query's position get p = 0 (the causal mask; it also covers a tile's keys past the
   context, which are never read). Values differ from SDPA's by float rounding only: the same sums in
   another order (tests/test_kernel_cpu_prefill.py).

   Over an int8 pool (--kv-cache-dtype int8, pdserve_paged_prefill_i8) the same tiles run on the key
   tile's rows dequantized into the thread's buffers (int8_rows.h): each row once per task, for the
   whole query group and for up to MAX_TILES_PER_TASK consecutive query tiles, so the conversion is
   spread over up to 64 queries. Keys are found by walking the block table, not by a division per row
   (which, with a division per row for the scale groups, cost as much as the conversion itself).
*/
#include <float.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#include "int8_rows.h" /* and vector.h */

#define QUERY_TILE 16 /* queries per task: rows = 16 * group, a whole number of vectors at any LANES */
#define KEY_TILE 64   /* keys per softmax step: its S^T (64 x rows) and V rows stay in L1/L2 */
#define KEY_ROWS 4    /* keys per register tile in step 1: 4 x (rows / LANES) accumulators (3-6 timed alike) */
#define OUT_ROWS 4    /* rows per register tile in step 3: 4 x (head_dim / LANES) accumulators */
#define MAX_ROWS (QUERY_TILE * 8)
#define MAX_HEAD_DIM 128
/* Query tiles of one (request, kv head) that share each key tile an int8 task dequantizes: the
   conversion was 6% of the attention at one tile a task (256 tokens, one thread), 1.5% at 4. */
#define MAX_TILES_PER_TASK 4
#define TASKS_PER_THREAD 4 /* fewer tiles a task where the batch would give fewer tasks than this */

typedef struct {
    const float *q;
    int64_t q_stride;
    const void *k_cache, *v_cache; /* float, or int8 rows where kv_int8 */
    const int64_t *table;
    int64_t block_size, token_stride; /* elements of the pool per token: floats, or int8 bytes */
    int kv_int8;
    int tiles_per_task; /* query tiles sharing each gathered key tile, 1 .. MAX_TILES_PER_TASK */
    float scale;
    float *out;
    int64_t out_stride;
} Task;

typedef struct { /* one query tile's state across the key tiles */
    float qt[MAX_HEAD_DIM * MAX_ROWS]; /* Q^T: [head_dim][rows], scaled */
    float o[MAX_ROWS * MAX_HEAD_DIM];  /* O: [rows][head_dim] */
    vi row_pos[MAX_ROWS / LANES];      /* row r = j * G + g: query j's position */
    vf m[MAX_ROWS / LANES], l[MAX_ROWS / LANES];
    int64_t first, n, pos0; /* queries first .. first + n - 1 of the chunk, at positions pos0 .. */
} QueryTile;

typedef struct { /* one thread's buffers, reused by every task it runs */
    QueryTile tiles[MAX_TILES_PER_TASK];
    float st[KEY_TILE * MAX_ROWS]; /* S^T, then P^T: [keys][rows] */
    float alpha[MAX_ROWS];
    const float *k_rows[KEY_TILE], *v_rows[KEY_TILE];
    float k_tile[KEY_TILE * MAX_HEAD_DIM], v_tile[KEY_TILE * MAX_HEAD_DIM]; /* an int8 tile, dequantized */
} Scratch;

/* An int8 tile's rows dequantized into the thread's buffers: the values times their group's scale, as
   kv_int8.dequantize_rows. C (head_dim / LANES) is a constant in each copy, so the row's loops unroll. */
static inline __attribute__((always_inline)) void dequantize_tile(Scratch *sc, const int8_t *const *k, const int8_t *const *v,
                                                                  int nk, const int C) {
    for (int t = 0; t < nk; t++) {
        vf kt[MAX_HEAD_DIM / LANES], vt[MAX_HEAD_DIM / LANES];
        int8_row_values(k[t], kt, C);
        int8_row_values(v[t], vt, C);
        for (int c = 0; c < C; c++) {
            storev(sc->k_tile + (t * C + c) * LANES, kt[c]);
            storev(sc->v_tile + (t * C + c) * LANES, vt[c]);
        }
        sc->k_rows[t] = sc->k_tile + t * C * LANES;
        sc->v_rows[t] = sc->v_tile + t * C * LANES;
    }
}

/* Points k_rows / v_rows at the key tile's rows t0 .. t0 + nk - 1: into a float32 pool, or into the
   buffers an int8 pool's rows are dequantized to. */
static void gather_rows(const Task *task, Scratch *sc, int64_t kv_head, int64_t t0, int nk, int D) {
    const int64_t head_offset = kv_head * (task->kv_int8 ? int8_row_bytes(D) : D);
    const int8_t *k8[KEY_TILE], *v8[KEY_TILE];
    int64_t block = t0 / task->block_size, slot = t0 % task->block_size; /* walked, not divided, row by row */
    for (int t = 0; t < nk; t++) {
        const int64_t at = (task->table[block] * task->block_size + slot) * task->token_stride + head_offset;
        if (++slot == task->block_size) slot = 0, block++;
        if (!task->kv_int8) {
            sc->k_rows[t] = (const float *)task->k_cache + at;
            sc->v_rows[t] = (const float *)task->v_cache + at;
        } else {
            k8[t] = (const int8_t *)task->k_cache + at;
            v8[t] = (const int8_t *)task->v_cache + at;
        }
    }
    if (!task->kv_int8) return;
    switch (D) {
    case 16: dequantize_tile(sc, k8, v8, nk, 16 / LANES); break;
    case 32: dequantize_tile(sc, k8, v8, nk, 32 / LANES); break;
    case 64: dequantize_tile(sc, k8, v8, nk, 64 / LANES); break;
    case 128: dequantize_tile(sc, k8, v8, nk, 128 / LANES); break;
    }
}

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
static void start_tile(const Task *task, QueryTile *tile, int64_t kv_head, int G, int D) {
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
static void attend_keys(Scratch *sc, QueryTile *tile, int64_t t0, int nk, int G, int D) {
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

static void finish_tile(const Task *task, const QueryTile *tile, int64_t kv_head, int G, int D) {
    for (int j = 0; j < tile->n; j++)
        for (int g = 0; g < G; g++) {
            const int r = j * G + g;
            const float inv = 1.0f / tile->l[r / LANES][r % LANES];
            float *row = task->out + (tile->first + j) * task->out_stride + (kv_head * G + g) * D;
            for (int d = 0; d < D; d++) row[d] = tile->o[r * D + d] * inv;
        }
}

/* One task: count consecutive query tiles of one (request, kv head), sc->tiles[0 .. count - 1] (first,
   n and pos0 set), over each key tile gathered once for all of them. No key past a tile's last
   position is read for it; none past the last tile's is read at all. */
static void prefill_tiles(const Task *task, Scratch *sc, int64_t kv_head, int count, int G, int D) {
    for (int i = 0; i < count; i++) start_tile(task, &sc->tiles[i], kv_head, G, D);
    const QueryTile *final = &sc->tiles[count - 1];
    const int64_t last = final->pos0 + final->n - 1;
    for (int64_t t0 = 0; t0 <= last; t0 += KEY_TILE) {
        const int nk = (int)(last + 1 - t0 < KEY_TILE ? last + 1 - t0 : KEY_TILE);
        gather_rows(task, sc, kv_head, t0, nk, D);
        for (int i = 0; i < count; i++) {
            QueryTile *tile = &sc->tiles[i];
            const int64_t tile_last = tile->pos0 + tile->n - 1;
            if (tile_last >= t0) attend_keys(sc, tile, t0, (int)(tile_last + 1 - t0 < nk ? tile_last + 1 - t0 : nk), G, D);
        }
    }
    for (int i = 0; i < count; i++) finish_tile(task, &sc->tiles[i], kv_head, G, D);
}

static inline int64_t tiles_of(const int64_t *query_start, int64_t b) {
    return (query_start[b + 1] - query_start[b] + QUERY_TILE - 1) / QUERY_TILE;
}

static inline int64_t tasks_of(const int64_t *query_start, int64_t b, int per_task) {
    return (tiles_of(query_start, b) + per_task - 1) / per_task;
}

int64_t pdserve_prefill_scratch_bytes(void) { return (int64_t)(sizeof(Scratch) + 63) / 64 * 64; }

/* Every (request, kv head, run of tiles_per_task query tiles) of the batch over the threads; `base`:
   the Task less its table. */
static void prefill_all(const Task *base, const int64_t *block_tables, int64_t table_stride,
                        const int64_t *context_lens, const int64_t *query_start, void *scratch, int64_t batch,
                        int64_t kv_heads, int64_t group, int64_t head_dim, int num_threads) {
    const int per_task = base->tiles_per_task;
    int64_t tasks = 0;
    for (int64_t b = 0; b < batch; b++) tasks += tasks_of(query_start, b, per_task);
#pragma omp parallel num_threads(num_threads)
    {
#ifdef _OPENMP
        const int64_t thread = omp_get_thread_num();
#else
        const int64_t thread = 0;
#endif
        Scratch *sc = (Scratch *)((char *)scratch + thread * pdserve_prefill_scratch_bytes());
        /* Later tiles of a chunk attend to more keys: handing them out first balances the threads. */
#pragma omp for schedule(dynamic, 1)
        for (int64_t item = tasks * kv_heads - 1; item >= 0; item--) {
            const int64_t task_id = item / kv_heads, h = item % kv_heads;
            int64_t b = 0, before = 0; /* request b holds this task; before: the tasks of requests < b */
            while (before + tasks_of(query_start, b, per_task) <= task_id) before += tasks_of(query_start, b++, per_task);
            const int64_t q_len = query_start[b + 1] - query_start[b];
            const int64_t tile0 = (task_id - before) * per_task, tiles = tiles_of(query_start, b);
            const int count = (int)(tiles - tile0 < per_task ? tiles - tile0 : per_task);
            for (int i = 0; i < count; i++) {
                const int64_t j0 = (tile0 + i) * QUERY_TILE;
                QueryTile *tile = &sc->tiles[i];
                tile->first = query_start[b] + j0;
                tile->n = q_len - j0 < QUERY_TILE ? q_len - j0 : QUERY_TILE;
                tile->pos0 = context_lens[b] - q_len + j0;
            }
            Task task = *base;
            task.table = block_tables + b * table_stride;
            prefill_tiles(&task, sc, h, count, (int)group, (int)head_dim);
        }
    }
}

/* q: [num_tokens, num_heads, head_dim] with row stride q_stride; caches: [num_blocks, block_size,
   kv_heads, head_dim] contiguous; block_tables: [batch, table_stride] int64; context_lens: [batch]
   int64; query_start: [batch + 1] int64, request b's queries q[query_start[b] .. query_start[b + 1])
   the last ones of its context, each chunk at least one query; out: [num_tokens, num_heads, head_dim]
   contiguous; scratch: num_threads * pdserve_prefill_scratch_bytes() bytes, 64-byte aligned. The
   caller checks pdserve_decode_supported first (the two kernels have copies for the same shapes), and
   that every block id is in the pool. */
void pdserve_paged_prefill_f32(const float *q, int64_t q_stride, const float *k_cache, const float *v_cache,
                               const int64_t *block_tables, int64_t table_stride, const int64_t *context_lens,
                               const int64_t *query_start, float *out, void *scratch, int64_t batch,
                               int64_t num_heads, int64_t kv_heads, int64_t head_dim, int64_t block_size,
                               float scale, int num_threads) {
    const Task base = {q, q_stride, k_cache, v_cache, NULL, block_size, kv_heads * head_dim, 0, 1, scale, out,
                       num_heads * head_dim};
    prefill_all(&base, block_tables, table_stride, context_lens, query_start, scratch, batch, kv_heads,
                num_heads / kv_heads, head_dim, num_threads);
}

/* Tiles a task for an int8 pool: MAX_TILES_PER_TASK, halved while the batch would give a thread fewer
   than TASKS_PER_THREAD tasks (a short chunk keeps every thread busy; the float32 pool, read in
   place, gains nothing from sharing a key tile and takes one). Results do not depend on it: each
   query tile does the same operations in the same order. */
static int int8_tiles_per_task(const int64_t *query_start, int64_t batch, int64_t kv_heads, int num_threads) {
    int per_task = MAX_TILES_PER_TASK;
    for (; per_task > 1; per_task /= 2) {
        int64_t tasks = 0;
        for (int64_t b = 0; b < batch; b++) tasks += tasks_of(query_start, b, per_task);
        if (tasks * kv_heads >= (int64_t)TASKS_PER_THREAD * num_threads) break;
    }
    return per_task;
}

/* As pdserve_paged_prefill_f32, over int8 caches [num_blocks, block_size, kv_heads, row] with
   row = int8_row_bytes(head_dim) (kv_int8.row_dim). */
void pdserve_paged_prefill_i8(const float *q, int64_t q_stride, const int8_t *k_cache, const int8_t *v_cache,
                              const int64_t *block_tables, int64_t table_stride, const int64_t *context_lens,
                              const int64_t *query_start, float *out, void *scratch, int64_t batch,
                              int64_t num_heads, int64_t kv_heads, int64_t head_dim, int64_t block_size,
                              float scale, int num_threads) {
    const Task base = {q, q_stride, k_cache, v_cache, NULL, block_size, kv_heads * int8_row_bytes(head_dim), 1,
                       int8_tiles_per_task(query_start, batch, kv_heads, num_threads), scale, out,
                       num_heads * head_dim};
    prefill_all(&base, block_tables, table_stride, context_lens, query_start, scratch, batch, kv_heads,
                num_heads / kv_heads, head_dim, num_threads);
}
