"""attnd.Client and attnd.torch from torch CPU tensors; torch CUDA tensors over CUDA IPC where a GPU is."""
import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import attnd  # noqa: E402
import attnd.torch  # noqa: E402
from conftest import assert_close, assert_lse_close, reference  # noqa: E402


def f64(t):
    return t.detach().to("cpu", torch.float64).numpy()


def inputs(seed, b, lq, lk, hq, hkv, d, dtype=torch.bfloat16, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(s, generator=g).to(dtype).to(device)
                 for s in ((b, lq, hq, d), (b, lk, hkv, d), (b, lk, hkv, d)))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("causal,mask", [(False, "none"), (True, "top_left"), ("bottom_right", "bottom_right")])
def test_cpu_tensors(client, dtype, causal, mask):
    q, k, v = inputs(1, 2, 24, 40, 8, 2, 64, dtype)
    o, lse = client.attention(q, k, v, causal=causal, return_lse=True)
    assert isinstance(o, torch.Tensor) and o.dtype == dtype and o.shape == q.shape
    assert lse.dtype == torch.float32 and lse.shape == (2, 8, 24)
    ref_o, ref_lse = reference(f64(q), f64(k), f64(v), mask)
    assert_close(f64(o), ref_o, atol=2e-2 if dtype == torch.bfloat16 else 5e-3)
    assert_lse_close(lse.numpy(), ref_lse)


def test_transposed_views_and_out(client):
    # [b, h, l, d] tensors viewed as [b, l, h, d] go by strides.
    g = torch.Generator().manual_seed(2)
    qh = torch.randn(2, 4, 33, 128, generator=g).bfloat16()
    kh = torch.randn(2, 2, 17, 128, generator=g).bfloat16()
    vh = torch.randn(2, 2, 17, 128, generator=g).bfloat16()
    q, k, v = (x.transpose(1, 2) for x in (qh, kh, vh))
    assert not q.is_contiguous()
    out = torch.empty(2, 33, 4, 128, dtype=torch.bfloat16)
    o = client.attention(q, k, v, causal="bottom_right", out=out)
    assert o is out
    ref_o, _ = reference(f64(q), f64(k), f64(v), "bottom_right")
    assert_close(f64(out), ref_o)


def test_sdpa_drop_in(client):
    g = torch.Generator().manual_seed(3)
    q = torch.randn(2, 8, 21, 64, generator=g).bfloat16()
    k = torch.randn(2, 2, 21, 64, generator=g).bfloat16()
    v = torch.randn(2, 2, 21, 64, generator=g).bfloat16()
    o = attnd.torch.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True, client=client)
    assert o.shape == q.shape
    ref_o, _ = reference(f64(q.transpose(1, 2)), f64(k.transpose(1, 2)), f64(v.transpose(1, 2)), "top_left")
    assert_close(f64(o.transpose(1, 2)), ref_o)
    if hasattr(torch.nn.functional, "scaled_dot_product_attention") and "enable_gqa" in \
            torch.nn.functional.scaled_dot_product_attention.__doc__:
        t = torch.nn.functional.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=True,
                                                             enable_gqa=True)
        assert (o.float() - t).abs().max().item() < 2e-2
    with pytest.raises(ValueError):
        attnd.torch.scaled_dot_product_attention(q, k, v, client=client)  # GQA without enable_gqa


def test_default_client(client):
    q, k, v = (x.transpose(1, 2) for x in inputs(4, 1, 9, 9, 2, 2, 64))
    attnd.set_default_client(client)
    try:
        o = attnd.torch.scaled_dot_product_attention(q, k, v)
    finally:
        attnd.set_default_client(None)
    ref_o, _ = reference(f64(q.transpose(1, 2)), f64(k.transpose(1, 2)), f64(v.transpose(1, 2)), "none")
    assert_close(f64(o.transpose(1, 2)), ref_o)


def test_async_torch(client):
    calls = [inputs(10 + i, 1, 16, 16, 4, 4, 64) for i in range(4)]
    futures = [client.attention_async(q, k, v, causal=True) for q, k, v in calls]
    for f, (q, k, v) in zip(futures, calls):
        ref_o, _ = reference(f64(q), f64(k), f64(v), "top_left")
        assert_close(f64(f.result(timeout=60)), ref_o)


def test_mixed_kinds_rejected(client):
    q, k, v = inputs(5, 1, 8, 8, 2, 2, 64)
    with pytest.raises(attnd.AttndError) as e:
        client.attention(q, np.zeros((1, 8, 2, 64), np.float16), v)
    assert e.value.code == attnd.StatusCode.INVALID_ARGUMENT


# -- CUDA tensors over IPC: a CUDA-backend server of the same build on this host --------------------------------

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")


@pytest.fixture(scope="module")
def cuda_client(tmpdir_short):
    binary = os.environ.get("ATTND_SERVER")
    if not binary:
        pytest.skip("ATTND_SERVER is not set")
    from conftest import Server
    s = Server(["--backend=cuda", "--enable_cuda_ipc"], tmpdir_short, "cuda")
    c = attnd.Client("unix:" + s.unix, shm_socket=s.shm)
    if c.info()["backend"] != "cuda":
        c.close()
        s.stop()
        pytest.skip("the server has no CUDA backend")
    yield c, s
    c.close()
    s.stop()


