/*
 * One fused pass over a unit's stored bits: the sum of squares in float64 and the
 * extreme bit patterns, for the statistics of tclip.core.kernels.reduce_unit.
 *
 * Why C: NumPy cannot fuse "widen to float64, square, sum". Done with NumPy the
 * unit is widened into a float64 copy, squared in place and summed: three passes
 * over 8 bytes an element for data stored in 2 or 4, plus two or three integer
 * reductions for the extremes (1.5-2.0 ns an element on the development VM).
 * This reads the stored bytes once.
 *
 * Why it gives NumPy's bits: the squares of float16, bfloat16 and float32 values are
 * exact in float64, a float64 square is one rounded product either way, and the sum
 * follows np.add.reduce's own order: its pairwise summation (blocks of at most 128
 * terms summed by eight accumulators, halves split on multiples of eight) over
 * chunks of CHUNK terms, each chunk's sum added in turn to a running total that
 * starts at 0.0. kernels.py compares this with np.add.reduce before it first uses
 * it (and keeps NumPy's way if they ever differ); the tests compare them over many
 * lengths and values. Built with -ffp-contract=off so that no product and sum is
 * fused into one rounding.
 *
 * The GIL is released for the loop, so worker threads run it side by side.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>
#include <math.h>

enum { KIND_F64 = 0, KIND_F32 = 1, KIND_BF16 = 2, KIND_F16 = 3 };

static double f16_value[65536];   /* every float16 as a float64 (Inf and NaN included) */

/* Each element's square in float64, exactly (the squares of float16, bfloat16 and float32
 * values are exact in float64), from its stored bits. The kinds' loops are written out by
 * the macros below, so that the compiler sees one element type per loop. */
static inline double square_f64(const unsigned char *p, Py_ssize_t i)
{
    double v; memcpy(&v, p + 8 * i, 8); return v * v;
}
static inline double square_f32(const unsigned char *p, Py_ssize_t i)
{
    float v; memcpy(&v, p + 4 * i, 4); double d = v; return d * d;
}
static inline double square_bf16(const unsigned char *p, Py_ssize_t i)
{
    uint16_t b; memcpy(&b, p + 2 * i, 2);
    uint32_t w = (uint32_t)b << 16; float v; memcpy(&v, &w, 4); double d = v; return d * d;
}
static inline double square_f16(const unsigned char *p, Py_ssize_t i)
{
    uint16_t b; memcpy(&b, p + 2 * i, 2); double v = f16_value[b]; return v * v;
}

/* The extremes are kept as ordered keys: a pattern with the sign bit set has its other
 * bits flipped, so that the keys, as signed integers, sort as the values do (-0 below +0;
 * no NaN: a unit with NaN or Inf has a sum of squares that is not finite, and the caller
 * then takes NumPy's way). The same flip turns a key back into its pattern. */
#define ORDERED(s, STYPE, BITS) ((STYPE)((s) ^ (((s) >> ((BITS) - 1)) & (STYPE)~((uint64_t)1 << ((BITS) - 1)))))

typedef struct { int64_t lo, hi; } Keys;

/* The smallest and largest key of a[0 .. n) folded into k (a loop on integer lanes). */
#define EXTREMES(a, n, k, WIDTH, STYPE, BITS)                                                \
    do {                                                                                     \
        STYPE lo_ = (STYPE)(k)->lo, hi_ = (STYPE)(k)->hi;                                    \
        for (Py_ssize_t i_ = 0; i_ < (n); i_++) {                                            \
            STYPE b_; memcpy(&b_, (a) + i_ * (WIDTH), (WIDTH));                              \
            STYPE key_ = ORDERED(b_, STYPE, BITS);                                           \
            lo_ = key_ < lo_ ? key_ : lo_; hi_ = key_ > hi_ ? key_ : hi_;                    \
        }                                                                                    \
        (k)->lo = lo_; (k)->hi = hi_;                                                        \
    } while (0)

/* How the sum is cut. np.add.reduce sums a[0 .. n) pairwise: a block of at most 128
 * terms (a leaf) is summed by eight accumulators (term i into accumulator i % 8, the last
 * n % 8 terms added one by one after the eight are summed as a tree); a longer one is
 * split in two at n / 2 rounded down to a multiple of 8, and the two halves' sums added.
 * The loops keep that order exactly.
 * DIRECT sums one leaf at a time, the extremes in a loop of their own before it.
 * SIDE_BY_SIDE (float16 and bfloat16 in the AVX2 and AVX-512 copies, below) sums the two,
 * four or eight leaves of a node side by side: each leaf's eight accumulators are its own,
 * so four leaves are 32 independent sums, where one leaf's eight had to wait on the
 * latency of each other's additions (which bounded the direct loop at eight terms per
 * addition's latency, whatever the width of the type; float32 already takes that long to
 * widen). Eight terms are widened, squared and added at a time, into accumulators that
 * start at +0 (+0 plus a square, never -0, is that square). The extremes of up to
 * EXTREMES_AT_ONCE terms (8 KiB of 16-bit values) are found first, in one loop: the data
 * is still in the L1 cache for the sum, and the loop's setup and final reduction are paid
 * once for them all. */
enum { LEAF = 128, EXTREMES_AT_ONCE = 4096 };

/* Where np.add.reduce splits n terms (n > 128): the first part's length. */
static inline Py_ssize_t half(Py_ssize_t n) { return n / 2 - (n / 2) % 8; }

/* NAME_squares: np.add.reduce's pairwise summation of the squares of a[0 .. n), and the
 * smallest and largest key of a[0 .. n) folded into k. One pass over the stored bytes. */
#define DIRECT(NAME, KIND, WIDTH, STYPE, BITS, ATTR)                                         \
ATTR static double NAME##_leaf(const unsigned char *a, Py_ssize_t n, Keys *k)               \
{                                                                                            \
    EXTREMES(a, n, k, WIDTH, STYPE, BITS);                                                   \
    double res;                                                                              \
    if (n < 8) {                                                                             \
        res = -0.0;                                                                          \
        for (Py_ssize_t i = 0; i < n; i++) res += square_##KIND(a, i);                       \
        return res;                                                                          \
    }                                                                                        \
    double r[8];                                                                             \
    Py_ssize_t i;                                                                            \
    for (int j = 0; j < 8; j++) r[j] = square_##KIND(a, j);                                  \
    for (i = 8; i < n - (n % 8); i += 8)                                                     \
        for (int j = 0; j < 8; j++) r[j] += square_##KIND(a, i + j);                         \
    res = ((r[0] + r[1]) + (r[2] + r[3])) + ((r[4] + r[5]) + (r[6] + r[7]));                 \
    for (; i < n; i++) res += square_##KIND(a, i);                                           \
    return res;                                                                              \
}                                                                                            \
ATTR static double NAME##_squares(const unsigned char *a, Py_ssize_t n, Keys *k)            \
{                                                                                            \
    if (n <= LEAF) return NAME##_leaf(a, n, k);                                              \
    Py_ssize_t n2 = half(n);                                                                 \
    double first = NAME##_squares(a, n2, k);                                                 \
    return first + NAME##_squares(a + n2 * WIDTH, n - n2, k);                                \
}

DIRECT(f64, f64, 8, int64_t, 64, )
DIRECT(f32, f32, 4, int32_t, 32, )
DIRECT(bf16, bf16, 2, int16_t, 16, )
DIRECT(f16, f16, 2, int16_t, 16, )

typedef double (*Squares)(const unsigned char *, Py_ssize_t, Keys *);
static Squares squares_of[] = {f64_squares, f32_squares, bf16_squares, f16_squares};

/* The same loops compiled for AVX2 as well, chosen at import where the CPU has it (four
 * float32 widened per instruction: 0.75 -> 0.51 ns an element for float32 measured).
 * Same operations in the same order: only the instructions differ. The 16-bit kinds are
 * summed SIDE_BY_SIDE there, eight values at a time written with intrinsics: bfloat16
 * shifted into float32 and widened, float16 widened by F16C's conversion, eight to float32
 * in one instruction, exactly (subnormals included, whatever the FPU's flush-to-zero
 * setting: the instruction ignores it), then squared in float32, exactly too (11
 * significant bits squared are 22, and the smallest square, 2**-48, is a normal float32),
 * where the baseline copy's table of 65,536 values is one scalar load each. Measured, one
 * core, in cache: bfloat16 0.55 -> 0.33, float16 0.51 -> 0.30 ns an element. The AVX2
 * copies are used where the CPU has AVX2, F16C and FMA (every one with AVX2 has both). */
#if defined(__GNUC__) && !defined(__clang__) && (defined(__x86_64__) || defined(__i386__))
#define HAVE_AVX2_COPY 1
#include <immintrin.h>
#define AVX2 __attribute__((target("avx2")))
#define AVX2_FMA_F16C __attribute__((target("avx2,fma,f16c")))
#define LOAD8_16(p) _mm_loadu_si128((const __m128i *)(const void *)(p))

/* Four and eight float64 lanes (GCC's vectors: each lane added on its own, in IEEE double,
 * as the plain C would be). */
typedef double V4 __attribute__((vector_size(32)));
typedef double V8 __attribute__((vector_size(64)));
#define ALWAYS_INLINE static inline __attribute__((always_inline))
#define V4_ADD(a, b) ((a) + (b))
#define V4_LANE(a, j) ((a)[j])

/* The extremes of 16-bit patterns so far, 32 lanes each (the AVX512-BW copy, below): the
 * signed maximum, the unsigned maximum and minimum (see extremes16_avx512bw). */
typedef struct { __m512i smax, umax, umin; } Ext16;

/* FETCH_NEXT: while the terms a[0 .. n) of a chunk of EXTREMES_AT_ONCE are summed (from the
 * L1 cache, where the loop over the chunk's extremes brought them), the same stretch of the
 * next chunk is asked for, a cache line at a time. The loop over the extremes is the only
 * one that reads from memory, and the hardware prefetcher follows only the loads that are
 * made: without this, memory waited while the sums were computed and the sums while memory
 * was read (out of cache 0.47-0.51 -> 0.34-0.37 ns an element measured, one core). A
 * prefetch past the end of the data is harmless (it never faults). */
#define FETCH_NEXT(a, n)                                                                     \
    for (Py_ssize_t f_ = 0; f_ < 2 * (n); f_ += 64) __builtin_prefetch((a) + 2 * EXTREMES_AT_ONCE + f_)

/* NAME_leaves: the sums of the squares of K leaves of a (K = 1, 2 or 4, and 8 for AVX-512;
 * each of 8 terms or more) into sums, each in np.add.reduce's order (accumulator j in lane j of low, or lane
 * j - 4 of high), the K side by side as far as the shortest goes.
 * Compiled once per copy (AVX2, AVX-512): inlining must stay within one target. */
#define LEAVES(NAME, KIND, ADD, ATTR)                                                                 \
ATTR ALWAYS_INLINE void NAME##_leaves(const unsigned char *a, const Py_ssize_t *off,                  \
                                      const Py_ssize_t *len, double *sums, const int K, Ext16 *e)     \
{                                                                                                     \
    (void)e;                                                                                          \
    V4 low[4], high[4];                                                                               \
    const unsigned char *t[4];                                                                        \
    Py_ssize_t whole[4], common = PY_SSIZE_T_MAX;                                                     \
    for (int q = 0; q < K; q++) {                                                                     \
        t[q] = a + 2 * off[q];                                                                        \
        whole[q] = len[q] - len[q] % 8;                                                               \
        common = whole[q] < common ? whole[q] : common;                                               \
        low[q] = high[q] = (V4){0.0, 0.0, 0.0, 0.0};  /* 0 + a square is that square */              \
    }                                                                                                 \
    Py_ssize_t i;                                                                                     \
    for (i = 0; i < common; i += 8)                                                                   \
        for (int q = 0; q < K; q++) ADD(low[q], high[q], t[q] + 2 * i);                               \
    for (int q = 0; q < K; q++) {                                                                     \
        Py_ssize_t c;                                                                                 \
        for (c = i; c < whole[q]; c += 8) ADD(low[q], high[q], t[q] + 2 * c);                         \
        double res = ((V4_LANE(low[q], 0) + V4_LANE(low[q], 1)) + (V4_LANE(low[q], 2) + V4_LANE(low[q], 3))) \
                     + ((V4_LANE(high[q], 0) + V4_LANE(high[q], 1)) + (V4_LANE(high[q], 2) + V4_LANE(high[q], 3))); \
        for (c = whole[q]; c < len[q]; c++) res += square_##KIND(t[q], c);                            \
        sums[q] = res;                                                                                \
    }                                                                                                 \
}

/* NAME_sum: np.add.reduce's sum of the squares of a[0 .. n), by NAME_leaves (with EIGHT,
 * the eight leaves of a node of up to 1,024 terms side by side too: the AVX-512 copy has
 * registers for them). */
#define SIDE_BY_SIDE(NAME, KIND, EIGHT, ATTR)                                                         \
ATTR static double NAME##_sum(const unsigned char *a, Py_ssize_t n, Ext16 *e)                         \
{                                                                                                     \
    double sums[8];                                                                                   \
    if (n <= LEAF) {                                                                                  \
        if (n < 8) {                                                                                  \
            double res = -0.0;                                                                        \
            for (Py_ssize_t i = 0; i < n; i++) res += square_##KIND(a, i);                            \
            return res;                                                                               \
        }                                                                                             \
        FETCH_NEXT(a, n);                                                                             \
        const Py_ssize_t off[1] = {0}, len[1] = {n};                                                  \
        NAME##_leaves(a, off, len, sums, 1, e);                                                          \
        return sums[0];                                                                               \
    }                                                                                                 \
    const Py_ssize_t n2 = half(n), n3 = n - n2;                                                       \
    if (n2 <= LEAF && n3 <= LEAF) {                                                                   \
        FETCH_NEXT(a, n);                                                                             \
        const Py_ssize_t off[2] = {0, n2}, len[2] = {n2, n3};                                         \
        NAME##_leaves(a, off, len, sums, 2, e);                                                          \
        return sums[0] + sums[1];                                                                     \
    }                                                                                                 \
    const Py_ssize_t n4 = half(n2), n5 = half(n3);                                                    \
    if (n2 > LEAF && n3 > LEAF && n2 - n4 <= LEAF && n3 - n5 <= LEAF) {                               \
        FETCH_NEXT(a, n);                                                                             \
        const Py_ssize_t off[4] = {0, n4, n2, n2 + n5}, len[4] = {n4, n2 - n4, n5, n3 - n5};          \
        NAME##_leaves(a, off, len, sums, 4, e);                                                          \
        return (sums[0] + sums[1]) + (sums[2] + sums[3]);                                             \
    }                                                                                                 \
    if (EIGHT && n2 > LEAF && n3 > LEAF) {                                                            \
        const Py_ssize_t q[4] = {n4, n2 - n4, n5, n3 - n5};                                           \
        Py_ssize_t off[8], len[8], at = 0;                                                            \
        int eight = 1;                                                                                \
        for (int j = 0; j < 4; j++) {                                                                 \
            const Py_ssize_t h = half(q[j]);                                                          \
            eight = eight && q[j] > LEAF && q[j] - h <= LEAF;                                         \
            off[2 * j] = at; len[2 * j] = h; off[2 * j + 1] = at + h; len[2 * j + 1] = q[j] - h;      \
            at += q[j];                                                                               \
        }                                                                                             \
        if (eight) {                                                                                  \
            FETCH_NEXT(a, n);                                                                         \
            NAME##_leaves(a, off, len, sums, EIGHT ? 8 : 1, e);                                          \
            return ((sums[0] + sums[1]) + (sums[2] + sums[3])) + ((sums[4] + sums[5]) + (sums[6] + sums[7])); \
        }                                                                                             \
    }                                                                                                 \
    const double first = NAME##_sum(a, n2, e);                                                        \
    return first + NAME##_sum(a + 2 * n2, n3, e);                                                     \
}

