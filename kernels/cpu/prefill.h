/* The records prefill.c (the tasks: which query tiles, which key rows) and prefill_tile.c (one query
   tile's flash-attention steps over one key tile) share. */
#ifndef PDSERVE_CPU_PREFILL_H
#define PDSERVE_CPU_PREFILL_H

#include "int8_rows.h" /* and vector.h */

#define QUERY_TILE 16 /* queries per tile: rows = 16 * group, a whole number of vectors at any LANES */
#define KEY_TILE 64   /* keys per softmax step: its S^T (64 x rows) and V rows stay in L1/L2 */
#define KEY_ROWS 4    /* keys per register tile in step 1: 4 x (rows / LANES) accumulators (3-6 timed alike) */
#define OUT_ROWS 4    /* rows per register tile in step 3: 4 x (head_dim / LANES) accumulators */
#define MAX_ROWS (QUERY_TILE * 8)
#define MAX_HEAD_DIM 128
/* Query tiles of one (request, kv head) that share each key tile an int8 task dequantizes: the
   conversion was 6% of the attention at one tile a task (256 tokens, one thread); shared by 4, the
   int8 attention timed level with the float32 one (benchmarks/engine/kv_attention.py). */
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

void prefill_start_tile(const Task *task, QueryTile *tile, int64_t kv_head, int G, int D);
void prefill_attend_keys(Scratch *sc, QueryTile *tile, int64_t t0, int nk, int G, int D);
void prefill_finish_tile(const Task *task, const QueryTile *tile, int64_t kv_head, int G, int D);

#endif
