/* The int8 KV pool's writer (--kv-cache-dtype int8), beside decode_int8.c (the decode reader). Rows are
   [head_dim int8 | one float16 scale per 16 values] (kernels/triton/kv_int8.py).

   pdserve_rope_store_i8: layer_ops.c's RoPE + K/V store, quantizing each K and V head into its row as
   it stores it. The quantizer is kv_int8.quantize_rows to the bit: scale = float16(amax / 127) (round to
   nearest even, capped at float16's largest), q = the float32 product x * (1 / scale) rounded half to
   even, clamped to +-127; a group whose scale is 0 in float16 stores zeros. K is quantized after its
   rotation, as llama.cpp stores its q8_0 K.

   A token's K and V heads lie side by side in its qkv row, so its 2 * kv_heads * head_dim / 16 groups
   are one run of floats, quantized LANES groups at a time in three steps:
     1. each group's |x| maximum lane by lane over its vectors (NaN loses, as in torch's amax of finite
        values);
     2. the LANES maxima reduced at once by a transpose-and-max tree into one vector of amax, then one
        vector division for the scales, rounded to float16, and one for the inverses;
     3. each vector times its group's inverse, clamped, rounded by the float-to-int conversion (round
        half to even in the default rounding mode) and narrowed to bytes.
   It was 3.6x the float32 store: 16 calls of libm's fmaxf per group for the lane maximum and two
   scalar divisions. The rounding was x * inv + 1.5 * 2^23 - 1.5 * 2^23, which GCC contracts into an
   FMA: one rounding of the exact product, not of the float32 product, and so the other integer where
   the float32 product is a tie (tests/test_kv_int8_kernels.py).

   The prefill reader is prefill.c's pdserve_paged_prefill_i8. */
#include <math.h>

#include "int8_rows.h" /* and vector.h; the intrinsics */
#include "rope.h"

#define QMAX 127.0f
#define F16_MAX 65504.0f /* float16's largest: a larger amax / 127 (|x| past 8.3 million) is capped */
#define MIN_STORE_ROWS 64 /* fewer tokens take less time than waking the other threads */

/* a > b ? a : b and a < b ? a : b lane by lane (so b where either is NaN): x86's maxps and minps
   exactly, one instruction where vector.h's select is a compare and two logic operations. */
#if LANES == 16 && defined(__AVX512F__)
#define VEC_MAX _mm512_max_ps
#define VEC_MIN _mm512_min_ps
typedef __m512 native_vf;
#elif LANES == 8 && defined(__AVX__)
#define VEC_MAX _mm256_max_ps
#define VEC_MIN _mm256_min_ps
typedef __m256 native_vf;
#elif LANES == 4 && defined(__SSE__)
#define VEC_MAX _mm_max_ps
#define VEC_MIN _mm_min_ps
typedef __m128 native_vf;
#endif

/* One lane-wise choice, written once for both: the native instruction where there is one. */
#ifdef VEC_MAX
#define LANEWISE(NAME, NATIVE, CMP)                                                                      \
    static inline vf NAME(vf a, vf b) {                                                                  \
        native_vf x, y;                                                                                  \
        memcpy(&x, &a, sizeof x);                                                                        \
        memcpy(&y, &b, sizeof y);                                                                        \
        x = NATIVE(x, y);                                                                                \
        memcpy(&a, &x, sizeof a);                                                                        \
        return a;                                                                                        \
    }
#else
#define LANEWISE(NAME, NATIVE, CMP) \
    static inline vf NAME(vf a, vf b) { return select(a CMP b, a, b); }
#endif
LANEWISE(greater_of, VEC_MAX, >)
LANEWISE(lesser_of, VEC_MIN, <)
#undef LANEWISE

#define PAIR_MAX(a, b, FIRST, SECOND) greater_of(SHUFFLE(a, b, FIRST), SHUFFLE(a, b, SECOND))

/* Lane i of the result = the largest lane of x[i], for LANES vectors of non-negative values: vector.h's
   sum_lanes tree with max for sum (max is exact, so any order gives the same value). */