/* The extremes of a[0 .. n) of 16 bits folded into k, in one loop (see EXTREMES). */
#define EXTREMES16(a, n, k) EXTREMES(a, n, k, 2, int16_t, 16)

/* NAME_chunk: the sum of the squares of a[0 .. n) by NAME_sum, the extremes found first in
 * one loop and folded into k. */
#define AFTER_EXTREMES(NAME, ATTR)                                                                    \
ATTR static double NAME##_chunk(const unsigned char *a, Py_ssize_t n, Keys *k)                       \
{                                                                                                     \
    EXTREMES16(a, n, k);                                                                              \
    return NAME##_sum(a, n, NULL);                                                                    \
}

/* NAME_squares: np.add.reduce's sum of the squares of a[0 .. n) by NAME_chunk, up to
 * EXTREMES_AT_ONCE terms at a time (see DIRECT). */
#define CHUNKED(NAME, ATTR)                                                                           \
ATTR static double NAME##_squares(const unsigned char *a, Py_ssize_t n, Keys *k)                     \
{                                                                                                     \
    if (n <= EXTREMES_AT_ONCE) return NAME##_chunk(a, n, k);                                          \
    const Py_ssize_t n2 = half(n);                                                                    \
    const double first = NAME##_squares(a, n2, k);                                                    \
    return first + NAME##_squares(a + 2 * n2, n - n2, k);                                             \
}

/* bfloat16: each square added by a fused multiply-add, which rounds a * a + r once where
 * the plain code rounds a * a and then the sum: the same result, as a * a (16 significant
 * bits) is exact in float64. Two instructions fewer for eight values. */
#define ADD8_BF16_AVX2(low, high, p)                                                         \
    do {                                                                                     \
        const __m256 v_ = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(LOAD8_16(p)), 16)); \
        const __m256d a_ = _mm256_cvtps_pd(_mm256_castps256_ps128(v_));                      \
        const __m256d b_ = _mm256_cvtps_pd(_mm256_extractf128_ps(v_, 1));                    \
        (low) = (V4)_mm256_fmadd_pd(a_, a_, (__m256d)(low));                                 \
        (high) = (V4)_mm256_fmadd_pd(b_, b_, (__m256d)(high));                               \
    } while (0)
#define ADD8_F16C(low, high, p)                                                              \
    do {                                                                                     \
        const __m256 v_ = _mm256_cvtph_ps(LOAD8_16(p));                                      \
        const __m256 q_ = _mm256_mul_ps(v_, v_);                                             \
        (low) = V4_ADD((low), (V4)_mm256_cvtps_pd(_mm256_castps256_ps128(q_)));              \
        (high) = V4_ADD((high), (V4)_mm256_cvtps_pd(_mm256_extractf128_ps(q_, 1)));          \
    } while (0)
DIRECT(f64_avx2, f64, 8, int64_t, 64, AVX2)
DIRECT(f32_avx2, f32, 4, int32_t, 32, AVX2)
LEAVES(bf16_avx2, bf16, ADD8_BF16_AVX2, AVX2_FMA_F16C)
SIDE_BY_SIDE(bf16_avx2, bf16, 0, AVX2_FMA_F16C)
AFTER_EXTREMES(bf16_avx2, AVX2_FMA_F16C)
CHUNKED(bf16_avx2, AVX2_FMA_F16C)
LEAVES(f16_avx2, f16, ADD8_F16C, AVX2_FMA_F16C)
SIDE_BY_SIDE(f16_avx2, f16, 0, AVX2_FMA_F16C)
AFTER_EXTREMES(f16_avx2, AVX2_FMA_F16C)
CHUNKED(f16_avx2, AVX2_FMA_F16C)

/* The 16-bit statistics once more for AVX-512 (where the CPU and the OS have it): one leaf's
 * eight accumulators are one register of eight float64, and eight values are widened by
 * one conversion to it (AVX2 needs two, and a third instruction to split the eight in two
 * halves: the shuffle unit that all three use is what bounds the AVX2 loop). The same
 * additions in the same order. Measured, one core, against the AVX2 copy: in cache bfloat16
 * 0.32 -> 0.23, float16 0.30 -> 0.24 ns an element; out of cache 0.36 -> 0.32, 0.33 -> 0.30. */
#define AVX512 __attribute__((target("avx2,fma,f16c,avx512f")))
#define ADD8_BF16_AVX512(r, p)                                                               \
    do {                                                                                     \
        const __m256 v_ = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(LOAD8_16(p)), 16)); \
        const __m512d d_ = _mm512_cvtps_pd(v_);                                              \
        (r) = (V8)_mm512_fmadd_pd(d_, d_, (__m512d)(r));                                     \
    } while (0)
#define ADD8_F16_AVX512(r, p)                                                                \
    do {                                                                                     \
        const __m256 v_ = _mm256_cvtph_ps(LOAD8_16(p));                                      \
        (r) = (r) + (V8)_mm512_cvtps_pd(_mm256_mul_ps(v_, v_));                              \
    } while (0)
#define LEAVES_AVX512(NAME, KIND, ADD, ATTR)                                                          \
ATTR ALWAYS_INLINE void NAME##_leaves(const unsigned char *a, const Py_ssize_t *off,                  \
                                      const Py_ssize_t *len, double *sums, const int K, Ext16 *e)     \
{                                                                                                     \
    (void)e;                                                                                          \
    V8 r[8];                                                                                          \
    const unsigned char *t[8];                                                                        \
    Py_ssize_t whole[8], common = PY_SSIZE_T_MAX;                                                     \
    for (int q = 0; q < K; q++) {                                                                     \
        t[q] = a + 2 * off[q];                                                                        \
        whole[q] = len[q] - len[q] % 8;                                                               \
        common = whole[q] < common ? whole[q] : common;                                               \
        r[q] = (V8){0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0};                                          \
    }                                                                                                 \
    Py_ssize_t i;                                                                                     \
    for (i = 0; i < common; i += 8)                                                                   \
        for (int q = 0; q < K; q++) ADD(r[q], t[q] + 2 * i);                                          \
    for (int q = 0; q < K; q++) {                                                                     \
        Py_ssize_t c;                                                                                 \
        for (c = i; c < whole[q]; c += 8) ADD(r[q], t[q] + 2 * c);                                    \
        double res = ((r[q][0] + r[q][1]) + (r[q][2] + r[q][3])) + ((r[q][4] + r[q][5]) + (r[q][6] + r[q][7])); \
        for (c = whole[q]; c < len[q]; c++) res += square_##KIND(t[q], c);                            \
        sums[q] = res;                                                                                \
    }                                                                                                 \
}
LEAVES_AVX512(bf16_avx512, bf16, ADD8_BF16_AVX512, AVX512)
SIDE_BY_SIDE(bf16_avx512, bf16, 1, AVX512)
AFTER_EXTREMES(bf16_avx512, AVX512)
CHUNKED(bf16_avx512, AVX512)
LEAVES_AVX512(f16_avx512, f16, ADD8_F16_AVX512, AVX512)
SIDE_BY_SIDE(f16_avx512, f16, 1, AVX512)
AFTER_EXTREMES(f16_avx512, AVX512)
CHUNKED(f16_avx512, AVX512)

/* The 16-bit statistics for AVX-512 once more, where the CPU also has AVX512-BW (level 3):
 * the same additions in the same order, with fewer instructions beside the conversions.
 * - Each leaf is read 32 values (one 64-byte load) at a time, and the extremes are found in
 *   those same registers: no second loop over the data (the copy above read every value
 *   twice, the extremes' loop from L2 and the sum's from L1). They follow from three integer
 *   reductions of the patterns, with no key computed per value: the signed maximum (the
 *   largest non-negative pattern, where there is one), and the unsigned maximum (the
 *   negative one of the largest magnitude, where there is one) and minimum (the smallest
 *   non-negative pattern, or where all are negative, the one of the smallest magnitude).
 *   The smallest key is the unsigned maximum's where it has the sign bit, else the unsigned
 *   minimum's; the largest is the signed maximum's where it is not negative, else the
 *   unsigned minimum's: EXTREMES's keys (whose order is the values', -0 below +0), with 3
 *   instructions per 32 values where EXTREMES takes 5 per 16. FETCH_NEXT stays: with the
 *   sum's loads reading memory it still measured 0.50 -> 0.41 ns an element out of cache.
 * - bfloat16: each eight of the 32 put in the upper halves of eight 32-bit lanes by one
 *   permutation (zero-extending and shifting took two), then widened and added as above.
 *   float16: sixteen widened to float32 by one conversion, squared, widened as above.
 * - The eight leaves' eight accumulators are added up in their tree order lane-wise:
 *   two leaves' registers shuffled into the even and the odd accumulators of both and added
 *   give (a0 + a1), (a2 + a3), ... of both; the same twice more gives ((a0 + a1) + (a2 + a3))
 *   + ((a4 + a5) + (a6 + a7)) of all eight in one register: 21 instructions, where each
 *   leaf's lanes were read out and added one by one.
 * Measured, one core of a loaded 2-core VM, 32,768 values (L2), the same process: bfloat16
 * 0.35 -> 0.29, float16 0.33 -> 0.30 ns an element (float32 0.43): per byte 1.6 -> 1.35 times
 * float32's; out of cache 0.39 -> 0.35, 0.38 -> 0.36 (float32 0.72-0.75). What is left per
 * eight values is one permutation or conversion to float32, the conversion to float64 (two
 * micro-ops) and the multiply-add, on the two ports of 512-bit operations: without the
 * extremes' three instructions per 32 the sum alone measured 0.17 against float32's 0.28
 * (per byte 1.21 times), so the extremes and the widening both stand above 1.2. */
#define AVX512BW __attribute__((target("avx2,fma,f16c,avx512f,avx512bw")))
#define EXTREMES32(smax, umax, umin, v)                                                      \
    do {                                                                                     \
        (smax) = _mm512_max_epi16((smax), (v));                                              \
        (umax) = _mm512_max_epu16((umax), (v));                                              \
        (umin) = _mm512_min_epu16((umin), (v));                                              \
    } while (0)
AVX512BW static inline void ext16_init(Ext16 *e)
{
    e->smax = _mm512_set1_epi16(INT16_MIN);
    e->umax = _mm512_setzero_si512();
    e->umin = _mm512_set1_epi16(-1);
}

/* The patterns of p[0 .. n) into e (the last n % 32 by a masked load, which reads no byte
 * past the end). */
AVX512BW static inline void ext16_range(Ext16 *e, const unsigned char *p, Py_ssize_t n)
{
    __m512i smax = e->smax, umax = e->umax, umin = e->umin;
    Py_ssize_t i = 0;
    for (; i + 32 <= n; i += 32) {
        const __m512i v = _mm512_loadu_si512((const void *)(p + 2 * i));
        EXTREMES32(smax, umax, umin, v);
    }
    if (i < n) {
        const __mmask32 m = (__mmask32)(((uint64_t)1 << (n - i)) - 1);
        const __m512i v = _mm512_maskz_loadu_epi16(m, (const void *)(p + 2 * i));
        smax = _mm512_mask_max_epi16(smax, m, smax, v);
        umax = _mm512_mask_max_epu16(umax, m, umax, v);
        umin = _mm512_mask_min_epu16(umin, m, umin, v);
    }
    e->smax = smax; e->umax = umax; e->umin = umin;
}

/* The smallest and largest key of what e has seen folded into k (as EXTREMES would). */
AVX512BW static void ext16_fold(const Ext16 *e, Keys *k)
{
    int16_t s[32];
    uint16_t hi[32], lo[32];
    _mm512_storeu_si512((void *)s, e->smax);
    _mm512_storeu_si512((void *)hi, e->umax);
    _mm512_storeu_si512((void *)lo, e->umin);
    int16_t signed_max = INT16_MIN;
    uint16_t unsigned_max = 0, unsigned_min = UINT16_MAX;
    for (int j = 0; j < 32; j++) {
        signed_max = s[j] > signed_max ? s[j] : signed_max;
        unsigned_max = hi[j] > unsigned_max ? hi[j] : unsigned_max;
        unsigned_min = lo[j] < unsigned_min ? lo[j] : unsigned_min;
    }
    const int16_t smallest = (int16_t)(unsigned_max & 0x8000 ? unsigned_max : unsigned_min);
    const int16_t largest = signed_max >= 0 ? signed_max : (int16_t)unsigned_min;
    const int16_t lo_key = ORDERED(smallest, int16_t, 16), hi_key = ORDERED(largest, int16_t, 16);
    k->lo = lo_key < k->lo ? lo_key : k->lo;
    k->hi = hi_key > k->hi ? hi_key : k->hi;
}

/* NAME_chunk: as AFTER_EXTREMES's, the extremes found by NAME_leaves in the values it loads. */
#define FUSED_CHUNK(NAME, ATTR)                                                                       \
ATTR static double NAME##_chunk(const unsigned char *a, Py_ssize_t n, Keys *k)                       \
{                                                                                                     \
    Ext16 e;                                                                                          \
    ext16_init(&e);                                                                                   \
    if (n < 8) ext16_range(&e, a, n);  /* NAME_sum adds these up itself, with no leaf */             \
    const double sum = NAME##_sum(a, n, &e);                                                          \
    ext16_fold(&e, k);                                                                                \
    return sum;                                                                                       \
}

/* The eight leaf sums of r[0 .. 8) (each leaf's accumulators in lanes 0 .. 7) into sums, each
 * ((r0 + r1) + (r2 + r3)) + ((r4 + r5) + (r6 + r7)) of its lanes. */
AVX512BW ALWAYS_INLINE void eight_leaf_sums(const V8 *r, double *sums)
{
    const __m512i even = _mm512_setr_epi64(0, 2, 4, 6, 8, 10, 12, 14);
    const __m512i odd = _mm512_setr_epi64(1, 3, 5, 7, 9, 11, 13, 15);
    __m512d level[4];
    for (int q = 0; q < 4; q++)  /* leaves 2q, 2q + 1: (r0 + r1), (r2 + r3), (r4 + r5), (r6 + r7) of each */
        level[q] = _mm512_add_pd(_mm512_permutex2var_pd((__m512d)r[2 * q], even, (__m512d)r[2 * q + 1]),
                                 _mm512_permutex2var_pd((__m512d)r[2 * q], odd, (__m512d)r[2 * q + 1]));
    for (int q = 0; q < 2; q++)  /* leaves 4q .. 4q + 3: the sums of the first four and the last four */
        level[q] = _mm512_add_pd(_mm512_permutex2var_pd(level[2 * q], even, level[2 * q + 1]),
                                 _mm512_permutex2var_pd(level[2 * q], odd, level[2 * q + 1]));
    _mm512_storeu_pd(sums, _mm512_add_pd(_mm512_permutex2var_pd(level[0], even, level[1]),
                                         _mm512_permutex2var_pd(level[0], odd, level[1])));
}

/* bf16_spread_words[g]: the permutation that puts values 8g .. 8g + 7 of 32 in the upper halves of
 * the first eight 32-bit lanes (words 1, 3, .., 15). */
#define SPREAD(g) {0, 8 * (g), 0, 8 * (g) + 1, 0, 8 * (g) + 2, 0, 8 * (g) + 3, 0, 8 * (g) + 4, 0, 8 * (g) + 5, \
                   0, 8 * (g) + 6, 0, 8 * (g) + 7}
static const uint16_t bf16_spread_words[4][32] __attribute__((aligned(64))) = {
    SPREAD(0), SPREAD(1), SPREAD(2), SPREAD(3)};
