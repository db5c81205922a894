// Q4_0, Q4_1, Q4_K and Q6_K weights repacked at load into panels of 16 rows, each output in its
// own vector lane.
//
// kvk.c reads a row as the file stores it: a 512-bit vector holds 32 inputs of one row, so every
// output ends as 16 lanes summed, and a group's scales go on per lane (3 operations to 8 products).
// A prompt's tile of that layout ran a 1.7B Q4_0 at 220-290 GMAC/s on 2 Zen 5 cores and its
// prefill at 0.83x llama.cpp's. Here 16 rows sit side by side: vector lane j is output j, a
// vpdpwssd multiplies one pair of inputs, broadcast from the activation row, by that pair of each
// of the 16 rows, a block's 16 products sum in the lane without any reduction, and a block's 16
// float16 scales are one vector. Measured against kvk.c's row kernels, Q4_0 at 1.7B shapes (kvk
// matmul alone, one process, interleaved): 128 rows 1.23-1.62x faster (337-354 GMAC/s), 5 rows 1.6-
// 2.3x, 1 row 1.2-1.4x (weights in cache); Q4_K 1.0-1.2x, 1.5-2.0x, 1.3-1.5x; Q6_K 1.0-1.4x,
// 1.5-2.2x, 1.15-1.2x. llama.cpp repacks Q4_0 the same way ("Q4_0x8").
//
// A panel holds, per unit of inputs (a block of 32; a K-quant's super-block of 256), the 16 rows'
// scales as vectors, then each 32 inputs' codes as 4 vectors of 32 16-bit words in which word
// 2j + s of vector v holds row j's codes q[2(v + 4m) + s] in nibble m (m < 4): a mask and a shift
// take out the 16-bit lanes vpdpwssd reads (weights of inputs 2p, 2p + 1 for pair p = v + 4m).
//   Q4_0  16 float16 d, then the codes: 16 x 18 bytes, the file's
//   Q4_1  16 float16 d, 16 float16 m, then the codes: 16 x 20 bytes, the file's
//   Q4_K  16 float16 d, 16 float16 dmin, the 8 sub-blocks' 6-bit scales and minimums as bytes
//         [8][16] each, then 8 sub-blocks' codes: 16 x 148 bytes, 4 more a row than the file's
//         12 bytes of packed scales (2.8%). Kept packed ([12][16], unpacked for 16 rows at once
//         with byte-vector operations), a decode row streamed a 1.7B-shaped layer at 25-38 GB/s
//         against 47-49 unpacked (2 threads, weights 10x the L3 cache).
//   Q6_K  16 float16 d, the 16 sub-blocks' int8 scales [16][16], then per 32 inputs the codes'
//         low 4 bits as above and their high 2 bits as 2 vectors of 32 words (word 2j + s of
//         vector h holds the 2-bit fields of pairs v + 4m, v = 2h, 2h + 1, in field 4(v - 2h) +
//         m): 16 x 210 bytes, the file's
// Rows past n (the last panel's) are zeros.
//
// Activations: one 16-bit plane in input order, a scale dx per 256 inputs (kvk.c's rounding:
// the same codes), and per block of 32 the integer s = sum(xq). A block's products sum exactly in
// int32 (at most 32 x 15 x 32767): Q4_0's lanes start at -8 * s, so that they sum (q - 8) * xq.
// Per output and group of 256 inputs the float operations are, whatever the number of rows in the
// call (so a row's outputs are the same bits alone and among others):
//   Q4_0, Q4_1  p = sum(b0) * d(b0), then p = fma(sum(b), d(b), p) for each further block (Q4_1:
//               each followed by p = fma(m(b), s(b), p)), then acc = fma(p, dx, acc)
//   Q4_K        p = fma(sum(j), sc(j), p) and q = fma(m(j), s(j), q) over its sub-blocks j (the
//               first a product), then acc = fma(p, d * dx, acc), acc = fnmadd(q, dmin * dx, acc)
//   Q6_K        p = fma(sum(j), sc(j), p) over its 16 sub-blocks of 16 (the codes centred, q - 32,
//               in the lanes: no b term), then acc = fma(p, d * dx, acc)

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512VNNI__)
#include <immintrin.h>
#define PANELS_AVX512 1
#endif

#define KVK_API __attribute__((visibility("default")))
#define T_Q4_0 2
#define T_Q4_1 3
#define T_Q4_K 12
#define T_Q6_K 14
#define PANEL_ROWS 16
#define TILE_ROWS 8  // activation rows a panel's pass takes at once (registers: 3-4 vectors a row)
#ifndef Q6K_TILE_ROWS
#define Q6K_TILE_ROWS 5  // Q6_K's: 4 vectors a row and its codes' unpacking
#endif

int64_t kvk_row_block_budget(void);  // kvk.c: the bytes of activation rows that stay in L2
void kvk_scale_min_k4(const uint8_t *s, uint8_t *sc, uint8_t *mn);  // kvk.c: Q4_K's 6-bit fields
int kvk_block_code(int t, const uint8_t *b, int e);                 // kvk.c: code e of a block