static inline vf max_lanes(const vf *x) {
#if LANES == 16
    vf y[8], z[4];
    for (int i = 0; i < 8; i++) y[i] = PAIR_MAX(x[2 * i], x[2 * i + 1], HALVES_LO, HALVES_HI);
    for (int i = 0; i < 4; i++) z[i] = PAIR_MAX(y[2 * i], y[2 * i + 1], QUARTERS_LO, QUARTERS_HI);
#elif LANES == 8
    vf z[4];
    for (int i = 0; i < 4; i++) z[i] = PAIR_MAX(x[2 * i], x[2 * i + 1], QUARTERS_LO, QUARTERS_HI);
#else
    const vf *z = x;
#endif
    vf w[2];
    for (int i = 0; i < 2; i++) w[i] = PAIR_MAX(z[2 * i], z[2 * i + 1], PAIRS_LO, PAIRS_HI);
    return PAIR_MAX(w[0], w[1], EVENS, ODDS);
}

/* Each lane rounded half to even to an int32. The conversion instructions round in the current mode
   (round to nearest even unless someone changed it, which nearbyintf and torch.round assume too); a
   NaN gives INT32_MIN, whose low byte store_int8 keeps: 0, as the scalar (int8_t)(int32_t) cast. */
static inline vi round_lanes(vf y) {
    vi out;
#if LANES == 16 && defined(__AVX512F__)
    __m512 f;
    memcpy(&f, &y, sizeof f);
    const __m512i r = _mm512_cvtps_epi32(f);
#elif LANES == 8 && defined(__AVX__)
    __m256 f;
    memcpy(&f, &y, sizeof f);
    const __m256i r = _mm256_cvtps_epi32(f);
#elif LANES == 4 && defined(__SSE2__)
    __m128 f;
    memcpy(&f, &y, sizeof f);
    const __m128i r = _mm_cvtps_epi32(f);
#else
    vi r;
    for (int i = 0; i < LANES; i++) r[i] = (int32_t)nearbyintf(y[i]);
#endif
    memcpy(&out, &r, sizeof out);
    return out;
}

/* LANES int32 lanes stored as their low bytes: one vpmovdb with AVX-512, else lane by lane. */
static inline void store_int8(int8_t *p, vi x) {
#if LANES == 16 && defined(__AVX512F__)
    __m512i w;
    memcpy(&w, &x, sizeof w);
    _mm_storeu_si128((__m128i *)p, _mm512_cvtepi32_epi8(w));
#elif LANES == 8 && defined(__AVX512VL__)
    __m256i w;
    memcpy(&w, &x, sizeof w);
    _mm_storel_epi64((__m128i *)p, _mm256_cvtepi32_epi8(w));
#else
    for (int i = 0; i < LANES; i++) p[i] = (int8_t)x[i];
#endif
}

/* Two vectors' low bytes side by side (2 * LANES bytes): with AVX512-VBMI one two-source byte permute
   and one store, half the shuffle work of two vpmovdb. */
static inline void store_int8_pair(int8_t *p, vi x, vi y) {
#if LANES == 16 && defined(__AVX512VBMI__)
    __m512i a, b;
    memcpy(&a, &x, sizeof a);
    memcpy(&b, &y, sizeof b);
    const __m512i low_bytes = _mm512_set_epi8(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
                                              0, 0, 0, 0, 0, 0, 124, 120, 116, 112, 108, 104, 100, 96, 92, 88, 84, 80,
                                              76, 72, 68, 64, 60, 56, 52, 48, 44, 40, 36, 32, 28, 24, 20, 16, 12, 8, 4, 0);
    _mm256_storeu_si256((__m256i *)p, _mm512_castsi512_si256(_mm512_permutex2var_epi8(a, low_bytes, b)));
#else
    store_int8(p, x);
    store_int8(p + LANES, y);
#endif
}

/* Where each group of a token's run goes: the same offsets for every token (made once a call), into
   its K slot for the first k_groups groups, its V slot for the rest. */
