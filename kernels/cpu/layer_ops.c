/* The small per-token steps of a decoder layer on CPU, fp32, each one pass over its rows: RMSNorm with
   the residual add before it, rotary embedding with the K/V store after it, and SwiGLU's product (vLLM's
   CPU backend has the same three: fused_add_rms_norm, rotary_embedding + reshape_and_cache,
   silu_and_mul).

   In torch each is 4-8 operators, a few microseconds of dispatch apiece on a few rows: at one decode
   token, one thread, they were ~8% of a step of the `small` model. With many rows (a prefill chunk)
   the torch norm makes several passes over [rows, hidden] where this makes one.
*/
#include <math.h>

#include "vector.h"
#include "rope.h"

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
        rope_heads(row, num_heads + kv_heads, head_dim, cos + t * half, sin + t * half);
        const float *k = row + num_heads * head_dim;
        memcpy(k_cache + slots[t] * kv_size, k, kv_size * sizeof(float));
        memcpy(v_cache + slots[t] * kv_size, k + kv_size, kv_size * sizeof(float));
    }
}

/* exp of each lane: Cephes' expf (2^n * e^r, r in [-ln2/2, ln2/2] by a degree-7 polynomial), within
   2 ulp of the true value over the float range; beyond +-88.37 it clamps, where silu no longer cares. */
static inline vf exp_lanes(vf x) {
    x = select(x > splat(88.37f), splat(88.37f), x);
    x = select(x < splat(-88.37f), splat(-88.37f), x);
    const vf t = x * 1.44269504088896341f + 0.5f;
    vf n = __builtin_convertvector(__builtin_convertvector(t, vi), vf); /* truncated toward zero */
    n = select(n > t, n - 1.0f, n);                                       /* floor */
    const vf r = x - n * 0.693359375f - n * -2.12194440e-4f;
    vf p = splat(1.9875691500e-4f);
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * (r * r) + r + 1.0f;
    const vi bits = (__builtin_convertvector(n, vi) + 127) << 23; /* 2^n */
    vf scale;
    memcpy(&scale, &bits, sizeof scale);
    return p * scale;
}

/* SwiGLU's product: out[t][i] = silu(gate[t][i]) * up[t][i], with gate_up rows [gate | up] of
   2 * inter floats, gate_up_stride apart; out [rows, inter] contiguous (the down projection's input,
   which the packed form would otherwise copy contiguous). One read of each input and one write, where
   torch's in-place silu and multiply make three passes. */
void pdserve_silu_mul_f32(const float *gate_up, int64_t gate_up_stride, float *out, int64_t rows, int64_t inter,
                          int num_threads) {
    (void)num_threads;
    const int64_t vec_end = inter / LANES * LANES;
#pragma omp parallel for num_threads(num_threads) schedule(static) if (rows >= MIN_PARALLEL_ROWS)
    for (int64_t t = 0; t < rows; t++) {
        const float *gate = gate_up + t * gate_up_stride, *up = gate + inter;
        float *dst = out + t * inter;
        for (int64_t i = 0; i < vec_end; i += LANES) {
            const vf g = loadv(gate + i);
            storev(dst + i, g / (1.0f + exp_lanes(-g)) * loadv(up + i));
        }
        for (int64_t i = vec_end; i < inter; i++) dst[i] = gate[i] / (1.0f + expf(-gate[i])) * up[i];
    }
}
