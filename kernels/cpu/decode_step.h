/* The records kernels/cpu/decode_step.c and decode_step_team.c share (kernels/cpu/native.py mirrors
   them in ctypes), and the kernels they call. */
#ifndef PDSERVE_DECODE_STEP_H
#define PDSERVE_DECODE_STEP_H
#include <stddef.h>
#include <stdint.h>

void pdserve_rms_norm_f32(const float *x, int64_t x_stride, float *residual, const float *weight, float *out,
                          int64_t rows, int64_t dim, float eps, int num_threads);
void pdserve_linear_f32(const float *x, int64_t M, int64_t K, const float *wp, int64_t N, const float *bias,
                        float *out, int num_threads);
void pdserve_rope_store_f32(float *qkv, int64_t qkv_stride, int64_t tokens, int64_t num_heads, int64_t kv_heads,
                            int64_t head_dim, const float *cos, const float *sin, const int64_t *slots,
                            float *k_cache, float *v_cache, int num_threads);
void pdserve_paged_decode_f32(const float *q, int64_t q_stride, const float *k_cache, const float *v_cache,
                              const int64_t *block_tables, int64_t table_stride, const int64_t *context_lens,
                              float *out, float *scratch, int64_t batch, int64_t num_heads, int64_t kv_heads,
                              int64_t head_dim, int64_t block_size, int64_t ctx_pad, float scale, int num_threads);
void pdserve_rope_store_i8(float *qkv, int64_t qkv_stride, int64_t tokens, int64_t num_heads, int64_t kv_heads,
                           int64_t head_dim, const float *cos, const float *sin, const int64_t *slots,
                           int8_t *k_cache, int8_t *v_cache, int num_threads);
void pdserve_paged_decode_i8(const float *q, int64_t q_stride, const int8_t *k_cache, const int8_t *v_cache,
                             const int64_t *block_tables, int64_t table_stride, const int64_t *context_lens,
                             float *out, float *scratch, int64_t batch, int64_t num_heads, int64_t kv_heads,
                             int64_t head_dim, int64_t block_size, int64_t ctx_pad, float scale,
                             int num_threads);
void pdserve_paged_decode_item_f32(const float *q, int64_t q_stride, const float *k_cache, const float *v_cache,
                                   const int64_t *block_tables, int64_t table_stride, const int64_t *context_lens,
                                   float *out, float *scratch, int64_t num_heads, int64_t kv_heads, int64_t head_dim,
                                   int64_t block_size, int64_t ctx_pad, float scale, int64_t item);
void pdserve_silu_mul_f32(const float *gate_up, int64_t gate_up_stride, float *out, int64_t rows, int64_t inter,
                          int num_threads);

/* quant.c's pdserve_quant_linear_into (y's rows ldy floats apart) */
typedef void (*QuantLinear)(int type, const float *x, int64_t rows, int64_t K, const uint8_t *w, int64_t N,
                            int64_t row_bytes, const float *bias, float *y, int64_t ldy, uint8_t *scratch,
                            int threads);
/* quant.c's pdserve_quant_linear_team_into: the same, called by every thread of an enclosing parallel region */
typedef void (*QuantTeam)(int type, const float *x, int64_t rows, int64_t K, const uint8_t *w, int64_t N,
                          int64_t row_bytes, const float *bias, float *y, int64_t ldy, uint8_t *scratch,
                          int own_scratch);

/* One projection's weight: float32 in linear.c's packed layout (type < 0), else N rows of row_bytes in
   quant.c's format `type`; where split > 0 only its first `split` output rows are those, and the rest are
   rows of row_bytes2 at w2 in format type2 (a fused projection whose parts differ: engine/quant/parts.py). */
typedef struct {
    const void *w;
    int64_t type, row_bytes, split;
    const void *w2;
    int64_t type2, row_bytes2;
} Projection;

/* One layer's weights: the norms' [hidden] weights, qkv_bias ([q + 2 kv] or NULL), the projections. */
typedef struct {
    const float *input_norm, *post_norm, *qkv_bias;
    Projection qkv, o, gate_up, down;
} DecodeLayer;

/* The model's shape and a step's attention inputs (tables, context lengths: as pdserve_paged_decode_f32);
   quant_linear: NULL where every projection is float32; kv_int8: the pool holds int8 rows with their
   scales (kv_int8_ops.c, decode_int8.c: the same kernels as the int8 layer path), cache_floats then
   counting its bytes. */
typedef struct {
    int64_t hidden, num_heads, kv_heads, head_dim, inter, block_size, cache_floats; /* one layer's K cache */
    float eps, scale;
    QuantLinear quant_linear;
    int64_t kv_int8;
    /* quant_team: NULL, or the step's layers at up to TEAM_ROWS rows run in one parallel region each
       (decode_step_team.c) where every projection is quantized; quant_scratch then holds one space of
       quant_scratch_stride bytes per thread */
    QuantTeam quant_team;
    int64_t quant_scratch_stride;
} DecodeShape;

#define TEAM_ROWS 4 /* rows up to which a quantized step takes decode_step_team.c */

/* Layer l's RoPE with the K/V store of the step's rows, then their decode attention into attn: the pool's
   float32 or int8 kernels (the same calls as the layer path). */
void decode_store_kv(const DecodeShape *s, int64_t l, float *qkv, int64_t rows, void *pool, const float *cos,
                     const float *sin, const int64_t *slots, int num_threads);
void decode_attend(const DecodeShape *s, int64_t l, const float *qkv, int64_t rows, const void *pool,
                   const int64_t *block_tables, int64_t table_stride, const int64_t *context_lens, int64_t ctx_pad,
                   float *attn, float *scores, int num_threads);

/* The step in one parallel region per layer (decode_step_team.c); whether it takes these rows. */
int pdserve_decode_team_takes(const DecodeLayer *layers, int64_t num_layers, const DecodeShape *s, int64_t rows);
void decode_step_team(const DecodeLayer *layers, int64_t num_layers, const DecodeShape *s, float *x, int64_t rows,
                      void *pool, const float *cos, const float *sin, const int64_t *slots,
                      const int64_t *block_tables, int64_t table_stride, const int64_t *context_lens,
                      int64_t ctx_pad, float *work, uint8_t *quant_scratch, int num_threads);
#endif
