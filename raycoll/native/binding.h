/* What the binding's files share (module.c defines these; pipemodule.c uses them). */
#ifndef RAYCOLL_BINDING_H
#define RAYCOLL_BINDING_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "core.h"

/* The check callback's argument: the Python callable, and the thread state the GIL was
 * released with (call_check takes the GIL back while it calls). */
typedef struct {
    PyObject *fn;
    PyThreadState *ts;
} check_arg;

/* A buffer of a call, C-contiguous: 1 writable, 0 read-only (need_writable 0), -1 error. */
int take_buffer(PyObject *obj, Py_buffer *view, int need_writable);
/* core.h's rc_check_fn over a check_arg: calls fn(waited_s, pending) with the GIL. */
int call_check(void *arg, double waited_s, const int *pending, int npending);
/* call->wait from a (spin_ns, tick_ns, check_ns, check_max_ns) tuple: 1, or 0 with an
 * exception set. */
int parse_call(PyObject *wait, rc_call *call);
/* The check's exception (a new reference) after a run that ended RC_CHECK with it set, else
 * None; clears the error indicator. */
PyObject *check_exception(int rc);
/* Adds the Pipe type (pipemodule.c) to the module: 0, or -1 with an exception set. */
int add_pipe_type(PyObject *m);
/* Adds the SockPipe type (sockpipemodule.c): 0, or -1 with an exception set. */
int add_sockpipe_type(PyObject *m);

#endif
