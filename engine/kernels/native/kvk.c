// kvscope's CPU kernels for GGUF block formats (the "kvk" library).
//
// A weight row is read as the GGUF file stores it (memory-mapped, never copied) and multiplied by
// activations quantized once per call to one 16-bit plane: per group of 256 inputs (a K-quant
// super-block, 8 blocks of the 32-weight types) a scale dx = amax / 32767 and codes
// xq = round(x / dx). One 8-bit plane per 32 inputs (llama.cpp's q8) was measured too coarse for a
// small model's heavy-tailed activations: on the packaged SmolLM2-135M (Q4_1) against its float32
// twin, mean KL 2.1e-3 and top-1 97.0%, against the product's bound of 5e-4 and 99.5%; the 16-bit
// plane measures KL 3.3e-7 and top-1 100% there (the two 8-bit planes it replaced: 1.2e-7, 100%).
// Every quantized type is read through one description: per sub-block of S weights (S = 32 or 16),
// 8-bit codes c and two floats a, b with
//     w = a * c + b
// (Q4_0: c = q, a = d, b = -8d; Q8_0: c = q + 128, a = d, b = -128d; Q4_K: a = d*sc, b = -dmin*m;
// Q6_K, Q3_K, IQ4_XS: c centred (q - 32, q - 4, the table's signed values), b = 0), so that a row's
// dot product with x = dx*xq is, per sub-block, a*dx*sum(c*xq) + b*dx*sum(xq): integer dot products
// of the codes, widened to 16-bit lanes, with the 16-bit activations (AVX-512 VNNI's vpdpwssd, 32
// products an instruction), plus a correction from the activations' sub-block sums. The K-quants'
// sub-block scales are integers: their codes are multiplied by them in 16 bits (exactly: at most
// 4096), so a super-block sums in int32 and is scaled once by d * dx. 16-bit products run at half
// the rate of 8-bit ones (vpdpbusd, what llama.cpp uses), and at the rate of oneDNN's bfloat16
// GEMM (vdpbf16ps): every one of them is one instruction a cycle on Zen 4 (measured). With the two
// 8-bit planes (vpdpbusd twice, plus maddubs for the K-quants) a row of several activation rows
// cost twice as many products; a prompt's rows now run at 200-310 GFLOP/s on 2 cores (was 110-180).
// F16/BF16 weights are multiplied in float32 against float32 activations.
//
// The LM head needs more than that: every logit the sampler, the probability panel and the server
// report must come from the file's weights. kvk_matmul_f32 multiplies any type by float32
// activations (each weight decoded to float32 in registers, products and sums in float32), with
// no activation rounding; the head uses it.
//
// Each output element is computed by one thread, with the same sequence of operations whatever the
// number of rows in the call, their tiling or the thread count (threads split the weight rows,
// never the inputs of a dot product): a sequence's outputs never depend on its neighbours.
//
// Built once per instruction set (engine/kernels/native/build.py): this file's portable C is the
// reference and the fallback on any CPU; where the compiler targets AVX-512 VNNI, the hot loops
// use its intrinsics. Dequantization (an embedding's rows, tests) is bit for bit gguf-py's.

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__unix__) || defined(__APPLE__)
#include <unistd.h>  // sysconf: the L2 cache's size (row_block_bytes)
#endif
#ifdef _OPENMP
#include <omp.h>
#endif

#if defined(__F16C__)
#include <immintrin.h>
#endif
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512VNNI__)
#include <immintrin.h>
#define KVK_AVX512 1
#endif

#define KVK_API __attribute__((visibility("default")))

enum {
    T_F32 = 0, T_F16 = 1, T_Q4_0 = 2, T_Q4_1 = 3, T_Q5_0 = 6, T_Q5_1 = 7, T_Q8_0 = 8,
    T_Q2_K = 10, T_Q3_K = 11, T_Q4_K = 12, T_Q5_K = 13, T_Q6_K = 14, T_IQ4_NL = 20,
    T_IQ4_XS = 23, T_BF16 = 30,
};

static const int8_t IQ4_VALUES[16] = {-127, -104, -83, -65, -49, -35, -22, -10,
                                      1,    13,   25,  38,  53,  69,  89,  113};

// ---- type descriptions ------------------------------------------------------------------------
typedef struct {
    int block;  // weights per block
    int bytes;  // bytes per block
    int sub;    // weights per (a, b) pair: 32 or 16; 0 for float types
    int act;    // activation quantization block: 32 or 256; 0 for float types
} kvk_type;

static int type_info(int t, kvk_type *out) {
    kvk_type ti = {0, 0, 0, 0};
    switch (t) {
        case T_F16: ti = (kvk_type){1, 2, 0, 0}; break;
        case T_BF16: ti = (kvk_type){1, 2, 0, 0}; break;
        case T_Q4_0: ti = (kvk_type){32, 18, 32, 32}; break;
        case T_Q4_1: ti = (kvk_type){32, 20, 32, 32}; break;
        case T_Q5_0: ti = (kvk_type){32, 22, 32, 32}; break;
        case T_Q5_1: ti = (kvk_type){32, 24, 32, 32}; break;
        case T_Q8_0: ti = (kvk_type){32, 34, 32, 32}; break;
        case T_IQ4_NL: ti = (kvk_type){32, 18, 32, 32}; break;
        case T_Q2_K: ti = (kvk_type){256, 84, 16, 256}; break;
        case T_Q3_K: ti = (kvk_type){256, 110, 16, 256}; break;
        case T_Q4_K: ti = (kvk_type){256, 144, 32, 256}; break;
        case T_Q5_K: ti = (kvk_type){256, 176, 32, 256}; break;
        case T_Q6_K: ti = (kvk_type){256, 210, 16, 256}; break;
        case T_IQ4_XS: ti = (kvk_type){256, 136, 32, 256}; break;
        default: return 0;
    }
    *out = ti;
    return 1;
}