#define bf16_spread_at(g) _mm512_load_si512((const void *)bf16_spread_words[g])
/* 32 bfloat16 values loaded in v: each eight of them put in the upper halves of eight 32-bit
 * lanes, the lower halves zeroed (one permutation; two instructions before), then as ADD8. */
#define ADD32_BF16_AVX512BW(r, v)                                                            \
    do {                                                                                     \
        for (int g_ = 0; g_ < 4; g_++) {                                                     \
            const __m512i w_ = _mm512_maskz_permutexvar_epi16(0xAAAA, bf16_spread_at(g_), (v)); \
            const __m512d d_ = _mm512_cvtps_pd(_mm512_castps512_ps256(_mm512_castsi512_ps(w_))); \
            (r) = (V8)_mm512_fmadd_pd(d_, d_, (__m512d)(r));                                 \
        }                                                                                    \
    } while (0)
/* 32 float16 values loaded in v: widened sixteen at a time, squared, as ADD8_F16_AVX512. */
#define ADD32_F16_AVX512BW(r, v)                                                             \
    do {                                                                                     \
        for (int h_ = 0; h_ < 2; h_++) {                                                     \
            const __m512 f_ = _mm512_cvtph_ps(h_ ? _mm512_extracti64x4_epi64((v), 1) : _mm512_castsi512_si256(v)); \
            const __m512 q_ = _mm512_mul_ps(f_, f_);                                         \
            (r) = (r) + (V8)_mm512_cvtps_pd(_mm512_castps512_ps256(q_));                     \
            (r) = (r) + (V8)_mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(q_), 1))); \
        }                                                                                    \
    } while (0)
/* LEAVES_AVX512's loops, 32 values of each leaf at a time where they can, the extremes found
 * in the same values, and the eight leaves of a node (none with a term past its last eight)
 * added up by eight_leaf_sums. */
#define LEAVES_AVX512BW(NAME, KIND, ADD, ADD32, ATTR)                                                 \
ATTR ALWAYS_INLINE void NAME##_leaves(const unsigned char *a, const Py_ssize_t *off,                  \
                                      const Py_ssize_t *len, double *sums, const int K, Ext16 *e)     \
{                                                                                                     \
    V8 r[8];                                                                                          \
    const unsigned char *t[8];                                                                        \
    Py_ssize_t whole[8], common = PY_SSIZE_T_MAX;                                                     \
    int tails = 0;                                                                                    \
    _Pragma("GCC unroll 8")                                                                         \
    for (int q = 0; q < K; q++) {                                                                     \
        t[q] = a + 2 * off[q];                                                                        \
        whole[q] = len[q] - len[q] % 8;                                                               \
        tails |= whole[q] != len[q];                                                                  \
        common = whole[q] < common ? whole[q] : common;                                               \
        r[q] = (V8)_mm512_setzero_pd();                                                               \
    }                                                                                                 \
    __m512i smax = e->smax, umax = e->umax, umin = e->umin;                                           \
    Py_ssize_t i;                                                                                     \
    for (i = 0; i + 32 <= common; i += 32)                                                            \
        for (int q = 0; q < K; q++) {                                                                 \
            const __m512i v = _mm512_loadu_si512((const void *)(t[q] + 2 * i));                       \
            EXTREMES32(smax, umax, umin, v);                                                          \
            ADD32(r[q], v);                                                                           \
        }                                                                                             \
    e->smax = smax; e->umax = umax; e->umin = umin;                                                   \
    for (int q = 0; q < K; q++) ext16_range(e, t[q] + 2 * i, len[q] - i);  /* the rest of each leaf */ \
    for (; i < common; i += 8)                                                                        \
        for (int q = 0; q < K; q++) ADD(r[q], t[q] + 2 * i);                                          \
    for (int q = 0; q < K; q++)                                                                       \
        for (Py_ssize_t c = i; c < whole[q]; c += 8) ADD(r[q], t[q] + 2 * c);                         \
    if (K == 8 && !tails) {                                                                           \
        eight_leaf_sums(r, sums);                                                                     \
        return;                                                                                       \
    }                                                                                                 \
    for (int q = 0; q < K; q++) {                                                                     \
        double res = ((r[q][0] + r[q][1]) + (r[q][2] + r[q][3])) + ((r[q][4] + r[q][5]) + (r[q][6] + r[q][7])); \
        for (Py_ssize_t c = whole[q]; c < len[q]; c++) res += square_##KIND(t[q], c);                 \
        sums[q] = res;                                                                                \
    }                                                                                                 \
}
LEAVES_AVX512BW(bf16_avx512bw, bf16, ADD8_BF16_AVX512, ADD32_BF16_AVX512BW, AVX512BW)
SIDE_BY_SIDE(bf16_avx512bw, bf16, 1, AVX512BW)
FUSED_CHUNK(bf16_avx512bw, AVX512BW)
CHUNKED(bf16_avx512bw, AVX512BW)
LEAVES_AVX512BW(f16_avx512bw, f16, ADD8_F16_AVX512, ADD32_F16_AVX512BW, AVX512BW)
SIDE_BY_SIDE(f16_avx512bw, f16, 1, AVX512BW)
FUSED_CHUNK(f16_avx512bw, AVX512BW)
CHUNKED(f16_avx512bw, AVX512BW)
#endif
static const int bits_of[] = {64, 32, 16, 16};

/* The smallest and largest keys back to bit patterns, as unsigned integers of the width. */
static PyObject *patterns(const Keys *k, int bits)
{
    const uint64_t mask = bits == 64 ? ~(uint64_t)0 : (((uint64_t)1 << bits) - 1);
    const uint64_t flip = mask >> 1;
    uint64_t lo = (uint64_t)k->lo & mask, hi = (uint64_t)k->hi & mask;
    lo ^= (k->lo < 0) ? flip : 0;
    hi ^= (k->hi < 0) ? flip : 0;
    return Py_BuildValue("(KK)", (unsigned long long)lo, (unsigned long long)hi);
}

static PyObject *unit_stats(PyObject *self, PyObject *args)
{
    (void)self;
    Py_buffer view;
    int kind;
    Py_ssize_t chunk;
    if (!PyArg_ParseTuple(args, "y*in", &view, &kind, &chunk)) return NULL;
    const Py_ssize_t width = kind == KIND_F64 ? 8 : kind == KIND_F32 ? 4 : 2;
    if (kind < KIND_F64 || kind > KIND_F16 || view.len % width || view.len == 0 || chunk < 1) {
        PyBuffer_Release(&view);
        PyErr_SetString(PyExc_ValueError, "unit_stats: bad kind, chunk or length");
        return NULL;
    }
    const unsigned char *a = view.buf;
    const Py_ssize_t n = view.len / width;
    const int bits = bits_of[kind];
    double total = 0.0;
    /* the keys start at the extremes of their width */
    Keys k = {(int64_t)((uint64_t)-1 >> (65 - bits)), -(int64_t)((uint64_t)-1 >> (65 - bits)) - 1};
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t start = 0; start < n; start += chunk) {
        Py_ssize_t count = n - start < chunk ? n - start : chunk;
        total += squares_of[kind](a + start * width, count, &k);
    }
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&view);
    PyObject *extremes = patterns(&k, bits);
    if (extremes == NULL) return NULL;
    PyObject *result = Py_BuildValue("(dOO)", total, PyTuple_GET_ITEM(extremes, 0), PyTuple_GET_ITEM(extremes, 1));
    Py_DECREF(extremes);
    return result;
}

/* The sum of squares of each row of `columns` elements into sums[r] (np.add.reduce over
 * the trailing axes of a C-contiguous unit sums each row alone, in the same pairwise order,
 * onto 0.0), and the extreme patterns over all rows. For --axes over every axis but the first. */
static PyObject *row_stats(PyObject *self, PyObject *args)
{
    (void)self;
    Py_buffer view, sums;
    int kind;
    Py_ssize_t columns;
    if (!PyArg_ParseTuple(args, "y*inw*", &view, &kind, &columns, &sums)) return NULL;
    const Py_ssize_t width = kind == KIND_F64 ? 8 : kind == KIND_F32 ? 4 : 2;
    Py_ssize_t n = view.len / width;
    int ok = kind >= KIND_F64 && kind <= KIND_F16 && view.len % width == 0 && n > 0 && columns > 0
             && n % columns == 0 && sums.len == (Py_ssize_t)sizeof(double) * (n / columns);
    const int bits = ok ? bits_of[kind] : 64;
    Keys k = {(int64_t)((uint64_t)-1 >> (65 - bits)), -(int64_t)((uint64_t)-1 >> (65 - bits)) - 1};
    if (ok) {
        const unsigned char *a = view.buf;
        double *out = sums.buf;
        Py_BEGIN_ALLOW_THREADS
        for (Py_ssize_t r = 0; r < n / columns; r++)
            out[r] = 0.0 + squares_of[kind](a + r * columns * width, columns, &k);
        Py_END_ALLOW_THREADS
    }
    PyBuffer_Release(&view);
    PyBuffer_Release(&sums);
    if (!ok) {
        PyErr_SetString(PyExc_ValueError, "row_stats: bad kind, columns, length or sums");
        return NULL;
    }
    return patterns(&k, bits);
}

/* data[i] = table[data[i]] in place: a 16- or 8-bit float scaled by one factor through the
 * table of all its results (kernels._scale_by_table builds it). NumPy's take needs an intp
 * copy of the indices and holds 0.7 ns an element; this is the lookup alone. */
/* The data and the table never overlap (restrict), and eight indices are loaded before their
 * eight results are stored: measured 1.1 -> 0.4 ns an element against one element at a
 * time, whose store the next table load had to be ordered after. */
static void lookup16(uint16_t *restrict d, const uint16_t *restrict t, Py_ssize_t n)
{
    Py_ssize_t i = 0;
    for (; i + 8 <= n; i += 8) {
        uint16_t b[8];
        for (int j = 0; j < 8; j++) b[j] = d[i + j];
        for (int j = 0; j < 8; j++) d[i + j] = t[b[j]];
    }
    for (; i < n; i++) d[i] = t[d[i]];
}

static void lookup8(unsigned char *restrict d, const unsigned char *restrict t, Py_ssize_t n)
{
    Py_ssize_t i = 0;
    for (; i + 8 <= n; i += 8) {
        unsigned char b[8];
        for (int j = 0; j < 8; j++) b[j] = d[i + j];
        for (int j = 0; j < 8; j++) d[i + j] = t[b[j]];
    }
    for (; i < n; i++) d[i] = t[d[i]];
}

static PyObject *lookup(PyObject *self, PyObject *args)
{
    (void)self;
    Py_buffer data, table;
    if (!PyArg_ParseTuple(args, "w*y*", &data, &table)) return NULL;
    int ok = (table.len == 2 * 65536 && data.len % 2 == 0) || table.len == 256;
    if (ok) {
        Py_BEGIN_ALLOW_THREADS
        if (table.len == 256) {
            lookup8(data.buf, table.buf, data.len);
        } else if (((uintptr_t)data.buf & 1) == 0 && ((uintptr_t)table.buf & 1) == 0) {
            lookup16(data.buf, table.buf, data.len / 2);
        } else {  /* unaligned: byte copies */
            unsigned char *d = data.buf;
            const unsigned char *t = table.buf;
            for (Py_ssize_t i = 0; i < data.len / 2; i++) {
                uint16_t b, r;
                memcpy(&b, d + 2 * i, 2);
                memcpy(&r, t + 2 * (Py_ssize_t)b, 2);
                memcpy(d + 2 * i, &r, 2);
            }
        }
        Py_END_ALLOW_THREADS
    }
    PyBuffer_Release(&data);
    PyBuffer_Release(&table);
    if (!ok) {
        PyErr_SetString(PyExc_ValueError, "lookup: a table of 65,536 uint16 or 256 uint8, data of its width");
        return NULL;
    }
    Py_RETURN_NONE;
}

/* float16 and bfloat16 rows times one factor each, in place, for kernels._scale_rows16_fused:
 * the reference arithmetic of kernels._scale_whole (each value widened exactly, the float64
 * product rounded once to float16, or for bfloat16 to float32 and then to bfloat16 as
 * ml_dtypes narrows), for every finite value, with the FPU doing the rounding:
 * - float16: the magnitude's bits shifted left by 13 are a float32 2**112 times too small
 *   (its subnormals too), so the product is that float32 times factor * 2**112, one rounding.
 *   Adding and subtracting 1.5 * 2**52 times the float16 quantum of the product's binade
 *   (2**-24 at the least, which takes subnormal results in) rounds it to a multiple of that
 *   quantum, to nearest, ties to even (1.5 * 2**52 is even). That multiple times 2**-112 is a
 *   float32 whose bits, shifted right by 13, are the float16's; past 65,504 they are Inf's.
 *   The sign is put back last. (This is widening._narrow_float16's rounding.)
 * - bfloat16: the bits shifted left by 16 are the float32 value; the product rounded to
 *   float32 by the cast, then to bfloat16 by adding 0x7FFF and the lowest kept bit.
 * Each row is first checked for Inf and NaN (exponent all ones), whose handling is NumPy's
 * and ml_dtypes' business: such a row is left as it is and its index written to `left`.
 * A row whose factor is 1 is then left alone (x * 1 is x, for every finite x). Factors are
 * at least 0 and below 2**900, so nothing overflows on the way. Written without branches so
 * that GCC vectorizes the loops; compiled twice, the second for AVX2. 0.7 ns an element
 * (float16) and 0.4 ns (bfloat16) with AVX2, in cache. Returns the number of rows left. */
#define SCALE16(NAME, ATTR)                                                                           \
ATTR static Py_ssize_t NAME(uint16_t *restrict d, Py_ssize_t rows, Py_ssize_t columns,                \
                            const double *factors, int kind, int64_t *restrict left)                  \
{                                                                                                     \
    const uint16_t field = kind == KIND_F16 ? 0x7C00 : 0x7F80;                                        \
    Py_ssize_t n_left = 0;                                                                            \
    for (Py_ssize_t r = 0; r < rows; r++) {                                                           \
        uint16_t *restrict row = d + r * columns;                                                     \
        uint64_t special = 0;                                                                         \
        for (Py_ssize_t c0 = 0; c0 < columns; c0 += 65535) {  /* 16-bit counters, 65,535 at most */   \
            const Py_ssize_t c1 = columns - c0 < 65535 ? columns : c0 + 65535;                        \
            uint16_t n = 0;                                                                           \
            for (Py_ssize_t c = c0; c < c1; c++) n = (uint16_t)(n + ((row[c] & field) == field));     \
            special += n;                                                                             \
        }                                                                                             \
        if (special) {                                                                                \
            left[n_left++] = r;                                                                       \
            continue;                                                                                 \
        }                                                                                             \
        const double f = factors[r];                                                                  \
        if (f == 1.0) continue;                                                                       \
        if (kind == KIND_F16) {                                                                       \
            const double f112 = f * 0x1p112;  /* exact */                                             \
            for (Py_ssize_t c = 0; c < columns; c++) {                                                \
                const uint16_t b = row[c];                                                            \
                const uint32_t wb = (uint32_t)(b & 0x7FFF) << 13;                                     \
                float w; memcpy(&w, &wb, 4);                                                          \
                const double p = (double)w * f112;                                                    \
                uint64_t pb; memcpy(&pb, &p, 8);                                                      \
                int64_t e = (int64_t)(pb & UINT64_C(0x7FF0000000000000));                             \
                e = e < (INT64_C(1009) << 52) ? (INT64_C(1009) << 52) : e;  /* 2**-14 at the least */ \
                const uint64_t rb = (uint64_t)e + ((UINT64_C(42) << 52) | (UINT64_C(1) << 51));       \
                double rounder; memcpy(&rounder, &rb, 8);                                             \
                const float h = (float)(((p + rounder) - rounder) * 0x1p-112);                        \
                uint32_t hb; memcpy(&hb, &h, 4);                                                      \
                uint32_t magnitude = hb >> 13;                                                        \
                magnitude = magnitude > 0x7C00 ? 0x7C00 : magnitude;                                  \
                row[c] = (uint16_t)(magnitude | (b & 0x8000));                                        \
            }                                                                                         \
        } else {                                                                                      \
            for (Py_ssize_t c = 0; c < columns; c++) {                                                \
                const uint32_t wb = (uint32_t)row[c] << 16;                                           \
                float w; memcpy(&w, &wb, 4);                                                          \
                const float s = (float)((double)w * f);                                               \
                uint32_t u; memcpy(&u, &s, 4);                                                        \
                row[c] = (uint16_t)((u + 0x7FFF + ((u >> 16) & 1)) >> 16);                            \
            }                                                                                         \
        }                                                                                             \
    }                                                                                                 \
    return n_left;                                                                                    \
}
SCALE16(scale16_baseline, )
#ifdef HAVE_AVX2_COPY
SCALE16(scale16_avx2, __attribute__((target("avx2"))))
#endif
typedef Py_ssize_t (*Scale16)(uint16_t *, Py_ssize_t, Py_ssize_t, const double *, int, int64_t *);
static Scale16 scale16_loop = scale16_baseline;

