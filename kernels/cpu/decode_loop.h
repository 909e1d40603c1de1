/* The paged-decode attention loop, written once for every KV pool format: the float32 kernel (decode.c)
   and the int8 one (decode_int8.c) each include it after defining how one of their rows is read.

   One query token per request over its paged K/V: each K and V row is read once, straight from the pool
   through the block table, for the whole query group of its KV head (GQA), the rows PREFETCH_TOKENS
   ahead fetched meanwhile. Per (request, kv head), one OpenMP task:
     1. scores[g][t] = (q_g * scale) . k_t  for every context token t, LANES tokens at a time
     2. p = exp(scores - max), sum per query head (a vectorised exp)
     3. out_g = sum_t p[g][t] v_t / sum_g, each V scale group's scale folded into p (not into v: G
        multiplies per group instead of one per value)

   A template by inclusion rather than a run-time format flag (prefill.c's gather_rows): the row read
   sits in the innermost loop, which must stay straight-line vector code. The including file defines
   first, for a row of its pool:
     KV_T                                  the pool's element type (float, int8_t)
     kv_row_elems(head_dim)                elements of one row: its values, then any scales
     kv_prefetch_row(row, head_dim)        fetches a row into L2 (see PREFETCH_TOKENS)
     kv_row_keys(row, k, C)                a K row's C vectors, dequantized
     kv_load(p)                            LANES values of a V row as floats, before their group's scale
     kv_scale_groups(head_dim)             scale groups per row, each of head_dim / that values
     kv_group_scale(row, head_dim, j)      group j's scale (a float row: one group, scale 1, and the
                                           multiply by it folds away)
   and gets decode_item, one (request, kv head) of the batch, for its entry points. */
#ifndef PDSERVE_CPU_DECODE_LOOP_H
#define PDSERVE_CPU_DECODE_LOOP_H

#ifndef KV_T
#error "define KV_T and the row hooks before including decode_loop.h"
#endif

#include <float.h>

#include "vector.h"

/* Rows fetched ahead: pages lie at random places in the pool, where the hardware prefetcher cannot
   follow (+25% at batch 64, one thread). Into L2, not L1 (locality 2: prefetcht1 on x86): 32 float32
   rows ahead are 128 lines, more than L1's miss slots, and in L1 they evict q and the scores. All 8
   layers' decode attention, one thread, 2026-11-25 EPYC, ms (L1 -> L2, two runs each): batch 8
   context 330 2.64 -> 2.31, batch 16 6.13 -> 5.11 (and 6.29 -> 4.89), batch 2 context 2048 4.80 -> 3.38. */
#define PREFETCH_TOKENS 32

/* Walks a request's context token by token through its block table, without a division per token. */
typedef struct {
    const KV_T *cache; /* this kv head's first row */
    const int64_t *table;
    int64_t block_size, token_stride, page, offset;
} Cursor;

static inline Cursor cursor_at(const KV_T *cache, const int64_t *table, int64_t block_size, int64_t token_stride,
                               int64_t pos) {
    return (Cursor){cache, table, block_size, token_stride, pos / block_size, pos % block_size};
}

static inline const KV_T *cursor_next(Cursor *c) {
    const KV_T *row = c->cache + (c->table[c->page] * c->block_size + c->offset) * c->token_stride;
    if (++c->offset == c->block_size) {
        c->offset = 0;
        c->page++;
    }
    return row;
}

/* One (request, kv head). G (query heads per kv head) and C (head_dim / LANES) are constants in each
   specialised copy (DECODE_COPY), so q and the accumulators stay in registers. */
static inline __attribute__((always_inline)) void decode_one(const float *q, const KV_T *k_head, const KV_T *v_head,
                                                             const int64_t *table, int64_t ctx, float *out,
                                                             float *scores, int64_t block_size,
                                                             int64_t token_stride, int64_t ctx_pad, float scale,
                                                             const int G, const int C) {
    const int64_t head_dim = (int64_t)C * LANES;
    const int VG = C / (int)kv_scale_groups(head_dim); /* vectors per scale group */
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
            if (t0 + PREFETCH_TOKENS + t < ctx) kv_prefetch_row(cursor_next(&k_ahead), head_dim);
            if (t >= n) {
                for (int g = 0; g < G; g++) partial[g][t] = (vf){0};
                continue;
            }
            vf k[C];
            kv_row_keys(cursor_next(&k_rows), k, C);
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
        if (t + PREFETCH_TOKENS < ctx) kv_prefetch_row(cursor_next(&v_ahead), head_dim);
        const KV_T *row = cursor_next(&v_rows);
        vf v[C];
        for (int c = 0; c < C; c++) v[c] = kv_load(row + LANES * c);
        for (int j = 0; j < C / VG; j++) {
            const float s = kv_group_scale(row, head_dim, j);
            for (int g = 0; g < G; g++) {
                const float p = scores[g * ctx_pad + t] * s;
                for (int c = j * VG; c < (j + 1) * VG; c++) acc[g * C + c] += p * v[c];
            }
        }
    }
    for (int g = 0; g < G; g++)
        for (int c = 0; c < C; c++) storev(out + LANES * (g * C + c), acc[g * C + c] * inv_sum[g]);
}