// ---- half precision ---------------------------------------------------------------------------
static inline float fp16_to_fp32(uint16_t h) {
    // exact for every value, subnormals, infinities and NaNs included
    uint32_t sign = (uint32_t)(h & 0x8000) << 16;
    uint32_t exp = (h >> 10) & 0x1f, man = h & 0x3ff, bits;
    if (exp == 0) {
        if (man == 0) {
            bits = sign;
        } else {  // subnormal: normalise
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

static inline float bf16_to_fp32(uint16_t h) {
    uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

static inline float rd_f16(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
#ifdef __F16C__
    return _cvtsh_ss(h);  // the same exact conversion, one instruction
#else
    return fp16_to_fp32(h);
#endif
}

// ---- dequantization, as gguf-py computes it (same float32 operations in the same order) ------
// Compiled with -ffp-contract=off so that no product and sum are fused where gguf rounds twice.
static void get_scale_min_k4(const uint8_t *s, uint8_t *sc, uint8_t *mn) {
    for (int j = 0; j < 4; j++) {
        sc[j] = s[j] & 63;
        mn[j] = s[j + 4] & 63;
        sc[j + 4] = (s[j + 8] & 0x0f) | ((s[j] >> 2) & 0x30);
        mn[j + 4] = (s[j + 8] >> 4) | ((s[j + 4] >> 2) & 0x30);
    }
}

static void q3k_scales(const uint8_t *s, int8_t *out) {
    for (int j = 0; j < 16; j++) {
        int lo = (j < 8 ? s[j] : s[j - 8] >> 4) & 0x0f;
        int hi = (s[8 + (j & 3)] >> (2 * (j >> 2))) & 3;
        out[j] = (int8_t)((lo | (hi << 4)) - 32);
    }
}

static void iq4xs_scales(const uint8_t *b, int8_t *out) {
    uint16_t sh;
    memcpy(&sh, b + 2, 2);
    for (int j = 0; j < 8; j++) {
        int lo = (b[4 + j / 2] >> (4 * (j % 2))) & 0x0f;
        int hi = (sh >> (2 * j)) & 3;
        out[j] = (int8_t)((lo | (hi << 4)) - 32);
    }
}

// The unsigned code of weight e of a block (the `c` of w = a*c + b), for every quantized type.
static inline int block_code(int t, const uint8_t *b, int e) {
    switch (t) {
        case T_Q4_0: case T_Q4_1: case T_IQ4_NL: {
            const uint8_t *qs = b + (t == T_Q4_1 ? 4 : 2);
            int q = e < 16 ? qs[e] & 0x0f : qs[e - 16] >> 4;
            return t == T_IQ4_NL ? IQ4_VALUES[q] + 128 : q;
        }
        case T_Q5_0: case T_Q5_1: {
            int off = t == T_Q5_1 ? 4 : 2;
            uint32_t qh;
            memcpy(&qh, b + off, 4);
            const uint8_t *qs = b + off + 4;
            int lo = e < 16 ? qs[e] & 0x0f : qs[e - 16] >> 4;
            return lo | (int)(((qh >> e) & 1) << 4);
        }
        case T_Q8_0: return (int)(int8_t)b[2 + e] + 128;
        case T_Q2_K: {
            int h = e / 128, s = (e / 32) % 4, i = e % 32;
            return (b[16 + h * 32 + i] >> (2 * s)) & 3;
        }
        case T_Q3_K: {
            int h = e / 128, s = (e / 32) % 4, i = e % 32;
            int low = (b[32 + h * 32 + i] >> (2 * s)) & 3;
            int hbit = (b[i] >> (e / 32)) & 1;
            return low | (hbit << 2);
        }
        case T_Q4_K: case T_Q5_K: {
            int c = e / 64, n = (e / 32) % 2, i = e % 32;
            const uint8_t *qs = b + (t == T_Q5_K ? 48 : 16);
            int lo = (qs[c * 32 + i] >> (4 * n)) & 0x0f;
            if (t == T_Q4_K) return lo;
            int hbit = (b[16 + i] >> (e / 32)) & 1;
            return lo | (hbit << 4);
        }
        case T_Q6_K: {
            int h = e / 128, s = (e / 32) % 4, i = e % 32;
            int low = (b[h * 64 + (s & 1) * 32 + i] >> (4 * (s >> 1))) & 0x0f;
            int hi = (b[128 + h * 32 + i] >> (2 * s)) & 3;
            return low | (hi << 4);
        }
        case T_IQ4_XS: {
            int j = e / 32, i = e % 32;
            const uint8_t *qs = b + 8 + j * 16;
            int q = i < 16 ? qs[i] & 0x0f : qs[i - 16] >> 4;
            return IQ4_VALUES[q] + 128;
        }
    }
    return 0;
}

// panels.c reads the file's blocks through these
void kvk_scale_min_k4(const uint8_t *s, uint8_t *sc, uint8_t *mn) { get_scale_min_k4(s, sc, mn); }
int kvk_block_code(int t, const uint8_t *b, int e) { return block_code(t, b, e); }

// The (a, b) of every sub-block of a block: w = a * c + b.
static void block_scales(int t, const uint8_t *b, float *a, float *o) {
    switch (t) {
        case T_Q4_0: case T_Q5_0: case T_Q8_0: case T_IQ4_NL: {
            float d = rd_f16(b);
            a[0] = d;
            o[0] = (t == T_Q4_0 ? -8.0f : t == T_Q5_0 ? -16.0f : -128.0f) * d;
            return;
        }
        case T_Q4_1: case T_Q5_1: a[0] = rd_f16(b); o[0] = rd_f16(b + 2); return;
        case T_Q2_K: {
            float d = rd_f16(b + 80), dmin = rd_f16(b + 82);
            for (int j = 0; j < 16; j++) {
                a[j] = d * (float)(b[j] & 0x0f);
                o[j] = -(dmin * (float)(b[j] >> 4));
            }
            return;
        }
        case T_Q3_K: {
            int8_t sc[16];
            float d = rd_f16(b + 108);
            q3k_scales(b + 96, sc);
            for (int j = 0; j < 16; j++) { a[j] = d * (float)sc[j]; o[j] = -4.0f * a[j]; }
            return;
        }
        case T_Q4_K: case T_Q5_K: {
            uint8_t sc[8], mn[8];
            float d = rd_f16(b), dmin = rd_f16(b + 2);
            get_scale_min_k4(b + 4, sc, mn);
            for (int j = 0; j < 8; j++) { a[j] = d * (float)sc[j]; o[j] = -(dmin * (float)mn[j]); }
            return;
        }
        case T_Q6_K: {
            float d = rd_f16(b + 208);
            for (int j = 0; j < 16; j++) { a[j] = d * (float)(int8_t)b[192 + j]; o[j] = -32.0f * a[j]; }
            return;
        }
        case T_IQ4_XS: {
            int8_t sc[8];
            float d = rd_f16(b);
            iq4xs_scales(b, sc);
            for (int j = 0; j < 8; j++) { a[j] = d * (float)sc[j]; o[j] = -128.0f * a[j]; }
            return;
        }
    }
}

// One block's weights exactly as gguf-py's dequantize_blocks computes them.
static void dequant_block(int t, const uint8_t *b, float *w) {
    switch (t) {
        case T_Q4_0: case T_Q5_0: case T_Q8_0: case T_IQ4_NL: {
            float d = rd_f16(b);
            int mid = t == T_Q4_0 ? 8 : t == T_Q5_0 ? 16 : 128;
            for (int e = 0; e < 32; e++) w[e] = d * (float)(block_code(t, b, e) - mid);
            return;
        }
        case T_Q4_1: case T_Q5_1: {
            float d = rd_f16(b), m = rd_f16(b + 2);
            for (int e = 0; e < 32; e++) w[e] = d * (float)block_code(t, b, e) + m;
            return;
        }
        case T_Q2_K: case T_Q4_K: case T_Q5_K: {  // (d * sc) * q - (dmin * m)
            float a[16], o[16];
            int sub = t == T_Q2_K ? 16 : 32;
            block_scales(t, b, a, o);
            for (int e = 0; e < 256; e++) w[e] = a[e / sub] * (float)block_code(t, b, e) + o[e / sub];
            return;
        }
        case T_Q3_K: case T_Q6_K: {  // (d * sc) * (q - mid)
            float a[16], o[16];
            int mid = t == T_Q3_K ? 4 : 32;
            block_scales(t, b, a, o);
            for (int e = 0; e < 256; e++) w[e] = a[e / 16] * (float)(block_code(t, b, e) - mid);
            return;
        }
        case T_IQ4_XS: {
            float a[8], o[8];
            block_scales(t, b, a, o);
            for (int e = 0; e < 256; e++) w[e] = a[e / 32] * (float)(block_code(t, b, e) - 128);
            return;
        }
    }
}

static void dequant_row(int t, const uint8_t *row, int64_t k, float *w) {
    if (t == T_F16 || t == T_BF16) {
        for (int64_t i = 0; i < k; i++) {
            uint16_t h;
            memcpy(&h, row + 2 * i, 2);
            w[i] = t == T_F16 ? fp16_to_fp32(h) : bf16_to_fp32(h);
        }
        return;
    }
    kvk_type ti = {0, 0, 0, 0};
    type_info(t, &ti);
    for (int64_t g = 0; g < k / ti.block; g++) dequant_block(t, row + g * ti.bytes, w + g * ti.block);
}

// A block decoded to float32 exactly as gguf-py decodes it: a * (c - mid) for the symmetric types
// (one rounding), a * c + b for the types with a minimum (two roundings, no fused multiply-add).
static inline int symmetric_mid(int t) {
    switch (t) {
        case T_Q4_0: return 8;
        case T_Q5_0: return 16;
        case T_Q8_0: case T_IQ4_NL: case T_IQ4_XS: return 128;
        case T_Q3_K: return 4;
        case T_Q6_K: return 32;
    }
    return -1;
}

// ---- activations ------------------------------------------------------------------------------
// A row quantized for one weight type: one 16-bit plane per input, xq = round(x / dx) in
// [-XQ_MAX, XQ_MAX], with one scale dx = amax / XQ_MAX per group of 256 inputs (a super-block of
// the K-quants, 8 blocks of the 32-weight types; a row's last group of those may be shorter);
// and xs [k / sub] = dx * sum(xq) over each of the weight type's sub-blocks (the b * sum(x) terms).
// xq is laid out in the kernel's order within each chunk of 64 inputs (slot_of: the order in which
// a chunk's 64 byte codes leave vpunpcklbw/vpunpckhbw as two vectors of 16-bit lanes), zero past
// k up to the next chunk. Rows are laid out one after another in one buffer.
typedef struct {
    int64_t k, sub, groups, stride;  // stride: bytes per row
    int64_t off_dx, off_xs;          // the group scales, the b-term sums
    int t;                           // the weight type (Q4_K lays its inputs out its own way)
    int act;                         // 32: a 32-weight type (its whole groups: block or nibble lanes)
} act_layout;

// 15 bits and a sign. The K-quants' 16-bit weights (a code times its sub-block's integer scale,
// centred where the type is symmetric) reach 4096 (Q6_K: |c - 32| <= 32 times |sc| <= 128), and a
// 32-bit lane sums 16 products a super-block: 16 * 4096 * 32767 < 2^31, so no sum overflows.
#define XQ_MAX 32767

// Where input e of a row sits in xq: chunk by chunk, the first 8 of each 16 inputs in the chunk's
// low vector (slots 0-31), the last 8 in its high vector (slots 32-63).
static inline int64_t slot_of(int64_t e) {
    const int64_t p = e & 63, j = p >> 4, t = p & 15;
    return (e & ~(int64_t)63) + (t < 8 ? 8 * j + t : 32 + 8 * j + (t - 8));
}

// Q4_K's order: its unpacking reads a super-block's 128 bytes of nibbles as 16-bit lanes and takes
// each lane's four nibbles apart with a mask and shifts (no byte shuffles, which bound its one-row
// matmul): vector v = 4 H + n (H the half of the bytes, n the nibble of the lane), lane L holds
// the weight of nibble n of lane L of the half's 64 bytes. Q4K_SLOT[e]: where weight e of a
// super-block sits (32 v + L).
static uint16_t Q4K_SLOT[256];

__attribute__((constructor)) static void init_q4k_slots(void) {
    for (int v = 0; v < 8; v++)
        for (int L = 0; L < 32; L++) {
            const int H = v / 4, n = v % 4;
            const int J = 64 * H + 2 * L + (n >= 2);  // the byte of qs
            const int c = J / 32, i = J % 32;
            Q4K_SLOT[64 * c + 32 * (n % 2) + i] = (uint16_t)(32 * v + L);
        }
}

// The 32-weight types' whole groups: each 32-bit lane of the kernel's 8 vectors sums the products
// of one block, 16 of them (lanes 4i + c, for c < 4 and i < 4, take block 2c + i / 2), so that a
// group's integer sums need one conversion and one scaling per output instead of one per chunk.
// Input e = 64c + 16i + 2W + b of a group (c: the chunk of two blocks, i: its 16-input quarter, W:
// the pair within it, b: which of the pair) sits in vector W, 16-bit lane 8i + 2c + b: where
// block_lanes puts its weight. A row's last group, when shorter, keeps the chunk order (slot_of).
static inline int64_t slot_block_lanes(int64_t e) {
    const int64_t c = (e >> 6) & 3, i = (e >> 4) & 3, W = (e >> 1) & 7, b = e & 1;
    return (e & ~(int64_t)255) + 32 * W + 8 * i + 2 * c + b;
}

// Q4_0, Q4_1 and IQ4_NL (a block's 16 bytes: code i in the low nibble of byte i, code 16 + i in
// the high one) take their whole groups' lanes straight from the nibbles (nibble_lanes), in another
// order with the same property (each 32-bit lane one block's, 2 lanes a block): input e = 32B + 16n + 8s
// + 2w + b of a group (block B = 4h + j, nibble n, ...) sits in vector 4n + 2s + w / 2, lane 8j +
// 2(2(w % 2) + h) + b; lane 4j + x belongs to block j + 4(x % 2).
static inline int64_t slot_nibble_lanes(int64_t e) {
    const int64_t B = (e >> 5) & 7, h = B >> 2, j = B & 3, n = (e >> 4) & 1, s = (e >> 3) & 1;
    const int64_t w = (e >> 1) & 3, b = e & 1;
    return (e & ~(int64_t)255) + 32 * (4 * n + 2 * s + (w >> 1)) + 8 * j + 2 * (2 * (w & 1) + h) + b;
}

static inline int nibble_lane_type(int t) { return t == T_Q4_0 || t == T_IQ4_NL || t == T_Q4_1; }

static inline int64_t slot_in(const act_layout *l, int64_t e) {
    if (l->t == T_Q4_K) return (e & ~(int64_t)255) + Q4K_SLOT[e & 255];
    if (l->act == 32 && (e | 255) < l->k)  // a whole group
        return nibble_lane_type(l->t) ? slot_nibble_lanes(e) : slot_block_lanes(e);
    return slot_of(e);
}

// A whole group's input pairs in either lane order: LANE_PAIRS[o][d], the pair (inputs 2p, 2p + 1)
// that goes to pair d of the group's slots (o: 0 block lanes, 1 nibble lanes); and LANE_BLOCKS[o]
// [L], the block of 32-bit lane L (the same in each of the 8 vectors): its pair's inputs' block.
static uint8_t LANE_PAIRS[2][128];
static int32_t LANE_BLOCKS[2][16];

__attribute__((constructor)) static void init_lane_pairs(void) {
    for (int64_t e = 0; e < 256; e += 2) {
        LANE_PAIRS[0][slot_block_lanes(e) / 2] = (uint8_t)(e / 2);
        LANE_PAIRS[1][slot_nibble_lanes(e) / 2] = (uint8_t)(e / 2);
    }
    for (int o = 0; o < 2; o++)
        for (int L = 0; L < 16; L++) LANE_BLOCKS[o][L] = LANE_PAIRS[o][L] / 16;
}

static act_layout layout_for(int64_t k, int t, const kvk_type *ti) {
    act_layout l;
    l.t = t;
    l.act = ti->act;
    l.k = k;
    l.sub = ti->sub;
    l.groups = (k + 255) / 256;
    const int64_t xq = ((k + 63) & ~(int64_t)63) * 2;  // a tail block's zero twin included
    l.off_dx = xq;
    l.off_xs = xq + (((l.groups + 16) * 4 + 63) & ~(int64_t)63);
    // + a last group's zero b-terms (the 32-weight types' kernel reads 8 per group)
    l.stride = l.off_xs + (((k / ti->sub + 16) * 4 + 63) & ~(int64_t)63);
    return l;
}

static void quantize_row(const float *x, const act_layout *l, uint8_t *dst) {
    int16_t *xq = (int16_t *)dst;
    float *dx = (float *)(dst + l->off_dx);
    float *xs = (float *)(dst + l->off_xs);
    const int64_t k = l->k, sub = l->sub;
    memset(dst, 0, (size_t)l->stride);
    for (int64_t g = 0; g < l->groups; g++) {
        const int64_t e0 = 256 * g, n = k - e0 < 256 ? k - e0 : 256;
        float amax = 0.0f;
        for (int64_t i = 0; i < n; i++) amax = fmaxf(amax, fabsf(x[e0 + i]));
        const float d = amax / (float)XQ_MAX, inv = amax > 0.0f ? (float)XQ_MAX / amax : 0.0f;
        dx[g] = d;
        for (int64_t j = 0; j < n / sub; j++) {
            int32_t s = 0;
            for (int64_t i = 0; i < sub; i++) {
                const int64_t e = e0 + j * sub + i;
                int q = (int)nearbyintf(x[e] * inv);
                q = q > XQ_MAX ? XQ_MAX : q < -XQ_MAX ? -XQ_MAX : q;
                s += q;
                xq[slot_in(l, e)] = (int16_t)q;
            }
            xs[e0 / sub + j] = d * (float)s;
        }
    }
}

// The K-quants read as 16-bit weights: whether the type's codes are centred (symmetric types:
// w = a * (c - mid), no b term), and a super-block's integer sub-block scales and its d.
static inline int centered_type(int t) { return t == T_Q6_K || t == T_Q3_K || t == T_IQ4_XS; }

static float kquant_int_scales(int t, const uint8_t *b, int *sc) {
    switch (t) {
        case T_Q4_K: case T_Q5_K: {
            uint8_t s[8], m[8];
            get_scale_min_k4(b + 4, s, m);
            for (int j = 0; j < 8; j++) sc[j] = s[j];
            return rd_f16(b);
        }
        case T_Q6_K:
            for (int j = 0; j < 16; j++) sc[j] = (int8_t)b[192 + j];
            return rd_f16(b + 208);
        case T_Q3_K: {
            int8_t s[16];
            q3k_scales(b + 96, s);
            for (int j = 0; j < 16; j++) sc[j] = s[j];
            return rd_f16(b + 108);
        }
        case T_Q2_K:
            for (int j = 0; j < 16; j++) sc[j] = b[j] & 0x0f;
            return rd_f16(b + 80);
        default: {  // IQ4_XS
            int8_t s[8];
            iq4xs_scales(b, s);
            for (int j = 0; j < 8; j++) sc[j] = s[j];
            return rd_f16(b);
        }
    }
}

// ---- one output: a weight row against one quantized activation row (portable) ----------------
// Per group: the K-quants' integer sum over the super-block (codes times their sub-block scales,
// times the inputs' codes) scaled once by d * dx; the 32-weight types' integer sum per block
// scaled by its a, the group's sum then by dx; then the b terms.
__attribute__((unused)) static float dot_row_portable(int t, const kvk_type *ti, const uint8_t *row, int64_t k,
                                                      const uint8_t *act, const act_layout *l) {
    const int16_t *xq = (const int16_t *)act;
    const float *dx = (const float *)(act + l->off_dx);
    const float *xs = (const float *)(act + l->off_xs);
    float total = 0.0f, offsets = 0.0f;
    float a[16], o[16];
    const int per = ti->block / ti->sub;
    const int cen = ti->block == 256 && centered_type(t), mid = cen ? symmetric_mid(t) : 0;
    for (int64_t g = 0; g < l->groups; g++) {
        const int64_t e0 = 256 * g, n = k - e0 < 256 ? k - e0 : 256;
        if (ti->block == 256) {
            const uint8_t *b = row + g * ti->bytes;
            int sc[16];
            const float d = kquant_int_scales(t, b, sc);
            block_scales(t, b, a, o);
            int64_t isum = 0;
            for (int j = 0; j < per; j++) {
                int64_t s = 0;
                for (int i = 0; i < ti->sub; i++) {
                    const int e = j * ti->sub + i;
                    s += (int64_t)(block_code(t, b, e) - mid) * xq[slot_in(l, e0 + e)];
                }
                isum += s * sc[j];
                if (!cen) offsets += o[j] * xs[e0 / ti->sub + j];
            }
            total += (float)isum * (d * dx[g]);
        } else {
            float part = 0.0f;
            for (int64_t b0 = e0; b0 < e0 + n; b0 += 32) {
                const uint8_t *b = row + (b0 / 32) * ti->bytes;
                block_scales(t, b, a, o);
                int64_t s = 0;
                for (int i = 0; i < 32; i++) s += (int64_t)block_code(t, b, i) * xq[slot_in(l, b0 + i)];
                part += (float)s * a[0];
                offsets += o[0] * xs[b0 / 32];
            }
            total += part * dx[g];
        }
    }
    return total + offsets;
}

__attribute__((unused)) static float dot_row_f32_portable(int t, const kvk_type *ti, const uint8_t *row, int64_t k,
                                  const float *x, float *scratch) {
    (void)ti;
    dequant_row(t, row, k, scratch);
    float acc = 0.0f;
    for (int64_t i = 0; i < k; i++) acc += scratch[i] * x[i];
    return acc;
}

// The activation rows' block size of a prompt's matmul (row_block), in bytes; 0: from the L2
// cache's size. Tests set it small to run many blocks on small matrices (the same bits); a
// measurement can try other sizes with it.
static int64_t row_block_override = 0;
KVK_API void kvk_set_row_block_bytes(int64_t bytes) { row_block_override = bytes; }

#ifdef KVK_AVX512
// ---- AVX-512 VNNI ------------------------------------------------------------------------------
// A chunk is 64 weights: 64 8-bit codes in one register, in the row's order (for the 32-weight
// types two blocks A and B), widened to two vectors of 16-bit lanes (the activations are laid out
// in the same order, slot_of); a 32-bit lane of their products with the activations then sums one
// sub-block's products (lanes 0-7 block A's, 8-15 B's). A group is 256 weights: a super-block, or 4
// chunks of the 32-weight types.
//   K-quants and IQ4_XS: codes times sub-block scales in 16 bits, so a super-block accumulates in
//     int32 and is scaled once by d * dx.
//   32-weight types, a whole group: its codes arranged so that each 32-bit lane sums one block's
//     products (2 lanes a block, 16 products each: nibble_lanes for Q4_0, Q4_1 and IQ4_NL,
//     block_lanes from the chunks for the others), so the group too accumulates in int32 and is
//     scaled once, by its lanes' block scales a times dx. (Per chunk, as a row's last, shorter
//     group still goes, each (weight row, activation row) paid a conversion and a scaling per 64
//     products beside the 2 products' instructions, on the same pipes: 128-row tiles took
//     1.15-1.35x the time, 5 rows up to 1.2x.)
// A call of up to 8 activation rows (decode, a speculative round) takes one weight row at a time,
// streaming it; a longer one (a prompt) tiles NW weight rows x RT activation rows, every group of
// the NW rows unpacked once for all activation rows. Every output's operations depend only on k
// (groups and chunks in order, the same sums and the same reduction), never on the rows of the
// call, the tile it fell in or the thread that ran it.

static const int8_t IQ4_CODES[16] = {1,   24,  45,  63,  79,  93,  106, 118,
                                     -127, -115, -103, -90, -75, -59, -39, -15};  // table + 128, as int8

// A prompt's tiles: NW weight rows x RT activation rows (RT32 for the 32-weight types), their NW *
// RT sums in registers (-D to try others). Measured at 128 rows, GFLOP/s on 2 cores, Q4_K / Q6_K /
// Q4_0: 4x2 207-236 / 231-265 / 175-182, 4x3 223-233 / 257-263 / 183-186, 2x4 194-224 / 213-267 /
// 180-211, 6x2 218-226 / 255-268 / 184-189, 4x4 246-256 / 249-259 / 207-216 (the shape kept; the
// later work took it to 290-310 / 300-310 / 200-230). A call of up to SEQUENTIAL_ROWS activation
// rows takes one weight row at a time (few_rows16).
#ifndef KVK_NW
#define KVK_NW 4
#endif
#ifndef KVK_RT
#define KVK_RT 4
#endif
#ifndef KVK_RT32
#define KVK_RT32 4
#endif
enum { NW = KVK_NW, RT = KVK_RT, RT32 = KVK_RT32, SEQUENTIAL_ROWS = 8, MAXT = 16 };
// How far ahead of its reads a one-row matmul asks for a weight row's bytes (a software prefetch
// per cache line of each group). The hardware prefetcher alone left a Q4_K decode waiting on its
// loads (perf: 14% of samples behind the first load of a group); measured one row against
// 16384 x 2048 and 2048 x 8192 layers of Q4_K, Q4_0 and Q6_K (GB/s, 10 interleaved rounds):
// none 13-25, 512 B 15-24, 1 KiB 16-27, 2 KiB 18-28, 4 KiB 18-28.
#ifndef KVK_PREFETCH
#define KVK_PREFETCH 2048
#endif

typedef struct {
    __m512i codes[4];
    __m512i sc[4];  // K-quants: each 16-bit lane's sub-block scale (lanes in the activations' order)
    __m256 d8;      // 32-weight types: the group's 8 block scales
    float d;        // K-quants: the super-block's scale
} group_t;

static inline __m512i nibbles_pair(const uint8_t *qa, const uint8_t *qb) {
    // two blocks' 16 bytes of nibbles -> [A's 32 codes | B's 32 codes] in weight order
    __m256i q = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)qa)),
                                        _mm_loadu_si128((const __m128i *)qb), 1);
    const __m256i m4 = _mm256_set1_epi8(0x0f);
    __m256i lo = _mm256_and_si256(q, m4), hi = _mm256_and_si256(_mm256_srli_epi16(q, 4), m4);
    __m512i t = _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);  // [Alo Blo Ahi Bhi]
    return _mm512_shuffle_i64x2(t, t, _MM_SHUFFLE(3, 1, 2, 0));          // [Alo Ahi Blo Bhi]
}

