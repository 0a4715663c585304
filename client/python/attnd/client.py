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
sends only the new rows. Their tensors are [T, heads, head_dim], the sequences' rows back to back. With torch CUDA
tensors and a server on this host with --enable_cuda_ipc a step sends references into the caller's memory (each
CUDA allocation registered once). Over the shared-memory channel (transport="shm") it is also ordered on the current
CUDA stream without a host wait: the server starts the step once the stream has passed the work queued before the
call, and the call returns after the step has run (docs/sequences.md, "Steps from CUDA memory"); elsewhere the stream
is synchronised first. batch() names a set of sequences once for steps whose host work does not grow with the batch.
"""
import concurrent.futures
import ctypes
import enum
import itertools
import json
import collections
import numbers
import re
import sys
import threading
import weakref

from . import _lib

_byref = ctypes.byref
_pack_forward = _lib.FORWARD_ARGS.pack_into
_pack_step = _lib.STEP_ARGS.pack_into
_pack_cuda_step = _lib.CUDA_STEP_ARGS.pack_into


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


def _grpc_args(grpc_args):
    """Client(grpc_args=...) as the C ABI's "name=value" strings (bytes)."""
    if grpc_args is None:
        return []
    if isinstance(grpc_args, str):
        raise _invalid("grpc_args: a mapping {name: value} or a list of \"name=value\" strings, not one string")
    items = grpc_args.items() if hasattr(grpc_args, "items") else None
    specs = [f"{k}={v}" for k, v in items] if items is not None else list(grpc_args)
    for i, spec in enumerate(specs):
        if not isinstance(spec, str):
            raise _invalid(f"grpc_args[{i}]: {spec!r} is not a \"name=value\" string")
    return [spec.encode() for spec in specs]


def _options(scale, transport, timeout):
    """The options ForwardArgs and StepArgs share: (has_scale, scale, transport, timeout_s)."""
    if transport is None:
        code = _lib.TRANSPORT_DEFAULT
    elif transport in _lib.TRANSPORTS:
        code = _lib.TRANSPORTS[transport]
    else:
        raise _invalid(f"transport: {transport!r} is not one of {', '.join(_lib.TRANSPORTS)}")
    # c_float: a finite double beyond fp32's range becomes inf (the server names the bad scale), as in a ctypes
    # field, where struct's 'f' would raise OverflowError.
    if scale is None:
        return 0, 0.0, code, float(timeout or 0)
    return 1, ctypes.c_float(float(scale)).value, code, float(timeout or 0)


# Per-call work is kept to what the call's arguments need (the Python layer's cost is measured against the C++
# tools' by client/python/bench/overhead.py): modules and types are looked up once, tensors are inspected with
# one attribute read per property, and the argument structs are filled by one pack_into each.

_numpy = None
_F16 = _U16 = _U8 = None


def _np():
    global _numpy, _F16, _U16, _U8
    if _numpy is None:
        import numpy
        _F16, _U16, _U8 = numpy.dtype(numpy.float16), numpy.dtype(numpy.uint16), numpy.dtype(numpy.uint8)
        _numpy = numpy
    return _numpy


def _torch():
    # A caller with torch tensors has imported torch; nobody else pays for importing it.
    return sys.modules.get("torch")


_Tensor = None
_TORCH_CODES = None


def _tensor_type():
    """torch.Tensor once torch is imported, else None."""
    global _Tensor, _TORCH_CODES
    if _Tensor is None:
        torch = _torch()
        if torch is None:
            return None
        _TORCH_CODES = {torch.bfloat16: _lib.DTYPE_BF16, torch.float16: _lib.DTYPE_FP16}
        if hasattr(torch, "float8_e4m3fn"):  # torch >= 2.1
            _TORCH_CODES[torch.float8_e4m3fn] = _lib.DTYPE_FP8_E4M3
        _Tensor = torch.Tensor
    return _Tensor


_BF16_UNSET = object()
_bf16 = _BF16_UNSET


_fp8 = None


def _bf16_numpy_dtype():
    """ml_dtypes.bfloat16 as a NumPy dtype, or None without ml_dtypes (probed once: a failed import is slow)."""
    global _bf16, _fp8
    if _bf16 is _BF16_UNSET:
        try:
            import ml_dtypes
            _bf16 = _np().dtype(ml_dtypes.bfloat16)
            _fp8 = _np().dtype(ml_dtypes.float8_e4m3fn)
        except (ImportError, AttributeError):
            _bf16 = None
    return _bf16


def _torch_code(name, x):
    code = _TORCH_CODES.get(x.dtype)
    if code is None:
        raise _invalid(f"{name}: dtype {x.dtype} is not torch.bfloat16, torch.float16 or torch.float8_e4m3fn")
    return code


def _np_code(name, dt, hint, hint_text):
    """The dtype code of a NumPy dtype: ml_dtypes.bfloat16, float16, ml_dtypes.float8_e4m3fn, uint16 bits with the
    dtype hint "bf16" or "fp16", or uint8 codes with the hint "fp8_e4m3"."""
    if (dt is _U8 or dt == _U8) and hint == "fp8_e4m3":
        return _lib.DTYPE_FP8_E4M3
    if dt is _U16 or dt == _U16:
        if hint == "bf16":
            return _lib.DTYPE_BF16
        if hint == "fp16":
            return _lib.DTYPE_FP16
        raise _invalid(f"{name}: dtype {dt} is not bfloat16 (ml_dtypes) or float16 ({hint_text})")
    if dt is _F16 or dt == _F16:
        return _lib.DTYPE_FP16
    bf16 = _bf16_numpy_dtype()
    if bf16 is not None and dt == bf16:
        return _lib.DTYPE_BF16
    if _fp8 is not None and dt == _fp8:
        return _lib.DTYPE_FP8_E4M3
    raise _invalid(f"{name}: dtype {dt} is not bfloat16 (ml_dtypes), float16 or float8_e4m3fn (ml_dtypes; uint8 "
                   "codes with dtype='fp8_e4m3')")


_addressof = ctypes.addressof
_char_at = ctypes.c_char.from_buffer


def _np_ptr(x):
    """The address of a NumPy array's first element. ndarray.ctypes.data costs about a microsecond; a ctypes view
    of the buffer a tenth of that, where the buffer can be had that way (C-contiguous, writable, not empty)."""
    f = x.flags
    if f.c_contiguous and f.writeable:
        try:
            return _addressof(_char_at(x))
        except (TypeError, ValueError, BufferError):
            pass
    return x.ctypes.data


def _check_np_out(out, shape, dtype):
    """`out` as a call's O into NumPy memory: an array of `shape` and `dtype`, contiguous and writable."""
    if not isinstance(out, _numpy.ndarray) or out.shape != shape or out.dtype != dtype:
        raise _invalid(f"out: must be a numpy array of shape {list(shape)} and dtype {dtype}")
    f = out.flags
    if not f.c_contiguous:
        raise _invalid("out: must be contiguous")
    if not f.writeable:
        raise _invalid("out: is read-only")


