/* A quantized decode step of a few rows (up to TEAM_ROWS) with one OpenMP parallel region per layer
   instead of one per kernel call: the values are decode_step.c's bits, from the same kernels.

   Why: at one stream a projection streams 0.35-1.9 MB of Q8_0 rows, a few tens of microseconds on two
   threads, and decode_step.c starts a parallel region for each (qkv, o, gate_up, down, attention) with a
   barrier inside after quantizing the input row: ~150 team starts and ~420 barriers a token. Each costs
   microseconds when idle and a scheduler slice when the cores are shared, as every thread must arrive.
   ggml runs a whole graph in one team for that reason. Here, over a float32 KV pool, the whole step is one
   region, and inside it the only barriers are the ones the data needs (a projection's output complete,
   the K/V stored before attention reads it, attention's output complete):

     layer l:  norm | qkv | RoPE + K/V store | attention (decode.c's items, shared out) | o | norm |
               gate_up | SwiGLU | down

   Over an int8 pool (decode_int8.c has no per-item entry) a region ends before each attention, which
   runs as in decode_step.c: two regions a layer.

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
    const int64_t first = p->split > 0 ? p->split : N;
    s->quant_team((int)p->type, x, rows, K, p->w, first, p->row_bytes, bias, out, N, own->scratch, 1);
    if (first < N) /* the second part's columns (decode_step.h's Projection) */
        s->quant_team((int)p->type2, x, rows, K, p->w2, N - first, p->row_bytes2, bias ? bias + first : NULL,
                      out + first, N, own->scratch, 1);
}

/* own->h = norm(residual + x) with weight; the sum into own->residual and, by thread 0, into next. */
static void norm_add(const DecodeShape *s, const float *x, const float *residual, float *next, const float *weight,
                     int64_t rows, const Own *own, int thread) {
    const size_t bytes = (size_t)(rows * s->hidden) * sizeof(float);
    memcpy(own->residual, residual, bytes);
    pdserve_rms_norm_f32(x, s->hidden, own->residual, weight, own->h, rows, s->hidden, s->eps, 1);
    if (thread == 0) memcpy(next, own->residual, bytes);
}

/* What every thread of the step's team reads: the step's arguments and the shared buffers. */
typedef struct {
    const DecodeLayer *layers;
    const DecodeShape *s;
    float *x, *qkv, *attn, *gate_up, *scores, *stream[2], *own_rows;
    int64_t rows, table_stride, ctx_pad;
    void *pool;
    const float *cos, *sin;
    const int64_t *slots, *block_tables, *context_lens;
    uint8_t *quant_scratch;
} Step;

static Own own_of(const Step *st, int thread) {
    const int64_t rows = st->rows, hidden = st->s->hidden;
    float *mine = st->own_rows + thread * rows * (2 * hidden + st->s->inter);
    return (Own){mine, mine + rows * hidden, mine + 2 * rows * hidden,
                 st->quant_scratch + thread * st->s->quant_scratch_stride};
}

/* Layer l up to its attention: its input norm, qkv, and RoPE with the K/V store (one thread, no wait:
   the caller's next barrier covers it). *at: which stream buffer holds the residual stream. */
static void start_layer(const Step *st, int64_t l, const Own *own, int thread, int *at) {
    const DecodeShape *s = st->s;
    const DecodeLayer *w = st->layers + l;
    const int64_t rows = st->rows, hidden = s->hidden, qkv_size = (s->num_heads + 2 * s->kv_heads) * s->head_dim;
    if (l == 0) { /* the first layer's residual stream is its input */
        pdserve_rms_norm_f32(st->x, hidden, NULL, w->input_norm, own->h, rows, hidden, s->eps, 1);
        if (thread == 0) memcpy(st->stream[*at], st->x, (size_t)(rows * hidden) * sizeof(float));
    } else {
        norm_add(s, st->x, st->stream[*at], st->stream[*at ^ 1], w->input_norm, rows, own, thread), *at ^= 1;
    }
    project(s, &w->qkv, own->h, rows, hidden, qkv_size, w->qkv_bias, st->qkv, own);
#pragma omp single nowait
    decode_store_kv(s, l, st->qkv, rows, st->pool, st->cos, st->sin, st->slots, 1);
}