static inline __attribute__((always_inline)) __m512i codes32_natural(const int t, const uint8_t *A, const uint8_t *B) {
    switch (t) {
        case T_Q4_0: return nibbles_pair(A + 2, B + 2);
        case T_Q4_1: return nibbles_pair(A + 4, B + 4);
        case T_IQ4_NL:
            return _mm512_shuffle_epi8(_mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)IQ4_CODES)),
                                       nibbles_pair(A + 2, B + 2));
        case T_Q5_0: case T_Q5_1: {
            const int off = t == T_Q5_1 ? 4 : 2;
            uint32_t ha, hb;
            memcpy(&ha, A + off, 4);
            memcpy(&hb, B + off, 4);
            __mmask64 m = (__mmask64)ha | ((__mmask64)hb << 32);
            return _mm512_or_si512(nibbles_pair(A + off + 4, B + off + 4),
                                   _mm512_maskz_mov_epi8(m, _mm512_set1_epi8(0x10)));
        }
        default: {  // Q8_0
            __m512i q = _mm512_inserti64x4(
                _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(A + 2))),
                _mm256_loadu_si256((const __m256i *)(B + 2)), 1);
            return _mm512_xor_si512(q, _mm512_set1_epi8((char)0x80));
        }
    }
}

static inline __attribute__((always_inline)) void scales32(const int t, const uint8_t *b, float *a, float *o) {
    const float d = rd_f16(b);
    *a = d;
    switch (t) {
        case T_Q4_1: case T_Q5_1: *o = rd_f16(b + 2); break;
        case T_Q4_0: *o = -8.0f * d; break;
        case T_Q5_0: *o = -16.0f * d; break;
        default: *o = -128.0f * d;  // Q8_0, IQ4_NL
    }
}

static const uint8_t ZERO_BLOCK[256] = {0};

static inline uint16_t ld16(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return h;
}

// The 16-bit values at p, p + stride, ... (n <= 8 of them; the rest zero) in one register, each
// inserted straight from memory. Measured slower: a masked gather (Zen 4 runs it as microcode: its
// result's consumer held 13% of a Q4_0 decode's samples, Q4_0 at 9.8 GB/s against Q4_1's 17.8),
// and a vector built from scalars, which the compiler did through the stack (store forwarding
// stalled at every group; a row's last group of fewer than 8 blocks took that path until measured:
// Q4_1 3072 x 576, 18 blocks a row: 10.4 -> 13.1 GB/s). A last group reads only its own blocks.
static inline __m128i halves8(const uint8_t *p, int stride, int n) {
    // (a row's last group takes the same branches for every row of a layer: predicted)
    __m128i v = _mm_cvtsi32_si128(ld16(p));
    if (n > 1) v = _mm_insert_epi16(v, ld16(p + stride), 1);
    if (n > 2) v = _mm_insert_epi16(v, ld16(p + 2 * stride), 2);
    if (n > 3) v = _mm_insert_epi16(v, ld16(p + 3 * stride), 3);
    if (n > 4) v = _mm_insert_epi16(v, ld16(p + 4 * stride), 4);
    if (n > 5) v = _mm_insert_epi16(v, ld16(p + 5 * stride), 5);
    if (n > 6) v = _mm_insert_epi16(v, ld16(p + 6 * stride), 6);
    if (n > 7) v = _mm_insert_epi16(v, ld16(p + 7 * stride), 7);
    return v;
}

// A whole group of 18-byte blocks (Q4_0, IQ4_NL: a float16 d, then 16 bytes of nibbles) is 144
// bytes = 72 16-bit words, read as three vectors (words 0-31, 32-63, 40-71: nothing past the group)
// and taken apart by word permutes: block j's d is word 9j, its nibbles words 9j+1..9j+8. The 8
// d's by one permute, the nibbles of blocks 0-3 and 4-7 by one each (a block a 128-bit lane), then
// the nibbles of blocks j and j + 4 interleaved by 16-bit pairs and widened: the 8 vectors of the
// nibble-lane layout (slot_nibble_lanes) in 16 operations after the loads. (Through the chunk
// codes and block_lanes it took 24; word by word from the block reads, ~80 a group, which held a
// one-row Q4_0 matmul below the memory's speed: 22 GB/s on 2 cores against Q4_K's 27.) Q4_1's
// 20-byte blocks go the same way (below). Against the chunk order (ffd749f), one row of Q4_0,
// Q4_1 and IQ4_NL took 0.77-0.90x the time (kvk_matmul of both libraries in one process).
static const int16_t Q40_D_WORDS[32] = {0, 9, 18, 27, 36, 45, 54, 63};
static const int16_t Q40_NIBBLE_WORDS[2][32] = {
    // blocks 0-3 from words 0-63 (vectors 0, 1): 1-8, 10-17, 19-26, 28-35
    {1, 2, 3, 4, 5, 6, 7, 8, 10, 11, 12, 13, 14, 15, 16, 17,
     19, 20, 21, 22, 23, 24, 25, 26, 28, 29, 30, 31, 32, 33, 34, 35},
    // blocks 4-7 from words 32-63 (vector 1: 0-31) and 40-71 (vector 2: 32 + word - 40): 37-44,
    // 46-53, 55-62, 64-71
    {5, 6, 7, 32, 33, 34, 35, 36, 38, 39, 40, 41, 42, 43, 44, 45,
     47, 48, 49, 50, 51, 52, 53, 54, 56, 57, 58, 59, 60, 61, 62, 63}};

// Q4_1's 20-byte blocks (d, m, 16 bytes of nibbles): a group is 160 bytes = 80 words, read as words
// 0-31, 32-63 and 48-79; block j's (d, m) is 32-bit word 5j, its nibbles words 10j+2..10j+9.
static const int32_t Q41_DM_DWORDS[16] = {0, 5, 10, 15, 20, 25, 30, 35 - 24};  // the last: v2's dword 11
static const int16_t Q41_NIBBLE_WORDS[2][32] = {
    // blocks 0-3 from words 0-63 (vectors 0, 1): 2-9, 12-19, 22-29, 32-39
    {2, 3, 4, 5, 6, 7, 8, 9, 12, 13, 14, 15, 16, 17, 18, 19,
     22, 23, 24, 25, 26, 27, 28, 29, 32, 33, 34, 35, 36, 37, 38, 39},
    // blocks 4-7 from words 32-63 (vector 1: 0-31) and 48-79 (vector 2: 32 + word - 48): 42-49,
    // 52-59, 62-69, 72-79
    {10, 11, 12, 13, 14, 15, 16, 17, 20, 21, 22, 23, 24, 25, 26, 27,
     30, 31, 48, 49, 50, 51, 52, 53, 56, 57, 58, 59, 60, 61, 62, 63}};

// A whole group of Q4_0, Q4_1 or IQ4_NL blocks (bytes: 18 or 20) as the nibble-lane layout's 8
// vectors, its block scales d8 and b terms o8.
static inline __attribute__((always_inline)) void nibble_lanes(const int t, const int bytes, const uint8_t *b,
                                                               __m512i *w, __m256 *d8, __m256 *o8) {
    const __m512i v0 = _mm512_loadu_si512((const void *)b);
    const __m512i v1 = _mm512_loadu_si512((const void *)(b + 64));
    const __m512i v2 = _mm512_loadu_si512((const void *)(b + 8 * bytes - 64));
    __m512i q[2];
    if (bytes == 20) {
        // (d, m) of blocks 0-6 from dwords 0-31, block 7's from v2 (dwords 24-39)
        const __m512i pick = _mm512_loadu_si512((const void *)Q41_DM_DWORDS);
        __m512i dm = _mm512_permutex2var_epi32(v0, pick, v1);
        dm = _mm512_mask_permutexvar_epi32(dm, (__mmask16)0x80, pick, v2);
        *d8 = _mm256_cvtph_ps(_mm256_castsi256_si128(_mm512_cvtepi32_epi16(dm)));
        *o8 = _mm256_cvtph_ps(_mm256_castsi256_si128(_mm512_cvtepi32_epi16(_mm512_srli_epi32(dm, 16))));
        q[0] = _mm512_permutex2var_epi16(v0, _mm512_loadu_si512((const void *)Q41_NIBBLE_WORDS[0]), v1);
        q[1] = _mm512_permutex2var_epi16(v1, _mm512_loadu_si512((const void *)Q41_NIBBLE_WORDS[1]), v2);
    } else {
        const __m512i d = _mm512_permutex2var_epi16(v0, _mm512_loadu_si512((const void *)Q40_D_WORDS), v1);
        *d8 = _mm256_cvtph_ps(_mm512_castsi512_si128(d));
        *o8 = _mm256_mul_ps(*d8, _mm256_set1_ps(t == T_Q4_0 ? -8.0f : -128.0f));
        q[0] = _mm512_permutex2var_epi16(v0, _mm512_loadu_si512((const void *)Q40_NIBBLE_WORDS[0]), v1);
        q[1] = _mm512_permutex2var_epi16(v1, _mm512_loadu_si512((const void *)Q40_NIBBLE_WORDS[1]), v2);
    }
    const __m512i m4 = _mm512_set1_epi8(0x0f), z = _mm512_setzero_si512();
    const __m512i iq4 = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)IQ4_CODES));
    for (int n = 0; n < 2; n++) {
        __m512i c[2];
        for (int h = 0; h < 2; h++) {
            const __m512i nib = n ? _mm512_and_si512(_mm512_srli_epi16(q[h], 4), m4) : _mm512_and_si512(q[h], m4);
            c[h] = t == T_IQ4_NL ? _mm512_shuffle_epi8(iq4, nib) : nib;  // its table
        }
        for (int s = 0; s < 2; s++) {
            const __m512i u = s ? _mm512_unpackhi_epi16(c[0], c[1]) : _mm512_unpacklo_epi16(c[0], c[1]);
            w[4 * n + 2 * s] = _mm512_unpacklo_epi8(u, z);
            w[4 * n + 2 * s + 1] = _mm512_unpackhi_epi8(u, z);
        }
    }
}

