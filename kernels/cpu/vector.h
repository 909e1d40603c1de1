/* Vector helpers shared by the CPU kernels (decode.c, prefill.c, linear.c, ...): a float
   vector as wide as one hardware register (GCC vector extensions, also understood by clang), loads and
   stores, a transpose-and-add reduction of LANES vectors at once, and the softmax's exponential. */
#ifndef PDSERVE_CPU_VECTOR_H
#define PDSERVE_CPU_VECTOR_H

#include <stdint.h>
#include <string.h>

/* One vector register of floats: 16 lanes with AVX-512, 8 with AVX, else 4 (SSE, NEON). Batch 64,
   context 200-600, one thread, ms per layer on the AVX-512 Xeon built for each instruction set:
       lanes          4     8     16
       SSE2         3.85  6.28
       AVX2         3.70  1.77  7.68
       AVX-512      3.52  1.76  1.37
   Wider than the hardware's, generic vectors are lowered to slow shuffles; narrower, they leave half
   the register idle (the decode-attention kernel, decode.c). A build may set LANES itself (the
   tests build every width on one machine). */
#ifndef LANES
#if defined(__AVX512F__)
#define LANES 16
#elif defined(__AVX__)
#define LANES 8
#else
#define LANES 4
#endif
#endif
#if LANES != 4 && LANES != 8 && LANES != 16
#error "LANES must be 4, 8 or 16"
#endif
typedef float vf __attribute__((vector_size(4 * LANES)));
typedef int32_t vi __attribute__((vector_size(4 * LANES)));

static inline vf loadv(const float *p) { vf v; memcpy(&v, p, sizeof v); return v; }
static inline void storev(float *p, vf v) { memcpy(p, &v, sizeof v); }
static inline vf splat(float x) { return (vf){0} + x; }

static inline vf select(vi mask, vf a, vf b) { /* lanes where mask is -1 from a, the rest from b */
    vi ai, bi;
    memcpy(&ai, &a, sizeof ai);
    memcpy(&bi, &b, sizeof bi);
    const vi r = (ai & mask) | (bi & ~mask);
    vf out;
    memcpy(&out, &r, sizeof out);
    return out;
}

/* Two-vector shuffle with constant lane indices (0 .. 2 * LANES - 1 across a then b): clang and GCC 12+
   spell it __builtin_shufflevector, older GCC __builtin_shuffle with an index vector. */
#if defined(__clang__) || __GNUC__ >= 12
#define SHUFFLE(a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
#else
#define SHUFFLE(a, b, ...) __builtin_shuffle(a, b, (vi){__VA_ARGS__})
#endif
#define PAIR_SUM(a, b, FIRST, SECOND) (SHUFFLE(a, b, FIRST) + SHUFFLE(a, b, SECOND))

/* Lane i of the result = the sum of the lanes of x[i], for LANES vectors at once: a transpose-and-add
   tree (log2(LANES) levels, each halving the partial sums per vector and doubling the vectors per
   register), against a full horizontal reduction per vector done one by one. */
#if LANES == 16
#define HALVES_LO 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23
#define HALVES_HI 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31
#define QUARTERS_LO 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27
#define QUARTERS_HI 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31
#define PAIRS_LO 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29
#define PAIRS_HI 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31
#define EVENS 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30
#define ODDS 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31
#elif LANES == 8
#define QUARTERS_LO 0, 1, 2, 3, 8, 9, 10, 11
#define QUARTERS_HI 4, 5, 6, 7, 12, 13, 14, 15
#define PAIRS_LO 0, 1, 4, 5, 8, 9, 12, 13
#define PAIRS_HI 2, 3, 6, 7, 10, 11, 14, 15
#define EVENS 0, 2, 4, 6, 8, 10, 12, 14
#define ODDS 1, 3, 5, 7, 9, 11, 13, 15
#else
#define PAIRS_LO 0, 1, 4, 5
#define PAIRS_HI 2, 3, 6, 7
#define EVENS 0, 2, 4, 6
#define ODDS 1, 3, 5, 7
#endif

static inline vf sum_lanes(const vf *x) {
#if LANES == 16
    vf y[8], z[4];
    for (int i = 0; i < 8; i++) y[i] = PAIR_SUM(x[2 * i], x[2 * i + 1], HALVES_LO, HALVES_HI); /* 8 partials each */
    for (int i = 0; i < 4; i++) z[i] = PAIR_SUM(y[2 * i], y[2 * i + 1], QUARTERS_LO, QUARTERS_HI); /* 4 */
#elif LANES == 8
    vf z[4];
    for (int i = 0; i < 4; i++) z[i] = PAIR_SUM(x[2 * i], x[2 * i + 1], QUARTERS_LO, QUARTERS_HI); /* 4 */
#else
    const vf *z = x;
#endif
    vf w[2];
    for (int i = 0; i < 2; i++) w[i] = PAIR_SUM(z[2 * i], z[2 * i + 1], PAIRS_LO, PAIRS_HI); /* 2 partials each */
    return PAIR_SUM(w[0], w[1], EVENS, ODDS);
}

/* e^x for x <= 0 (softmax arguments): 2^n * poly(r) with x = n ln2 + r, |r| <= ln2 / 2 (Cephes' expf
   polynomial, about 1 ulp); below -87 it returns e^-87, which the sum cannot tell from 0. */
static inline vf exp_nonpositive(vf x) {
    x = select(x < splat(-87.0f), splat(-87.0f), x);
    const vf round = splat(12582912.0f); /* 1.5 * 2^23: adding and subtracting it rounds to an integer */
    const vf n = (x * 1.44269504088896341f + round) - round;
    const vf r = x - n * 0.693359375f + n * 2.12194440e-4f; /* ln2 in two parts: exact n * ln2_hi */
    vf p = r * 1.9875691500e-4f + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    const vi bits = (__builtin_convertvector(n, vi) + 127) << 23;
    vf two_n;
    memcpy(&two_n, &bits, sizeof two_n);
    return p * two_n;
}

#endif
