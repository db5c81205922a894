// kvscope's small per-layer operations for models that run on kvk: the residual add with the
// RMSNorm after it, and RoPE in place. Each replaces several eager torch ops of a few microseconds
// each (torch's CPU rms_norm is a composite of ~9 ops; RoPE a roll, a multiply and an addcmul):
// at a decode row the ops' dispatch, not their arithmetic, is what a layer spends outside its
// matmuls. Only the own forward of a model whose projections run on kvk uses them: kvk rounds
// each matmul's input to 16-bit codes, far coarser than these ops' last float32 bit, so they
// need not round as torch does (the float32 models keep torch's ops, bit for bit with
// transformers).
//
// Every row is computed alone, in a fixed order, whatever the rows beside it: a sequence's
// results do not depend on its batch.

#include <math.h>
#include <stdint.h>
#include <string.h>
#include <time.h>

#define KVK_API __attribute__((visibility("default")))

// h[r] = (x[r] + res[r]) / sqrt(mean((x[r] + res[r])^2) + eps) * w, for each of `rows` rows of
// `n`; with res non-NULL the sum is also written to xout[r] (which may be x itself: the residual
// stream updated in place). Sums of squares in eight float32 lanes, then the lanes in order.
KVK_API int kvk_add_rms_norm(const float *x, int64_t ldx, const float *res, int64_t ldres, float *xout,
                             int64_t ldxout, const float *w, float eps, int64_t rows, int64_t n, float *h,
                             int64_t ldh) {
    if (n <= 0 || rows < 0) return 1;
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * ldx;
        float *hr = h + r * ldh;
        const float *src = xr;
        if (res != 0) {
            const float *rr = res + r * ldres;
            float *xo = xout + r * ldxout;
            for (int64_t i = 0; i < n; i++) xo[i] = xr[i] + rr[i];
            src = xo;
        }
        float lanes[8] = {0, 0, 0, 0, 0, 0, 0, 0};
        int64_t i = 0;
        for (; i + 8 <= n; i += 8)
            for (int l = 0; l < 8; l++) lanes[l] += src[i + l] * src[i + l];
        float sum = 0.0f;
        for (int l = 0; l < 8; l++) sum += lanes[l];
        for (; i < n; i++) sum += src[i] * src[i];
        const float scale = 1.0f / sqrtf(sum / (float)n + eps);
        for (int64_t j = 0; j < n; j++) hr[j] = src[j] * scale * w[j];
    }
    return 0;
}

// RoPE in place on `heads` heads of width d per row (q's and k's heads side by side), on their
// first `width` dims, Llama's rotate-half layout, as the own forward writes it in torch:
//   x'[j] = x[j] * cos[j] + x[(j + half) % width] * sin[j]
// with sin's first half negated (engine/model/llama_forward.py's _Rope): each product rounded,
// then the sum (no fused multiply-add: built with -ffp-contract=off), as torch rounds it.
KVK_API int kvk_rope(float *qk, int64_t ld_row, int64_t ld_head, int64_t rows, int heads, int width,
                     const float *cos, const float *sin, int64_t ld_table) {
    if (width <= 0 || width % 2 || heads <= 0) return 1;
    const int half = width / 2;
    for (int64_t r = 0; r < rows; r++) {
        const float *c = cos + r * ld_table, *s = sin + r * ld_table;
        for (int hd = 0; hd < heads; hd++) {
            float *v = qk + r * ld_row + hd * ld_head;
            for (int i = 0; i < half; i++) {
                const float a = v[i], b = v[i + half];
                v[i] = a * c[i] + b * s[i];
                v[i + half] = b * c[i + half] + a * s[i + half];
            }
        }
    }
    return 0;
}

// ---- SiLU(gate) * up --------------------------------------------------------------------------
#if defined(__AVX512F__)
#include <immintrin.h>
__m512 kvk_exp16_nonpositive(__m512 x);  // attention.c's e^x for x <= 0 (within ~1 ulp)
#endif

// out[r][i] = silu(g) * u with g = gu[r][i], u = gu[r][inter + i] (a fused gate|up projection's
// output): silu(g) = g * sigmoid(g), sigmoid from t = e^-|g| (never overflows): 1 / (1 + t) for
// g >= 0, t / (1 + t) below. Vectorised where the build has AVX-512 (e^x within ~1 ulp); each
// element is computed alone, so a row's values never depend on the rows beside it.
static inline float silu_mul1(float g, float u) {
    const float t = expf(-fabsf(g));
    const float sig = g >= 0.0f ? 1.0f / (1.0f + t) : t / (1.0f + t);
    return g * sig * u;
}