// Group g (chunks 4g.. of the row; blocks 8g.., nb of them: 8 but in a row's last group) of a
// 32-weight-type row: codes, lane scales, and the b of each block into o (the 8 scales of the group
// converted at once). Returns its chunks. The callers pass nb = 8 as a constant for every full
// group, so the compiler unrolls its chunks and keeps them in registers (with a variable count
// they went through the stack: one row of Q4_0 at 12 GB/s against 20).
static inline __attribute__((always_inline)) int group32(const int t, const int bytes, const uint8_t *row,
                                                         int64_t g, const int nb, group_t *G, float *o) {
    const int64_t first = 8 * g;
    // the 8 halves in one register (halves8: inserts straight from memory)
    const __m256 d8 = _mm256_cvtph_ps(halves8(row + first * bytes, bytes, nb));
    __m256 o8;
    if (t == T_Q4_1 || t == T_Q5_1) o8 = _mm256_cvtph_ps(halves8(row + first * bytes + 2, bytes, nb));
    else o8 = _mm256_mul_ps(d8, _mm256_set1_ps(t == T_Q4_0 ? -8.0f : t == T_Q5_0 ? -16.0f : -128.0f));
    _mm256_storeu_ps(o + first, o8);  // blocks past the row's end (a tail's twin) have d = 0: b = 0
    G->d8 = d8;
    const int nch = (nb + 1) / 2;
    for (int ch = 0; ch < nch; ch++) {
        const uint8_t *A = row + (first + 2 * ch) * bytes;
        const uint8_t *B = 2 * ch + 1 < nb ? A + bytes : ZERO_BLOCK;  // a tail block's zero twin
        G->codes[ch] = codes32_natural(t, A, B);
    }
    return nch;
}

// The Q4_K/Q5_K scale bytes -> [sc0..sc7, m0..m7] in one register (get_scale_min_k4's values; reads
// 16 bytes at s). Unpacked with scalar operations they went through the stack: a third of a one-row
// Q4_K matmul's instructions.
static inline __m128i k4_scales_simd(const uint8_t *s) {
    const __m128i v = _mm_loadu_si128((const __m128i *)s);  // A = s[0..4), B = s[4..8), C = s[8..12)
    const __m128i acbc = _mm_shuffle_epi8(v, _mm_setr_epi8(0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 8, 9, 10, 11));
    const __m128i _a_b = _mm_shuffle_epi8(v, _mm_setr_epi8(-1, -1, -1, -1, 0, 1, 2, 3, -1, -1, -1, -1, 4, 5, 6, 7));
    // sc0-3 = A & 63, sc4-7 = C & 15 | (A >> 2) & 0x30, m0-3 = B & 63, m4-7 = C >> 4 | (B >> 2) & 0x30
    const __m128i low = _mm_and_si128(acbc, _mm_setr_epi8(63, 63, 63, 63, 15, 15, 15, 15, 63, 63, 63, 63, 0, 0, 0, 0));
    const __m128i high_nibble = _mm_and_si128(_mm_srli_epi16(acbc, 4),
                                              _mm_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 15, 15, 15, 15));
    const __m128i top = _mm_and_si128(_mm_srli_epi16(_a_b, 2), _mm_setr_epi8(0, 0, 0, 0, 0x30, 0x30, 0x30, 0x30, 0, 0,
                                                                            0, 0, 0x30, 0x30, 0x30, 0x30));
    return _mm_or_si128(_mm_or_si128(low, high_nibble), top);
}

// A Q4_K/Q5_K super-block's [sc0..7, m0..7] (k4_scales_simd), its d, and each sub-block's
// b = -(dmin * m) into o[0..8) (exactly: one rounding).
static inline __m128i k4_header(const uint8_t *b, float *d, float *o) {
    const __m128i scmn = k4_scales_simd(b + 4);
    *d = rd_f16(b);
    const float dmin = rd_f16(b + 2);
    const __m256 m = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(scmn, 8)));
    _mm256_storeu_ps(o, _mm256_mul_ps(m, _mm256_set1_ps(-dmin)));
    return scmn;
}

static inline __m512i lane_scales16(__m256i s16, int ch, int per_chunk) {
    // i16 scales of the sub-blocks -> per i16 lane (2 weights) of chunk ch
    static const int16_t idx32[4][32] = {
        {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1},
        {2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3},
        {4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5},
        {6, 6, 6, 6, 6, 6, 6, 6, 6, 6, 6, 6, 6, 6, 6, 6, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7}};
    static const int16_t idx16[4][32] = {
        {0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3},
        {4, 4, 4, 4, 4, 4, 4, 4, 5, 5, 5, 5, 5, 5, 5, 5, 6, 6, 6, 6, 6, 6, 6, 6, 7, 7, 7, 7, 7, 7, 7, 7},
        {8, 8, 8, 8, 8, 8, 8, 8, 9, 9, 9, 9, 9, 9, 9, 9, 10, 10, 10, 10, 10, 10, 10, 10, 11, 11, 11, 11, 11, 11, 11, 11},
        {12, 12, 12, 12, 12, 12, 12, 12, 13, 13, 13, 13, 13, 13, 13, 13, 14, 14, 14, 14, 14, 14, 14, 14, 15, 15, 15, 15, 15, 15, 15, 15}};
    const int16_t *idx = per_chunk == 2 ? idx32[ch] : idx16[ch];
    return _mm512_permutexvar_epi16(_mm512_loadu_si512((const void *)idx), _mm512_castsi256_si512(s16));
}

// A super-block: codes in weight order, its integer lane scales, d, and each sub-block's b into o
// (the types with a minimum: Q4_K, Q5_K, Q2_K). `centered`: the symmetric types' codes as signed
// bytes c - mid (Q6_K, Q3_K; IQ4_XS its table's values), which the 16-bit product takes with no b
// term; else unsigned (the float paths, which decode with block_scales' a and b).
static inline __attribute__((always_inline)) void group256(const int t, const uint8_t *b, group_t *G, float *o,
                                                           const int centered) {
    const __m512i m4 = _mm512_set1_epi8(0x0f);
    const __m256i m3 = _mm256_set1_epi8(3), one = _mm256_set1_epi8(1);
    switch (t) {
        case T_Q4_K: case T_Q5_K: {
            const __m128i scmn = k4_header(b, &G->d, o);  // [sc0..7, m0..7]
            const __m256i s16 = _mm256_cvtepu8_epi16(scmn);
            const uint8_t *qs = b + (t == T_Q5_K ? 48 : 16);
            for (int h = 0; h < 2; h++) {
                __m512i v = _mm512_loadu_si512((const void *)(qs + 64 * h));
                __m512i lo = _mm512_and_si512(v, m4), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), m4);
                G->codes[2 * h] = _mm512_shuffle_i64x2(lo, hi, _MM_SHUFFLE(1, 0, 1, 0));
                G->codes[2 * h + 1] = _mm512_shuffle_i64x2(lo, hi, _MM_SHUFFLE(3, 2, 3, 2));
            }
            if (t == T_Q5_K) {
                __m256i qh = _mm256_loadu_si256((const __m256i *)(b + 16));
                for (int ch = 0; ch < 4; ch++) {
                    __m256i b0 = _mm256_and_si256(_mm256_srli_epi16(qh, 2 * ch), one);
                    __m256i b1 = _mm256_and_si256(_mm256_srli_epi16(qh, 2 * ch + 1), one);
                    __m512i hb = _mm512_inserti64x4(_mm512_castsi256_si512(b0), b1, 1);
                    G->codes[ch] = _mm512_or_si512(G->codes[ch], _mm512_slli_epi16(hb, 4));
                }
            }
            for (int ch = 0; ch < 4; ch++) G->sc[ch] = lane_scales16(s16, ch, 2);
            return;
        }
        case T_IQ4_XS: {
            int8_t sc[8];
            iq4xs_scales(b, sc);
            G->d = rd_f16(b);
            const __m256i s16 = _mm256_cvtepi8_epi16(_mm_loadl_epi64((const __m128i *)sc));
            const __m256i m4y = _mm256_set1_epi8(0x0f);
            const __m512i table =
                _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)(centered ? IQ4_VALUES : IQ4_CODES)));
            for (int ch = 0; ch < 4; ch++) {
                __m256i q = _mm256_loadu_si256((const __m256i *)(b + 8 + 32 * ch));
                __m256i lo = _mm256_and_si256(q, m4y), hi = _mm256_and_si256(_mm256_srli_epi16(q, 4), m4y);
                __m512i tt = _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
                G->codes[ch] = _mm512_shuffle_epi8(table, _mm512_shuffle_i64x2(tt, tt, _MM_SHUFFLE(3, 1, 2, 0)));
                G->sc[ch] = lane_scales16(s16, ch, 2);
            }
            return;
        }
        default: {  // Q6_K, Q3_K, Q2_K: 16-weight sub-blocks; chunk ch = half ch>>1, sub-blocks s0, s0+1
            __m256i s16;
            if (t == T_Q6_K) {
                G->d = rd_f16(b + 208);
                const __m128i sc8 = _mm_loadu_si128((const __m128i *)(b + 192));
                s16 = _mm256_cvtepi8_epi16(sc8);
            } else if (t == T_Q3_K) {
                int8_t sc[16];
                q3k_scales(b + 96, sc);
                G->d = rd_f16(b + 108);
                const __m128i sc8 = _mm_loadu_si128((const __m128i *)sc);
                s16 = _mm256_cvtepi8_epi16(sc8);
            } else {  // Q2_K
                G->d = rd_f16(b + 80);
                const float dmin = rd_f16(b + 82);
                const __m128i raw = _mm_loadu_si128((const __m128i *)b);
                s16 = _mm256_cvtepu8_epi16(_mm_and_si128(raw, _mm_set1_epi8(0x0f)));
                const __m128i mn = _mm_and_si128(_mm_srli_epi16(raw, 4), _mm_set1_epi8(0x0f));
                _mm512_storeu_ps(o, _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(mn)), _mm512_set1_ps(-dmin)));
            }
            for (int ch = 0; ch < 4; ch++) {
                const int h = ch >> 1, s0 = 2 * (ch & 1);
                if (t == T_Q6_K) {
                    __m512i ql = _mm512_loadu_si512((const void *)(b + 64 * h));
                    __m512i nib = (ch & 1) ? _mm512_and_si512(_mm512_srli_epi16(ql, 4), m4) : _mm512_and_si512(ql, m4);
                    __m256i q = _mm256_loadu_si256((const __m256i *)(b + 128 + 32 * h));
                    __m256i h0 = _mm256_and_si256(_mm256_srli_epi16(q, 2 * s0), m3);
                    __m256i h1 = _mm256_and_si256(_mm256_srli_epi16(q, 2 * s0 + 2), m3);
                    __m512i hi = _mm512_inserti64x4(_mm512_castsi256_si512(h0), h1, 1);
                    G->codes[ch] = _mm512_or_si512(nib, _mm512_slli_epi16(hi, 4));
                    if (centered) G->codes[ch] = _mm512_sub_epi8(G->codes[ch], _mm512_set1_epi8(32));
                } else {
                    __m256i q = _mm256_loadu_si256((const __m256i *)(b + (t == T_Q3_K ? 32 : 16) + 32 * h));
                    __m256i low0 = _mm256_and_si256(_mm256_srli_epi16(q, 2 * s0), m3);
                    __m256i low1 = _mm256_and_si256(_mm256_srli_epi16(q, 2 * s0 + 2), m3);
                    __m512i cc = _mm512_inserti64x4(_mm512_castsi256_si512(low0), low1, 1);
                    if (t == T_Q3_K) {
                        __m256i hm = _mm256_loadu_si256((const __m256i *)b);
                        __m256i hb0 = _mm256_and_si256(_mm256_srli_epi16(hm, 2 * ch), one);
                        __m256i hb1 = _mm256_and_si256(_mm256_srli_epi16(hm, 2 * ch + 1), one);
                        __m512i hb = _mm512_inserti64x4(_mm512_castsi256_si512(hb0), hb1, 1);
                        cc = _mm512_or_si512(cc, _mm512_slli_epi16(hb, 2));
                    }
                    G->codes[ch] = t == T_Q3_K && centered ? _mm512_sub_epi8(cc, _mm512_set1_epi8(4)) : cc;
                }
                G->sc[ch] = lane_scales16(s16, ch, 4);
            }
        }
    }
}

// ---- the 16-bit product ----------------------------------------------------------------------
// A group's weights as 16-bit lanes for vpdpwssd (32 products an instruction) against the
// activations' chunks: chunk ch's 64 codes widened to a low and a high vector in the activations'
// order (slot_of), for the K-quants times their sub-block scales (exact: at most 4096), for the
// 32-weight types as they are, with the float scale of each 32-bit lane's block beside them; a
// 32-weight type's whole group as the 8 vectors of its lane layout (slot_in) and one of scales.
typedef struct {
    __m512i w[8];  // chunk ch: w[2 ch] against the activations' low vector, w[2 ch + 1] the high
    __m512 f[4];   // 32-weight types: chunk ch's 32-bit lanes' block scales (8 lanes a block); a
                   // whole group: f[0], its lanes' (LANE_BLOCKS)
    float d;       // K-quants: the super-block's scale
} wgroup_t;

// acc += the pairwise products of a and b's 16-bit lanes (vpdpwssd), in place. GCC 12 kept each
// accumulator of the intrinsic in another register and moved it in and out around every product
// (two moves a product in a prompt's tiles: a Q4_K layer at 250 GF/s instead of 300+).
static inline __attribute__((always_inline)) __m512i dpwssd(__m512i acc, __m512i a, __m512i b) {
    __asm__("vpdpwssd %2, %1, %0" : "+v"(acc) : "v"(a), "v"(b));
    return acc;
}

static inline __attribute__((always_inline)) void widen16(const int centered, __m512i c, __m512i *lo, __m512i *hi) {
    const __m512i z = _mm512_setzero_si512();
    if (centered) {  // signed bytes: into the high byte, then an arithmetic shift
        *lo = _mm512_srai_epi16(_mm512_unpacklo_epi8(z, c), 8);
        *hi = _mm512_srai_epi16(_mm512_unpackhi_epi8(z, c), 8);
    } else {
        *lo = _mm512_unpacklo_epi8(c, z);
        *hi = _mm512_unpackhi_epi8(c, z);
    }
}

// Q4_K's lane scales for half H: [sc(4H) x 16 | sc(4H + 2) x 16] (the low nibbles of a lane's
// bytes), [sc(4H + 1) x 16 | sc(4H + 3) x 16] (the high ones).
static const int16_t Q4K_SCALE_PICK[4][32] = {
    {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2},
    {1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3},
    {4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 6, 6, 6, 6, 6, 6, 6, 6, 6, 6, 6, 6, 6, 6, 6, 6},
    {5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7}};