// Whether this build multiplies panels of type t (the AVX-512 VNNI build, Q4_0, Q4_1, Q4_K, Q6_K).
static int panel_type(int t) {
#ifdef PANELS_AVX512
    return t == T_Q4_0 || t == T_Q4_1 || t == T_Q4_K || t == T_Q6_K;
#else
    (void)t;
    return 0;
#endif
}

// Inputs per unit (a file block of 32, Q4_K's super-block), a file block's bytes, a panel unit's
// bytes and where its codes start.
static inline int unit_inputs(int t) { return t == T_Q4_K || t == T_Q6_K ? 256 : 32; }
static inline int file_block(int t) { return t == T_Q6_K ? 210 : t == T_Q4_K ? 144 : t == T_Q4_1 ? 20 : 18; }
static inline int codes_at(int t) { return t == T_Q6_K ? 288 : t == T_Q4_K ? 320 : t == T_Q4_1 ? 64 : 32; }
static inline int block_codes(int t) { return t == T_Q6_K ? 384 : 256; }  // a 32-input block's code bytes
static inline int panel_unit(int t) { return codes_at(t) + unit_inputs(t) / 32 * block_codes(t); }

KVK_API int64_t kvk_panel_bytes(int t, int64_t n, int64_t k) {
    if (!panel_type(t) || k <= 0 || k % unit_inputs(t) || n < 0) return -1;
    return (n + PANEL_ROWS - 1) / PANEL_ROWS * (k / unit_inputs(t)) * panel_unit(t);
}

// 16 rows' 32 codes each as the panel's 4 vectors of words (see above).
static void pack_codes(const uint8_t q[PANEL_ROWS][32], uint8_t *dst) {
    uint16_t words[128];
    for (int j = 0; j < PANEL_ROWS; j++)
        for (int v = 0; v < 4; v++)
            for (int s = 0; s < 2; s++) {
                uint16_t w = 0;
                for (int m = 0; m < 4; m++) w |= (uint16_t)(q[j][2 * (v + 4 * m) + s] << (4 * m));
                words[32 * v + 2 * j + s] = w;
            }
    memcpy(dst, words, sizeof words);
}

// Q6_K's high 2 bits of 16 rows' 32 codes as 2 vectors of words (see above).
static void pack_high(const uint8_t q[PANEL_ROWS][32], uint8_t *dst) {
    uint16_t words[64];
    for (int j = 0; j < PANEL_ROWS; j++)
        for (int h = 0; h < 2; h++)
            for (int s = 0; s < 2; s++) {
                uint16_t w = 0;
                for (int f = 0; f < 8; f++) {
                    const int v = 2 * h + f / 4, m = f % 4;
                    w |= (uint16_t)((q[j][2 * (v + 4 * m) + s] >> 4) << (2 * f));
                }
                words[32 * h + 2 * j + s] = w;
            }
    memcpy(dst, words, sizeof words);
}

// Code e of row j of a panel's 32-input codes (pack_codes, and Q6_K's pack_high, read back).
static inline int code_at(int t, const uint8_t *codes, int j, int e) {
    uint16_t w, hw;
    const int pair = e / 2, v = pair % 4, m = pair / 4;
    memcpy(&w, codes + 2 * (32 * v + 2 * j + e % 2), 2);
    const int low = (w >> (4 * m)) & 15;
    if (t != T_Q6_K) return low;
    memcpy(&hw, codes + 256 + 2 * (32 * (v / 2) + 2 * j + e % 2), 2);
    return low | (((hw >> (2 * (4 * (v % 2) + m))) & 3) << 4);
}