KVK_API int kvk_silu_mul(const float *gu, int64_t ld, int64_t rows, int64_t inter, float *out, int64_t ldo) {
    if (inter <= 0 || rows < 0) return 1;
    for (int64_t r = 0; r < rows; r++) {
        const float *g = gu + r * ld, *u = g + inter;
        float *o = out + r * ldo;
        int64_t i = 0;
#if defined(__AVX512F__)
        const __m512 one = _mm512_set1_ps(1.0f), zero = _mm512_setzero_ps();
        for (; i < inter; i += 16) {  // the last 16 or fewer through the same code, masked
            const __mmask16 m = inter - i >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (inter - i)) - 1);
            const __m512 gv = _mm512_maskz_loadu_ps(m, g + i);
            const __m512 t = kvk_exp16_nonpositive(_mm512_sub_ps(zero, _mm512_abs_ps(gv)));
            const __mmask16 neg = _mm512_cmp_ps_mask(gv, zero, _CMP_LT_OQ);
            const __m512 sig = _mm512_div_ps(_mm512_mask_mov_ps(one, neg, t), _mm512_add_ps(one, t));
            _mm512_mask_storeu_ps(o + i, m, _mm512_mul_ps(_mm512_mul_ps(gv, sig), _mm512_maskz_loadu_ps(m, u + i)));
        }
#endif
        for (; i < inter; i++) o[i] = silu_mul1(g[i], u[i]);
    }
    return 0;
}

// ---- greedy sampling's argmax and log-sum-exp -----------------------------------------------------
// index = the first position of the largest of x[0..n), lse = log(sum(e^(x - max))) + max: what a
// plain greedy step needs of its logits, in two passes (torch's argmax and logsumexp took ~0.1-0.3
// ms for a 49152-token vocabulary in an engine step, a few percent of a small model's token).
// Sums in 16 float32 lanes, then the lanes in order. Returns 1 (nothing written) if x holds a NaN.
KVK_API int kvk_argmax_logsumexp(const float *x, int64_t n, int64_t *index, float *lse) {
    if (n <= 0) return 1;
    float best = x[0];
    int64_t i = 0;
#if defined(__AVX512F__)
    if (n >= 16) {  // the largest value, 16 lanes at a time (max is exact: any order gives it)
        __m512 top = _mm512_loadu_ps(x);
        __mmask16 nan = 0;
        for (; i + 16 <= n; i += 16) {
            const __m512 v = _mm512_loadu_ps(x + i);
            nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
            top = _mm512_max_ps(top, v);
        }
        if (nan) return 1;
        best = _mm512_reduce_max_ps(top);
    }
#endif
    for (; i < n; i++) {
        if (x[i] != x[i]) return 1;
        if (x[i] > best) best = x[i];
    }
    int64_t at = 0;
    while (x[at] != best) at++;  // its first position
    float lanes[16] = {0};
    i = 0;
#if defined(__AVX512F__)
    __m512 acc = _mm512_setzero_ps();
    const __m512 peak = _mm512_set1_ps(best);
    for (; i + 16 <= n; i += 16)
        acc = _mm512_add_ps(acc, kvk_exp16_nonpositive(_mm512_sub_ps(_mm512_loadu_ps(x + i), peak)));
    _mm512_storeu_ps(lanes, acc);
#endif
    for (; i < n; i++) lanes[i % 16] += expf(x[i] - best);
    float sum = 0.0f;
    for (int l = 0; l < 16; l++) sum += lanes[l];
    *index = at;
    *lse = best + logf(sum);
    return 0;
}

// ---- a whole decoder layer in one call ---------------------------------------------------------
// A Llama-shaped layer whose four projections run on kvk (fused q|k|v and gate|up), with plain
// RMSNorms, RoPE and SiLU: what the own forward does for such a layer op by op (llama_forward.py),
// the same C functions in the same order on the same values, so the same bits; ~10 Python and
// torch calls a layer (each a few microseconds at a decode row) become one.
int kvk_matmul_visit(int t, const uint8_t *const *rowp, const int64_t *visit, int64_t n, int64_t k, const float *x,
                     int64_t xs, int64_t nr, float *y, int64_t ys);
int kvk_matmul_panels(int t, const uint8_t *panels, int64_t n, int64_t k, const float *x, int64_t xs, int64_t nr,
                      float *y, int64_t ys);
int kvk_paged_attention(const float *q, int64_t q_stride, int64_t nrows, int heads, int d, const void *k_pool,
                        const void *v_pool, int kv_type, const uint16_t *k_scales, const uint16_t *v_scales,
                        int64_t block_size, int kv_heads, const int32_t *tables, const int64_t *table_start,
                        const int64_t *start, const int64_t *stop, float scale, float softcap, const float *sinks,
                        float *out, int64_t out_stride, float *probs, int64_t probs_width);