// A whole group's 4 chunks of byte codes (blocks 2c, 2c + 1 in chunk c, in weight order) as the 8
// vectors of 16-bit weights of the block-lane layout (slot_block_lanes): the chunks' 16-bit pairs
// interleaved, then their 32-bit pairs, then widened, so that vector W, lane 4i + c holds pair W of
// quarter i of chunk c. 16 operations; the chunk layout's widening took 8, and the products saved
// are 3 conversions and 3 scalings per output and group.
static inline __attribute__((always_inline)) void block_lanes(const __m512i *codes, __m512i *w) {
    const __m512i z = _mm512_setzero_si512();
    const __m512i u01[2] = {_mm512_unpacklo_epi16(codes[0], codes[1]), _mm512_unpackhi_epi16(codes[0], codes[1])};
    const __m512i u23[2] = {_mm512_unpacklo_epi16(codes[2], codes[3]), _mm512_unpackhi_epi16(codes[2], codes[3])};
    for (int s1 = 0; s1 < 2; s1++)
        for (int s2 = 0; s2 < 2; s2++) {
            const __m512i d = s2 ? _mm512_unpackhi_epi32(u01[s1], u23[s1]) : _mm512_unpacklo_epi32(u01[s1], u23[s1]);
            w[4 * s1 + 2 * s2] = _mm512_unpacklo_epi8(d, z);
            w[4 * s1 + 2 * s2 + 1] = _mm512_unpackhi_epi8(d, z);
        }
}

// The vectors of a whole group of a 32-weight type in either lane layout: its 8 vectors of 16-bit
// weights and one of lane scales.
enum { LANES32 = 8 };

// Group g of a row as 16-bit weights, and its b terms into o (the 32-weight types' 8 per group,
// the K-quants' 256 / sub). nb: the group's blocks (32-weight types). Returns its chunks, or
// LANES32 for a 32-weight type's whole group (nibble or block lanes).
static inline __attribute__((always_inline)) int prepare16(const int t, const int bytes, const int act, const int sub,
                                                           const uint8_t *row, int64_t g, const int nb,
                                                           wgroup_t *W, float *o) {
    group_t G;
    if (act == 32 && nibble_lane_type(t) && nb == 8) {  // Q4_0, Q4_1, IQ4_NL, a whole group
        __m256 d8, o8;
        nibble_lanes(t, bytes, row + 8 * g * bytes, W->w, &d8, &o8);
        _mm256_storeu_ps(o + 8 * g, o8);
        W->f[0] = _mm512_permutexvar_ps(_mm512_loadu_si512((const void *)LANE_BLOCKS[1]), _mm512_castps256_ps512(d8));
        return LANES32;
    }
    if (act == 32) {
        const int nch = group32(t, bytes, row, g, nb, &G, o);
        const __m512 d8 = _mm512_castps256_ps512(G.d8);
        if (nb == 8) {
            block_lanes(G.codes, W->w);
            W->f[0] = _mm512_permutexvar_ps(_mm512_loadu_si512((const void *)LANE_BLOCKS[0]), d8);
            return LANES32;
        }
        for (int ch = 0; ch < nch; ch++) {
            widen16(0, G.codes[ch], &W->w[2 * ch], &W->w[2 * ch + 1]);
            // lanes 0-7 take block 2ch's scale, 8-15 block 2ch + 1's
            const __m512i pick = _mm512_setr_epi32(2 * ch, 2 * ch, 2 * ch, 2 * ch, 2 * ch, 2 * ch, 2 * ch, 2 * ch,
                                                   2 * ch + 1, 2 * ch + 1, 2 * ch + 1, 2 * ch + 1, 2 * ch + 1,
                                                   2 * ch + 1, 2 * ch + 1, 2 * ch + 1);
            W->f[ch] = _mm512_permutexvar_ps(pick, d8);
        }
        return nch;
    }
    if (t == T_Q4_K) {  // the lanes' four nibbles by mask and shifts, in Q4K_SLOT's order
        const uint8_t *b = row + g * bytes;
        const __m128i scmn = k4_header(b, &W->d, o + g * 8);
        const __m512i s16 = _mm512_castsi256_si512(_mm256_cvtepu8_epi16(scmn));
        const __m512i m4 = _mm512_set1_epi16(0x000f);
        for (int H = 0; H < 2; H++) {
            const __m512i v = _mm512_loadu_si512((const void *)(b + 16 + 64 * H));
            // lanes 0-15 read sub-block 4H (+1 for the high nibbles), 16-31 sub-block 4H + 2 (+1)
            const __m512i even = _mm512_permutexvar_epi16(_mm512_loadu_si512((const void *)Q4K_SCALE_PICK[2 * H]), s16);
            const __m512i odd = _mm512_permutexvar_epi16(_mm512_loadu_si512((const void *)Q4K_SCALE_PICK[2 * H + 1]), s16);
            W->w[4 * H] = _mm512_mullo_epi16(_mm512_and_si512(v, m4), even);
            W->w[4 * H + 1] = _mm512_mullo_epi16(_mm512_and_si512(_mm512_srli_epi16(v, 4), m4), odd);
            W->w[4 * H + 2] = _mm512_mullo_epi16(_mm512_and_si512(_mm512_srli_epi16(v, 8), m4), even);
            W->w[4 * H + 3] = _mm512_mullo_epi16(_mm512_srli_epi16(v, 12), odd);
        }
        return 4;
    }
    group256(t, row + g * bytes, &G, o + g * (256 / sub), 1);
    for (int ch = 0; ch < 4; ch++) {
        __m512i lo, hi;
        widen16(centered_type(t), G.codes[ch], &lo, &hi);
        W->w[2 * ch] = _mm512_mullo_epi16(lo, G.sc[ch]);
        W->w[2 * ch + 1] = _mm512_mullo_epi16(hi, G.sc[ch]);
    }
    W->d = G.d;
    return 4;
}

// Group g's products for NWc weight rows (W[0..NWc)) and RTc activation rows from r0, added into
// acc [w * RTc + r] (registers: the shapes are compile-time constants). Per output, whatever the
// shapes: the group summed in int32, then acc += float(sum) * (d * dx) for the K-quants, float(sum)
// * (a * dx) for a 32-weight type's whole group (a: its lanes' block scales); a row's last,
// shorter group of a 32-weight type chunk by chunk, each converted and scaled by its blocks' a,
// then the group's sum times dx. Half a chunk at a time: the NWc weight vectors and RTc
// activation vectors of a half are loaded once into registers, then every pair multiplied (a tile of 4 x 4 reads 8 vectors
// for 16 products; loading a vector for each product bound it by loads).
static inline __attribute__((always_inline)) void compute16(const int act, const int NWc, const int RTc,
                                                            const wgroup_t *W, int nch, const uint8_t *A,
                                                            const act_layout *l, int64_t g, int64_t r0,
                                                            __m512 *acc) {
    const int16_t *x[SEQUENTIAL_ROWS];
    for (int r = 0; r < RTc; r++) x[r] = (const int16_t *)(A + (r0 + r) * l->stride) + 256 * g;
    if (act == 32 && nch < LANES32) {  // a row's last, shorter group: chunk by chunk
        __m512 part[MAXT];
        for (int i = 0; i < NWc * RTc; i++) part[i] = _mm512_setzero_ps();
        for (int ch = 0; ch < nch; ch++)
            for (int r = 0; r < RTc; r++) {  // (here a row's two vectors against each weight row measured best)
                const __m512i xl = _mm512_loadu_si512((const void *)(x[r] + 64 * ch));
                const __m512i xh = _mm512_loadu_si512((const void *)(x[r] + 64 * ch + 32));
                for (int w = 0; w < NWc; w++) {
                    const __m512i dp = dpwssd(_mm512_madd_epi16(W[w].w[2 * ch], xl), W[w].w[2 * ch + 1], xh);
                    part[w * RTc + r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dp), W[w].f[ch], part[w * RTc + r]);
                }
            }
        for (int r = 0; r < RTc; r++) {
            const __m512 dr = _mm512_set1_ps(((const float *)(A + (r0 + r) * l->stride + l->off_dx))[g]);
            for (int w = 0; w < NWc; w++) acc[w * RTc + r] = _mm512_fmadd_ps(part[w * RTc + r], dr, acc[w * RTc + r]);
        }
        return;
    }
    // A few outputs (a decode row) sum their super-block in SPLIT independent int32 chains, added at
    // the end: one chain of 8 vpdpwssd (4-5 cycles each) bound a one-row Q4_K matmul by its
    // latency (11.5 GB/s a core). Integer sums: the same value however they are split.
    const int SPLIT = NWc * RTc <= 2 ? 4 : 1;
    __m512i isum[MAXT * 4];
    for (int ch = 0; ch < 4; ch++)
        for (int h = 0; h < 2; h++) {
            const int v = 2 * ch + h, part = v % SPLIT;
            __m512i xv[SEQUENTIAL_ROWS], wv[NW];
            for (int r = 0; r < RTc; r++) xv[r] = _mm512_loadu_si512((const void *)(x[r] + 64 * ch + 32 * h));
            for (int w = 0; w < NWc; w++) wv[w] = W[w].w[v];
            for (int w = 0; w < NWc; w++)
                for (int r = 0; r < RTc; r++) {
                    __m512i *sum = &isum[(w * RTc + r) * SPLIT + part];
                    *sum = v >= SPLIT ? dpwssd(*sum, wv[w], xv[r]) : _mm512_madd_epi16(wv[w], xv[r]);
                }
        }
    for (int i = 0; i < NWc * RTc && SPLIT == 4; i++)
        isum[i * 4] = _mm512_add_epi32(_mm512_add_epi32(isum[i * 4], isum[i * 4 + 1]),
                                       _mm512_add_epi32(isum[i * 4 + 2], isum[i * 4 + 3]));
    for (int r = 0; r < RTc; r++) {
        const float dr = ((const float *)(A + (r0 + r) * l->stride + l->off_dx))[g];
        for (int w = 0; w < NWc; w++) {
            const __m512 scale = act == 32 ? _mm512_mul_ps(W[w].f[0], _mm512_set1_ps(dr)) : _mm512_set1_ps(W[w].d * dr);
            acc[w * RTc + r] =
                _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[(w * RTc + r) * SPLIT]), scale, acc[w * RTc + r]);
        }
    }
}

// An output's 16 lanes summed: (lanes i + i+8), then (i + i+4), then (0 + 2) + (1 + 3). One
// order everywhere, written out so that reduce16x16 (a tile's 16 outputs at once) keeps it.
static inline float reduce16(__m512 a) {
    const __m256 t = _mm256_add_ps(_mm512_castps512_ps256(a), _mm512_extractf32x8_ps(a, 1));
    const __m128 u = _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));
    const __m128 v = _mm_add_ps(u, _mm_movehl_ps(u, u));
    return _mm_cvtss_f32(_mm_add_ss(v, _mm_movehdup_ps(v)));
}