def _check_torch_out(out, shape, dtype, device):
    """`out` as a call's O into a torch tensor: of `shape` and `dtype` on `device`, contiguous."""
    if not isinstance(out, _Tensor) or out.shape != shape or out.dtype != dtype or out.device != device:
        raise _invalid(f"out: must be a {dtype} tensor of shape {list(shape)} on {device}")
    if not out.is_contiguous():
        raise _invalid("out: must be contiguous")


_NUMPY, _HOST_TORCH, _CUDA = "numpy", "torch", "cuda"
_DT_BF16, _DT_FP16, _DT_FP8 = _lib.DTYPE_BF16, _lib.DTYPE_FP16, _lib.DTYPE_FP8_E4M3
_MASK_NONE, _TRANSPORT_DEFAULT = _lib.MASK_NONE, _lib.TRANSPORT_DEFAULT
_QKV = ("q", "k", "v")


def _np_shape_code(name, x, ndim, dims, dtype_hint, hint_text):
    """A NumPy array's shape, which must have `ndim` dimensions (`dims` names them in the error), and its dtype
    code (hint_text: what _np_code says of uint16 without a dtype hint)."""
    shape = x.shape
    if len(shape) != ndim:
        raise _invalid(f"{name}: must have {ndim} dimensions{dims}, has {len(shape)}")
    dt = x.dtype
    if dt is _U16 and dtype_hint == "bf16":  # bf16 bits as uint16, the usual input: no _np_code call
        return shape, _DT_BF16
    return shape, _np_code(name, dt, dtype_hint, hint_text)


