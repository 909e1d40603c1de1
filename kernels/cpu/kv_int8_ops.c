/* The int8 KV pool's writer and its prefill reader (--kv-cache-dtype int8), beside decode_int8.c (the
   decode reader). Rows are [head_dim int8 | one float32 scale per 32 values] (kernels/triton/kv_int8.py).

   pdserve_rope_store_i8: layer_ops.c's RoPE + K/V store, quantizing each K and V head into its row as
   it stores it. The quantizer is kv_int8.quantize_rows to the bit: scale = amax / 127, q = round half to
   even of x * (127 / amax) (nearbyintf in the default rounding mode), clamped to +-127; an all-zero
   group keeps scale 0. K is quantized after its rotation, as llama.cpp stores its q8_0 K.

   pdserve_paged_prefill_i8: causal attention of prompt chunks over their paged int8 context. One task
   per (request, kv head, tile of QUERY_TILE queries): each KEY_TILE of keys and values is dequantized
   once into a float tile that the tile's whole query group (up to QUERY_TILE * group rows) reads, with
   an online softmax per row; nothing is dequantized outside the task's small work area. */
#include <float.h>
#include <math.h>

#include "vector.h"
#ifdef _OPENMP
#include <omp.h>
#endif

#define SCALE_GROUP 32 /* values per scale; a head of 32 or fewer values is one group */
#define QMAX 127.0f
#define QUERY_TILE 16
#define KEY_TILE 32       /* a multiple of every LANES */
#define MIN_STORE_ROWS 64 /* fewer tokens take less time than waking the other threads */

static inline int64_t scale_groups(int64_t head_dim) { return head_dim < SCALE_GROUP ? 1 : head_dim / SCALE_GROUP; }

static void quantize_row(const float *x, int64_t head_dim, int8_t *row) {
    const int64_t groups = scale_groups(head_dim), size = head_dim / groups;
    for (int64_t g = 0; g < groups; g++) {
        const float *xg = x + g * size;
        float amax = 0.0f;
        for (int64_t i = 0; i < size; i++) amax = fmaxf(amax, fabsf(xg[i]));
        const float inv = amax > 0.0f ? QMAX / amax : 0.0f, scale = amax / QMAX;
        for (int64_t i = 0; i < size; i++) {
            const float v = nearbyintf(xg[i] * inv);
            row[g * size + i] = (int8_t)(v > QMAX ? QMAX : v < -QMAX ? -QMAX : v);
        }
        memcpy(row + head_dim + 4 * g, &scale, sizeof scale);
    }
}

static void dequantize_row(const int8_t *row, int64_t head_dim, float *x) {
    const int64_t groups = scale_groups(head_dim), size = head_dim / groups;
    for (int64_t g = 0; g < groups; g++) {
        float scale;
        memcpy(&scale, row + head_dim + 4 * g, sizeof scale);
        for (int64_t i = 0; i < size; i++) x[g * size + i] = (float)row[g * size + i] * scale;
    }
}

/* As pdserve_rope_store_f32 (layer_ops.c), over int8 caches [slots, kv_heads, row] with
   row = head_dim + 4 * groups. */
void pdserve_rope_store_i8(float *qkv, int64_t qkv_stride, int64_t tokens, int64_t num_heads, int64_t kv_heads,
                           int64_t head_dim, const float *cos, const float *sin, const int64_t *slots,
                           int8_t *k_cache, int8_t *v_cache, int num_threads) {
    (void)num_threads;
    const int64_t half = head_dim / 2, row = head_dim + 4 * scale_groups(head_dim), token_row = kv_heads * row;
#pragma omp parallel for num_threads(num_threads) schedule(static) if (tokens >= MIN_STORE_ROWS)
    for (int64_t t = 0; t < tokens; t++) {
        float *x = qkv + t * qkv_stride;
        const float *c = cos + t * half, *s = sin + t * half;
        for (int64_t h = 0; h < num_heads + kv_heads; h++) {
            float *x1 = x + h * head_dim, *x2 = x1 + half;
            for (int64_t i = 0; i < half; i++) {
                const float a = x1[i], b = x2[i];
                x1[i] = a * c[i] - b * s[i];
                x2[i] = b * c[i] + a * s[i];
            }
        }
        const float *k = x + num_heads * head_dim, *v = k + kv_heads * head_dim;
        for (int64_t h = 0; h < kv_heads; h++) {
            quantize_row(k + h * head_dim, head_dim, k_cache + slots[t] * token_row + h * row);
            quantize_row(v + h * head_dim, head_dim, v_cache + slots[t] * token_row + h * row);
        }
    }
}

/* Floats of one thread's work area for pdserve_paged_prefill_i8. */
int64_t pdserve_prefill_i8_work_floats(int64_t group, int64_t head_dim) {
    const int64_t rows = QUERY_TILE * group;
    return rows * head_dim + 2 * rows + 2 * KEY_TILE * head_dim + KEY_TILE;
}

typedef struct {
    const float *q;
    int64_t q_stride;
    const int8_t *k_head, *v_head; /* this kv head's first row in the caches */
    const int64_t *table;
    int64_t block_size, token_row, head_dim, group, num_heads;
    float scale;
    float *out;
} Task;

static inline const int8_t *row_at(const int8_t *head, const Task *task, int64_t t) {
    return head + (task->table[t / task->block_size] * task->block_size + t % task->block_size) * task->token_row;
}