// reduce16 of 16 vectors into s[0..16), by transposing as it adds (45 operations for 16 outputs,
// against ~8 each alone), with reduce16's pairs: its bits.
static inline __attribute__((always_inline)) void reduce16x16(const __m512 *a, float *s) {
    __m512 T[8], U[4], S[2];
    for (int k = 0; k < 8; k++)
        T[k] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * k], a[2 * k + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm512_shuffle_f32x4(a[2 * k], a[2 * k + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    for (int m = 0; m < 4; m++)
        U[m] = _mm512_add_ps(_mm512_shuffle_f32x4(T[2 * m], T[2 * m + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                             _mm512_shuffle_f32x4(T[2 * m], T[2 * m + 1], _MM_SHUFFLE(3, 1, 3, 1)));
    for (int n = 0; n < 2; n++)
        S[n] = _mm512_add_ps(_mm512_shuffle_ps(U[2 * n], U[2 * n + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm512_shuffle_ps(U[2 * n], U[2 * n + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    const __m512 R = _mm512_add_ps(_mm512_shuffle_ps(S[0], S[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                   _mm512_shuffle_ps(S[0], S[1], _MM_SHUFFLE(3, 1, 3, 1)));
    float r[16];
    _mm512_storeu_ps(r, R);
    for (int j = 0; j < 4; j++)
        for (int e = 0; e < 4; e++) s[4 * e + j] = r[4 * j + e];  // lane j, element e: output 4e + j
}

// The b terms (types with a minimum or unsigned codes: sum_j b_j * xs_j) of NWc weight rows (o,
// ostride apart) against RTc activation rows from r0, each output's in 16 lanes, b [w * RTc + r];
// the outputs' chains side by side (one chain at a time was a quarter of a Q4_K tile's time).
static inline __attribute__((always_inline)) void b_terms(const int NWc, const int RTc, const float *o,
                                                          const int64_t ostride, const uint8_t *A,
                                                          const act_layout *l, int64_t r0, int64_t subs,
                                                          __m512 *b) {
    const float *xs[SEQUENTIAL_ROWS];
    for (int r = 0; r < RTc; r++) xs[r] = (const float *)(A + (r0 + r) * l->stride + l->off_xs);
    for (int i = 0; i < NWc * RTc; i++) b[i] = _mm512_setzero_ps();
    for (int64_t j = 0; j < subs; j += 16) {
        const __mmask16 m = subs - j >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (subs - j)) - 1);
        for (int w = 0; w < NWc; w++) {
            const __m512 ow = _mm512_maskz_loadu_ps(m, o + w * ostride + j);
            for (int r = 0; r < RTc; r++)
                b[w * RTc + r] = _mm512_fmadd_ps(ow, _mm512_maskz_loadu_ps(m, xs[r] + j), b[w * RTc + r]);
        }
    }
}

static inline int has_b_terms(const int t, const int act) { return !(act == 256 && centered_type(t)); }

// An output's last step: its lanes summed, and its b terms'.
static inline __attribute__((always_inline)) float finish(const int t, const int act, __m512 acc, const float *o,
                                                          const uint8_t *arow, const act_layout *l, int64_t subs) {
    const float s = reduce16(acc);
    if (!has_b_terms(t, act)) return s;
    __m512 b;
    b_terms(1, 1, o, 0, arow, l, 0, subs, &b);
    return s + reduce16(b);
}

// The blocks of group g: 8 (a K-quant super-block counts as 8), fewer in a 32-weight row's last.
static inline int group_blocks(const int act, int64_t k, int64_t g) {
    if (act == 256) return 8;
    const int64_t left = k / 32 - 8 * g;
    return left < 8 ? (int)left : 8;
}

// Q4_K, one activation row (a decode): the codes' products summed per pair of vectors that share
// their sub-blocks, then times the scales in 32 bits (vpmulld), not the codes times the scales in
// 16 bits first: 12 multiplies a super-block instead of 16 (they share one pipe with the products,
// one a cycle). The same integer as prepare16 + compute16 give (exact sums), so the same bits.
static const int32_t Q4K_SCALE_PICK32[4][16] = {{0, 0, 0, 0, 0, 0, 0, 0, 2, 2, 2, 2, 2, 2, 2, 2},
                                                {1, 1, 1, 1, 1, 1, 1, 1, 3, 3, 3, 3, 3, 3, 3, 3},
                                                {4, 4, 4, 4, 4, 4, 4, 4, 6, 6, 6, 6, 6, 6, 6, 6},
                                                {5, 5, 5, 5, 5, 5, 5, 5, 7, 7, 7, 7, 7, 7, 7, 7}};

static inline __attribute__((always_inline)) void q4k_one_row(const uint8_t *b, const uint8_t *A,
                                                              const act_layout *l, int64_t g, float *o,
                                                              __m512 *acc) {
    float d;
    const __m128i scmn = k4_header(b, &d, o + g * 8);
    const __m512i s32 = _mm512_cvtepu8_epi32(scmn);
    const __m512i m4 = _mm512_set1_epi16(0x000f);
    const int16_t *x = (const int16_t *)A + 256 * g;
    __m512i isum[2];
    for (int H = 0; H < 2; H++) {
        const __m512i v = _mm512_loadu_si512((const void *)(b + 16 + 64 * H));
        const int16_t *xh = x + 128 * H;
        const __m512i even = dpwssd(_mm512_madd_epi16(_mm512_and_si512(v, m4), _mm512_loadu_si512((const void *)xh)),
                                    _mm512_and_si512(_mm512_srli_epi16(v, 8), m4),
                                    _mm512_loadu_si512((const void *)(xh + 64)));
        const __m512i odd =
            dpwssd(_mm512_madd_epi16(_mm512_and_si512(_mm512_srli_epi16(v, 4), m4), _mm512_loadu_si512((const void *)(xh + 32))),
                   _mm512_srli_epi16(v, 12), _mm512_loadu_si512((const void *)(xh + 96)));
        isum[H] = _mm512_add_epi32(
            _mm512_mullo_epi32(even, _mm512_permutexvar_epi32(_mm512_loadu_si512((const void *)Q4K_SCALE_PICK32[2 * H]), s32)),
            _mm512_mullo_epi32(odd, _mm512_permutexvar_epi32(_mm512_loadu_si512((const void *)Q4K_SCALE_PICK32[2 * H + 1]), s32)));
    }
    const float dr = ((const float *)(A + l->off_dx))[g];
    acc[0] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(isum[0], isum[1])), _mm512_set1_ps(d * dr), acc[0]);
}

static inline __attribute__((always_inline)) void few_group16(const int t, const int bytes, const int act,
                                                              const int sub, const int NR, const int nb,
                                                              const uint8_t *row, int64_t g, const uint8_t *A,
                                                              const act_layout *l, float *o, __m512 *acc) {
    if (t == T_Q4_K && NR == 1) {
        q4k_one_row(row + g * bytes, A, l, g, o, acc);
        return;
    }
    wgroup_t W;
    const int nch = prepare16(t, bytes, act, sub, row, g, nb, &W, o);
    compute16(act, 1, NR, &W, nch, A, l, g, 0, acc);
}

// One weight row against NR <= SEQUENTIAL_ROWS activation rows (a decode step's every matmul, a
// speculative round's few rows): the weights stream from memory in one sequential run the
// hardware prefetcher follows (four interleaved rows are four short streams it never ramps up on:
// 5 GB/s against 20+), each group unpacked once for all NR rows, the accumulators in registers.
static inline __attribute__((always_inline)) void few_rows16(const int t, const int bytes, const int act,
                                                             const int sub, const int NR, const uint8_t *row,
                                                             const int64_t k, const uint8_t *A,
                                                             const act_layout *l, float *o, float *out,
                                                             const int64_t ys) {
    __m512 acc[SEQUENTIAL_ROWS];
    for (int r = 0; r < NR; r++) acc[r] = _mm512_setzero_ps();
    const int gbytes = act == 32 ? 8 * bytes : bytes;
    for (int64_t g = 0; g < l->groups; g++) {
        if (KVK_PREFETCH > 0)
            for (int q = 0; q < gbytes; q += 64)
                _mm_prefetch((const char *)(row + g * gbytes + KVK_PREFETCH + q), _MM_HINT_T0);
        const int nb = group_blocks(act, k, g);
        if (nb == 8) few_group16(t, bytes, act, sub, NR, 8, row, g, A, l, o, acc);
        else few_group16(t, bytes, act, sub, NR, nb, row, g, A, l, o, acc);  // a short last group
    }
    const int64_t subs = act == 32 ? 8 * l->groups : k / sub;
    for (int r = 0; r < NR; r++) out[r * ys] = finish(t, act, acc[r], o, A + r * l->stride, l, subs);
}

// NWc weight rows against all nr activation rows (a prompt's rows): every group of the rows
// unpacked once into `packed` [groups][NW], then for each RT activation rows the groups in order
// with the accumulators in registers. The same operations per output as few_rows16.
static inline __attribute__((always_inline)) void tile16(const int t, const int bytes, const int act, const int sub,
                                                         const int NWc, const uint8_t *const *rows, const int64_t k,
                                                         const uint8_t *A, const act_layout *l, const int64_t nr,
                                                         wgroup_t *packed, int *nchs, float *o, const int64_t ostride,
                                                         float *out, const int64_t ys) {
    const int64_t groups = l->groups;
    for (int64_t g = 0; g < groups; g++) {
        const int nb = group_blocks(act, k, g);
        for (int w = 0; w < NWc; w++)
            nchs[g] = nb == 8 ? prepare16(t, bytes, act, sub, rows[w], g, 8, &packed[g * NW + w], o + w * ostride)
                              : prepare16(t, bytes, act, sub, rows[w], g, nb, &packed[g * NW + w], o + w * ostride);
    }
    const int64_t subs = act == 32 ? 8 * groups : k / sub;
    const int RTt = act == 32 ? RT32 : RT;
    const int whole = act == 32 ? LANES32 : 4;  // a whole group's chunks
    int64_t r0 = 0;
    for (; r0 + RTt <= nr; r0 += RTt) {
        __m512 acc[MAXT];
        for (int i = 0; i < NWc * RTt; i++) acc[i] = _mm512_setzero_ps();
        for (int64_t g = 0; g < groups; g++) {
            if (nchs[g] == whole) compute16(act, NWc, RTt, &packed[g * NW], whole, A, l, g, r0, acc);
            else compute16(act, NWc, RTt, &packed[g * NW], nchs[g], A, l, g, r0, acc);
        }
        if (NWc * RTt == 16) {  // a whole tile: its 16 outputs summed at once, as finish sums each
            float sums[16], bs[16];
            reduce16x16(acc, sums);
            if (has_b_terms(t, act)) {
                __m512 b[16];
                b_terms(NWc, RTt, o, ostride, A, l, r0, subs, b);
                reduce16x16(b, bs);
                for (int i = 0; i < 16; i++) sums[i] += bs[i];
            }
            for (int w = 0; w < NWc; w++)
                for (int r = 0; r < RTt; r++) out[(r0 + r) * ys + w] = sums[w * RTt + r];
        } else {
            for (int w = 0; w < NWc; w++)
                for (int r = 0; r < RTt; r++)
                    out[(r0 + r) * ys + w] =
                        finish(t, act, acc[w * RTt + r], o + w * ostride, A + (r0 + r) * l->stride, l, subs);
        }
    }
    for (; r0 < nr; r0++) {
        __m512 acc[NW];
        for (int i = 0; i < NWc; i++) acc[i] = _mm512_setzero_ps();
        for (int64_t g = 0; g < groups; g++) {
            if (nchs[g] == whole) compute16(act, NWc, 1, &packed[g * NW], whole, A, l, g, r0, acc);
            else compute16(act, NWc, 1, &packed[g * NW], nchs[g], A, l, g, r0, acc);
        }
        for (int w = 0; w < NWc; w++)
            out[r0 * ys + w] = finish(t, act, acc[w], o + w * ostride, A + r0 * l->stride, l, subs);
    }
}

// A prompt's activation rows in blocks that stay in a core's L2 cache while every weight row of
// the thread passes over them (each block unpacks and reads the weights again). Without it, a
// layer whose activations outgrow L2 read all of them from L3 for every NW weight rows: a 1.7B
// model's down projection (8192 inputs, 128 rows: 2.2 MB of 16-bit codes) ran at 190-200 GMAC/s
// on Zen 5 (1 MiB L2) while its 2048-input layers (0.55 MB) ran at 300-320. Blocks of at most
// 5/8 of L2 (the rest: the unpacked weights, the outputs) measured best among 1/4-1 (1.7B
// shapes, 128 and 256 rows, kvk_matmul): the down projection 0.76-0.92 of the time it took, the
// 2048-input layers unchanged at 128 rows (one block) and 0.80-0.85 at 256. Blocks as even as
// the tiles allow, a multiple of their rows; an output's operations do not depend on its block.
static int64_t row_block_bytes(void) {
    if (row_block_override > 0) return row_block_override;
    static int64_t bytes = 0;  // a benign race: every thread computes the same value
    if (bytes == 0) {
        long l2 = 0;
#ifdef _SC_LEVEL2_CACHE_SIZE  // glibc's; elsewhere the default
        l2 = sysconf(_SC_LEVEL2_CACHE_SIZE);
#endif
        bytes = l2 > 0 ? (int64_t)l2 * 5 / 8 : 640 * 1024;
    }
    return bytes;
}

// panels.c's rows go in blocks of the same budget
int64_t kvk_row_block_budget(void) { return row_block_bytes(); }

static inline int64_t row_block(int64_t stride, int64_t nr) {
    const int64_t tile = RT == RT32 ? RT : RT * RT32;
    const int64_t budget = row_block_bytes();
    const int64_t blocks = (nr * stride + budget - 1) / budget;
    const int64_t rows = ((nr + blocks - 1) / blocks + tile - 1) / tile * tile;
    return rows < nr ? rows : nr;
}

// The weight rows [i0, i1) of one thread.
static inline __attribute__((always_inline)) void rows_typed(const int t, const int bytes, const int act, const int sub,
                                                             const uint8_t *const *rowp, const int64_t *visit,
                                                             int64_t i0, int64_t i1, int64_t k, const uint8_t *A,
                                                             const act_layout *l, int64_t nr, float *y, int64_t ys) {
    const int64_t ostride = ((k / 32 + 8) / 16 + 1) * 16 * 2;  // room for k/16 entries and a tail
    float *o = (float *)aligned_alloc(64, sizeof(float) * NW * (size_t)ostride);
    if (nr <= SEQUENTIAL_ROWS) {
#define KVK_FEW(NR)                                                                             \
    case NR:                                                                                    \
        for (int64_t v = i0; v < i1; v++) {                                                     \
            const int64_t i = visit ? visit[v] : v;                                             \
            few_rows16(t, bytes, act, sub, NR, rowp[i], k, A, l, o, y + i, ys);                 \
        }                                                                                       \
        break;
        switch (nr) { KVK_FEW(1) KVK_FEW(2) KVK_FEW(3) KVK_FEW(4) KVK_FEW(5) KVK_FEW(6) KVK_FEW(7) KVK_FEW(8) }
#undef KVK_FEW
        free(o);
        return;
    }
    wgroup_t *packed = (wgroup_t *)aligned_alloc(64, sizeof(wgroup_t) * NW * (size_t)l->groups);
    int *nchs = (int *)malloc(sizeof(int) * (size_t)l->groups);
    const int64_t block = row_block(l->stride, nr);
    for (int64_t r0 = 0; r0 < nr; r0 += block) {
        const int64_t rn = nr - r0 < block ? nr - r0 : block;
        const uint8_t *Ab = A + r0 * l->stride;
        float *yb = y + r0 * ys;
        for (int64_t i = i0; i < i1; i += NW) {
            if (i1 - i >= NW) {
                tile16(t, bytes, act, sub, NW, rowp + i, k, Ab, l, rn, packed, nchs, o, ostride, yb + i, ys);
            } else {  // the last, narrower tile: its rows one by one (the same operations per output)
                for (int64_t j = i; j < i1; j++)
                    tile16(t, bytes, act, sub, 1, rowp + j, k, Ab, l, rn, packed, nchs, o, ostride, yb + j, ys);
            }
        }
    }
    free(nchs);
    free(packed);
    free(o);
}

static void rows_avx512(int t, const uint8_t *const *rowp, const int64_t *visit, int64_t i0, int64_t i1, int64_t k,
                        const uint8_t *A, const act_layout *l, int64_t nr, float *y, int64_t ys) {
#define KVK_CASE(T, BYTES, ACT, SUB) \
    case T: rows_typed(T, BYTES, ACT, SUB, rowp, visit, i0, i1, k, A, l, nr, y, ys); return;
    switch (t) {
        KVK_CASE(T_Q4_0, 18, 32, 32)
        KVK_CASE(T_Q4_1, 20, 32, 32)
        KVK_CASE(T_Q5_0, 22, 32, 32)
        KVK_CASE(T_Q5_1, 24, 32, 32)
        KVK_CASE(T_Q8_0, 34, 32, 32)
        KVK_CASE(T_IQ4_NL, 18, 32, 32)
        KVK_CASE(T_Q2_K, 84, 256, 16)
        KVK_CASE(T_Q3_K, 110, 256, 16)
        KVK_CASE(T_Q4_K, 144, 256, 32)
        KVK_CASE(T_Q5_K, 176, 256, 32)
        KVK_CASE(T_Q6_K, 210, 256, 16)
        KVK_CASE(T_IQ4_XS, 136, 256, 32)
    }
#undef KVK_CASE
}


// F16 / BF16 against float32 activations: 16 weights decoded at a time.
static inline __m512 decode16(int t, const uint8_t *row, int64_t i) {
    if (t == T_F16) return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(row + 2 * i)));
    __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(row + 2 * i)));
    return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
}

static void dot_rows_float_avx512(int t, const uint8_t *row, int64_t k, const float *x, int64_t xs,
                                  int64_t nr, float *out, int64_t ys) {
    enum { MAXR = 8 };
    for (int64_t r0 = 0; r0 < nr; r0 += MAXR) {
        int64_t rn = nr - r0 < MAXR ? nr - r0 : MAXR;
        __m512 acc[MAXR];
        for (int r = 0; r < rn; r++) acc[r] = _mm512_setzero_ps();
        int64_t i = 0;
        for (; i + 16 <= k; i += 16) {
            __m512 w = decode16(t, row, i);
            for (int r = 0; r < rn; r++) acc[r] = _mm512_fmadd_ps(w, _mm512_loadu_ps(x + (r0 + r) * xs + i), acc[r]);
        }
        for (int r = 0; r < rn; r++) {
            float s = _mm512_reduce_add_ps(acc[r]);
            for (int64_t j = i; j < k; j++) {
                uint16_t h;
                memcpy(&h, row + 2 * j, 2);
                s += (t == T_F16 ? fp16_to_fp32(h) : bf16_to_fp32(h)) * x[(r0 + r) * xs + j];
            }
            out[(r0 + r) * ys] = s;
        }
    }
}

static inline __m512 decode_q16(__m128i codes, float a, float o, int mid) {
    __m512i ci = _mm512_cvtepu8_epi32(codes);
    if (mid >= 0) return _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(ci, _mm512_set1_epi32(mid))), _mm512_set1_ps(a));
    return _mm512_add_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(ci), _mm512_set1_ps(a)), _mm512_set1_ps(o));
}

