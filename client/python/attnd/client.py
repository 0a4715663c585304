"""attnd.Client: attention calls to an attnd server from NumPy arrays and torch tensors.

Every call goes through libattnd_client_c.so (the C++ client library), so transports, streaming, the
shared-memory channel, CUDA IPC registration and auth behave as in `attn`.

Layouts: q [batch, q_len, q_heads, head_dim], k and v [batch, kv_len, kv_heads, head_dim], O like q, LSE fp32
[batch, q_heads, q_len]. Where the memory goes:
- NumPy arrays and torch CPU tensors travel inline. The head_dim axis must be contiguous (an array whose last
  axis is strided is copied with ascontiguousarray/contiguous first); other strides (a transposed view) are
  passed as strides, and the C library gathers such a tensor into the request in one pass, since inline tensors
  travel contiguous on every transport.
- torch CUDA tensors go by CUDA IPC (same host, a server started with --enable_cuda_ipc): each storage is
  registered once (RegisterCudaBuffer) and the call names it with the tensor's offset and strides, so nothing is
  copied. The registration is dropped when the storage is freed or the client closes.

KV sequences (docs/sequences.md) keep K and V on the server: open_sequence() returns Sequence objects, step()
sends only the new rows. Their tensors are [T, heads, head_dim], the sequences' rows back to back.
"""
import concurrent.futures
import ctypes
import enum
import itertools
import json
import collections
import re
import sys
import threading
import weakref

from . import _lib


class StatusCode(enum.IntEnum):
    """gRPC status codes (the C library reports them numerically)."""
    OK = 0
    CANCELLED = 1
    UNKNOWN = 2
    INVALID_ARGUMENT = 3
    DEADLINE_EXCEEDED = 4
    NOT_FOUND = 5
    ALREADY_EXISTS = 6
    PERMISSION_DENIED = 7
    RESOURCE_EXHAUSTED = 8
    FAILED_PRECONDITION = 9
    ABORTED = 10
    OUT_OF_RANGE = 11
    UNIMPLEMENTED = 12
    INTERNAL = 13
    UNAVAILABLE = 14
    DATA_LOSS = 15
    UNAUTHENTICATED = 16


class AttndError(Exception):
    """A failed call: `code` (StatusCode), `message` (names the field at fault for bad input), `request_id`."""

    def __init__(self, code, message, request_id=""):
        self.code = StatusCode(code) if not isinstance(code, str) else StatusCode[code]
        self.message = message
        self.request_id = request_id
        rid = f" [request {request_id}]" if request_id else ""
        super().__init__(f"{self.code.name}: {message}{rid}")


def _raise(err):
    raise AttndError(err.code, err.message.decode(errors="replace"), err.request_id.decode(errors="replace"))


def _invalid(message):
    return AttndError(StatusCode.INVALID_ARGUMENT, message)


_INT_STRING = re.compile(r"^-?\d+$")


