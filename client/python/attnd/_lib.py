"""ctypes declarations of libattnd_client_c.so (client/c/attnd_client_c.h) and how the library is found.

The library lives in this package's lib/ folder (put there by the build's `attnd_python_lib` target, with the
libraries it needs beyond glibc and the C++ runtime, listed in lib/bundled.txt in load order). Those are loaded
by path first, dependencies before dependents, so a host without gRPC needs nothing installed. The test suite
points ATTND_CLIENT_LIB at a build tree's library instead (its dependencies then come from the system).
"""
import ctypes
import os
import struct

ABI_VERSION = 9

TRANSPORTS = {"auto": 0, "unary": 1, "stream": 2, "shm": 3}
TRANSPORT_NAMES = {v: k for k, v in TRANSPORTS.items()}
TRANSPORT_DEFAULT = -1  # per call: the client's
# enum attnd_dtype and enum attnd_mask of the C ABI, not the proto's numbers: the library maps them to those.
DTYPE_BF16, DTYPE_FP16, DTYPE_FP8_E4M3 = 0, 1, 2
KV_AS_DTYPE, KV_FP8_E4M3 = 0, 1  # enum attnd_kv_format
MASK_NONE, MASK_TOP_LEFT, MASK_BOTTOM_RIGHT = 0, 1, 2


class Error(ctypes.Structure):
    _fields_ = [("code", ctypes.c_int32), ("request_id", ctypes.c_char * 128), ("message", ctypes.c_char * 2048)]


class ClientOptions(ctypes.Structure):
    _fields_ = [
        ("target", ctypes.c_char_p),
        ("transport", ctypes.c_int32),
        ("tls_ca_file", ctypes.c_char_p),
        ("tls_server_name", ctypes.c_char_p),
        ("auth_token", ctypes.c_char_p),
        ("shm_socket", ctypes.c_char_p),
        ("default_timeout_s", ctypes.c_double),
        ("shm_max_bytes", ctypes.c_uint64),
        ("grpc_args", ctypes.POINTER(ctypes.c_char_p)),
        ("num_grpc_args", ctypes.c_int32),
        ("move_connections", ctypes.c_int32),
    ]


class Tensor(ctypes.Structure):
    _fields_ = [
        ("data", ctypes.c_void_p),
        ("buffer_id", ctypes.c_char_p),
        ("offset", ctypes.c_uint64),
        ("strides", ctypes.c_int64 * 3),
    ]


class ForwardArgs(ctypes.Structure):
    _fields_ = [
        ("batch", ctypes.c_int64),
        ("q_len", ctypes.c_int64),
        ("kv_len", ctypes.c_int64),
        ("q_heads", ctypes.c_int64),
        ("kv_heads", ctypes.c_int64),
        ("head_dim", ctypes.c_int64),
        ("dtype", ctypes.c_int32),
        ("mask", ctypes.c_int32),
        ("has_scale", ctypes.c_int32),
        ("scale", ctypes.c_float),
        ("want_lse", ctypes.c_int32),
        ("transport", ctypes.c_int32),
        ("timeout_s", ctypes.c_double),
        ("request_id", ctypes.c_char_p),
        ("q", Tensor),
        ("k", Tensor),
        ("v", Tensor),
        ("o", Tensor),
        ("lse", ctypes.c_void_p),
        ("q_descale", ctypes.c_void_p),
        ("k_descale", ctypes.c_void_p),
        ("v_descale", ctypes.c_void_p),
        ("q_descale_count", ctypes.c_int64),
        ("k_descale_count", ctypes.c_int64),
        ("v_descale_count", ctypes.c_int64),
    ]


class ForwardInfo(ctypes.Structure):
    _fields_ = [
        ("request_id", ctypes.c_char * 128),
        ("backend", ctypes.c_char * 16),
        ("kernel", ctypes.c_char * 128),
        ("device", ctypes.c_int32),
        ("transport", ctypes.c_int32),
        ("queue_us", ctypes.c_double),
        ("h2d_us", ctypes.c_double),
        ("kernel_us", ctypes.c_double),
        ("d2h_us", ctypes.c_double),
        ("total_us", ctypes.c_double),
        ("latency_us", ctypes.c_double),
    ]


class SequenceShape(ctypes.Structure):
    _fields_ = [
        ("layers", ctypes.c_int64),
        ("kv_heads", ctypes.c_int64),
        ("head_dim", ctypes.c_int64),
        ("dtype", ctypes.c_int32),
        ("kv_format", ctypes.c_int32),
        ("k_descale", ctypes.POINTER(ctypes.c_float)),
        ("v_descale", ctypes.POINTER(ctypes.c_float)),
        ("k_descale_count", ctypes.c_int64),
        ("v_descale_count", ctypes.c_int64),
    ]