/* Whether this thread's FPU keeps subnormals (no flush-to-zero, no denormals-are-zero, as
 * some libraries built with fast-math set it): scale16's rounding needs them, as NumPy's
 * float16 casts do not. volatile keeps the compiler from folding the products. */
static int subnormals_kept(void)
{
    volatile float tiny = 1e-40f, one = 1.0f, small = 1e-30f, smaller = 1e-10f;
    return tiny * one != 0.0f && small * smaller != 0.0f;
}

static PyObject *scale16(PyObject *self, PyObject *args)
{
    (void)self;
    Py_buffer data, factors, left;
    Py_ssize_t columns;
    int kind;
    if (!PyArg_ParseTuple(args, "w*iny*w*", &data, &kind, &columns, &factors, &left)) return NULL;
    const Py_ssize_t count = data.len / 2, rows = columns > 0 ? count / columns : 0;
    int ok = (kind == KIND_F16 || kind == KIND_BF16) && columns > 0 && data.len % 2 == 0 && count % columns == 0
             && factors.len == 8 * rows && left.len >= 8 * rows && ((uintptr_t)data.buf & 1) == 0
             && ((uintptr_t)factors.buf & 7) == 0 && ((uintptr_t)left.buf & 7) == 0;
    for (Py_ssize_t r = 0; ok && r < rows; r++) {
        const double f = ((const double *)factors.buf)[r];
        ok = f >= 0.0 && f < 0x1p900;  /* NaN fails */
    }
    Py_ssize_t n_left = -1;
    if (ok && subnormals_kept()) {
        Py_BEGIN_ALLOW_THREADS
        n_left = scale16_loop(data.buf, rows, columns, factors.buf, kind, left.buf);
        Py_END_ALLOW_THREADS
    }
    PyBuffer_Release(&data);
    PyBuffer_Release(&factors);
    PyBuffer_Release(&left);
    if (!ok) {
        PyErr_SetString(PyExc_ValueError, "scale16: rows of `columns` uint16 (aligned) of kind 2 or 3, a factor in "
                                          "[0, 2**900) per row, room for a row index per row");
        return NULL;
    }
    return PyLong_FromSsize_t(n_left);
}

/* x[r][c] = (float)((double)x[r][c] * factor[r]) in place, for float32 rows of `columns`
 * (one factor for all: a single factor). The float64 product rounded once to float32: the
 * same casts and product as NumPy's np.multiply(x, f, out=x, dtype=float64), without its
 * buffers (0.8 ns an element there). */
#define SCALE_F32(NAME, ATTR)                                                                \
ATTR static void NAME(unsigned char *d, Py_ssize_t rows, Py_ssize_t columns, const double *f, \
                      Py_ssize_t nf)                                                           \
{                                                                                              \
    for (Py_ssize_t r = 0; r < rows; r++) {                                                    \
        const double g = f[nf == 1 ? 0 : r];                                                   \
        unsigned char *row = d + 4 * r * columns;                                              \
        for (Py_ssize_t c = 0; c < columns; c++) {                                             \
            float v; memcpy(&v, row + 4 * c, 4);                                               \
            v = (float)((double)v * g);                                                        \
            memcpy(row + 4 * c, &v, 4);                                                        \
        }                                                                                      \
    }                                                                                          \
}
SCALE_F32(scale_f32_baseline, )
#ifdef HAVE_AVX2_COPY
SCALE_F32(scale_f32_avx2, __attribute__((target("avx2"))))
#endif
typedef void (*ScaleF32)(unsigned char *, Py_ssize_t, Py_ssize_t, const double *, Py_ssize_t);
static ScaleF32 scale_f32_loop = scale_f32_baseline;

static PyObject *scale_f32(PyObject *self, PyObject *args)
{
    (void)self;
    Py_buffer data, factors;
    Py_ssize_t columns;
    if (!PyArg_ParseTuple(args, "w*ny*", &data, &columns, &factors)) return NULL;
    Py_ssize_t count = data.len / 4, nf = factors.len / 8;
    int ok = columns > 0 && data.len % 4 == 0 && count % columns == 0 && factors.len % 8 == 0
             && (nf == 1 || nf == count / columns);
    if (ok) {
        Py_BEGIN_ALLOW_THREADS
        scale_f32_loop(data.buf, count / columns, columns, factors.buf, nf);
        Py_END_ALLOW_THREADS
    }
    PyBuffer_Release(&data);
    PyBuffer_Release(&factors);
    if (!ok) {
        PyErr_SetString(PyExc_ValueError, "scale_f32: float32 rows of `columns`, one float64 factor or one per row");
        return NULL;
    }
    Py_RETURN_NONE;
}

/* The copies of the loops: 0 the baseline ones, 1 the AVX2 ones, 2 the AVX2 ones with the
 * AVX-512 ones for the 16-bit statistics, 3 as 2 with the AVX-512 ones that also use
 * AVX512-BW; the highest at most `wanted` that the CPU has.
 * Returns the level now in use. */
static int use_copies(int wanted)
{
    static const Squares baseline[] = {f64_squares, f32_squares, bf16_squares, f16_squares};
    memcpy(squares_of, baseline, sizeof baseline);
    scale_f32_loop = scale_f32_baseline;
    scale16_loop = scale16_baseline;
    int level = 0;
#ifdef HAVE_AVX2_COPY
    __builtin_cpu_init();
    if (wanted >= 1 && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c")
            && __builtin_cpu_supports("fma")) {
        squares_of[KIND_F64] = f64_avx2_squares;
        squares_of[KIND_F32] = f32_avx2_squares;
        squares_of[KIND_BF16] = bf16_avx2_squares;
        squares_of[KIND_F16] = f16_avx2_squares;
        scale_f32_loop = scale_f32_avx2;
        scale16_loop = scale16_avx2;
        level = 1;
        if (wanted >= 2 && __builtin_cpu_supports("avx512f")) {  /* checks that the OS saves the registers */
            squares_of[KIND_BF16] = bf16_avx512_squares;
            squares_of[KIND_F16] = f16_avx512_squares;
            level = 2;
            if (wanted >= 3 && __builtin_cpu_supports("avx512bw")) {
                squares_of[KIND_BF16] = bf16_avx512bw_squares;
                squares_of[KIND_F16] = f16_avx512bw_squares;
                level = 3;
            }
        }
    }
#endif
    (void)wanted;
    return level;
}

static PyObject *set_avx2(PyObject *self, PyObject *args)
{
    (void)self;
    int wanted;
    if (!PyArg_ParseTuple(args, "p", &wanted)) return NULL;
    return PyBool_FromLong(use_copies(wanted ? 3 : 0) > 0);
}

static PyObject *set_copies(PyObject *self, PyObject *args)
{
    (void)self;
    int wanted;
    if (!PyArg_ParseTuple(args, "i", &wanted)) return NULL;
    return PyLong_FromLong(use_copies(wanted));
}

static PyObject *quant_sums(PyObject *self, PyObject *args);  /* the quantized section, at the end */
static PyObject *code_moments(PyObject *self, PyObject *args);
static PyObject *byte_lookup(PyObject *self, PyObject *args);
static PyObject *ggml_sums(PyObject *self, PyObject *args);  /* the kquant section, at the end */

static PyMethodDef methods[] = {
    {"row_stats", row_stats, METH_VARARGS,
     "row_stats(data, kind, columns, sums) -> (smallest, largest): each row's sum of squares into\n"
     "sums (float64, one per row), as np.add.reduce over the trailing axes gives it."},
    {"lookup", lookup, METH_VARARGS,
     "lookup(data, table): data[i] = table[data[i]] in place (uint16 with a table of 65,536,\n"
     "or uint8 with a table of 256)."},
    {"scale_f32", scale_f32, METH_VARARGS,
     "scale_f32(data, columns, factors): float32 rows of `columns` times float64 factors (one,\n"
     "or one per row), each product rounded once to float32, in place."},
    {"scale16", scale16, METH_VARARGS,
     "scale16(data, kind, columns, factors, left) -> rows left, or -1: float16 (kind 3) or\n"
     "bfloat16 (2) rows of `columns` times one float64 factor each, rounded as NumPy and\n"
     "ml_dtypes round, in place. Rows with Inf or NaN are left as they are and their indices\n"
     "written to `left`; -1 (nothing done) where the FPU flushes subnormals."},
    {"set_avx2", set_avx2, METH_VARARGS,
     "set_avx2(wanted) -> bool: use the AVX2 copies of the loops (where the CPU has AVX2, F16C\n"
     "and FMA; with the AVX-512 ones where it has that too) or the baseline ones; returns whether\n"
     "the AVX2 copies are in use. For the tests: all give the same bits."},
    {"set_copies", set_copies, METH_VARARGS,
     "set_copies(level) -> level in use: 0 the baseline loops, 1 the AVX2 ones, 2 the AVX2 ones\n"
     "and the AVX-512 ones for the 16-bit statistics, 3 as 2 with AVX512-BW in those; the\n"
     "highest at most `level` the CPU has."},
    {"unit_stats", unit_stats, METH_VARARGS,
     "unit_stats(data, kind, chunk) -> (sum_of_squares, smallest, largest)\n\n"
     "data: a unit's stored bytes, C-contiguous; kind: 0 float64, 1 float32, 2 bfloat16,\n"
     "3 float16 (this machine's byte order); chunk: np.add.reduce's terms per inner call.\n"
     "smallest, largest: the extreme values' bit patterns (meaningful when the sum is finite)."},
    {"quant_sums", quant_sums, METH_VARARGS,
     "quant_sums(raw, row_bytes, block_pairs, byte_squares, key_kind, key_values, scales, stride,\n"
     "bounds, sums, fast[, scale_table]) -> (largest, smallest): quant.codes.closed_form's sums of squares\n"
     "per group of rows (bounds: int64 row starts and the end) and extremes of codes times block scales;\n"
     "fast: E4M3FN codes summed in any order where that is exact, with AVX2 (1) or AVX-512 (2) where\n"
     "the CPU has it, E2M1 codes (key_kind 2) in integers with AVX-512 (2) (0: NumPy's order always);\n"
     "scale_table: the scales are bytes (uint8), each scale the table's float64 at its byte."},
    {"code_moments", code_moments, METH_VARARGS,
     "code_moments(codes, n, is_signed, bias, out): per row of n codes c (uint8, or int8), c - bias's sum,\n"
     "sum of squares, smallest and largest into out (int64, 4 x rows)."},
    {"byte_lookup", byte_lookup, METH_VARARGS,
     "byte_lookup(raw, table, out): out[i] = table[raw[i]] (uint8 into float64, a table of 256)."},
    {"ggml_sums", ggml_sums, METH_VARARGS,
     "ggml_sums(blocks, type_id, big_endian, extremes, out, ok): per GGUF block (Q8_0 ... Q6_K) the closed\n"
     "form of tclip.quant.ggml's block statistics: sum of squares, sum, smallest, largest into out (float64,\n"
     "4 x blocks), ok[i] = 1 (uint8) where the block is exact, 0 where the caller dequantizes it."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_fused", NULL, -1, methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__fused(void)
{
    for (uint32_t b = 0; b < 65536; b++) {   /* float16 -> float64, exactly */
        uint32_t sign = b >> 15, exponent = (b >> 10) & 31, mantissa = b & 1023;
        double magnitude;
        if (exponent == 31) magnitude = mantissa ? NAN : INFINITY;
        else if (exponent == 0) magnitude = ldexp((double)mantissa, -24);
        else magnitude = ldexp((double)(mantissa | 1024), (int)exponent - 25);
        f16_value[b] = sign ? -magnitude : magnitude;
    }
    use_copies(3);
    return PyModule_Create(&module);
}

/* =====================================================================================
 * Quantized codes times scales: tclip.quant.codes.closed_form in one pass (quant_sums).
 *
 * A weight stored as one-byte codes (FP8, int8) or two 4-bit codes a byte (E2M1, low
 * nibble first) with a float scale per block of `bw` codes of a row. NumPy's closed form
 * (codes.py) looks up the sum of the squares of each two bytes' codes, adds the rows that
 * share their scales column by column, sums each block, multiplies each block's sum by its
 * scale squared and sums the products per group of rows; the extremes are each block's
 * largest and smallest code (by order keys) times its scale. Every step here is the same
 * rounding in the same order, so the bits are NumPy's:
 * - a pair's squares: byte_sq[b0] + byte_sq[b1] (the uint16 table holds that sum);
 * - columns: 0.0 + row 0 + row 1 + ... (np.add.reduce along axis 0 adds row after row);
 * - a block of at most 32 pairs: pair 0 + pair 1 + ... (codes.py adds column by column),
 *   a longer one and the last, partial block: 0.0 + np.add.reduce's pairwise sum;
 * - a group: 0.0 + the pairwise sum of (scale * scale) * block sum over its blocks.
 * E4M3 and E2M1 sums are exact anyway; E5M2's are not, which is why the order is kept.
 * codes.py compares the two on a probe before it first uses this one, and the tests over
 * every code. Blocks must start on a row's first code (codes.py's NumPy way takes the rest).
 * ===================================================================================== */

enum { QKEY_SIGN_MAGNITUDE = 0, QKEY_INT8 = 1, QKEY_NIBBLES = 2 };

/* np.add.reduce's pairwise sum of a[0 .. n) (contiguous float64), before its 0.0 is added. */
static double quant_pairwise(const double *a, Py_ssize_t n)
{
    if (n < 8) {
        double res = -0.0;
        for (Py_ssize_t i = 0; i < n; i++) res += a[i];
        return res;
    }
    if (n <= LEAF) {
        double r[8];
        Py_ssize_t i;
        for (int j = 0; j < 8; j++) r[j] = a[j];
        for (i = 8; i < n - (n % 8); i += 8)
            for (int j = 0; j < 8; j++) r[j] += a[i + j];
        double res = ((r[0] + r[1]) + (r[2] + r[3])) + ((r[4] + r[5]) + (r[6] + r[7]));
        for (; i < n; i++) res += a[i];
        return res;
    }
    Py_ssize_t n2 = half(n);
    return quant_pairwise(a, n2) + quant_pairwise(a + n2, n - n2);
}

/* Order keys (codes.py's _keys and _nibble_keys): sign-magnitude m becomes m or -1 - m. */
static inline int8_t quant_key(uint8_t b) { int8_t s = (int8_t)b; return (int8_t)((s & 0x7F) ^ (s >> 7)); }
static inline int8_t quant_nibble_key(uint8_t n) { return (int8_t)((n & 7) ^ -((n >> 3) & 1)); }

/* Each byte's largest and smallest key of the rows [0, rows) of p (rb bytes a row) into hi, lo. */
static void quant_keys(const uint8_t *p, Py_ssize_t rows, Py_ssize_t rb, int kind, int8_t *hi, int8_t *lo)
{
    for (Py_ssize_t i = 0; i < rb; i++) { hi[i] = -128; lo[i] = 127; }
    for (Py_ssize_t r = 0; r < rows; r++, p += rb) {
        if (kind == QKEY_NIBBLES) {
            for (Py_ssize_t i = 0; i < rb; i++) {
                int8_t a = quant_nibble_key(p[i] & 15), b = quant_nibble_key(p[i] >> 4);
                int8_t h = a > b ? a : b, l = a < b ? a : b;
                hi[i] = h > hi[i] ? h : hi[i];
                lo[i] = l < lo[i] ? l : lo[i];
            }
        } else if (kind == QKEY_INT8) {
            for (Py_ssize_t i = 0; i < rb; i++) {
                int8_t k = (int8_t)p[i];
                hi[i] = k > hi[i] ? k : hi[i];
                lo[i] = k < lo[i] ? k : lo[i];
            }
        } else {
            for (Py_ssize_t i = 0; i < rb; i++) {
                int8_t k = quant_key(p[i]);
                hi[i] = k > hi[i] ? k : hi[i];
                lo[i] = k < lo[i] ? k : lo[i];
            }
        }
    }
}

/* The column sums of the pairs' squares of rows [0, rows): 0.0 + row 0 + row 1 + ... */
static void quant_columns(const uint8_t *p, Py_ssize_t rows, Py_ssize_t m, const double *sq, double *col)
{
    for (Py_ssize_t j = 0; j < m; j++) col[j] = 0.0 + (sq[p[2 * j]] + sq[p[2 * j + 1]]);
    for (Py_ssize_t r = 1; r < rows; r++) {
        p += 2 * m;
        for (Py_ssize_t j = 0; j < m; j++) col[j] += sq[p[2 * j]] + sq[p[2 * j + 1]];
    }
}

typedef struct {
    const uint8_t *raw;
    Py_ssize_t rb, bpb;           /* bytes a row; pairs of bytes a block */
    int kind, fast;               /* fast: a QFAST_ loop where the codes are E4M3FN and the CPU has it */
    const double *sq, *kval;      /* a byte's sum of squares; a key's value (index key + 128) */
    const double *scales;         /* one row of `stride` per group (float64, or bytes with stable) */
    const double *stable;         /* NULL, or the value of each scale byte (NVFP4's E4M3, E8M0) */
    Py_ssize_t stride;
    const int64_t *bounds;        /* group g: rows [bounds[g], bounds[g + 1]) */
    Py_ssize_t groups;
    double *sums;
} QuantJob;

enum { QFAST_NONE = 0, QFAST_E4M3 = 1, QFAST_E4M3_AVX512 = 2, QFAST_E2M1_AVX512 = 3 };

/* Group g's block sums of squares into cs and block keys into bhi, blo, in NumPy's order. */
static void quant_blocks_ordered(const QuantJob *job, Py_ssize_t g, double *col, int8_t *hi, int8_t *lo,
                                 double *cs, int8_t *bhi, int8_t *blo)
{
    const Py_ssize_t rb = job->rb, m = rb / 2, bpb = job->bpb, kb = 2 * bpb;
    const Py_ssize_t full = m / bpb, tail = m - full * bpb, nb = full + (tail > 0);
    const uint8_t *p = job->raw + job->bounds[g] * rb;
    const Py_ssize_t rows = job->bounds[g + 1] - job->bounds[g];
    quant_columns(p, rows, m, job->sq, col);
    quant_keys(p, rows, rb, job->kind, hi, lo);
    for (Py_ssize_t b = 0; b < full; b++) {
        const double *c = col + b * bpb;
        double t;
        if (bpb <= 32) {
            t = c[0];
            for (Py_ssize_t k = 1; k < bpb; k++) t += c[k];
        } else {
            t = 0.0 + quant_pairwise(c, bpb);
        }
        cs[b] = t;
    }
    if (tail) cs[full] = 0.0 + quant_pairwise(col + full * bpb, tail);
    for (Py_ssize_t b = 0; b < nb; b++) {
        int8_t h = -128, l = 127;
        const Py_ssize_t end = (b + 1) * kb < rb ? (b + 1) * kb : rb;
        for (Py_ssize_t i = b * kb; i < end; i++) {
            h = hi[i] > h ? hi[i] : h;
            l = lo[i] < l ? lo[i] : l;
        }
        bhi[b] = h;
        blo[b] = l;
    }
}

#ifdef HAVE_AVX2_COPY
/* The fast loops walk a block's rows, each in another page (which the CPU does not prefetch
 * across): they ask for the row QUANT_AHEAD rows on themselves (measured 3x faster in a pass
 * over a file, whose units are out of the cache). */
enum { QUANT_AHEAD = 48 };

/* Eight E4M3FN codes' squares (float32, exact: four significant bits squared); NaN codes give
 * a finite square, which the caller never uses (their keys are +-127 and -128). */
AVX2 static inline __m256 quant_e4m3_squares(__m256i x)
{
    x = _mm256_and_si256(x, _mm256_set1_epi32(0x7F));
    __m256 normal = _mm256_castsi256_ps(_mm256_add_epi32(_mm256_slli_epi32(x, 20), _mm256_set1_epi32(120 << 23)));
    __m256 small = _mm256_mul_ps(_mm256_cvtepi32_ps(x), _mm256_set1_ps(0x1p-9f));  /* subnormal: m * 2**-9 */
    __m256 v = _mm256_blendv_ps(normal, small, _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(8), x)));
    return _mm256_mul_ps(v, v);
}