typedef struct {
    int8_t *k_row, *v_row;          /* the token's slot in each cache: kv_heads rows */
    const int64_t *values, *scales; /* per group of the run: where its values and its scale's 4 bytes start */
    int64_t k_groups;
} Targets;

static inline int8_t *target(const Targets *to, const int64_t *offsets, int64_t i) {
    return (i < to->k_groups ? to->k_row : to->v_row) + offsets[i];
}

/* The float16 scale of amax / 127 (NaN passes, as through torch's clamp), as a float in *d. */
static inline _Float16 half_scale(float amax_over_qmax, float *d) {
    const _Float16 h = (_Float16)(amax_over_qmax > F16_MAX ? F16_MAX : amax_over_qmax);
    *d = (float)h;
    return h;
}

/* Each lane's half_scale at once: vcvtps2ph / vcvtph2ps (F16C, AVX-512F) where there, else lane by lane.
   The vector min keeps its second operand where either is NaN, so a NaN passes as in half_scale. */
static inline vf half_scales(vf amax_over_qmax, _Float16 *scale) {
#if LANES == 16 && defined(__AVX512F__)
    __m512 w;
    memcpy(&w, &amax_over_qmax, sizeof w);
    const __m256i h = _mm512_cvtps_ph(_mm512_min_ps(_mm512_set1_ps(F16_MAX), w), _MM_FROUND_TO_NEAREST_INT);
    _mm256_storeu_si256((__m256i *)scale, h);
    const __m512 back = _mm512_cvtph_ps(h);
#elif LANES == 8 && defined(__F16C__) && defined(__AVX__)
    __m256 w;
    memcpy(&w, &amax_over_qmax, sizeof w);
    const __m128i h = _mm256_cvtps_ph(_mm256_min_ps(_mm256_set1_ps(F16_MAX), w), _MM_FROUND_TO_NEAREST_INT);
    _mm_storeu_si128((__m128i *)scale, h);
    const __m256 back = _mm256_cvtph_ps(h);
#else
    float back[LANES];
    for (int i = 0; i < LANES; i++) scale[i] = half_scale(amax_over_qmax[i], &back[i]);
#endif
    vf d;
    memcpy(&d, &back, sizeof d);
    return d;
}

/* y clamped to +-127 (only where the inverse overflowed to inf); a NaN passes, as through the scalar
   comparisons. */
static inline vf clamp_qmax(vf y) { return greater_of(splat(-QMAX), lesser_of(splat(QMAX), y)); }

/* Groups first .. first + n - 1 (n <= LANES) of the run, VG vectors each, from x on (group first's
   values). VG is a constant in each copy (always inlined into a switch), so the loops over a group's
   vectors unroll. */
static inline __attribute__((always_inline)) void quantize_groups(const float *x, const Targets *to, int64_t first,
                                                                  int n, const int VG) {
    vf top[LANES]; /* each written once: a zeroing loop before would become a call of memset */
    for (int i = 0; i < LANES; i++) {
        vf m = (vf){0};
        for (int c = 0; c < VG && i < n; c++) {
            vi bits;
            const vf v = loadv(x + (i * VG + c) * LANES);
            memcpy(&bits, &v, sizeof bits);
            bits &= 0x7fffffff; /* |v| */
            vf a;
            memcpy(&a, &bits, sizeof a);
            m = greater_of(a, m); /* a NaN loses */
        }
        top[i] = m;
    }
    const vf amax = max_lanes(top);
    _Float16 scale[LANES];
    const vf d = half_scales(amax / QMAX, scale);
    const vf inv = select(d > (vf){0}, splat(1.0f) / d, (vf){0}); /* a zero scale stores zeros */
    for (int i = 0; i < n; i++) {
        const vf k = splat(inv[i]);
        const float *g = x + i * VG * LANES;
        int8_t *q = target(to, to->values, first + i);
        int c = 0;
        for (; c + 1 < VG; c += 2)
            store_int8_pair(q + c * LANES, round_lanes(clamp_qmax(loadv(g + c * LANES) * k)),
                            round_lanes(clamp_qmax(loadv(g + (c + 1) * LANES) * k)));
        if (c < VG) store_int8(q + c * LANES, round_lanes(clamp_qmax(loadv(g + c * LANES) * k)));
        memcpy(target(to, to->scales, first + i), &scale[i], sizeof scale[i]);
    }
}