def _ints(obj):
    """proto3's JSON writes 64-bit integers as strings; back to ints (no other field is all digits)."""
    if isinstance(obj, dict):
        return {k: _ints(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_ints(v) for v in obj]
    if isinstance(obj, str) and _INT_STRING.match(obj):
        return int(obj)
    return obj


def _mask(causal):
    if causal is False or causal is None:
        return _lib.MASK_NONE
    if causal is True or causal == "top_left":
        return _lib.MASK_TOP_LEFT
    if causal == "bottom_right":
        return _lib.MASK_BOTTOM_RIGHT
    raise _invalid(f"causal: {causal!r} is not False, True, 'top_left' or 'bottom_right'")


class _View:
    """One tensor as the C library sees it: kind, shape, dtype code, pointer, element strides, the object."""
    __slots__ = ("kind", "obj", "shape", "dtype", "ptr", "strides", "device")


def _np():
    import numpy
    return numpy


def _torch():
    # A caller with torch tensors has imported torch; nobody else pays for importing it.
    return sys.modules.get("torch")


_BF16_UNSET = object()
_bf16 = _BF16_UNSET


def _bf16_numpy_dtype():
    """ml_dtypes.bfloat16 as a NumPy dtype, or None without ml_dtypes (probed once: a failed import is slow)."""
    global _bf16
    if _bf16 is _BF16_UNSET:
        try:
            import ml_dtypes
            _bf16 = _np().dtype(ml_dtypes.bfloat16)
        except ImportError:
            _bf16 = None
    return _bf16


def _view(name, x, dtype_hint):
    v = _View()
    v.obj = x
    torch = _torch()
    if torch is not None and isinstance(x, torch.Tensor):
        if x.dim() != 4:
            raise _invalid(f"{name}: must have 4 dimensions, has {x.dim()}")
        if x.dtype == torch.bfloat16:
            v.dtype = _lib.DTYPE_BF16
        elif x.dtype == torch.float16:
            v.dtype = _lib.DTYPE_FP16
        else:
            raise _invalid(f"{name}: dtype {x.dtype} is not torch.bfloat16 or torch.float16")
        if x.stride(3) != 1:
            x = x.contiguous()
            v.obj = x
        v.kind = "cuda" if x.is_cuda else "torch"
        v.device = x.device
        v.shape = tuple(x.shape)
        v.ptr = x.data_ptr()
        v.strides = tuple(x.stride()[:3])
        return v
    np = _np()
    if not isinstance(x, np.ndarray):
        raise _invalid(f"{name}: {type(x).__name__} is not a numpy.ndarray or a torch.Tensor")
    if x.ndim != 4:
        raise _invalid(f"{name}: must have 4 dimensions, has {x.ndim}")
    bf16 = _bf16_numpy_dtype()
    if bf16 is not None and x.dtype == bf16:
        v.dtype = _lib.DTYPE_BF16
    elif x.dtype == np.float16:
        v.dtype = _lib.DTYPE_FP16
    elif x.dtype == np.uint16 and dtype_hint in ("bf16", "fp16"):
        v.dtype = _lib.DTYPE_BF16 if dtype_hint == "bf16" else _lib.DTYPE_FP16
    else:
        hint = " (uint16 bf16 bits need dtype='bf16')" if x.dtype == np.uint16 else ""
        raise _invalid(f"{name}: dtype {x.dtype} is not bfloat16 (ml_dtypes) or float16{hint}")
    if x.strides[3] != x.itemsize:
        x = np.ascontiguousarray(x)
        v.obj = x
    v.kind = "numpy"
    v.device = None
    v.shape = tuple(x.shape)
    v.ptr = x.ctypes.data
    v.strides = tuple(s // x.itemsize for s in x.strides[:3])
    return v


def _set_inline(t, v):
    t.data = v.ptr
    t.buffer_id = None
    t.offset = 0
    t.strides[:] = list(v.strides)


class _Registration:
    __slots__ = ("buffer_id", "nbytes", "finalizer", "weak", "counter")

    def alive(self):
        return self.finalizer.alive if self.weak is None else not self.weak.expired()

    def detach(self):
        if self.finalizer is not None:
            self.finalizer.detach()


class _Call:
    """What one call holds until it completes: the argument struct and every object whose memory it names."""
    __slots__ = ("args", "keep", "out", "lse", "future", "ret")


def _set_call_options(a, scale, return_lse, transport, timeout, request_id):
    """The options ForwardArgs and StepArgs share: softmax scale, LSE, transport, timeout, request id."""
    a.has_scale = 0 if scale is None else 1
    a.scale = 0.0 if scale is None else float(scale)
    a.want_lse = 1 if return_lse else 0
    if transport is None:
        a.transport = -1
    elif transport in _lib.TRANSPORTS:
        a.transport = _lib.TRANSPORTS[transport]
    else:
        raise _invalid(f"transport: {transport!r} is not one of {', '.join(_lib.TRANSPORTS)}")
    a.timeout_s = float(timeout or 0)
    a.request_id = request_id.encode() if request_id else None


class Client:
    """A connection to an attnd server. Thread-safe; close() (or a `with` block) releases it."""

    def __init__(self, target, transport="auto", tls=None, token=None, shm_socket=None, timeout=None,
                 tls_server_name=None):
        """target: host:port or unix:/path. transport: auto | unary | stream | shm (shm: Forward calls over the
        server's --shm_socket, given as shm_socket; the other RPCs still use target). tls: path of the PEM CA
        file the server's certificate chains to (the channel then speaks TLS). token: the bearer token of a
        server started with --auth_token_file. timeout: seconds per call (default 120)."""
        self._lib = _lib.load()
        if transport not in _lib.TRANSPORTS:
            raise _invalid(f"transport: {transport!r} is not one of {', '.join(_lib.TRANSPORTS)}")
        opts = _lib.ClientOptions()
        opts.target = target.encode()
        opts.transport = _lib.TRANSPORTS[transport]
        opts.tls_ca_file = tls.encode() if tls else None
        opts.tls_server_name = tls_server_name.encode() if tls_server_name else None
        opts.auth_token = token.encode() if token else None
        opts.shm_socket = shm_socket.encode() if shm_socket else None
        opts.default_timeout_s = float(timeout or 0)
        opts.shm_max_bytes = 0
        err = _lib.Error()
        handle = self._lib.attnd_client_create(ctypes.byref(opts), ctypes.byref(err))
        if not handle:
            _raise(err)
        self._handle = handle
        self.transport = transport
        self._mu = threading.Lock()
        self._buffers = {}  # storage data_ptr -> _Registration

    # -- lifetime ---------------------------------------------------------------------------------------------

    def close(self):
        """Unregisters this client's CUDA buffers, waits for its calls in flight, and closes it."""
        handle, self._handle = getattr(self, "_handle", None), None
        if not handle:
            return
        with self._mu:
            regs, self._buffers = list(self._buffers.values()), {}
        for r in regs:
            r.detach()
            self._unregister(handle, r)
        self._lib.attnd_client_destroy(handle)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass

    def _h(self):
        if not self._handle:
            raise AttndError(StatusCode.FAILED_PRECONDITION, "client: closed")
        return self._handle

    # -- passthroughs -----------------------------------------------------------------------------------------

    def _json(self, fn, *args):
        err = _lib.Error()
        p = fn(self._h(), *args, ctypes.byref(err))
        if not p:
            _raise(err)
        try:
            return _ints(json.loads(ctypes.string_at(p).decode()))
        finally:
            self._lib.attnd_free_string(p)

    def info(self, refresh=False):
        """GetServerInfo as a dict (proto field names): backend, supported_head_dims, supported_dtypes, limits,
        cuda_ipc_enabled, kernels, devices, ..."""
        return self._json(self._lib.attnd_client_info_json, 1 if refresh else 0)

    def stats(self):
        """GetStats as a dict (rpcs, queue_depth, in_flight, uptime_s, bytes_in, bytes_out, ...)."""
        return self._json(self._lib.attnd_client_stats_json)

    def health(self, service=""):
        """True when the server's grpc.health.v1 check says SERVING; AttndError otherwise."""
        err = _lib.Error()
        if self._lib.attnd_client_health(self._h(), service.encode(), ctypes.byref(err)) != 0:
            _raise(err)
        return True

    # -- attention --------------------------------------------------------------------------------------------

    def attention(self, q, k, v, causal=False, scale=None, return_lse=False, out=None, dtype=None,
                  transport=None, timeout=None, request_id=None):
        """O = softmax(scale * Q K^T + mask) V, computed by the server.

        q [batch, q_len, q_heads, head_dim]; k, v [batch, kv_len, kv_heads, head_dim] (q_heads a multiple of
        kv_heads: GQA/MQA). NumPy arrays (ml_dtypes.bfloat16 or float16; uint16 bf16 bits with dtype="bf16"),
        torch CPU or CUDA tensors (bfloat16, float16); all three of one kind. causal: False, True or "top_left"
        (torch's is_causal), "bottom_right" (FlashAttention's). scale: None is 1/sqrt(head_dim).
        Returns O of q's kind (written into `out` when given: contiguous, q's shape and dtype), or (O, LSE) with
        return_lse, LSE fp32 [batch, q_heads, q_len]. transport overrides the client's for this call (not shm
        unless the client has a shm_socket)."""
        call = self._prepare(q, k, v, causal, scale, return_lse, out, dtype, transport, timeout, request_id)
        info = _lib.ForwardInfo()
        err = _lib.Error()
        if self._lib.attnd_forward(self._h(), ctypes.byref(call.args), ctypes.byref(info), ctypes.byref(err)) != 0:
            _raise(err)
        self.last_info = info
        return call.ret()

    def attention_async(self, q, k, v, causal=False, scale=None, return_lse=False, out=None, dtype=None,
                        transport=None, timeout=None, request_id=None):
        """attention() without waiting: a concurrent.futures.Future of its result (in asyncio:
        `await asyncio.wrap_future(client.attention_async(...))`). The inputs must not change until it is done."""
        call = self._prepare(q, k, v, causal, scale, return_lse, out, dtype, transport, timeout, request_id)
        call.future = concurrent.futures.Future()
        call.future.set_running_or_notify_cancel()
        key = next(_call_ids)
        with _pending_mu:
            _pending[key] = call
        err = _lib.Error()
        rc = self._lib.attnd_forward_async(self._h(), ctypes.byref(call.args), _on_done, ctypes.c_void_p(key),
                                           ctypes.byref(err))
        if rc != 0:
            with _pending_mu:
                _pending.pop(key, None)
            _raise(err)
        return call.future

    def _prepare(self, q, k, v, causal, scale, return_lse, out, dtype, transport, timeout, request_id):
        qv, kv, vv = _view("q", q, dtype), _view("k", k, dtype), _view("v", v, dtype)
        if not (qv.kind == kv.kind == vv.kind):
            raise _invalid(f"k, v: must be of q's kind ({qv.kind}), are {kv.kind} and {vv.kind}")
        if qv.kind == "cuda" and not (qv.device == kv.device == vv.device):
            raise _invalid(f"k, v: must be on q's device ({qv.device})")
        if not (qv.dtype == kv.dtype == vv.dtype):
            raise _invalid("k, v: must have q's dtype")
        b, lq, hq, d = qv.shape
        if kv.shape != vv.shape:
            raise _invalid(f"v: shape {list(vv.shape)} differs from k's {list(kv.shape)}")
        if kv.shape[0] != b:
            raise _invalid(f"k: batch {kv.shape[0]} differs from q's {b}")
        if kv.shape[3] != d:
            raise _invalid(f"k: head_dim {kv.shape[3]} differs from q's {d}")
        lk, hkv = kv.shape[1], kv.shape[2]
        call = _Call()
        a = _lib.ForwardArgs()
        a.batch, a.q_len, a.kv_len, a.q_heads, a.kv_heads, a.head_dim = b, lq, lk, hq, hkv, d
        a.dtype = qv.dtype
        a.mask = _mask(causal)
        _set_call_options(a, scale, return_lse, transport, timeout, request_id)
        keep = [qv.obj, kv.obj, vv.obj]
        o = self._make_out(qv, out, (b, lq, hq, d))
        lse = None
        if return_lse:
            lse = self._make_lse(qv, (b, hq, lq))
            keep.append(lse)
            a.lse = lse.ctypes.data if qv.kind == "numpy" else lse.data_ptr()
        if qv.kind == "cuda":
            self._wait_for_producer(qv.device)
            for name, vw in (("q", qv), ("k", kv), ("v", vv)):
                self._set_ref(getattr(a, name), vw.obj, vw.strides)
            self._set_ref(a.o, o, None)
        else:
            _set_inline(a.q, qv)
            _set_inline(a.k, kv)
            _set_inline(a.v, vv)
            a.o.data = o.ctypes.data if qv.kind == "numpy" else o.data_ptr()
            a.o.buffer_id = None
            a.o.strides[:] = [0, 0, 0]
        keep.append(o)
        call.args, call.keep = a, keep
        device = qv.device if qv.kind == "cuda" else None

        def ret():
            if not return_lse:
                return o
            return o, (lse.to(device) if device is not None else lse)

        call.ret = ret
        return call

    @staticmethod
    def _make_out(qv, out, shape):
        if qv.kind == "numpy":
            np = _np()
            if out is None:
                return np.empty(shape, dtype=qv.obj.dtype)
            if not isinstance(out, np.ndarray) or out.shape != shape or out.dtype != qv.obj.dtype:
                raise _invalid(f"out: must be a numpy array of shape {list(shape)} and dtype {qv.obj.dtype}")
            if not out.flags["C_CONTIGUOUS"]:
                raise _invalid("out: must be contiguous")
            return out
        torch = _torch()
        if out is None:
            return torch.empty(shape, dtype=qv.obj.dtype, device=qv.device)
        if (not isinstance(out, torch.Tensor) or tuple(out.shape) != shape or out.dtype != qv.obj.dtype
                or out.device != qv.device):
            raise _invalid(f"out: must be a {qv.obj.dtype} tensor of shape {list(shape)} on {qv.device}")
        if not out.is_contiguous():
            raise _invalid("out: must be contiguous")
        return out

    @staticmethod
    def _make_lse(qv, shape):
        # LSE comes back inline (host memory) on every transport; a CUDA caller gets it moved to its device.
        if qv.kind == "numpy":
            return _np().empty(shape, dtype=_np().float32)
        torch = _torch()
        return torch.empty(shape, dtype=torch.float32)

    # -- KV sequences (docs/sequences.md) ----------------------------------------------------------------------

    def open_sequence(self, layers, kv_heads, head_dim, dtype="bf16", max_tokens=0, count=None):
        """Opens KV sequences of one shape: a Sequence, or a list of `count` of them. dtype: "bf16" or "fp16";
        max_tokens 0: the server's limit."""
        if dtype not in _SEQ_DTYPES:
            raise _invalid(f"dtype: {dtype!r} is not 'bf16' or 'fp16'")
        if count is not None and (not isinstance(count, int) or count < 1):
            raise _invalid(f"count: {count!r} is not a positive int")
        shape = SequenceShape(int(layers), int(kv_heads), int(head_dim), dtype)
        cs = _lib.SequenceShape(shape.layers, shape.kv_heads, shape.head_dim, _SEQ_DTYPES[dtype])
        got_max, page = ctypes.c_int64(0), ctypes.c_int32(0)
        err = _lib.Error()
        p = self._lib.attnd_sequence_open(self._h(), ctypes.byref(cs), int(max_tokens), count or 1,
                                          ctypes.byref(got_max), ctypes.byref(page), ctypes.byref(err))
        if not p:
            _raise(err)
        seqs = [Sequence(self, i, shape, got_max.value) for i in _ids_of(p, self._lib)]
        return seqs if count is not None else seqs[0]


    def step(self, layer, sequences, q=None, k=None, v=None, q_heads=None, return_lse=False, scale=None,
             tokens=None, dtype=None, transport=None, timeout=None, request_id=None):
        """One Step at `layer` for a batch of sequences (Sequence objects or ids): appends k, v as each sequence's
        new rows and runs attention for q's rows over everything cached, causal (the row at position p sees keys
        0..p). Either q (attend only) or k and v (append only) may be left out.

        q [T, q_heads, head_dim], k and v [T, kv_heads, head_dim]: NumPy arrays (ml_dtypes.bfloat16 or float16;
        uint16 bits take the sequences' dtype) or torch tensors (bfloat16, float16), the sequences' rows back to
        back, or a list of per-sequence tensors (concatenated; they give the tokens). tokens: rows per sequence, an
        int or a list; default: from the lists, else T split evenly. torch CUDA tensors are copied to host memory
        and O comes back on their device (steps have no zero-copy path for them).
        Returns O (q's kind and dtype; None without q), or (O, LSE) with return_lse: LSE a list of fp32
        [q_heads, tokens] per sequence. Each Sequence object's `lengths[layer]` is updated from the reply."""
        if isinstance(sequences, (Sequence, str)):
            sequences = [sequences]
        sequences = list(sequences)
        if not sequences:
            raise _invalid("sequences: empty")
        ids = [_seq_id(f"sequences[{i}]", s) for i, s in enumerate(sequences)]
        if dtype is None:
            dtype = next((s.shape.dtype for s in sequences if isinstance(s, Sequence)), None)
        views = {}
        for name, x in (("q", q), ("k", k), ("v", v)):
            if x is not None:
                views[name] = _step_tensor(name, x, dtype)
        if ("k" in views) != ("v" in views):
            raise _invalid("k, v: give both (append) or neither (attend only)")
        if not views:
            raise _invalid("q, k, v: none given")
        first = next(iter(views.values()))
        for name, t in views.items():
            if t.kind != first.kind:
                raise _invalid(f"{name}: must be of the same kind as the others ({first.kind}), is {t.kind}")
            if t.dtype != first.dtype:
                raise _invalid(f"{name}: dtype differs from the other tensors'")
            if t.shape[0] != first.shape[0]:
                raise _invalid(f"{name}: {t.shape[0]} rows, the other tensors have {first.shape[0]}")
            if t.shape[2] != first.shape[2]:
                raise _invalid(f"{name}: head_dim {t.shape[2]} differs from the other tensors' {first.shape[2]}")
        if "k" in views and views["k"].shape[1] != views["v"].shape[1]:
            raise _invalid(f"v: {views['v'].shape[1]} heads, k has {views['k'].shape[1]}")
        total, d = first.shape[0], first.shape[2]
        rows = next((t.rows for t in views.values() if t.rows is not None), None)
        if tokens is None:
            if rows is not None:
                tokens = rows
            elif total % len(ids) == 0:
                tokens = [total // len(ids)] * len(ids)
            else:
                raise _invalid(f"tokens: {total} rows do not split evenly over {len(ids)} sequences; give tokens=")
        elif isinstance(tokens, int):
            tokens = [tokens] * len(ids)
        tokens = [int(n) for n in tokens]
        if len(tokens) != len(ids):
            raise _invalid(f"tokens: {len(tokens)} entries for {len(ids)} sequences")
        if sum(tokens) != total:
            raise _invalid(f"tokens: they sum to {sum(tokens)}, the tensors have {total} rows")
        for name, t in views.items():
            if t.rows is not None and t.rows != tokens:
                raise _invalid(f"{name}: rows per sequence {t.rows} differ from tokens {tokens}")
        qv = views.get("q")
        if qv is not None:
            if q_heads is not None and int(q_heads) != qv.shape[1]:
                raise _invalid(f"q_heads: {q_heads} but q has {qv.shape[1]} heads")
            q_heads = qv.shape[1]
        a = _lib.StepArgs()
        a.layer = int(layer)
        a.q_heads = int(q_heads or 0)
        a.count = len(ids)
        id_bytes = [i.encode() for i in ids]
        c_ids = (ctypes.c_char_p * len(ids))(*id_bytes)
        c_tokens = (ctypes.c_int64 * len(ids))(*tokens)
        c_lengths = (ctypes.c_int64 * len(ids))()
        a.sequence_ids = c_ids
        a.tokens = c_tokens
        a.lengths = c_lengths
        _set_call_options(a, scale, return_lse, transport, timeout, request_id)
        for name, t in views.items():
            setattr(a, name, t.ptr)
            setattr(a, f"{name}_bytes", t.nbytes)
        o = lse = None
        np = _np()
        torch = _torch()
        if qv is not None:
            shape = (total, qv.shape[1], d)
            o = np.empty(shape, dtype=qv.obj.dtype) if qv.kind == "numpy" else torch.empty(shape, dtype=qv.obj.dtype)
            a.o = o.ctypes.data if qv.kind == "numpy" else o.data_ptr()
            a.o_bytes = total * qv.shape[1] * d * 2
        if return_lse:
            if qv is None:
                raise _invalid("return_lse: needs q")
            n = total * qv.shape[1]
            lse = np.empty(n, dtype=np.float32) if qv.kind == "numpy" else torch.empty(n, dtype=torch.float32)
            a.lse = lse.ctypes.data if qv.kind == "numpy" else lse.data_ptr()
            a.lse_bytes = n * 4
        info = _lib.ForwardInfo()
        err = _lib.Error()
        if self._lib.attnd_step(self._h(), ctypes.byref(a), ctypes.byref(info), ctypes.byref(err)) != 0:
            _raise(err)
        self.last_info = info
        for s, n in zip(sequences, c_lengths):
            if isinstance(s, Sequence):
                s.lengths[int(layer)] = int(n)
        device = qv.device if qv is not None and qv.kind == "torch" and qv.device.type != "cpu" else None
        if o is not None and device is not None:
            o = o.to(device)
        if not return_lse:
            return o
        parts, at = [], 0
        for n in tokens:
            part = lse[at:at + n * qv.shape[1]].reshape(qv.shape[1], n)
            parts.append(part.to(device) if device is not None else part)
            at += n * qv.shape[1]
        return o, parts


    def fork_sequence(self, sequence, n=None):
        """New sequences sharing `sequence`'s tokens (copy-on-write): one Sequence, or a list of n."""
        if n is not None and (not isinstance(n, int) or n < 1):
            raise _invalid(f"n: {n!r} is not a positive int")
        err = _lib.Error()
        p = self._lib.attnd_sequence_fork(self._h(), _seq_id("sequence", sequence).encode(), n or 1, ctypes.byref(err))
        if not p:
            _raise(err)
        ids = _ids_of(p, self._lib)
        if isinstance(sequence, Sequence):
            kids = [Sequence(self, i, sequence.shape, sequence.max_tokens, sequence.lengths) for i in ids]
        else:
            kids = ids
        return kids if n is not None else kids[0]


    def truncate_sequence(self, sequence, tokens):
        """Keeps the first `tokens` of every layer of `sequence`; returns the per-layer lengths after it."""
        if not isinstance(tokens, int) or tokens < 0:
            raise _invalid(f"tokens: {tokens!r} is not an int >= 0")
        lengths = (ctypes.c_int64 * 4096)()
        n = ctypes.c_size_t(0)
        err = _lib.Error()
        if self._lib.attnd_sequence_truncate(self._h(), _seq_id("sequence", sequence).encode(), tokens, lengths,
                                             len(lengths), ctypes.byref(n), ctypes.byref(err)) != 0:
            _raise(err)
        out = [int(x) for x in lengths[:min(n.value, len(lengths))]]
        if isinstance(sequence, Sequence):
            sequence.lengths = list(out)
        return out


    def close_sequences(self, sequences):
        """Closes all of `sequences` (Sequence objects or ids), or none of them when one is unknown."""
        if isinstance(sequences, (Sequence, str)):
            sequences = [sequences]
        sequences = list(sequences)
        ids = [_seq_id(f"sequences[{i}]", s).encode() for i, s in enumerate(sequences)]
        err = _lib.Error()
        if self._lib.attnd_sequence_close(self._h(), (ctypes.c_char_p * len(ids))(*ids), len(ids),
                                          ctypes.byref(err)) != 0:
            _raise(err)
        for s in sequences:
            if isinstance(s, Sequence):
                s.closed = True


    def sequence_info(self, sequence):
        """GetSequence as a dict (proto field names)."""
        return self._json(self._lib.attnd_sequence_info_json, _seq_id("sequence", sequence).encode())

    # -- CUDA IPC ---------------------------------------------------------------------------------------------

    @staticmethod
    def _wait_for_producer(device):
        # The server reads the memory from its own stream: whatever the caller's current stream still has
        # queued (the kernels that produced q, k, v) must be done first.
        _torch().cuda.current_stream(device).synchronize()

    def _set_ref(self, t, tensor, strides):
        storage = tensor.untyped_storage() if hasattr(tensor, "untyped_storage") else tensor.storage()
        reg = self._registration(storage, tensor.device)
        t.data = None
        t.buffer_id = reg.buffer_id
        t.offset = tensor.storage_offset() * tensor.element_size()
        t.strides[:] = list(strides) if strides is not None else [0, 0, 0]

    def _registration(self, storage, device):
        key = storage.data_ptr()
        with self._mu:
            reg = self._buffers.get(key)
        if reg is not None and reg.alive() and reg.nbytes == storage.nbytes():
            return reg
        if reg is not None:  # a stale entry at a reused address
            self._drop(key)
        return self._register(storage, device, key)

    def _register(self, storage, device, key):
        # torch's own IPC export of a storage. Fields of the tuple used: [0] device index, [1] the handle
        # (the 64 bytes of cudaIpcMemHandle_t of the caching allocator's block; newer torch prefixes a version
        # byte and a type byte, 'c' for cudaMalloc memory, 'e' for expandable segments, which cudaIpcOpenMemHandle
        # cannot open), [2] the storage's size in bytes, [3] its offset in the block, [4], [5] the handle and
        # offset of torch's IPC reference counter. _share_cuda_ counts the export as one outstanding consumer,
        # which keeps the block out of the allocator's reuse after the storage is freed; the server is not a
        # torch consumer, so this client releases the count when it unregisters (as torch's consumers do).
        shared = storage._share_cuda_()
        dev, handle, size, offset = int(shared[0]), bytes(shared[1]), int(shared[2]), int(shared[3])
        counter = (shared[4], int(shared[5]), dev)
        if len(handle) == 66 and handle[1:2] == b"c":
            handle = handle[2:]
        if len(handle) != 64:
            _release_counter(counter)
            kind = " (an expandable segment: set PYTORCH_CUDA_ALLOC_CONF=expandable_segments:False)" \
                if len(handle) >= 2 and handle[1:2] == b"e" else ""
            raise AttndError(StatusCode.FAILED_PRECONDITION,
                             f"q/k/v/o: torch's IPC handle is {len(handle)} bytes, not a cudaIpcMemHandle_t{kind}")
        err = _lib.Error()
        buf = ctypes.create_string_buffer(256)
        rc = self._lib.attnd_register_cuda_buffer(self._h(), handle, dev, offset, size, b"attnd-python", buf,
                                                  len(buf), ctypes.byref(err))
        if rc != 0:
            _release_counter(counter)
            _raise(err)
        reg = _Registration()
        reg.buffer_id = buf.value
        reg.nbytes = size
        reg.counter = counter
        reg.finalizer, reg.weak = None, None
        if _storage_objects_persist():
            # The storage's Python object lives exactly as long as the storage: its finalizer is the free.
            reg.finalizer = weakref.finalize(storage, _drop_registration, weakref.ref(self), key, reg)
        else:
            # A fresh wrapper per access (older torch): a weak reference to the storage itself, checked on
            # every registration and whenever the cache is consulted for a new storage.
            from torch.multiprocessing.reductions import StorageWeakRef
            reg.weak = StorageWeakRef(storage)
            self._sweep()
        with self._mu:
            self._buffers[key] = reg
        return reg

    def _sweep(self):
        with self._mu:
            dead = [k for k, r in self._buffers.items() if r.weak is not None and r.weak.expired()]
        for k in dead:
            self._drop(k)

    def _drop(self, key):
        with self._mu:
            reg = self._buffers.pop(key, None)
        if reg is not None:
            reg.detach()
            if self._handle:
                self._unregister(self._handle, reg)

    def _unregister(self, handle, reg):
        err = _lib.Error()
        self._lib.attnd_unregister_cuda_buffer(handle, reg.buffer_id, ctypes.byref(err))
        _release_counter(reg.counter)


_persist = None


def _storage_objects_persist():
    """Whether torch hands out one Python object per storage for its whole life (torch 2.x preserves it)."""
    global _persist
    if _persist is None:
        torch = _torch()
        t = torch.empty(1)
        _persist = hasattr(t, "untyped_storage") and t.untyped_storage() is t.untyped_storage()
    return _persist


def _release_counter(counter):
    torch = _torch()
    handle, offset, dev = counter
    # torch 2.x: UntypedStorage._release_ipc_counter(handle, offset, device=...) (what torch's own IPC consumers
    # call); older torch: torch.cuda.Storage._release_ipc_counter(handle, offset).
    release = getattr(torch.UntypedStorage, "_release_ipc_counter", None)
    if release is not None:
        release(handle, offset, device=dev)
    else:
        torch.cuda.Storage._release_ipc_counter(handle, offset)


def _drop_registration(client_ref, key, reg):
    client = client_ref()
    if client is None or not client._handle:
        return
    with client._mu:
        if client._buffers.get(key) is reg:
            del client._buffers[key]
    client._unregister(client._handle, reg)


# -- KV sequences -------------------------------------------------------------------------------------------------

SequenceShape = collections.namedtuple("SequenceShape", ["layers", "kv_heads", "head_dim", "dtype"])
_SEQ_DTYPES = {"bf16": _lib.DTYPE_BF16, "fp16": _lib.DTYPE_FP16}


class Sequence:
    """A KV sequence on the server: `id`, `shape` (SequenceShape), `max_tokens` (the limit that applies) and
    `lengths` (its cached tokens per layer as this object last saw them: after its steps and truncations).
    A `with` block closes it."""

    def __init__(self, client, sequence_id, shape, max_tokens=0, lengths=None):
        self.client = client
        self.id = sequence_id
        self.shape = shape
        self.max_tokens = max_tokens
        self.lengths = list(lengths) if lengths is not None else [0] * shape.layers
        self.closed = False

    def step(self, layer, q=None, k=None, v=None, return_lse=False, scale=None, q_heads=None, **kw):
        """client.step(layer, [self], ...): O [tokens, q_heads, head_dim], or (O, LSE [q_heads, tokens])."""
        r = self.client.step(layer, [self], q, k, v, q_heads=q_heads, return_lse=return_lse, scale=scale, **kw)
        if return_lse:
            return r[0], r[1][0]
        return r

    def fork(self, n=None):
        """A new Sequence sharing this one's tokens (copy-on-write), or a list of n of them."""
        return self.client.fork_sequence(self, n)

    def truncate(self, tokens):
        """Keeps the first `tokens` of every layer; returns the per-layer lengths after it."""
        return self.client.truncate_sequence(self, tokens)

    def info(self):
        """GetSequence as a dict: sequence_id, shape, max_tokens, lengths, pages, shared_pages, idle_s, ..."""
        return self.client.sequence_info(self)

    def close(self):
        """Frees the sequence on the server; closing it again does nothing."""
        if not self.closed:
            self.client.close_sequences([self])

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __str__(self):
        return self.id

    def __repr__(self):
        return f"Sequence({self.id!r}, {tuple(self.shape)}, lengths={self.lengths})"


def _seq_id(name, s):
    if isinstance(s, Sequence):
        return s.id
    if isinstance(s, str) and s:
        return s
    raise _invalid(f"{name}: {s!r} is not a Sequence or a sequence id")


class _StepTensor:
    __slots__ = ("kind", "device", "obj", "shape", "dtype", "ptr", "nbytes", "rows")


def _step_tensor(name, x, dtype_hint):
    """One of a step's q/k/v as contiguous host memory ([T, heads, head_dim]); a list is concatenated on T."""
    t = _StepTensor()
    torch = _torch()
    np = _np()
    if isinstance(x, (list, tuple)):
        if not x:
            raise _invalid(f"{name}: an empty list")
        t.rows = []
        for i, part in enumerate(x):
            if getattr(part, "ndim", None) != 3:
                raise _invalid(f"{name}[{i}]: must be a tensor of 3 dimensions [tokens, heads, head_dim]")
            t.rows.append(int(part.shape[0]))
        if torch is not None and all(isinstance(p, torch.Tensor) for p in x):
            if any(p.device != x[0].device for p in x):
                raise _invalid(f"{name}: the list's tensors must be on one device")
            x = torch.cat(list(x), dim=0)
        elif all(isinstance(p, np.ndarray) for p in x):
            x = np.concatenate(x, axis=0)
        else:
            raise _invalid(f"{name}: a list must hold numpy arrays only or torch tensors only")
    else:
        t.rows = None
    if torch is not None and isinstance(x, torch.Tensor):
        if x.dim() != 3:
            raise _invalid(f"{name}: must have 3 dimensions [tokens, heads, head_dim], has {x.dim()}")
        if x.dtype == torch.bfloat16:
            t.dtype = _lib.DTYPE_BF16
        elif x.dtype == torch.float16:
            t.dtype = _lib.DTYPE_FP16
        else:
            raise _invalid(f"{name}: dtype {x.dtype} is not torch.bfloat16 or torch.float16")
        t.kind, t.device = "torch", x.device
        x = x.detach().cpu().contiguous()
        t.ptr = x.data_ptr()
        t.nbytes = x.numel() * x.element_size()
    elif isinstance(x, np.ndarray):
        if x.ndim != 3:
            raise _invalid(f"{name}: must have 3 dimensions [tokens, heads, head_dim], has {x.ndim}")
        bf16 = _bf16_numpy_dtype()
        if bf16 is not None and x.dtype == bf16:
            t.dtype = _lib.DTYPE_BF16
        elif x.dtype == np.float16:
            t.dtype = _lib.DTYPE_FP16
        elif x.dtype == np.uint16 and dtype_hint in _SEQ_DTYPES:
            t.dtype = _SEQ_DTYPES[dtype_hint]
        else:
            hint = " (uint16 bf16 bits need the sequence's dtype: a Sequence or dtype=)" \
                if x.dtype == np.uint16 else ""
            raise _invalid(f"{name}: dtype {x.dtype} is not bfloat16 (ml_dtypes) or float16{hint}")
        t.kind, t.device = "numpy", None
        x = np.ascontiguousarray(x)
        t.ptr = x.ctypes.data
        t.nbytes = x.nbytes
    else:
        raise _invalid(f"{name}: {type(x).__name__} is not a numpy.ndarray or a torch.Tensor (or a list of them)")
    t.obj = x
    t.shape = tuple(int(n) for n in x.shape)
    if t.shape[0] < 1:
        raise _invalid(f"{name}: has no rows")
    return t


def _ids_of(p, lib):
    try:
        text = ctypes.string_at(p).decode()
    finally:
        lib.attnd_free_string(p)
    return text.split("\n") if text else []


# Async calls in flight: the C library hands back the key; the call object keeps its memory alive until then.
_call_ids = itertools.count(1)
_pending = {}
_pending_mu = threading.Lock()


def _complete(key, err_p, info_p):
    with _pending_mu:
        call = _pending.pop(key, None)
    if call is None:
        return
    err = err_p.contents
    if err.code != 0:
        call.future.set_exception(
            AttndError(err.code, err.message.decode(errors="replace"), err.request_id.decode(errors="replace")))
    else:
        call.future.set_result(call.ret())


@_lib.DONE_FN
def _on_done(user, err_p, info_p):
    try:
        _complete(user, err_p, info_p)
    except BaseException:  # an exception must not cross into the C library's thread
        pass
