/* A quantized decode step of a few rows (up to TEAM_ROWS) with one OpenMP parallel region per layer
   instead of one per kernel call: the values are decode_step.c's bits, from the same kernels.

   Why: at one stream a projection streams 0.35-1.9 MB of Q8_0 rows, a few tens of microseconds on two
   threads, and decode_step.c starts a parallel region for each (qkv, o, gate_up, down, attention) with a
   barrier inside after quantizing the input row: ~150 team starts and ~420 barriers a token. Each costs
   microseconds when idle and a scheduler slice when the cores are shared, as every thread must arrive.
   ggml runs a whole graph in one team for that reason. Here a layer's work between two attentions is one
   region, and inside it the only barriers are the ones the data needs (a projection's output complete):

     region l:  o (layer l-1) | norm | gate_up | SwiGLU | down | norm (layer l) | qkv | RoPE + K/V store
     then:      attention of layer l (its own kernel and region, as in decode_step.c)

   Between projections each thread computes the norm, SwiGLU's product and the activation quantization
   for itself into its own rows, from shared inputs no one writes then: work a barrier would have had the
   others wait for. The residual stream alternates between two shared buffers: a norm reads one and its
   thread 0 writes the other, which no thread reads until a projection's barrier later. */
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif
#include "decode_step.h"

int pdserve_decode_team_takes(const DecodeLayer *layers, int64_t num_layers, const DecodeShape *s, int64_t rows) {
    if (s->quant_team == NULL || rows > TEAM_ROWS) return 0;
    for (int64_t l = 0; l < num_layers; l++) {
        const DecodeLayer *w = layers + l;
        if (w->qkv.type < 0 || w->o.type < 0 || w->gate_up.type < 0 || w->down.type < 0) return 0;
    }
    return 1;
}

/* One thread's rows: the residual stream after a norm's add, the norm's output, SwiGLU's product, and its
   quantization scratch. */
typedef struct {
    float *residual, *h, *act;
    uint8_t *scratch;
} Own;

static inline void project(const DecodeShape *s, const Projection *p, const float *x, int64_t rows, int64_t K,
                           int64_t N, const float *bias, float *out, const Own *own) {
    s->quant_team((int)p->type, x, rows, K, p->w, N, p->row_bytes, bias, out, own->scratch, 1);
}

/* own->h = norm(residual + x) with weight; the sum into own->residual and, by thread 0, into next. */
static void norm_add(const DecodeShape *s, const float *x, const float *residual, float *next, const float *weight,
                     int64_t rows, const Own *own, int thread) {
    const size_t bytes = (size_t)(rows * s->hidden) * sizeof(float);
    memcpy(own->residual, residual, bytes);
    pdserve_rms_norm_f32(x, s->hidden, own->residual, weight, own->h, rows, s->hidden, s->eps, 1);
    if (thread == 0) memcpy(next, own->residual, bytes);
}

void decode_step_team(const DecodeLayer *layers, int64_t num_layers, const DecodeShape *s, float *x, int64_t rows,
                      void *pool, const float *cos, const float *sin, const int64_t *slots,
                      const int64_t *block_tables, int64_t table_stride, const int64_t *context_lens,
                      int64_t ctx_pad, float *work, uint8_t *quant_scratch, int num_threads) {
    const int64_t hidden = s->hidden, inter = s->inter, q_size = s->num_heads * s->head_dim;
    const int64_t qkv_size = q_size + 2 * s->kv_heads * s->head_dim;
    /* decode_step.c's layout of work, its h as the second residual buffer, then each thread's rows */
    float *stream[2] = {work, work + rows * hidden}, *qkv = stream[1] + rows * hidden, *attn = qkv + rows * qkv_size;
    float *gate_up = attn + rows * q_size, *scores = gate_up + rows * 3 * inter;
    float *own_rows = scores + rows * s->num_heads * ctx_pad;
    for (int64_t l = 0; l <= num_layers; l++) {
#pragma omp parallel num_threads(num_threads)
        {
#ifdef _OPENMP
            const int thread = omp_get_thread_num();
#else
            const int thread = 0;
#endif
            float *mine = own_rows + thread * rows * (2 * hidden + inter);
            const Own own = {mine, mine + rows * hidden, mine + 2 * rows * hidden,
                             quant_scratch + thread * s->quant_scratch_stride};
            int at = 0; /* stream[at]: the residual stream as of the last norm; two flips a region but the last */
            if (l > 0) { /* the rest of layer l - 1 */
                const DecodeLayer *w = layers + l - 1;
                project(s, &w->o, attn, rows, q_size, hidden, NULL, x, &own);
                norm_add(s, x, stream[at], stream[at ^ 1], w->post_norm, rows, &own, thread), at ^= 1;
                project(s, &w->gate_up, own.h, rows, hidden, 2 * inter, NULL, gate_up, &own);
                pdserve_silu_mul_f32(gate_up, 2 * inter, own.act, rows, inter, 1);
                project(s, &w->down, own.act, rows, inter, hidden, NULL, x, &own);
            }
            if (l == 0) { /* the first layer's residual stream is its input */
                pdserve_rms_norm_f32(x, hidden, NULL, layers[0].input_norm, own.h, rows, hidden, s->eps, 1);
                if (thread == 0) memcpy(stream[at], x, (size_t)(rows * hidden) * sizeof(float));
            } else if (l < num_layers) {
                norm_add(s, x, stream[at], stream[at ^ 1], layers[l].input_norm, rows, &own, thread), at ^= 1;
            }
            if (l < num_layers) {
                project(s, &layers[l].qkv, own.h, rows, hidden, qkv_size, layers[l].qkv_bias, qkv, &own);
#pragma omp single nowait
                decode_store_kv(s, l, qkv, rows, pool, cos, sin, slots, 1);
            } else {
#pragma omp single nowait
                for (int64_t i = 0; i < rows * hidden; i++) x[i] += stream[at][i];
            }
        }
        if (l < num_layers)
            decode_attend(s, l, qkv, rows, pool, block_tables, table_stride, context_lens, ctx_pad, attn, scores,
                          num_threads);
    }
}