def _view(name, x, dtype_hint):
    """q, k or v as (kind, dtype code, shape, strides, pointer, CUDA device index, object). strides: in elements,
    the first three used (head_dim is made contiguous, by a copy where it is not); pointer: host memory (0 for
    CUDA); device index: -1 but for CUDA; object: what the call sends (keep it alive until the call is done)."""
    np = _numpy
    if np is not None and isinstance(x, np.ndarray):
        shape, code = _np_shape_code(name, x, 4, "", dtype_hint, "uint16 bf16 bits need dtype='bf16'")
        s, e = x.strides, x.itemsize
        if s[3] != e:
            x = np.ascontiguousarray(x)
            s = x.strides
        return _NUMPY, code, shape, (s[0] // e, s[1] // e, s[2] // e), _np_ptr(x), -1, x
    tensor_type = _Tensor if _Tensor is not None else _tensor_type()
    if tensor_type is not None and isinstance(x, tensor_type):
        shape = x.shape
        if len(shape) != 4:
            raise _invalid(f"{name}: must have 4 dimensions, has {len(shape)}")
        code = _TORCH_CODES.get(x.dtype)
        if code is None:
            code = _torch_code(name, x)
        strides = x.stride()
        if strides[3] != 1:
            x = x.contiguous()
            strides = x.stride()
        if x.is_cuda:
            return _CUDA, code, shape, strides, 0, x.get_device(), x
        return _HOST_TORCH, code, shape, strides, x.data_ptr(), -1, x
    if np is None and isinstance(x, _np().ndarray):
        return _view(name, x, dtype_hint)
    raise _invalid(f"{name}: {type(x).__name__} is not a numpy.ndarray or a torch.Tensor")


class _Registration:
    """A CUDA storage registered with the server: buffer_id (bytes), its NUL-terminated copy at id_addr (what
    an argument struct points to), the region's size, and what releases it."""
    __slots__ = ("buffer_id", "id_buf", "id_addr", "nbytes", "finalizer", "weak", "counter")

    def alive(self):
        return self.finalizer.alive if self.weak is None else not self.weak.expired()

    def detach(self):
        if self.finalizer is not None:
            self.finalizer.detach()


class _Call:
    """An async call until it completes: its argument struct, every object whose memory it names, its result."""
    __slots__ = ("args", "keep", "out", "lse", "lse_device", "future")

    def ret(self):
        if self.lse is None:
            return self.out
        return self.out, (self.lse.to(self.lse_device) if self.lse_device is not None else self.lse)


# The current stream's Stream object per stream identity (torch._C._cuda_getCurrentStream's answer, which
# torch.cuda.current_stream wraps in a new Stream on every call).
_streams = {}
_stream_key = None


def _wait_for_producer(device):
    """Waits for the caller's current stream on `device`: the server reads q, k, v from its own stream, so the
    kernels still queued there (the ones that produced them) must be done first."""
    global _stream_key
    key_of = _stream_key
    if key_of is None:
        key_of = _stream_key = getattr(_torch()._C, "_cuda_getCurrentStream", False)
    if not key_of:
        _torch().cuda.current_stream(device).synchronize()
        return
    key = key_of(device)
    stream = _streams.get(key)
    if stream is None:
        stream = _torch().cuda.current_stream(device)
        if len(_streams) >= 64:  # streams come from torch's pools, so few; external ones could be many
            _streams.clear()
        _streams[key] = stream
    stream.synchronize()


# The current stream's raw cudaStream_t per stream identity, for steps ordered on it.
_stream_handles = {}


def _current_stream_handle(device):
    global _stream_key
    key_of = _stream_key
    if key_of is None:
        key_of = _stream_key = getattr(_torch()._C, "_cuda_getCurrentStream", False)
    if not key_of:
        return _torch().cuda.current_stream(device).cuda_stream
    key = key_of(device)
    h = _stream_handles.get(key)
    if h is None:
        if len(_stream_handles) >= 64:
            _stream_handles.clear()
        h = _stream_handles[key] = _torch().cuda.current_stream(device).cuda_stream
    return h


class Client:
    """A connection to an attnd server. Thread-safe; close() (or a `with` block) releases it."""

    def __init__(self, target, transport="auto", tls=None, token=None, shm_socket=None, timeout=None,
                 tls_server_name=None, grpc_args=None, move_connections=None):
        """target: host:port, unix:/path, or a fleet: ipv4:host:port,host:port,... or dns:///name:port (calls
        spread round robin, sequences placed where there is room and followed to their server). transport:
        auto | unary | stream | shm (shm: Forward calls over the server's --shm_socket, given as shm_socket; the
        other RPCs still use target). tls: path of the PEM CA file the server's certificate chains to (the
        channel then speaks TLS). token: the bearer token of a server started with --auth_token_file. timeout:
        seconds per call (default 120). grpc_args: gRPC channel arguments applied after attnd's own settings, as
        a mapping {name: value} or strings "name=value" (gRPC's names: {"grpc.http2.bdp_probe": 0} keeps a bulk
        byte move's HTTP/2 window where attnd sets it, docs/transport.md). move_connections: connections of
        its own to each server that a move by bytes takes, up to 64 (None: 8; 0: moves share the other calls'
        connections), so that moves at once do not share one connection's thread and window (docs/sequences.md)."""
        self._lib = _lib.load()
        self.last_move_path = None  # "bytes" or "device": what carried the last move_sequence's rows
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
        specs = _grpc_args(grpc_args)
        opts.grpc_args = (ctypes.c_char_p * max(1, len(specs)))(*specs)
        opts.num_grpc_args = len(specs)
        if move_connections is not None and (isinstance(move_connections, bool) or
                                             not isinstance(move_connections, int) or move_connections < 0):
            raise _invalid(f"move_connections: {move_connections!r} is not an int from 0 to 64")
        # The ABI's 0 is its default and a negative value no connections of their own.
        opts.move_connections = 0 if move_connections is None else -1 if move_connections == 0 else move_connections
        err = _lib.Error()
        handle = self._lib.attnd_client_create(ctypes.byref(opts), ctypes.byref(err))
        if not handle:
            _raise(err)
        self._handle = handle
        self._forward_at, self._step_at = self._lib.forward_at, self._lib.step_at
        self._errors = []
        self.transport = transport
        self._mu = threading.Lock()
        self._buffers = {}  # storage data_ptr -> _Registration
        self._cuda_steps = None  # CUDA steps by reference (the server takes IPC from this host); None: not asked yet
        self._batches = collections.OrderedDict()  # sequence ids -> StepBatch, for step() with CUDA tensors

    # -- lifetime ---------------------------------------------------------------------------------------------

    def close(self):
        """Unregisters this client's CUDA buffers, waits for its calls in flight, and closes it."""
        handle, self._handle = getattr(self, "_handle", None), None
        if not handle:
            return
        with self._mu:
            regs, self._buffers = list(self._buffers.values()), {}
            batches, self._batches = list(self._batches.values()), collections.OrderedDict()
        for b in batches:
            b._free()
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

    def _call_at(self, fn, args):
        """Calls a Forward or Step entry point (fn: the C function at its address, by address arguments) with the
        packed `args`; last_info takes its timing. Raises what the library reports."""
        info = _lib.ForwardInfo()
        err = self._error()
        if fn(self._handle or self._h(), _addressof(args), _addressof(info), _addressof(err)) != 0:
            _raise(err)
        self._errors.append(err)
        self.last_info = info

    def _error(self):
        # Error structs are reused (one is 2 KiB to clear): taken per call, given back after a success.
        try:
            return self._errors.pop()
        except IndexError:
            return _lib.Error()

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
                  transport=None, timeout=None, request_id=None, q_descale=None, k_descale=None, v_descale=None):
        """O = softmax(scale * Q K^T + mask) V, computed by the server.

        q [batch, q_len, q_heads, head_dim]; k, v [batch, kv_len, kv_heads, head_dim] (q_heads a multiple of
        kv_heads: GQA/MQA). NumPy arrays (ml_dtypes.bfloat16 or float16; uint16 bf16 bits with dtype="bf16"),
        torch CPU or CUDA tensors (bfloat16, float16); all three of one kind. causal: False, True or "top_left"
        (torch's is_causal), "bottom_right" (FlashAttention's). scale: None is 1/sqrt(head_dim).
        Returns O of q's kind (written into `out` when given: contiguous, q's shape and dtype), or (O, LSE) with
        return_lse, LSE fp32 [batch, q_heads, q_len]. transport overrides the client's for this call (not shm
        unless the client has a shm_socket).

        Float8 inputs: torch.float8_e4m3fn tensors, NumPy ml_dtypes.float8_e4m3fn arrays or uint8 codes with
        dtype="fp8_e4m3". Element x of head h is read as x * q_descale[h] (K and V likewise); each descale is a
        float, a list, or a 1-D array / tensor of 1 value or one per head (q_heads for q_descale, kv_heads for
        the others), finite and > 0, required with float8 and refused otherwise (AttndError INVALID_ARGUMENT
        naming the argument). O is then bfloat16 (torch.bfloat16; NumPy: ml_dtypes.bfloat16, else uint16 bits)."""
        a = _lib.ForwardArgs()
        # `keep` holds every object whose memory `a` names until the call returns.
        o, lse, lse_device, keep = self._fill_forward(a, q, k, v, causal, scale, return_lse, out, dtype, transport,
                                                      timeout, request_id, (q_descale, k_descale, v_descale))
        self._call_at(self._forward_at, a)
        if lse is None:
            return o
        return o, (lse.to(lse_device) if lse_device is not None else lse)

    def attention_async(self, q, k, v, causal=False, scale=None, return_lse=False, out=None, dtype=None,
                        transport=None, timeout=None, request_id=None, q_descale=None, k_descale=None,
                        v_descale=None):
        """attention() without waiting: a concurrent.futures.Future of its result (in asyncio:
        `await asyncio.wrap_future(client.attention_async(...))`). The inputs must not change until it is done."""
        call = _Call()
        call.args = a = _lib.ForwardArgs()
        call.out, call.lse, call.lse_device, call.keep = self._fill_forward(
            a, q, k, v, causal, scale, return_lse, out, dtype, transport, timeout, request_id,
            (q_descale, k_descale, v_descale))
        call.future = concurrent.futures.Future()
        call.future.set_running_or_notify_cancel()
        key = next(_call_ids)
        with _pending_mu:
            _pending[key] = call
        err = _lib.Error()
        rc = self._lib.attnd_forward_async(self._h(), _byref(a), _on_done, ctypes.c_void_p(key), _byref(err))
        if rc != 0:
            with _pending_mu:
                _pending.pop(key, None)
            _raise(err)
        return call.future

    def _fill_forward(self, a, q, k, v, causal, scale, return_lse, out, dtype, transport, timeout, request_id,
                      descales):
        """Checks a call's arguments and fills ForwardArgs `a`. Returns O (out, or a new one), the LSE (or None),
        the device the LSE goes to (CUDA callers; else None), and what `a` points into."""
        qk, code, qs, qst, qp, qdev, qx = _view("q", q, dtype)
        kk, kcode, ks, kst, kp, kdev, kx = _view("k", k, dtype)
        vk, vcode, vs, vst, vp, vdev, vx = _view("v", v, dtype)
        if not (qk == kk == vk):
            raise _invalid(f"k, v: must be of q's kind ({qk}), are {kk} and {vk}")
        if qk is _CUDA and not (qdev == kdev == vdev):
            raise _invalid(f"k, v: must be on q's device ({qx.device})")
        if not (code == kcode == vcode):
            raise _invalid("k, v: must have q's dtype")
        b, lq, hq, d = qs
        if ks != vs:
            raise _invalid(f"v: shape {list(vs)} differs from k's {list(ks)}")
        if ks[0] != b:
            raise _invalid(f"k: batch {ks[0]} differs from q's {b}")
        if ks[3] != d:
            raise _invalid(f"k: head_dim {ks[3]} differs from q's {d}")
        lk, hkv = ks[1], ks[2]
        if causal is False or causal is None:
            mask = _MASK_NONE
        else:
            mask = _mask(causal)
        if scale is None and transport is None and timeout is None:
            has_scale, scale_f, tr, timeout_s = 0, 0.0, _TRANSPORT_DEFAULT, 0.0
        else:
            has_scale, scale_f, tr, timeout_s = _options(scale, transport, timeout)
        o = self._out(qk, qx, qs, out, code == _DT_FP8)
        # The descales as fp32 arrays the struct points at (sent as given: the server checks counts and values).
        d_arrays = []
        for name, x in zip(("q_descale", "k_descale", "v_descale"), descales):
            t = _descales(name, x)
            d_arrays.append((ctypes.c_float * len(t))(*t) if t else None)
        d_ptrs = [0 if x is None else _addressof(x) for x in d_arrays]
        d_counts = [0 if x is None else len(x) for x in d_arrays]
        lse = lse_device = None
        lse_ptr = want_lse = 0
        if return_lse:
            want_lse = 1
            # LSE comes back inline (host memory) on every transport; a CUDA caller gets it moved to its device.
            if qk is _NUMPY:
                lse = _numpy.empty((b, hq, lq), dtype=_numpy.float32)
                lse_ptr = _np_ptr(lse)
            else:
                torch = _torch()
                lse = torch.empty((b, hq, lq), dtype=torch.float32)
                lse_ptr = lse.data_ptr()
                if qk is _CUDA:
                    lse_device = qx.device
        if qk is _CUDA:
            _wait_for_producer(qdev)
            rq, q_off = self._ref(qx, qs, qst)
            rk, k_off = self._ref(kx, ks, kst)
            rv, v_off = self._ref(vx, vs, vst)
            ro, o_off = self._ref(o, qs, None)
            _pack_forward(a, 0, b, lq, lk, hq, hkv, d, code, mask, has_scale, scale_f, want_lse, tr, timeout_s,
                          0, 0, rq.id_addr, q_off, qst[0], qst[1], qst[2], 0, rk.id_addr, k_off, kst[0], kst[1], kst[2],
                          0, rv.id_addr, v_off, vst[0], vst[1], vst[2], 0, ro.id_addr, o_off, 0, 0, 0, lse_ptr,
                          *d_ptrs, *d_counts)
            keep = (qx, kx, vx, o, lse, rq, rk, rv, ro, d_arrays)
        else:
            op = _np_ptr(o) if qk is _NUMPY else o.data_ptr()
            _pack_forward(a, 0, b, lq, lk, hq, hkv, d, code, mask, has_scale, scale_f, want_lse, tr, timeout_s,
                          0, qp, 0, 0, qst[0], qst[1], qst[2], kp, 0, 0, kst[0], kst[1], kst[2],
                          vp, 0, 0, vst[0], vst[1], vst[2], op, 0, 0, 0, 0, 0, lse_ptr, *d_ptrs, *d_counts)
            keep = (qx, kx, vx, o, lse, d_arrays)
        if request_id:
            a.request_id = request_id.encode()  # the struct keeps the bytes alive
        return o, lse, lse_device, keep

    @staticmethod
    def _out(kind, qx, shape, out, fp8):
        """O for the call: a new array/tensor like q, or `out` checked (q's shape, dtype and device; contiguous). For
        float8 inputs (`fp8`) O is bfloat16: ml_dtypes.bfloat16 in NumPy where installed, else its uint16 bits."""
        if kind is _NUMPY:
            dt = qx.dtype
            if fp8:  # a NumPy dtype is falsy (no fields): no `or` here
                dt = _bf16_numpy_dtype()
                dt = _U16 if dt is None else dt
            if out is None:
                return _numpy.empty(shape, dtype=dt)
            _check_np_out(out, shape, dt)
            return out
        dt = qx.dtype if not fp8 else _torch().bfloat16
        if out is None:
            return _torch().empty(shape, dtype=dt, device=qx.device)
        _check_torch_out(out, shape, dt, qx.device)
        return out

    # -- KV sequences (docs/sequences.md) ----------------------------------------------------------------------

    def open_sequence(self, layers, kv_heads, head_dim, dtype="bf16", max_tokens=0, count=None, kv_dtype=None,
                      k_descale=None, v_descale=None):
        """Opens KV sequences of one shape: a Sequence, or a list of `count` of them. dtype: "bf16" or "fp16", of
        q, O and the k/v rows steps send; max_tokens 0: the server's limit.

        kv_dtype: how the cache stores K and V. None or the dtype (its name, or torch.bfloat16 / torch.float16):
        as sent. torch.float8_e4m3fn or "fp8_e4m3": float8 e4m3 codes, half the bytes; an appended element x of kv
        head h at layer l is cached as the code nearest x / k_descale[l, h] (saturating at +-448) and every step
        attends over code * k_descale[l, h] (V likewise). The descales, required with float8 and refused without:
        each a float (every layer and head), or a list / array / tensor of `layers` values or layers x kv_heads
        values (a [layers, kv_heads] tensor, or flat layer-major), each finite and > 0 (docs/sequences.md, "Float8
        caches"). A kv_dtype or descale of another kind is a ValueError; counts and values the server refuses
        are AttndError INVALID_ARGUMENT naming shape.k_descale or shape.v_descale."""
        if dtype not in _SEQ_DTYPES:
            raise _invalid(f"dtype: {dtype!r} is not 'bf16' or 'fp16'")
        if count is not None and (not isinstance(count, int) or count < 1):
            raise _invalid(f"count: {count!r} is not a positive int")
        kv = _kv_dtype(kv_dtype, dtype)
        kd, vd = _descales("k_descale", k_descale), _descales("v_descale", v_descale)
        shape = SequenceShape(int(layers), int(kv_heads), int(head_dim), dtype, kv, kd, vd)
        cs = _lib.SequenceShape(shape.layers, shape.kv_heads, shape.head_dim, _SEQ_DTYPES[dtype],
                                _lib.KV_FP8_E4M3 if kv == _FP8 else _lib.KV_AS_DTYPE,
                                (ctypes.c_float * len(kd))(*kd) if kd else None,
                                (ctypes.c_float * len(vd))(*vd) if vd else None, len(kd), len(vd))
        got_max, page = ctypes.c_int64(0), ctypes.c_int32(0)
        err = _lib.Error()
        p = self._lib.attnd_sequence_open(self._h(), ctypes.byref(cs), int(max_tokens), count or 1,
                                          ctypes.byref(got_max), ctypes.byref(page), ctypes.byref(err))
        if not p:
            _raise(err)
        seqs = [Sequence(self, i, shape, got_max.value) for i in _ids_of(p, self._lib)]
        return seqs if count is not None else seqs[0]


    def step(self, layer, sequences, q=None, k=None, v=None, q_heads=None, return_lse=False, scale=None,
             tokens=None, dtype=None, transport=None, timeout=None, request_id=None, out=None):
        """One Step at `layer` for a batch of sequences (Sequence objects or ids): appends k, v as each sequence's
        new rows and runs attention for q's rows over everything cached, causal (the row at position p sees keys
        0..p). Either q (attend only) or k and v (append only) may be left out.

        q [T, q_heads, head_dim], k and v [T, kv_heads, head_dim]: NumPy arrays (ml_dtypes.bfloat16 or float16;
        uint16 bits take the sequences' dtype) or torch tensors (bfloat16, float16), the sequences' rows back to
        back, or a list of per-sequence tensors (concatenated; they give the tokens). tokens: rows per sequence, an
        int or a list; default: from the lists, else T split evenly. torch CUDA tensors (one tensor each, rows
        split evenly, no LSE) go by reference into their CUDA allocations, ordered on the current stream
        (StepBatch); otherwise, or with a server that takes no CUDA IPC, they are copied through host memory.
        Returns O (q's kind and dtype; None without q), or (O, LSE) with return_lse: LSE a list of fp32
        [q_heads, tokens] per sequence. out: O's destination (q's kind, dtype and device, [T, q_heads, head_dim],
        contiguous), returned as O. Each Sequence object's `lengths[layer]` is updated from the reply."""
        if isinstance(sequences, (Sequence, str)):
            sequences = (sequences,)
        elif not isinstance(sequences, (list, tuple)):
            sequences = list(sequences)
        n = len(sequences)
        if n == 0:
            raise _invalid("sequences: empty")
        if (not return_lse and _is_cuda_tensor(q if q is not None else k) and tokens is None
                and self._cuda_path()):
            ids = tuple(_seq_id(f"sequences[{i}]", s) for i, s in enumerate(sequences))
            batch = self._batch_for(ids, sequences)
            o = batch.step(layer, q, k, v, q_heads=q_heads, scale=scale, transport=transport, timeout=timeout,
                           request_id=request_id, out=out)
            layer = int(layer)
            for s, m in zip(sequences, batch._lengths):
                if isinstance(s, Sequence):
                    s.lengths[layer] = m
            return o
        if n == 1 and isinstance(sequences[0], Sequence):
            c_ids = sequences[0]._c_ids()
            if dtype is None:
                dtype = sequences[0].shape.dtype
        else:
            c_ids = (ctypes.c_char_p * n)(*[_seq_id(f"sequences[{i}]", s).encode() for i, s in enumerate(sequences)])
            if dtype is None:
                dtype = next((s.shape.dtype for s in sequences if isinstance(s, Sequence)), None)
        qt = _step_tensor("q", q, dtype) if q is not None else None
        kt = _step_tensor("k", k, dtype) if k is not None else None
        vt = _step_tensor("v", v, dtype) if v is not None else None
        if (kt is None) != (vt is None):
            raise _invalid("k, v: give both (append) or neither (attend only)")
        first = qt if qt is not None else kt
        if first is None:
            raise _invalid("q, k, v: none given")
        kind, code, (total, _, d) = first[0], first[1], first[2]
        if code == _DT_FP8:
            raise _invalid("q, k, v: float8 tensors are attention()'s; a step's are the sequence's dtype (a float8 "
                           "cache is open_sequence(kv_dtype=...))")
        rows = None
        for name, t in zip(_QKV, (qt, kt, vt)):
            if t is None:
                continue
            if t[0] != kind:
                raise _invalid(f"{name}: must be of the same kind as the others ({kind}), is {t[0]}")
            if t[1] != code:
                raise _invalid(f"{name}: dtype differs from the other tensors'")
            if t[2][0] != total:
                raise _invalid(f"{name}: {t[2][0]} rows, the other tensors have {total}")
            if t[2][2] != d:
                raise _invalid(f"{name}: head_dim {t[2][2]} differs from the other tensors' {d}")
            if rows is None:
                rows = t[6]
        if kt is not None and kt[2][1] != vt[2][1]:
            raise _invalid(f"v: {vt[2][1]} heads, k has {kt[2][1]}")
        if tokens is None and rows is None and n == 1:
            tokens = (total,)
        else:
            if tokens is None:
                if rows is not None:
                    tokens = rows
                elif total % n == 0:
                    tokens = [total // n] * n
                else:
                    raise _invalid(f"tokens: {total} rows do not split evenly over {n} sequences; give tokens=")
            elif isinstance(tokens, int):
                tokens = [tokens] * n
            tokens = [int(x) for x in tokens]
            if len(tokens) != n:
                raise _invalid(f"tokens: {len(tokens)} entries for {n} sequences")
            if sum(tokens) != total:
                raise _invalid(f"tokens: they sum to {sum(tokens)}, the tensors have {total} rows")
            for name, t in zip(_QKV, (qt, kt, vt)):
                if t is not None and t[6] is not None and t[6] != tokens:
                    raise _invalid(f"{name}: rows per sequence {t[6]} differ from tokens {tokens}")
        if n == 1:
            c_tokens, c_lengths = ctypes.c_int64(tokens[0]), ctypes.c_int64()
        else:
            c_tokens, c_lengths = (ctypes.c_int64 * n)(*tokens), (ctypes.c_int64 * n)()
        if scale is None and transport is None and timeout is None:
            has_scale, scale_f, tr, timeout_s = 0, 0.0, _TRANSPORT_DEFAULT, 0.0
        else:
            has_scale, scale_f, tr, timeout_s = _options(scale, transport, timeout)
        o = lse = o_host = None
        o_ptr = o_bytes = lse_ptr = lse_bytes = 0
        device = None
        if qt is not None:
            qh = qt[2][1]
            if q_heads is not None and int(q_heads) != qh:
                raise _invalid(f"q_heads: {q_heads} but q has {qh} heads")
            q_heads = qh
            device = qt[7]
            o, o_host = _step_out(kind, qt[5], (total, qh, d), device, out)
            o_ptr = _np_ptr(o_host) if kind is _NUMPY else o_host.data_ptr()
            o_bytes = qt[4]
        elif out is not None:
            raise _invalid("out: needs q")
        if return_lse:
            if qt is None:
                raise _invalid("return_lse: needs q")
            m = total * q_heads
            if kind is _NUMPY:
                lse = _numpy.empty(m, dtype=_numpy.float32)
                lse_ptr = _np_ptr(lse)
            else:
                torch = _torch()
                lse = torch.empty(m, dtype=torch.float32)
                lse_ptr = lse.data_ptr()
            lse_bytes = 4 * m
        a = _lib.StepArgs()
        _pack_step(a, 0, int(layer), int(q_heads or 0), n, _addressof(c_ids), _addressof(c_tokens), has_scale, scale_f,
                   1 if return_lse else 0, tr, timeout_s, 0,
                   qt[3] if qt is not None else 0, qt[4] if qt is not None else 0,
                   kt[3] if kt is not None else 0, kt[4] if kt is not None else 0,
                   vt[3] if vt is not None else 0, vt[4] if vt is not None else 0,
                   o_ptr, o_bytes, lse_ptr, lse_bytes, _addressof(c_lengths))
        if request_id:
            a.request_id = request_id.encode()  # the struct keeps the bytes alive
        # qt, kt, vt, o_host and lse hold the memory `a` names until the call returns.
        self._call_at(self._step_at, a)
        layer = int(layer)
        if n == 1:
            if isinstance(sequences[0], Sequence):
                sequences[0].lengths[layer] = c_lengths.value
        else:
            for s, m in zip(sequences, c_lengths):
                if isinstance(s, Sequence):
                    s.lengths[layer] = m
        if o is not o_host:  # q is on a device: O came back in host memory
            o = o_host.to(device) if o is None else o.copy_(o_host)
        if not return_lse:
            return o
        parts, at = [], 0
        for m in tokens:
            part = lse[at:at + m * q_heads].reshape(q_heads, m)
            parts.append(part.to(device) if device is not None else part)
            at += m * q_heads
        return o, parts


    def batch(self, sequences, tokens=None, wait=True):
        """A StepBatch of `sequences` (Sequence objects or ids): their ids are packed once, and its step() costs the
        same host work for 1 or 256 sequences. tokens: rows per sequence per step (default: T // len(sequences) of
        each step's tensors). wait=False: stream-ordered steps return before they run (StepBatch says how)."""
        if isinstance(sequences, (Sequence, str)):
            sequences = [sequences]
        return StepBatch(self, list(sequences), tokens, wait=wait)

    def _batch_for(self, ids, sequences):
        with self._mu:
            b = self._batches.get(ids)
            if b is not None:
                self._batches.move_to_end(ids)
                return b
        b = StepBatch(self, list(sequences), None)
        with self._mu:
            self._batches[ids] = b
            old = self._batches.popitem(last=False)[1] if len(self._batches) > 64 else None
        if old is not None:
            old._free()
        return b

    def _cuda_path(self):
        """Whether CUDA tensors can be stepped by reference: the server takes CUDA IPC (asked once)."""
        ok = self._cuda_steps
        if ok is None:
            try:
                ok = bool(self.info().get("cuda_ipc_enabled"))
            except AttndError:
                ok = False
            self._cuda_steps = ok
        return ok

    @property
    def stream_ordered(self):
        """True when CUDA steps are ordered on the caller's stream: the client's transport is "shm" and the server
        offers it (the library then never waits for the stream on the host); False when the library synchronises
        the stream before each step."""
        if self.transport != "shm" or not self._cuda_path():
            return False
        err = _lib.Error()
        rc = self._lib.attnd_cuda_stream_ordered(self._h(), ctypes.byref(err))
        if rc < 0:
            _raise(err)
        return rc == 1

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


    def move_sequence(self, sequence, to, path="auto"):
        """Moves `sequence` (a Sequence or an id) to the server at `to` (the address that server advertises after
        its ids' '@'): its cached K and V go there, the old one closes. Returns the new id; a Sequence object
        follows it (a StepBatch made before names the old id: make a new one). On failure the sequence stays where
        it was. `path`: "auto" (on the GPU when both servers share one, else bytes), "bytes" or "device";
        `last_move_path` then says which carried the rows ("bytes" or "device")."""
        if not isinstance(to, str) or not to:
            raise _invalid(f"to: {to!r} is not a server address")
        paths = ("auto", "bytes", "device")
        if path not in paths:
            raise _invalid(f"path: {path!r} is not one of {paths}")
        err = _lib.Error()
        used = ctypes.c_int32(0)
        p = self._lib.attnd_sequence_move_path(self._h(), _seq_id("sequence", sequence).encode(), to.encode(),
                                               paths.index(path), ctypes.byref(used), ctypes.byref(err))
        if not p:
            _raise(err)
        self.last_move_path = paths[used.value]
        moved = _ids_of(p, self._lib)[0]
        if isinstance(sequence, Sequence):
            sequence.id = moved
            sequence._batch = None
        return moved

    def move_sequences(self, sequences, to, path="auto", at_once=8):
        """Moves every one of `sequences` (Sequence objects or ids) to the server at `to`, `at_once` of them at a
        time (threads of this client; a same-GPU move spends most of its time in calls between the servers, which
        moves at once overlap). Returns the new ids in order; each Sequence object follows its move. When some fail,
        the others still move, and an AttndError (the first failure's code) names each failed `sequences[i]`; those
        stay where they were. `path` as move_sequence's."""
        if isinstance(sequences, (Sequence, str)):
            sequences = [sequences]
        sequences = list(sequences)
        if not isinstance(at_once, int) or isinstance(at_once, bool) or at_once < 1:
            raise _invalid(f"at_once: {at_once!r} is not an int >= 1")
        for i, s in enumerate(sequences):
            _seq_id(f"sequences[{i}]", s)
        if not sequences:
            return []

        def one(s):
            try:
                return self.move_sequence(s, to, path=path), None
            except AttndError as e:
                return None, e

        with concurrent.futures.ThreadPoolExecutor(min(at_once, len(sequences))) as pool:
            done = list(pool.map(one, sequences))
        failed = [(i, e) for i, (_, e) in enumerate(done) if e is not None]
        if failed:
            raise AttndError(failed[0][1].code, "; ".join(f"sequences[{i}]: {e}" for i, e in failed))
        return [moved for moved, _ in done]

    def _moves_followed(self):
        """Moves the C++ client has followed (a call about a moved sequence goes to its new id); see Sequence.id.
        0 once the client is closed: its Sequence objects keep the ids they had."""
        return self._lib.attnd_client_moves_followed(self._handle) if self._handle else 0

    def current_sequence_id(self, sequence_id):
        """The id `sequence_id` goes by now: itself, or the new id after its server moved it (a drain with
        --sequence_drain_to) and a call of this client followed the move."""
        return _ids_of(self._lib.attnd_sequence_current_id(self._h(), sequence_id.encode()), self._lib)[0]

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

    def _ref(self, x, shape, strides):
        """The registration covering CUDA tensor x (strides None: contiguous) and x's byte offset in it.

        The cache is keyed by the storage's address (x's address less its offset). A hit covers x when x's last
        byte is inside the registered region: an entry lives until its storage is freed (or, on older torch, the
        next sweep), and torch keeps the block out of reuse until the registration releases its IPC count, so
        the region's memory is this address's memory. Anything else takes the storage's own path."""
        so, e = x.storage_offset(), x.element_size()  # e: 2 (bf16, fp16) or 1 (float8)
        reg = self._buffers.get(x.data_ptr() - e * so)
        if strides is None:
            end = so + shape[0] * shape[1] * shape[2] * shape[3]
        else:
            end = so + (shape[0] - 1) * strides[0] + (shape[1] - 1) * strides[1] + (shape[2] - 1) * strides[2] + shape[3]
        if reg is None or e * end > reg.nbytes:
            storage = x.untyped_storage() if hasattr(x, "untyped_storage") else x.storage()
            reg = self._registration(storage, x.device)
        return reg, e * so

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
        reg.id_buf, reg.id_addr = buf, ctypes.addressof(buf)
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

# kv_dtype: the cache's element type, the dtype's name or "fp8_e4m3"; k_descale, v_descale: a float8 cache's
# descales as open_sequence sent them (a tuple of floats), empty otherwise.
SequenceShape = collections.namedtuple(
    "SequenceShape", ["layers", "kv_heads", "head_dim", "dtype", "kv_dtype", "k_descale", "v_descale"],
    defaults=(None, (), ()))
_SEQ_DTYPES = {"bf16": _lib.DTYPE_BF16, "fp16": _lib.DTYPE_FP16}
_FP8 = "fp8_e4m3"
# open_sequence's kv_dtype by name, and torch's dtypes by str() (no torch import for a caller without it).
_KV_DTYPES = {"bf16": "bf16", "fp16": "fp16", _FP8: _FP8, "float8_e4m3fn": _FP8, "torch.bfloat16": "bf16",
              "torch.float16": "fp16", "torch.float8_e4m3fn": _FP8}


def _kv_dtype(kv_dtype, dtype):
    """open_sequence's kv_dtype as the cache's element type: `dtype` itself or "fp8_e4m3"."""
    if kv_dtype is None:
        return dtype
    kv = _KV_DTYPES.get(kv_dtype if isinstance(kv_dtype, str) else str(kv_dtype))
    if kv not in (dtype, _FP8):
        raise ValueError(f"kv_dtype: {kv_dtype!r} is neither dtype ({dtype!r}) nor torch.float8_e4m3fn / 'fp8_e4m3'")
    return kv


def _descales(name, x):
    """A descale argument as a tuple of floats: () for None; a number; a list or tuple of numbers; a NumPy array
    or torch tensor (on any device), flattened row-major, so a [layers, kv_heads] one is layer-major. The server
    checks the count and the values."""
    if x is None:
        return ()
    if hasattr(x, "reshape") and hasattr(x, "tolist"):
        x = (x.detach() if hasattr(x, "detach") else x).reshape(-1).tolist()
    elif isinstance(x, numbers.Real):
        x = (x,)
    if not isinstance(x, (list, tuple)) or not all(isinstance(v, numbers.Real) and not isinstance(v, bool)
                                                   for v in x):
        raise ValueError(f"{name}: {x!r} is not a number, a list of numbers, an array or a tensor")
    return tuple(float(v) for v in x)


class Sequence:
    """A KV sequence on the server: `id`, `shape` (SequenceShape), `max_tokens` (the limit that applies) and
    `lengths` (its cached tokens per layer as this object last saw them: after its steps and truncations).
    A `with` block closes it."""

    def __init__(self, client, sequence_id, shape, max_tokens=0, lengths=None):
        self.client = client
        self._moves_seen = client._moves_followed()
        self.id = sequence_id
        self.shape = shape
        self.max_tokens = max_tokens
        self.lengths = list(lengths) if lengths is not None else [0] * shape.layers
        self.closed = False
        self._c_id = None
        self._batch = None  # a StepBatch of this sequence alone, for steps with CUDA tensors

    @property
    def id(self):
        """The sequence's id; once its server has moved it (a drain) and a call of the client followed the move,
        the new one."""
        seen = self.client._moves_followed()
        if seen != self._moves_seen and seen:
            self._moves_seen = seen
            self._id = self.client.current_sequence_id(self._id)
        return self._id

    @id.setter
    def id(self, value):
        self._id = value

    def _c_ids(self):
        """The id as a one-entry `const char* const*` for StepArgs, made once per id."""
        c = self._c_id
        if c is None or c[0] is not self.id:
            c = self._c_id = (self.id, (ctypes.c_char_p * 1)(_seq_id("sequences[0]", self).encode()))
        return c[1]

    def step(self, layer, q=None, k=None, v=None, return_lse=False, scale=None, q_heads=None, **kw):
        """client.step(layer, [self], ...): O [tokens, q_heads, head_dim], or (O, LSE [q_heads, tokens])."""
        if not return_lse and _is_cuda_tensor(q if q is not None else k) and self.client._cuda_path():
            b = self._batch
            if b is None:
                b = self._batch = StepBatch(self.client, [self], None)
            o = b.step(layer, q, k, v, q_heads=q_heads, scale=scale, **kw)
            self.lengths[int(layer)] = b._lengths[0]
            return o
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

    def move(self, to, path="auto"):
        """Moves this sequence to the server at `to` (client.move_sequence); `id` is the new one afterwards."""
        return self.client.move_sequence(self, to, path=path)

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


def _is_cuda_tensor(x):
    t = _Tensor if _Tensor is not None else _tensor_type()
    return t is not None and isinstance(x, t) and x.is_cuda


class StepBatch:
    """Sequences stepped together, layer after layer and step after step, with their ids packed once (the C
    library keeps the request's sequence list): a step costs the same host work for one sequence or 256.

    step(layer, q, k, v): q [T, q_heads, head_dim], k and v [T, kv_heads, head_dim] with T = sequences x tokens,
    sequence i's rows at [i * tokens, (i + 1) * tokens). torch CUDA tensors go by reference, ordered on the current
    stream (docs/sequences.md); NumPy arrays and CPU tensors go inline through Client.step. `lengths`
    holds each sequence's cached tokens at the last step's layer after that step (Sequence.lengths is left as it
    was: updating it is per-sequence work).

    wait=False (the batch's default, or per step): where steps are stream-ordered (Client.stream_ordered), step()
    returns once the step is queued, before it runs, and work queued afterwards on the current stream waits on the
    GPU until it has run; so the host queues the engine's next kernels while attnd attends. A step that fails has
    its O filled with NaN before the stream goes on, later steps submitted on that stream are not sent, and the
    error is raised by the next step() or synchronize() on the stream. `lengths` and `last_info` are not updated
    by such steps. Elsewhere wait=False steps run as wait=True ones."""

    def __init__(self, client, sequences, tokens=None, wait=True):
        if not sequences:
            raise _invalid("sequences: empty")
        self.client = client
        self.sequences = list(sequences)
        self.tokens = tokens
        ids = [_seq_id(f"sequences[{i}]", s).encode() for i, s in enumerate(self.sequences)]
        n = len(ids)
        err = _lib.Error()
        handle = client._lib.attnd_batch_create(client._h(), (ctypes.c_char_p * n)(*ids), n, int(tokens or 1),
                                                ctypes.byref(err))
        if not handle:
            _raise(err)
        self._handle = handle
        self._lib = client._lib
        self._n = n
        self._lengths = (ctypes.c_int64 * n)()
        self._lengths_addr = ctypes.addressof(self._lengths)
        self._step_at = client._lib.cuda_step_at
        self._args = _lib.CudaStepArgs()
        self._args_addr = ctypes.addressof(self._args)
        self._info = _lib.ForwardInfo()
        self._info_addr = ctypes.addressof(self._info)
        self._err = _lib.Error()
        self._err_addr = ctypes.addressof(self._err)
        self._mu = threading.Lock()  # the argument struct is reused: one call at a time
        self._submit_at = client._lib.cuda_submit_at
        self.wait = bool(wait)
        self._device = None  # of the last CUDA step: synchronize() waits for that device's current stream
        self.last_info = None

    def __len__(self):
        return self._n

    @property
    def lengths(self):
        return list(self._lengths)

    def _free(self):
        mu = getattr(self, "_mu", None)
        if mu is None:
            return
        with mu:  # a step of this batch in another thread finishes first
            h, self._handle = self._handle, None
        if h:
            self._lib.attnd_batch_destroy(h)

    def close(self):
        self._free()

    def __del__(self):
        try:
            self._free()
        except Exception:
            pass

    def synchronize(self):
        """Waits until every step submitted with wait=False on the current stream has run; raises the first failure
        not yet raised."""
        if self._device is None:
            return
        err = _lib.Error()
        if self._lib.attnd_cuda_sync(self.client._h(), _current_stream_handle(self._device), ctypes.byref(err)) != 0:
            _raise(err)

    def step(self, layer, q=None, k=None, v=None, out=None, tokens=None, q_heads=None, scale=None, transport=None,
             timeout=None, request_id=None, dtype=None, wait=None):
        """One step at `layer`; returns O [T, q_heads, head_dim] (in `out` when given: contiguous, q's shape, dtype
        and device), or None without q. dtype: for uint16 NumPy bits only, as in Client.step. wait: None for the
        batch's."""
        first = q if q is not None else k
        if first is None:
            raise _invalid("q, k, v: none given")
        if not _is_cuda_tensor(first) or not self.client._cuda_path():
            t = tokens or self.tokens
            if t is not None and first.shape[0] != t * self._n:
                raise _invalid(f"tokens: {first.shape[0]} rows, the batch steps {self._n} sequences x {t} tokens")
            return self.client.step(layer, self.sequences, q, k, v, q_heads=q_heads, scale=scale, tokens=t,
                                    transport=transport, timeout=timeout, request_id=request_id, out=out,
                                    dtype=dtype)
        rows = first.shape[0]
        t = tokens or self.tokens
        if t is None:
            if rows % self._n:
                raise _invalid(f"q: {rows} rows do not split evenly over {self._n} sequences; give tokens=")
            t = rows // self._n
        elif rows != t * self._n:
            raise _invalid(f"q: {rows} rows, the batch steps {self._n} sequences x {t} tokens")
        device = first.device
        qp = op = kp = vp = qb = kvb = 0
        qh = 0
        if q is not None:
            if q.dim() != 3:
                raise _invalid(f"q: must have 3 dimensions [tokens, heads, head_dim], has {q.dim()}")
            if not q.is_contiguous():
                q = q.contiguous()
            qh = q.shape[1]
            if q_heads is not None and int(q_heads) != qh:
                raise _invalid(f"q_heads: {q_heads} but q has {qh} heads")
            if out is None:
                out = _torch().empty(q.shape, dtype=q.dtype, device=device)
            elif (out.shape != q.shape or out.dtype != q.dtype or out.device != device
                  or not out.is_contiguous()):
                raise _invalid(f"out: must be a contiguous {q.dtype} tensor of shape {list(q.shape)} on {device}")
            qp, op = q.data_ptr(), out.data_ptr()
            _torch_code("q", q)
            qb = 2 * q.numel()
        elif out is not None:
            raise _invalid("out: needs q")
        if k is not None or v is not None:
            if k is None or v is None:
                raise _invalid("k, v: give both (append) or neither (attend only)")
            if not (_is_cuda_tensor(k) and _is_cuda_tensor(v)) or k.device != device or v.device != device:
                raise _invalid(f"k, v: must be CUDA tensors on {device} like q")
            if k.shape != v.shape or k.dim() != 3 or k.shape[0] != rows:
                raise _invalid(f"k, v: must both be [{rows}, kv_heads, head_dim], are {list(k.shape)} and "
                               f"{list(v.shape)}")
            if not k.is_contiguous():
                k = k.contiguous()
            if not v.is_contiguous():
                v = v.contiguous()
            kp, vp = k.data_ptr(), v.data_ptr()
            _torch_code("k", k)
            kvb = 2 * k.numel()
        if scale is None and transport is None and timeout is None:
            has_scale, scale_f, tr, timeout_s = 0, 0.0, _TRANSPORT_DEFAULT, 0.0
        else:
            has_scale, scale_f, tr, timeout_s = _options(scale, transport, timeout)
        index = first.get_device()
        stream = _current_stream_handle(index)
        submit = not (self.wait if wait is None else wait)
        with self._mu:
            if not self._handle:
                raise AttndError(StatusCode.FAILED_PRECONDITION, "batch: closed")
            a = self._args
            _pack_cuda_step(a, 0, int(layer), qh, t, has_scale, scale_f, tr, timeout_s, 0, stream, qp, kp, vp, op,
                            qb, kvb, self._lengths_addr)
            if request_id:
                a.request_id = request_id.encode()
            self._device = index
            if submit:
                # The step reads q, k, v and writes out in stream order: torch's allocator reuses their memory only
                # for work queued on this stream after it, which waits for the step.
                if self._submit_at(self._handle, self._args_addr, self._err_addr) != 0:
                    _raise(self._err)
                return out
            # q, k, v and out stay referenced by this frame until the call returns, which is after the step ran.
            if self._step_at(self._handle, self._args_addr, self._info_addr, self._err_addr) != 0:
                _raise(self._err)
            self.last_info = self._info
        return out

    def __repr__(self):
        return f"StepBatch({self._n} sequences)"


def _seq_id(name, s):
    if isinstance(s, Sequence):
        return s.id
    if isinstance(s, str) and s:
        return s
    raise _invalid(f"{name}: {s!r} is not a Sequence or a sequence id")


def _step_tensor(name, x, dtype_hint):
    """One of a step's q/k/v as contiguous host memory ([T, heads, head_dim]); a list is concatenated on T.
    Returns (kind, dtype code, shape, pointer, bytes, object, rows per list part or None, device or None): the
    device of a torch tensor that is not in host memory (which is copied to host memory)."""
    np = _numpy
    if np is not None and isinstance(x, np.ndarray):
        shape, code = _np_shape_code(name, x, 3, " [tokens, heads, head_dim]", dtype_hint,
                                     "uint16 bf16 bits need the sequence's dtype: a Sequence or dtype=")
        if not x.flags.c_contiguous:
            x = np.ascontiguousarray(x)
        if shape[0] < 1:
            raise _invalid(f"{name}: has no rows")
        return _NUMPY, code, shape, _np_ptr(x), x.nbytes, x, None, None
    tensor_type = _Tensor if _Tensor is not None else _tensor_type()
    if tensor_type is not None and isinstance(x, tensor_type):
        shape = x.shape
        if len(shape) != 3:
            raise _invalid(f"{name}: must have 3 dimensions [tokens, heads, head_dim], has {len(shape)}")
        code = _torch_code(name, x)
        device = x.device
        if device.type != "cpu":
            x = x.detach().cpu()
        else:
            device = None
        if not x.is_contiguous():
            x = x.contiguous()
        if shape[0] < 1:
            raise _invalid(f"{name}: has no rows")
        return _HOST_TORCH, code, shape, x.data_ptr(), 2 * x.numel(), x, None, device
    if isinstance(x, (list, tuple)):
        if not x:
            raise _invalid(f"{name}: an empty list")
        rows = []
        for i, part in enumerate(x):
            if getattr(part, "ndim", None) != 3:
                raise _invalid(f"{name}[{i}]: must be a tensor of 3 dimensions [tokens, heads, head_dim]")
            rows.append(int(part.shape[0]))
        if tensor_type is not None and all(isinstance(p, tensor_type) for p in x):
            if any(p.device != x[0].device for p in x):
                raise _invalid(f"{name}: the list's tensors must be on one device")
            joined = _torch().cat(list(x), dim=0)
        elif all(isinstance(p, _np().ndarray) for p in x):
            joined = _numpy.concatenate(x, axis=0)
        else:
            raise _invalid(f"{name}: a list must hold numpy arrays only or torch tensors only")
        t = _step_tensor(name, joined, dtype_hint)
        return t[:6] + (rows, t[7])
    if np is None and isinstance(x, _np().ndarray):
        return _step_tensor(name, x, dtype_hint)
    raise _invalid(f"{name}: {type(x).__name__} is not a numpy.ndarray or a torch.Tensor (or a list of them)")


def _step_out(kind, qx, shape, device, out):
    """A step's O: (what the call returns, or None where it is q's host copy moved to `device`; the host memory
    the library writes O into)."""
    if kind is _NUMPY:
        if out is None:
            o = _numpy.empty(shape, dtype=qx.dtype)
        else:
            _check_np_out(out, shape, qx.dtype)
            o = out
        return o, o
    torch = _torch()
    where = device if device is not None else qx.device
    if out is not None:
        _check_torch_out(out, shape, qx.dtype, where)
    if device is None:
        o = out if out is not None else torch.empty(shape, dtype=qx.dtype)
        return o, o
    return out, torch.empty(shape, dtype=qx.dtype)


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
