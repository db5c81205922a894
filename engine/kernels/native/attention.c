// Paged attention for query rows, each over exactly its own positions of the KV pool.
//
// A row r attends the keys at positions [start[r], stop[r]) of its sequence, read through its
// block table (block = table[p / block_size], slot = p % block_size). Every (row, query head) is
// computed alone, in one fixed order: the scores in position order, their max, the exponentials
// summed in position order, the values weighted in position order. So a row's output depends on
// nothing but its query, its positions and the pool: a decode row, a speculative verification row
// at the same position and a prefill row at the same position are the same computation, whatever
// else the step holds (batch invariant by construction, and chunk invariant).
//
// The pool is laid out as engine/kv/storage.py keeps it: per layer K then V, each
// [num_blocks, kv_heads, block_size, head_dim], in float32, float16, bfloat16, or int8 with one
// float16 scale per (block, kv head, slot). GQA: query head h reads KV head h / (heads / kv_heads).
// Soft-capping (Gemma 2: s = cap * tanh(s / cap)) and attention sinks (gpt-oss: one logit per head
// that takes probability mass and gives no value) are built in. `probs`, when given, receives each
// row's probabilities over its positions (the attention-per-head view reads the step's own numbers).

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif
#if defined(__AVX512F__)
#include <immintrin.h>
#define ATT_AVX512 1
#endif

#define KVK_API __attribute__((visibility("default")))

enum { KV_F32 = 0, KV_F16 = 1, KV_BF16 = 2, KV_I8 = 3 };

static inline float h2f(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff, bits;
    if (exp == 0) {
        if (man == 0) {
            bits = sign;
        } else {
            int e = -1;
            do { e++; man <<= 1; } while ((man & 0x400) == 0);
            bits = sign | ((uint32_t)(127 - 15 - e) << 23) | ((man & 0x3ff) << 13);
        }
    } else if (exp == 31) {
        bits = sign | 0x7f800000u | (man << 13);
    } else {
        bits = sign | ((exp + 127 - 15) << 23) | (man << 13);
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

// One key or value vector of the pool decoded to float32 into dst[0..d).
static inline void load_vec(const void *pool, int kv_type, const uint16_t *scales, int64_t index, int d,
                            float *dst) {
    const int64_t base = index * d;
    switch (kv_type) {
        case KV_F32: memcpy(dst, (const float *)pool + base, (size_t)d * 4); return;
        case KV_F16: {
            const uint16_t *p = (const uint16_t *)pool + base;
            for (int i = 0; i < d; i++) dst[i] = h2f(p[i]);
            return;
        }
        case KV_BF16: {
            const uint16_t *p = (const uint16_t *)pool + base;
            for (int i = 0; i < d; i++) {
                uint32_t bits = (uint32_t)p[i] << 16;
                memcpy(dst + i, &bits, 4);
            }
            return;
        }
        default: {  // int8 codes times the slot's float16 scale, as storage.gather_blocks does
            const int8_t *p = (const int8_t *)pool + base;
            const float s = h2f(scales[index]);
            for (int i = 0; i < d; i++) dst[i] = (float)p[i] * s;
        }
    }
}

static inline float dot(const float *a, const float *b, int d) {
#ifdef ATT_AVX512
    __m512 acc = _mm512_setzero_ps();
    int i = 0;
    for (; i + 16 <= d; i += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), acc);
    float s = _mm512_reduce_add_ps(acc);
    for (; i < d; i++) s += a[i] * b[i];
    return s;
#else
    float s = 0.0f;
    for (int i = 0; i < d; i++) s += a[i] * b[i];
    return s;
#endif
}

static inline void axpy(float w, const float *x, float *y, int d) {
#ifdef ATT_AVX512
    const __m512 wv = _mm512_set1_ps(w);
    int i = 0;
    for (; i + 16 <= d; i += 16) _mm512_storeu_ps(y + i, _mm512_fmadd_ps(wv, _mm512_loadu_ps(x + i), _mm512_loadu_ps(y + i)));
    for (; i < d; i++) y[i] += w * x[i];
#else
    for (int i = 0; i < d; i++) y[i] += w * x[i];
#endif
}

// e^x for x <= 0, x in float32 (the scores minus their max): libm's expf, which is correctly
// rounded to within an ulp on glibc; the same function for every row.
static inline float exp_nonpositive(float x) { return expf(x); }

#ifdef ATT_AVX512
// e^x for 16 lanes, x <= 0 (scores minus their max): x = n ln2 + r, |r| <= ln2 / 2, e^r by a degree-6
// polynomial (Cephes' expf coefficients, within ~1 ulp), scaled by 2^n; e^x = 0 below -87.
static inline __m512 exp16(__m512 x) {
    const __m512 lo = _mm512_set1_ps(-87.3f);
    const __mmask16 tiny = _mm512_cmp_ps_mask(x, lo, _CMP_LT_OQ);
    x = _mm512_max_ps(x, lo);
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 y = _mm512_set1_ps(1.9875691500e-4f);
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.3981999507e-3f));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(8.3334519073e-3f));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(4.1665795894e-2f));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.6666665459e-1f));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(5.0000001201e-1f));
    y = _mm512_fmadd_ps(y, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    return _mm512_maskz_mov_ps(~tiny, _mm512_scalef_ps(y, n));
}