/* An E4M3FN block (rows of kb bytes, rb apart; kb a multiple of 16): the sum of its squares in
 * float64 in any order, exact while below 2**35 (each square is a multiple of 2**-18, so every
 * partial sum is exact while the total is below 2**53 of them: the caller checks it), and its
 * largest and smallest keys. */
AVX2 static double quant_e4m3_block(const uint8_t *p, Py_ssize_t rows, Py_ssize_t rb, Py_ssize_t kb,
                                    int8_t *hi, int8_t *lo)
{
    __m256d a0 = _mm256_setzero_pd(), a1 = a0, a2 = a0, a3 = a0;
    __m128i h = _mm_set1_epi8(-128), l = _mm_set1_epi8(127);
    const __m128i low7 = _mm_set1_epi8(0x7F), zero = _mm_setzero_si128();
    for (Py_ssize_t r = 0; r < rows; r++, p += rb) {
        for (Py_ssize_t i = 0; i < kb; i += 16) {
            if (i % 64 == 0 && r + QUANT_AHEAD < rows)
                _mm_prefetch((const char *)(p + QUANT_AHEAD * rb + i), _MM_HINT_T0);
            __m128i b = _mm_loadu_si128((const __m128i *)(const void *)(p + i));
            __m128i k = _mm_xor_si128(_mm_and_si128(b, low7), _mm_cmpgt_epi8(zero, b));
            h = _mm_max_epi8(h, k);
            l = _mm_min_epi8(l, k);
            __m256 s0 = quant_e4m3_squares(_mm256_cvtepu8_epi32(b));
            __m256 s1 = quant_e4m3_squares(_mm256_cvtepu8_epi32(_mm_srli_si128(b, 8)));
            a0 = _mm256_add_pd(a0, _mm256_cvtps_pd(_mm256_castps256_ps128(s0)));
            a1 = _mm256_add_pd(a1, _mm256_cvtps_pd(_mm256_extractf128_ps(s0, 1)));
            a2 = _mm256_add_pd(a2, _mm256_cvtps_pd(_mm256_castps256_ps128(s1)));
            a3 = _mm256_add_pd(a3, _mm256_cvtps_pd(_mm256_extractf128_ps(s1, 1)));
        }
    }
    double lanes[4];
    int8_t hs[16], ls[16];
    _mm256_storeu_pd(lanes, _mm256_add_pd(_mm256_add_pd(a0, a1), _mm256_add_pd(a2, a3)));
    _mm_storeu_si128((__m128i *)(void *)hs, h);
    _mm_storeu_si128((__m128i *)(void *)ls, l);
    int8_t top = -128, bottom = 127;
    for (int j = 0; j < 16; j++) {
        top = hs[j] > top ? hs[j] : top;
        bottom = ls[j] < bottom ? ls[j] : bottom;
    }
    *hi = top;
    *lo = bottom;
    return (lanes[0] + lanes[1]) + (lanes[2] + lanes[3]);
}
#endif

/* The same in integers with AVX-512 (VBMI and VNNI), 64 codes at a time: a code of magnitude
 * x = e|m is V * 2**-9 with V = M << sh (M = 8 + m, sh = e - 1; subnormal: M = m, sh = 0), so
 * V * V = M * M * 4**sh: table lookups (vpermt2b, the sign bit ignored) give M * M and, for each
 * of four groups of exponents G (sh in 4G .. 4G + 3), 4**(sh - 4G) or 0, and vpdpbusd adds the
 * products into int32 lanes. The block's sum of V * V is sum over G of 256**G times its group's:
 * exact in int64, converted to float64 exactly while below 2**53 (the caller checks 2**35 after
 * the scaling by 2**-18). */
#ifdef HAVE_AVX2_COPY
#define QUANT_AVX512 __attribute__((target("avx512f,avx512bw,avx512dq,avx512vbmi,avx512vnni")))
static uint8_t quant_msq[128];
static int8_t quant_factor[4][128];

static void quant_tables(void)
{
    for (int x = 0; x < 128; x++) {
        int e = x >> 3, m = x & 7, big = e ? 8 + m : m, sh = e ? e - 1 : 0;
        quant_msq[x] = (uint8_t)(x == 0x7F ? 0 : big * big);   /* NaN: found by its key */
        for (int g = 0; g < 4; g++) quant_factor[g][x] = (int8_t)(sh / 4 == g ? 1 << (2 * (sh % 4)) : 0);
    }
}

QUANT_AVX512 static inline __m512i quant_lookup(const uint8_t *table, __m512i index)
{
    return _mm512_permutex2var_epi8(_mm512_loadu_si512(table), index, _mm512_loadu_si512(table + 64));
}

QUANT_AVX512 static int64_t quant_flush(__m512i *acc)
{
    int64_t total = 0;
    for (int g = 3; g >= 0; g--) {
        __m512i wide = _mm512_add_epi64(_mm512_cvtepi32_epi64(_mm512_castsi512_si256(acc[g])),
                                        _mm512_cvtepi32_epi64(_mm512_extracti64x4_epi64(acc[g], 1)));
        total = total * 256 + _mm512_reduce_add_epi64(wide);
        acc[g] = _mm512_setzero_si512();
    }
    return total;
}

/* The blocks of an E4M3FN group (rows of rb bytes, nb blocks of kb bytes, kb a multiple of
 * 64) as quant_e4m3_block gives each: their sums into cs, their keys into bhi, blo. The rows are
 * taken QUANT_TILE at a time across all blocks (each block's lanes kept in `state` between
 * tiles): a block's rows one after the other would each be in another page, out of the TLB.
 * Returns 0 where a row of a block is too long for the int32 lanes (over 2 MiB). */
enum { QUANT_TILE = 16, QUANT_LOADS = 32768 };   /* a lane adds at most 4 * 225 * 64 a load */

QUANT_AVX512 static int quant_e4m3_group512(const uint8_t *p, Py_ssize_t rows, Py_ssize_t rb, Py_ssize_t kb,
                                            Py_ssize_t nb, __m512i *state, int64_t *total, double *cs,
                                            int8_t *bhi, int8_t *blo)
{
    const Py_ssize_t per_row = kb / 64;
    if (per_row > QUANT_LOADS) return 0;
    const Py_ssize_t tile = QUANT_LOADS / per_row < QUANT_TILE ? QUANT_LOADS / per_row : QUANT_TILE;
    const __m512i low7 = _mm512_set1_epi8(0x7F);
    for (Py_ssize_t b = 0; b < nb; b++) {
        for (int g = 0; g < 4; g++) state[6 * b + g] = _mm512_setzero_si512();
        state[6 * b + 4] = _mm512_set1_epi8(-128);
        state[6 * b + 5] = _mm512_set1_epi8(127);
        total[b] = 0;
    }
    Py_ssize_t loads = 0;
    for (Py_ssize_t r0 = 0; r0 < rows; r0 += tile) {
        const Py_ssize_t rt = rows - r0 < tile ? rows - r0 : tile;
        const int flush = loads + rt * per_row > QUANT_LOADS;
        loads = flush ? rt * per_row : loads + rt * per_row;
        for (Py_ssize_t b = 0; b < nb; b++) {
            __m512i *st = state + 6 * b;
            if (flush) total[b] += quant_flush(st);
            __m512i acc[4] = {st[0], st[1], st[2], st[3]}, h = st[4], l = st[5];
            const uint8_t *q = p + r0 * rb + b * kb;
            for (Py_ssize_t r = 0; r < rt; r++, q += rb) {
                for (Py_ssize_t i = 0; i < kb; i += 64) {
                    __m512i x = _mm512_loadu_si512(q + i);
                    __m512i k = _mm512_mask_blend_epi8(_mm512_movepi8_mask(x), x, _mm512_xor_si512(x, low7));
                    h = _mm512_max_epi8(h, k);
                    l = _mm512_min_epi8(l, k);
                    __m512i squares = quant_lookup(quant_msq, x);
                    for (int g = 0; g < 4; g++)
                        acc[g] = _mm512_dpbusd_epi32(acc[g], squares, quant_lookup((const uint8_t *)quant_factor[g], x));
                }
            }
            for (int g = 0; g < 4; g++) st[g] = acc[g];
            st[4] = h;
            st[5] = l;
        }
    }
    for (Py_ssize_t b = 0; b < nb; b++) {
        int64_t sum = total[b] + quant_flush(state + 6 * b);
        int8_t hs[64], ls[64];
        _mm512_storeu_si512(hs, state[6 * b + 4]);
        _mm512_storeu_si512(ls, state[6 * b + 5]);
        int8_t top = -128, bottom = 127;
        for (int j = 0; j < 64; j++) {
            top = hs[j] > top ? hs[j] : top;
            bottom = ls[j] < bottom ? ls[j] : bottom;
        }
        bhi[b] = top;
        blo[b] = bottom;
        cs[b] = sum < ((int64_t)1 << 53) ? ldexp((double)sum, -18) : INFINITY;
    }
    return 1;
}

/* E2M1 codes (two a byte) with AVX-512: 4 * v * v of each nibble by vpshufb (0, 1, 4, 9, 16, 36,
 * 64, 144), summed per eight bytes by vpsadbw, and each eight bytes' largest and smallest key
 * (biased by 128 to order as unsigned bytes, the smallest as the largest of their complements);
 * the eight-byte sums of a group's rows are added, then per block of kb bytes (a multiple of 8).
 * Integers: exact, as NumPy's sums of these squares are. rb: a multiple of 64. */
QUANT_AVX512 static inline __m512i quant_qword_max(__m512i v)
{
    v = _mm512_max_epu8(v, _mm512_srli_epi64(v, 32));
    v = _mm512_max_epu8(v, _mm512_srli_epi64(v, 16));
    return _mm512_max_epu8(v, _mm512_srli_epi64(v, 8));
}

