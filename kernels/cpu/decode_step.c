/* A decode step's decoder layers in one call, float32 activations: for every layer, RMSNorm (with the residual add),
   the qkv projection, RoPE with the K/V store, decode attention, the o projection, RMSNorm, gate_up,
   SwiGLU's product and the down projection -- the same kernels (layer_ops.c, linear.c,
   decode.c) in the same order as the Python layer calls them one by one, so the values are the
   same bits. A projection is float32 (linear.c's packed layout) or quantized rows (kernels/cpu/quant.c,
   called through the pointer the quant library hands over: the very function the layer path calls).

   Why: called from Python, a layer is ~10 kernel calls, each with its argument checks, output
   allocation and ctypes conversion; at a decode step of one sequence those cost about a fifth of the
   step (the kernels themselves stream 12 MB of weights per layer in ~0.5 ms). Here they are one call.
*/
#include "decode_step.h"

/* out[rows][N] = x[rows][K] @ W^T (+ bias) with the projection's kernel; quant_scratch: quant.c's work space. */
static void project(const DecodeShape *s, const Projection *p, const float *x, int64_t rows, int64_t K, int64_t N,
                    const float *bias, float *out, uint8_t *quant_scratch, int num_threads) {
    if (p->type < 0) {
        pdserve_linear_f32(x, rows, K, p->w, N, bias, out, num_threads);
        return;
    }
    const int64_t first = p->split > 0 ? p->split : N;
    s->quant_linear((int)p->type, x, rows, K, p->w, first, p->row_bytes, bias, out, N, quant_scratch, num_threads);
    if (first < N) /* the second part's columns of the same rows */
        s->quant_linear((int)p->type2, x, rows, K, p->w2, N - first, p->row_bytes2, bias ? bias + first : NULL,
                        out + first, N, quant_scratch, num_threads);
}

/* Floats of work space a step of `rows` sequences needs, contexts padded to ctx_pad, on num_threads threads
   (decode_step_team.c's per-thread rows of the residual stream, the normed input and SwiGLU's product). */
int64_t pdserve_decode_step_work(const DecodeShape *s, int64_t rows, int64_t ctx_pad, int64_t num_threads) {
    const int64_t qkv = (s->num_heads + 2 * s->kv_heads) * s->head_dim, q = s->num_heads * s->head_dim;
    const int64_t shared = rows * (2 * s->hidden + qkv + q + 3 * s->inter + s->num_heads * ctx_pad);
    return shared + num_threads * rows * (2 * s->hidden + s->inter);
}

void decode_store_kv(const DecodeShape *s, int64_t l, float *qkv, int64_t rows, void *pool, const float *cos,
                     const float *sin, const int64_t *slots, int num_threads) {
    const int64_t qkv_size = (s->num_heads + 2 * s->kv_heads) * s->head_dim;
    if (s->kv_int8) {
        int8_t *k_cache = (int8_t *)pool + 2 * l * s->cache_floats, *v_cache = k_cache + s->cache_floats;
        pdserve_rope_store_i8(qkv, qkv_size, rows, s->num_heads, s->kv_heads, s->head_dim, cos, sin, slots, k_cache,
                              v_cache, num_threads);
    } else {
        float *k_cache = (float *)pool + 2 * l * s->cache_floats, *v_cache = k_cache + s->cache_floats;
        pdserve_rope_store_f32(qkv, qkv_size, rows, s->num_heads, s->kv_heads, s->head_dim, cos, sin, slots, k_cache,
                               v_cache, num_threads);
    }
}

