"""attnd.Client from NumPy against a CPU-backend server: masks, GQA, LSE, strides, transports, errors, async."""
import asyncio

import numpy as np
import pytest

import attnd
from conftest import (MAX_MESSAGE_BYTES, assert_close, assert_lse_close, bf16_bits_to_f64, random_bf16,
                      reference)

MASKS = [(False, "none"), ("top_left", "top_left"), (True, "top_left"), ("bottom_right", "bottom_right")]


def bf16_inputs(seed, b, lq, lk, hq, hkv, d):
    rng = np.random.default_rng(seed)
    return (random_bf16(rng, (b, lq, hq, d)), random_bf16(rng, (b, lk, hkv, d)), random_bf16(rng, (b, lk, hkv, d)))


def check(o, lse, q, k, v, mask, scale=None):
    ref_o, ref_lse = reference(bf16_bits_to_f64(q), bf16_bits_to_f64(k), bf16_bits_to_f64(v), mask, scale)
    assert_close(bf16_bits_to_f64(o), ref_o)
    if lse is not None:
        assert_lse_close(lse, ref_lse)


def test_info_stats_health(client):
    info = client.info()
    assert info["backend"] == "cpu"
    assert 64 in info["supported_head_dims"] and 128 in info["supported_head_dims"]
    assert "DTYPE_BF16" in info["supported_dtypes"]
    assert info["limits"]["max_message_bytes"] == MAX_MESSAGE_BYTES
    assert client.health() is True
    stats = client.stats()
    assert "uptime_s" in stats and "rpcs" in stats


@pytest.mark.parametrize("causal,mask", MASKS)
@pytest.mark.parametrize("lq,lk", [(37, 37), (20, 53), (53, 20)])
def test_masks_gqa_lse(client, causal, mask, lq, lk):
    q, k, v = bf16_inputs(1, 2, lq, lk, 4, 2, 64)
    o, lse = client.attention(q, k, v, causal=causal, return_lse=True, dtype="bf16")
    assert o.shape == q.shape and o.dtype == np.uint16 and lse.shape == (2, 4, lq) and lse.dtype == np.float32
    check(o, lse, q, k, v, mask)


def test_scale_and_mqa(client):
    q, k, v = bf16_inputs(2, 1, 16, 24, 8, 1, 128)
    o = client.attention(q, k, v, scale=0.05, dtype="bf16")
    check(o, None, q, k, v, "none", scale=0.05)


def test_fp16(client):
    rng = np.random.default_rng(3)
    q, k, v = (rng.standard_normal((1, 19, 2, 64)).astype(np.float16) for _ in range(3))
    o = client.attention(q, k, v, causal=True)
    assert o.dtype == np.float16
    ref, _ = reference(q.astype(np.float64), k.astype(np.float64), v.astype(np.float64), "top_left")
    assert_close(o, ref, atol=5e-3)


def test_ml_dtypes_bfloat16(client):
    ml_dtypes = pytest.importorskip("ml_dtypes")
    q, k, v = (x.view(ml_dtypes.bfloat16) for x in bf16_inputs(4, 1, 8, 8, 2, 2, 64))
    o = client.attention(q, k, v)
    assert o.dtype == ml_dtypes.bfloat16
    check(o.view(np.uint16), None, q.view(np.uint16), k.view(np.uint16), v.view(np.uint16), "none")


def test_strided_views(client):
    # [b, h, l, d] arrays viewed as [b, l, h, d]: sent by strides (the C library gathers them once).
    q, k, v = bf16_inputs(5, 2, 33, 41, 4, 2, 64)
    qt, kt, vt = (np.ascontiguousarray(x.transpose(0, 2, 1, 3)).transpose(0, 2, 1, 3) for x in (q, k, v))
    assert not qt.flags["C_CONTIGUOUS"]
    o = client.attention(qt, kt, vt, causal="bottom_right", dtype="bf16")
    check(o, None, q, k, v, "bottom_right")
    # Every other sequence row: a strided seq axis.
    q2, k2, v2 = bf16_inputs(6, 1, 40, 40, 2, 2, 64)
    o = client.attention(q2[:, ::2], k2[:, ::2], v2[:, ::2], dtype="bf16")
    check(o, None, np.ascontiguousarray(q2[:, ::2]), np.ascontiguousarray(k2[:, ::2]),
          np.ascontiguousarray(v2[:, ::2]), "none")


