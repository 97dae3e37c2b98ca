/*
 * raycoll._core's Python binding: it parses arguments, takes buffers through the buffer
 * protocol, releases the GIL and calls the plain C of segment.c and reduce.c. Nothing is
 * decided here (raycoll/transport/segment.py plans; raycoll/native/__init__.py loads this).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "binding.h"
#include "cma.h"
#include "core.h"
#include "net.h"
#include "reduce.h"
#include "segment.h"

/* The most buffers one run takes (an all_to_all's pieces each: core.h). */
#define MAX_BUFS RC_MAX_BUFS

/* Reductions of at most this many bytes keep the GIL (releasing it costs more). */
#define GIL_FREE_BYTES 65536

/* ---------------------------------------------------------------- buffers */
/* A buffer of a call: writable when the object lends it so. */
int take_buffer(PyObject *obj, Py_buffer *view, int need_writable) {
    if (PyObject_GetBuffer(obj, view, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) == 0) return 1;
    if (need_writable) return -1;
    PyErr_Clear();
    if (PyObject_GetBuffer(obj, view, PyBUF_C_CONTIGUOUS) == 0) return 0;
    return -1;
}

/* ---------------------------------------------------------------- reductions */
static PyObject *py_reduce(PyObject *self, PyObject *args) {
    int dtype, op;
    PyObject *dst_obj, *srcs_obj;
    (void)self;
    if (!PyArg_ParseTuple(args, "iiOO", &dtype, &op, &dst_obj, &srcs_obj)) return NULL;
    size_t esize = rc_dtype_size(dtype);
    if (!esize || !rc_reduce_supported(dtype, op)) {
        PyErr_Format(PyExc_ValueError, "no native reduction for dtype code %d and op code %d",
                     dtype, op);
        return NULL;
    }
    PyObject *seq = PySequence_Fast(srcs_obj, "srcs must be a sequence of buffers");
    if (seq == NULL) return NULL;
    Py_ssize_t nsrc = PySequence_Fast_GET_SIZE(seq);
    if (nsrc < 1 || nsrc > RC_MAX_RANKS) {
        Py_DECREF(seq);
        PyErr_Format(PyExc_ValueError, "srcs: expected 1 to %d buffers, got %zd", RC_MAX_RANKS,
                     nsrc);
        return NULL;
    }
    Py_buffer dst;
    if (take_buffer(dst_obj, &dst, 1) < 0) {
        Py_DECREF(seq);
        return NULL;
    }
    Py_buffer views[RC_MAX_RANKS];
    const void *ptrs[RC_MAX_RANKS];
    Py_ssize_t got = 0;
    PyObject *result = NULL;
    if (dst.len % (Py_ssize_t)esize != 0) {
        PyErr_Format(PyExc_ValueError, "dst: %zd bytes is not a whole number of %zu-byte "
                     "elements", dst.len, esize);
        goto done;
    }
    for (; got < nsrc; got++) {
        if (take_buffer(PySequence_Fast_GET_ITEM(seq, got), &views[got], 0) < 0) goto done;
        if (views[got].len != dst.len) {
            PyErr_Format(PyExc_ValueError, "srcs[%zd] has %zd bytes, dst %zd", got,
                         views[got].len, dst.len);
            got++;
            goto done;
        }
        ptrs[got] = views[got].buf;
    }
    size_t count = (size_t)dst.len / esize;
    if (dst.len > GIL_FREE_BYTES) {
        Py_BEGIN_ALLOW_THREADS rc_reduce(dtype, op, dst.buf, ptrs, (int)nsrc, count);
        Py_END_ALLOW_THREADS
    } else {
        rc_reduce(dtype, op, dst.buf, ptrs, (int)nsrc, count);
    }
    result = Py_None;
    Py_INCREF(result);
done:
    for (Py_ssize_t i = 0; i < got; i++) PyBuffer_Release(&views[i]);
    PyBuffer_Release(&dst);
    Py_DECREF(seq);
    return result;
}

