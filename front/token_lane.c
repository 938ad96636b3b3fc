/* The front's per-token path in C: one read of the engine's HTTP stream, its plain token events taken
 * into the request's answer and written as the client's SSE events (front/token_lane.py says when and
 * why; docs/benchmarks.md measures it).
 *
 * `Lane(answer, text, end, live)` holds the Python objects the Python path updates for each token
 * (front/engine_direct.py _TakeText.take and the SSE body's _SseText.write in front/app.py), and
 * `lane.feed(data, pos)` does, for each whole chunk of `data` from `pos` that is one plain event, exactly
 * what that path does for it:
 *   - the chunk: `<hex size>\r\n` `data:<json>\n\n` `\r\n` (Triton's one event per chunk);
 *   - the event (orjson's parse, as the Python path's): a dict without `error`, with `output_ids` (a list
 *     of ints or one int), `sequence_length` absent, an int or a list starting with one, `sequence_index`
 *     absent or 0 (an int or a list starting with one), and none of the arrays beside the ids
 *     (output_log_probs, generation_logits, context_logits); at least one id after the length's cut;
 *   - the take: the answer's count of sequence 0, its detokenizer (table lookup, a UTF-8 character cut
 *     across tokens held back), its last time and kept text, the stream's last output and time, the
 *     choice's stop strings (the Python matcher, called, when the choice has any), its text parts and
 *     characters sent, and the SSE event `head + json string + tail` added to the client's body.
 * It returns the position of the first chunk it did not take (anything else: a partial chunk, the body's
 * end, an error, log probs...), where the Python path goes on: what it does not know, it leaves whole.
 * Every state it changes lives in those Python objects, written back before it returns.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <string.h>

static PyObject *orjson_loads;           /* orjson.loads: the parse the Python path uses */
static PyObject *encode_ascii;           /* json.encoder.encode_basestring_ascii: the SSE text's string */
static PyObject *monotonic;              /* time.monotonic */
static PyObject *s_answer_last_at, *s_last, *s_last_had_output, *s_produced, *s_pending, *s_sent, *s_events,
    *s_stops, *s_text, *key_error, *key_ids, *key_length, *key_index, *beside[3], *zero;

typedef struct {
    PyObject_HEAD
    PyObject *answer, *end, *live, *sink;  /* _Answer, _EmptyEnd, _Live, the text sink (_SseText) */
    PyObject *by_sequence;                 /* answer.counts.by_sequence */
    PyObject *detok;                       /* answer.detok (IncrementalDetokenizer: its `pending`) */
    PyObject *table;                       /* the token byte table (a list of bytes) */
    PyObject *kept;                        /* answer.kept: a list, or None */
    PyObject *choices, *state, *stop, *parts; /* the choice, its stop matcher and text parts */
    PyObject *head, *tail;                 /* the SSE event's bytes around the JSON string */
    PyObject *add;                         /* the client body's add(bytes) */
    int no_stops;                          /* the choice has no stop strings (its matcher's list, set once) */
} Lane;

static int
lane_traverse(Lane *self, visitproc visit, void *arg)
{
    Py_VISIT(self->answer); Py_VISIT(self->end); Py_VISIT(self->live); Py_VISIT(self->sink);
    Py_VISIT(self->by_sequence); Py_VISIT(self->detok); Py_VISIT(self->table); Py_VISIT(self->kept);
    Py_VISIT(self->choices); Py_VISIT(self->state); Py_VISIT(self->stop); Py_VISIT(self->parts);
    Py_VISIT(self->head); Py_VISIT(self->tail); Py_VISIT(self->add);
    return 0;
}

static int
lane_clear(Lane *self)
{
    Py_CLEAR(self->answer); Py_CLEAR(self->end); Py_CLEAR(self->live); Py_CLEAR(self->sink);
    Py_CLEAR(self->by_sequence); Py_CLEAR(self->detok); Py_CLEAR(self->table); Py_CLEAR(self->kept);
    Py_CLEAR(self->choices); Py_CLEAR(self->state); Py_CLEAR(self->stop); Py_CLEAR(self->parts);
    Py_CLEAR(self->head); Py_CLEAR(self->tail); Py_CLEAR(self->add);
    return 0;
}