QUANT_AVX512 static void quant_e2m1_group512(const uint8_t *p, Py_ssize_t rows, Py_ssize_t rb, Py_ssize_t kb,
                                             uint64_t *qsum, uint8_t *qtop, uint8_t *qnot, double *cs,
                                             int8_t *bhi, int8_t *blo)
{
    const __m512i squares = _mm512_broadcast_i32x4(_mm_setr_epi8(0, 1, 4, 9, 16, 36, 64, (char)144,
                                                                 0, 1, 4, 9, 16, 36, 64, (char)144));
    const __m512i keys = _mm512_broadcast_i32x4(_mm_setr_epi8((char)128, (char)129, (char)130, (char)131,
                                                              (char)132, (char)133, (char)134, (char)135,
                                                              127, 126, 125, 124, 123, 122, 121, 120));
    const __m512i nibble = _mm512_set1_epi8(0x0F), ones = _mm512_set1_epi8(-1), zero = _mm512_setzero_si512();
    for (Py_ssize_t r = 0; r < rows; r++, p += rb) {
        for (Py_ssize_t c = 0; c < rb; c += 64) {
            __m512i x = _mm512_loadu_si512(p + c);
            __m512i low = _mm512_and_si512(x, nibble), high = _mm512_and_si512(_mm512_srli_epi16(x, 4), nibble);
            __m512i sum = _mm512_add_epi64(_mm512_sad_epu8(_mm512_shuffle_epi8(squares, low), zero),
                                           _mm512_sad_epu8(_mm512_shuffle_epi8(squares, high), zero));
            __m512i a = _mm512_shuffle_epi8(keys, low), b = _mm512_shuffle_epi8(keys, high);
            __m128i top = _mm512_cvtepi64_epi8(quant_qword_max(_mm512_max_epu8(a, b)));
            __m128i not = _mm512_cvtepi64_epi8(quant_qword_max(_mm512_xor_si512(_mm512_min_epu8(a, b), ones)));
            uint64_t *qs = qsum + c / 8;
            if (r) {
                sum = _mm512_add_epi64(sum, _mm512_loadu_si512(qs));
                top = _mm_max_epu8(top, _mm_loadl_epi64((const __m128i *)(const void *)(qtop + c / 8)));
                not = _mm_max_epu8(not, _mm_loadl_epi64((const __m128i *)(const void *)(qnot + c / 8)));
            }
            _mm512_storeu_si512(qs, sum);
            _mm_storel_epi64((__m128i *)(void *)(qtop + c / 8), top);
            _mm_storel_epi64((__m128i *)(void *)(qnot + c / 8), not);
        }
    }
    const Py_ssize_t per = kb / 8;
    if (per == 1) {  /* NVFP4: a block is eight bytes, eight blocks at a time (rb / 8: a multiple of 8) */
        const __m512i limit = _mm512_set1_epi64((int64_t)1 << 53);
        const __m128i top_flip = _mm_set1_epi8((char)0x80), low_flip = _mm_set1_epi8(0x7F);
        for (Py_ssize_t b = 0; b < rb / 8; b += 8) {
            __m512i q = _mm512_min_epu64(_mm512_loadu_si512(qsum + b), limit);  /* 2**53: not exact, refused */
            _mm512_storeu_pd(cs + b, _mm512_mul_pd(_mm512_cvtepu64_pd(q), _mm512_set1_pd(0.25)));
            __m128i t = _mm_loadl_epi64((const __m128i *)(const void *)(qtop + b));
            __m128i u = _mm_loadl_epi64((const __m128i *)(const void *)(qnot + b));
            _mm_storel_epi64((__m128i *)(void *)(bhi + b), _mm_xor_si128(t, top_flip));
            _mm_storel_epi64((__m128i *)(void *)(blo + b), _mm_xor_si128(u, low_flip));  /* ~x ^ 0x80 */
        }
        return;
    }
    for (Py_ssize_t b = 0; b < rb / kb; b++) {
        uint64_t sum = 0;
        uint8_t top = 0, not = 0;
        for (Py_ssize_t q = b * per; q < (b + 1) * per; q++) {
            sum += qsum[q];
            top = qtop[q] > top ? qtop[q] : top;
            not = qnot[q] > not ? qnot[q] : not;
        }
        cs[b] = (double)(sum < ((uint64_t)1 << 53) ? sum : ((uint64_t)1 << 53)) * 0.25;  /* 2**51: not exact */
        bhi[b] = (int8_t)(top ^ 0x80);
        blo[b] = (int8_t)((uint8_t)~not ^ 0x80);
    }
}

/* quant_group's products for E2M1 (keys -8 .. 7), eight blocks at a time: each block's sum
 * times its scale squared into cs, the extremes of its codes times its scale folded in. */
QUANT_AVX512 static void quant_e2m1_finish512(const QuantJob *job, const double *s, Py_ssize_t nb, double *cs,
                                              const int8_t *bhi, const int8_t *blo, double *largest,
                                              double *smallest, int *nan)
{
    const __m512d low = _mm512_loadu_pd(job->kval + 120), high = _mm512_loadu_pd(job->kval + 128);
    const __m512i eight = _mm512_set1_epi64(8);
    __m512d top_all = _mm512_set1_pd(-INFINITY), bottom_all = _mm512_set1_pd(INFINITY);
    __mmask8 bad = 0;
    Py_ssize_t b = 0;
    for (; b + 8 <= nb; b += 8) {
        __m512d scale = _mm512_loadu_pd(s + b);
        _mm512_storeu_pd(cs + b, _mm512_mul_pd(_mm512_mul_pd(scale, scale), _mm512_loadu_pd(cs + b)));
        __m512i h = _mm512_add_epi64(_mm512_cvtepi8_epi64(_mm_loadl_epi64((const __m128i *)(const void *)(bhi + b))),
                                     eight);
        __m512i l = _mm512_add_epi64(_mm512_cvtepi8_epi64(_mm_loadl_epi64((const __m128i *)(const void *)(blo + b))),
                                     eight);
        __m512d top = _mm512_mul_pd(_mm512_permutex2var_pd(low, h, high), scale);
        __m512d bottom = _mm512_mul_pd(_mm512_permutex2var_pd(low, l, high), scale);
        bad |= _mm512_cmp_pd_mask(top, bottom, _CMP_UNORD_Q);
        top_all = _mm512_max_pd(top_all, _mm512_max_pd(top, bottom));
        bottom_all = _mm512_min_pd(bottom_all, _mm512_min_pd(top, bottom));
    }
    *nan |= bad != 0;
    const double top = _mm512_reduce_max_pd(top_all), bottom = _mm512_reduce_min_pd(bottom_all);
    if (top > *largest) *largest = top;
    if (bottom < *smallest) *smallest = bottom;
    for (; b < nb; b++) {
        const double t = job->kval[bhi[b] + 128] * s[b], u = job->kval[blo[b] + 128] * s[b];
        *nan |= isnan(t) || isnan(u);
        if (t > *largest) *largest = t;
        if (u > *largest) *largest = u;
        if (t < *smallest) *smallest = t;
        if (u < *smallest) *smallest = u;
        cs[b] = (s[b] * s[b]) * cs[b];
    }
}

/* NVFP4's groups of one row (a scale per 16 codes, per row): quant_e2m1_group512 and
 * quant_e2m1_finish512 in one walk over the row, 64 bytes (eight blocks) at a time, nothing
 * stored but each block's product: vpsadbw's eight sums are the eight blocks' (times 4, exact),
 * each eight bytes' largest key byte (biased: 120 .. 135, kval's index) is its block's, and the
 * scales are eight bytes looked up in `table` (or eight float64). The same products, extremes
 * and NaN flag as the two steps; cs gets the products for the caller's pairwise sum. */
QUANT_AVX512 static void quant_e2m1_row512(const QuantJob *job, const uint8_t *p, const void *scales, double *cs,
                                           double *largest, double *smallest, int *nan)
{
    const __m512i squares = _mm512_broadcast_i32x4(_mm_setr_epi8(0, 1, 4, 9, 16, 36, 64, (char)144,
                                                                 0, 1, 4, 9, 16, 36, 64, (char)144));
    const __m512i keys = _mm512_broadcast_i32x4(_mm_setr_epi8(8, 9, 10, 11, 12, 13, 14, 15,
                                                              7, 6, 5, 4, 3, 2, 1, 0));  /* kval index - 120 */
    const __m512i nibble = _mm512_set1_epi8(0x0F), zero = _mm512_setzero_si512(), byte = _mm512_set1_epi64(0xFF);
    const __m512i ones = _mm512_set1_epi8(-1);  /* the smallest byte: the complement of the complements' largest */
    const __m512d low = _mm512_loadu_pd(job->kval + 120), high = _mm512_loadu_pd(job->kval + 128);
    const __m512d quarter = _mm512_set1_pd(0.25);
    const uint8_t *sb = scales;
    const double *sd = scales;
    __m512d top_all = _mm512_set1_pd(-INFINITY), bottom_all = _mm512_set1_pd(INFINITY);
    __mmask8 bad = 0;
    for (Py_ssize_t c = 0; c < job->rb; c += 64) {
        __m512i x = _mm512_loadu_si512(p + c);
        __m512i lo4 = _mm512_and_si512(x, nibble), hi4 = _mm512_and_si512(_mm512_srli_epi16(x, 4), nibble);
        __m512i sum = _mm512_add_epi64(_mm512_sad_epu8(_mm512_shuffle_epi8(squares, lo4), zero),
                                       _mm512_sad_epu8(_mm512_shuffle_epi8(squares, hi4), zero));
        __m512i a = _mm512_shuffle_epi8(keys, lo4), b = _mm512_shuffle_epi8(keys, hi4);
        __m512i h = _mm512_and_si512(quant_qword_max(_mm512_max_epu8(a, b)), byte);
        __m512i l = _mm512_andnot_si512(quant_qword_max(_mm512_xor_si512(_mm512_min_epu8(a, b), ones)), byte);
        __m512d scale = job->stable
            ? _mm512_i64gather_pd(_mm512_cvtepu8_epi64(_mm_loadl_epi64((const __m128i *)(const void *)(sb + c / 8))),
                                  job->stable, 8)
            : _mm512_loadu_pd(sd + c / 8);
        __m512d terms = _mm512_mul_pd(_mm512_cvtepu64_pd(sum), quarter);
        _mm512_storeu_pd(cs + c / 8, _mm512_mul_pd(_mm512_mul_pd(scale, scale), terms));
        __m512d top = _mm512_mul_pd(_mm512_permutex2var_pd(low, h, high), scale);
        __m512d bottom = _mm512_mul_pd(_mm512_permutex2var_pd(low, l, high), scale);
        bad |= _mm512_cmp_pd_mask(top, bottom, _CMP_UNORD_Q);
        top_all = _mm512_max_pd(top_all, _mm512_max_pd(top, bottom));
        bottom_all = _mm512_min_pd(bottom_all, _mm512_min_pd(top, bottom));
    }
    *nan |= bad != 0;
    const double top = _mm512_reduce_max_pd(top_all), bottom = _mm512_reduce_min_pd(bottom_all);
    if (top > *largest) *largest = top;
    if (bottom < *smallest) *smallest = bottom;
}

static int quant_avx512(void)
{
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512dq")
           && __builtin_cpu_supports("avx512vbmi") && __builtin_cpu_supports("avx512vnni");
}
#endif

/* Group g's block sums and keys the fast way, where it gives NumPy's bits: 1, or 0 (then the
 * ordered way is taken): not E4M3FN, not AVX2, blocks not of whole 16 bytes, a NaN code (key
 * 127 or -128) or a sum that may have rounded. */
static int quant_blocks_fast(const QuantJob *job, Py_ssize_t g, double *cs, int8_t *bhi, int8_t *blo)
{
#ifdef HAVE_AVX2_COPY
    const Py_ssize_t rb = job->rb, kb = 2 * job->bpb;
    const uint8_t *p = job->raw + job->bounds[g] * rb;
    const Py_ssize_t rows = job->bounds[g + 1] - job->bounds[g];
    if (job->fast == QFAST_E2M1_AVX512 && kb % 8 == 0 && rb % kb == 0 && rb % 64 == 0) {
        void *memory = PyMem_RawMalloc(2 * (size_t)rb);   /* rb / 8 sums of 8 bytes, then rb / 8 bytes twice */
        if (memory == NULL) return 0;
        uint8_t *top = (uint8_t *)memory + rb;
        quant_e2m1_group512(p, rows, rb, kb, memory, top, top + rb / 8, cs, bhi, blo);
        PyMem_RawFree(memory);
        for (Py_ssize_t b = 0; b < rb / kb; b++)
            if (!(cs[b] < 0x1p51)) return 0;
        return 1;
    }
    if (job->fast == QFAST_NONE || job->fast == QFAST_E2M1_AVX512 || kb % 16 || rb % kb) return 0;
    if (kb % 64 == 0 && job->fast == QFAST_E4M3_AVX512) {
        int ok = 0;
        void *memory = PyMem_RawMalloc(6 * (size_t)(rb / kb) * sizeof(__m512i) + 64);  /* aligned to 64 below */
        __m512i *state = (__m512i *)(((uintptr_t)memory + 63) & ~(uintptr_t)63);
        int64_t *total = PyMem_RawMalloc((size_t)(rb / kb) * sizeof(int64_t));
        if (memory && total) ok = quant_e4m3_group512(p, rows, rb, kb, rb / kb, state, total, cs, bhi, blo);
        PyMem_RawFree(memory);
        PyMem_RawFree(total);
        if (!ok) return 0;
    } else {
        for (Py_ssize_t b = 0; b < rb / kb; b++) cs[b] = quant_e4m3_block(p + b * kb, rows, rb, kb, bhi + b, blo + b);
    }
    for (Py_ssize_t b = 0; b < rb / kb; b++)
        if (!(cs[b] < 0x1p35) || bhi[b] == 127 || blo[b] == -128) return 0;
    return 1;
#else
    (void)job; (void)g; (void)cs; (void)bhi; (void)blo;
    return 0;
#endif
}

/* One group's sum into job->sums[g], its extremes folded into *largest, *smallest (NaN: *nan). */
static void quant_group(const QuantJob *job, Py_ssize_t g, double *col, double *cs, int8_t *hi, int8_t *lo,
                        double *sv, double *largest, double *smallest, int *nan)
{
    const Py_ssize_t m = job->rb / 2, nb = (m + job->bpb - 1) / job->bpb;
    const double *s = job->scales + g * job->stride;
#ifdef HAVE_AVX2_COPY
    if (job->fast == QFAST_E2M1_AVX512 && job->bpb == 4 && job->rb % 64 == 0
            && job->bounds[g + 1] - job->bounds[g] == 1) {  /* NVFP4: one row, a block per 8 bytes */
        const void *row = job->stable ? (const void *)((const uint8_t *)job->scales + g * job->stride) : s;
        quant_e2m1_row512(job, job->raw + job->bounds[g] * job->rb, row, cs, largest, smallest, nan);
        job->sums[g] = 0.0 + quant_pairwise(cs, nb);
        return;
    }
#endif
    if (job->stable) {  /* one-byte scales: their values, as the table (ml_dtypes' cast) gives them */
        const uint8_t *b = (const uint8_t *)job->scales + g * job->stride;
        for (Py_ssize_t k = 0; k < nb; k++) sv[k] = job->stable[b[k]];
        s = sv;
    }
    int8_t *bhi = hi + job->rb, *blo = lo + job->rb;   /* after each byte's keys: each block's */
    const int fast = quant_blocks_fast(job, g, cs, bhi, blo);
    if (!fast) quant_blocks_ordered(job, g, col, hi, lo, cs, bhi, blo);
#ifdef HAVE_AVX2_COPY
    if (fast && job->fast == QFAST_E2M1_AVX512) {
        quant_e2m1_finish512(job, s, nb, cs, bhi, blo, largest, smallest, nan);
        job->sums[g] = 0.0 + quant_pairwise(cs, nb);
        return;
    }
#endif
    for (Py_ssize_t b = 0; b < nb; b++) {
        const double top = job->kval[bhi[b] + 128] * s[b], bottom = job->kval[blo[b] + 128] * s[b];
        *nan |= isnan(top) || isnan(bottom);
        if (top > *largest) *largest = top;
        if (bottom > *largest) *largest = bottom;
        if (top < *smallest) *smallest = top;
        if (bottom < *smallest) *smallest = bottom;
        cs[b] = (s[b] * s[b]) * cs[b];
    }
    job->sums[g] = 0.0 + quant_pairwise(cs, nb);
}