def test_out(client):
    q, k, v = bf16_inputs(7, 1, 12, 12, 2, 1, 64)
    out = np.zeros_like(q)
    o = client.attention(q, k, v, out=out, dtype="bf16")
    assert o is out
    check(out, None, q, k, v, "none")
    with pytest.raises(attnd.AttndError) as e:
        client.attention(q, k, v, out=np.zeros((1, 12, 2, 32), np.uint16), dtype="bf16")
    assert e.value.code == attnd.StatusCode.INVALID_ARGUMENT and "out" in e.value.message


@pytest.mark.parametrize("transport", ["unary", "stream", "shm"])
def test_transports(server, transport):
    q, k, v = bf16_inputs(8, 2, 30, 30, 4, 2, 64)
    with attnd.Client(server.target, transport=transport, shm_socket=server.shm) as c:
        o, lse = c.attention(q, k, v, causal=True, return_lse=True, dtype="bf16")
        assert c.last_info.transport == {"unary": 1, "stream": 2, "shm": 3}[transport]
        assert c.last_info.backend == b"cpu"
    check(o, lse, q, k, v, "top_left")


def test_unix_socket_target(server):
    q, k, v = bf16_inputs(9, 1, 10, 10, 2, 2, 64)
    with attnd.Client("unix:" + server.unix) as c:
        check(c.attention(q, k, v, dtype="bf16"), None, q, k, v, "none")


def test_over_message_limit_streams(client):
    # Q, K, V 1 MiB each: above the server's 1 MiB message limit, so auto picks the stream; unary refuses.
    q, k, v = bf16_inputs(10, 1, 2048, 2048, 4, 4, 64)
    o = client.attention(q, k, v, causal=True, dtype="bf16")
    assert client.last_info.transport == 2
    # The full float64 reference at 2k x 2k is slow: check a few query rows.
    rows = [0, 1, 777, 2047]
    for r in rows:  # top-left causal: row r sees keys 0..r
        ref_r, _ = reference(bf16_bits_to_f64(q[:, r:r + 1]), bf16_bits_to_f64(k[:, :r + 1]),
                             bf16_bits_to_f64(v[:, :r + 1]), "none")
        assert_close(bf16_bits_to_f64(o[:, r:r + 1]), ref_r)
    with pytest.raises(attnd.AttndError) as e:
        client.attention(q, k, v, dtype="bf16", transport="unary")
    assert e.value.code == attnd.StatusCode.RESOURCE_EXHAUSTED


def test_bad_input(client):
    q, k, v = bf16_inputs(11, 1, 8, 8, 2, 2, 48)
    with pytest.raises(attnd.AttndError) as e:
        client.attention(q, k, v, dtype="bf16")
    assert e.value.code == attnd.StatusCode.INVALID_ARGUMENT and "head_dim" in e.value.message
    assert e.value.request_id  # the library names every call

    q, k, v = bf16_inputs(12, 1, 8, 8, 3, 2, 64)
    with pytest.raises(attnd.AttndError) as e:
        client.attention(q, k, v, dtype="bf16")
    assert e.value.code == attnd.StatusCode.INVALID_ARGUMENT and "heads" in e.value.message

    q, k, v = bf16_inputs(13, 1, 8, 8, 2, 2, 64)
    with pytest.raises(attnd.AttndError) as e:
        client.attention(q, k, v[:, :4], dtype="bf16")
    assert e.value.code == attnd.StatusCode.INVALID_ARGUMENT and e.value.message.startswith("v:")
    with pytest.raises(attnd.AttndError) as e:
        client.attention(q.astype(np.float32), k, v)
    assert e.value.code == attnd.StatusCode.INVALID_ARGUMENT and e.value.message.startswith("q:")
    with pytest.raises(attnd.AttndError) as e:
        client.attention(q, k, v, dtype="bf16", causal="diagonal")
    assert "causal" in e.value.message
    with pytest.raises(attnd.AttndError) as e:
        client.attention(q, k, v, dtype="bf16", scale=float("inf"))
    assert e.value.code == attnd.StatusCode.INVALID_ARGUMENT and "scale" in e.value.message


def test_async_futures(client):
    inputs = [bf16_inputs(20 + i, 1, 16 + i, 24, 4, 2, 64) for i in range(8)]
    futures = [client.attention_async(q, k, v, causal="bottom_right", return_lse=True, dtype="bf16")
               for q, k, v in inputs]
    for f, (q, k, v) in zip(futures, inputs):
        o, lse = f.result(timeout=60)
        check(o, lse, q, k, v, "bottom_right")
    q, k, v = bf16_inputs(30, 1, 8, 8, 2, 2, 48)
    with pytest.raises(attnd.AttndError) as e:
        client.attention_async(q, k, v, dtype="bf16").result(timeout=60)
    assert e.value.code == attnd.StatusCode.INVALID_ARGUMENT


