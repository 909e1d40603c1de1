/* kernels/cpu/half.c's tiles: out[n][r] = dot of 16-bit weight row n with activation row r, for HALF_TW
   weight rows by nx <= HALF_TX rows of x, each weight vector loaded once for all nx rows and each
   activation vector once for all HALF_TW weight rows (at 16 rows of x a weight tile is read from memory
   once and from L1 four times). The code path is the compiler's reading of the CPU (HALF_PATH):
     3  AVX-512F/BW + AVX512-BF16: BF16 by vdpbf16ps on the hi and lo halves, F16 as 2
     2  AVX-512F/BW: vcvtph2ps (F16) or a 16-bit shift (BF16) to float32, FMA with x (F16) or hi + lo
     1  AVX2 + FMA + F16C: the same at 8 lanes, the tail of a row in C
     0  plain C (half.c's dot_tile), also the PDSERVE_HALF_SCALAR build */
#ifndef PDSERVE_HALF_TILES_H
#define PDSERVE_HALF_TILES_H
#include <stdint.h>
#include <string.h>

/* format tags: engine/quant/weight.py's BF16 and F16 (kernels/cpu/half.py's TYPE_IDS, beside quant.c's 0-7) */
enum { HALF_BF16 = 8, HALF_F16 = 9, HALF_BF16_ONCE = 10 /* x rounded to bf16 once, as llama.cpp: measured only */ };

#if !defined(PDSERVE_HALF_SCALAR) && defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>
#if defined(__AVX512BF16__)
#define HALF_PATH 3
#else
#define HALF_PATH 2
#endif
#elif !defined(PDSERVE_HALF_SCALAR) && defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define HALF_PATH 1
#else
#define HALF_PATH 0
#endif

#define HALF_TW 4 /* weight rows per tile */
/* the tiles' loops over their constant bounds unrolled outright, so the accumulators live in registers (with
   the loops left rolled GCC 12 kept them in memory, a store after every vdpbf16ps) */
#define UNROLL _Pragma("GCC unroll 4")
#define HALF_TX 4 /* activation rows per tile */
/* Prefetch distance along the weight stream: at one row of x the stream is the whole cost, and a core
   needs ~12 KB of reads in flight to reach DRAM's bandwidth on Zen 5 (quant_tile512.c measured it). */
#define HALF_AHEAD 12288

/* One row of x as the tiles read it: float32 (F16), hi + lo in float32 (BF16 without vdpbf16ps), and the
   bf16 halves themselves (vdpbf16ps). */
typedef struct {
    const float *x, *xr;
    const uint16_t *hi, *lo;
} half_x;

static inline float half_f16_to_f32(uint16_t h) {
#if HALF_PATH
    return _cvtsh_ss(h);
#else
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff;
    uint32_t u;
    if (exp == 0x1f) u = sign | 0x7f800000u | (man << 13); /* inf, NaN */
    else if (exp) u = sign | ((exp + 112) << 23) | (man << 13);
    else if (!man) u = sign;
    else { /* a denormal f16 is a normal f32: shift its leading 1 into place */
        int e = 113;
        uint32_t m = man;
        while (!(m & 0x400)) m <<= 1, e--;
        u = sign | ((uint32_t)e << 23) | ((m & 0x3ff) << 13);
    }
    float f;
    memcpy(&f, &u, 4);
    return f;
#endif
}