/* The fast E4M3FN loop this CPU has: QFAST_E4M3_AVX512, QFAST_E4M3 (AVX2) or QFAST_NONE. */
static int quant_avx2(void)
{
#ifdef HAVE_AVX2_COPY
    __builtin_cpu_init();
    if (!quant_msq[8]) quant_tables();   /* 0 until filled: 8 is 1.0, M * M = 64 */
    return __builtin_cpu_supports("avx2") ? (quant_avx512() ? QFAST_E4M3_AVX512 : QFAST_E4M3) : QFAST_NONE;
#else
    return 0;
#endif
}

static PyObject *quant_sums(PyObject *self, PyObject *args)
{
    (void)self;
    Py_buffer raw, sq, kval, scales, bounds, sums, table = {0};
    Py_ssize_t rb, bpb, stride;
    int kind, fast;
    PyObject *table_object = Py_None;
    if (!PyArg_ParseTuple(args, "y*nny*iy*y*ny*w*i|O", &raw, &rb, &bpb, &sq, &kind, &kval, &scales, &stride,
                          &bounds, &sums, &fast, &table_object))
        return NULL;
    if (table_object != Py_None && PyObject_GetBuffer(table_object, &table, PyBUF_SIMPLE) < 0) {
        PyBuffer_Release(&raw); PyBuffer_Release(&sq); PyBuffer_Release(&kval);
        PyBuffer_Release(&scales); PyBuffer_Release(&bounds); PyBuffer_Release(&sums);
        return NULL;
    }
    const Py_ssize_t scale_size = table.buf ? 1 : 8;   /* bytes of one scale */
    const Py_ssize_t groups = bounds.len / 8 - 1, m = rb / 2;
    const Py_ssize_t nb = bpb > 0 ? (m + bpb - 1) / bpb : 0;
    const int64_t *bound = bounds.buf;
    int ok = rb > 0 && rb % 2 == 0 && bpb > 0 && kind >= 0 && kind <= 2 && sq.len == 256 * 8 && kval.len == 256 * 8
             && bounds.len % 8 == 0 && groups >= 1 && sums.len == groups * 8 && stride >= nb
             && scales.len == groups * stride * scale_size && bound[0] == 0 && raw.len == bound[groups] * rb
             && (!table.buf || table.len == 256 * 8);
    for (Py_ssize_t g = 0; ok && g < groups; g++) ok = bound[g + 1] > bound[g];
    double largest = -INFINITY, smallest = INFINITY;
    int nan = 0;
    double *col = NULL, *terms = NULL;
    int8_t *keys = NULL;
    if (ok) {
        col = PyMem_RawMalloc(m * sizeof(double));
        terms = PyMem_RawMalloc(2 * nb * sizeof(double));   /* the block terms, then the scales' values */
        keys = PyMem_RawMalloc(4 * rb);
    }
    if (ok && col && terms && keys) {
        const int level = quant_avx2();  /* under the GIL: fills the tables once */
        /* E2M1 (key kind QKEY_NIBBLES): its fast loop where the caller allows AVX-512 and the CPU has it */
        const int loop = kind == QKEY_NIBBLES ? (fast >= 2 && level == QFAST_E4M3_AVX512 ? QFAST_E2M1_AVX512 : 0)
                                              : (fast < level ? fast : level);
        QuantJob job = {raw.buf, rb, bpb, kind, loop, sq.buf, kval.buf, scales.buf, table.buf, stride, bound,
                        groups, sums.buf};
        Py_BEGIN_ALLOW_THREADS
        for (Py_ssize_t g = 0; g < groups; g++)
            quant_group(&job, g, col, terms, keys, keys + 2 * rb, terms + nb, &largest, &smallest, &nan);
        Py_END_ALLOW_THREADS
    }
    int memory = ok && !(col && terms && keys);
    PyMem_RawFree(col);
    PyMem_RawFree(terms);
    PyMem_RawFree(keys);
    PyBuffer_Release(&raw);
    PyBuffer_Release(&sq);
    PyBuffer_Release(&kval);
    PyBuffer_Release(&scales);
    PyBuffer_Release(&bounds);
    PyBuffer_Release(&sums);
    if (table.buf) PyBuffer_Release(&table);
    if (memory) return PyErr_NoMemory();
    if (!ok) {
        PyErr_SetString(PyExc_ValueError, "quant_sums: bad row length, block, kind, tables, scales or bounds");
        return NULL;
    }
    if (nan) largest = smallest = NAN;
    return Py_BuildValue("(dd)", largest, smallest);
}

/* GGUF code moments (tclip.quant.ggml.blocks._code_stats): per row of n codes, c = u - bias
 * (u: uint8, or int8 where is_signed), the sum of c, of c * c, the smallest and the largest c,
 * into out[0 .. 4) (int64, one row of `rows` each). Integers: exact in any order, so NumPy's
 * float32 sums (exact below 2**24) give the same numbers. */
static PyObject *code_moments(PyObject *self, PyObject *args)
{
    (void)self;
    Py_buffer codes, out;
    Py_ssize_t n, bias;
    int is_signed;
    if (!PyArg_ParseTuple(args, "y*ninw*", &codes, &n, &is_signed, &bias, &out)) return NULL;
    const Py_ssize_t rows = n > 0 ? codes.len / n : 0;
    const int ok = n > 0 && n <= 4096 && codes.len % n == 0 && out.len == 4 * rows * (Py_ssize_t)sizeof(int64_t);
    if (ok) {
        const uint8_t *p = codes.buf;
        int64_t *sums = out.buf, *squares = sums + rows, *lo = squares + rows, *hi = lo + rows;
        const int32_t b = (int32_t)bias;
        Py_BEGIN_ALLOW_THREADS
        for (Py_ssize_t r = 0; r < rows; r++, p += n) {
            int32_t s = 0, q = 0, small = INT32_MAX, large = INT32_MIN;
            if (is_signed) {
                for (Py_ssize_t j = 0; j < n; j++) {
                    int32_t c = (int32_t)(int8_t)p[j] - b;
                    s += c; q += c * c;
                    small = c < small ? c : small; large = c > large ? c : large;
                }
            } else {
                for (Py_ssize_t j = 0; j < n; j++) {
                    int32_t c = (int32_t)p[j] - b;
                    s += c; q += c * c;
                    small = c < small ? c : small; large = c > large ? c : large;
                }
            }
            sums[r] = s; squares[r] = q; lo[r] = small; hi[r] = large;
        }
        Py_END_ALLOW_THREADS
    }
    PyBuffer_Release(&codes);
    PyBuffer_Release(&out);
    if (!ok) {
        PyErr_SetString(PyExc_ValueError, "code_moments: bad row length or output");
        return NULL;
    }
    Py_RETURN_NONE;
}

/* out[i] = table[raw[i]]: one-byte scales (E4M3, E8M0) as float64 through the table of their
 * 256 values (NumPy's fancy indexing takes 5-10 ns an element; quant.codes.scale_values). */
static PyObject *byte_lookup(PyObject *self, PyObject *args)
{
    (void)self;
    Py_buffer raw, table, out;
    if (!PyArg_ParseTuple(args, "y*y*w*", &raw, &table, &out)) return NULL;
    const int ok = table.len == 256 * (Py_ssize_t)sizeof(double) && out.len == raw.len * (Py_ssize_t)sizeof(double);
    if (ok) {
        const uint8_t *r = raw.buf;
        const double *t = table.buf;
        double *o = out.buf;
        Py_BEGIN_ALLOW_THREADS
        for (Py_ssize_t i = 0; i < raw.len; i++) o[i] = t[r[i]];
        Py_END_ALLOW_THREADS
    }
    PyBuffer_Release(&raw);
    PyBuffer_Release(&table);
    PyBuffer_Release(&out);
    if (!ok) {
        PyErr_SetString(PyExc_ValueError, "byte_lookup: bad table or output");
        return NULL;
    }
    Py_RETURN_NONE;
}

/* =====================================================================================
 * GGUF blocks in closed form (kquant section): tclip.quant.ggml.arithmetic._quant_stats's
 * numbers per block in one pass over the raw blocks (ggml_sums).
 *
 * NumPy unpacks each type's packed codes into a uint8 array, sums them per sub-block, reads
 * the sub-block scales and the f16 scale fields and combines them with a dozen whole-array
 * integer steps; here each block is unpacked into codes c = u - bias on the stack and the
 * same arithmetic is done on it (see _scaled_sums and _affine_sums for why it is exact):
 * - sums of codes, of their squares, extremes: integers, the same in any order;
 * - the affine types' integer sums in uint64, so that they wrap where NumPy's int64 arrays
 *   wrap (only where a factor is 0: the product is then 0 either way);
 * - every float64 product, ldexp and comparison is NumPy's, operand for operand; the
 *   minimum and maximum of two float64 give the second on a tie, as NumPy's do (signed zeros).
 * Blocks that are not exact (ok[i] = 0: a non-finite scale, or an affine block past 2**24)
 * get 0 and are redone by the caller. ggml type ids as in ggml.h.
 * ===================================================================================== */

typedef struct {
    int type, block_bytes, subs, sub_len, bias, c_hi, d_at, m_at, has_scales;
} GgmlLayout;  /* m_at -1: no minimum */

/* Each type's loop is its own copy (ggml_loop inlined with a constant type): the layout folds into
 * constants and the sub-block loops are vectorized (a shared loop: 4 ns a value for Q4_1). */
#define GGML_INLINE static inline __attribute__((always_inline))
#if defined(__SSE2__)
#include <emmintrin.h>
#endif
GGML_INLINE GgmlLayout ggml_layout(int type)
{
    switch (type) {
    case 8: return (GgmlLayout){8, 34, 1, 32, 128, 127, 0, -1, 0};      /* Q8_0 (bias of u = c + 128) */
    case 2: return (GgmlLayout){2, 18, 1, 32, 8, 7, 0, -1, 0};          /* Q4_0 */
    case 3: return (GgmlLayout){3, 20, 1, 32, 0, 15, 0, 2, 0};          /* Q4_1: B = -1 */
    case 6: return (GgmlLayout){6, 22, 1, 32, 16, 15, 0, -1, 0};        /* Q5_0 */
    case 7: return (GgmlLayout){7, 24, 1, 32, 0, 31, 0, 2, 0};          /* Q5_1: B = -1 */
    case 10: return (GgmlLayout){10, 84, 16, 16, 0, 3, 80, 82, 1};      /* Q2_K */
    case 11: return (GgmlLayout){11, 110, 16, 16, 4, 3, 108, -1, 1};    /* Q3_K */
    case 12: return (GgmlLayout){12, 144, 8, 32, 0, 15, 0, 2, 1};       /* Q4_K */
    case 13: return (GgmlLayout){13, 176, 8, 32, 0, 31, 0, 2, 1};       /* Q5_K */
    case 14: return (GgmlLayout){14, 210, 16, 16, 32, 31, 208, -1, 1};  /* Q6_K */
    default: return (GgmlLayout){0, 0, 0, 0, 0, 0, 0, 0, 0};
    }
}

/* ldexp(x, e) where the result is a normal number (here |e| <= 60 and x an integer below 2**63):
 * a product by an exact power of two, the same bits, without libm's call (tens of ns a block). */
GGML_INLINE double ggml_pow2(int64_t e)
{
    const uint64_t bits = (uint64_t)(1023 + e) << 52;
    double v;
    memcpy(&v, &bits, sizeof v);
    return v;
}

/* The unsigned codes u = c + bias of one block in sub-block order (sub-block s, place l at
 * s * sub_len + l; Q8_0's int8 codes as c + 128), and its sub-block scales A and minima B (K types);
 * layouts as in blocks.py. */
GGML_INLINE void ggml_unpack(int type, const uint8_t *b, int big_endian, uint8_t *c, int64_t *a, int64_t *m)
{
    switch (type) {
    case 8:
        for (int j = 0; j < 32; j++) c[j] = b[2 + j] ^ 0x80;  /* int8 c = (c + 128) - 128 */
        break;
    case 2: case 3: {
        const uint8_t *qs = b + (type == 2 ? 2 : 4);
        for (int j = 0; j < 16; j++) { c[j] = qs[j] & 15; c[j + 16] = qs[j] >> 4; }
        break;
    }
    case 6: case 7: {
        const uint8_t *h = b + (type == 6 ? 2 : 4), *qs = h + 4;
        const uint32_t qh = big_endian
            ? (uint32_t)h[3] | (uint32_t)h[2] << 8 | (uint32_t)h[1] << 16 | (uint32_t)h[0] << 24
            : (uint32_t)h[0] | (uint32_t)h[1] << 8 | (uint32_t)h[2] << 16 | (uint32_t)h[3] << 24;
#if defined(__SSE2__)
        {   /* byte j of `bit` is 0x10 where bit j of qh is set: qh's bytes spread over 8 bytes each, tested */
            const __m128i one_bit = _mm_set1_epi64x((long long)0x8040201008040201ULL), nib = _mm_set1_epi8(15);
            const __m128i x = _mm_loadu_si128((const __m128i *)(const void *)qs);
            const uint64_t spread = 0x0101010101010101ULL;
            const __m128i low = _mm_set_epi64x((long long)(((qh >> 8) & 255) * spread),
                                               (long long)((qh & 255) * spread));
            const __m128i high = _mm_set_epi64x((long long)((qh >> 24) * spread),
                                                (long long)(((qh >> 16) & 255) * spread));
            const __m128i ten = _mm_set1_epi8(0x10);
            const __m128i low_bit = _mm_and_si128(_mm_cmpeq_epi8(_mm_and_si128(low, one_bit), one_bit), ten);
            const __m128i high_bit = _mm_and_si128(_mm_cmpeq_epi8(_mm_and_si128(high, one_bit), one_bit), ten);
            _mm_storeu_si128((__m128i *)(void *)c, _mm_or_si128(_mm_and_si128(x, nib), low_bit));
            _mm_storeu_si128((__m128i *)(void *)(c + 16),
                             _mm_or_si128(_mm_and_si128(_mm_srli_epi16(x, 4), nib), high_bit));
        }
#else
        for (int j = 0; j < 16; j++) {
            c[j] = (uint8_t)((qs[j] & 15) | ((qh >> j) & 1) << 4);
            c[j + 16] = (uint8_t)((qs[j] >> 4) | ((qh >> (j + 16)) & 1) << 4);
        }
#endif
        break;
    }
    case 10: case 11: {  /* sub-block 8h + 2j + t: bits 2j, 2j + 1 of qs[32h + 16t + l] */
        const uint8_t *qs = b + (type == 10 ? 16 : 32), *hmask = b;
        for (int h = 0; h < 2; h++)
            for (int j = 0; j < 4; j++)
                for (int t = 0; t < 2; t++) {
                    uint8_t *out = c + 16 * (8 * h + 2 * j + t);
                    const uint8_t *q = qs + 32 * h + 16 * t;
#if defined(__SSE2__)  /* 16-bit shifts: the two bits kept of each byte are that byte's */
                    const __m128i x = _mm_loadu_si128((const __m128i *)(const void *)q);
                    __m128i u = _mm_and_si128(_mm_srl_epi16(x, _mm_cvtsi32_si128(2 * j)), _mm_set1_epi8(3));
                    if (type == 11) {
                        const __m128i y = _mm_loadu_si128((const __m128i *)(const void *)(hmask + 16 * t));
                        const __m128i bit = _mm_and_si128(_mm_srl_epi16(y, _mm_cvtsi32_si128(4 * h + j)),
                                                          _mm_set1_epi8(1));
                        u = _mm_or_si128(u, _mm_slli_epi16(bit, 2));
                    }
                    _mm_storeu_si128((__m128i *)(void *)out, u);
                    continue;
#endif
                    if (type == 10) {
                        for (int l = 0; l < 16; l++) out[l] = (uint8_t)((q[l] >> (2 * j)) & 3);
                    } else {  /* Q3_K: the high bit (+4) is bit 4h + j of hmask[16t + l] */
                        const uint8_t *hm = hmask + 16 * t;
                        for (int l = 0; l < 16; l++)
                            out[l] = (uint8_t)(((q[l] >> (2 * j)) & 3) | ((hm[l] >> (4 * h + j)) & 1) << 2);
                    }
                }
        if (type == 10) {
            for (int s = 0; s < 16; s++) { a[s] = b[s] & 15; m[s] = b[s] >> 4; }
        } else {
            const uint8_t *p = b + 96;
            for (int s = 0; s < 16; s++) {
                a[s] = (int64_t)(((p[s % 8] >> (4 * (s / 8))) & 15) | ((p[8 + s % 4] >> (2 * (s / 4))) & 3) << 4) - 32;
                m[s] = 0;
            }
        }
        break;
    }
    case 12: case 13: {  /* sub-block 2g: low nibbles of qs[32g ..], 2g + 1: high nibbles; Q5_K: bit s of qh[l] */
        const uint8_t *qs = b + (type == 12 ? 16 : 48), *qh = b + 16;
        for (int g = 0; g < 4; g++)
            for (int l = 0; l < 32; l++) {
                c[64 * g + l] = (uint8_t)(qs[32 * g + l] & 15);
                c[64 * g + 32 + l] = (uint8_t)(qs[32 * g + l] >> 4);
            }
        if (type == 13)
            for (int s = 0; s < 8; s++)
                for (int l = 0; l < 32; l++) c[32 * s + l] |= (uint8_t)(((qh[l] >> s) & 1) << 4);
        const uint8_t *q = b + 4;  /* ggml's get_scale_min_k4 */
        for (int s = 0; s < 4; s++) { a[s] = q[s] & 63; m[s] = q[4 + s] & 63; }
        for (int s = 4; s < 8; s++) {
            a[s] = (q[s + 4] & 15) | (q[s - 4] >> 6) << 4;
            m[s] = (q[s + 4] >> 4) | (q[s] >> 6) << 4;
        }
        break;
    }
    case 14: {  /* element 128n + 32k + l: nibble k / 2 of ql[64n + 32(k % 2) + l], bits 2k, 2k + 1 of qh[32n + l] */
        const uint8_t *ql = b, *qh = b + 128;
        for (int n = 0; n < 2; n++)
            for (int k = 0; k < 4; k++)
                for (int l = 0; l < 32; l++)
                    c[128 * n + 32 * k + l] = (uint8_t)(((ql[64 * n + 32 * (k % 2) + l] >> (4 * (k / 2))) & 15)
                                                        | ((qh[32 * n + l] >> (2 * k)) & 3) << 4);
        for (int s = 0; s < 16; s++) { a[s] = (int8_t)b[192 + s]; m[s] = 0; }
        break;
    }
    }
}