def test_asyncio(client):
    inputs = [bf16_inputs(40 + i, 2, 12, 12, 2, 1, 64) for i in range(4)]

    async def run():
        return await asyncio.gather(*(asyncio.wrap_future(client.attention_async(q, k, v, dtype="bf16"))
                                      for q, k, v in inputs))

    for o, (q, k, v) in zip(asyncio.run(run()), inputs):
        check(o, None, q, k, v, "none")


def test_async_shm(server):
    inputs = [bf16_inputs(50 + i, 1, 20, 20, 2, 2, 64) for i in range(4)]
    with attnd.Client(server.target, transport="shm", shm_socket=server.shm) as c:
        futures = [c.attention_async(q, k, v, causal=True, dtype="bf16") for q, k, v in inputs]
        for f, (q, k, v) in zip(futures, inputs):
            check(f.result(timeout=60), None, q, k, v, "top_left")


def test_auth_and_tls(secure_server):
    s = secure_server
    q, k, v = bf16_inputs(60, 1, 8, 8, 2, 2, 64)
    # TLS on TCP with the token.
    with attnd.Client(s.target, tls=s.ca, tls_server_name="localhost", token=s.token) as c:
        check(c.attention(q, k, v, dtype="bf16"), None, q, k, v, "none")
    # The unix socket (plaintext) still needs the token: without it UNAUTHENTICATED, with a wrong one too.
    with attnd.Client("unix:" + s.unix) as c:
        with pytest.raises(attnd.AttndError) as e:
            c.attention(q, k, v, dtype="bf16")
        assert e.value.code == attnd.StatusCode.UNAUTHENTICATED
    with attnd.Client("unix:" + s.unix, token="wrong") as c:
        with pytest.raises(attnd.AttndError) as e:
            c.info()
        assert e.value.code in (attnd.StatusCode.UNAUTHENTICATED, attnd.StatusCode.PERMISSION_DENIED)
    with attnd.Client("unix:" + s.unix, token=s.token, transport="shm", shm_socket=s.shm) as c:
        check(c.attention(q, k, v, dtype="bf16"), None, q, k, v, "none")
    with attnd.Client("unix:" + s.unix, transport="shm", shm_socket=s.shm) as c:
        with pytest.raises(attnd.AttndError) as e:
            c.attention(q, k, v, dtype="bf16")
        assert e.value.code in (attnd.StatusCode.UNAUTHENTICATED, attnd.StatusCode.PERMISSION_DENIED)


def test_closed_client(server):
    c = attnd.Client(server.target)
    c.close()
    with pytest.raises(attnd.AttndError) as e:
        c.info()
    assert e.value.code == attnd.StatusCode.FAILED_PRECONDITION


def test_transport_unavailable():
    with attnd.Client("127.0.0.1:1", timeout=5) as c:
        with pytest.raises(attnd.AttndError) as e:
            c.health()
        assert e.value.code in (attnd.StatusCode.UNAVAILABLE, attnd.StatusCode.DEADLINE_EXCEEDED)


def test_read_only_inputs_and_out(client):
    q, k, v = bf16_inputs(20, 1, 9, 9, 2, 2, 64)
    for x in (q, k, v):
        x.setflags(write=False)
    check(client.attention(q, k, v, causal=True, dtype="bf16"), None, q, k, v, "top_left")
    with pytest.raises(attnd.AttndError) as e:
        client.attention(q, k, v, dtype="bf16", out=q)  # read-only: never written by the library
    assert e.value.code == attnd.StatusCode.INVALID_ARGUMENT and "out" in e.value.message


def test_grpc_args(server):
    q, k, v = bf16_inputs(21, 1, 33, 33, 2, 2, 64)
    # The channel takes the argument: a receive limit below the reply's size refuses the reply.
    with attnd.Client(server.target, transport="unary", grpc_args={"grpc.max_receive_message_length": 256}) as c:
        with pytest.raises(attnd.AttndError) as e:
            c.attention(q, k, v, dtype="bf16")
        assert e.value.code == attnd.StatusCode.RESOURCE_EXHAUSTED
    with attnd.Client(server.target, transport="unary", grpc_args=["grpc.http2.bdp_probe=0"]) as c:
        check(c.attention(q, k, v, dtype="bf16"), None, q, k, v, "none")
    for bad, field in ((["grpc.http2.bdp_probe"], "grpc_args"), ("grpc.http2.bdp_probe=0", "grpc_args"),
                       ([7], "grpc_args[0]")):
        with pytest.raises(attnd.AttndError) as e:
            attnd.Client(server.target, grpc_args=bad)
        assert e.value.code == attnd.StatusCode.INVALID_ARGUMENT and field in e.value.message, e.value.message