#if HALF_PATH >= 2
static inline __attribute__((always_inline)) __m512 half_widen16(int t, const uint16_t *p, __mmask16 m) {
    const __m256i raw = _mm256_maskz_loadu_epi16(m, p);
    if (t == HALF_F16) return _mm512_cvtph_ps(raw);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

/* F16, and BF16 without vdpbf16ps: each weight vector widened to float32 once for the tile's rows of x */
static inline __attribute__((always_inline)) void half_tile_fma(int t, int nx, const uint16_t *const *w,
                                                                const half_x *x, int64_t K,
                                                                float out[HALF_TW][HALF_TX]) {
    __m512 acc[HALF_TW][HALF_TX];
    UNROLL for (int n = 0; n < HALF_TW; n++) UNROLL for (int r = 0; r < nx; r++) acc[n][r] = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k += 16) {
        const int64_t left = K - k;
        const __mmask16 m = left >= 16 ? 0xffff : (__mmask16)((1u << left) - 1);
        __m512 wv[HALF_TW];
        UNROLL for (int n = 0; n < HALF_TW; n++) {
            if (k % 32 == 0) _mm_prefetch((const char *)(w[n] + k) + HALF_AHEAD, _MM_HINT_T0); /* a line per 32 */
            wv[n] = half_widen16(t, w[n] + k, m);
        }
        UNROLL for (int r = 0; r < nx; r++) {
            const __m512 xv = _mm512_maskz_loadu_ps(m, (t == HALF_F16 ? x[r].x : x[r].xr) + k);
            UNROLL for (int n = 0; n < HALF_TW; n++) acc[n][r] = _mm512_fmadd_ps(wv[n], xv, acc[n][r]);
        }
    }
    UNROLL for (int n = 0; n < HALF_TW; n++) UNROLL for (int r = 0; r < nx; r++) {
        out[n][r] = _mm512_reduce_add_ps(acc[n][r]);
    }
}

#if HALF_PATH == 3
/* BF16 by vdpbf16ps, 32 products an instruction. At up to 2 rows of x the lo half goes to accumulators of
   its own (apart): there are only HALF_TW * nx sums, and chains of two dependent vdpbf16ps a step would
   bound the stream by their latency; at more rows the sums are chains enough, and twice the accumulators
   would not fit the 32 registers. */
static inline __attribute__((always_inline)) void half_tile_dp(int t, int nx, const uint16_t *const *w,
                                                               const half_x *x, int64_t K,
                                                               float out[HALF_TW][HALF_TX]) {
    const int apart = t == HALF_BF16 && nx <= 2;
    __m512 acc[HALF_TW][HALF_TX], low[HALF_TW][HALF_TX];
    UNROLL for (int n = 0; n < HALF_TW; n++) UNROLL for (int r = 0; r < nx; r++) {
        acc[n][r] = low[n][r] = _mm512_setzero_ps();
    }
    for (int64_t k = 0; k < K; k += 32) { /* 32 values: 64 bytes, one cache line, of each weight row */
        const int64_t left = K - k;
        const __mmask32 m = left >= 32 ? 0xffffffffu : (1u << left) - 1;
        __m512bh wv[HALF_TW];
        UNROLL for (int n = 0; n < HALF_TW; n++) {
            _mm_prefetch((const char *)(w[n] + k) + HALF_AHEAD, _MM_HINT_T0);
            wv[n] = (__m512bh)_mm512_maskz_loadu_epi16(m, w[n] + k);
        }
        UNROLL for (int r = 0; r < nx; r++) {
            const __m512bh hi = (__m512bh)_mm512_maskz_loadu_epi16(m, x[r].hi + k);
            UNROLL for (int n = 0; n < HALF_TW; n++) acc[n][r] = _mm512_dpbf16_ps(acc[n][r], wv[n], hi);
            if (t != HALF_BF16) continue;
            const __m512bh lo = (__m512bh)_mm512_maskz_loadu_epi16(m, x[r].lo + k);
            UNROLL for (int n = 0; n < HALF_TW; n++) {
                if (apart) low[n][r] = _mm512_dpbf16_ps(low[n][r], wv[n], lo);
                else acc[n][r] = _mm512_dpbf16_ps(acc[n][r], wv[n], lo);
            }
        }
    }
    UNROLL for (int n = 0; n < HALF_TW; n++) UNROLL for (int r = 0; r < nx; r++) {
        out[n][r] = _mm512_reduce_add_ps(apart ? _mm512_add_ps(acc[n][r], low[n][r]) : acc[n][r]);
    }
}
#endif