static PyObject *py_finalize(PyObject *self, PyObject *args) {
    int dtype, op, divisor;
    double factor;
    PyObject *obj;
    (void)self;
    if (!PyArg_ParseTuple(args, "iiOid", &dtype, &op, &obj, &divisor, &factor)) return NULL;
    size_t esize = rc_dtype_size(dtype);
    if (!esize) {
        PyErr_Format(PyExc_ValueError, "unknown dtype code %d", dtype);
        return NULL;
    }
    Py_buffer buf;
    if (take_buffer(obj, &buf, 1) < 0) return NULL;
    int rc = -1;
    if (buf.len % (Py_ssize_t)esize == 0) rc = rc_finalize(dtype, op, buf.buf, (size_t)buf.len / esize, divisor, factor);
    PyBuffer_Release(&buf);
    if (rc != 0) {
        PyErr_Format(PyExc_ValueError, "cannot finish op code %d on dtype code %d over this "
                     "buffer", op, dtype);
        return NULL;
    }
    Py_RETURN_NONE;
}

static PyObject *py_supported(PyObject *self, PyObject *args) {
    int dtype, op;
    (void)self;
    if (!PyArg_ParseTuple(args, "ii", &dtype, &op)) return NULL;
    return PyBool_FromLong(rc_reduce_supported(dtype, op));
}

static PyObject *py_dtype_size(PyObject *self, PyObject *args) {
    int dtype;
    (void)self;
    if (!PyArg_ParseTuple(args, "i", &dtype)) return NULL;
    return PyLong_FromSize_t(rc_dtype_size(dtype));
}

/* ---------------------------------------------------------------- the Segment type */
typedef struct {
    PyObject_HEAD
    rc_seg seg;
    int busy;    /* a run or a rejection is in progress (in some thread) */
    int exports; /* buffer views of the mapping alive */
} SegmentObject;

static PyObject *SegmentError;
static PyTypeObject SegmentType;

static int seg_init(SegmentObject *self, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"name", "nranks", "rank", "half_bytes", "create", NULL};
    const char *name;
    int nranks, rank, create;
    unsigned long long half;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "siiKp", kwlist, &name, &nranks, &rank, &half,
                                     &create))
        return -1;
    if (self->seg.base != NULL) {
        PyErr_SetString(PyExc_RuntimeError, "Segment is already open");
        return -1;
    }
    if (strlen(name) >= RC_NAME_MAX) {
        PyErr_Format(PyExc_ValueError, "segment name too long (at most %d characters)",
                     RC_NAME_MAX - 1);
        return -1;
    }
    char err[256] = "";
    int rc;
    Py_BEGIN_ALLOW_THREADS rc = create ? rc_seg_create(&self->seg, name, nranks, rank, half, err, sizeof err)
                                       : rc_seg_attach(&self->seg, name, nranks, rank, half, err, sizeof err);
    Py_END_ALLOW_THREADS
    if (rc != 0) {
        PyObject *exc = Py_BuildValue("(is)", rc, err);
        if (exc != NULL) {
            PyErr_SetObject(SegmentError, exc);
            Py_DECREF(exc);
        }
        return -1;
    }
    return 0;
}

