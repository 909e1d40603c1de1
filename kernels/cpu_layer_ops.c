/* The small per-token steps of a decoder layer on CPU, fp32, each one pass over its rows: RMSNorm with
   the residual add before it, and rotary embedding with the K/V store after it (vLLM's CPU backend has
   the same two, fused_add_rms_norm and rotary_embedding + reshape_and_cache).

   In torch each is 4-8 operators, a few microseconds of dispatch apiece on a few rows: at one decode
   token, one thread, they were ~8% of a step of the `small` model. With many rows (a prefill chunk)
   the torch norm makes several passes over [rows, hidden] where this makes one.
*/
#include <math.h>

#include "cpu_vector.h"

#define MIN_PARALLEL_ROWS 64 /* fewer rows take less time than waking the other threads */

static inline float add_lanes(vf v) {
    float s = 0.0f;
    for (int i = 0; i < LANES; i++) s += v[i];
    return s;
}

/* out[t] = weight * (h / sqrt(mean(h^2) + eps)) with h = x[t], or, with a residual, h = residual[t] += x[t]
   (the layer's residual stream, updated in place). The sum of squares is in float32, as transformers'
   RMSNorm computes it for float32 weights. x rows are x_stride floats apart; residual and out are
   [rows, dim] contiguous; out may be x itself. */
void pdserve_rms_norm_f32(const float *x, int64_t x_stride, float *residual, const float *weight, float *out,
                          int64_t rows, int64_t dim, float eps, int num_threads) {
    (void)num_threads; /* unused without OpenMP */
    const int64_t vec_end = dim / LANES * LANES;
#pragma omp parallel for num_threads(num_threads) schedule(static) if (rows >= MIN_PARALLEL_ROWS)
    for (int64_t t = 0; t < rows; t++) {
        const float *src = x + t * x_stride;
        float *h = residual != NULL ? residual + t * dim : NULL;
        vf acc = {0};
        float tail = 0.0f;
        if (h != NULL) {
            for (int64_t k = 0; k < vec_end; k += LANES) {
                const vf v = loadv(src + k) + loadv(h + k);
                storev(h + k, v);
                acc += v * v;
            }
            for (int64_t k = vec_end; k < dim; k++) {
                h[k] += src[k];
                tail += h[k] * h[k];
            }
            src = h;
        } else {
            for (int64_t k = 0; k < vec_end; k += LANES) {
                const vf v = loadv(src + k);
                acc += v * v;
            }
            for (int64_t k = vec_end; k < dim; k++) tail += src[k] * src[k];
        }
        const float inv = 1.0f / sqrtf((add_lanes(acc) + tail) / (float)dim + eps);
        float *dst = out + t * dim;
        const vf inv_v = splat(inv);
        for (int64_t k = 0; k < vec_end; k += LANES) storev(dst + k, loadv(weight + k) * (loadv(src + k) * inv_v));
        for (int64_t k = vec_end; k < dim; k++) dst[k] = weight[k] * (src[k] * inv);
    }
}

/* Rotary embedding (the rotate-half pairing of Llama: element i with i + head_dim / 2) of each token's
   query and key heads, in place in its qkv row ([q heads | k heads | v heads], qkv_stride floats
   apart), then the token's rotated K and its V into cache slot slots[t] (caches: [slots, kv_heads,
   head_dim] contiguous). cos and sin: [tokens, head_dim / 2], the token's own angles. */
void pdserve_rope_store_f32(float *qkv, int64_t qkv_stride, int64_t tokens, int64_t num_heads, int64_t kv_heads,
                            int64_t head_dim, const float *cos, const float *sin, const int64_t *slots,
                            float *k_cache, float *v_cache, int num_threads) {
    (void)num_threads;
    const int64_t half = head_dim / 2, kv_size = kv_heads * head_dim;
#pragma omp parallel for num_threads(num_threads) schedule(static) if (tokens >= MIN_PARALLEL_ROWS)
    for (int64_t t = 0; t < tokens; t++) {
        float *row = qkv + t * qkv_stride;
        const float *c = cos + t * half, *s = sin + t * half;
        for (int64_t h = 0; h < num_heads + kv_heads; h++) {
            float *x1 = row + h * head_dim, *x2 = x1 + half;
            for (int64_t i = 0; i < half; i++) {
                const float a = x1[i], b = x2[i];
                x1[i] = a * c[i] - b * s[i];
                x2[i] = b * c[i] + a * s[i];
            }
        }
        const float *k = row + num_heads * head_dim;
        memcpy(k_cache + slots[t] * kv_size, k, kv_size * sizeof(float));
        memcpy(v_cache + slots[t] * kv_size, k + kv_size, kv_size * sizeof(float));
    }
}