// A projection: up to 4 parts side by side in its output (q|k|v or gate|up across formats: a
// Q4_K_M file keeps some v projections in Q6_K), each a kvk matmul into its columns, plus its bias.
typedef struct {
    int32_t t, unused;  // GGML type
    int64_t n;          // its output columns
    const uint8_t *const *rows;  // its row-address table
    const float *bias;  // [n] or NULL
    const int64_t *visit;  // NULL, or its outputs in its rows' address order (kvk_matmul_visit)
    const uint8_t *panels;  // NULL, or its rows repacked into panels (panels.c): what it multiplies
} kvk_part;

typedef struct {
    int32_t count, unused;
    kvk_part part[4];
} kvk_proj;

typedef struct {  // one layer's weights and shapes (built once; engine/model/fused_layers.py)
    kvk_proj qkv, o, gu, down;
    int32_t heads, kv_heads, d, rope_width;
    int64_t hidden, inter;
    const float *norm1, *norm2;
    const float *sinks;  // [heads] or NULL
    float eps, scale, softcap, unused;
} kvk_layer_spec;

typedef struct {  // one step's rows (built once a step)
    int64_t rows, block_size;
    int64_t kv_type;  // the pools' elements: attention.c's KV_F32 (0) or KV_F16 (1)
    float *x;        // [rows, hidden]: the residual stream, updated in place
    const int64_t *kv_rows;  // [rows * kv_heads]: each new token's head's row in a pool seen as [.., d]
    const int32_t *tables;   // the attention's block tables, where each row's starts, its stop
    const int64_t *table_start, *stops;
    float *h, *qkv, *attn, *gu, *m;  // scratch [rows, hidden | q+k+v | heads * d | 2 * inter | inter]
    float *y;        // [rows, hidden]: in, the previous layer's MLP output (pending) when asked; out, this one's
} kvk_layer_step;

// y [rows, ys] = x [rows, k] times the projection's parts, each into its columns, then its bias
// (as the op-by-op forward's KernelLinear and StackedLinear compute each part: the same bits).
static int project(const kvk_proj *P, int64_t k, const float *x, int64_t rows, float *y, int64_t ys) {
    int64_t col = 0;
    for (int p = 0; p < P->count; p++) {
        const kvk_part *q = &P->part[p];
        if (q->panels ? kvk_matmul_panels(q->t, q->panels, q->n, k, x, k, rows, y + col, ys)
                      : kvk_matmul_visit(q->t, q->rows, q->visit, q->n, k, x, k, rows, y + col, ys))
            return 1;
        if (q->bias)
            for (int64_t r = 0; r < rows; r++)
                for (int64_t i = 0; i < q->n; i++) y[r * ys + col + i] += q->bias[i];
        col += q->n;
    }
    return 0;
}

// float32 -> float16 bits, rounding to nearest even, as torch's Tensor.to(torch.float16) does
// (c10's fp16_ieee_from_fp32_value, the same arithmetic): PagedKVStorage.write's bits.
static inline uint16_t f2h(float f) {
    float base = (fabsf(f) * 0x1.0p+112f) * 0x1.0p-110f;
    uint32_t w, bits;
    memcpy(&w, &f, 4);
    const uint32_t shl1_w = w + w, sign = w & 0x80000000u;
    uint32_t bias = shl1_w & 0xFF000000u;
    if (bias < 0x71000000u) bias = 0x71000000u;
    const uint32_t bias_bits = (bias >> 1) + 0x07800000u;
    float b;
    memcpy(&b, &bias_bits, 4);
    base = b + base;
    memcpy(&bits, &base, 4);
    const uint32_t nonsign = ((bits >> 13) & 0x00007C00u) + (bits & 0x00000FFFu);
    return (uint16_t)((sign >> 16) | (shl1_w > 0xFF000000u ? 0x7E00u : nonsign));
}