static void seg_dealloc(SegmentObject *self) {
    rc_seg_unmap(&self->seg);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static int seg_open(SegmentObject *self) {
    if (self->seg.base == NULL) {
        PyErr_SetString(PyExc_ValueError, "the segment is closed");
        return 0;
    }
    return 1;
}

/* The exception classes whose errors leave a group usable (set_soft_errors): a check that
 * raises one of them fails its run softly (RC_CHECK_SOFT; see core.h). */
static PyObject *soft_errors = NULL;

static PyObject *py_set_soft_errors(PyObject *self, PyObject *arg) {
    (void)self;
    if (!PyTuple_Check(arg)) {
        PyErr_SetString(PyExc_TypeError, "set_soft_errors takes a tuple of exception classes");
        return NULL;
    }
    Py_INCREF(arg);
    Py_XSETREF(soft_errors, arg);
    Py_RETURN_NONE;
}

/* The check callback: called with the GIL released inside rc_exec. */
int call_check(void *arg, double waited_s, const int *pending, int npending) {
    check_arg *c = (check_arg *)arg;
    PyEval_RestoreThread(c->ts);
    int failed = RC_CHECK_HARD;
    PyObject *tuple = PyTuple_New(npending);
    if (tuple != NULL) {
        for (int i = 0; i < npending; i++) PyTuple_SET_ITEM(tuple, i, PyLong_FromLong(pending[i]));
        PyObject *r = PyObject_CallFunction(c->fn, "dO", waited_s, tuple);
        Py_DECREF(tuple);
        if (r != NULL) {
            Py_DECREF(r);
            failed = PyErr_CheckSignals() != 0 ? RC_CHECK_HARD : 0;
        }
    }
    if (failed && soft_errors != NULL && PyErr_ExceptionMatches(soft_errors))
        failed = RC_CHECK_SOFT;
    c->ts = PyEval_SaveThread();
    return failed;
}

PyObject *check_exception(int rc) {
    PyObject *exc = Py_None;
    if (rc == RC_CHECK && PyErr_Occurred()) { /* the callback's exception, handed back */
        PyObject *type, *value, *tb;
        PyErr_Fetch(&type, &value, &tb);
        PyErr_NormalizeException(&type, &value, &tb);
        if (tb != NULL && value != NULL) PyException_SetTraceback(value, tb);
        Py_XDECREF(type);
        Py_XDECREF(tb);
        exc = value != NULL ? value : Py_None;
        if (value == NULL) Py_INCREF(exc);
    } else {
        Py_INCREF(exc);
    }
    return exc;
}

/* The waiting policy and the call's identity, from run()'s / reject()'s keywords. */
int parse_call(PyObject *wait, rc_call *call) {
    unsigned long long spin, tick, check, check_max;
    if (!PyArg_ParseTuple(wait, "KKKK", &spin, &tick, &check, &check_max)) return 0;
    call->wait.spin_ns = spin;
    call->wait.tick_ns = tick;
    call->wait.check_ns = check;
    call->wait.check_max_ns = check_max;
    return 1;
}

/* A plan's run on a segment (or none) and the sockets of net (or none): net is
 * (out_fds, in_fds, conns, fp_hash): int64 sockets by peer slot, each connection's kept
 * state (RC_CONN_BYTES a slot, writable), the call's fingerprint hash. */
static PyObject *run_plan(SegmentObject *segobj, PyObject *plan_obj, PyObject *bufs_obj,
                          int dtype, int op, double factor, int divisor,
                          unsigned long long call_seq, Py_buffer *fp, PyObject *wait,
                          PyObject *check, PyObject *net_obj, Py_buffer *rank_map) {
    PyObject *result = NULL;
    PyObject *seq = NULL;
    Py_buffer plan, out_fds, in_fds, conns;
    int have_plan = 0, have_net = 0;
    Py_buffer *views = NULL;
    rc_buf *bufs = NULL;
    Py_ssize_t nbufs = 0, got = 0;
    rc_call call;
    rc_net net;
    unsigned long long fp_hash = 0;
    memset(&call, 0, sizeof call);
    memset(&net, 0, sizeof net);
    if (segobj != NULL && !seg_open(segobj)) goto done;
    if (!parse_call(wait, &call)) goto done;
    if (segobj != NULL && segobj->busy) {
        PyErr_SetString(PyExc_RuntimeError, "the segment is busy with another call");
        goto done;
    }
    if (fp->len > RC_FP_BYTES) {
        PyErr_Format(PyExc_ValueError, "fingerprint of %zd bytes (at most %u)", fp->len,
                     RC_FP_BYTES);
        goto done;
    }
    if (net_obj != Py_None) {
        if (!PyArg_ParseTuple(net_obj, "y*y*w*K", &out_fds, &in_fds, &conns, &fp_hash)) goto done;
        have_net = 1;
        Py_ssize_t npeers = out_fds.len / (Py_ssize_t)sizeof(int64_t);
        if (out_fds.len != in_fds.len || out_fds.len % (Py_ssize_t)sizeof(int64_t) ||
            conns.len != npeers * RC_CONN_BYTES || npeers > 2 * RC_MAX_RANKS) {
            PyErr_SetString(PyExc_ValueError, "net: out_fds and in_fds are int64 per peer, "
                            "conns RC_CONN_BYTES per peer");
            goto done;
        }
        net.npeers = (int)npeers;
        net.out_fd = (const int64_t *)out_fds.buf;
        net.in_fd = (const int64_t *)in_fds.buf;
        net.conns = (rc_conn *)conns.buf;
    }
    if (PyObject_GetBuffer(plan_obj, &plan, PyBUF_C_CONTIGUOUS) < 0) goto done;
    have_plan = 1;
    if (plan.len % (Py_ssize_t)(RC_OP_WORDS * sizeof(int64_t)) != 0) {
        PyErr_SetString(PyExc_ValueError, "a plan is whole operations of 8 int64 words");
        goto done;
    }
    seq = PySequence_Fast(bufs_obj, "bufs must be a sequence of buffers");
    if (seq == NULL) goto done;
    nbufs = PySequence_Fast_GET_SIZE(seq);
    if (nbufs > MAX_BUFS) {
        PyErr_Format(PyExc_ValueError, "at most %d buffers a call", MAX_BUFS);
        goto done;
    }
    views = (Py_buffer *)PyMem_Calloc((size_t)nbufs + 1, sizeof(Py_buffer));
    bufs = (rc_buf *)PyMem_Calloc((size_t)nbufs + 1, sizeof(rc_buf));
    if (views == NULL || bufs == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (; got < nbufs; got++) {
        int writable = take_buffer(PySequence_Fast_GET_ITEM(seq, got), &views[got], 0);
        if (writable < 0) goto done;
        bufs[got].ptr = (uint8_t *)views[got].buf;
        bufs[got].len = (uint64_t)views[got].len;
        bufs[got].writable = writable;
    }
    call.dtype = dtype;
    call.op = op;
    call.factor = factor;
    call.divisor = divisor;
    call.call_seq = call_seq;
    call.fp = (const uint8_t *)fp->buf;
    call.fp_len = (uint32_t)fp->len;
    call.fp_hash = fp_hash;
    if (rank_map != NULL && rank_map->len > 0) {
        if (rank_map->len % (Py_ssize_t)sizeof(int32_t) ||
            rank_map->len / (Py_ssize_t)sizeof(int32_t) > RC_MAX_RANKS) {
            PyErr_SetString(PyExc_ValueError, "rank_map: int32 per local rank, at most "
                            "MAX_RANKS of them");
            goto done;
        }
        call.rank_map = (const int32_t *)rank_map->buf;
        call.rank_map_len = (int)(rank_map->len / (Py_ssize_t)sizeof(int32_t));
    }
    check_arg carg = {check, NULL};
    if (check != Py_None) {
        call.check = call_check;
        call.check_arg = &carg;
    }
    int peer = -1, rc;
    if (segobj != NULL) segobj->busy = 1;
    carg.ts = PyEval_SaveThread();
    rc = rc_exec(segobj != NULL ? &segobj->seg : NULL, have_net ? &net : NULL,
                 (const int64_t *)plan.buf, (size_t)plan.len / (RC_OP_WORDS * sizeof(int64_t)),
                 bufs, (int)nbufs, &call, &peer);
    PyEval_RestoreThread(carg.ts);
    if (segobj != NULL) segobj->busy = 0;
    result = Py_BuildValue("(iiiiN)", rc, peer, call.io_errno, call.broke, check_exception(rc));
done:
    for (Py_ssize_t i = 0; i < got; i++) PyBuffer_Release(&views[i]);
    PyMem_Free(views);
    PyMem_Free(bufs);
    Py_XDECREF(seq);
    if (have_plan) PyBuffer_Release(&plan);
    if (have_net) {
        PyBuffer_Release(&out_fds);
        PyBuffer_Release(&in_fds);
        PyBuffer_Release(&conns);
    }
    return result;
}

static PyObject *seg_run(SegmentObject *self, PyObject *args) {
    PyObject *plan_obj, *bufs_obj, *wait, *check;
    int dtype, op, divisor;
    double factor;
    unsigned long long call_seq;
    Py_buffer fp;
    if (!PyArg_ParseTuple(args, "OOiidiKy*OO", &plan_obj, &bufs_obj, &dtype, &op, &factor,
                          &divisor, &call_seq, &fp, &wait, &check))
        return NULL;
    PyObject *result = run_plan(self, plan_obj, bufs_obj, dtype, op, factor, divisor, call_seq,
                                &fp, wait, check, Py_None, NULL);
    PyBuffer_Release(&fp);
    return result;
}

static PyObject *py_execute(PyObject *module, PyObject *args) {
    PyObject *seg_obj, *plan_obj, *bufs_obj, *wait, *check, *net_obj;
    int dtype, op, divisor;
    double factor;
    unsigned long long call_seq;
    Py_buffer fp, rank_map;
    (void)module;
    memset(&rank_map, 0, sizeof rank_map);
    if (!PyArg_ParseTuple(args, "OOOiidiKy*OOO|y*", &seg_obj, &plan_obj, &bufs_obj, &dtype,
                          &op, &factor, &divisor, &call_seq, &fp, &wait, &check, &net_obj,
                          &rank_map))
        return NULL;
    PyObject *result = NULL;
    if (seg_obj != Py_None && !PyObject_TypeCheck(seg_obj, &SegmentType)) {
        PyErr_SetString(PyExc_TypeError, "seg must be a Segment or None");
    } else {
        result = run_plan(seg_obj == Py_None ? NULL : (SegmentObject *)seg_obj, plan_obj,
                          bufs_obj, dtype, op, factor, divisor, call_seq, &fp, wait, check,
                          net_obj, &rank_map);
    }
    PyBuffer_Release(&fp);
    if (rank_map.obj != NULL) PyBuffer_Release(&rank_map);
    return result;
}

static PyObject *seg_abort(SegmentObject *self, PyObject *args) {
    unsigned int reason = RC_ABORT_FAILED;
    if (!PyArg_ParseTuple(args, "|I", &reason)) return NULL;
    if (!seg_open(self)) return NULL;
    rc_seg_abort(&self->seg, reason ? reason : RC_ABORT_FAILED);
    Py_RETURN_NONE;
}

static PyObject *seg_close(SegmentObject *self, PyObject *noargs) {
    (void)noargs;
    if (self->seg.base == NULL) Py_RETURN_NONE;
    if (self->busy) { /* another thread waits in a run: end it, and tell the peers */
        self->seg.closing = 1;
        rc_seg_abort(&self->seg, RC_ABORT_CLOSED);
        Py_RETURN_NONE;
    }
    if (self->exports == 0) rc_seg_unmap(&self->seg);
    Py_RETURN_NONE;
}

/* Parses (rank, parity) for a call on an open segment; 0 with an exception set if the
 * segment is closed or the rank is out of [0, nranks). */
static int seg_rank_parity(SegmentObject *self, PyObject *args, int *rank, int *parity) {
    if (!PyArg_ParseTuple(args, "ii", rank, parity)) return 0;
    if (!seg_open(self)) return 0;
    if (*rank < 0 || *rank >= self->seg.nranks) {
        PyErr_Format(PyExc_IndexError, "rank %d out of range [0, %d)", *rank, self->seg.nranks);
        return 0;
    }
    return 1;
}

static PyObject *seg_info(SegmentObject *self, PyObject *args) {
    int rank, parity;
    if (!seg_rank_parity(self, args, &rank, &parity)) return NULL;
    const rc_ctl *c = &self->seg.ctl[rank];
    const rc_step_info *info = &c->info[parity & 1];
    uint32_t fp_len = info->fp_len > RC_FP_BYTES ? RC_FP_BYTES : info->fp_len;
    return Py_BuildValue("{s:K,s:I,s:I,s:y#,s:i,s:I,s:I,s:I}", "call_seq",
                         (unsigned long long)info->call_seq, "flags", info->flags, "step",
                         info->step, "fp", (const char *)info->fp, (Py_ssize_t)fp_len, "pid",
                         (int)c->pid, "seq", __atomic_load_n(&c->seq, __ATOMIC_ACQUIRE), "abort",
                         __atomic_load_n(&c->abort, __ATOMIC_ACQUIRE), "mapped",
                         __atomic_load_n(&c->mapped, __ATOMIC_ACQUIRE));
}

static PyObject *seg_probe_cma(SegmentObject *self, PyObject *noargs) {
    (void)noargs;
    if (!seg_open(self)) return NULL;
    int ok;
    Py_BEGIN_ALLOW_THREADS ok = rc_seg_probe_cma(&self->seg);
    Py_END_ALLOW_THREADS
    return PyBool_FromLong(ok);
}

static PyObject *seg_half_offset(SegmentObject *self, PyObject *args) {
    int rank, parity;
    if (!seg_rank_parity(self, args, &rank, &parity)) return NULL;
    return PyLong_FromSize_t((size_t)(rc_seg_half(&self->seg, rank, parity) - self->seg.base));
}

static PyObject *seg_attached(SegmentObject *self, void *closure) {
    (void)closure;
    if (!seg_open(self)) return NULL;
    return PyLong_FromUnsignedLong(__atomic_load_n(&self->seg.hdr->attached, __ATOMIC_ACQUIRE));
}

static PyObject *seg_step(SegmentObject *self, void *closure) {
    (void)closure;
    return PyLong_FromUnsignedLong(self->seg.step);
}

static PyObject *seg_spin_fails(SegmentObject *self, void *closure) {
    (void)closure;
    return PyLong_FromUnsignedLongLong(self->seg.spin_fails);
}

static PyObject *seg_half(SegmentObject *self, void *closure) {
    (void)closure;
    return PyLong_FromUnsignedLongLong(self->seg.half);
}

static PyObject *seg_closed(SegmentObject *self, void *closure) {
    (void)closure;
    return PyBool_FromLong(self->seg.base == NULL);
}

static PyObject *py_unlink(PyObject *self, PyObject *args) {
    const char *name;
    (void)self;
    if (!PyArg_ParseTuple(args, "s", &name)) return NULL;
    int rc = rc_seg_unlink(name);
    return PyBool_FromLong(rc == 0);
}

static PyObject *py_total_bytes(PyObject *self, PyObject *args) {
    int nranks;
    unsigned long long half;
    (void)self;
    if (!PyArg_ParseTuple(args, "iK", &nranks, &half)) return NULL;
    return PyLong_FromSize_t(rc_seg_total_bytes(nranks, half));
}

/* The mapping, read-only, for Python to read what the peers wrote (a view keeps the
 * segment mapped). */
static int seg_getbuffer(SegmentObject *self, Py_buffer *view, int flags) {
    if (self->seg.base == NULL) {
        PyErr_SetString(PyExc_BufferError, "the segment is closed");
        return -1;
    }
    if (PyBuffer_FillInfo(view, (PyObject *)self, self->seg.base, (Py_ssize_t)self->seg.len, 1,
                          flags) < 0)
        return -1;
    self->exports++;
    return 0;
}

static void seg_releasebuffer(SegmentObject *self, Py_buffer *view) {
    (void)view;
    self->exports--;
}

static PyBufferProcs seg_as_buffer = {(getbufferproc)seg_getbuffer,
                                      (releasebufferproc)seg_releasebuffer};

static PyMethodDef seg_methods[] = {
    {"run", (PyCFunction)seg_run, METH_VARARGS,
     "run(plan, bufs, dtype, op, factor, divisor, call_seq, fp, wait, check) -> (status, "
     "peer, errno, broke, exc): run a plan's operations (GIL released; check(waited_s, "
     "pending) is called while it waits; exc: what it raised, status CHECK; broke: the run "
     "raised the abort flag itself)"},
    {"abort", (PyCFunction)seg_abort, METH_VARARGS,
     "abort(reason=1): tell the peers this rank gave up on the group"},
    {"close", (PyCFunction)seg_close, METH_NOARGS,
     "close(): unmap (or, while a call waits in another thread, end it)"},
    {"info", (PyCFunction)seg_info, METH_VARARGS,
     "info(rank, parity) -> dict: a rank's control block and step info"},
    {"probe_cma", (PyCFunction)seg_probe_cma, METH_NOARGS,
     "probe_cma() -> bool: whether this process can read every peer's memory "
     "(process_vm_readv; call once every rank mapped the segment)"},
    {"half_offset", (PyCFunction)seg_half_offset, METH_VARARGS,
     "half_offset(rank, parity) -> int: where that half starts in the mapping"},
    {NULL, NULL, 0, NULL}};

static PyGetSetDef seg_getset[] = {
    {"attached", (getter)seg_attached, NULL, "ranks that mapped the segment", NULL},
    {"step", (getter)seg_step, NULL, "the last step this rank published", NULL},
    {"half_bytes", (getter)seg_half, NULL, "bytes of each half of each slot", NULL},
    {"spin_fails", (getter)seg_spin_fails, NULL,
     "waits whose spin ran its whole length without the peer", NULL},
    {"closed", (getter)seg_closed, NULL, "whether it is unmapped", NULL},
    {NULL, NULL, NULL, NULL, NULL}};

static PyTypeObject SegmentType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "raycoll.native._core.Segment",
    .tp_basicsize = sizeof(SegmentObject),
    .tp_dealloc = (destructor)seg_dealloc,
    .tp_as_buffer = &seg_as_buffer,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Segment(name, nranks, rank, half_bytes, create): a node segment, mapped",
    .tp_methods = seg_methods,
    .tp_getset = seg_getset,
    .tp_init = (initproc)seg_init,
    .tp_new = PyType_GenericNew,
};

/* ---------------------------------------------------------------- cross-memory reads */
/* cma_read(pid, remote, bufs) -> (status, errno): remote[i] = (address, length) in process
 * pid, read into the writable buffer bufs[i], whose length must be that length exactly. */
static PyObject *py_cma_read(PyObject *self, PyObject *args) {
    int pid;
    PyObject *remote_obj, *bufs_obj;
    (void)self;
    if (!PyArg_ParseTuple(args, "iOO", &pid, &remote_obj, &bufs_obj)) return NULL;
    PyObject *remote = PySequence_Fast(remote_obj, "remote must be a sequence of (address, length)");
    if (remote == NULL) return NULL;
    PyObject *bufs = PySequence_Fast(bufs_obj, "bufs must be a sequence of buffers");
    if (bufs == NULL) {
        Py_DECREF(remote);
        return NULL;
    }
    Py_ssize_t n = PySequence_Fast_GET_SIZE(remote);
    PyObject *result = NULL;
    Py_buffer *views = NULL;
    rc_range *ranges = NULL;
    Py_ssize_t got = 0;
    if (n != PySequence_Fast_GET_SIZE(bufs) || n > (1 << 20)) {
        PyErr_Format(PyExc_ValueError, "cma_read: %zd ranges for %zd buffers (at most 1048576)",
                     n, PySequence_Fast_GET_SIZE(bufs));
        goto done;
    }
    views = PyMem_Calloc((size_t)n + 1, sizeof(Py_buffer));
    ranges = PyMem_Calloc(2 * (size_t)n + 1, sizeof(rc_range));
    if (views == NULL || ranges == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (; got < n; got++) {
        unsigned long long addr, len;
        PyObject *pair = PySequence_Fast_GET_ITEM(remote, got);
        if (!PyArg_ParseTuple(pair, "KK", &addr, &len)) goto done;
        if (take_buffer(PySequence_Fast_GET_ITEM(bufs, got), &views[got], 1) < 0) goto done;
        if ((unsigned long long)views[got].len != len || (len && addr == 0) ||
            addr > UINT64_MAX - len) { /* bounds: exactly the buffer, a range that exists */
            PyErr_Format(PyExc_ValueError,
                         "cma_read: range %zd is %llu bytes at address %llu, its buffer %zd bytes",
                         got, len, addr, views[got].len);
            PyBuffer_Release(&views[got]);
            goto done;
        }
        ranges[got].addr = (uint64_t)(uintptr_t)views[got].buf;
        ranges[got].len = (uint64_t)len;
        ranges[n + got].addr = (uint64_t)addr;
        ranges[n + got].len = (uint64_t)len;
    }
    int rc, err = 0;
    Py_BEGIN_ALLOW_THREADS rc = rc_cma_readv((int32_t)pid, ranges, ranges + n, (int)n, &err);
    Py_END_ALLOW_THREADS result = Py_BuildValue("(ii)", rc, err);
done:
    for (Py_ssize_t i = 0; i < got; i++) PyBuffer_Release(&views[i]);
    PyMem_Free(views);
    PyMem_Free(ranges);
    Py_DECREF(remote);
    Py_DECREF(bufs);
    return result;
}

static PyMethodDef module_methods[] = {
    {"execute", py_execute, METH_VARARGS,
     "execute(seg, plan, bufs, dtype, op, factor, divisor, call_seq, fp, wait, check, net"
     "[, rank_map]) "
     "-> (status, peer, errno, broke, exc): run a plan on a segment (or None) and sockets "
     "(net: (out_fds, in_fds, conns, fp_hash), or None; rank_map: int32 bytes, each local "
     "rank's group rank, how the check names pending ranks); GIL released. broke: the run failed "
     "in a way that breaks the group and raised the abort flag / shut the call's sockets "
     "itself; exc: the check's exception (status CHECK), else None"},
    {"set_soft_errors", py_set_soft_errors, METH_O,
     "set_soft_errors(classes): the exceptions of a check that leave a group usable"},
    {"reduce", py_reduce, METH_VARARGS,
     "reduce(dtype, op, dst, srcs): dst = srcs[0] op srcs[1] op ..., elementwise"},
    {"finalize", py_finalize, METH_VARARGS,
     "finalize(dtype, op, buf, divisor, factor): AVG's division / PREMUL_SUM's factor"},
    {"supported", py_supported, METH_VARARGS, "supported(dtype, op) -> bool"},
    {"dtype_size", py_dtype_size, METH_VARARGS, "dtype_size(dtype) -> bytes an element"},
    {"unlink", py_unlink, METH_VARARGS, "unlink(name) -> bool: shm_unlink"},
    {"cma_read", py_cma_read, METH_VARARGS,
     "cma_read(pid, remote, bufs) -> (status, errno): read remote[i] = (address, length) of "
     "process pid into bufs[i] (exactly that length), process_vm_readv; GIL released"},
    {"total_bytes", py_total_bytes, METH_VARARGS,
     "total_bytes(nranks, half_bytes) -> the size of such a segment"},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef core_module = {PyModuleDef_HEAD_INIT, "raycoll.native._core",
                                         "raycoll's native core (see raycoll/native/).", -1,
                                         module_methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__core(void) {
    if (PyType_Ready(&SegmentType) < 0) return NULL;
    PyObject *m = PyModule_Create(&core_module);
    if (m == NULL) return NULL;
    if (add_pipe_type(m) < 0 || add_sockpipe_type(m) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    SegmentError = PyErr_NewException("raycoll.native._core.SegmentError", PyExc_OSError, NULL);
    Py_INCREF(&SegmentType);
    if (SegmentError == NULL || PyModule_AddObject(m, "Segment", (PyObject *)&SegmentType) < 0 ||
        PyModule_AddObject(m, "SegmentError", SegmentError) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    struct {
        const char *name;
        long value;
    } consts[] = {
        {"OP_WRITE", RC_OP_WRITE}, {"OP_SYNC", RC_OP_SYNC}, {"OP_COPY", RC_OP_COPY},
        {"OP_REDUCE", RC_OP_REDUCE}, {"OP_LOCAL", RC_OP_LOCAL}, {"OP_FINAL", RC_OP_FINAL},
        {"BUF_NEXT", RC_BUF_NEXT}, {"FLAG_FINAL", RC_FLAG_FINAL}, {"STEP_FIRST", RC_STEP_FIRST},
        {"STEP_PUBLISH", RC_STEP_PUBLISH},
        {"OK", RC_OK}, {"MISMATCH", RC_MISMATCH}, {"ABORTED", RC_ABORTED}, {"DEAD", RC_DEAD},
        {"BADPLAN", RC_BADPLAN}, {"CLOSED", RC_CLOSED}, {"SEQ", RC_SEQ},
        {"ABORT_FAILED", RC_ABORT_FAILED}, {"ABORT_CLOSED", RC_ABORT_CLOSED},
        {"FP_BYTES", RC_FP_BYTES}, {"PAGE", RC_PAGE}, {"MAX_RANKS", RC_MAX_RANKS},
        {"OP_WORDS", RC_OP_WORDS}, {"OP_SEND", RC_OP_SEND}, {"OP_RECV", RC_OP_RECV},
        {"OP_XFER", RC_OP_XFER}, {"OP_RED2", RC_OP_RED2}, {"OP_MREDUCE", RC_OP_MREDUCE},
        {"OP_CREAD", RC_OP_CREAD}, {"OP_CREDUCE", RC_OP_CREDUCE}, {"CFLAG_FINAL", RC_CFLAG_FINAL},
        {"PEER_CLOSED", RC_PEER_CLOSED}, {"FOREIGN", RC_FOREIGN}, {"GARBLED", RC_GARBLED},
        {"IOERR", RC_IOERR}, {"CONN_BYTES", RC_CONN_BYTES}, {"MSG_MAGIC", (long)RC_MSG_MAGIC},
        {"END_MAGIC", (long)RC_END_MAGIC}, {"CHECK", RC_CHECK}, {"RETRY", RC_RETRY},
    };
#ifndef RAYCOLL_SANITIZE
#define RAYCOLL_SANITIZE ""
#endif
    /* the sanitizers this build runs under (setup.py's RAYCOLL_NATIVE_SANITIZE), "" none */
    if (PyModule_AddStringConstant(m, "SANITIZE", RAYCOLL_SANITIZE) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    for (size_t i = 0; i < sizeof consts / sizeof consts[0]; i++) {
        if (PyModule_AddIntConstant(m, consts[i].name, consts[i].value) < 0) {
            Py_DECREF(m);
            return NULL;
        }
    }
    return m;
}