/* _f16_parts: finite f16 bits as significand * 2**exponent; returns 1 where not finite (parts 0). */
static int ggml_f16_parts(uint32_t bits, int64_t *sig, int64_t *exp)
{
    const uint32_t field = (bits >> 10) & 31, mantissa = bits & 1023;
    if (field == 31) { *sig = 0; *exp = 0; return 1; }
    const int64_t s = field == 0 ? mantissa : mantissa | 1024;
    *sig = bits >> 15 ? -s : s;
    *exp = field == 0 ? -24 : (int64_t)field - 25;
    return 0;
}

/* Of the n (16 or 32) codes u of a sub-block, c = u - bias: the sum, the sum of squares (from the sums
 * of u and u * u: integers, exact), the smallest and the largest. */
#if defined(__SSE2__)
GGML_INLINE void ggml_moments(const uint8_t *u, int n, int64_t bias, int64_t *sum, int64_t *sq, int64_t *lo,
                              int64_t *hi)
{
    const __m128i zero = _mm_setzero_si128();
    __m128i s = zero, q = zero, small = _mm_set1_epi8((char)0xFF), large = zero;
    for (int k = 0; k < n; k += 16) {
        const __m128i v = _mm_loadu_si128((const __m128i *)(const void *)(u + k));
        s = _mm_add_epi64(s, _mm_sad_epu8(v, zero));
        const __m128i low = _mm_unpacklo_epi8(v, zero), high = _mm_unpackhi_epi8(v, zero);
        q = _mm_add_epi32(q, _mm_add_epi32(_mm_madd_epi16(low, low), _mm_madd_epi16(high, high)));
        small = _mm_min_epu8(small, v);
        large = _mm_max_epu8(large, v);
    }
    s = _mm_add_epi64(s, _mm_unpackhi_epi64(s, s));
    q = _mm_add_epi32(q, _mm_shuffle_epi32(q, 0x4E));
    q = _mm_add_epi32(q, _mm_shuffle_epi32(q, 0xB1));
    small = _mm_min_epu8(small, _mm_srli_si128(small, 8));
    small = _mm_min_epu8(small, _mm_srli_si128(small, 4));
    small = _mm_min_epu8(small, _mm_srli_si128(small, 2));
    small = _mm_min_epu8(small, _mm_srli_si128(small, 1));
    large = _mm_max_epu8(large, _mm_srli_si128(large, 8));
    large = _mm_max_epu8(large, _mm_srli_si128(large, 4));
    large = _mm_max_epu8(large, _mm_srli_si128(large, 2));
    large = _mm_max_epu8(large, _mm_srli_si128(large, 1));
    const int64_t su = _mm_cvtsi128_si32(s), squ = _mm_cvtsi128_si32(q);
    *sum = su - n * bias;
    *sq = squ - 2 * bias * su + n * bias * bias;
    *lo = (int64_t)(_mm_cvtsi128_si32(small) & 0xFF) - bias;
    *hi = (int64_t)(_mm_cvtsi128_si32(large) & 0xFF) - bias;
}
#else
GGML_INLINE void ggml_moments(const uint8_t *u, int n, int64_t bias, int64_t *sum, int64_t *sq, int64_t *lo,
                              int64_t *hi)
{
    int64_t su = 0, squ = 0, small = 255, large = 0;
    for (int l = 0; l < n; l++) {
        su += u[l]; squ += u[l] * u[l];
        small = u[l] < small ? u[l] : small; large = u[l] > large ? u[l] : large;
    }
    *sum = su - n * bias;
    *sq = squ - 2 * bias * su + n * bias * bias;
    *lo = small - bias;
    *hi = large - bias;
}
#endif

static inline double ggml_min2(double x, double y) { return x < y ? x : y; }  /* NumPy: y on a tie */
static inline double ggml_max2(double x, double y) { return x > y ? x : y; }

GGML_INLINE void ggml_block(const GgmlLayout *t, const uint8_t *b, int big_endian, int extremes, double *res,
                            uint8_t *ok)
{
    uint8_t c[256];
    int64_t a[16], m[16], sum[16], sq[16], lo[16], hi[16];
    ggml_unpack(t->type, b, big_endian, c, a, m);
    for (int s = 0; s < t->subs; s++)
        ggml_moments(c + s * t->sub_len, t->sub_len, t->bias, sum + s, sq + s, lo + s, hi + s);
    const uint32_t d_bits = big_endian ? (uint32_t)b[t->d_at] << 8 | b[t->d_at + 1]
                                       : (uint32_t)b[t->d_at + 1] << 8 | b[t->d_at];
    res[0] = res[1] = res[2] = res[3] = 0.0;
    if (t->m_at < 0) {  /* _scaled_sums: v = d * (A c) */
        if (((d_bits >> 10) & 31) == 31) { *ok = 0; return; }
        const double d = f16_value[d_bits];
        int64_t w2 = 0, w1 = 0, e_lo = INT64_MAX, e_hi = INT64_MIN;
        for (int s = 0; s < t->subs; s++) {
            const int64_t as = t->has_scales ? a[s] : 1, x = as * lo[s], y = as * hi[s];
            w2 += as * as * sq[s]; w1 += as * sum[s];
            const int64_t small = x < y ? x : y, large = x > y ? x : y;
            e_lo = small < e_lo ? small : e_lo; e_hi = large > e_hi ? large : e_hi;
        }
        res[0] = (d * d) * (double)w2;
        res[1] = d * (double)w1;
        if (extremes) {
            const double smallest = (double)e_lo * d, largest = (double)e_hi * d;
            res[2] = ggml_min2(smallest, largest);
            res[3] = ggml_max2(smallest, largest);
        }
        *ok = 1;
        return;
    }
    /* _affine_sums: v = (d A) c - m' B, exact where every value is below 2**24 in units of 2**e */
    const uint32_t m_bits = big_endian ? (uint32_t)b[t->m_at] << 8 | b[t->m_at + 1]
                                       : (uint32_t)b[t->m_at + 1] << 8 | b[t->m_at];
    const int64_t n = t->sub_len;
    int64_t a_top, b_top, b_sign;
    uint64_t w_aa = 0, w_ab = 0, w_bb = 0, w_a = 0, w_b = 0;
    if (!t->has_scales) {  /* Q4_1/Q5_1: A = 1, B = -1 */
        a_top = 1; b_top = 1; b_sign = -1;
        w_aa = (uint64_t)sq[0]; w_ab = -(uint64_t)sum[0]; w_bb = 1; w_a = (uint64_t)sum[0]; w_b = (uint64_t)-1;
    } else {
        a_top = INT64_MIN; b_top = INT64_MIN; b_sign = 1;
        for (int s = 0; s < t->subs; s++) {
            a_top = a[s] > a_top ? a[s] : a_top; b_top = m[s] > b_top ? m[s] : b_top;
            w_aa += (uint64_t)(a[s] * a[s] * sq[s]); w_ab += (uint64_t)(a[s] * m[s] * sum[s]);
            w_bb += (uint64_t)(m[s] * m[s]); w_a += (uint64_t)(a[s] * sum[s]); w_b += (uint64_t)m[s];
        }
    }
    int64_t d_sig, d_exp, m_sig, m_exp;
    int bad = ggml_f16_parts(d_bits, &d_sig, &d_exp);
    bad |= ggml_f16_parts(m_bits, &m_sig, &m_exp);
    const int uses_m = m_sig != 0 && b_top != 0;
    const int64_t low_exp = uses_m && m_exp < d_exp ? m_exp : d_exp;
    const double p_top = fabs((double)(d_sig * a_top) * ggml_pow2(d_exp - low_exp)) * (double)t->c_hi;
    const double q_top = fabs((double)(m_sig * b_top) * ggml_pow2(m_exp - low_exp));
    const int same_sign = (d_sig >= 0) == (m_sig * b_sign >= 0);
    const double reach = same_sign ? (p_top > q_top ? p_top : q_top) : p_top + q_top;
    if (!(reach < 16777216.0) || bad) { *ok = 0; return; }
    const uint64_t p = (uint64_t)d_sig << (d_exp - low_exp);
    const uint64_t q = uses_m ? (uint64_t)m_sig << (m_exp - low_exp) : 0;
    const uint64_t squares = p * p * w_aa - 2 * p * q * w_ab + (uint64_t)n * q * q * w_bb;
    const uint64_t totals = p * w_a - (uint64_t)n * q * w_b;
    res[0] = (double)(int64_t)squares * ggml_pow2(2 * low_exp);
    res[1] = (double)(int64_t)totals * ggml_pow2(low_exp);
    if (extremes) {
        int64_t e_lo = INT64_MAX, e_hi = INT64_MIN;
        for (int s = 0; s < t->subs; s++) {
            const uint64_t pa = t->has_scales ? p * (uint64_t)a[s] : p, qb = t->has_scales ? q * (uint64_t)m[s] : -q;
            const int64_t x = (int64_t)(pa * (uint64_t)lo[s] - qb), y = (int64_t)(pa * (uint64_t)hi[s] - qb);
            const int64_t small = x < y ? x : y, large = x > y ? x : y;
            e_lo = small < e_lo ? small : e_lo; e_hi = large > e_hi ? large : e_hi;
        }
        res[2] = (double)e_lo * ggml_pow2(low_exp);
        res[3] = (double)e_hi * ggml_pow2(low_exp);
    }
    *ok = 1;
}

GGML_INLINE void ggml_loop(int type, const uint8_t *b, Py_ssize_t count, int big_endian, int extremes, double *o,
                           uint8_t *ok)
{
    const GgmlLayout t = ggml_layout(type);
    double res[4];
    for (Py_ssize_t i = 0; i < count; i++, b += t.block_bytes) {
        ggml_block(&t, b, big_endian, extremes, res, ok + i);
        o[i] = res[0]; o[count + i] = res[1]; o[2 * count + i] = res[2]; o[3 * count + i] = res[3];
    }
}

static void ggml_loops(int type, const uint8_t *b, Py_ssize_t count, int big_endian, int extremes, double *o,
                       uint8_t *ok)
{
    switch (type) {
    case 8: ggml_loop(8, b, count, big_endian, extremes, o, ok); break;
    case 2: ggml_loop(2, b, count, big_endian, extremes, o, ok); break;
    case 3: ggml_loop(3, b, count, big_endian, extremes, o, ok); break;
    case 6: ggml_loop(6, b, count, big_endian, extremes, o, ok); break;
    case 7: ggml_loop(7, b, count, big_endian, extremes, o, ok); break;
    case 10: ggml_loop(10, b, count, big_endian, extremes, o, ok); break;
    case 11: ggml_loop(11, b, count, big_endian, extremes, o, ok); break;
    case 12: ggml_loop(12, b, count, big_endian, extremes, o, ok); break;
    case 13: ggml_loop(13, b, count, big_endian, extremes, o, ok); break;
    case 14: ggml_loop(14, b, count, big_endian, extremes, o, ok); break;
    }
}

/* ggml_sums(blocks, type_id, big_endian, extremes, out, ok): see the section's comment; out is
 * float64 (4, blocks): sums of squares, sums, smallest, largest (0 where extremes is 0). */
static PyObject *ggml_sums(PyObject *self, PyObject *args)
{
    (void)self;
    Py_buffer raw, out, okb;
    int type, big_endian, extremes;
    if (!PyArg_ParseTuple(args, "y*iiiw*w*", &raw, &type, &big_endian, &extremes, &out, &okb)) return NULL;
    const GgmlLayout layout = ggml_layout(type);
    const Py_ssize_t count = layout.block_bytes ? raw.len / layout.block_bytes : 0;
    const int ok = layout.block_bytes && raw.len % layout.block_bytes == 0
                   && out.len == 4 * count * (Py_ssize_t)sizeof(double) && okb.len == count;
    if (ok) {
        Py_BEGIN_ALLOW_THREADS
        ggml_loops(type, raw.buf, count, big_endian, extremes, out.buf, okb.buf);
        Py_END_ALLOW_THREADS
    }
    PyBuffer_Release(&raw);
    PyBuffer_Release(&out);
    PyBuffer_Release(&okb);
    if (!ok) {
        PyErr_SetString(PyExc_ValueError, "ggml_sums: unknown type, or blocks and outputs that do not match");
        return NULL;
    }
    Py_RETURN_NONE;
}