static inline __attribute__((always_inline)) void half_tile_at(int t, int nx, const uint16_t *const *w,
                                                               const half_x *x, int64_t K,
                                                               float out[HALF_TW][HALF_TX]) {
#if HALF_PATH == 3
    if (t != HALF_F16) {
        half_tile_dp(t, nx, w, x, K, out);
        return;
    }
#endif
    half_tile_fma(t, nx, w, x, K, out);
}
#elif HALF_PATH == 1
static inline __attribute__((always_inline)) __m256 half_widen8(int t, const uint16_t *p) {
    const __m128i raw = _mm_loadu_si128((const __m128i *)p);
    if (t == HALF_F16) return _mm256_cvtph_ps(raw);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}

static inline __attribute__((always_inline)) void half_tile_at(int t, int nx, const uint16_t *const *w,
                                                               const half_x *x, int64_t K,
                                                               float out[HALF_TW][HALF_TX]) {
    __m256 acc[HALF_TW][HALF_TX];
    UNROLL for (int n = 0; n < HALF_TW; n++) UNROLL for (int r = 0; r < nx; r++) acc[n][r] = _mm256_setzero_ps();
    int64_t k = 0;
    for (; k + 8 <= K; k += 8) {
        __m256 wv[HALF_TW];
        UNROLL for (int n = 0; n < HALF_TW; n++) {
            if (k % 32 == 0) _mm_prefetch((const char *)(w[n] + k) + HALF_AHEAD, _MM_HINT_T0); /* a line per 32 */
            wv[n] = half_widen8(t, w[n] + k);
        }
        UNROLL for (int r = 0; r < nx; r++) {
            const __m256 xv = _mm256_loadu_ps((t == HALF_F16 ? x[r].x : x[r].xr) + k);
            UNROLL for (int n = 0; n < HALF_TW; n++) acc[n][r] = _mm256_fmadd_ps(wv[n], xv, acc[n][r]);
        }
    }
    UNROLL for (int n = 0; n < HALF_TW; n++) UNROLL for (int r = 0; r < nx; r++) {
        __m128 s = _mm_add_ps(_mm256_castps256_ps128(acc[n][r]), _mm256_extractf128_ps(acc[n][r], 1));
        s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        float sum = _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
        for (int64_t j = k; j < K; j++) { /* the row's last K % 8 values */
            uint32_t u = (uint32_t)w[n][j] << 16;
            float wf;
            memcpy(&wf, &u, 4);
            sum += t == HALF_F16 ? half_f16_to_f32(w[n][j]) * x[r].x[j] : wf * x[r].xr[j];
        }
        out[n][r] = sum;
    }
}
#endif

#if HALF_PATH
#define HALF_ROWS(T)                                                                                           \
    switch (nx) {                                                                                              \
    case 1: half_tile_at(T, 1, w, x, K, out); break;                                                           \
    case 2: half_tile_at(T, 2, w, x, K, out); break;                                                           \
    case 3: half_tile_at(T, 3, w, x, K, out); break;                                                           \
    default: half_tile_at(T, 4, w, x, K, out); break;                                                          \
    }

/* the tile with the format and row count constant, so each combination gets its own unrolled code */
static void half_tile(int t, int nw, int nx, const uint16_t *const *w, const half_x *x, int64_t K,
                      float out[HALF_TW][HALF_TX]) {
    (void)nw; /* always HALF_TW rows: half.c repeats a row to fill a short last tile */
    if (t == HALF_F16) {
        HALF_ROWS(HALF_F16)
    } else if (t == HALF_BF16) {
        HALF_ROWS(HALF_BF16)
    } else {
        HALF_ROWS(HALF_BF16_ONCE)
    }
}
#endif
#endif
