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
#ifdef _OPENMP
#include <omp.h>
#endif

#include "prefill.h"

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

/* One task: count consecutive query tiles of one (request, kv head), sc->tiles[0 .. count - 1] (first,
   n and pos0 set), over each key tile gathered once for all of them. No key past a tile's last
   position is read for it; none past the last tile's is read at all. */
static void prefill_tiles(const Task *task, Scratch *sc, int64_t kv_head, int count, int G, int D) {
    for (int i = 0; i < count; i++) prefill_start_tile(task, &sc->tiles[i], kv_head, G, D);
    const QueryTile *final = &sc->tiles[count - 1];
    const int64_t last = final->pos0 + final->n - 1;
    for (int64_t t0 = 0; t0 <= last; t0 += KEY_TILE) {
        const int nk = (int)(last + 1 - t0 < KEY_TILE ? last + 1 - t0 : KEY_TILE);
        gather_rows(task, sc, kv_head, t0, nk, D);
        for (int i = 0; i < count; i++) {
            QueryTile *tile = &sc->tiles[i];
            const int64_t tile_last = tile->pos0 + tile->n - 1;
            if (tile_last >= t0) prefill_attend_keys(sc, tile, t0, (int)(tile_last + 1 - t0 < nk ? tile_last + 1 - t0 : nk), G, D);
        }
    }
    for (int i = 0; i < count; i++) prefill_finish_tile(task, &sc->tiles[i], kv_head, G, D);
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