// exp16 for layer_ops.c's SiLU (not exported from the library; one exponential for both).
__m512 kvk_exp16_nonpositive(__m512 x) { return exp16(x); }

// 16 horizontal sums at once: out[j] = sum of the lanes of v[j].
static inline __m512 hsum16(__m512 v[16]) {
    // pairwise: interleave halves and add, 4 levels (each level halves the vector count)
#pragma GCC unroll 4
    for (int width = 16, step = 8; step >= 1; step /= 2, width /= 2) {
#pragma GCC unroll 8
        for (int j = 0; j < width / 2; j++) {
            const __m512 a = v[j], b = v[j + width / 2];
            __m512 lo, hi;
            if (step == 8) {
                lo = _mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(1, 0, 1, 0));
                hi = _mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(3, 2, 3, 2));
            } else if (step == 4) {
                lo = _mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(2, 0, 2, 0));
                hi = _mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(3, 1, 3, 1));
            } else if (step == 2) {
                lo = _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(a), _mm512_castps_pd(b)));
                hi = _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(a), _mm512_castps_pd(b)));
            } else {
                lo = _mm512_shuffle_ps(a, b, _MM_SHUFFLE(2, 0, 2, 0));
                hi = _mm512_shuffle_ps(a, b, _MM_SHUFFLE(3, 1, 3, 1));
            }
            v[j] = _mm512_add_ps(lo, hi);
        }
    }
    return v[0];  // lane order scrambled by the shuffles: fixed, undone by the caller's permute
}

// 16 elements of the pool at element offset `at` (the vector `index` of d elements, from element
// i), decoded to float32 exactly as load_vec decodes them, for every kind of pool: the float16
// and bfloat16 pools of the float16/bfloat16 models and the int8 pool took load_vec's scalar loop
// (and a dot product per position), several times the float32 path's time a position.
static inline __m512 load16(const void *pool, int kv_type, const uint16_t *scales, int64_t index, int64_t at) {
    switch (kv_type) {
        case KV_F32: return _mm512_loadu_ps((const float *)pool + at);
        case KV_F16: return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const uint16_t *)pool + at)));
        case KV_BF16:
            return _mm512_castsi512_ps(_mm512_slli_epi32(
                _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)((const uint16_t *)pool + at))), 16));
        default:  // int8 codes times the slot's float16 scale: one rounding, as load_vec's
            return _mm512_mul_ps(
                _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)((const int8_t *)pool + at)))),
                _mm512_set1_ps(h2f(scales[index])));
    }
}
#endif

// The lane order hsum16 leaves its 16 sums in (found once, by summing vectors that name themselves).
#ifdef ATT_AVX512
static int hsum_order[16];
#endif
static int hsum_order_ready = 0;

