/* Decode attention on CPU, fp32: one query token per request over its paged K/V, in one pass.

   The torch path (paged_decode.py) gathers each request's pages into a padded copy and then runs two
   bmm calls over it: every K/V byte is read, written and read again, and a decode step at batch 64
   spends about a third of its time there. This kernel reads each K and V row once, straight from the
   pool through the block table, for the whole query group of its KV head (GQA): the loop is
   decode_loop.h's, shared with the int8 pool's kernel (decode_int8.c); this file says how a float32
   row is read.

   Built at first use by cpu/native.py with the machine's C compiler (-O3 -march=native -fopenmp).
   GCC vector extensions (GCC 9 or later, or clang) keep it portable across x86 and Arm; see LANES.
*/
#include "vector.h"

/* A float32 row: head_dim values, no scales (one group of scale 1). */
#define KV_T float

static inline int64_t kv_row_elems(int64_t head_dim) { return head_dim; }

static inline void kv_prefetch_row(const float *row, int64_t head_dim) {
    for (int64_t i = 0; i < head_dim; i += 16) __builtin_prefetch(row + i, 0, 2); /* one 64-byte line a call */
}

static inline vf kv_load(const float *p) { return loadv(p); }

static inline void kv_row_keys(const float *row, vf *k, const int C) {
    for (int c = 0; c < C; c++) k[c] = loadv(row + LANES * c);
}

static inline int64_t kv_scale_groups(int64_t head_dim) {
    (void)head_dim;
    return 1;
}

static inline float kv_group_scale(const float *row, int64_t head_dim, int64_t group) {
    (void)row, (void)head_dim, (void)group;
    return 1.0f;
}

#include "decode_loop.h"

/* 1 where this build runs its work on OpenMP threads, 0 where it runs on the caller's thread alone. */
int pdserve_native_threaded(void) {
#ifdef _OPENMP
    return 1;
#else
    return 0;
#endif
}

int pdserve_decode_supported(int64_t group, int64_t head_dim) {
    return group >= 1 && group <= 8 && (head_dim == 16 || head_dim == 32 || head_dim == 64 || head_dim == 128);
}

/* One item of pdserve_paged_decode_f32, row item / kv_heads and its KV head item % kv_heads, for a caller
   whose own threads share the batch * kv_heads items (kernels/cpu/decode_step_team.c). */
void pdserve_paged_decode_item_f32(const float *q, int64_t q_stride, const float *k_cache, const float *v_cache,
                                   const int64_t *block_tables, int64_t table_stride, const int64_t *context_lens,
                                   float *out, float *scratch, int64_t num_heads, int64_t kv_heads, int64_t head_dim,
                                   int64_t block_size, int64_t ctx_pad, float scale, int64_t item) {
    decode_item(q, q_stride, k_cache, v_cache, block_tables, table_stride, context_lens, out, scratch, num_heads,
                kv_heads, head_dim, block_size, ctx_pad, scale, item);
}

/* q: [batch, num_heads, head_dim] with row stride q_stride; caches: [num_blocks, block_size, kv_heads,
   head_dim] contiguous; the rest as decode_item (decode_loop.h). The caller checks
   pdserve_decode_supported first. */
void pdserve_paged_decode_f32(const float *q, int64_t q_stride, const float *k_cache, const float *v_cache,
                              const int64_t *block_tables, int64_t table_stride, const int64_t *context_lens,
                              float *out, float *scratch, int64_t batch, int64_t num_heads, int64_t kv_heads,
                              int64_t head_dim, int64_t block_size, int64_t ctx_pad, float scale, int num_threads) {
#pragma omp parallel for num_threads(num_threads) schedule(dynamic, 1)
    for (int64_t item = 0; item < batch * kv_heads; item++)
        pdserve_paged_decode_item_f32(q, q_stride, k_cache, v_cache, block_tables, table_stride, context_lens, out,
                                      scratch, num_heads, kv_heads, head_dim, block_size, ctx_pad, scale, item);
}
