/* Decode attention on CPU, fp32: one query token per request over its paged K/V, in one pass.

   The torch path (paged_decode.py) gathers each request's pages into a padded copy and then runs two
   bmm calls over it: every K/V byte is read, written and read again, and a decode step at batch 64
   spends about a third of its time there. This kernel reads each K and V row once, straight from the
   pool through the block table, for the whole query group of its KV head (GQA).

   Built at first use by cpu/native.py with the machine's C compiler (-O3 -march=native -fopenmp).
   GCC vector extensions (GCC 9 or later, or clang) keep it portable across x86 and Arm; see LANES.

   Per (request, kv head), one OpenMP task:
     1. scores[g][t] = (q_g * scale) . k_t  for every context token t, LANES tokens at a time
     2. p = exp(scores - max), sum per query head (a vectorised exp)
     3. out_g = sum_t p[g][t] v_t / sum_g
*/
#include <float.h>

#include "vector.h"

#define PREFETCH_TOKENS 32 /* rows fetched ahead: pages lie at random places in the pool, where the
                              hardware prefetcher cannot follow (+25% at batch 64, one thread) */

/* Walks a request's context token by token through its block table, without a division per token. */
typedef struct {
    const float *cache; /* this kv head's first element: cache + head * head_dim */
    const int64_t *table;
    int64_t block_size, token_stride, page, offset;
} Cursor;

static inline Cursor cursor_at(const float *cache, const int64_t *table, int64_t block_size,
                               int64_t token_stride, int64_t pos) {
    return (Cursor){cache, table, block_size, token_stride, pos / block_size, pos % block_size};
}

static inline const float *cursor_next(Cursor *c) {
    const float *row = c->cache + (c->table[c->page] * c->block_size + c->offset) * c->token_stride;
    if (++c->offset == c->block_size) {
        c->offset = 0;
        c->page++;
    }
    return row;
}

/* Into L2, not L1 (locality 2: prefetcht1 on x86): 32 rows ahead are 128 lines, more than L1's miss
   slots, and in L1 they evict q and the scores. All 8 layers' decode attention, one thread, 2026-11-25
   EPYC, ms (L1 -> L2, two runs each): batch 8 context 330 2.64 -> 2.31, batch 16 6.13 -> 5.11 (and
   6.29 -> 4.89), batch 2 context 2048 4.80 -> 3.38. */
static inline void prefetch_row(const float *row, int floats) {
    for (int i = 0; i < floats; i += 16) __builtin_prefetch(row + i, 0, 2); /* one 64-byte line per call */
}

/* One (request, kv head). G (query heads per kv head) and C (head_dim / LANES) are constants in each
   specialised copy, so q and the accumulators stay in registers. */
static inline void decode_one(const float *q, const float *k_head, const float *v_head, const int64_t *table,
                              int64_t ctx, float *out, float *scores, int64_t block_size, int64_t token_stride,
                              int64_t ctx_pad, float scale, const int G, const int C) {
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
            if (t0 + PREFETCH_TOKENS + t < ctx) prefetch_row(cursor_next(&k_ahead), C * LANES);
            if (t >= n) {
                for (int g = 0; g < G; g++) partial[g][t] = (vf){0};
                continue;
            }
            const float *row = cursor_next(&k_rows);
            vf k[C];
            for (int c = 0; c < C; c++) k[c] = loadv(row + LANES * c);
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
        if (t + PREFETCH_TOKENS < ctx) prefetch_row(cursor_next(&v_ahead), C * LANES);
        const float *row = cursor_next(&v_rows);
        vf v[C];
        for (int c = 0; c < C; c++) v[c] = loadv(row + LANES * c);
        for (int g = 0; g < G; g++) {
            const float p = scores[g * ctx_pad + t];
            for (int c = 0; c < C; c++) acc[g * C + c] += p * v[c];
        }
    }
    for (int g = 0; g < G; g++)
        for (int c = 0; c < C; c++) storev(out + LANES * (g * C + c), acc[g * C + c] * inv_sum[g]);
}

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

