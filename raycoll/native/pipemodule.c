/*
 * raycoll._core's Pipe type: a pair pipe (pipe.h) for Python, which matches messages to
 * receives (raycoll/transport/pipes.py). It parses arguments, takes buffers and releases the
 * GIL around pipe.c's calls; nothing is decided here.
 */
#include "binding.h"
#include "pipe.h"
#include "segment.h"

typedef struct {
    PyObject_HEAD
    rc_pipe pipe;
    int sending;   /* a send is in progress (in some thread) */
    int receiving; /* a peek or take is in progress */
} PipeObject;

static int pipe_init(PipeObject *self, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"name", "side", "ring_bytes", "wait_s", NULL};
    const char *name;
    int side;
    unsigned long long ring;
    double wait_s;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "siKd", kwlist, &name, &side, &ring, &wait_s))
        return -1;
    if (self->pipe.base != NULL) {
        PyErr_SetString(PyExc_RuntimeError, "Pipe is already open");
        return -1;
    }
    char err[256] = "";
    int rc;
    uint64_t wait_ns = wait_s > 0 ? (uint64_t)(wait_s * 1e9) : 0;
    Py_BEGIN_ALLOW_THREADS rc = rc_pipe_open(&self->pipe, name, side, ring, wait_ns, err, sizeof err);
    Py_END_ALLOW_THREADS
    if (rc != 0) {
        PyObject *exc = Py_BuildValue("(is)", rc, err);
        if (exc != NULL) {
            PyErr_SetObject(PyExc_OSError, exc);
            Py_DECREF(exc);
        }
        return -1;
    }
    return 0;
}