class StepArgs(ctypes.Structure):
    _fields_ = [
        ("layer", ctypes.c_int64),
        ("q_heads", ctypes.c_int64),
        ("count", ctypes.c_int64),
        ("sequence_ids", ctypes.POINTER(ctypes.c_char_p)),
        ("tokens", ctypes.POINTER(ctypes.c_int64)),
        ("has_scale", ctypes.c_int32),
        ("scale", ctypes.c_float),
        ("want_lse", ctypes.c_int32),
        ("transport", ctypes.c_int32),
        ("timeout_s", ctypes.c_double),
        ("request_id", ctypes.c_char_p),
        ("q", ctypes.c_void_p),
        ("q_bytes", ctypes.c_uint64),
        ("k", ctypes.c_void_p),
        ("k_bytes", ctypes.c_uint64),
        ("v", ctypes.c_void_p),
        ("v_bytes", ctypes.c_uint64),
        ("o", ctypes.c_void_p),
        ("o_bytes", ctypes.c_uint64),
        ("lse", ctypes.c_void_p),
        ("lse_bytes", ctypes.c_uint64),
        ("lengths", ctypes.POINTER(ctypes.c_int64)),
    ]


class CudaStepArgs(ctypes.Structure):
    _fields_ = [
        ("layer", ctypes.c_int64),
        ("q_heads", ctypes.c_int64),
        ("tokens", ctypes.c_int64),
        ("has_scale", ctypes.c_int32),
        ("scale", ctypes.c_float),
        ("transport", ctypes.c_int32),
        ("timeout_s", ctypes.c_double),
        ("request_id", ctypes.c_char_p),
        ("stream", ctypes.c_uint64),
        ("q", ctypes.c_uint64),
        ("k", ctypes.c_uint64),
        ("v", ctypes.c_uint64),
        ("o", ctypes.c_uint64),
        ("q_bytes", ctypes.c_uint64),
        ("kv_bytes", ctypes.c_uint64),
        ("lengths", ctypes.POINTER(ctypes.c_int64)),
    ]


# ForwardArgs and StepArgs as struct formats, so that a call fills its argument struct with one pack_into (a
# ctypes field assignment each costs about as much as the whole pack). Pointers are packed as integers: whoever
# packs them keeps the objects they point into alive until the call is done. client/python/tests/test_layout.py
# checks every field's offset against the ctypes declarations above.
FORWARD_ARGS = struct.Struct("@6q3if2idP" + "PPQ3q" * 4 + "P" + "3P3q")
STEP_ARGS = struct.Struct("@3q2PifiidP" + "PQ" * 5 + "P")
CUDA_STEP_ARGS = struct.Struct("@3qifidP7QP")
assert FORWARD_ARGS.size == ctypes.sizeof(ForwardArgs) and STEP_ARGS.size == ctypes.sizeof(StepArgs)
assert CUDA_STEP_ARGS.size == ctypes.sizeof(CudaStepArgs)

_BY_ADDRESS = ctypes.CFUNCTYPE(ctypes.c_int32, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p)
_BY_ADDRESS3 = ctypes.CFUNCTYPE(ctypes.c_int32, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p)
DONE_FN = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.POINTER(Error), ctypes.POINTER(ForwardInfo))

_lib = None


def _package_lib_dir():
    return os.path.join(os.path.dirname(os.path.abspath(__file__)), "lib")


