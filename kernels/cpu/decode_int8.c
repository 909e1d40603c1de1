/* Decode attention on CPU over an int8 KV pool (--kv-cache-dtype int8): one query token per request over
   its paged K/V, each row [head_dim int8 | one float16 scale per 16 values] (kernels/triton/kv_int8.py),
   dequantized in registers as it is read. Nothing is dequantized into memory.

   The loop is decode.c's (the tuned float32 kernel), written once in decode_loop.h, for the same reason:
   at 32 streams of ~400 tokens the K/V rows are as many bytes as the weights, so each row must be read
   once, for the whole query group of its KV head (GQA), with the next rows prefetched. An int8 row is a
   quarter of a float32 row's bytes; converting it costs one sign-extend and one int-to-float per vector,
   shared by the group. This file says how an int8 row is read: K's values times their group's scale
   (int8_rows.h), V's raw, each group's scale folded into the softmax weight p by the loop.

   Why not int8 q . k (VNNI, as llama.cpp's q8_0 x q8_0): quantizing q moves scores by ~1e-3 relative,
   and the tests hold this kernel to the float64 attention over the dequantized pool; with the row read
   once for 3 query heads the conversion is not what bounds it (32 streams x 384 tokens, one thread:
   benchmarks/engine/kv_decode.py's --attention figure). */
#include "int8_rows.h"

#define KV_T int8_t

static inline int64_t kv_row_elems(int64_t head_dim) { return int8_row_bytes(head_dim); }

/* A row of head_dim + scales bytes (72 at head_dim 64) may straddle two lines: fetch its first and last. */
static inline void kv_prefetch_row(const int8_t *row, int64_t head_dim) {
    __builtin_prefetch(row, 0, 2);
    __builtin_prefetch(row + int8_row_bytes(head_dim) - 1, 0, 2);
}

static inline vf kv_load(const int8_t *p) { return load_int8(p); }

static inline void kv_row_keys(const int8_t *row, vf *k, const int C) { int8_row_values(row, k, C); }

static inline int64_t kv_scale_groups(int64_t head_dim) { return int8_row_groups(head_dim); }

static inline float kv_group_scale(const int8_t *row, int64_t head_dim, int64_t group) {
    return int8_row_scale(row, head_dim, group);
}

#include "decode_loop.h"

/* As pdserve_paged_decode_f32 (decode.c), over int8 caches [num_blocks, block_size, kv_heads, row] with
   row = int8_row_bytes(head_dim) (int8_rows.h); the rest as decode_item (decode_loop.h). The
   caller checks pdserve_decode_supported first. */
void pdserve_paged_decode_i8(const float *q, int64_t q_stride, const int8_t *k_cache, const int8_t *v_cache,
                             const int64_t *block_tables, int64_t table_stride, const int64_t *context_lens,
                             float *out, float *scratch, int64_t batch, int64_t num_heads, int64_t kv_heads,
                             int64_t head_dim, int64_t block_size, int64_t ctx_pad, float scale, int num_threads) {
#pragma omp parallel for num_threads(num_threads) schedule(dynamic, 1)
    for (int64_t item = 0; item < batch * kv_heads; item++)
        decode_item(q, q_stride, k_cache, v_cache, block_tables, table_stride, context_lens, out, scratch, num_heads,
                    kv_heads, head_dim, block_size, ctx_pad, scale, item);
}