// One unit of 16 rows (rows past n: zeros) from the file's blocks into the panel's layout.
static void repack_unit(int t, const uint8_t *const *rowp, int64_t n, int64_t p, int64_t b, uint8_t *o) {
    memset(o, 0, (size_t)codes_at(t));
    uint8_t q[8][PANEL_ROWS][32];  // [sub-block][row][code]
    memset(q, 0, sizeof q[0] * (size_t)(unit_inputs(t) / 32));
    for (int j = 0; j < PANEL_ROWS; j++) {
        const int64_t row = p * PANEL_ROWS + j;
        if (row >= n) continue;
        const uint8_t *blk = rowp[row] + b * file_block(t);
        memcpy(o + 2 * j, blk, 2);  // d
        if (t == T_Q4_0 || t == T_Q4_1) {
            if (t == T_Q4_1) memcpy(o + 32 + 2 * j, blk + 2, 2);  // m
            const uint8_t *qs = blk + (t == T_Q4_1 ? 4 : 2);
            for (int i = 0; i < 16; i++) q[0][j][i] = qs[i] & 15, q[0][j][i + 16] = qs[i] >> 4;
        } else if (t == T_Q6_K) {  // d at the block's end, the int8 scales, the 6-bit codes
            memcpy(o + 2 * j, blk + 208, 2);
            for (int sb = 0; sb < 16; sb++) o[32 + 16 * sb + j] = blk[192 + sb];
            for (int e = 0; e < 256; e++) q[e / 32][j][e % 32] = (uint8_t)kvk_block_code(T_Q6_K, blk, e);
        } else {  // Q4_K: dmin, the scales and minimums unpacked, sub-block 2c + h in nibble h of qs[32c..]
            memcpy(o + 32 + 2 * j, blk + 2, 2);
            uint8_t sc[8], mn[8];
            kvk_scale_min_k4(blk + 4, sc, mn);
            for (int sb = 0; sb < 8; sb++) o[64 + 16 * sb + j] = sc[sb], o[192 + 16 * sb + j] = mn[sb];
            for (int sb = 0; sb < 8; sb++)
                for (int i = 0; i < 32; i++) q[sb][j][i] = (blk[16 + 32 * (sb / 2) + i] >> (4 * (sb % 2))) & 15;
        }
    }
    for (int sb = 0; sb < unit_inputs(t) / 32; sb++) {
        uint8_t low[PANEL_ROWS][32];
        for (int j = 0; j < PANEL_ROWS; j++)
            for (int i = 0; i < 32; i++) low[j][i] = q[sb][j][i] & 15;
        pack_codes((const uint8_t(*)[32])low, o + codes_at(t) + block_codes(t) * sb);
        if (t == T_Q6_K) pack_high((const uint8_t(*)[32])q[sb], o + codes_at(t) + block_codes(t) * sb + 256);
    }
}

// rows rowp[0..n) (blocks as the file stores them, k inputs) into panels at out.
KVK_API int kvk_repack_panels(int t, const uint8_t *const *rowp, int64_t n, int64_t k, uint8_t *out) {
    if (kvk_panel_bytes(t, n, k) < 0) return -1;
    const int64_t nu = k / unit_inputs(t), np = (n + PANEL_ROWS - 1) / PANEL_ROWS;
#pragma omp parallel for schedule(static) if (n * k >= 65536)
    for (int64_t p = 0; p < np; p++)
        for (int64_t b = 0; b < nu; b++) repack_unit(t, rowp, n, p, b, out + (p * nu + b) * panel_unit(t));
    return 0;
}

// float16 bits -> float32, exactly (subnormals included).
static float half_to_float(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16, e = (h >> 10) & 0x1f, m = h & 0x3ff;
    float f;
    if (e == 0) {
        f = ldexpf((float)m, -24);
    } else {
        const uint32_t bits = e == 31 ? 0x7f800000u | (m << 13) : ((e + 112) << 23) | (m << 13);
        memcpy(&f, &bits, 4);
    }
    return sign ? -f : f;
}

// The panels' weights as float32 [n, k] as gguf computes them: d * (q - 8) (Q4_0), d * q + m
// (Q4_1), (d * sc) * q + -(dmin * m) (Q4_K) (tests: the panels hold the file's codes and scales).
KVK_API int kvk_panel_dequantize(int t, const uint8_t *panels, int64_t n, int64_t k, float *out) {
    if (kvk_panel_bytes(t, n, k) < 0) return -1;
    const int64_t nu = k / unit_inputs(t);
    for (int64_t row = 0; row < n; row++) {
        const int64_t p = row / PANEL_ROWS;
        const int j = (int)(row % PANEL_ROWS);
        for (int64_t b = 0; b < nu; b++) {
            const uint8_t *o = panels + (p * nu + b) * panel_unit(t);
            uint16_t hd, h2;
            memcpy(&hd, o + 2 * j, 2);
            memcpy(&h2, o + 32 + 2 * j, 2);
            const float d = half_to_float(hd), d2 = half_to_float(h2);
            float *w = out + row * k + b * unit_inputs(t);
            for (int e = 0; e < unit_inputs(t); e++) {
                const int sb = e / 32, q = code_at(t, o + codes_at(t) + block_codes(t) * sb, j, e % 32);
                if (t == T_Q4_0) w[e] = d * (float)(q - 8);
                else if (t == T_Q4_1) w[e] = d * (float)q + d2;
                else if (t == T_Q6_K) w[e] = (d * (float)(int8_t)o[32 + 16 * (e / 16) + j]) * (float)(q - 32);
                else w[e] = (d * (float)o[64 + 16 * sb + j]) * (float)q + -(d2 * (float)o[192 + 16 * sb + j]);
            }
        }
    }
    return 0;
}

#ifdef PANELS_AVX512
typedef struct {
    // row stride and the offsets of dx [groups], bs [blocks] and bs as floats [blocks] (exact: |bs|
    // < 2^24), which the kernels broadcast from memory where they scale by it
    int64_t k, stride, off_dx, off_bs, off_bsf;
} panel_act;

