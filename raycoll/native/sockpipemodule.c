/*
 * raycoll._core's SockPipe type: a socket pipe (sockpipe.h) for Python, with the Pipe type's
 * methods (pipemodule.c), so that raycoll/transport/pipes.py matches messages the same way on
 * both. It parses arguments, takes buffers and releases the GIL around sockpipe.c's calls;
 * nothing is decided here.
 */
#include "binding.h"
#include "sockpipe.h"

typedef struct {
    PyObject_HEAD
    rc_sock sock;
    int open;
    int sending;   /* a send is in progress (in some thread) */
    int receiving; /* a peek or take is in progress */
} SockPipeObject;

static int sp_init(SockPipeObject *self, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"out_fd", "in_fd", NULL};
    int out_fd, in_fd;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "ii", kwlist, &out_fd, &in_fd)) return -1;
    if (self->open) {
        PyErr_SetString(PyExc_RuntimeError, "SockPipe is already open");
        return -1;
    }
    int err = rc_sock_open(&self->sock, out_fd, in_fd);
    if (err != 0) {
        errno = err;
        PyErr_SetFromErrno(PyExc_OSError);
        return -1;
    }
    self->open = 1;
    return 0;
}

static void sp_dealloc(SockPipeObject *self) {
    if (self->open) rc_sock_close(&self->sock);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static int sp_usable(SockPipeObject *self, int busy) {
    if (!self->open) {
        PyErr_SetString(PyExc_ValueError, "the pipe is closed");
        return 0;
    }
    if (busy) {
        PyErr_SetString(PyExc_RuntimeError, "the pipe is busy with another call that way");
        return 0;
    }
    return 1;
}

static int sp_prepare(rc_call *call, check_arg *carg, PyObject *wait, PyObject *check) {
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

/* send(buf, tag, meta, may_wait, ack, cma, wait, check) -> (status, broke, exc); cma is
 * ignored (a peer on another node). */
static PyObject *sp_send(SockPipeObject *self, PyObject *args) {
    PyObject *data_obj, *wait, *check;
    long long tag;
    Py_buffer meta;
    int may_wait, ack, cma;
    if (!PyArg_ParseTuple(args, "OLy*pppOO", &data_obj, &tag, &meta, &may_wait, &ack, &cma,
                          &wait, &check))
        return NULL;
    (void)cma;
    PyObject *result = NULL;
    Py_buffer data;
    int have_data = 0;
    rc_call call;
    check_arg carg;
    if (!sp_usable(self, self->sending) || !sp_prepare(&call, &carg, wait, check)) goto done;
    if (meta.len > RC_PIPE_META_BYTES) {
        PyErr_Format(PyExc_ValueError, "meta: %zd bytes (at most %u)", meta.len,
                     RC_PIPE_META_BYTES);
        goto done;
    }
    if (take_buffer(data_obj, &data, 0) < 0) goto done;
    have_data = 1;
    self->sending = 1;
    int rc;
    if (!may_wait) { /* no wait: the GIL kept */
        rc = rc_sock_send(&self->sock, tag, (const uint8_t *)meta.buf, (uint32_t)meta.len,
                          (const uint8_t *)data.buf, (uint64_t)data.len, 0, ack, &call);
    } else {
        carg.ts = PyEval_SaveThread();
        rc = rc_sock_send(&self->sock, tag, (const uint8_t *)meta.buf, (uint32_t)meta.len,
                          (const uint8_t *)data.buf, (uint64_t)data.len, 1, ack, &call);
        PyEval_RestoreThread(carg.ts);
    }
    self->sending = 0;
    result = Py_BuildValue("(iiN)", rc, call.broke, check_exception(rc));
done:
    if (have_data) PyBuffer_Release(&data);
    PyBuffer_Release(&meta);
    return result;
}

static PyObject *sp_msg_result(int rc, const rc_pipe_msg *msg, int broke) {
    if (rc != RC_OK && rc != RC_PIPE_OTHER && rc != RC_MISMATCH)
        return Py_BuildValue("(iLKy#iN)", rc, 0LL, 0ULL, "", (Py_ssize_t)0, broke,
                             check_exception(rc));
    return Py_BuildValue("(iLKy#iN)", rc, (long long)msg->tag, (unsigned long long)msg->nbytes,
                         (const char *)msg->meta, (Py_ssize_t)msg->meta_len, broke,
                         check_exception(rc));
}

static PyObject *sp_peek(SockPipeObject *self, PyObject *args) {
    PyObject *wait, *check;
    int may_wait;
    if (!PyArg_ParseTuple(args, "pOO", &may_wait, &wait, &check)) return NULL;
    rc_call call;
    check_arg carg;
    if (!sp_usable(self, self->receiving) || !sp_prepare(&call, &carg, wait, check)) return NULL;
    rc_pipe_msg msg;
    int rc;
    if (!may_wait) {
        rc = rc_sock_peek(&self->sock, 0, &call, &msg);
        return sp_msg_result(rc, &msg, call.broke);
    }
    self->receiving = 1;
    carg.ts = PyEval_SaveThread();
    rc = rc_sock_peek(&self->sock, 1, &call, &msg);
    PyEval_RestoreThread(carg.ts);
    self->receiving = 0;
    return sp_msg_result(rc, &msg, call.broke);
}

static PyObject *sp_take(SockPipeObject *self, PyObject *args) {
    PyObject *dst_obj, *wait, *check;
    int reject;
    if (!PyArg_ParseTuple(args, "OpOO", &dst_obj, &reject, &wait, &check)) return NULL;
    rc_call call;
    check_arg carg;
    if (!sp_usable(self, self->receiving) || !sp_prepare(&call, &carg, wait, check)) return NULL;
    if (!self->sock.have_cur) {
        PyErr_SetString(PyExc_RuntimeError, "take: no message was peeked");
        return NULL;
    }
    Py_buffer dst;
    int have_dst = 0;
    if (dst_obj != Py_None) {
        if (take_buffer(dst_obj, &dst, 1) < 0) return NULL;
        have_dst = 1;
        if ((uint64_t)dst.len != self->sock.cur.nbytes) { /* bounds: exactly the message */
            PyErr_Format(PyExc_ValueError, "take: the buffer has %zd bytes, the message %llu",
                         dst.len, (unsigned long long)self->sock.cur.nbytes);
            PyBuffer_Release(&dst);
            return NULL;
        }
    }
    self->receiving = 1;
    carg.ts = PyEval_SaveThread();
    int rc = rc_sock_take(&self->sock, have_dst ? (uint8_t *)dst.buf : NULL,
                          have_dst ? (uint64_t)dst.len : 0, reject, &call);
    PyEval_RestoreThread(carg.ts);
    self->receiving = 0;
    if (have_dst) PyBuffer_Release(&dst);
    return Py_BuildValue("(iiN)", rc, call.broke, check_exception(rc));
}

/* recv(buf, tag, meta, wait, check): as Pipe.recv (pipemodule.c), one call for the common
 * case. */
static PyObject *sp_recv(SockPipeObject *self, PyObject *args) {
    PyObject *dst_obj, *wait, *check;
    long long tag;
    Py_buffer meta;
    if (!PyArg_ParseTuple(args, "OLy*OO", &dst_obj, &tag, &meta, &wait, &check)) return NULL;
    PyObject *result = NULL;
    Py_buffer dst;
    int have_dst = 0;
    rc_call call;
    check_arg carg;
    if (!sp_usable(self, self->receiving) || !sp_prepare(&call, &carg, wait, check)) goto done;
    if (take_buffer(dst_obj, &dst, 1) < 0) goto done;
    have_dst = 1;
    self->receiving = 1;
    carg.ts = PyEval_SaveThread();
    rc_pipe_msg msg;
    int rc = rc_sock_peek(&self->sock, 1, &call, &msg);
    if (rc == RC_OK && msg.tag != tag) {
        rc = RC_PIPE_OTHER;
    } else if (rc == RC_OK) {
        int same = msg.meta_len == (uint32_t)meta.len &&
                   memcmp(msg.meta, meta.buf, (size_t)meta.len) == 0 &&
                   msg.nbytes == (uint64_t)dst.len;
        rc = rc_sock_take(&self->sock, same ? (uint8_t *)dst.buf : NULL, (uint64_t)dst.len,
                          !same, &call);
        if (rc == RC_OK && !same) rc = RC_MISMATCH;
    }
    PyEval_RestoreThread(carg.ts);
    self->receiving = 0;
    result = sp_msg_result(rc, &msg, call.broke);
done:
    if (have_dst) PyBuffer_Release(&dst);
    PyBuffer_Release(&meta);
    return result;
}

static PyObject *sp_attach_in(SockPipeObject *self, PyObject *args) {
    int fd;
    if (!PyArg_ParseTuple(args, "i", &fd)) return NULL;
    if (!sp_usable(self, self->receiving)) return NULL;
    int err = rc_sock_attach_in(&self->sock, fd);
    if (err != 0) {
        errno = err;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    Py_RETURN_NONE;
}

static PyObject *sp_close(SockPipeObject *self, PyObject *noargs) {
    (void)noargs;
    if (!self->open) Py_RETURN_NONE;
    self->sock.closing = 1;
    if (self->sending || self->receiving) Py_RETURN_NONE; /* the waiting call ends; dealloc */
    rc_sock_close(&self->sock);
    self->open = 0;
    Py_RETURN_NONE;
}

static PyObject *sp_state(SockPipeObject *self, void *closure) {
    (void)closure;
    return Py_BuildValue("{s:i,s:i,s:i}", "attached", self->sock.in_fd >= 0 ? 2 : 1,
                         "out_broken", self->sock.out_broken, "in_broken", self->sock.in_broken);
}

static PyObject *sp_spin_fails(SockPipeObject *self, void *closure) {
    (void)closure;
    return PyLong_FromUnsignedLongLong(self->sock.spin_fails);
}

static PyObject *sp_closed(SockPipeObject *self, void *closure) {
    (void)closure;
    return PyBool_FromLong(!self->open || self->sock.closing);
}

static PyObject *sp_attached(SockPipeObject *self, void *closure) {
    (void)closure;
    return PyBool_FromLong(self->open && self->sock.in_fd >= 0);
}

static PyMethodDef sp_methods[] = {
    {"send", (PyCFunction)sp_send, METH_VARARGS,
     "send(buf, tag, meta, may_wait, ack, cma, wait, check) -> (status, broke, exc): as "
     "Pipe.send (cma ignored); GIL released where it may wait"},
    {"peek", (PyCFunction)sp_peek, METH_VARARGS,
     "peek(may_wait, wait, check) -> (status, tag, nbytes, meta, broke, exc): as Pipe.peek"},
    {"take", (PyCFunction)sp_take, METH_VARARGS,
     "take(buf or None, reject, wait, check) -> (status, broke, exc): as Pipe.take"},
    {"recv", (PyCFunction)sp_recv, METH_VARARGS,
     "recv(buf, tag, meta, wait, check) -> (status, tag, nbytes, meta, broke, exc): as "
     "Pipe.recv"},
    {"attach_in", (PyCFunction)sp_attach_in, METH_VARARGS,
     "attach_in(fd): the peer's connection (a dup is kept), once it came"},
    {"close", (PyCFunction)sp_close, METH_NOARGS,
     "close(): end the pipe's waits and close its descriptors (the connections stay open)"},
    {NULL, NULL, 0, NULL}};

static PyGetSetDef sp_getset[] = {
    {"state", (getter)sp_state, NULL, "the pipe's flags, as a dict", NULL},
    {"closed", (getter)sp_closed, NULL, "whether it is closed", NULL},
    {"attached", (getter)sp_attached, NULL, "whether the peer's connection is attached", NULL},
    {"spin_fails", (getter)sp_spin_fails, NULL,
     "waits whose spin ran its whole length without the peer", NULL},
    {NULL, NULL, NULL, NULL, NULL}};

static PyTypeObject SockPipeType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "raycoll.native._core.SockPipe",
    .tp_basicsize = sizeof(SockPipeObject),
    .tp_dealloc = (destructor)sp_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "SockPipe(out_fd, in_fd): a socket pipe over dups of two connections "
              "(sockpipe.h); in_fd -1 until the peer's comes",
    .tp_methods = sp_methods,
    .tp_getset = sp_getset,
    .tp_init = (initproc)sp_init,
    .tp_new = PyType_GenericNew,
};

int add_sockpipe_type(PyObject *m) {
    if (PyType_Ready(&SockPipeType) < 0) return -1;
    Py_INCREF(&SockPipeType);
    if (PyModule_AddObject(m, "SockPipe", (PyObject *)&SockPipeType) < 0) {
        Py_DECREF(&SockPipeType);
        return -1;
    }
    return 0;
}