#define FOR_GROUP(C_)                                                                                   \
    switch (group) {                                                                                   \
    case 1: decode_one(qr, kh, vh, table, ctx, o, sc, block_size, token_stride, ctx_pad, scale, 1, C_); break; \
    case 2: decode_one(qr, kh, vh, table, ctx, o, sc, block_size, token_stride, ctx_pad, scale, 2, C_); break; \
    case 3: decode_one(qr, kh, vh, table, ctx, o, sc, block_size, token_stride, ctx_pad, scale, 3, C_); break; \
    case 4: decode_one(qr, kh, vh, table, ctx, o, sc, block_size, token_stride, ctx_pad, scale, 4, C_); break; \
    case 5: decode_one(qr, kh, vh, table, ctx, o, sc, block_size, token_stride, ctx_pad, scale, 5, C_); break; \
    case 6: decode_one(qr, kh, vh, table, ctx, o, sc, block_size, token_stride, ctx_pad, scale, 6, C_); break; \
    case 7: decode_one(qr, kh, vh, table, ctx, o, sc, block_size, token_stride, ctx_pad, scale, 7, C_); break; \
    case 8: decode_one(qr, kh, vh, table, ctx, o, sc, block_size, token_stride, ctx_pad, scale, 8, C_); break; \
    }

/* One item of pdserve_paged_decode_f32, row item / kv_heads and its KV head item % kv_heads, for a caller
   whose own threads share the batch * kv_heads items (kernels/cpu/decode_step_team.c). */
void pdserve_paged_decode_item_f32(const float *q, int64_t q_stride, const float *k_cache, const float *v_cache,
                                   const int64_t *block_tables, int64_t table_stride, const int64_t *context_lens,
                                   float *out, float *scratch, int64_t num_heads, int64_t kv_heads, int64_t head_dim,
                                   int64_t block_size, int64_t ctx_pad, float scale, int64_t item) {
    const int64_t group = num_heads / kv_heads, token_stride = kv_heads * head_dim;
    const int64_t b = item / kv_heads, h = item % kv_heads, ctx = context_lens[b];
    const int64_t *table = block_tables + b * table_stride;
    const float *qr = q + b * q_stride + h * group * head_dim;
    const float *kh = k_cache + h * head_dim, *vh = v_cache + h * head_dim;
    float *o = out + (b * num_heads + h * group) * head_dim;
    float *sc = scratch + item * group * ctx_pad;
    switch (head_dim) {
    case 16: FOR_GROUP(16 / LANES) break;
    case 32: FOR_GROUP(32 / LANES) break;
    case 64: FOR_GROUP(64 / LANES) break;
    case 128: FOR_GROUP(128 / LANES) break;
    }
}

/* q: [batch, num_heads, head_dim] with row stride q_stride; caches: [num_blocks, block_size, kv_heads,
   head_dim] contiguous; block_tables: [batch, table_stride] int64; context_lens: [batch] int64, each >= 1;
   out: [batch, num_heads, head_dim] contiguous; scratch: batch * num_heads * ctx_pad floats, ctx_pad a
   multiple of 16 >= every context. The caller checks pdserve_decode_supported first. */
void pdserve_paged_decode_f32(const float *q, int64_t q_stride, const float *k_cache, const float *v_cache,
                              const int64_t *block_tables, int64_t table_stride, const int64_t *context_lens,
                              float *out, float *scratch, int64_t batch, int64_t num_heads, int64_t kv_heads,
                              int64_t head_dim, int64_t block_size, int64_t ctx_pad, float scale, int num_threads) {
#pragma omp parallel for num_threads(num_threads) schedule(dynamic, 1)
    for (int64_t item = 0; item < batch * kv_heads; item++)
        pdserve_paged_decode_item_f32(q, q_stride, k_cache, v_cache, block_tables, table_stride, context_lens, out,
                                      scratch, num_heads, kv_heads, head_dim, block_size, ctx_pad, scale, item);
}