static panel_act act_layout(int64_t k) {
    panel_act l;
    l.k = k;
    l.off_dx = (k * 2 + 63) & ~(int64_t)63;
    l.off_bs = l.off_dx + (((k + 255) / 256 * 4 + 63) & ~(int64_t)63);
    l.off_bsf = l.off_bs + ((k / 32 * 4 + 63) & ~(int64_t)63);
    l.stride = l.off_bsf + ((k / 32 * 4 + 63) & ~(int64_t)63);
    return l;
}

// A row's codes as kvk.c's quantize_row rounds them: xq = round-to-even(x * (32767 / amax)).
static void quantize(const float *x, const panel_act *l, uint8_t *dst) {
    int16_t *xq = (int16_t *)dst;
    float *dx = (float *)(dst + l->off_dx);
    int32_t *bs = (int32_t *)(dst + l->off_bs);
    float *bsf = (float *)(dst + l->off_bsf);
    for (int64_t g = 0; g < (l->k + 255) / 256; g++) {
        const int64_t e0 = 256 * g, n = l->k - e0 < 256 ? l->k - e0 : 256;
        __m512 am = _mm512_setzero_ps();
        for (int64_t i = 0; i < n; i += 16) am = _mm512_max_ps(am, _mm512_abs_ps(_mm512_loadu_ps(x + e0 + i)));
        const float amax = _mm512_reduce_max_ps(am);
        dx[g] = amax / 32767.0f;
        const __m512 inv = _mm512_set1_ps(amax > 0.0f ? 32767.0f / amax : 0.0f);
        for (int64_t b = 0; b < n / 32; b++) {
            const float *xb = x + e0 + 32 * b;
            const __m512i q0 = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(xb), inv));
            const __m512i q1 = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(xb + 16), inv));
            _mm256_storeu_si256((__m256i *)(xq + e0 + 32 * b), _mm512_cvtsepi32_epi16(q0));
            _mm256_storeu_si256((__m256i *)(xq + e0 + 32 * b + 16), _mm512_cvtsepi32_epi16(q1));
            bs[e0 / 32 + b] = _mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1));
            bsf[e0 / 32 + b] = (float)bs[e0 / 32 + b];
        }
    }
}

