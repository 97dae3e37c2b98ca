/*
 * Elementwise reductions of raycoll's native core, with numpy's semantics for every dtype and
 * ReduceOp raycoll has (raycoll/reduce_op.py is the reference they are tested against):
 * integers wrap, float MIN/MAX propagate NaN, float16 and bfloat16 compute each step in
 * float32 and round to nearest even (as numpy's float16 loops do), bool SUM/MAX is OR and
 * PRODUCT/MIN is AND, complex PRODUCT is (ac - bd, ad + bc). AVG and PREMUL_SUM reduce as
 * SUM; their last step (rc_finalize) divides by the ranks / multiplies by the factor, as
 * raycoll.reduce_op.finalize does (integers: through float64, truncated).
 *
 * Functions are picked from tables by (dtype, op): no chain of ifs a call.
 */
#ifndef RAYCOLL_REDUCE_H
#define RAYCOLL_REDUCE_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* dtype codes (raycoll/native/__init__.py maps numpy dtypes to them) */
enum {
    RC_DT_BOOL = 0,
    RC_DT_INT8,
    RC_DT_UINT8,
    RC_DT_INT16,
    RC_DT_UINT16,
    RC_DT_INT32,
    RC_DT_UINT32,
    RC_DT_INT64,
    RC_DT_UINT64,
    RC_DT_FLOAT16,
    RC_DT_BFLOAT16,
    RC_DT_FLOAT32,
    RC_DT_FLOAT64,
    RC_DT_LONGDOUBLE,
    RC_DT_COMPLEX64,
    RC_DT_COMPLEX128,
    RC_DT_COUNT
};

/* op codes (the names of raycoll.ReduceOp) */
enum {
    RC_RED_SUM = 0,
    RC_RED_PRODUCT,
    RC_RED_MIN,
    RC_RED_MAX,
    RC_RED_BAND,
    RC_RED_BOR,
    RC_RED_BXOR,
    RC_RED_AVG,
    RC_RED_PREMUL_SUM,
    RC_RED_COUNT
};

/* The size of one element of dtype (0: unknown dtype). */
size_t rc_dtype_size(int dtype);
/* Whether op is defined on dtype (as raycoll.reduce_op.check_op_dtype decides). */
int rc_reduce_supported(int dtype, int op);
/* dst[i] = src[0][i] op src[1][i] op ... op src[nsrc-1][i], in that order, for count
 * elements (dst may be src[0]). 0, or -1 for an unsupported (dtype, op) or nsrc < 1. */
int rc_reduce(int dtype, int op, void *dst, const void *const *src, int nsrc, size_t count);
/* AVG's division by divisor / PREMUL_SUM's multiplication by factor, in place; nothing for
 * the other ops. */
int rc_finalize(int dtype, int op, void *buf, size_t count, int divisor, double factor);

#ifdef __cplusplus
}
#endif
#endif