// The 16 codes of part q (0..3) of a chunk.
static inline __m128i chunk_part(__m512i chunk, int q) {
    switch (q) {
        case 0: return _mm512_extracti32x4_epi32(chunk, 0);
        case 1: return _mm512_extracti32x4_epi32(chunk, 1);
        case 2: return _mm512_extracti32x4_epi32(chunk, 2);
        default: return _mm512_extracti32x4_epi32(chunk, 3);
    }
}

// The 16 weights of part q (0..3) of a chunk, decoded to float32 as gguf rounds them.
static inline __m512 decode_part(__m512i chunk, int q, float a, float o, int mid) {
    return decode_q16(chunk_part(chunk, q), a, o, mid);
}

// The same for a centred chunk (group256's signed codes c - mid): a * (c - mid), one rounding,
// one operation fewer (a Q6_K head's decoding bounds its one-row pass).
static inline __m512 decode_part_centred(__m512i chunk, int q, float a) {
    return _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(chunk_part(chunk, q))), _mm512_set1_ps(a));
}

// One group (256 weights, or fewer at a 32-type row's end) decoded to float32: w[0..n).
static inline __attribute__((always_inline)) int decode_group(const int t, const int bytes, const int act, const int sub,
                                                              const uint8_t *row, int64_t blocks, int64_t g, __m512 *w) {
    const int mid = symmetric_mid(t);
    if (t == T_Q8_0) {  // signed codes as stored: d * q, one rounding (exact: 11 x 8 bits)
        const int64_t first = 8 * g;
        const int nb = blocks - first < 8 ? (int)(blocks - first) : 8;
        for (int j = 0; j < nb; j++) {
            const uint8_t *A = row + (first + j) * bytes;
            const __m512 d = _mm512_set1_ps(rd_f16(A));
            w[2 * j] = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(A + 2)))), d);
            w[2 * j + 1] =
                _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(A + 18)))), d);
        }
        return 32 * nb;
    }
    if (act == 32) {
        const int64_t first = 8 * g;
        const int nb = blocks - first < 8 ? (int)(blocks - first) : 8;
        for (int j = 0; j < nb; j += 2) {
            const uint8_t *A = row + (first + j) * bytes;
            const uint8_t *B = j + 1 < nb ? A + bytes : ZERO_BLOCK;
            const __m512i c = codes32_natural(t, A, B);  // [A's 32 | B's 32] in weight order
            float aA, oA, aB, oB;
            scales32(t, A, &aA, &oA);
            scales32(t, B, &aB, &oB);
            w[2 * j] = decode_part(c, 0, aA, oA, mid);
            w[2 * j + 1] = decode_part(c, 1, aA, oA, mid);
            w[2 * j + 2] = decode_part(c, 2, aB, oB, mid);
            w[2 * j + 3] = decode_part(c, 3, aB, oB, mid);
        }
        return 32 * nb;
    }
    group_t G;
    float o[16], a[16];
    const uint8_t *b = row + g * bytes;
    group256(t, b, &G, o, 0);
    block_scales(t, b, a, o);  // the float a and b, as gguf rounds them
    for (int ch = 0; ch < 4; ch++)
        for (int q = 0; q < 4; q++) {
            const int j = (ch * 64 + q * 16) / sub;
            w[4 * ch + q] = decode_part(G.codes[ch], q, a[j], o[j], mid);
        }
    return 256;
}

// A centred type's 16 (IQ4_XS: 8) sub-block scales a = d * sc in one vector operation, the values
// block_scales computes one by one (the same products of the same floats). Its scalar loop held a
// fifth of a one-row Q6_K head's instructions (perf annotate: movsbl, cvtsi2ss, mulss per scale).
static inline void centred_scales(const int t, const uint8_t *b, float *a) {
    int8_t sc[16] = {0};
    float d;
    if (t == T_Q6_K) {
        memcpy(sc, b + 192, 16);
        d = rd_f16(b + 208);
    } else if (t == T_Q3_K) {
        q3k_scales(b + 96, sc);
        d = rd_f16(b + 108);
    } else {  // IQ4_XS
        iq4xs_scales(b, sc);
        d = rd_f16(b);
    }
    const __m512 s = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)sc)));
    _mm512_storeu_ps(a, _mm512_mul_ps(_mm512_set1_ps(d), s));
    // kept in memory: each sub-block then broadcasts its scale with a load (left in a register,
    // the compiler broadcast each with two shuffles, and the shuffle unit bounds this loop)
    __asm__ __volatile__("" : : "r"(a) : "memory");
}

// Float activations times weights decoded to float32 chunk by chunk in registers (the exact head).
// Up to F32R activation rows at a time share each decoded chunk (a speculative round's 5 rows, a
// batch's logit rows: one pass over the head; with 4 a pass, 5 rows read the head twice: 2.6x a
// row's time on a 1.7B Q6_K head).
enum { F32R = 8 };

static inline __attribute__((always_inline)) void f32_fma(const int RTc, __m512 w, const float *x, int64_t xs,
                                                          __m512 *acc) {
    for (int r = 0; r < RTc; r++) acc[r] = _mm512_fmadd_ps(w, _mm512_loadu_ps(x + r * xs), acc[r]);
}

static inline __attribute__((always_inline)) void f32_row(const int t, const int bytes, const int act, const int sub,
                                                          const int RTc, const uint8_t *row, int64_t k, const float *x,
                                                          int64_t xs, float *y, int64_t ys) {
    const int mid = symmetric_mid(t);
    __m512 acc[F32R];
    for (int r = 0; r < RTc; r++) acc[r] = _mm512_setzero_ps();
    if (t == T_Q8_0) {  // signed codes as stored: d * q, one rounding (exact: 11 x 8 bits)
        for (int64_t j = 0; j < k / 32; j++) {
            const uint8_t *A = row + j * bytes;
            if (KVK_PREFETCH > 0 && j % 2 == 0) _mm_prefetch((const char *)(A + KVK_PREFETCH), _MM_HINT_T0);
            const __m512 d = _mm512_set1_ps(rd_f16(A));
            for (int h = 0; h < 2; h++) {
                const __m512i q = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(A + 2 + 16 * h)));
                f32_fma(RTc, _mm512_mul_ps(_mm512_cvtepi32_ps(q), d), x + 32 * j + 16 * h, xs, acc);
            }
        }
    } else if (act == 32) {
        const int64_t blocks = k / 32;
        for (int64_t j = 0; j < blocks; j += 2) {
            const uint8_t *A = row + j * bytes;
            const uint8_t *B = j + 1 < blocks ? A + bytes : ZERO_BLOCK;
            if (KVK_PREFETCH > 0) _mm_prefetch((const char *)(A + KVK_PREFETCH), _MM_HINT_T0);
            const __m512i c = codes32_natural(t, A, B);  // [A's 32 | B's 32] in weight order
            float aA, oA, aB, oB;
            scales32(t, A, &aA, &oA);
            scales32(t, B, &aB, &oB);
            const int parts = j + 1 < blocks ? 4 : 2;
            for (int q = 0; q < parts; q++)
                f32_fma(RTc, decode_part(c, q, q < 2 ? aA : aB, q < 2 ? oA : oB, mid), x + 32 * j + 16 * q, xs, acc);
        }
    } else {
        for (int64_t g = 0; g < k / 256; g++) {
            group_t G;
            float o[16], a[16];
            const uint8_t *b = row + g * bytes;
            if (KVK_PREFETCH > 0)
                for (int q = 0; q < bytes; q += 64) _mm_prefetch((const char *)(b + KVK_PREFETCH + q), _MM_HINT_T0);
            const int cen = centered_type(t);
            group256(t, b, &G, o, cen);
            if (cen) centred_scales(t, b, a);  // the float a of each sub-block (b = -mid * a: unused)
            else block_scales(t, b, a, o);  // the float a and b, as gguf rounds them
            for (int ch = 0; ch < 4; ch++)
                for (int q = 0; q < 4; q++) {
                    const int j = (ch * 64 + q * 16) / sub;
                    const __m512 w = cen ? decode_part_centred(G.codes[ch], q, a[j])
                                         : decode_part(G.codes[ch], q, a[j], o[j], mid);
                    f32_fma(RTc, w, x + 256 * g + 64 * ch + 16 * q, xs, acc);
                }
        }
    }
    for (int r = 0; r < RTc; r++) y[r * ys] = _mm512_reduce_add_ps(acc[r]);
}

static inline __attribute__((always_inline)) void rows_f32_typed(const int t, const int bytes, const int act,
                                                                 const int sub, const uint8_t *const *rowp, int64_t i0, int64_t i1, int64_t k,
                                                                 const float *x, int64_t xs, int64_t nr, float *y,
                                                                 int64_t ys) {
    for (int64_t i = i0; i < i1; i++) {
        const uint8_t *row = rowp[i];
        for (int64_t r0 = 0; r0 < nr; r0 += F32R) {
            const float *xr = x + r0 * xs;
            float *yr = y + r0 * ys + i;
#define KVK_F32_ROWS(N) \
    case N: f32_row(t, bytes, act, sub, N, row, k, xr, xs, yr, ys); break;
            switch (nr - r0 < F32R ? nr - r0 : F32R) {
                KVK_F32_ROWS(1) KVK_F32_ROWS(2) KVK_F32_ROWS(3) KVK_F32_ROWS(4)
                KVK_F32_ROWS(5) KVK_F32_ROWS(6) KVK_F32_ROWS(7) KVK_F32_ROWS(8)
            }
#undef KVK_F32_ROWS
        }
    }
}

// bfloat16 of a float32, rounded to nearest even (the weights are finite).
static inline __m256i to_bf16(__m512 v) {
    __m512i bits = _mm512_castps_si512(v);
    __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    bits = _mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff)));
    return _mm512_cvtepi32_epi16(_mm512_srli_epi32(bits, 16));
}

static inline __attribute__((always_inline)) void rows_bf16_typed(const int t, const int bytes, const int act,
                                                                  const int sub, const uint8_t *const *rowp, int64_t i0, int64_t i1, int64_t k,
                                                                  uint16_t *out) {
    const int64_t groups = (k + 255) / 256, blocks = k / 32;
    for (int64_t i = i0; i < i1; i++) {
        const uint8_t *row = rowp[i];
        uint16_t *dst = out + i * k;
        for (int64_t g = 0; g < groups; g++) {
            __m512 w[16];
            const int n = decode_group(t, bytes, act, sub, row, blocks, g, w);
            for (int q = 0; q < n / 16; q++) _mm256_storeu_si256((__m256i *)(dst + 256 * g + 16 * q), to_bf16(w[q]));
        }
    }
}

#define KVK_TYPES(X)              \
    X(T_Q4_0, 18, 32, 32)         \
    X(T_Q4_1, 20, 32, 32)         \
    X(T_Q5_0, 22, 32, 32)         \
    X(T_Q5_1, 24, 32, 32)         \
    X(T_Q8_0, 34, 32, 32)         \
    X(T_IQ4_NL, 18, 32, 32)       \
    X(T_Q2_K, 84, 256, 16)        \
    X(T_Q3_K, 110, 256, 16)       \
    X(T_Q4_K, 144, 256, 32)       \
    X(T_Q5_K, 176, 256, 32)       \
    X(T_Q6_K, 210, 256, 16)       \
    X(T_IQ4_XS, 136, 256, 32)

static void rows_f32_avx512(int t, const uint8_t *const *rowp, int64_t i0, int64_t i1,
                            int64_t k, const float *x, int64_t xs, int64_t nr, float *y, int64_t ys) {
#define KVK_F32(T, BYTES, ACT, SUB) \
    case T: rows_f32_typed(T, BYTES, ACT, SUB, rowp, i0, i1, k, x, xs, nr, y, ys); return;
    switch (t) { KVK_TYPES(KVK_F32) }
#undef KVK_F32
}

static void rows_bf16_avx512(int t, const uint8_t *const *rowp, int64_t i0, int64_t i1,
                             int64_t k, uint16_t *out) {
#define KVK_BF16(T, BYTES, ACT, SUB) \
    case T: rows_bf16_typed(T, BYTES, ACT, SUB, rowp, i0, i1, k, out); return;
    switch (t) { KVK_TYPES(KVK_BF16) }
#undef KVK_BF16
}
#endif  // KVK_AVX512

#ifdef KVK_AVX512
// quantize_row's bytes, 16 inputs at a time: the same float operations (a multiply,
// round-to-nearest-even, the clamps) in the same order, so both builds quantize alike; each chunk
// of 64 then put in the kernel's order (slot_of) by two 128-bit-lane shuffles. The scalar loop ran
// on one thread before each matmul's parallel region (a 1.7B down projection's 8192 inputs: ~40
// us of a 760 us call).
// Q4_K's gather: lane L takes input 2 L (+ 1 for nibbles 2, 3) of the pair of 32-input runs.
static const int16_t Q4K_PICK[2][32] = {
    {0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30, 32, 34, 36, 38, 40, 42, 44, 46, 48, 50, 52, 54, 56, 58, 60, 62},
    {1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31, 33, 35, 37, 39, 41, 43, 45, 47, 49, 51, 53, 55, 57, 59, 61, 63}};