#ifdef ATT_AVX512
// 16 positions' scores from their 16 partial-sum vectors: summed, put in position order, scaled.
static inline __attribute__((always_inline)) void store_scores(__m512 part[16], float scale, float *dst) {
    const __m512 sums = _mm512_permutexvar_ps(_mm512_loadu_si512((const void *)hsum_order), hsum16(part));
    _mm512_storeu_ps(dst, _mm512_mul_ps(sums, _mm512_set1_ps(scale)));
}
#endif

#ifdef ATT_AVX512
// NH heads' outputs (out, out + d) from their probabilities (weights, weights + n) over the values
// at slots[0..n), each chunk a register accumulator summed in position order; a value's chunk is
// loaded (a float16 one converted) once for the NH heads.
static inline __attribute__((always_inline)) void weigh_values(const int NH, const int d, const float *weights,
                                                               int64_t n, const int64_t *slots, const void *v_pool,
                                                               const int kv_type, const uint16_t *v_scales,
                                                               float *out) {
    const int per = d / 16;
    __m512 acc[2][16];
    for (int k = 0; k < NH; k++)
        for (int i = 0; i < per; i++) acc[k][i] = _mm512_setzero_ps();
    for (int64_t t = 0; t < n; t++) {
        __m512 w[2];
        for (int k = 0; k < NH; k++) w[k] = _mm512_set1_ps(weights[k * n + t]);
        const int64_t index = slots[t];
        for (int i = 0; i < per; i++) {
            const __m512 val = load16(v_pool, kv_type, v_scales, index, index * d + 16 * i);
            for (int k = 0; k < NH; k++) acc[k][i] = _mm512_fmadd_ps(w[k], val, acc[k][i]);
        }
    }
    for (int k = 0; k < NH; k++)
        for (int i = 0; i < per; i++) _mm512_storeu_ps(out + k * d + 16 * i, acc[k][i]);
}
#endif

