/* Elementwise reductions (see reduce.h for the semantics). */
#include "reduce.h"

#include <math.h>
#include <string.h>

typedef void (*rc_pair_fn)(void *dst, const void *a, const void *b, size_t n);
typedef void (*rc_final_fn)(void *buf, size_t n, int divisor, double factor);

/* ---------------------------------------------------------------- float16 and bfloat16 */
static inline float h2f(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t exp = (h >> 10) & 0x1fu;
    uint32_t man = h & 0x3ffu;
    uint32_t bits;
    if (exp == 0) {
        if (man == 0) {
            bits = sign;
        } else { /* subnormal: normalise */
            exp = 127 - 15 + 1;
            while (!(man & 0x400u)) {
                man <<= 1;
                exp--;
            }
            man &= 0x3ffu;
            bits = sign | (exp << 23) | (man << 13);
        }
    } else if (exp == 0x1f) {
        bits = sign | 0x7f800000u | (man << 13);
    } else {
        bits = sign | ((exp + 127 - 15) << 23) | (man << 13);
    }
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* numpy's npy_floatbits_to_halfbits: round to nearest even. */
static inline uint16_t f2h(float value) {
    uint32_t f;
    memcpy(&f, &value, sizeof f);
    uint16_t h_sgn = (uint16_t)((f & 0x80000000u) >> 16);
    uint32_t f_exp = f & 0x7f800000u;
    uint32_t f_sig;
    if (f_exp >= 0x47800000u) { /* overflow, inf or NaN */
        if (f_exp == 0x7f800000u) {
            f_sig = f & 0x007fffffu;
            if (f_sig != 0) {
                uint16_t ret = (uint16_t)(0x7c00u + (f_sig >> 13));
                if (ret == 0x7c00u) ret++;
                return (uint16_t)(h_sgn + ret);
            }
        }
        return (uint16_t)(h_sgn + 0x7c00u);
    }
    if (f_exp <= 0x38000000u) { /* a subnormal half, or zero */
        if (f_exp < 0x33000000u) return h_sgn;
        f_exp >>= 23;
        f_sig = 0x00800000u + (f & 0x007fffffu);
        uint32_t lost = f & 0x000007ffu;
        f_sig >>= (113 - f_exp);
        if (((f_sig & 0x00003fffu) != 0x00001000u) || lost) f_sig += 0x00001000u;
        return (uint16_t)(h_sgn + (uint16_t)(f_sig >> 13));
    }
    uint16_t h_exp = (uint16_t)((f_exp - 0x38000000u) >> 13);
    f_sig = f & 0x007fffffu;
    if ((f_sig & 0x00003fffu) != 0x00001000u) f_sig += 0x00001000u;
    uint16_t h_sig = (uint16_t)(f_sig >> 13);
    return (uint16_t)(h_sgn + h_sig + h_exp);
}

static inline float b2f(uint16_t b) {
    uint32_t bits = (uint32_t)b << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static inline uint16_t f2b(float value) {
    uint32_t bits;
    memcpy(&bits, &value, sizeof bits);
    if ((bits & 0x7f800000u) == 0x7f800000u && (bits & 0x007fffffu)) /* NaN: stay quiet */
        return (uint16_t)((bits >> 16) | 0x40u);
    bits += 0x7fffu + ((bits >> 16) & 1u);
    return (uint16_t)(bits >> 16);
}

/* ---------------------------------------------------------------- element operations */
#define NAN_MIN(a, b) (((a) < (b) || (a) != (a)) ? (a) : (b))
#define NAN_MAX(a, b) (((a) > (b) || (a) != (a)) ? (a) : (b))

/* A pair function over a plain C type: dst[i] = a[i] OP b[i]. */
#define PAIR(name, T, EXPR)                                                     \
    static void name(void *dst_, const void *a_, const void *b_, size_t n) {   \
        T *dst = (T *)dst_;                                                     \
        const T *a = (const T *)a_;                                             \
        const T *b = (const T *)b_;                                             \
        for (size_t i = 0; i < n; i++) {                                        \
            T x = a[i], y = b[i];                                               \
            dst[i] = (T)(EXPR);                                                 \
        }                                                                       \
    }

/* Integers wrap: arithmetic in an unsigned type at least as wide (M: not promoted to int). */
#define INT_PAIRS(S, T, U, M)                               \
    PAIR(S##_sum, T, (U)((M)(U)x + (M)(U)y))                \
    PAIR(S##_prod, T, (U)((M)(U)x * (M)(U)y))               \
    PAIR(S##_min, T, x < y ? x : y)                         \
    PAIR(S##_max, T, x > y ? x : y)                         \
    PAIR(S##_band, T, x & y)                                \
    PAIR(S##_bor, T, x | y)                                 \
    PAIR(S##_bxor, T, x ^ y)

INT_PAIRS(i8, int8_t, uint8_t, uint32_t)
INT_PAIRS(u8, uint8_t, uint8_t, uint32_t)
INT_PAIRS(i16, int16_t, uint16_t, uint32_t)
INT_PAIRS(u16, uint16_t, uint16_t, uint32_t)
INT_PAIRS(i32, int32_t, uint32_t, uint32_t)
INT_PAIRS(u32, uint32_t, uint32_t, uint32_t)
INT_PAIRS(i64, int64_t, uint64_t, uint64_t)
INT_PAIRS(u64, uint64_t, uint64_t, uint64_t)

PAIR(b_or, uint8_t, (x != 0) | (y != 0))
PAIR(b_and, uint8_t, (x != 0) & (y != 0))
PAIR(b_xor, uint8_t, (x != 0) ^ (y != 0))

#define FLOAT_PAIRS(S, T)                       \
    PAIR(S##_sum, T, x + y)                     \
    PAIR(S##_prod, T, x * y)                    \
    PAIR(S##_min, T, NAN_MIN(x, y))             \
    PAIR(S##_max, T, NAN_MAX(x, y))

FLOAT_PAIRS(f32, float)
FLOAT_PAIRS(f64, double)
FLOAT_PAIRS(fld, long double)

/* 16-bit floats: each step in float32, rounded back. */
#define HALF_PAIRS(S, TOF, FROMF)                                  \
    PAIR(S##_sum, uint16_t, FROMF(TOF(x) + TOF(y)))                \
    PAIR(S##_prod, uint16_t, FROMF(TOF(x) * TOF(y)))               \
    PAIR(S##_min, uint16_t, FROMF(NAN_MIN(TOF(x), TOF(y))))        \
    PAIR(S##_max, uint16_t, FROMF(NAN_MAX(TOF(x), TOF(y))))

HALF_PAIRS(f16, h2f, f2h)
HALF_PAIRS(bf16, b2f, f2b)

/* Complex numbers as (re, im) pairs of T. */
#define COMPLEX_PAIRS(S, T)                                                       \
    static void S##_sum(void *dst_, const void *a_, const void *b_, size_t n) {   \
        T *dst = (T *)dst_;                                                       \
        const T *a = (const T *)a_;                                               \
        const T *b = (const T *)b_;                                               \
        for (size_t i = 0; i < 2 * n; i++) dst[i] = a[i] + b[i];                 \
    }                                                                             \
    static void S##_prod(void *dst_, const void *a_, const void *b_, size_t n) {  \
        T *dst = (T *)dst_;                                                       \
        const T *a = (const T *)a_;                                               \
        const T *b = (const T *)b_;                                               \
        for (size_t i = 0; i < n; i++) {                                          \
            T ar = a[2 * i], ai = a[2 * i + 1], br = b[2 * i], bi = b[2 * i + 1]; \
            dst[2 * i] = ar * br - ai * bi;                                       \
            dst[2 * i + 1] = ar * bi + ai * br;                                   \
        }                                                                         \
    }

COMPLEX_PAIRS(c64, float)
COMPLEX_PAIRS(c128, double)

/* ---------------------------------------------------------------- finishing steps */
/* numpy: np.divide(out, W) for floats; np.trunc(out / W) cast back for integers. */
#define FINAL_FLOAT(S, T)                                                          \
    static void S##_final(void *buf_, size_t n, int divisor, double factor) {     \
        T *buf = (T *)buf_;                                                        \
        if (divisor) {                                                             \
            T d = (T)divisor;                                                      \
            for (size_t i = 0; i < n; i++) buf[i] = buf[i] / d;                    \
        } else {                                                                   \
            T f = (T)factor;                                                       \
            for (size_t i = 0; i < n; i++) buf[i] = buf[i] * f;                    \
        }                                                                          \
    }
FINAL_FLOAT(f32, float)
FINAL_FLOAT(f64, double)
FINAL_FLOAT(fld, long double)

/* PREMUL_SUM's product on integers, converted back with a defined result for every value (a
 * plain cast of a double out of the type's range, or of NaN, is undefined behaviour in C,
 * and x86 and ARM give different values): truncated toward zero, NaN to 0, saturated at the
 * type's bounds (lo, hi: as doubles, hi the first value past the type's largest). Within the
 * range it is numpy's astype. */
#define FINAL_INT(S, T, LO, HI, TMIN, TMAX)                                        \
    static void S##_final(void *buf_, size_t n, int divisor, double factor) {     \
        T *buf = (T *)buf_;                                                        \
        if (divisor) {                                                             \
            double d = (double)divisor;                                            \
            for (size_t i = 0; i < n; i++) buf[i] = (T)trunc((double)buf[i] / d); \
        } else {                                                                   \
            for (size_t i = 0; i < n; i++) {                                       \
                double v = trunc((double)buf[i] * factor);                         \
                buf[i] = v != v ? (T)0 : v <= (LO) ? (TMIN) : v >= (HI) ? (TMAX) : (T)v; \
            }                                                                      \
        }                                                                          \
    }
FINAL_INT(i8, int8_t, -128.0, 128.0, INT8_MIN, INT8_MAX)
FINAL_INT(u8, uint8_t, 0.0, 256.0, 0, UINT8_MAX)
FINAL_INT(i16, int16_t, -32768.0, 32768.0, INT16_MIN, INT16_MAX)
FINAL_INT(u16, uint16_t, 0.0, 65536.0, 0, UINT16_MAX)
FINAL_INT(i32, int32_t, -2147483648.0, 2147483648.0, INT32_MIN, INT32_MAX)
FINAL_INT(u32, uint32_t, 0.0, 4294967296.0, 0, UINT32_MAX)
FINAL_INT(i64, int64_t, -9223372036854775808.0, 9223372036854775808.0, INT64_MIN, INT64_MAX)
FINAL_INT(u64, uint64_t, 0.0, 18446744073709551616.0, 0, UINT64_MAX)

#define FINAL_HALF(S, TOF, FROMF)                                                   \
    static void S##_final(void *buf_, size_t n, int divisor, double factor) {      \
        uint16_t *buf = (uint16_t *)buf_;                                           \
        if (divisor) {                                                              \
            float d = TOF(FROMF((float)divisor));                                   \
            for (size_t i = 0; i < n; i++) buf[i] = FROMF(TOF(buf[i]) / d);         \
        } else {                                                                    \
            float f = TOF(FROMF((float)factor));                                    \
            for (size_t i = 0; i < n; i++) buf[i] = FROMF(TOF(buf[i]) * f);         \
        }                                                                           \
    }
FINAL_HALF(f16, h2f, f2h)
FINAL_HALF(bf16, b2f, f2b)

#define FINAL_COMPLEX(S, T)                                                        \
    static void S##_final(void *buf_, size_t n, int divisor, double factor) {     \
        T *buf = (T *)buf_;                                                        \
        T f = divisor ? (T)divisor : (T)factor;                                    \
        if (divisor) {                                                             \
            for (size_t i = 0; i < 2 * n; i++) buf[i] = buf[i] / f;                \
        } else {                                                                   \
            for (size_t i = 0; i < 2 * n; i++) buf[i] = buf[i] * f;                \
        }                                                                          \
    }
FINAL_COMPLEX(c64, float)
FINAL_COMPLEX(c128, double)

/* ---------------------------------------------------------------- the tables */
static const size_t SIZES[RC_DT_COUNT] = {
    1, 1, 1, 2, 2, 4, 4, 8, 8, 2, 2, 4, 8, sizeof(long double), 8, 16,
};

/* By dtype: SUM, PRODUCT, MIN, MAX, BAND, BOR, BXOR (AVG and PREMUL_SUM use SUM). */
#define INT_ROW(S) {S##_sum, S##_prod, S##_min, S##_max, S##_band, S##_bor, S##_bxor}
#define FLOAT_ROW(S) {S##_sum, S##_prod, S##_min, S##_max, NULL, NULL, NULL}
static const rc_pair_fn PAIRS[RC_DT_COUNT][7] = {
    {b_or, b_and, b_and, b_or, b_and, b_or, b_xor},
    INT_ROW(i8),
    INT_ROW(u8),
    INT_ROW(i16),
    INT_ROW(u16),
    INT_ROW(i32),
    INT_ROW(u32),
    INT_ROW(i64),
    INT_ROW(u64),
    FLOAT_ROW(f16),
    FLOAT_ROW(bf16),
    FLOAT_ROW(f32),
    FLOAT_ROW(f64),
    FLOAT_ROW(fld),
    {c64_sum, c64_prod, NULL, NULL, NULL, NULL, NULL},
    {c128_sum, c128_prod, NULL, NULL, NULL, NULL, NULL},
};

static const rc_final_fn FINALS[RC_DT_COUNT] = {
    NULL, i8_final, u8_final, i16_final, u16_final, i32_final, u32_final, i64_final,
    u64_final, f16_final, bf16_final, f32_final, f64_final, fld_final, c64_final,
    c128_final,
};

size_t rc_dtype_size(int dtype) {
    return (dtype >= 0 && dtype < RC_DT_COUNT) ? SIZES[dtype] : 0;
}

static rc_pair_fn pair_fn(int dtype, int op) {
    if (dtype < 0 || dtype >= RC_DT_COUNT || op < 0 || op >= RC_RED_COUNT) return NULL;
    if (op == RC_RED_AVG || op == RC_RED_PREMUL_SUM) {
        if (dtype == RC_DT_BOOL) return NULL; /* not defined on bool, as in raycoll.reduce_op */
        op = RC_RED_SUM;
    }
    return PAIRS[dtype][op];
}

int rc_reduce_supported(int dtype, int op) { return pair_fn(dtype, op) != NULL; }

/* Elements a block: the reduction walks the sources a block at a time, so that the
 * destination's block stays in the first-level cache across the sources. */
#define BLOCK_BYTES 8192

int rc_reduce(int dtype, int op, void *dst, const void *const *src, int nsrc, size_t count) {
    rc_pair_fn fn = pair_fn(dtype, op);
    if (fn == NULL || nsrc < 1) return -1;
    size_t size = SIZES[dtype];
    if (nsrc == 1) {
        if (dst != src[0]) memmove(dst, src[0], count * size);
        return 0;
    }
    size_t block = BLOCK_BYTES / size;
    if (block == 0) block = 1;
    uint8_t *d = (uint8_t *)dst;
    for (size_t at = 0; at < count; at += block) {
        size_t n = count - at < block ? count - at : block;
        size_t off = at * size;
        fn(d + off, (const uint8_t *)src[0] + off, (const uint8_t *)src[1] + off, n);
        for (int k = 2; k < nsrc; k++) fn(d + off, d + off, (const uint8_t *)src[k] + off, n);
    }
    return 0;
}

int rc_finalize(int dtype, int op, void *buf, size_t count, int divisor, double factor) {
    if (dtype < 0 || dtype >= RC_DT_COUNT) return -1;
    if (op == RC_RED_AVG) {
        if (divisor <= 1) return 0;
        factor = 0.0;
    } else if (op == RC_RED_PREMUL_SUM) {
        divisor = 0;
    } else {
        return 0;
    }
    rc_final_fn fn = FINALS[dtype];
    if (fn == NULL) return -1;
    fn(buf, count, divisor, factor);
    return 0;
}