void decode_attend(const DecodeShape *s, int64_t l, const float *qkv, int64_t rows, const void *pool,
                   const int64_t *block_tables, int64_t table_stride, const int64_t *context_lens, int64_t ctx_pad,
                   float *attn, float *scores, int num_threads) {
    const int64_t qkv_size = (s->num_heads + 2 * s->kv_heads) * s->head_dim;
    if (s->kv_int8) {
        const int8_t *k_cache = (const int8_t *)pool + 2 * l * s->cache_floats, *v_cache = k_cache + s->cache_floats;
        pdserve_paged_decode_i8(qkv, qkv_size, k_cache, v_cache, block_tables, table_stride, context_lens, attn,
                                scores, rows, s->num_heads, s->kv_heads, s->head_dim, s->block_size, ctx_pad,
                                s->scale, num_threads);
    } else {
        const float *k_cache = (const float *)pool + 2 * l * s->cache_floats, *v_cache = k_cache + s->cache_floats;
        pdserve_paged_decode_f32(qkv, qkv_size, k_cache, v_cache, block_tables, table_stride, context_lens, attn,
                                 scores, rows, s->num_heads, s->kv_heads, s->head_dim, s->block_size, ctx_pad,
                                 s->scale, num_threads);
    }
}

/* x: [rows, hidden], the embeddings in, the last layer's output plus the residual stream out (what
   the model's forward returns). pool: the KV pool, layer l's K cache at pool + 2 l cache_floats and its
   V cache right after. cos, sin: [rows, head_dim / 2]; slots: each row's new cache slot. quant_scratch:
   quant.c's work space for `rows` rows of the widest projection input (NULL where none is quantized; one
   per thread where decode_step_team.c takes the step). */
void pdserve_decode_step_f32(const DecodeLayer *layers, int64_t num_layers, const DecodeShape *s, float *x,
                             int64_t rows, void *pool, const float *cos, const float *sin, const int64_t *slots,
                             const int64_t *block_tables, int64_t table_stride, const int64_t *context_lens,
                             int64_t ctx_pad, float *work, uint8_t *quant_scratch, int num_threads) {
    if (pdserve_decode_team_takes(layers, num_layers, s, rows)) {
        decode_step_team(layers, num_layers, s, x, rows, pool, cos, sin, slots, block_tables, table_stride,
                         context_lens, ctx_pad, work, quant_scratch, num_threads);
        return;
    }
    const int64_t hidden = s->hidden, q_size = s->num_heads * s->head_dim;
    const int64_t qkv_size = q_size + 2 * s->kv_heads * s->head_dim;
    float *residual = work, *h = residual + rows * hidden, *qkv = h + rows * hidden, *attn = qkv + rows * qkv_size;
    float *gate_up = attn + rows * q_size, *act = gate_up + rows * 2 * s->inter, *scores = act + rows * s->inter;
    for (int64_t l = 0; l < num_layers; l++) {
        const DecodeLayer *w = layers + l;
        if (l == 0) { /* the first layer's residual stream is its input */
            for (int64_t i = 0; i < rows * hidden; i++) residual[i] = x[i];
            pdserve_rms_norm_f32(x, hidden, NULL, w->input_norm, h, rows, hidden, s->eps, num_threads);
        } else {
            pdserve_rms_norm_f32(x, hidden, residual, w->input_norm, h, rows, hidden, s->eps, num_threads);
        }
        project(s, &w->qkv, h, rows, hidden, qkv_size, w->qkv_bias, qkv, quant_scratch, num_threads);
        decode_store_kv(s, l, qkv, rows, pool, cos, sin, slots, num_threads);
        decode_attend(s, l, qkv, rows, pool, block_tables, table_stride, context_lens, ctx_pad, attn, scores,
                      num_threads);
        project(s, &w->o, attn, rows, q_size, hidden, NULL, x, quant_scratch, num_threads);
        pdserve_rms_norm_f32(x, hidden, residual, w->post_norm, h, rows, hidden, s->eps, num_threads);
        project(s, &w->gate_up, h, rows, hidden, 2 * s->inter, NULL, gate_up, quant_scratch, num_threads);
        pdserve_silu_mul_f32(gate_up, 2 * s->inter, act, rows, s->inter, num_threads);
        project(s, &w->down, act, rows, s->inter, hidden, NULL, x, quant_scratch, num_threads);
    }
    for (int64_t i = 0; i < rows * hidden; i++) x[i] += residual[i];
}