// One (row, KV head): the G query heads that share it. scratch: n int64 (each position's vector in
// the pool), G * n floats (scores), 16 * d floats, G * 256 floats (grouped heads' partial sums).
// (inlined once per kind of pool and common head width, kv_type and d constants in each:
// attend_one dispatches)
static inline __attribute__((always_inline)) void attend_typed(
    const float *q, int g, const int d, const void *k_pool, const void *v_pool, const int kv_type,
    const uint16_t *k_scales, const uint16_t *v_scales, int64_t block_size, int kv_heads, int kvh,
    const int32_t *table, int64_t start, int64_t stop, float scale, float softcap, const float *sinks, float *out,
    float *probs, int64_t probs_head_stride, float *scratch) {
    const int64_t n = stop - start;
    int64_t *slots = (int64_t *)scratch;
    float *scores = scratch + 2 * n, *vec = scores + (int64_t)g * n, *parts = vec + 16 * d;  // parts: g * 256
    // Each position's vector in the pool (KV head kvh), found once for the scores and the values
    // by walking the block table: a division by the block size per position and loop (and per
    // head for the float32 pool) cost more than the products of a short row.
    for (int64_t j = 0, block = start / block_size, slot = start % block_size; j < n; j++) {
        slots[j] = ((int64_t)table[block] * kv_heads + kvh) * block_size + slot;
        if (++slot == block_size) slot = 0, block++;
    }
    // scores, position by position (16 at a time where the pool is float32 and d a multiple of 16)
    int64_t j = 0;
#ifdef ATT_AVX512
    if (kv_type == KV_F32 && d % 16 == 0 && d <= 256) {  // (the float32 pool's loop as it was measured)
        const float *kp = (const float *)k_pool;
        for (; j + 16 <= n; j += 16) {
            for (int h = 0; h < g; h++) {
                __m512 part[16];
                for (int t = 0; t < 16; t++) {
                    const float *key = kp + slots[j + t] * d;
                    __m512 acc = _mm512_mul_ps(_mm512_loadu_ps(q + h * d), _mm512_loadu_ps(key));
                    for (int i = 16; i < d; i += 16)
                        acc = _mm512_fmadd_ps(_mm512_loadu_ps(q + h * d + i), _mm512_loadu_ps(key + i), acc);
                    part[t] = acc;
                }
                store_scores(part, scale, scores + h * n + j);
            }
        }
    } else if (d % 16 == 0 && d <= 256 && g > 1) {
        // Heads sharing a KV head: each key is decoded once for all g of them (decoded per head,
        // the conversions bound the loop). A head's 16 partial sums wait in `parts` for its hsum16:
        // every score is the same chain of products and the same sum as below, so the same bits.
        const int per = d / 16;
        for (; j + 16 <= n; j += 16) {
            const int64_t *index = slots + j;
            for (int t = 0; t < 16; t++) {
                const int64_t at = index[t] * d;
                __m512 key[16];
                for (int i = 0; i < per; i++) key[i] = load16(k_pool, kv_type, k_scales, index[t], at + 16 * i);
                for (int h = 0; h < g; h++) {
                    __m512 acc = _mm512_mul_ps(_mm512_loadu_ps(q + h * d), key[0]);
                    for (int i = 1; i < per; i++) acc = _mm512_fmadd_ps(_mm512_loadu_ps(q + h * d + 16 * i), key[i], acc);
                    _mm512_storeu_ps(parts + (h * 16 + t) * 16, acc);
                }
            }
            for (int h = 0; h < g; h++) {
                __m512 part[16];
                for (int t = 0; t < 16; t++) part[t] = _mm512_loadu_ps(parts + (h * 16 + t) * 16);
                store_scores(part, scale, scores + h * n + j);
            }
        }
    } else if (d % 16 == 0 && d <= 256) {
        for (; j + 16 <= n; j += 16) {
            const int64_t *index = slots + j;  // the 16 positions' vectors in the pool
            for (int h = 0; h < g; h++) {
                __m512 part[16];
                for (int t = 0; t < 16; t++) {
                    const int64_t at = index[t] * d;
                    __m512 acc = _mm512_mul_ps(_mm512_loadu_ps(q + h * d), load16(k_pool, kv_type, k_scales, index[t], at));
                    for (int i = 16; i < d; i += 16)
                        acc = _mm512_fmadd_ps(_mm512_loadu_ps(q + h * d + i),
                                              load16(k_pool, kv_type, k_scales, index[t], at + i), acc);
                    part[t] = acc;
                }
                store_scores(part, scale, scores + h * n + j);
            }
        }
    }
    // The last n % 16 positions, one at a time, with the same bits as the portable loop below (the
    // key decoded exactly, dot's FMA chain over 16-lane chunks and its reduce_add): load_vec's
    // scalar float16 decode here took a third of a prompt's attention (every row of a 128-token
    // prompt has ~7.5 such positions a head; 128 rows x 32 heads 3.3-3.5 -> 2.2 ms a layer with the
    // slots below) and ~0.5 ms of a 1.7B decode step (0.28-0.29 -> 0.26 ms a layer).
    if (d % 16 == 0 && d <= 256) {
        const int per = d / 16;
        for (; j < n; j++) {
            const int64_t index = slots[j];
            __m512 key[16];
            for (int i = 0; i < per; i++) key[i] = load16(k_pool, kv_type, k_scales, index, index * d + 16 * i);
            for (int h = 0; h < g; h++) {
                __m512 acc = _mm512_setzero_ps();
                for (int i = 0; i < per; i++) acc = _mm512_fmadd_ps(_mm512_loadu_ps(q + h * d + 16 * i), key[i], acc);
                scores[h * n + j] = _mm512_reduce_add_ps(acc) * scale;
            }
        }
    }
#endif
    for (; j < n; j++) {
        const int64_t index = slots[j];
        load_vec(k_pool, kv_type, k_scales, index, d, vec);
        for (int h = 0; h < g; h++) scores[h * n + j] = dot(q + h * d, vec, d) * scale;
    }
    for (int h = 0; h < g; h++) {
        float *sh = scores + h * n;
        if (softcap > 0.0f)
            for (int64_t t = 0; t < n; t++) sh[t] = tanhf(sh[t] / softcap) * softcap;
        float peak = sinks ? sinks[h] : -INFINITY;
        int64_t from = 0;
#ifdef ATT_AVX512
        // 16 lanes at a time (a maximum is exact in any order): the scalar loop's chain of
        // compares took ~10% of a long row's attention
        __m512 pv = _mm512_set1_ps(peak);
        for (; from + 16 <= n; from += 16) pv = _mm512_max_ps(pv, _mm512_loadu_ps(sh + from));
        peak = _mm512_reduce_max_ps(pv);
#endif
        for (int64_t t = from; t < n; t++) peak = sh[t] > peak ? sh[t] : peak;
        float total = 0.0f;
        int64_t t = 0;
#ifdef ATT_AVX512
        __m512 tv = _mm512_setzero_ps();
        for (; t + 16 <= n; t += 16) {
            const __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(sh + t), _mm512_set1_ps(peak)));
            _mm512_storeu_ps(sh + t, e);
            tv = _mm512_add_ps(tv, e);
        }
        total = _mm512_reduce_add_ps(tv);
        if (t < n) {
            const __mmask16 m = (__mmask16)((1u << (n - t)) - 1);
            const __m512 e = exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, sh + t), _mm512_set1_ps(peak)));
            _mm512_mask_storeu_ps(sh + t, m, e);
            total += _mm512_reduce_add_ps(_mm512_maskz_mov_ps(m, e));
        }
        if (sinks) {
            float sink_e[16];
            _mm512_storeu_ps(sink_e, exp16(_mm512_set1_ps(sinks[h] - peak)));
            total += sink_e[0];
        }