/* Queries first .. first + n - 1 (positions pos0 .. pos0 + n - 1) of kv head h. */
static void prefill_tile_i8(const Task *task, int64_t h, int64_t first, int64_t n, int64_t pos0, float *work) {
    const int64_t hd = task->head_dim, group = task->group, rows = n * group;
    float *acc = work, *m = acc + rows * hd, *l = m + rows, *kt = l + rows, *vt = kt + KEY_TILE * hd;
    float *s = vt + KEY_TILE * hd;
    for (int64_t i = 0; i < rows * hd; i++) acc[i] = 0.0f;
    for (int64_t r = 0; r < rows; r++) m[r] = -FLT_MAX, l[r] = 0.0f;
    const int64_t end = pos0 + n; /* the last query sees keys 0 .. end - 1 */
    for (int64_t t0 = 0; t0 < end; t0 += KEY_TILE) {
        const int64_t count = end - t0 < KEY_TILE ? end - t0 : KEY_TILE;
        for (int64_t i = 0; i < count; i++) {
            dequantize_row(row_at(task->k_head, task, t0 + i), hd, kt + i * hd);
            dequantize_row(row_at(task->v_head, task, t0 + i), hd, vt + i * hd);
        }
        for (int64_t j = 0; j < n; j++) {
            const int64_t visible = pos0 + j + 1 - t0; /* causal: keys t0 .. pos0 + j */
            if (visible <= 0) continue;
            const int64_t cnt = visible < count ? visible : count;
            for (int64_t g = 0; g < group; g++) {
                const int64_t r = j * group + g;
                const float *qv = task->q + (first + j) * task->q_stride + (h * group + g) * hd;
                float top = m[r];
                for (int64_t i = 0; i < cnt; i++) {
                    const float *k = kt + i * hd;
                    float dot = 0.0f;
                    for (int64_t d = 0; d < hd; d++) dot += qv[d] * k[d];
                    s[i] = dot * task->scale;
                    top = s[i] > top ? s[i] : top;
                }
                for (int64_t i = cnt; i < KEY_TILE; i++) s[i] = top; /* lanes past the keys: read, unused */
                for (int64_t i = 0; i < cnt; i += LANES) storev(s + i, exp_nonpositive(loadv(s + i) - top));
                float *a = acc + r * hd;
                const float fix = m[r] == -FLT_MAX ? 0.0f : expf(m[r] - top);
                float sum = l[r] * fix;
                for (int64_t d = 0; d < hd; d++) a[d] *= fix;
                for (int64_t i = 0; i < cnt; i++) {
                    const float p = s[i], *v = vt + i * hd;
                    sum += p;
                    for (int64_t d = 0; d < hd; d++) a[d] += p * v[d];
                }
                m[r] = top, l[r] = sum;
            }
        }
    }
    for (int64_t j = 0; j < n; j++) {
        for (int64_t g = 0; g < group; g++) {
            const int64_t r = j * group + g;
            float *o = task->out + (first + j) * task->num_heads * hd + (h * group + g) * hd;
            const float inv = 1.0f / l[r];
            for (int64_t d = 0; d < hd; d++) o[d] = acc[r * hd + d] * inv;
        }
    }
}

static inline int64_t tiles_of(const int64_t *query_start, int64_t b) {
    return (query_start[b + 1] - query_start[b] + QUERY_TILE - 1) / QUERY_TILE;
}

/* As pdserve_paged_prefill_f32 (prefill.c), over int8 caches [num_blocks, block_size, kv_heads, row];
   work: num_threads * pdserve_prefill_i8_work_floats(group, head_dim) floats. head_dim: a multiple of
   LANES that kv_int8.row_dim takes; the caller checks every block id is in the pool. */
void pdserve_paged_prefill_i8(const float *q, int64_t q_stride, const int8_t *k_cache, const int8_t *v_cache,
                              const int64_t *block_tables, int64_t table_stride, const int64_t *context_lens,
                              const int64_t *query_start, float *out, float *work, int64_t batch, int64_t num_heads,
                              int64_t kv_heads, int64_t head_dim, int64_t block_size, float scale,
                              int num_threads) {
    const int64_t group = num_heads / kv_heads, row = head_dim + 4 * scale_groups(head_dim);
    const int64_t work_floats = pdserve_prefill_i8_work_floats(group, head_dim);
    int64_t tiles = 0;
    for (int64_t b = 0; b < batch; b++) tiles += tiles_of(query_start, b);
#pragma omp parallel num_threads(num_threads)
    {
#ifdef _OPENMP
        float *mine = work + omp_get_thread_num() * work_floats;
#else
        float *mine = work;
#endif
        /* Later tiles of a chunk attend to more keys: handing them out first balances the threads. */
#pragma omp for schedule(dynamic, 1)
        for (int64_t item = tiles * kv_heads - 1; item >= 0; item--) {
            const int64_t tile = item / kv_heads, h = item % kv_heads;
            int64_t b = 0, before = 0; /* request b holds this tile; before: the tiles of requests < b */
            while (before + tiles_of(query_start, b) <= tile) before += tiles_of(query_start, b++);
            const int64_t q_len = query_start[b + 1] - query_start[b], j0 = (tile - before) * QUERY_TILE;
            const int64_t n = q_len - j0 < QUERY_TILE ? q_len - j0 : QUERY_TILE;
            const Task task = {q, q_stride, k_cache + h * row, v_cache + h * row, block_tables + b * table_stride,
                               block_size, kv_heads * row, head_dim, group, num_heads, scale, out};
            prefill_tile_i8(&task, h, query_start[b] + j0, n, context_lens[b] - q_len + j0, mine);
        }
    }
}