// acc += w * pair: the activation pair a 32-bit broadcast from memory (the instruction's own).
static inline __attribute__((always_inline)) __m512i dp_pair(__m512i acc, __m512i w, const int16_t *pair) {
    __asm__("vpdpwssd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(w), "m"(*(const int32_t *)pair));
    return acc;
}

static inline int32_t block_sum(const uint8_t *A, const panel_act *l, int r, int64_t block) {
    return ((const int32_t *)(A + r * l->stride + l->off_bs))[block];
}

// The block sum as a float, broadcast from memory (one instruction: no conversion, no shuffle).
static inline __m512 block_sum_ps(const uint8_t *A, const panel_act *l, int r, int64_t block) {
    return _mm512_set1_ps(((const float *)(A + r * l->stride + l->off_bsf))[block]);
}

static inline float group_dx(const uint8_t *A, const panel_act *l, int r, int64_t group) {
    return ((const float *)(A + r * l->stride + l->off_dx))[group];
}

// acc += w * b, the pair already broadcast in a register (one broadcast for several panels).
static inline __attribute__((always_inline)) __m512i dp_reg(__m512i acc, __m512i w, __m512i b) {
    __asm__("vpdpwssd %2, %1, %0" : "+v"(acc) : "v"(w), "v"(b));
    return acc;
}

// A pass takes NP panels side by side (NP x 16 outputs). Each activation pair is broadcast once
// for all of them, into a register: alone, a panel's pass broadcasts every pair for every row
// from memory, one broadcast for each vpdpwssd. Each output's operations are the same, in the same
// order, whatever NP: the same bits. Two panels a pass pay where a prompt's rows reuse the panels
// in the cache: Q4_K at 64 rows 0.81x the time, 16 rows 0.89x (1.7B-shaped, streamed, 2 threads,
// panel_bench), a 1.7B Q4_K_M's prefill of 512 tokens 174 -> 205 tok/s. Fewer rows keep one panel
// a pass: they stream each panel once, and two panels read as two streams took 1.36x the time at 5
// rows (one stream, the pairs' units interleaved, took one row 1.07-1.18x). The other types keep
// one panel a pass too: Q4_0 and Q4_1 took 1.11-1.24x the time at 16-64 rows, Q6_K 1.01-1.07x.
#define MAX_NP 2
#define PAIR_MIN_ROWS 16
static inline int pair_panels(int t) { return t == T_Q4_K ? 2 : 1; }

// The products of inputs e0..e0+32 of R activation rows with NP panels' 32 codes at codes[p],
// added to sum[p][r] (int32: exact).
static inline __attribute__((always_inline)) void block_products(const int NP, const int R,
                                                                 const uint8_t *const *codes, const uint8_t *A,
                                                                 const panel_act *l, int64_t e0,
                                                                 __m512i sum[][TILE_ROWS]) {
    const __m512i m4 = _mm512_set1_epi16(15);
    for (int v = 0; v < 4; v++) {
        __m512i w[MAX_NP][4];
        for (int p = 0; p < NP; p++) {
            const __m512i words = _mm512_loadu_si512((const void *)(codes[p] + 64 * v));
            w[p][0] = _mm512_and_si512(words, m4);
            w[p][1] = _mm512_and_si512(_mm512_srli_epi16(words, 4), m4);
            w[p][2] = _mm512_and_si512(_mm512_srli_epi16(words, 8), m4);
            w[p][3] = _mm512_srli_epi16(words, 12);
        }
        for (int r = 0; r < R; r++) {
            const int16_t *x = (const int16_t *)(A + r * l->stride) + e0 + 2 * v;
            for (int m = 0; m < 4; m++) {
                if (NP == 1) {
                    sum[0][r] = dp_pair(sum[0][r], w[0][m], x + 8 * m);
                    continue;
                }
                const __m512i b = _mm512_set1_epi32(*(const int32_t *)(x + 8 * m));
                for (int p = 0; p < NP; p++) sum[p][r] = dp_reg(sum[p][r], w[p][m], b);
            }
        }
    }
}

// always_inline: as a plain static function GCC (12) found it free of side effects (it only
// prefetches), judged the calls dead and removed them, so the panels ran with no software prefetch
// at all, and a step of 5 rows waited on every panel's bytes: streamed from memory it ran at half
// its rate with the bytes in L3 (150 against 330 G products/s, 1.7B-shaped Q4_K, 2 threads).
static inline __attribute__((always_inline)) void prefetch_ahead(const uint8_t *p, int bytes) {
    for (int q = 0; q < bytes; q += 64) _mm_prefetch((const char *)(p + q), _MM_HINT_T0);
}

// How far ahead a panel's bytes are asked for: ~9 KiB in whole units of the type (Q4_0: 32
// blocks, Q4_1: 29, Q4_K: 4 super-blocks, Q6_K: 3). Measured on 1.7B-shaped panels, 2 threads,
// weights 15x the L3 cache, against one unit ahead (Q4_0: 4 blocks), interleaved: 5 rows
// 0.75-0.83x the time, 2 rows 0.64x (Q4_K), one row 0.79-1.04x (the machine's memory bandwidth
// moved between runs by more than that).
#define PREFETCH_BYTES 9216
static inline int prefetch_units(int unit_bytes) {
    const int units = (PREFETCH_BYTES + unit_bytes / 2) / unit_bytes;
    return units > 1 ? units : 1;
}

// Q4_0 and Q4_1: one panel (nu blocks at P) against R activation rows from A.
static inline __attribute__((always_inline)) void block_panel(const int t, const int R, const uint8_t *P, int64_t nu,
                                                              const uint8_t *A, const panel_act *l, __m512 *acc) {
    __m512 part[TILE_ROWS];
    for (int r = 0; r < R; r++) acc[r] = part[r] = _mm512_setzero_ps();
    const int bytes = panel_unit(t), ahead = prefetch_units(bytes) * bytes;
    for (int64_t b = 0; b < nu; b++) {
        const uint8_t *pb = P + b * bytes;
        prefetch_ahead(pb + ahead, bytes);
        __m512i sum[1][TILE_ROWS];
        for (int r = 0; r < R; r++)
            sum[0][r] = t == T_Q4_0 ? _mm512_set1_epi32(-8 * block_sum(A, l, r, b)) : _mm512_setzero_si512();
        const uint8_t *codes = pb + codes_at(t);
        block_products(1, R, &codes, A, l, 32 * b, sum);
        const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)pb));
        for (int r = 0; r < R; r++)
            part[r] = (b & 7) ? _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum[0][r]), d, part[r])
                              : _mm512_mul_ps(_mm512_cvtepi32_ps(sum[0][r]), d);
        if (t == T_Q4_1) {
            const __m512 m = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(pb + 32)));
            for (int r = 0; r < R; r++)
                part[r] = _mm512_fmadd_ps(m, block_sum_ps(A, l, r, b), part[r]);
        }
        if ((b & 7) == 7 || b == nu - 1)
            for (int r = 0; r < R; r++)
                acc[r] = _mm512_fmadd_ps(part[r], _mm512_set1_ps(group_dx(A, l, r, b / 8)), acc[r]);
    }
}

// 16 bytes (a sub-block's scales or minimums of 16 rows) as floats.
static inline __m512 bytes_as_floats(const uint8_t *b) {
    return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)b)));
}