def load():
    """The loaded library (loaded once)."""
    global _lib
    if _lib is not None:
        return _lib
    path = os.environ.get("ATTND_CLIENT_LIB")  # tests: the build tree's library
    if not path:
        libdir = _package_lib_dir()
        path = os.path.join(libdir, "libattnd_client_c.so")
        if not os.path.exists(path):
            raise ImportError(
                f"attnd: {path} is missing; build the `attnd_python_lib` target (cmake --build build --target "
                "attnd_python_lib) before installing or importing this package")
        manifest = os.path.join(libdir, "bundled.txt")
        if os.path.exists(manifest):
            with open(manifest) as f:
                for name in f.read().split():
                    ctypes.CDLL(os.path.join(libdir, name))
    lib = ctypes.CDLL(path)
    lib.attnd_abi_version.restype = ctypes.c_int32
    if lib.attnd_abi_version() != ABI_VERSION:
        raise ImportError(f"attnd: {path} has C ABI {lib.attnd_abi_version()}, this package needs {ABI_VERSION}")
    lib.attnd_free_string.argtypes = [ctypes.c_void_p]
    lib.attnd_free_string.restype = None
    lib.attnd_client_create.argtypes = [ctypes.POINTER(ClientOptions), ctypes.POINTER(Error)]
    lib.attnd_client_create.restype = ctypes.c_void_p
    lib.attnd_client_destroy.argtypes = [ctypes.c_void_p]
    lib.attnd_client_destroy.restype = None
    lib.attnd_client_info_json.argtypes = [ctypes.c_void_p, ctypes.c_int32, ctypes.POINTER(Error)]
    lib.attnd_client_info_json.restype = ctypes.c_void_p
    lib.attnd_client_stats_json.argtypes = [ctypes.c_void_p, ctypes.POINTER(Error)]
    lib.attnd_client_stats_json.restype = ctypes.c_void_p
    lib.attnd_client_health.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.POINTER(Error)]
    lib.attnd_client_health.restype = ctypes.c_int32
    lib.attnd_forward.argtypes = [ctypes.c_void_p, ctypes.POINTER(ForwardArgs), ctypes.POINTER(ForwardInfo),
                                  ctypes.POINTER(Error)]
    lib.attnd_forward.restype = ctypes.c_int32
    # attnd_forward and attnd_step with every argument an address (int): the per-call path packs its structs
    # and passes their addresses, which ctypes converts in about half the time of byref() into POINTER types.
    lib.forward_at = _BY_ADDRESS(("attnd_forward", lib))
    lib.step_at = _BY_ADDRESS(("attnd_step", lib))
    lib.cuda_step_at = _BY_ADDRESS(("attnd_batch_step_cuda", lib))
    lib.cuda_submit_at = _BY_ADDRESS3(("attnd_batch_submit_cuda", lib))
    lib.attnd_cuda_sync.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.POINTER(Error)]
    lib.attnd_cuda_sync.restype = ctypes.c_int32
    lib.attnd_forward_async.argtypes = [ctypes.c_void_p, ctypes.POINTER(ForwardArgs), DONE_FN, ctypes.c_void_p,
                                        ctypes.POINTER(Error)]
    lib.attnd_forward_async.restype = ctypes.c_int32
    lib.attnd_register_cuda_buffer.argtypes = [
        ctypes.c_void_p, ctypes.c_char_p, ctypes.c_int32, ctypes.c_uint64, ctypes.c_uint64, ctypes.c_char_p,
        ctypes.c_char_p, ctypes.c_size_t, ctypes.POINTER(Error)]
    lib.attnd_register_cuda_buffer.restype = ctypes.c_int32
    lib.attnd_unregister_cuda_buffer.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.POINTER(Error)]
    lib.attnd_unregister_cuda_buffer.restype = ctypes.c_int32
    err_p = ctypes.POINTER(Error)
    lib.attnd_sequence_open.argtypes = [ctypes.c_void_p, ctypes.POINTER(SequenceShape), ctypes.c_int64,
                                        ctypes.c_uint32, ctypes.POINTER(ctypes.c_int64),
                                        ctypes.POINTER(ctypes.c_int32), err_p]
    lib.attnd_sequence_open.restype = ctypes.c_void_p
    lib.attnd_step.argtypes = [ctypes.c_void_p, ctypes.POINTER(StepArgs), ctypes.POINTER(ForwardInfo), err_p]
    lib.attnd_step.restype = ctypes.c_int32
    lib.attnd_sequence_fork.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_uint32, err_p]
    lib.attnd_sequence_fork.restype = ctypes.c_void_p
    lib.attnd_sequence_move.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_char_p, err_p]
    lib.attnd_sequence_move.restype = ctypes.c_void_p
    lib.attnd_sequence_move_path.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_int32,
                                             ctypes.POINTER(ctypes.c_int32), err_p]
    lib.attnd_sequence_move_path.restype = ctypes.c_void_p
    lib.attnd_sequence_current_id.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
    lib.attnd_sequence_current_id.restype = ctypes.c_void_p
    lib.attnd_client_moves_followed.argtypes = [ctypes.c_void_p]
    lib.attnd_client_moves_followed.restype = ctypes.c_uint64
    lib.attnd_sequence_truncate.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_int64,
                                            ctypes.POINTER(ctypes.c_int64), ctypes.c_size_t,
                                            ctypes.POINTER(ctypes.c_size_t), err_p]
    lib.attnd_sequence_truncate.restype = ctypes.c_int32
    lib.attnd_sequence_close.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_char_p), ctypes.c_size_t, err_p]
    lib.attnd_sequence_close.restype = ctypes.c_int32
    lib.attnd_batch_create.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_char_p), ctypes.c_int64,
                                       ctypes.c_int64, err_p]
    lib.attnd_batch_create.restype = ctypes.c_void_p
    lib.attnd_batch_destroy.argtypes = [ctypes.c_void_p]
    lib.attnd_batch_destroy.restype = None
    lib.attnd_cuda_stream_ordered.argtypes = [ctypes.c_void_p, err_p]
    lib.attnd_cuda_stream_ordered.restype = ctypes.c_int32
    lib.attnd_sequence_info_json.argtypes = [ctypes.c_void_p, ctypes.c_char_p, err_p]
    lib.attnd_sequence_info_json.restype = ctypes.c_void_p
    _lib = lib
    return lib
