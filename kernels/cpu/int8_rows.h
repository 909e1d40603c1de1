/* Reading the int8 KV pool's rows (--kv-cache-dtype int8) in vector registers: each row is [head_dim
   int8 | one float16 scale per 16 values] (kernels/triton/kv_int8.py, which says why; a head of 16 or
   fewer values is one group). Shared by the int8 decode kernel (decode_int8.c) and the prefill kernel (prefill.c).
   Include this before or instead of vector.h. */
#ifndef PDSERVE_CPU_INT8_ROWS_H
#define PDSERVE_CPU_INT8_ROWS_H

#if defined(__x86_64__) || defined(__i386__)
/* immintrin.h pulls in libc's select(2), whose name vector.h's lane select takes: renamed here. */
#define select pdserve_libc_select
#include <immintrin.h>
#undef select
#endif
#include "vector.h"

#define INT8_SCALE_GROUP 16 /* values per scale */
#define INT8_SCALE_BYTES 2  /* one float16 (_Float16: vcvtph2ps with F16C, libgcc's exact conversion without) */

typedef int8_t vb __attribute__((vector_size(LANES)));

/* LANES int8 values as floats. GCC 12 lowers __builtin_convertvector from int8 (to float or to int32) to
   a scalar convert per lane, 6x slower than the float32 kernel's loads; with x86's intrinsics it is one
   sign-extending load (vpmovsxbd) and one vcvtdq2ps. */
static inline vf load_int8(const int8_t *p) {
#if LANES == 16 && defined(__AVX512F__)
    const __m512 f = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
#elif LANES == 8 && defined(__AVX2__)
    const __m256 f = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
#elif LANES == 4 && defined(__SSE4_1__)
    int32_t word;
    memcpy(&word, p, sizeof word);
    const __m128 f = _mm_cvtepi32_ps(_mm_cvtepi8_epi32(_mm_cvtsi32_si128(word)));
#else
    vb b;
    memcpy(&b, p, sizeof b);
    const vf f = __builtin_convertvector(b, vf);
#endif
    vf v;
    memcpy(&v, &f, sizeof v);
    return v;
}

static inline int64_t int8_row_groups(int64_t head_dim) {
    return head_dim < INT8_SCALE_GROUP ? 1 : head_dim / INT8_SCALE_GROUP;
}

/* Bytes of one row: the values, then the scales. */
static inline int64_t int8_row_bytes(int64_t head_dim) {
    return head_dim + INT8_SCALE_BYTES * int8_row_groups(head_dim);
}

static inline float int8_row_scale(const int8_t *row, int64_t head_dim, int64_t group) {
    _Float16 s;
    memcpy(&s, row + head_dim + INT8_SCALE_BYTES * group, sizeof s); /* the scales follow the values */
    return (float)s;
}

/* A row's C = head_dim / LANES vectors of values, each times its group's scale: the row dequantized,
   as kv_int8.dequantize_rows does (one float multiply per value). */
static inline void int8_row_values(const int8_t *row, vf *out, const int C) {
    const int64_t head_dim = (int64_t)C * LANES;
    const int VG = (int)(head_dim / int8_row_groups(head_dim)) / LANES; /* vectors per scale group */
    for (int j = 0; j < C / VG; j++) {
        const float s = int8_row_scale(row, head_dim, j);
        for (int c = j * VG; c < (j + 1) * VG; c++) out[c] = load_int8(row + LANES * c) * s;
    }
}

#endif