@cuda
@pytest.mark.parametrize("transport", ["auto", "shm"])
def test_cuda_ipc(cuda_client, transport):
    c, s = cuda_client
    q, k, v = inputs(20, 2, 256, 256, 8, 2, 128, device="cuda")
    qt = q.transpose(1, 2).contiguous().transpose(1, 2)  # strided: goes by strides
    ref_o, ref_lse = reference(f64(q), f64(k), f64(v), "top_left")
    o = c.attention(qt, k, v, causal=True, transport=transport)
    assert o.is_cuda
    assert c.last_info.h2d_us == 0 and c.last_info.d2h_us == 0  # no copy on the IPC path
    assert_close(f64(o), ref_o)
    # LSE has no by-reference form in the API yet: it comes back inline (the server's one copy, d2h), O still by IPC.
    o, lse = c.attention(qt, k, v, causal=True, return_lse=True, transport=transport)
    assert o.is_cuda and lse.is_cuda
    assert c.last_info.h2d_us == 0
    assert_close(f64(o), ref_o)
    assert_lse_close(f64(lse), ref_lse)


@cuda
def test_cuda_registration_cache_and_release(cuda_client):
    c, s = cuda_client
    q, k, v = inputs(21, 1, 64, 64, 4, 4, 64, device="cuda")
    c.attention(q, k, v)
    n = len(c._buffers)
    c.attention(q, k, v)
    assert len(c._buffers) == n  # registered once per storage
    del q, k, v
    import gc
    gc.collect()
    c._sweep()  # where torch has no persistent storage objects, dead registrations go at the next sweep
    assert len(c._buffers) < n  # dropped with the storages


@cuda
def test_cuda_stream_respected(cuda_client):
    c, s = cuda_client
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        q, k, v = inputs(22, 1, 512, 512, 8, 8, 128, device="cuda")
        q = q * 1.0  # produced on `stream`
        o = c.attention(q, k, v)
    ref_o, _ = reference(f64(q), f64(k), f64(v), "none")
    assert_close(f64(o), ref_o)


class _FakeStorage:
    """What the registration path reads from a CUDA storage, for servers and hosts without CUDA."""

    def __init__(self, handle):
        self.handle = handle

    def data_ptr(self):
        return 0x7000

    def nbytes(self):
        return 4096

    def _share_cuda_(self):
        return (0, self.handle, 4096, 256, b"/torch_ref_counter", 8, None, False)


def test_ipc_registration_errors(client, monkeypatch):
    released = []
    monkeypatch.setattr(attnd.client, "_release_counter", released.append)
    # A CPU server refuses CUDA IPC: FAILED_PRECONDITION, and torch's IPC counter is released.
    with pytest.raises(attnd.AttndError) as e:
        client._register(_FakeStorage(b"\x01c" + bytes(range(64))), None, 0x7000)
    assert e.value.code == attnd.StatusCode.FAILED_PRECONDITION
    assert released == [(b"/torch_ref_counter", 8, 0)]
    # An expandable segment's handle cannot be opened with cudaIpcOpenMemHandle: refused before any RPC.
    with pytest.raises(attnd.AttndError) as e:
        client._register(_FakeStorage(b"\x01e" + bytes(100)), None, 0x7000)
    assert e.value.code == attnd.StatusCode.FAILED_PRECONDITION and "expandable" in e.value.message
    assert len(released) == 2 and not client._buffers


class _Storage:
    def __init__(self, base, nbytes):
        self.base, self.size = base, nbytes

    def data_ptr(self):
        return self.base

    def nbytes(self):
        return self.size


class _CudaView:
    """What the IPC path reads from a CUDA tensor: its storage, offset (elements of 2 bytes) and address."""

    def __init__(self, storage, offset):
        self.storage, self.offset = storage, offset
        self.device = "cuda:0"

    def storage_offset(self):
        return self.offset

    def element_size(self):
        return 2

    def data_ptr(self):
        return self.storage.base + 2 * self.offset

    def untyped_storage(self):
        return self.storage


