/* Decode attention on CPU over an int8 KV pool (--kv-cache-dtype int8): one query token per request over
   its paged K/V, each row [head_dim int8 | one float32 scale per 32 values] (kernels/triton/kv_int8.py),
   dequantized in registers as it is read: a K group's scale multiplies its partial dot product once,
   a V group's scale folds into that token's softmax weight. Nothing is dequantized into memory.

   Per (request, kv head), one OpenMP task, as decode.c: scores for the whole query group, softmax,
   then the weighted sum of V. The scores of LANES tokens are reduced together (vector.h's sum_lanes) and
   exponentiated as vectors (exp_nonpositive), as decode.c does; its prefetching is left out (an int8 row
   is a quarter of the bytes). */
#include <float.h>
#include <math.h>

#include "vector.h"

typedef int8_t vb __attribute__((vector_size(LANES)));

static inline vf load_int8(const int8_t *p) {
    vb b;
    memcpy(&b, p, sizeof b);
    return __builtin_convertvector(b, vf);
}

#define GROUP 32 /* values per scale; a head of 32 or fewer values is one group */

static inline float row_scale(const int8_t *row, int64_t head_dim, int64_t group) {
    float s;
    memcpy(&s, row + head_dim + 4 * group, sizeof s); /* the scales follow the values */
    return s;
}

static inline float lanes_sum(vf v) {
    float s = 0.0f;
    for (int i = 0; i < LANES; i++) s += v[i];
    return s;
}

static inline const int8_t *row_at(const int8_t *head, const int64_t *table, int64_t block_size,
                                   int64_t token_stride, int64_t t) {
    return head + (table[t / block_size] * block_size + t % block_size) * token_stride;
}

/* q . k for one int8 key row: each scale group's partial sum scaled once, the groups' sums added as vectors
   (one horizontal sum per token, taken by the caller). */
static inline vf key_dot(const vf *qs, const int8_t *row, int64_t head_dim, const int VG, const int NG) {
    vf sum = (vf){0};
    for (int j = 0; j < NG; j++) {
        vf acc = (vf){0};
        for (int c = j * VG; c < (j + 1) * VG; c++) acc += qs[c] * load_int8(row + LANES * c);
        sum += acc * row_scale(row, head_dim, j);
    }
    return sum;
}

/* One (request, kv head); C = head_dim / LANES is a constant in each specialised copy, VG = the vectors
   of one scale group. scores: group rows of ctx_pad floats (a multiple of LANES >= ctx). */
static inline void decode_one_int8(const float *q, const int8_t *k_head, const int8_t *v_head, const int64_t *table,
                                   int64_t ctx, float *out, float *scores, int64_t block_size,
                                   int64_t token_stride, int64_t group, int64_t ctx_pad, float scale, const int C) {
    const int64_t head_dim = (int64_t)C * LANES;
    const int VG = (head_dim < GROUP ? head_dim : GROUP) / LANES, NG = C / VG;
    for (int64_t g = 0; g < group; g++) {
        vf qs[C];
        for (int c = 0; c < C; c++) qs[c] = loadv(q + g * head_dim + LANES * c) * scale;
        float *s = scores + g * ctx_pad;
        float max = -FLT_MAX;
        int64_t t = 0;
        for (; t + LANES <= ctx; t += LANES) { /* LANES tokens' sums in one transpose-and-add */
            vf part[LANES];
            for (int i = 0; i < LANES; i++)
                part[i] = key_dot(qs, row_at(k_head, table, block_size, token_stride, t + i), head_dim, VG, NG);
            storev(s + t, sum_lanes(part));
            for (int i = 0; i < LANES; i++) max = s[t + i] > max ? s[t + i] : max;
        }
        for (; t < ctx; t++) {
            s[t] = lanes_sum(key_dot(qs, row_at(k_head, table, block_size, token_stride, t), head_dim, VG, NG));
            max = s[t] > max ? s[t] : max;
        }
        const int64_t padded = (ctx + LANES - 1) / LANES * LANES;
        for (t = ctx; t < padded; t++) s[t] = -FLT_MAX; /* e^-87 after the clamp: nothing beside the sum */
        vf totals = (vf){0};
        for (t = 0; t < padded; t += LANES) {
            const vf e = exp_nonpositive(loadv(s + t) - max);
            storev(s + t, e);
            totals += e;
        }
        float total = lanes_sum(totals);
        vf acc[C];
        for (int c = 0; c < C; c++) acc[c] = (vf){0};
        for (t = 0; t < ctx; t++) {
            const int8_t *row = row_at(v_head, table, block_size, token_stride, t);
            for (int j = 0; j < NG; j++) {
                const float p = s[t] * row_scale(row, head_dim, j);
                for (int c = j * VG; c < (j + 1) * VG; c++) acc[c] += p * load_int8(row + LANES * c);
            }
        }
        const float inv = 1.0f / total;
        for (int c = 0; c < C; c++) storev(out + g * head_dim + LANES * c, acc[c] * inv);
    }
}

/* As pdserve_paged_decode_f32 (decode.c), over int8 caches [num_blocks, block_size, kv_heads, row] with
   row = head_dim + 4 * (head_dim / min(32, head_dim)); max_context: a multiple of 16 >= every context;
   scratch: batch * num_heads * max_context floats. The caller checks pdserve_decode_supported first. */
void pdserve_paged_decode_i8(const float *q, int64_t q_stride, const int8_t *k_cache, const int8_t *v_cache,
                             const int64_t *block_tables, int64_t table_stride, const int64_t *context_lens,
                             float *out, float *scratch, int64_t batch, int64_t num_heads, int64_t kv_heads,
                             int64_t head_dim, int64_t block_size, int64_t max_context, float scale,
                             int num_threads) {
    (void)num_threads;
    const int64_t group = num_heads / kv_heads, groups = head_dim < GROUP ? 1 : head_dim / GROUP;
    const int64_t row = head_dim + 4 * groups, token_stride = kv_heads * row;
#pragma omp parallel for num_threads(num_threads) schedule(dynamic, 1)
    for (int64_t item = 0; item < batch * kv_heads; item++) {
        const int64_t b = item / kv_heads, h = item % kv_heads, ctx = context_lens[b];
        const int64_t *table = block_tables + b * table_stride;
        const float *qr = q + b * q_stride + h * group * head_dim;
        const int8_t *kh = k_cache + h * row, *vh = v_cache + h * row;
        float *o = out + (b * num_heads + h * group) * head_dim;
        float *sc = scratch + item * group * max_context;
        switch (head_dim) {
        case 16: decode_one_int8(qr, kh, vh, table, ctx, o, sc, block_size, token_stride, group, max_context, scale, 16 / LANES); break;
        case 32: decode_one_int8(qr, kh, vh, table, ctx, o, sc, block_size, token_stride, group, max_context, scale, 32 / LANES); break;
        case 64: decode_one_int8(qr, kh, vh, table, ctx, o, sc, block_size, token_stride, group, max_context, scale, 64 / LANES); break;
        case 128: decode_one_int8(qr, kh, vh, table, ctx, o, sc, block_size, token_stride, group, max_context, scale, 128 / LANES); break;
        }
    }
}