static void quantize_row_avx512(const float *x, const act_layout *l, uint8_t *dst) {
    int16_t *xq = (int16_t *)dst;
    float *dx = (float *)(dst + l->off_dx);
    float *xs = (float *)(dst + l->off_xs);
    const int64_t k = l->k, sub = l->sub;
    memset(dst, 0, (size_t)l->stride);
    const __m512i lim = _mm512_set1_epi32(XQ_MAX), nlim = _mm512_set1_epi32(-XQ_MAX);
    const __m512 sign = _mm512_castsi512_ps(_mm512_set1_epi32(0x7fffffff));
    int16_t natural[256] __attribute__((aligned(64)));
    for (int64_t g = 0; g < l->groups; g++) {
        const int64_t e0 = 256 * g, n = k - e0 < 256 ? k - e0 : 256;
        const float *xg = x + e0;
        __m512 m = _mm512_setzero_ps();
        for (int64_t i = 0; i < n; i += 16) m = _mm512_max_ps(_mm512_and_ps(_mm512_loadu_ps(xg + i), sign), m);  // a NaN input leaves m, as fmaxf does
        const float amax = _mm512_reduce_max_ps(m);
        const float d = amax / (float)XQ_MAX, inv = amax > 0.0f ? (float)XQ_MAX / amax : 0.0f;
        dx[g] = d;
        const __m512 vinv = _mm512_set1_ps(inv);
        memset(natural, 0, sizeof natural);
        for (int64_t j = 0; j < n / sub; j++) {
            int32_t s = 0;
            for (int64_t i = 0; i < sub; i += 16) {
                const int64_t e = j * sub + i;
                const __m512 v = _mm512_loadu_ps(xg + e);
                __m512i q = _mm512_cvtps_epi32(_mm512_roundscale_ps(_mm512_mul_ps(v, vinv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
                q = _mm512_max_epi32(_mm512_min_epi32(q, lim), nlim);
                s += _mm512_reduce_add_epi32(q);
                _mm256_store_si256((__m256i *)(natural + e), _mm512_cvtepi32_epi16(q));
            }
            xs[e0 / sub + j] = d * (float)s;
        }
        if (l->t == T_Q4_K) {  // vector 4 H + n: every other input of two 32-input runs (Q4K_SLOT)
            for (int v = 0; v < 8; v++) {
                const int H = v / 4, n4 = v % 4;
                const __m512i a = _mm512_load_si512((const void *)(natural + 128 * H + 32 * (n4 % 2)));
                const __m512i b = _mm512_load_si512((const void *)(natural + 128 * H + 64 + 32 * (n4 % 2)));
                _mm512_storeu_si512((void *)(xq + e0 + 32 * v),
                                    _mm512_permutex2var_epi16(a, _mm512_loadu_si512((const void *)Q4K_PICK[n4 >= 2]), b));
            }
            continue;
        }
        if (l->act == 32 && n == 256) {  // a 32-weight type's whole group: its lanes' order
            const uint32_t *pairs = (const uint32_t *)natural;  // inputs 2p, 2p + 1
            const uint8_t *from = LANE_PAIRS[nibble_lane_type(l->t)];
            uint32_t *out = (uint32_t *)(xq + e0);
            for (int d = 0; d < 128; d++) out[d] = pairs[from[d]];
            continue;
        }
        for (int64_t c = 0; c < n; c += 64) {
            const __m512i a = _mm512_load_si512((const void *)(natural + c));
            const __m512i b = _mm512_load_si512((const void *)(natural + c + 32));
            _mm512_storeu_si512((void *)(xq + e0 + c), _mm512_shuffle_i64x2(a, b, _MM_SHUFFLE(2, 0, 2, 0)));
            _mm512_storeu_si512((void *)(xq + e0 + c + 32), _mm512_shuffle_i64x2(a, b, _MM_SHUFFLE(3, 1, 3, 1)));
        }
    }
}
#endif

// ---- the entry points -------------------------------------------------------------------------
static _Thread_local uint8_t *act_buf = NULL;
static _Thread_local int64_t act_cap = 0;

static uint8_t *act_scratch(int64_t bytes) {
    if (bytes > act_cap) {
        free(act_buf);
        act_buf = (uint8_t *)aligned_alloc(64, (size_t)((bytes + 63) & ~(int64_t)63));
        act_cap = act_buf ? bytes : 0;
    }
    return act_buf;
}

// Work below which a second thread costs more than it saves (rows x weight bytes).
#define PARALLEL_MIN_BYTES (64 * 1024)

KVK_API int kvk_isa(void) {
#ifdef KVK_AVX512
    return 512;
#else
    return 0;
#endif
}

KVK_API int kvk_supported(int t) {
    kvk_type ti = {0, 0, 0, 0};
    return type_info(t, &ti);
}

KVK_API int64_t kvk_row_bytes(int t, int64_t k) {
    kvk_type ti = {0, 0, 0, 0};
    if (!type_info(t, &ti) || k % ti.block) return -1;
    return k / ti.block * ti.bytes;
}

// y[r * ys + i] = sum_k W[i, k] * x[r * xs + k] for i < n, r < nr, where rowp[i] is where output
// row i's weights are (a table of row addresses: the rows of several tensors of one type fused into
// one call, a permutation of a tensor's rows, or a tensor's rows in order). Quantized types
// quantize x to one 16-bit plane; float types
// multiply it as it is. Returns 0, or -1 for a type or shape it does not take.
//
// visit: NULL, or the order in which a few-row call (nr <= SEQUENTIAL_ROWS: a decode step, a
// speculative round; the portable build: every call) computes the outputs, each still written to
// its own place: the table's rows
// by address (GGUFWeight's visit_order) where the table is a permutation. Llama's q and k rows,
// read in the order transformers permutes them to (every other row of a head, then the others),
// made a pass over a 1.7B Q4_0's layers at one row 52.9 ms against 47.5 in file order, 47.9 with
// this (one process, interleaved); engine bench's ITL against llama.cpp went 1.37x -> 1.16x. A
// row's output is computed as alone either way: the bits do not change.
KVK_API int kvk_matmul_visit(int t, const uint8_t *const *rowp, const int64_t *visit, int64_t n, int64_t k,
                             const float *x, int64_t xs, int64_t nr, float *y, int64_t ys);

KVK_API int kvk_matmul(int t, const uint8_t *const *rowp, int64_t n, int64_t k,
                       const float *x, int64_t xs, int64_t nr, float *y, int64_t ys) {
    return kvk_matmul_visit(t, rowp, NULL, n, k, x, xs, nr, y, ys);
}

KVK_API int kvk_matmul_visit(int t, const uint8_t *const *rowp, const int64_t *visit, int64_t n, int64_t k,
                             const float *x, int64_t xs, int64_t nr, float *y, int64_t ys) {
    kvk_type ti = {0, 0, 0, 0};
    if (!type_info(t, &ti) || k % ti.block || nr < 0 || n < 0) return -1;
    if (nr == 0 || n == 0) return 0;
    const int par = nr * n * (k / ti.block) * ti.bytes >= PARALLEL_MIN_BYTES;
    if (ti.sub == 0) {  // F16 / BF16: float32 activations as they are
#pragma omp parallel for schedule(static) if (par)
        for (int64_t i = 0; i < n; i++) {
            const uint8_t *row = rowp[i];
#ifdef KVK_AVX512
            dot_rows_float_avx512(t, row, k, x, xs, nr, y + i, ys);
#else
            float *tmp = (float *)malloc((size_t)k * sizeof(float));
            for (int64_t r = 0; r < nr; r++) y[r * ys + i] = dot_row_f32_portable(t, &ti, row, k, x + r * xs, tmp);
            free(tmp);
#endif
        }
        return 0;
    }
    act_layout l = layout_for(k, t, &ti);
    uint8_t *act = act_scratch(l.stride * nr);
    if (!act) return -2;
#pragma omp parallel for schedule(static) if (nr * k >= 65536)
#ifdef KVK_AVX512
    for (int64_t r = 0; r < nr; r++) quantize_row_avx512(x + r * xs, &l, act + r * l.stride);
#else
    for (int64_t r = 0; r < nr; r++) quantize_row(x + r * xs, &l, act + r * l.stride);
#endif
#ifdef KVK_AVX512
    // threads take whole tiles of weight rows: each output is one thread's, computed as alone
    const int64_t tiles = (n + NW - 1) / NW;
#pragma omp parallel if (par)
    {
#ifdef _OPENMP
        const int64_t nth = omp_get_num_threads(), me = omp_get_thread_num();
#else
        const int64_t nth = 1, me = 0;
#endif
        const int64_t t0 = tiles * me / nth, t1 = tiles * (me + 1) / nth;
        const int64_t i0 = t0 * NW, i1 = t1 * NW < n ? t1 * NW : n;
        if (i0 < i1) rows_avx512(t, rowp, visit, i0, i1, k, act, &l, nr, y, ys);
    }
#else
#pragma omp parallel for schedule(static) if (par)
    for (int64_t v = 0; v < n; v++) {
        const int64_t i = visit ? visit[v] : v;
        const uint8_t *row = rowp[i];
        for (int64_t r = 0; r < nr; r++) y[r * ys + i] = dot_row_portable(t, &ti, row, k, act + r * l.stride, &l);
    }
#endif
    return 0;
}

// The same product with float32 activations for every type (each weight decoded to float32):
// what an exact LM head needs.
KVK_API int kvk_matmul_f32(int t, const uint8_t *const *rowp, int64_t n, int64_t k,
                           const float *x, int64_t xs, int64_t nr, float *y, int64_t ys) {
    kvk_type ti;
    if (!type_info(t, &ti) || k % ti.block || nr < 0 || n < 0) return -1;
    if (ti.sub == 0) return kvk_matmul(t, rowp, n, k, x, xs, nr, y, ys);
    if (nr == 0 || n == 0) return 0;
    const int par = nr * n * (k / ti.block) * ti.bytes >= PARALLEL_MIN_BYTES;
#ifdef KVK_AVX512
#pragma omp parallel if (par)
    {
#ifdef _OPENMP
        const int64_t nth = omp_get_num_threads(), me = omp_get_thread_num();
#else
        const int64_t nth = 1, me = 0;
#endif
        const int64_t i0 = n * me / nth, i1 = n * (me + 1) / nth;
        if (i0 < i1) rows_f32_avx512(t, rowp, i0, i1, k, x, xs, nr, y, ys);
    }
#else
#pragma omp parallel for schedule(static) if (par)
    for (int64_t i = 0; i < n; i++) {
        const uint8_t *row = rowp[i];
        float *tmp = (float *)malloc((size_t)k * sizeof(float));
        for (int64_t r = 0; r < nr; r++) y[r * ys + i] = dot_row_f32_portable(t, &ti, row, k, x + r * xs, tmp);
        free(tmp);
    }
#endif
    return 0;
}

// The rows rowp[0..n) decoded and rounded to bfloat16 into out [n, k] (a dense
// kernel's temporary copy of a layer).
KVK_API int kvk_dequantize_bf16(int t, const uint8_t *const *rowp, int64_t n, int64_t k,
                                uint16_t *out) {
    kvk_type ti;
    if (!type_info(t, &ti) || k % ti.block) return -1;
    const int par = n * k >= 65536;
#ifdef KVK_AVX512
    if (ti.sub != 0) {
#pragma omp parallel if (par)
        {
#ifdef _OPENMP
            const int64_t nth = omp_get_num_threads(), me = omp_get_thread_num();
#else
            const int64_t nth = 1, me = 0;
#endif
            const int64_t i0 = n * me / nth, i1 = n * (me + 1) / nth;
            if (i0 < i1) rows_bf16_avx512(t, rowp, i0, i1, k, out);
        }
        return 0;
    }
#endif
#pragma omp parallel for schedule(static) if (par)
    for (int64_t i = 0; i < n; i++) {
        float *tmp = (float *)malloc((size_t)k * sizeof(float));
        dequant_row(t, rowp[i], k, tmp);
        for (int64_t j = 0; j < k; j++) {
            uint32_t bits;
            memcpy(&bits, tmp + j, 4);
            bits += 0x7fff + ((bits >> 16) & 1);
            out[i * k + j] = (uint16_t)(bits >> 16);
        }
        free(tmp);
    }
    return 0;
}

// Rows rowp[ids[0..m)] dequantized to float32 (an embedding lookup), bit for bit gguf-py's values.
KVK_API int kvk_dequantize_rows(int t, const uint8_t *const *rowp, int64_t k, const int64_t *ids,
                                int64_t m, float *out) {
    kvk_type ti = {0, 0, 0, 0};
    if (!type_info(t, &ti) || k % ti.block) return -1;
#pragma omp parallel for schedule(static) if (m * k >= 262144)
    for (int64_t j = 0; j < m; j++) dequant_row(t, rowp[ids[j]], k, out + j * k);
    return 0;
}

// nr rows of k activations quantized for type t as kvk_matmul quantizes them, into out (nr x the
// row stride bytes: the codes, scales and sums as this build lays them out), by the build's own
// routine, or with `scalar` by the portable loop (tests: the two write the same bytes). Returns the
// row stride, or -1 for a type or shape it does not take.
KVK_API int64_t kvk_quantize_rows(int t, int64_t k, const float *x, int64_t nr, uint8_t *out, int scalar) {
    kvk_type ti = {0, 0, 0, 0};
    if (!type_info(t, &ti) || ti.sub == 0 || k % ti.block || nr < 0) return -1;
    act_layout l = layout_for(k, t, &ti);
    if (out == NULL) return l.stride;
    for (int64_t r = 0; r < nr; r++) {
#ifdef KVK_AVX512
        if (!scalar) {
            quantize_row_avx512(x + r * k, &l, out + r * l.stride);
            continue;
        }
#endif
        quantize_row(x + r * k, &l, out + r * l.stride);
    }
    (void)scalar;
    return l.stride;
}

// One block's codes and (a, b) pairs, for tests: codes [block], a and b [block / sub].
KVK_API int kvk_unpack_block(int t, const uint8_t *b, uint8_t *codes, float *a, float *o) {
    kvk_type ti = {0, 0, 0, 0};
    if (!type_info(t, &ti) || ti.sub == 0) return -1;
    for (int e = 0; e < ti.block; e++) codes[e] = (uint8_t)block_code(t, b, e);
    block_scales(t, b, a, o);
    return 0;
}
