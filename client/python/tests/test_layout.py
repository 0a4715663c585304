"""The struct formats the per-call path packs ForwardArgs and StepArgs with match the ctypes declarations (and so
attnd_client_c.h) field by field: offset, size and kind. Needs neither the library nor a server."""
import ctypes
import re
import struct

import pytest

from attnd import _lib

_CODES = {ctypes.c_int64: "q", ctypes.c_uint64: "Q", ctypes.c_int32: "i", ctypes.c_float: "f", ctypes.c_double: "d",
          ctypes.c_void_p: "P", ctypes.c_char_p: "P"}


def _ctypes_fields(struct_type, base=0):
    """(offset, struct code) of every scalar in a ctypes Structure, nested structs and arrays flattened."""
    out = []
    for name, ftype in struct_type._fields_:
        offset = base + getattr(struct_type, name).offset
        if issubclass(ftype, ctypes.Structure):
            out += _ctypes_fields(ftype, offset)
        elif issubclass(ftype, ctypes.Array):
            out += [(offset + i * ctypes.sizeof(ftype._type_), _CODES[ftype._type_]) for i in range(ftype._length_)]
        elif issubclass(ftype, ctypes._Pointer):
            out.append((offset, "P"))
        else:
            out.append((offset, _CODES[ftype]))
    return out


def _format_fields(fmt):
    """(offset, code) of every item of a native-alignment struct format."""
    codes = [c for n, c in re.findall(r"(\d*)([a-zA-Z?])", fmt.lstrip("@")) for _ in range(int(n or 1))]
    return [(struct.calcsize("@" + "".join(codes[:i + 1])) - struct.calcsize(c), c) for i, c in enumerate(codes)]


@pytest.mark.parametrize("packed,declared", [(_lib.FORWARD_ARGS, _lib.ForwardArgs), (_lib.STEP_ARGS, _lib.StepArgs),
                                             (_lib.CUDA_STEP_ARGS, _lib.CudaStepArgs)])
def test_packed_layout_matches_the_declaration(packed, declared):
    assert _format_fields(packed.format) == _ctypes_fields(declared)
    assert packed.size == ctypes.sizeof(declared)


def test_packed_values_read_back():
    a = _lib.ForwardArgs()
    strides = [(11, 12, 13), (21, 22, 23), (31, 32, 33)]
    _lib.FORWARD_ARGS.pack_into(a, 0, 2, 3, 4, 8, 2, 64, _lib.DTYPE_FP16, _lib.MASK_BOTTOM_RIGHT, 1, 0.5, 1, 3, 7.5, 0,
                                0x1000, 0, 0, *strides[0], 0x2000, 0, 0, *strides[1], 0x3000, 0, 0, *strides[2],
                                0x4000, 0, 0, 0, 0, 0, 0x5000, 0x6000, 0x7000, 0x8000, 1, 8, 2)
    assert (a.batch, a.q_len, a.kv_len, a.q_heads, a.kv_heads, a.head_dim) == (2, 3, 4, 8, 2, 64)
    assert (a.dtype, a.mask, a.has_scale, a.scale, a.want_lse, a.transport, a.timeout_s) == (1, 2, 1, 0.5, 1, 3, 7.5)
    for t, ptr, st in ((a.q, 0x1000, strides[0]), (a.k, 0x2000, strides[1]), (a.v, 0x3000, strides[2])):
        assert t.data == ptr and tuple(t.strides) == st and t.offset == 0
    assert a.o.data == 0x4000 and tuple(a.o.strides) == (0, 0, 0) and a.lse == 0x5000
    assert (a.q_descale, a.k_descale, a.v_descale) == (0x6000, 0x7000, 0x8000)
    assert (a.q_descale_count, a.k_descale_count, a.v_descale_count) == (1, 8, 2)


def test_cuda_step_args_read_back():
    a = _lib.CudaStepArgs()
    _lib.CUDA_STEP_ARGS.pack_into(a, 0, 5, 32, 1, 1, 0.25, 3, 2.5, 0, 0x77, 0x1000, 0x2000, 0x3000, 0x4000, 4096, 1024,
                                  0x5000)
    assert (a.layer, a.q_heads, a.tokens, a.has_scale, a.scale, a.transport, a.timeout_s) == (5, 32, 1, 1, 0.25, 3, 2.5)
    assert (a.stream, a.q, a.k, a.v, a.o, a.q_bytes, a.kv_bytes) == (0x77, 0x1000, 0x2000, 0x3000, 0x4000, 4096, 1024)
    assert ctypes.cast(a.lengths, ctypes.c_void_p).value == 0x5000
