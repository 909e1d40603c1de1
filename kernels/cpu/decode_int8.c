/* Decode attention on CPU over an int8 KV pool (--kv-cache-dtype int8): one query token per request over
   its paged K/V, each row [head_dim int8 | one float16 scale per 16 values] (kernels/triton/kv_int8.py),
   dequantized in registers as it is read. Nothing is dequantized into memory.

   The structure is decode.c's (the tuned float32 kernel), for the same reason: at 32 streams of ~400
   tokens the K/V rows are as many bytes as the weights, so each row must be read once, for the whole
   query group of its KV head (GQA), with the next rows prefetched. An int8 row is a quarter of a float32
   row's bytes; converting it costs one sign-extend and one int-to-float per vector, shared by the group.

   Per (request, kv head), one OpenMP task:
     1. scores[g][t] = (q_g * scale) . k_t, k_t's values times their group's scale, LANES tokens at a time
     2. p = exp(scores - max), sum per query head (decode.c's vectorised exp)
     3. out_g = sum_t p[g][t] v_t / sum_g, each V group's scale folded into p
   Why not int8 q . k (VNNI, as llama.cpp's q8_0 x q8_0): quantizing q moves scores by ~1e-3 relative,
   and the tests hold this kernel to the float64 attention over the dequantized pool; with the row read
   once for 3 query heads the conversion is not what bounds it (32 streams x 384 tokens, one thread:
   benchmarks/engine/kv_decode.py's --attention figure). */
#include <float.h>

#include "int8_rows.h"

#define PREFETCH_TOKENS 32 /* as decode.c: pages lie at random places in the pool */

/* Walks a request's context token by token through its block table, without a division per token. */
typedef struct {
    const int8_t *cache; /* this kv head's first row */
    const int64_t *table;
    int64_t block_size, token_stride, page, offset;
} Cursor;

static inline Cursor cursor_at(const int8_t *cache, const int64_t *table, int64_t block_size,
                               int64_t token_stride, int64_t pos) {
    return (Cursor){cache, table, block_size, token_stride, pos / block_size, pos % block_size};
}

static inline const int8_t *cursor_next(Cursor *c) {
    const int8_t *row = c->cache + (c->table[c->page] * c->block_size + c->offset) * c->token_stride;
    if (++c->offset == c->block_size) {
        c->offset = 0;
        c->page++;
    }
    return row;
}

/* A row of head_dim + scales bytes (72 at head_dim 64) may straddle two lines: fetch its first and last. */
static inline void prefetch_row(const int8_t *row, int64_t bytes) {
    __builtin_prefetch(row, 0, 2);
    __builtin_prefetch(row + bytes - 1, 0, 2);
}

/* One (request, kv head). G (query heads per kv head) and C (head_dim / LANES) are constants in each
   specialised copy, so q and the accumulators stay in registers. */
static inline void decode_one_i8(const float *q, const int8_t *k_head, const int8_t *v_head, const int64_t *table,
                                 int64_t ctx, float *out, float *scores, int64_t block_size, int64_t token_stride,
                                 int64_t ctx_pad, float scale, const int G, const int C) {
    const int64_t head_dim = (int64_t)C * LANES, row_bytes = int8_row_bytes(head_dim);
    const int VG = (int)(head_dim / int8_row_groups(head_dim)) / LANES; /* vectors per scale group */
    vf qs[G * C];
    for (int i = 0; i < G * C; i++) qs[i] = loadv(q + LANES * i) * scale;
    vf lane;
    for (int i = 0; i < LANES; i++) lane[i] = (float)i;
    vf running_max[G];
    for (int g = 0; g < G; g++) running_max[g] = splat(-FLT_MAX);

    Cursor k_rows = cursor_at(k_head, table, block_size, token_stride, 0);
    Cursor k_ahead = cursor_at(k_head, table, block_size, token_stride, PREFETCH_TOKENS);
    for (int64_t t0 = 0; t0 < ctx; t0 += LANES) {
        const int64_t n = ctx - t0 < LANES ? ctx - t0 : LANES;
        vf partial[G][LANES]; /* partial[g][t]: lanes of q_g * k_t; their sum is the score */
        for (int64_t t = 0; t < LANES; t++) {
            if (t0 + PREFETCH_TOKENS + t < ctx) prefetch_row(cursor_next(&k_ahead), row_bytes);
            if (t >= n) {
                for (int g = 0; g < G; g++) partial[g][t] = (vf){0};
                continue;
            }
            vf k[C];
            int8_row_values(cursor_next(&k_rows), k, C);
            for (int g = 0; g < G; g++) {
                vf s = qs[g * C] * k[0];
                for (int c = 1; c < C; c++) s += qs[g * C + c] * k[c];
                partial[g][t] = s;
            }
        }
        const vi valid = lane < splat((float)n);
        for (int g = 0; g < G; g++) {
            const vf s = select(valid, sum_lanes(partial[g]), splat(-FLT_MAX));
            storev(scores + g * ctx_pad + t0, s);
            running_max[g] = select(s > running_max[g], s, running_max[g]);
        }
    }

    float inv_sum[G];
    for (int g = 0; g < G; g++) {
        float m = running_max[g][0];
        for (int i = 1; i < LANES; i++) m = running_max[g][i] > m ? running_max[g][i] : m;
        vf sum = {0};
        for (int64_t t0 = 0; t0 < ctx; t0 += LANES) {
            const vf e = select(lane < splat((float)(ctx - t0)),
                                 exp_nonpositive(loadv(scores + g * ctx_pad + t0) - m), (vf){0});
            storev(scores + g * ctx_pad + t0, e);
            sum += e;
        }
        float total = 0.f;
        for (int i = 0; i < LANES; i++) total += sum[i];
        inv_sum[g] = 1.0f / total;
    }

    vf acc[G * C];
    for (int i = 0; i < G * C; i++) acc[i] = (vf){0};
    Cursor v_rows = cursor_at(v_head, table, block_size, token_stride, 0);
    Cursor v_ahead = cursor_at(v_head, table, block_size, token_stride, PREFETCH_TOKENS);
    for (int64_t t = 0; t < ctx; t++) {
        if (t + PREFETCH_TOKENS < ctx) prefetch_row(cursor_next(&v_ahead), row_bytes);
        const int8_t *row = cursor_next(&v_rows);
        vf v[C];
        for (int c = 0; c < C; c++) v[c] = load_int8(row + LANES * c);
        for (int j = 0; j < C / VG; j++) {
            const float s = int8_row_scale(row, head_dim, j); /* the group's scale, folded into each p */
            for (int g = 0; g < G; g++) {
                const float p = scores[g * ctx_pad + t] * s;
                for (int c = j * VG; c < (j + 1) * VG; c++) acc[g * C + c] += p * v[c];
            }
        }
    }
    for (int g = 0; g < G; g++)
        for (int c = 0; c < C; c++) storev(out + LANES * (g * C + c), acc[g * C + c] * inv_sum[g]);
}