static void pipe_dealloc(PipeObject *self) {
    rc_pipe_unmap(&self->pipe);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* Whether the pipe is open and free for this direction (an exception set if not). */
static int pipe_usable(PipeObject *self, int busy) {
    if (self->pipe.base == NULL) {
        PyErr_SetString(PyExc_ValueError, "the pipe is closed");
        return 0;
    }
    if (busy) {
        PyErr_SetString(PyExc_RuntimeError, "the pipe is busy with another call that way");
        return 0;
    }
    return 1;
}

/* Set up a call's waiting policy and check: 1, or 0 with an exception set. */
static int prepare(rc_call *call, check_arg *carg, PyObject *wait, PyObject *check) {
    memset(call, 0, sizeof *call);
    if (!parse_call(wait, call)) return 0;
    carg->fn = check;
    carg->ts = NULL;
    if (check != Py_None) {
        call->check = call_check;
        call->check_arg = carg;
    }
    return 1;
}

static PyObject *pipe_send(PipeObject *self, PyObject *args) {
    PyObject *data_obj, *wait, *check;
    long long tag;
    Py_buffer meta;
    int may_wait, ack, cma;
    if (!PyArg_ParseTuple(args, "OLy*pppOO", &data_obj, &tag, &meta, &may_wait, &ack, &cma,
                          &wait, &check))
        return NULL;
    PyObject *result = NULL;
    Py_buffer data;
    int have_data = 0;
    rc_call call;
    check_arg carg;
    if (!pipe_usable(self, self->sending) || !prepare(&call, &carg, wait, check)) goto done;
    if (meta.len > RC_PIPE_META_BYTES) {
        PyErr_Format(PyExc_ValueError, "meta: %zd bytes (at most %u)", meta.len,
                     RC_PIPE_META_BYTES);
        goto done;
    }
    if (take_buffer(data_obj, &data, 0) < 0) goto done;
    have_data = 1;
    self->sending = 1;
    carg.ts = PyEval_SaveThread();
    int rc = rc_pipe_send(&self->pipe, tag, (const uint8_t *)meta.buf, (uint32_t)meta.len,
                          (const uint8_t *)data.buf, (uint64_t)data.len, may_wait, ack, cma, &call);
    PyEval_RestoreThread(carg.ts);
    self->sending = 0;
    result = Py_BuildValue("(iiN)", rc, call.broke, check_exception(rc));
done:
    if (have_data) PyBuffer_Release(&data);
    PyBuffer_Release(&meta);
    return result;
}

/* (status, tag, nbytes, meta) of a peek or recv. */
static PyObject *msg_result(int rc, const rc_pipe_msg *msg, int broke) {
    if (rc != RC_OK && rc != RC_PIPE_OTHER && rc != RC_MISMATCH)
        return Py_BuildValue("(iLKy#iN)", rc, 0LL, 0ULL, "", (Py_ssize_t)0, broke,
                             check_exception(rc));
    return Py_BuildValue("(iLKy#iN)", rc, (long long)msg->tag, (unsigned long long)msg->nbytes,
                         (const char *)msg->meta, (Py_ssize_t)msg->meta_len, broke,
                         check_exception(rc));
}

static PyObject *pipe_peek(PipeObject *self, PyObject *args) {
    PyObject *wait, *check;
    int may_wait;
    if (!PyArg_ParseTuple(args, "pOO", &may_wait, &wait, &check)) return NULL;
    rc_call call;
    check_arg carg;
    if (!pipe_usable(self, self->receiving) || !prepare(&call, &carg, wait, check)) return NULL;
    rc_pipe_msg msg;
    int rc;
    if (!may_wait) { /* a poll: no wait, the GIL kept */
        rc = rc_pipe_peek(&self->pipe, 0, &call, &msg);
        return msg_result(rc, &msg, call.broke);
    }
    self->receiving = 1;
    carg.ts = PyEval_SaveThread();
    rc = rc_pipe_peek(&self->pipe, 1, &call, &msg);
    PyEval_RestoreThread(carg.ts);
    self->receiving = 0;
    return msg_result(rc, &msg, call.broke);
}

/* take(buf or None, reject, wait, check) -> (status, broke, exc) */
static PyObject *pipe_take(PipeObject *self, PyObject *args) {
    PyObject *dst_obj, *wait, *check;
    int reject;
    if (!PyArg_ParseTuple(args, "OpOO", &dst_obj, &reject, &wait, &check)) return NULL;
    rc_call call;
    check_arg carg;
    if (!pipe_usable(self, self->receiving) || !prepare(&call, &carg, wait, check)) return NULL;
    if (!self->pipe.have_cur) {
        PyErr_SetString(PyExc_RuntimeError, "take: no message was peeked");
        return NULL;
    }
    Py_buffer dst;
    int have_dst = 0;
    if (dst_obj != Py_None) {
        if (take_buffer(dst_obj, &dst, 1) < 0) return NULL;
        have_dst = 1;
        if ((uint64_t)dst.len != self->pipe.cur.nbytes) { /* bounds: exactly the message */
            PyErr_Format(PyExc_ValueError, "take: the buffer has %zd bytes, the message %llu",
                         dst.len, (unsigned long long)self->pipe.cur.nbytes);
            PyBuffer_Release(&dst);
            return NULL;
        }
    }
    self->receiving = 1;
    carg.ts = PyEval_SaveThread();
    int rc = rc_pipe_take(&self->pipe, have_dst ? (uint8_t *)dst.buf : NULL,
                          have_dst ? (uint64_t)dst.len : 0, reject, &call);
    PyEval_RestoreThread(carg.ts);
    self->receiving = 0;
    if (have_dst) PyBuffer_Release(&dst);
    return Py_BuildValue("(iiN)", rc, call.broke, check_exception(rc));
}

/* recv(buf, tag, meta, wait, check) -> (status, tag, nbytes, meta, broke, exc): the next
 * message into buf when its tag is tag (RC_MISMATCH, the message skipped and its sender told,
 * when its meta or length differ from this receive's); RC_PIPE_OTHER (left in the pipe) when
 * its tag differs. One call for the common case: no Python between the wait and the copy. */
static PyObject *pipe_recv(PipeObject *self, PyObject *args) {
    PyObject *dst_obj, *wait, *check;
    long long tag;
    Py_buffer meta;
    if (!PyArg_ParseTuple(args, "OLy*OO", &dst_obj, &tag, &meta, &wait, &check)) return NULL;
    PyObject *result = NULL;
    Py_buffer dst;
    int have_dst = 0;
    rc_call call;
    check_arg carg;
    if (!pipe_usable(self, self->receiving) || !prepare(&call, &carg, wait, check)) goto done;
    if (take_buffer(dst_obj, &dst, 1) < 0) goto done;
    have_dst = 1;
    self->receiving = 1;
    carg.ts = PyEval_SaveThread();
    rc_pipe_msg msg;
    int rc = rc_pipe_peek(&self->pipe, 1, &call, &msg);
    if (rc == RC_OK && msg.tag != tag) {
        rc = RC_PIPE_OTHER;
    } else if (rc == RC_OK) {
        int same = msg.meta_len == (uint32_t)meta.len &&
                   memcmp(msg.meta, meta.buf, (size_t)meta.len) == 0 &&
                   msg.nbytes == (uint64_t)dst.len;
        rc = rc_pipe_take(&self->pipe, same ? (uint8_t *)dst.buf : NULL, (uint64_t)dst.len,
                          !same, &call);
        if (rc == RC_OK && !same) rc = RC_MISMATCH;
    }
    PyEval_RestoreThread(carg.ts);
    self->receiving = 0;
    result = msg_result(rc, &msg, call.broke);
done:
    if (have_dst) PyBuffer_Release(&dst);
    PyBuffer_Release(&meta);
    return result;
}

static PyObject *pipe_abort(PipeObject *self, PyObject *args) {
    unsigned int reason = RC_ABORT_FAILED;
    if (!PyArg_ParseTuple(args, "|I", &reason)) return NULL;
    if (!pipe_usable(self, 0)) return NULL;
    rc_pipe_abort(&self->pipe, reason ? reason : RC_ABORT_FAILED);
    Py_RETURN_NONE;
}

static PyObject *pipe_close(PipeObject *self, PyObject *noargs) {
    (void)noargs;
    if (self->pipe.base == NULL) Py_RETURN_NONE;
    rc_pipe_abort(&self->pipe, RC_ABORT_CLOSED); /* the peer's waits end */
    if (self->sending || self->receiving) { /* a call waits in another thread: end it */
        self->pipe.closing = 1;
        Py_RETURN_NONE;
    }
    rc_pipe_unmap(&self->pipe);
    Py_RETURN_NONE;
}

static PyObject *pipe_state(PipeObject *self, void *closure) {
    (void)closure;
    if (!pipe_usable(self, 0)) return NULL;
    const rc_pipe *p = &self->pipe;
    const rc_pipe_side *peer = &p->sides[1 - p->me];
    return Py_BuildValue("{s:I,s:i,s:I,s:I,s:i,s:K}", "attached",
                         __atomic_load_n(&p->hdr->attached, __ATOMIC_ACQUIRE), "peer_pid",
                         (int)__atomic_load_n(&peer->pid, __ATOMIC_ACQUIRE), "peer_abort",
                         __atomic_load_n(&peer->abort, __ATOMIC_ACQUIRE), "abort",
                         __atomic_load_n(&p->sides[p->me].abort, __ATOMIC_ACQUIRE), "created",
                         p->created, "ring_bytes", (unsigned long long)p->ring);
}

static PyObject *pipe_spin_fails(PipeObject *self, void *closure) {
    (void)closure;
    return PyLong_FromUnsignedLongLong(self->pipe.spin_fails);
}

static PyObject *pipe_closed(PipeObject *self, void *closure) {
    (void)closure;
    return PyBool_FromLong(self->pipe.base == NULL);
}

static PyMethodDef pipe_methods[] = {
    {"send", (PyCFunction)pipe_send, METH_VARARGS,
     "send(buf, tag, meta, may_wait, ack, cma, wait, check) -> (status, broke, exc): one "
     "message (may_wait false: AGAIN unless it goes whole now; ack: wait until the receiver "
     "took it, MISMATCH if it rejected it; cma, with ack: offer it across memory); GIL "
     "released"},
    {"peek", (PyCFunction)pipe_peek, METH_VARARGS,
     "peek(may_wait, wait, check) -> (status, tag, nbytes, meta, broke, exc): the next "
     "message's header, kept as the current one (AGAIN: none, without waiting)"},
    {"take", (PyCFunction)pipe_take, METH_VARARGS,
     "take(buf or None, reject, wait, check) -> (status, broke, exc): the current message "
     "into buf (exactly its bytes), or skipped (reject: its sender is told)"},
    {"recv", (PyCFunction)pipe_recv, METH_VARARGS,
     "recv(buf, tag, meta, wait, check) -> (status, tag, nbytes, meta, broke, exc): the next "
     "message into buf if its tag is tag (MISMATCH: skipped, its meta or size differ), else "
     "OTHER (left in the pipe)"},
    {"abort", (PyCFunction)pipe_abort, METH_VARARGS,
     "abort(reason=1): this side gives up on the pipe (the peer's waits end)"},
    {"close", (PyCFunction)pipe_close, METH_NOARGS,
     "close(): give up on the pipe and unmap it (or, while a call waits, end it)"},
    {NULL, NULL, 0, NULL}};

static PyGetSetDef pipe_getset[] = {
    {"state", (getter)pipe_state, NULL, "the sides' words, as a dict", NULL},
    {"closed", (getter)pipe_closed, NULL, "whether it is unmapped", NULL},
    {"spin_fails", (getter)pipe_spin_fails, NULL,
     "waits whose spin ran its whole length without the peer", NULL},
    {NULL, NULL, NULL, NULL, NULL}};

static PyTypeObject PipeType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "raycoll.native._core.Pipe",
    .tp_basicsize = sizeof(PipeObject),
    .tp_dealloc = (destructor)pipe_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Pipe(name, side, ring_bytes, wait_s): a pair pipe, made or mapped (pipe.h)",
    .tp_methods = pipe_methods,
    .tp_getset = pipe_getset,
    .tp_init = (initproc)pipe_init,
    .tp_new = PyType_GenericNew,
};

int add_pipe_type(PyObject *m) {
    if (PyType_Ready(&PipeType) < 0) return -1;
    Py_INCREF(&PipeType);
    if (PyModule_AddObject(m, "Pipe", (PyObject *)&PipeType) < 0) {
        Py_DECREF(&PipeType);
        return -1;
    }
    if (PyModule_AddIntConstant(m, "PIPE_AGAIN", RC_PIPE_AGAIN) < 0 ||
        PyModule_AddIntConstant(m, "PIPE_OTHER", RC_PIPE_OTHER) < 0 ||
        PyModule_AddIntConstant(m, "PIPE_META_BYTES", RC_PIPE_META_BYTES) < 0)
        return -1;
    return 0;
}
