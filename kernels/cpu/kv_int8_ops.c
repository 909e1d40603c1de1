/* The int8 KV pool's writer (--kv-cache-dtype int8), beside decode_int8.c (the decode reader). Rows are [head_dim int8 | one float16 scale per 16 values] (kernels/triton/kv_int8.py).

   pdserve_rope_store_i8: layer_ops.c's RoPE + K/V store, quantizing each K and V head into its row as
   it stores it. The quantizer is kv_int8.quantize_rows to the bit: scale = float16(amax / 127) (round to
   nearest even, capped at float16's largest), q = round half to even of x * (1 / scale) (nearbyintf
   in the default rounding mode), clamped to +-127; a group whose scale is 0 stores zeros. K is quantized after its rotation, as llama.cpp stores its q8_0 K.

   The prefill reader is prefill.c's pdserve_paged_prefill_i8 (the float32 kernel's tiles over the key
   tiles' rows dequantized). */
#include <math.h>

#include "int8_rows.h" /* and vector.h; the intrinsics */

#define QMAX 127.0f
#define F16_MAX 65504.0f
#define MIN_STORE_ROWS 64 /* fewer tokens take less time than waking the other threads */

/* The stored scale of a group whose largest magnitude is amax, and the multiplier its values are rounded with. */
static inline _Float16 group_scale(float amax, float *inv) {
    const float d = amax / QMAX;
    const _Float16 h = (_Float16)(d < F16_MAX ? d : F16_MAX); /* fminf would pass a NaN through the same */
    *inv = (float)h > 0.0f ? 1.0f / (float)h : 0.0f;
    return h;
}

/* LANES int32 lanes (each within +-127) stored as int8: one vpmovdb with AVX-512, else lane by lane. */
static inline void store_int8(int8_t *p, vi x) {
#if LANES == 16 && defined(__AVX512F__)
    __m512i w;
    memcpy(&w, &x, sizeof w);
    _mm_storeu_si128((__m128i *)p, _mm512_cvtepi32_epi8(w));
#else
    for (int i = 0; i < LANES; i++) p[i] = (int8_t)x[i];
#endif
}

/* One scale group of `size` values, a multiple of LANES, as vectors: the scalar quantizer's float
   operations lane by lane, so its bytes. nearbyintf (round half to even) is x + 1.5 * 2^23 - 1.5 * 2^23,
   exact for |x| < 2^22 (here |x| <= 127). GCC leaves the scalar loops scalar: 6x the float32 store. */
static void quantize_group_lanes(const float *x, int64_t size, int8_t *q, _Float16 *scale) {
    const vi magnitude = (vi){0} + 0x7fffffff;
    vf top = (vf){0};
    for (int64_t i = 0; i < size; i += LANES) {
        const vf v = loadv(x + i);
        vi bits;
        memcpy(&bits, &v, sizeof bits);
        bits &= magnitude; /* |v| */
        vf a;
        memcpy(&a, &bits, sizeof a);
        top = select(a > top, a, top); /* a NaN loses, as with fmaxf */
    }
    float amax = 0.0f;
    for (int i = 0; i < LANES; i++) amax = fmaxf(amax, top[i]);
    float inv;
    *scale = group_scale(amax, &inv);
    const vf round = splat(12582912.0f);
    for (int64_t i = 0; i < size; i += LANES) {
        vf v = (loadv(x + i) * inv + round) - round;
        v = select(v > splat(QMAX), splat(QMAX), v);
        v = select(v < splat(-QMAX), splat(-QMAX), v);
        store_int8(q + i, __builtin_convertvector(v, vi));
    }
}

static void quantize_row(const float *x, int64_t head_dim, int8_t *row) {
    const int64_t groups = int8_row_groups(head_dim), size = head_dim / groups;
    for (int64_t g = 0; g < groups; g++) {
        const float *xg = x + g * size;
        _Float16 scale;
        if (size % LANES == 0) {
            quantize_group_lanes(xg, size, row + g * size, &scale);
        } else {
            float amax = 0.0f;
            for (int64_t i = 0; i < size; i++) amax = fmaxf(amax, fabsf(xg[i]));
            float inv;
            scale = group_scale(amax, &inv);
            for (int64_t i = 0; i < size; i++) {
                const float v = nearbyintf(xg[i] * inv);
                row[g * size + i] = (int8_t)(v > QMAX ? QMAX : v < -QMAX ? -QMAX : v);
            }
        }
        memcpy(row + head_dim + INT8_SCALE_BYTES * g, &scale, sizeof scale);
    }
}

/* As pdserve_rope_store_f32 (layer_ops.c), over int8 caches [slots, kv_heads, row] with
   row = int8_row_bytes(head_dim). */
void pdserve_rope_store_i8(float *qkv, int64_t qkv_stride, int64_t tokens, int64_t num_heads, int64_t kv_heads,
                           int64_t head_dim, const float *cos, const float *sin, const int64_t *slots,
                           int8_t *k_cache, int8_t *v_cache, int num_threads) {
    (void)num_threads;
    const int64_t half = head_dim / 2, row = int8_row_bytes(head_dim), token_row = kv_heads * row;
#pragma omp parallel for num_threads(num_threads) schedule(static) if (tokens >= MIN_STORE_ROWS)
    for (int64_t t = 0; t < tokens; t++) {
        float *x = qkv + t * qkv_stride;
        const float *c = cos + t * half, *s = sin + t * half;
        for (int64_t h = 0; h < num_heads + kv_heads; h++) {
            float *x1 = x + h * head_dim, *x2 = x1 + half;
            for (int64_t i = 0; i < half; i++) {
                const float a = x1[i], b = x2[i];
                x1[i] = a * c[i] - b * s[i];
                x2[i] = b * c[i] + a * s[i];
            }
        }
        const float *k = x + num_heads * head_dim, *v = k + kv_heads * head_dim;
        for (int64_t h = 0; h < kv_heads; h++) {
            quantize_row(k + h * head_dim, head_dim, k_cache + slots[t] * token_row + h * row);
            quantize_row(v + h * head_dim, head_dim, v_cache + slots[t] * token_row + h * row);
        }
    }
}