// n float32 values as float16 bits, each rounded to nearest even (torch's .to(torch.float16)).
KVK_API int kvk_to_f16(const float *src, int64_t n, uint16_t *dst) {
    int64_t i = 0;
#if defined(__AVX512F__)
    for (; i + 16 <= n; i += 16)  // (vcvtps2ph rounds to nearest even: f2h's bits)
        _mm256_storeu_si256((__m256i *)(dst + i),
                            _mm512_cvtps_ph(_mm512_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
#endif
    for (; i < n; i++) dst[i] = f2h(src[i]);
    return 0;
}

// d values of a new token's head into its pool row: copied (float32) or rounded to float16.
static inline void store_kv(void *pool, int64_t kv_type, int64_t row, const float *src, int64_t d) {
    if (kv_type == 0) memcpy((float *)pool + row * d, src, (size_t)d * sizeof(float));
    else kvk_to_f16(src, d, (uint16_t *)pool + row * d);
}

static inline double now_s(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

// pending: add S->y (the previous layer's MLP output) into x first. cos/sin: [rows, rope_width];
// starts: each row's first attended position (the layer's window); k_pool/v_pool: float32 or
// float16 (S->kv_type) [num_blocks, kv_heads, block_size, d]. clock: NULL, or seconds accumulated
// into [matmuls, attention, the rest] (engine bench's decode split). Returns 0, or the failing
// part's number.
static int kvk_decoder_layer(const kvk_layer_spec *L, const kvk_layer_step *S, int pending, const float *cos,
                              const float *sin, const int64_t *starts, void *k_pool, void *v_pool,
                              double *clock) {
    const int64_t R = S->rows, H = L->hidden, d = L->d;
    const int64_t qw = (int64_t)L->heads * d, kw = (int64_t)L->kv_heads * d, qkv_n = qw + 2 * kw;
    double t[10];
#define TICK(i) \
    if (clock) t[i] = now_s()
    TICK(0);
    if (kvk_add_rms_norm(S->x, H, pending ? S->y : 0, H, S->x, H, L->norm1, L->eps, R, H, S->h, H)) return 1;
    TICK(1);
    if (project(&L->qkv, H, S->h, R, S->qkv, qkv_n)) return 2;
    TICK(2);
    if (kvk_rope(S->qkv, qkv_n, d, R, L->heads + L->kv_heads, L->rope_width, cos, sin, L->rope_width)) return 3;
    for (int64_t r = 0; r < R; r++)  // K and V into the pool, as PagedKVStorage.write_kv
        for (int h = 0; h < L->kv_heads; h++) {
            const int64_t row = S->kv_rows[r * L->kv_heads + h];
            store_kv(k_pool, S->kv_type, row, S->qkv + r * qkv_n + qw + h * d, d);
            store_kv(v_pool, S->kv_type, row, S->qkv + r * qkv_n + qw + kw + h * d, d);
        }
    TICK(3);
    if (kvk_paged_attention(S->qkv, qkv_n, R, L->heads, (int)d, k_pool, v_pool, (int)S->kv_type, 0, 0,
                            S->block_size, L->kv_heads, S->tables, S->table_start, starts, S->stops, L->scale,
                            L->softcap, L->sinks, S->attn, qw, 0, 0))
        return 4;
    TICK(4);
    float *a = S->y;  // the attention's output projection (y is free until the MLP's end)
    if (project(&L->o, qw, S->attn, R, a, H)) return 5;
    TICK(5);
    if (kvk_add_rms_norm(S->x, H, a, H, S->x, H, L->norm2, L->eps, R, H, S->h, H)) return 6;
    TICK(6);
    if (project(&L->gu, H, S->h, R, S->gu, 2 * L->inter)) return 7;
    TICK(7);
    if (kvk_silu_mul(S->gu, 2 * L->inter, R, L->inter, S->m, L->inter)) return 8;
    TICK(8);
    if (project(&L->down, L->inter, S->m, R, S->y, H)) return 9;
    TICK(9);
#undef TICK
    if (clock) {
        clock[0] += (t[2] - t[1]) + (t[5] - t[4]) + (t[7] - t[6]) + (t[9] - t[8]);
        clock[1] += t[4] - t[3];
        clock[2] += (t[1] - t[0]) + (t[3] - t[2]) + (t[6] - t[5]) + (t[8] - t[7]);
    }
    return 0;
}

// The layers [first, stop) of a step in one call: layer i is kvk_decoder_layer (specs[i], S, i > 0,
// cos[i], ...), its MLP output left in S->y for the next one's norm to add (the caller adds the
// last one's). One call a step instead of one a layer: the engine thread takes the GIL back once a
// step, not once a layer, and in the app each time it does it may wait on the GUI thread's
// painting (up to the switch interval). (The app ran at 0.85-0.93 of headless with a call a
// layer, 0.91-0.96 after; the measure's own noise is of that size.) A step that reads the
// residual at a middle layer (the hidden-state self-draft) makes two calls. Returns 0, or
// 16 * layer + its failing part.
KVK_API int kvk_decoder_layers(const kvk_layer_spec *const *specs, int64_t first, int64_t stop,
                               const kvk_layer_step *S, const float *const *cos, const float *const *sin,
                               const int64_t *const *starts, void *const *k_pools, void *const *v_pools,
                               double *clock) {
    for (int64_t i = first; i < stop; i++) {
        const int status = kvk_decoder_layer(specs[i], S, i > 0, cos[i], sin[i], starts[i], k_pools[i], v_pools[i], clock);
        if (status) return (int)(16 * i + status);
    }
    return 0;
}