#else
        for (; t < n; t++) {
            sh[t] = expf(sh[t] - peak);
            total += sh[t];
        }
        if (sinks) total += expf(sinks[h] - peak);
#endif
        const float inv = 1.0f / total;
        for (t = 0; t < n; t++) sh[t] *= inv;  // probabilities
        if (probs) memcpy(probs + h * probs_head_stride, sh, (size_t)n * 4);
    }
    // values weighted, position by position, into register accumulators, one or two heads a pass:
    // their chunks stay in registers (with all G heads' at once, their index a variable, GCC kept
    // them on the stack). Each accumulator sums in position order, as the loop below does. Two
    // heads a pass: a 64-wide head alone is 4 chains of dependent FMAs (Llama-3-8B's GQA shape, 5
    // rows: 0.91-0.92x the attention's time; SmolLM2-135M's 0.96x).
#ifdef ATT_AVX512
    if (d % 16 == 0 && d <= 256) {
        int h = 0;
        if (d <= 128)  // two heads a pass where their chunks fit: twice the independent FMA chains
            for (; h + 2 <= g; h += 2) weigh_values(2, d, scores + h * n, n, slots, v_pool, kv_type, v_scales, out + h * d);
        for (; h < g; h++) weigh_values(1, d, scores + h * n, n, slots, v_pool, kv_type, v_scales, out + h * d);
        return;
    }
#endif
    for (int h = 0; h < g; h++) memset(out + h * d, 0, (size_t)d * 4);
    for (int64_t t = 0; t < n; t++) {
        const int64_t index = slots[t];
        load_vec(v_pool, kv_type, v_scales, index, d, vec);
        for (int h = 0; h < g; h++) axpy(scores[h * n + t], vec, out + h * d, d);
    }
}

// A head width the compiler knows unrolls the loops over its 16-float chunks: with d a variable,
// GCC kept the 16 keys' partial sums of hsum16 and a value's chunks in arrays on the stack, a
// store and a load for each (the same operations in the same order either way: the same bits).
static void attend_one(const float *q, int g, int d, const void *k_pool, const void *v_pool, int kv_type,
                       const uint16_t *k_scales, const uint16_t *v_scales, int64_t block_size, int kv_heads,
                       int kvh, const int32_t *table, int64_t start, int64_t stop, float scale, float softcap,
                       const float *sinks, float *out, float *probs, int64_t probs_head_stride,
                       float *scratch) {
#define ATT_CALL(KIND, D)                                                                                \
    attend_typed(q, g, D, k_pool, v_pool, KIND, k_scales, v_scales, block_size, kv_heads, kvh, table, start, \
                 stop, scale, softcap, sinks, out, probs, probs_head_stride, scratch);                   \
    return;
#define ATT_CASE(KIND)                  \
    case KIND:                          \
        if (d == 64) { ATT_CALL(KIND, 64) } \
        if (d == 128) { ATT_CALL(KIND, 128) } \
        ATT_CALL(KIND, d)
    switch (kv_type) {
        ATT_CASE(KV_F32)
        ATT_CASE(KV_F16)
        ATT_CASE(KV_BF16)
        ATT_CASE(KV_I8)
    }
#undef ATT_CASE
#undef ATT_CALL
}