def test_ipc_registration_found_by_address(client, monkeypatch):
    # The per-call lookup: a view anywhere inside a registered storage reuses its registration (offset in bytes);
    # a tensor reaching past the registered region (another storage at the same address) takes the storage's
    # own path, which replaces the registration.
    import weakref
    registered = []

    def fake_register(storage, device, key):
        reg = attnd.client._Registration()
        reg.buffer_id, reg.id_buf, reg.id_addr = b"b%d" % len(registered), None, 0
        reg.nbytes, reg.counter, reg.weak = storage.nbytes(), None, None
        reg.finalizer = weakref.finalize(storage, lambda: None)
        registered.append(storage)
        client._buffers[key] = reg
        return reg

    monkeypatch.setattr(client, "_register", fake_register)
    monkeypatch.setattr(attnd.client, "_release_counter", lambda counter: None)
    try:
        s1 = _Storage(0x10000, 4096)
        whole = (1, 16, 2, 64)  # 2048 elements: the whole storage
        reg, off = client._ref(_CudaView(s1, 0), whole, None)
        assert off == 0 and registered == [s1]
        assert client._ref(_CudaView(s1, 0), whole, None)[0] is reg
        half = (1, 8, 2, 64)
        assert client._ref(_CudaView(s1, 1024), half, None) == (reg, 2048) and registered == [s1]
        # [b, l, h, d] strides of a [b, h, l, d] tensor: the last element is still inside.
        assert client._ref(_CudaView(s1, 0), whole, (2048, 64, 1024))[0] is reg and registered == [s1]
        s2 = _Storage(0x10000, 8192)
        reg2, off = client._ref(_CudaView(s2, 0), (1, 32, 2, 64), None)
        assert registered[-1] is s2 and reg2.nbytes == 8192 and client._buffers[0x10000] is reg2
    finally:
        client._buffers.clear()  # nothing was registered with the server


def test_stream_cache_follows_the_current_stream(monkeypatch):
    # The producer's stream is synchronized through a cached Stream object per stream identity: a different
    # current stream gets its own (never the cached one of another stream).
    current = ["s1"]
    made, synced = [], []

    class FakeStream:
        def __init__(self, name):
            self.name = name

        def synchronize(self):
            synced.append(self.name)

    def current_stream(device):
        made.append(current[0])
        return FakeStream(current[0])

    monkeypatch.setattr(attnd.client, "_streams", {})
    monkeypatch.setattr(attnd.client, "_stream_key", lambda device: (current[0], device))
    monkeypatch.setattr(torch.cuda, "current_stream", current_stream)
    attnd.client._wait_for_producer(0)
    attnd.client._wait_for_producer(0)
    current[0] = "s2"
    attnd.client._wait_for_producer(0)
    attnd.client._wait_for_producer(1)
    assert synced == ["s1", "s1", "s2", "s2"] and made == ["s1", "s2", "s2"]


def test_ipc_call_arguments(client, monkeypatch):
    # The CUDA branch of attention() on CPU tensors dressed as CUDA ones: what reaches attnd_forward names each
    # tensor by its registration's buffer id, byte offset and strides (O contiguous), and no host pointer.
    import ctypes
    from attnd import _lib
    real_view, synced, seen = attnd.client._view, [], {}

    def cuda_view(name, x, hint):
        return ("cuda", *real_view(name, x, hint)[1:4], 0, 0, x)

    ids = {}

    def fake_ref(x, shape, strides):
        key = x.data_ptr() - 2 * x.storage_offset()
        if key not in ids:
            reg = attnd.client._Registration()
            reg.id_buf = ctypes.create_string_buffer(b"buf-%d" % len(ids))
            reg.id_addr = ctypes.addressof(reg.id_buf)
            ids[key] = reg
        return ids[key], 2 * x.storage_offset()

    def fake_forward(handle, args, info, err):
        a = _lib.ForwardArgs.from_address(args)
        seen.update(shape=(a.batch, a.q_len, a.kv_len, a.q_heads, a.kv_heads, a.head_dim), mask=a.mask,
                    tensors=[(t.data, t.buffer_id, t.offset, tuple(t.strides)) for t in (a.q, a.k, a.v, a.o)])
        ctypes.memset(err, 0, ctypes.sizeof(_lib.Error))
        return 0

    monkeypatch.setattr(attnd.client, "_view", cuda_view)
    monkeypatch.setattr(attnd.client, "_wait_for_producer", synced.append)
    monkeypatch.setattr(client, "_ref", fake_ref)
    monkeypatch.setattr(client, "_forward_at", fake_forward)
    kvh = torch.zeros(1, 2, 12, 64, dtype=torch.bfloat16)  # [b, h, l, d]: k, v as views at offsets of one storage
    q = torch.zeros(1, 5, 4, 64, dtype=torch.bfloat16)
    k = kvh.transpose(1, 2)
    v = torch.zeros(2, 1, 12, 2, 64, dtype=torch.bfloat16)[1]
    o = client.attention(q, k, v, causal="bottom_right")
    assert synced == [0] and o.shape == q.shape
    assert seen["shape"] == (1, 5, 12, 4, 2, 64) and seen["mask"] == _lib.MASK_BOTTOM_RIGHT
    tq, tk, tv, to = seen["tensors"]
    assert tq[0] is None and tq[1:] == (b"buf-0", 0, (5 * 4 * 64, 4 * 64, 64))
    assert tk[0] is None and tk[1:] == (b"buf-1", 0, (2 * 12 * 64, 64, 12 * 64))
    assert tv[0] is None and tv[1:] == (b"buf-2", 2 * 12 * 2 * 64, (12 * 2 * 64, 2 * 64, 64))
    assert to[0] is None and to[1:] == (b"buf-3", 0, (0, 0, 0))
