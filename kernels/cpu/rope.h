/* Rotary embedding of one token's heads in place (the rotate-half pairing of Llama: element i with
   i + head_dim / 2), shared by the float32 and the int8 K/V stores (layer_ops.c, kv_int8_ops.c), so
   both pay the same for it. Include after vector.h (or int8_rows.h). */
#ifndef PDSERVE_CPU_ROPE_H
#define PDSERVE_CPU_ROPE_H

/* x: `heads` heads of head_dim floats side by side; c, s: the token's cos and sin, head_dim / 2 each.
   Written as vectors where a half is a whole number of them: GCC's own vectorisation of the scalar
   loop checks at run time, head by head, that x does not overlap c and s, and takes a scalar path for
   a short half. */
static inline void rope_heads(float *x, int64_t heads, int64_t head_dim, const float *c, const float *s) {
    const int64_t half = head_dim / 2;
    if (half % LANES == 0) {
        for (int64_t h = 0; h < heads; h++) {
            float *x1 = x + h * head_dim, *x2 = x1 + half;
            for (int64_t i = 0; i < half; i += LANES) {
                const vf a = loadv(x1 + i), b = loadv(x2 + i), ci = loadv(c + i), si = loadv(s + i);
                storev(x1 + i, a * ci - b * si);
                storev(x2 + i, b * ci + a * si);
            }
        }
        return;
    }
    for (int64_t h = 0; h < heads; h++) {
        float *x1 = x + h * head_dim, *x2 = x1 + half;
        for (int64_t i = 0; i < half; i++) {
            const float a = x1[i], b = x2[i];
            x1[i] = a * c[i] - b * s[i];
            x2[i] = b * c[i] + a * s[i];
        }
    }
}

#endif