static void
lane_dealloc(Lane *self)
{
    PyObject_GC_UnTrack(self);
    lane_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* getattr(obj, a.b.c...) with a new reference, NULL (an error set) if any is missing */
static PyObject *
attr_path(PyObject *obj, const char *path)
{
    char name[64];
    Py_INCREF(obj);
    while (*path) {
        const char *dot = strchr(path, '.');
        size_t len = dot ? (size_t)(dot - path) : strlen(path);
        if (len >= sizeof name) {
            PyErr_SetString(PyExc_ValueError, "attribute name too long");
            Py_DECREF(obj);
            return NULL;
        }
        memcpy(name, path, len);
        name[len] = 0;
        PyObject *next = PyObject_GetAttrString(obj, name);
        Py_DECREF(obj);
        if (next == NULL)
            return NULL;
        obj = next;
        path += len + (dot ? 1 : 0);
    }
    return obj;
}

static int
lane_init(Lane *self, PyObject *args, PyObject *kwds)
{
    PyObject *answer, *sink, *end, *live;
    static char *kwlist[] = {"answer", "text", "end", "live", NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OOOO:Lane", kwlist, &answer, &sink, &end, &live))
        return -1;
    lane_clear(self);
    Py_INCREF(answer); self->answer = answer;
    Py_INCREF(sink); self->sink = sink;
    Py_INCREF(end); self->end = end;
    Py_INCREF(live); self->live = live;
    if (!(self->by_sequence = attr_path(answer, "counts.by_sequence")) || !(self->detok = attr_path(answer, "detok"))
        || !(self->table = attr_path(answer, "detok.detok.table")) || !(self->kept = attr_path(answer, "kept"))
        || !(self->choices = attr_path(sink, "choices")) || !(self->state = attr_path(sink, "state"))
        || !(self->stop = attr_path(sink, "state.stop")) || !(self->parts = attr_path(sink, "state.parts"))
        || !(self->head = attr_path(sink, "head")) || !(self->tail = attr_path(sink, "tail"))
        || !(self->add = attr_path(sink, "body.add")))
        return -1;
    if (!PyDict_CheckExact(self->by_sequence) || !PyList_CheckExact(self->table) || !PyList_CheckExact(self->parts)
        || !PyBytes_CheckExact(self->head) || !PyBytes_CheckExact(self->tail)
        || (self->kept != Py_None && !PyList_CheckExact(self->kept))) {
        PyErr_SetString(PyExc_TypeError, "Lane: the answer's or the text sink's objects are not the expected types");
        return -1;
    }
    PyObject *stops = PyObject_GetAttr(self->stop, s_stops);
    if (stops == NULL)
        return -1;
    self->no_stops = PyList_CheckExact(stops) && PyList_GET_SIZE(stops) == 0;
    Py_DECREF(stops);
    return 0;
}

/* text/detokenize.py incomplete_tail: trailing bytes that start a UTF-8 character not complete yet */
static Py_ssize_t
incomplete_tail(const unsigned char *data, Py_ssize_t n)
{
    for (Py_ssize_t back = 1; back <= (n < 4 ? n : 4); back++) {
        unsigned char b = data[n - back];
        if ((b & 0xC0) == 0x80)
            continue;
        Py_ssize_t need = (b & 0xE0) == 0xC0 ? 2 : (b & 0xF0) == 0xE0 ? 3 : (b & 0xF8) == 0xF0 ? 4 : 1;
        return need > back ? back : 0;
    }
    return 0;
}

/* An optional scalar output as Triton's HTTP sends it (a single value, or a list starting with it): its
 * value if it is an int, -1 if absent, -2 otherwise (not plain). */
static long long
scalar_output(PyObject *event, PyObject *key)
{
    PyObject *v = PyDict_GetItemWithError(event, key);
    if (v == NULL)
        return PyErr_Occurred() ? -2 : -1;
    if (v == Py_None)
        return -1;
    if (PyList_CheckExact(v) && PyList_GET_SIZE(v) > 0)
        v = PyList_GET_ITEM(v, 0);
    if (!PyLong_CheckExact(v))
        return -2;
    int overflow;
    long long r = PyLong_AsLongLongAndOverflow(v, &overflow);
    if (overflow || (r == -1 && PyErr_Occurred())) {
        PyErr_Clear();
        return -2;
    }
    return r < 0 ? -2 : r;
}

/* The event of one whole chunk at data[pos:], parsed: a new reference to the dict, with *next the
 * position after the chunk; NULL without an error set when the chunk is not a whole plain one. */
static PyObject *
plain_event(const char *data, Py_ssize_t n, Py_ssize_t pos, Py_ssize_t *next)
{
    Py_ssize_t size = 0, i = pos;
    while (i < n && i - pos < 8) {
        char c = data[i];
        int digit = c >= '0' && c <= '9' ? c - '0' : c >= 'a' && c <= 'f' ? c - 'a' + 10
                  : c >= 'A' && c <= 'F' ? c - 'A' + 10 : -1;
        if (digit < 0)
            break;
        size = size * 16 + digit;
        i++;
    }
    if (i == pos || i + 1 >= n || data[i] != '\r' || data[i + 1] != '\n' || size < 8)
        return NULL;  /* no size, a partial or extended size line, the body's end, or too small for `data:{}\n\n` */
    const char *chunk = data + i + 2;
    Py_ssize_t end = i + 2 + size;
    if (end + 2 > n || data[end] != '\r' || data[end + 1] != '\n')
        return NULL;
    if (memcmp(chunk, "data:", 5) != 0 || chunk[size - 1] != '\n' || chunk[size - 2] != '\n'
        || memchr(chunk, '\n', size - 2) != NULL)
        return NULL;
    PyObject *json = PyBytes_FromStringAndSize(chunk + 5, size - 7);
    if (json == NULL)
        return NULL;
    PyObject *event = PyObject_CallOneArg(orjson_loads, json);
    Py_DECREF(json);
    if (event == NULL) {
        PyErr_Clear();  /* not JSON: the Python path says so */
        return NULL;
    }
    if (!PyDict_CheckExact(event) || PyDict_Contains(event, key_error)) {
        Py_DECREF(event);
        return NULL;
    }
    for (int k = 0; k < 3; k++) {
        if (PyDict_Contains(event, beside[k])) {
            Py_DECREF(event);
            return NULL;
        }
    }
    long long index = scalar_output(event, key_index);
    if (index != -1 && index != 0) {  /* another choice's (n > 1), or not an int: the Python path's */
        Py_DECREF(event);
        return NULL;
    }
    *next = end + 2;
    return event;
}

/* The event's ids as a C array of the table's bytes objects (borrowed), *count of them; 0 taken, -1 not a
 * plain step (ids missing, not ints, a length that is not an int, none left after the cut). */
static int
event_tokens(Lane *self, PyObject *event, PyObject **tokens, Py_ssize_t cap, Py_ssize_t *count)
{
    PyObject *ids = PyDict_GetItemWithError(event, key_ids);
    if (ids == NULL || ids == Py_None)
        return -1;
    PyObject *one[1] = {ids};
    PyObject **items = one;
    Py_ssize_t len = 1;
    if (PyList_CheckExact(ids)) {
        items = PySequence_Fast_ITEMS(ids);
        len = PyList_GET_SIZE(ids);
    }
    long long length = scalar_output(event, key_length);
    if (length == -2)
        return -1;
    Py_ssize_t n = length == -1 || length > len ? len : (Py_ssize_t)length;
    if (n == 0 || n > cap)
        return -1;
    Py_ssize_t size = PyList_GET_SIZE(self->table);
    for (Py_ssize_t k = 0; k < n; k++) {
        if (!PyLong_CheckExact(items[k]))
            return -1;
        int overflow;
        long long id = PyLong_AsLongLongAndOverflow(items[k], &overflow);
        tokens[k] = (!overflow && id >= 0 && id < size) ? PyList_GET_ITEM(self->table, id) : NULL;
        if (tokens[k] != NULL && !PyBytes_CheckExact(tokens[k]))
            return -1;
    }
    *count = n;
    return 0;
}

/* What the lane changed, written back to the Python objects (their only home) */
typedef struct {
    PyObject *pending;   /* the detokenizer's held bytes (a new reference) */
    long long count;     /* sequence 0's tokens */
    long long sent;      /* the choice's characters sent */
    long long events;    /* SSE events written */
    PyObject *now;       /* this read's time (a new reference) */
} Taken;

static int
set_int(PyObject *obj, PyObject *name, long long value)
{
    PyObject *v = PyLong_FromLongLong(value);
    if (v == NULL)
        return -1;
    int rc = PyObject_SetAttr(obj, name, v);
    Py_DECREF(v);
    return rc;
}

static int
write_back(Lane *self, Taken *t)
{
    int rc = 0;
    PyObject *count = PyLong_FromLongLong(t->count);
    if (count == NULL || PyDict_SetItem(self->by_sequence, zero, count) < 0)
        rc = -1;
    Py_XDECREF(count);
    if (PyObject_SetAttr(self->detok, s_pending, t->pending) < 0
        || PyObject_SetAttr(self->answer, s_answer_last_at, t->now) < 0
        || PyObject_SetAttr(self->live, s_last, t->now) < 0
        || PyObject_SetAttr(self->end, s_last_had_output, Py_True) < 0
        || PyObject_SetAttr(self->end, s_produced, Py_True) < 0
        || set_int(self->state, s_sent, t->sent) < 0 || set_int(self->sink, s_events, t->events) < 0)
        rc = -1;
    return rc;
}

static long long
int_attr(PyObject *obj, PyObject *name, int *ok)
{
    PyObject *v = PyObject_GetAttr(obj, name);
    long long r = v ? PyLong_AsLongLong(v) : -1;
    Py_XDECREF(v);
    if (r == -1 && PyErr_Occurred())
        *ok = 0;
    return r;
}

/* A step's text into the choice and the client's body (_SseText.write) */
static int
write_text(Lane *self, PyObject *text, Taken *t)
{
    PyObject *out;
    if (self->no_stops) {  /* no stop strings: Choices.text passes the text through (nothing can stop it) */
        if (PyList_Append(self->parts, text) < 0)
            return -1;
        Py_INCREF(text);
        out = text;
    } else {  /* the choice's stop matcher, in Python (Choices.text appends to the parts itself) */
        out = PyObject_CallMethodObjArgs(self->choices, s_text, self->state, text, NULL);
        if (out == NULL)
            return -1;
        if (!PyUnicode_Check(out)) {
            Py_DECREF(out);
            PyErr_SetString(PyExc_TypeError, "Choices.text did not return a str");
            return -1;
        }
    }
    Py_ssize_t chars = PyUnicode_GET_LENGTH(out);
    t->sent += chars;
    if (chars == 0) {
        Py_DECREF(out);
        return 0;
    }
    PyObject *escaped = PyObject_CallOneArg(encode_ascii, out);
    Py_DECREF(out);
    if (escaped == NULL)
        return -1;
    if (!PyUnicode_Check(escaped) || !PyUnicode_IS_ASCII(escaped)) {
        Py_DECREF(escaped);
        PyErr_SetString(PyExc_TypeError, "encode_basestring_ascii did not return ASCII");
        return -1;
    }
    Py_ssize_t h = PyBytes_GET_SIZE(self->head), e = PyUnicode_GET_LENGTH(escaped), tl = PyBytes_GET_SIZE(self->tail);
    PyObject *event = PyBytes_FromStringAndSize(NULL, h + e + tl);
    if (event == NULL) {
        Py_DECREF(escaped);
        return -1;
    }
    char *buf = PyBytes_AS_STRING(event);
    memcpy(buf, PyBytes_AS_STRING(self->head), h);
    memcpy(buf + h, PyUnicode_DATA(escaped), e);
    memcpy(buf + h + e, PyBytes_AS_STRING(self->tail), tl);
    Py_DECREF(escaped);
    PyObject *r = PyObject_CallOneArg(self->add, event);
    Py_DECREF(event);
    if (r == NULL)
        return -1;
    Py_DECREF(r);
    t->events++;
    return 0;
}

/* One step's token bytes through the detokenizer (IncrementalDetokenizer.push): its new text */
static PyObject *
detokenize(PyObject **tokens, Py_ssize_t n, Taken *t)
{
    Py_ssize_t total = PyBytes_GET_SIZE(t->pending);
    for (Py_ssize_t k = 0; k < n; k++)
        total += tokens[k] ? PyBytes_GET_SIZE(tokens[k]) : 0;
    char small[256];
    char *buf = total <= (Py_ssize_t)sizeof small ? small : PyMem_Malloc(total ? total : 1);
    if (buf == NULL)
        return PyErr_NoMemory();
    Py_ssize_t at = PyBytes_GET_SIZE(t->pending);
    memcpy(buf, PyBytes_AS_STRING(t->pending), at);
    for (Py_ssize_t k = 0; k < n; k++) {
        if (tokens[k]) {
            memcpy(buf + at, PyBytes_AS_STRING(tokens[k]), PyBytes_GET_SIZE(tokens[k]));
            at += PyBytes_GET_SIZE(tokens[k]);
        }
    }
    Py_ssize_t cut = total;
    if (total && (unsigned char)buf[total - 1] >= 0x80)
        cut = total - incomplete_tail((const unsigned char *)buf, total);
    PyObject *pending = PyBytes_FromStringAndSize(buf + cut, total - cut);
    PyObject *text = pending ? PyUnicode_DecodeUTF8(buf, cut, "replace") : NULL;
    if (buf != small)
        PyMem_Free(buf);
    if (text == NULL) {
        Py_XDECREF(pending);
        return NULL;
    }
    Py_SETREF(t->pending, pending);
    return text;
}

#define MAX_STEP_TOKENS 64

static PyObject *
lane_feed(Lane *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2 || !PyBytes_Check(args[0]) || !PyLong_Check(args[1])) {
        PyErr_SetString(PyExc_TypeError, "feed(data: bytes, pos: int)");
        return NULL;
    }
    const char *data = PyBytes_AS_STRING(args[0]);
    Py_ssize_t n = PyBytes_GET_SIZE(args[0]);
    Py_ssize_t pos = PyLong_AsSsize_t(args[1]);
    if (pos == -1 && PyErr_Occurred())
        return NULL;
    if (pos < 0 || self->add == NULL) {
        PyErr_SetString(PyExc_ValueError, self->add == NULL ? "Lane.feed before Lane.__init__" : "feed: pos < 0");
        return NULL;
    }
    Taken t = {NULL, 0, 0, 0, NULL};
    int started = 0, failed = 0;
    while (pos < n) {
        Py_ssize_t next;
        PyObject *event = plain_event(data, n, pos, &next);
        if (event == NULL) {
            if (PyErr_Occurred())
                failed = 1;
            break;
        }
        PyObject *tokens[MAX_STEP_TOKENS];
        Py_ssize_t count;
        int plain = event_tokens(self, event, tokens, MAX_STEP_TOKENS, &count);
        if (plain < 0) {
            Py_DECREF(event);
            if (PyErr_Occurred())
                failed = 1;
            break;
        }
        if (!started) {  /* the state the Python objects hold, read at the first step taken */
            int ok = 1;
            PyObject *before = PyDict_GetItemWithError(self->by_sequence, zero);
            t.count = before ? PyLong_AsLongLong(before) : 0;
            if ((before == NULL && PyErr_Occurred()) || (t.count == -1 && PyErr_Occurred()))
                ok = 0;
            t.sent = int_attr(self->state, s_sent, &ok);
            t.events = int_attr(self->sink, s_events, &ok);
            t.pending = ok ? PyObject_GetAttr(self->detok, s_pending) : NULL;
            t.now = t.pending ? PyObject_CallNoArgs(monotonic) : NULL;
            if (t.now == NULL || !PyBytes_CheckExact(t.pending)) {
                if (t.pending != NULL && !PyErr_Occurred())
                    PyErr_SetString(PyExc_TypeError, "the detokenizer's pending is not bytes");
                Py_DECREF(event);
                Py_CLEAR(t.pending);
                Py_CLEAR(t.now);
                return NULL;
            }
            started = 1;
        }
        /* the step is plain and has tokens: taken (the rest of this iteration can only fail on memory) */
        t.count += count;
        PyObject *text = detokenize(tokens, count, &t);
        Py_DECREF(event);
        if (text == NULL) {
            failed = 1;
            break;
        }
        pos = next;
        if (self->kept != Py_None && PyList_Append(self->kept, text) < 0) {
            Py_DECREF(text);
            failed = 1;
            break;
        }
        if (PyUnicode_GET_LENGTH(text) && write_text(self, text, &t) < 0) {
            Py_DECREF(text);
            failed = 1;
            break;
        }
        Py_DECREF(text);
    }
    if (started) {
        PyObject *type, *value, *tb;
        PyErr_Fetch(&type, &value, &tb);
        if (write_back(self, &t) < 0 && !failed) {
            failed = 1;
            type = value = tb = NULL;
        } else {
            PyErr_Restore(type, value, tb);
        }
        Py_DECREF(t.pending);
        Py_DECREF(t.now);
    }
    if (failed)
        return NULL;
    return PyLong_FromSsize_t(pos);
}

static PyMethodDef lane_methods[] = {
    {"feed", (PyCFunction)(void (*)(void))lane_feed, METH_FASTCALL,
     "feed(data, pos) -> the position of the first chunk not taken (see the module's doc)"},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject LaneType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "front._token_lane.Lane",
    .tp_basicsize = sizeof(Lane),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "Lane(answer, text, end, live): a stream's plain token events, read and written in C",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)lane_init,
    .tp_dealloc = (destructor)lane_dealloc,
    .tp_traverse = (traverseproc)lane_traverse,
    .tp_clear = (inquiry)lane_clear,
    .tp_methods = lane_methods,
};