/* One out-of-line copy of decode_one per (G, head_dim D), each specialised in a function of its own.
   Left to GCC's inliner (8 of the 32 copies apart, the rest inlined into the caller's switch), which
   copies were inlined moved with every edit of the loop: this header's first version, with the
   kernels' own switches, ran the int8 G=3, D=64 copy (SmolLM2's) 1.7x slower than before. And the
   fused multiply-adds GCC forms (-ffp-contract=fast) depend on the code around: an inlined copy's last
   bits differed from a separate one's. A copy of its own is compiled the same wherever it is called. */
#define DECODE_COPY(G_, D_)                                                                               \
    static __attribute__((noinline)) void decode_g##G_##_d##D_(                                           \
        const float *q, const KV_T *k_head, const KV_T *v_head, const int64_t *table, int64_t ctx,        \
        float *out, float *scores, int64_t block_size, int64_t token_stride, int64_t ctx_pad, float scale) { \
        decode_one(q, k_head, v_head, table, ctx, out, scores, block_size, token_stride, ctx_pad, scale,  \
                   G_, D_ / LANES);                                                                       \
    }
#define DECODE_COPIES(D_)                                                                                 \
    DECODE_COPY(1, D_) DECODE_COPY(2, D_) DECODE_COPY(3, D_) DECODE_COPY(4, D_)                           \
    DECODE_COPY(5, D_) DECODE_COPY(6, D_) DECODE_COPY(7, D_) DECODE_COPY(8, D_)
DECODE_COPIES(16)
DECODE_COPIES(32)
DECODE_COPIES(64)
DECODE_COPIES(128)

typedef void (*DecodeCopy)(const float *, const KV_T *, const KV_T *, const int64_t *, int64_t, float *, float *,
                           int64_t, int64_t, int64_t, float);
#define DECODE_COPY_ROW(D_)                                                                               \
    {decode_g1_d##D_, decode_g2_d##D_, decode_g3_d##D_, decode_g4_d##D_,                                  \
     decode_g5_d##D_, decode_g6_d##D_, decode_g7_d##D_, decode_g8_d##D_}
/* [head_dim 16, 32, 64, 128][G - 1]: pdserve_decode_supported's shapes. */
static const DecodeCopy DECODE_COPY_TABLE[4][8] = {
    DECODE_COPY_ROW(16), DECODE_COPY_ROW(32), DECODE_COPY_ROW(64), DECODE_COPY_ROW(128)};

/* Item `item` of a batch: its row item / kv_heads and KV head item % kv_heads. q: [batch, num_heads,
   head_dim] with row stride q_stride; caches: [num_blocks, block_size, kv_heads, kv_row_elems(head_dim)];
   block_tables: [batch, table_stride] int64; context_lens: [batch] int64, each >= 1; out: [batch,
   num_heads, head_dim] contiguous; scratch: batch * num_heads * ctx_pad floats, ctx_pad a multiple of 16
   >= every context. The caller checks pdserve_decode_supported (decode.c) first. */
static inline void decode_item(const float *q, int64_t q_stride, const KV_T *k_cache, const KV_T *v_cache,
                               const int64_t *block_tables, int64_t table_stride, const int64_t *context_lens,
                               float *out, float *scratch, int64_t num_heads, int64_t kv_heads, int64_t head_dim,
                               int64_t block_size, int64_t ctx_pad, float scale, int64_t item) {
    const int64_t group = num_heads / kv_heads, row = kv_row_elems(head_dim), token_stride = kv_heads * row;
    const int64_t b = item / kv_heads, h = item % kv_heads, ctx = context_lens[b];
    const int64_t *table = block_tables + b * table_stride;
    const float *qr = q + b * q_stride + h * group * head_dim;
    const KV_T *kh = k_cache + h * row, *vh = v_cache + h * row;
    float *o = out + (b * num_heads + h * group) * head_dim;
    float *sc = scratch + item * group * ctx_pad;
    const int d = head_dim == 16 ? 0 : head_dim == 32 ? 1 : head_dim == 64 ? 2 : 3;
    DECODE_COPY_TABLE[d][group - 1](qr, kh, vh, table, ctx, o, sc, block_size, token_stride, ctx_pad, scale);
}

#endif