// Q4_K: NP panels (nu super-blocks each, at P[p]) against R activation rows from A.
static inline __attribute__((always_inline)) void q4k_panel(const int NP, const int R, const uint8_t *const *P,
                                                            int64_t nu, const uint8_t *A, const panel_act *l,
                                                            __m512 acc[][TILE_ROWS]) {
    const int bytes = panel_unit(T_Q4_K), ahead = prefetch_units(bytes) * bytes;
    for (int p = 0; p < NP; p++)
        for (int r = 0; r < R; r++) acc[p][r] = _mm512_setzero_ps();
    for (int64_t u = 0; u < nu; u++) {
        const uint8_t *pu[MAX_NP];
        for (int p = 0; p < NP; p++) pu[p] = P[p] + u * bytes;
        __m512 part[MAX_NP][TILE_ROWS];
        for (int sb = 0; sb < 8; sb++) {
            const uint8_t *codes[MAX_NP];
            for (int p = 0; p < NP; p++) {
                prefetch_ahead(pu[p] + ahead + (sb == 0 ? 0 : codes_at(T_Q4_K) + 256 * sb), sb == 0 ? 576 : 256);
                codes[p] = pu[p] + codes_at(T_Q4_K) + 256 * sb;
            }
            __m512i sum[MAX_NP][TILE_ROWS];
            for (int p = 0; p < NP; p++)
                for (int r = 0; r < R; r++) sum[p][r] = _mm512_setzero_si512();
            block_products(NP, R, codes, A, l, 256 * u + 32 * sb, sum);
            for (int p = 0; p < NP; p++) {
                const __m512 sc = bytes_as_floats(pu[p] + 64 + 16 * sb);
                for (int r = 0; r < R; r++)
                    part[p][r] = sb ? _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum[p][r]), sc, part[p][r])
                                    : _mm512_mul_ps(_mm512_cvtepi32_ps(sum[p][r]), sc);
            }
        }
        for (int p = 0; p < NP; p++) {
            const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)pu[p]));
            const __m512 dmin = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(pu[p] + 32)));
            __m512 mn[8];
            for (int sb = 0; sb < 8; sb++) mn[sb] = bytes_as_floats(pu[p] + 192 + 16 * sb);
            for (int r = 0; r < R; r++) {
                __m512 mins = _mm512_setzero_ps();  // sum over sub-blocks of m * s
                for (int sb = 0; sb < 8; sb++) {
                    const __m512 s = block_sum_ps(A, l, r, 8 * u + sb);
                    mins = sb ? _mm512_fmadd_ps(mn[sb], s, mins) : _mm512_mul_ps(mn[sb], s);
                }
                const __m512 dx = _mm512_set1_ps(group_dx(A, l, r, u));
                acc[p][r] = _mm512_fmadd_ps(part[p][r], _mm512_mul_ps(d, dx), acc[p][r]);
                acc[p][r] = _mm512_fnmadd_ps(mins, _mm512_mul_ps(dmin, dx), acc[p][r]);
            }
        }
    }
}

// Q6_K: one panel (nu super-blocks at P) against R activation rows from A. A 32-input block's
// pairs v + 4m (m = 0, 1: its first 16 inputs, m = 2, 3: the next 16) sum into two int32 chains
// a row, one per sub-block of 16 (at most 16 x 32 x 32767: exact as floats).
static inline __attribute__((always_inline)) void q6k_panel(const int R, const uint8_t *P, int64_t nu, const uint8_t *A,
                                                            const panel_act *l, __m512 *acc) {
    const int bytes = panel_unit(T_Q6_K), ahead = prefetch_units(bytes) * bytes;
    const __m512i m4 = _mm512_set1_epi16(15), m30 = _mm512_set1_epi16(0x30), mid = _mm512_set1_epi16(32);
    for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t u = 0; u < nu; u++) {
        const uint8_t *pu = P + u * bytes;
        __m512 part[TILE_ROWS];
        for (int r = 0; r < R; r++) part[r] = _mm512_setzero_ps();  // (each first block overwrites it)
        for (int b = 0; b < 8; b++) {
            const uint8_t *codes = pu + codes_at(T_Q6_K) + block_codes(T_Q6_K) * b;
            prefetch_ahead(codes + ahead, block_codes(T_Q6_K));
            __m512i first[TILE_ROWS], second[TILE_ROWS];
            for (int r = 0; r < R; r++) first[r] = second[r] = _mm512_setzero_si512();
            for (int v = 0; v < 4; v++) {
                const __m512i words = _mm512_loadu_si512((const void *)(codes + 64 * v));
                const __m512i high = _mm512_loadu_si512((const void *)(codes + 256 + 64 * (v / 2)));
                __m512i w[4];
                for (int m = 0; m < 4; m++) {
                    const int f = 2 * (4 * (v % 2) + m);  // the 2-bit field, to bits 4-5
                    const __m512i hi = f >= 4 ? _mm512_srli_epi16(high, f - 4) : _mm512_slli_epi16(high, 4 - f);
                    const __m512i lo = m == 3 ? _mm512_srli_epi16(words, 12)
                                              : _mm512_and_si512(_mm512_srli_epi16(words, 4 * m), m4);
                    w[m] = _mm512_sub_epi16(_mm512_or_si512(lo, _mm512_and_si512(hi, m30)), mid);
                }
                for (int r = 0; r < R; r++) {
                    const int16_t *x = (const int16_t *)(A + r * l->stride) + 256 * u + 32 * b + 2 * v;
                    first[r] = dp_pair(first[r], w[0], x);
                    first[r] = dp_pair(first[r], w[1], x + 8);
                    second[r] = dp_pair(second[r], w[2], x + 16);
                    second[r] = dp_pair(second[r], w[3], x + 24);
                }
            }
            const __m512 sc0 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(pu + 32 + 32 * b))));
            const __m512 sc1 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(pu + 48 + 32 * b))));
            for (int r = 0; r < R; r++) {
                part[r] = b ? _mm512_fmadd_ps(_mm512_cvtepi32_ps(first[r]), sc0, part[r])
                            : _mm512_mul_ps(_mm512_cvtepi32_ps(first[r]), sc0);
                part[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(second[r]), sc1, part[r]);
            }
        }
        const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)pu));
        for (int r = 0; r < R; r++)
            acc[r] = _mm512_fmadd_ps(part[r], _mm512_mul_ps(d, _mm512_set1_ps(group_dx(A, l, r, u))), acc[r]);
    }
}