static void quantize_groups_any(const float *x, const Targets *to, int64_t first, int n, int VG) {
    switch (VG) { /* 16 / LANES, or head_dim / LANES for a head of 16 or fewer values */
#define VG_CASE(N) case N: quantize_groups(x, to, first, n, N); break;
        VG_CASE(1) VG_CASE(2) VG_CASE(3) VG_CASE(4) VG_CASE(5) VG_CASE(6) VG_CASE(7) VG_CASE(8)
#undef VG_CASE
    }
}

/* A group that is not a whole number of vectors (a head of fewer than LANES values, or not a multiple
   of them): the same operations one value at a time. */
static void quantize_group_scalar(const float *g, int64_t size, int8_t *q, int8_t *scale) {
    float amax = 0.0f;
    for (int64_t j = 0; j < size; j++) amax = fabsf(g[j]) > amax ? fabsf(g[j]) : amax;
    float d;
    const _Float16 s = half_scale(amax / QMAX, &d);
    const float inv = d > 0.0f ? 1.0f / d : 0.0f;
    for (int64_t j = 0; j < size; j++) {
        const float y = g[j] * inv;
        q[j] = (int8_t)(int32_t)nearbyintf(y > QMAX ? QMAX : y < -QMAX ? -QMAX : y);
    }
    memcpy(scale, &s, sizeof s);
}

/* As pdserve_rope_store_f32 (layer_ops.c), over int8 caches [slots, kv_heads, row] with
   row = int8_row_bytes(head_dim). */
void pdserve_rope_store_i8(float *qkv, int64_t qkv_stride, int64_t tokens, int64_t num_heads, int64_t kv_heads,
                           int64_t head_dim, const float *cos, const float *sin, const int64_t *slots,
                           int8_t *k_cache, int8_t *v_cache, int num_threads) {
    (void)num_threads;
    const int64_t half = head_dim / 2, head_groups = int8_row_groups(head_dim), group = head_dim / head_groups;
    const int64_t row = int8_row_bytes(head_dim), groups = 2 * kv_heads * head_groups;
    const int VG = group % LANES == 0 ? (int)(group / LANES) : 0; /* 1-4 (group <= 16); 0: the scalar quantizer */
    const int64_t k_groups = kv_heads * head_groups;
    int64_t values[groups], scales[groups]; /* Targets' offsets: group i of the run's head, then group in it */
    for (int64_t i = 0; i < groups; i++) {
        const int64_t head = i % k_groups / head_groups, g = i % head_groups;
        values[i] = head * row + g * group;
        scales[i] = head * row + head_dim + INT8_SCALE_BYTES * g;
    }
#pragma omp parallel for num_threads(num_threads) schedule(static) if (tokens >= MIN_STORE_ROWS)
    for (int64_t t = 0; t < tokens; t++) {
        float *x = qkv + t * qkv_stride;
        rope_heads(x, num_heads + kv_heads, head_dim, cos + t * half, sin + t * half);
        const Targets to = {k_cache + slots[t] * kv_heads * row, v_cache + slots[t] * kv_heads * row, values, scales,
                            k_groups};
        const float *kv = x + num_heads * head_dim; /* [k heads | v heads]: the run of groups */
        for (int64_t i = 0; i < groups; i += LANES) {
            const int n = groups - i < LANES ? (int)(groups - i) : LANES;
            if (VG > 0) {
                quantize_groups_any(kv + i * group, &to, i, n, VG);
            } else {
                for (int j = 0; j < n; j++)
                    quantize_group_scalar(kv + (i + j) * group, group, target(&to, values, i + j), target(&to, scales, i + j));
            }
        }
    }
}