static PyObject *
py_incomplete_tail(PyObject *module, PyObject *arg)
{
    if (!PyBytes_Check(arg)) {
        PyErr_SetString(PyExc_TypeError, "incomplete_tail(bytes)");
        return NULL;
    }
    return PyLong_FromSsize_t(incomplete_tail((const unsigned char *)PyBytes_AS_STRING(arg), PyBytes_GET_SIZE(arg)));
}

static PyMethodDef module_methods[] = {
    {"incomplete_tail", py_incomplete_tail, METH_O, "the C lane's text/detokenize.py incomplete_tail (tests)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "front._token_lane", NULL, -1, module_methods};

static PyObject *
import_attr(const char *module_name, const char *name)
{
    PyObject *m = PyImport_ImportModule(module_name);
    if (m == NULL)
        return NULL;
    PyObject *a = PyObject_GetAttrString(m, name);
    Py_DECREF(m);
    return a;
}

#define INTERN(var, text) if (!(var = PyUnicode_InternFromString(text))) return NULL

PyMODINIT_FUNC
PyInit__token_lane(void)
{
    if (!(orjson_loads = import_attr("orjson", "loads")) || !(encode_ascii = import_attr("json.encoder", "encode_basestring_ascii"))
        || !(monotonic = import_attr("time", "monotonic")))
        return NULL;
    INTERN(s_answer_last_at, "last_at"); INTERN(s_last, "last"); INTERN(s_last_had_output, "last_had_output");
    INTERN(s_produced, "produced"); INTERN(s_pending, "pending"); INTERN(s_sent, "sent"); INTERN(s_events, "events");
    INTERN(s_stops, "stops"); INTERN(s_text, "text"); INTERN(key_error, "error");
    INTERN(key_ids, "output_ids"); INTERN(key_length, "sequence_length"); INTERN(key_index, "sequence_index");
    INTERN(beside[0], "output_log_probs"); INTERN(beside[1], "generation_logits"); INTERN(beside[2], "context_logits");
    if (!(zero = PyLong_FromLong(0)))
        return NULL;
    if (PyType_Ready(&LaneType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
#ifndef LANE_SOURCE_SHA256
#define LANE_SOURCE_SHA256 ""
#endif
    /* the source this was built from (build/token_lane.py): front/token_lane.py ignores a stale build */
    if (PyModule_AddStringConstant(m, "SOURCE_SHA256", LANE_SOURCE_SHA256) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    Py_INCREF(&LaneType);
    if (PyModule_AddObject(m, "Lane", (PyObject *)&LaneType) < 0) {
        Py_DECREF(&LaneType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