/* Layer l after its attention: o, the post-attention norm, gate_up, SwiGLU's product and down into x. */
static void finish_layer(const Step *st, int64_t l, const Own *own, int thread, int *at) {
    const DecodeShape *s = st->s;
    const DecodeLayer *w = st->layers + l;
    const int64_t rows = st->rows, hidden = s->hidden, inter = s->inter, q_size = s->num_heads * s->head_dim;
    project(s, &w->o, st->attn, rows, q_size, hidden, NULL, st->x, own);
    norm_add(s, st->x, st->stream[*at], st->stream[*at ^ 1], w->post_norm, rows, own, thread), *at ^= 1;
    project(s, &w->gate_up, own->h, rows, hidden, 2 * inter, NULL, st->gate_up, own);
    pdserve_silu_mul_f32(st->gate_up, 2 * inter, own->act, rows, inter, 1);
    project(s, &w->down, own->act, rows, inter, hidden, NULL, st->x, own);
}

/* Layer l's attention over a float32 pool, its items shared among the team (a barrier at the end). */
static void attend_f32(const Step *st, int64_t l) {
    const DecodeShape *s = st->s;
    const int64_t qkv_size = (s->num_heads + 2 * s->kv_heads) * s->head_dim;
    const float *k_cache = (const float *)st->pool + 2 * l * s->cache_floats, *v_cache = k_cache + s->cache_floats;
#pragma omp for schedule(dynamic, 1)
    for (int64_t item = 0; item < st->rows * s->kv_heads; item++)
        pdserve_paged_decode_item_f32(st->qkv, qkv_size, k_cache, v_cache, st->block_tables, st->table_stride,
                                      st->context_lens, st->attn, st->scores, s->num_heads, s->kv_heads,
                                      s->head_dim, s->block_size, st->ctx_pad, s->scale, item);
}

static int thread_num(void) {
#ifdef _OPENMP
    return omp_get_thread_num();
#else
    return 0;
#endif
}

/* The final residual add: x += the residual stream (one thread; the region's end waits for it). */
static void add_stream(const Step *st, int at) {
#pragma omp single nowait
    for (int64_t i = 0; i < st->rows * st->s->hidden; i++) st->x[i] += st->stream[at][i];
}

void decode_step_team(const DecodeLayer *layers, int64_t num_layers, const DecodeShape *s, float *x, int64_t rows,
                      void *pool, const float *cos, const float *sin, const int64_t *slots,
                      const int64_t *block_tables, int64_t table_stride, const int64_t *context_lens,
                      int64_t ctx_pad, float *work, uint8_t *quant_scratch, int num_threads) {
    const int64_t hidden = s->hidden, q_size = s->num_heads * s->head_dim;
    const int64_t qkv_size = q_size + 2 * s->kv_heads * s->head_dim;
    /* decode_step.c's layout of work, its h as the second residual buffer, then each thread's rows */
    Step st = {.layers = layers, .s = s, .x = x, .rows = rows, .table_stride = table_stride, .ctx_pad = ctx_pad,
               .pool = pool, .cos = cos, .sin = sin, .slots = slots, .block_tables = block_tables,
               .context_lens = context_lens, .quant_scratch = quant_scratch};
    st.stream[0] = work, st.stream[1] = work + rows * hidden, st.qkv = st.stream[1] + rows * hidden;
    st.attn = st.qkv + rows * qkv_size, st.gate_up = st.attn + rows * q_size;
    st.scores = st.gate_up + rows * 3 * s->inter, st.own_rows = st.scores + rows * s->num_heads * ctx_pad;
    if (!s->kv_int8) {
#pragma omp parallel num_threads(num_threads)
        {
            const int thread = thread_num();
            const Own own = own_of(&st, thread);
            int at = 0; /* every thread follows the same sequence of stream buffers */
            for (int64_t l = 0; l < num_layers; l++) {
                start_layer(&st, l, &own, thread, &at);
#pragma omp barrier
                attend_f32(&st, l);
                finish_layer(&st, l, &own, thread, &at);
            }
            add_stream(&st, at);
        }
        return;
    }
    for (int64_t l = 0; l <= num_layers; l++) { /* region l: the rest of layer l - 1, layer l up to attention */
#pragma omp parallel num_threads(num_threads)
        {
            const int thread = thread_num();
            const Own own = own_of(&st, thread);
            int at = 0; /* two flips a region but the last: 0 at every region's start */
            if (l > 0) finish_layer(&st, l - 1, &own, thread, &at);
            if (l < num_layers) start_layer(&st, l, &own, thread, &at);
            else add_stream(&st, at);
        }
        if (l < num_layers)
            decode_attend(s, l, st.qkv, rows, pool, block_tables, table_stride, context_lens, ctx_pad, st.attn,
                          st.scores, num_threads);
    }
}
