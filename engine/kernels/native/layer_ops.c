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