static void find_hsum_order(void) {
#ifdef ATT_AVX512
    __m512 probe[16];
    for (int j = 0; j < 16; j++) {  // vector j sums to j: where its sum lands names its lane
        float lanes[16] = {0};
        lanes[0] = (float)j;
        probe[j] = _mm512_loadu_ps(lanes);
    }
    float got[16];
    _mm512_storeu_ps(got, hsum16(probe));
    for (int lane = 0; lane < 16; lane++) hsum_order[(int)got[lane]] = lane;
#endif
    hsum_order_ready = 1;
}

// Rows 0..nrows of q [nrows, heads, d] (row stride q_stride floats) into out (same layout, stride
// out_stride). Row r reads its block table at tables + table_start[r] and attends positions
// [start[r], stop[r]). sinks: [heads] or NULL; softcap <= 0: none. probs: NULL or
// [nrows, heads, probs_width] (probs_width >= every row's stop - start), zero past a row's end.
// Returns 0, or -1 for a row with no position or a bad argument.
KVK_API int kvk_paged_attention(const float *q, int64_t q_stride, int64_t nrows, int heads, int d,
                                const void *k_pool, const void *v_pool, int kv_type, const uint16_t *k_scales,
                                const uint16_t *v_scales, int64_t block_size, int kv_heads,
                                const int32_t *tables, const int64_t *table_start, const int64_t *start,
                                const int64_t *stop, float scale, float softcap, const float *sinks,
                                float *out, int64_t out_stride, float *probs, int64_t probs_width) {
    if (heads % kv_heads || d <= 0 || nrows < 0) return -1;
    if (!hsum_order_ready) find_hsum_order();
    const int g = heads / kv_heads;
    int64_t longest = 0, work = 0;
    for (int64_t r = 0; r < nrows; r++) {
        const int64_t n = stop[r] - start[r];
        if (n <= 0 || start[r] < 0 || (probs && n > probs_width)) return -1;
        longest = n > longest ? n : longest;
        work += n;
    }
    if (probs) memset(probs, 0, (size_t)(nrows * heads * probs_width) * 4);
    const int64_t tasks = nrows * kv_heads;
    const int par = work * heads * d >= 65536;
#pragma omp parallel if (par)
    {
        float *scratch = (float *)malloc((size_t)((int64_t)(g + 2) * longest + 16 * d + 256 * g) * sizeof(float));
#pragma omp for schedule(static)
        for (int64_t task = 0; task < tasks; task++) {
            // KV head by KV head, each over every row: a thread's consecutive tasks read one head's
            // keys and values, which the rows of one sequence (a speculative round's, a prompt
            // chunk's) share, so they come from its cache after the first row, not from memory
            // again (when this order came in, a 1.7B verify step's attention went 10.3 -> 6.0 ms;
            // with attend_one's sums kept in registers since, it takes ~2.3). Each task is computed
            // alone: the same bits in any order.
            const int64_t r = task % nrows;
            const int kvh = (int)(task / nrows);
            attend_one(q + r * q_stride + (int64_t)kvh * g * d, g, d, k_pool, v_pool, kv_type, k_scales, v_scales,
                       block_size, kv_heads, kvh, tables + table_start[r], start[r], stop[r], scale, softcap,
                       sinks ? sinks + kvh * g : NULL, out + r * out_stride + (int64_t)kvh * g * d,
                       probs ? probs + (r * heads + (int64_t)kvh * g) * probs_width : NULL, probs_width, scratch);
        }
        free(scratch);
    }
    return 0;
}