// NP panels (the first at P, each `panel` bytes after the one before; NP = 2: Q4_K only) against
// R (<= TILE_ROWS) activation rows: panel p's outputs y[r * ys + 16 p + 0..16), the last panel's
// first `nout`.
static inline __attribute__((always_inline)) void panel_rows(const int t, const int NP, const int R, const uint8_t *P,
                                                             int64_t panel, int64_t nu, const uint8_t *A,
                                                             const panel_act *l, float *y, int64_t ys, int nout) {
    __m512 acc[MAX_NP][TILE_ROWS];
    const uint8_t *panels[MAX_NP] = {P, P + panel};
    if (t == T_Q4_K) q4k_panel(NP, R, panels, nu, A, l, acc);
    else if (t == T_Q6_K) q6k_panel(R, P, nu, A, l, acc[0]);
    else block_panel(t, R, P, nu, A, l, acc[0]);
    for (int p = 0; p < NP; p++) {
        const int count = p == NP - 1 ? nout : PANEL_ROWS;
        const __mmask16 keep = count >= PANEL_ROWS ? (__mmask16)0xffff : (__mmask16)((1u << count) - 1);
        for (int r = 0; r < R; r++) _mm512_mask_storeu_ps(y + r * ys + PANEL_ROWS * p, keep, acc[p][r]);
    }
}

// R rows of NP panels: a constant type, NP and R per instance (two panels: pair_panels's Q4_K).
static void panel_some_rows(int t, int NP, int R, const uint8_t *P, int64_t panel, int64_t nu, const uint8_t *A,
                            const panel_act *l, float *y, int64_t ys, int nout) {
    switch (R + 8 * (t == T_Q4_1) + 16 * (t == T_Q4_K) + 24 * (t == T_Q6_K) + 32 * (NP == 2)) {
#define PANEL_CASE(N) \
    case N: panel_rows(T_Q4_0, 1, N, P, panel, nu, A, l, y, ys, nout); break; \
    case N + 8: panel_rows(T_Q4_1, 1, N, P, panel, nu, A, l, y, ys, nout); break; \
    case N + 16: panel_rows(T_Q4_K, 1, N, P, panel, nu, A, l, y, ys, nout); break; \
    case N + 24: panel_rows(T_Q6_K, 1, N, P, panel, nu, A, l, y, ys, nout); break; \
    case N + 48: panel_rows(T_Q4_K, 2, N, P, panel, nu, A, l, y, ys, nout); break;
        PANEL_CASE(1) PANEL_CASE(2) PANEL_CASE(3) PANEL_CASE(4)
        PANEL_CASE(5) PANEL_CASE(6) PANEL_CASE(7) PANEL_CASE(8)
#undef PANEL_CASE
    }
}

// Each calling thread's activation codes (kvk.c's act_scratch does the same): the engine's thread
// and a measuring worker may multiply at once.
static _Thread_local uint8_t *scratch;
static _Thread_local int64_t scratch_cap;
#endif