#define FOR_GROUP_I8(C_)                                                                                       \
    switch (group) {                                                                                          \
    case 1: decode_one_i8(qr, kh, vh, table, ctx, o, sc, block_size, token_stride, ctx_pad, scale, 1, C_); break; \
    case 2: decode_one_i8(qr, kh, vh, table, ctx, o, sc, block_size, token_stride, ctx_pad, scale, 2, C_); break; \
    case 3: decode_one_i8(qr, kh, vh, table, ctx, o, sc, block_size, token_stride, ctx_pad, scale, 3, C_); break; \
    case 4: decode_one_i8(qr, kh, vh, table, ctx, o, sc, block_size, token_stride, ctx_pad, scale, 4, C_); break; \
    case 5: decode_one_i8(qr, kh, vh, table, ctx, o, sc, block_size, token_stride, ctx_pad, scale, 5, C_); break; \
    case 6: decode_one_i8(qr, kh, vh, table, ctx, o, sc, block_size, token_stride, ctx_pad, scale, 6, C_); break; \
    case 7: decode_one_i8(qr, kh, vh, table, ctx, o, sc, block_size, token_stride, ctx_pad, scale, 7, C_); break; \
    case 8: decode_one_i8(qr, kh, vh, table, ctx, o, sc, block_size, token_stride, ctx_pad, scale, 8, C_); break; \
    }

/* As pdserve_paged_decode_f32 (decode.c), over int8 caches [num_blocks, block_size, kv_heads, row] with
   row = int8_row_bytes(head_dim) (int8_rows.h); ctx_pad: a multiple of 16 >= every context;
   scratch: batch * num_heads * ctx_pad floats. The caller checks pdserve_decode_supported first. */
void pdserve_paged_decode_i8(const float *q, int64_t q_stride, const int8_t *k_cache, const int8_t *v_cache,
                             const int64_t *block_tables, int64_t table_stride, const int64_t *context_lens,
                             float *out, float *scratch, int64_t batch, int64_t num_heads, int64_t kv_heads,
                             int64_t head_dim, int64_t block_size, int64_t ctx_pad, float scale, int num_threads) {
    (void)num_threads;
    const int64_t group = num_heads / kv_heads, row = int8_row_bytes(head_dim), token_stride = kv_heads * row;
#pragma omp parallel for num_threads(num_threads) schedule(dynamic, 1)
    for (int64_t item = 0; item < batch * kv_heads; item++) {
        const int64_t b = item / kv_heads, h = item % kv_heads, ctx = context_lens[b];
        const int64_t *table = block_tables + b * table_stride;
        const float *qr = q + b * q_stride + h * group * head_dim;
        const int8_t *kh = k_cache + h * row, *vh = v_cache + h * row;
        float *o = out + (b * num_heads + h * group) * head_dim;
        float *sc = scratch + item * group * ctx_pad;
        switch (head_dim) {
        case 16: FOR_GROUP_I8(16 / LANES) break;
        case 32: FOR_GROUP_I8(32 / LANES) break;
        case 64: FOR_GROUP_I8(64 / LANES) break;
        case 128: FOR_GROUP_I8(128 / LANES) break;
        }
    }
}