// y[r * ys + i] = sum_k W[i, k] x[r * xs + k] for the n rows held in panels (kvk_repack_panels).
// Threads take whole panels; a prompt's rows go in blocks that stay in L2 (kvk.c's budget), each
// block's rows TILE_ROWS at a time past every panel of the thread (Q4_K's prompt rows past two
// panels at a time, see MAX_NP).
KVK_API int kvk_matmul_panels(int t, const uint8_t *panels, int64_t n, int64_t k, const float *x, int64_t xs,
                              int64_t nr, float *y, int64_t ys) {
    if (kvk_panel_bytes(t, n, k) < 0 || nr < 0) return -1;
#ifdef PANELS_AVX512
    if (nr == 0 || n == 0) return 0;
    const panel_act l = act_layout(k);
    if (l.stride * nr > scratch_cap) {
        free(scratch);
        scratch = (uint8_t *)aligned_alloc(64, (size_t)(l.stride * nr));  // (stride: a multiple of 64)
        scratch_cap = scratch ? l.stride * nr : 0;
        if (!scratch) return -2;
    }
    uint8_t *A = scratch;
#pragma omp parallel for schedule(static) if (nr * k >= 65536)
    for (int64_t r = 0; r < nr; r++) quantize(x + r * xs, &l, A + r * l.stride);
    const int64_t nu = k / unit_inputs(t), np = (n + PANEL_ROWS - 1) / PANEL_ROWS;
    const int tile = t == T_Q6_K ? Q6K_TILE_ROWS : TILE_ROWS;
    const int np_pass = nr >= PAIR_MIN_ROWS ? pair_panels(t) : 1;
    const int64_t panel = nu * panel_unit(t);
    int64_t block = kvk_row_block_budget() / l.stride / TILE_ROWS * TILE_ROWS;
    if (block < TILE_ROWS) block = TILE_ROWS;
#pragma omp parallel if (nr * n * (k / 32) * 18 >= 64 * 1024)  // kvk.c's PARALLEL_MIN_BYTES
    {
#ifdef _OPENMP
        const int64_t nth = omp_get_num_threads(), me = omp_get_thread_num();
#else
        const int64_t nth = 1, me = 0;
#endif
        const int64_t p0 = np * me / nth, p1 = np * (me + 1) / nth;
        for (int64_t r0 = 0; r0 < nr; r0 += block) {
            const int64_t r1 = r0 + block < nr ? r0 + block : nr;
            for (int64_t p = p0; p < p1; p += np_pass) {
                const int NP = p + np_pass <= p1 ? np_pass : (int)(p1 - p);
                const uint8_t *P = panels + p * panel;
                const int64_t last = p + NP - 1;  // the pass's last panel: maybe rows past n
                const int nout = n - PANEL_ROWS * last >= PANEL_ROWS ? PANEL_ROWS : (int)(n - PANEL_ROWS * last);
                for (int64_t r = r0; r < r1; r += tile) {
                    const int R = r1 - r < tile ? (int)(r1 - r) : tile;
                    panel_some_rows(t, NP, R, P, panel, nu, A + r * l.stride, &l, y + r * ys + PANEL_ROWS * p, ys, nout);
                }
            }
        }
    }
    return 0;
#else
    (void)panels, (void)x, (void)xs, (void)y, (void)ys;
    return -1;
#endif
}

// The roof under the panels' arithmetic: each thread runs `iterations` rounds of 24 independent
// vpdpwssd on registers (32 products each, no memory operand, more chains than the instruction's
// latency times its throughput on any CPU we know), so threads * iterations * 768 products over
// the call's time is the most products per second any kernel multiplying 16-bit pairs reaches on
// these cores (2 Zen 5 cores: 533 G/s). Returns the threads that ran, or -1 where this build has
// no VNNI. The chains are named variables, each step an asm on registers: GCC kept an array of
// them on the stack, a store and a load a step, which is what this probe's first version measured
// (218 G/s).
#define PROBE_EACH(X) X(0) X(1) X(2) X(3) X(4) X(5) X(6) X(7) X(8) X(9) X(10) X(11) \
    X(12) X(13) X(14) X(15) X(16) X(17) X(18) X(19) X(20) X(21) X(22) X(23)
KVK_API int kvk_pair_product_probe(int64_t iterations) {
#ifdef PANELS_AVX512
    int threads = 1;
#pragma omp parallel
    {
#define PROBE_INIT(i) __m512i acc##i = _mm512_set1_epi32(i);
#define PROBE_STEP(i) __asm__("vpdpwssd %2, %1, %0" : "+v"(acc##i) : "v"(a), "v"(b));
#define PROBE_SUM(i) keep = _mm512_add_epi32(keep, acc##i);
        PROBE_EACH(PROBE_INIT)
        __m512i a = _mm512_set1_epi16(3), b = _mm512_set1_epi16(5), keep = _mm512_setzero_si512();
        __asm__ volatile("" : "+v"(a), "+v"(b));  // (not constants the compiler could fold)
        for (int64_t n = 0; n < iterations; n++) {
            PROBE_EACH(PROBE_STEP)
        }
        PROBE_EACH(PROBE_SUM)
        __asm__ volatile("" : : "v"(keep));
#undef PROBE_INIT
#undef PROBE_STEP
#undef PROBE_SUM
#ifdef _OPENMP
#pragma omp single
        threads = omp_get_num_threads();
#endif
    }
    return threads;
#else
    (void)iterations;
    return -1;
#endif
}
