"""attnd.Client.attention with float8 e4m3 inputs against a CPU-backend server: NumPy uint8 codes (dtype="fp8_e4m3")
and torch.float8_e4m3fn tensors where torch has them, per-head descales in every accepted form, O in bf16, every
transport, and the refusals."""
import numpy as np
import pytest

import attnd
from conftest import assert_lse_close, bf16_bits_to_f64, fp8_e4m3, reference

# Every code's value: sign, 4 exponent bits (bias 7), 3 mantissa bits; S.1111.111 is NaN.
_CODES = np.arange(256)
_VALUES = np.where(((_CODES >> 3) & 0xF) == 0, (_CODES & 7) * 2.0 ** -9,
                   (8 + (_CODES & 7)) * 2.0 ** (((_CODES >> 3) & 0xF) - 10.0)) * np.where(_CODES & 0x80, -1.0, 1.0)
_VALUES[(_CODES & 0x7F) == 0x7F] = np.nan


def fp8_codes(x):
    """float32 values as e4m3 codes (uint8): attnd's rounding (conftest.fp8_e4m3), then the code of that value."""
    y = fp8_e4m3(x).astype(np.float64)
    codes = np.searchsorted(_VALUES[:127], np.abs(y))  # codes 0..126 hold the finite positive values, increasing
    assert np.array_equal(_VALUES[codes], np.abs(y))
    return (codes | np.where(np.signbit(y), 0x80, 0)).astype(np.uint8)


def per_head(descale, heads):
    return np.broadcast_to(np.asarray(descale, dtype=np.float32).reshape(-1), (heads,))


def quantized(rng, shape, descale, stddev=1.0):
    """N(0, stddev) values of [b, l, h, d] as codes of x / descale[h] (descale: one value or one per head)."""
    x = (rng.standard_normal(shape) * stddev).astype(np.float32)
    return fp8_codes(x / per_head(descale, shape[2])[None, None, :, None])


def dequantized(codes, descale):
    return _VALUES[codes] * per_head(descale, codes.shape[2]).astype(np.float64)[None, None, :, None]


def check(o, lse, q, k, v, qd, kd, vd, mask, scale=None):
    ref_o, ref_lse = reference(dequantized(q, qd), dequantized(k, kd), dequantized(v, vd), mask, scale)
    got = bf16_bits_to_f64(np.asarray(o).view(np.uint16))
    # O rounded once to bf16 from an fp32 accumulation: half a bf16 ulp plus a little.
    err = np.abs(got - ref_o)
    assert (err <= 2.0 ** -8 * np.abs(ref_o) + 1e-5 * np.abs(ref_o).max() + 1e-7).all(), err.max()
    if lse is not None:
        assert_lse_close(lse, ref_lse)


def inputs(seed, b, lq, lk, hq, hkv, d, qd=0.01, kd=0.01, vd=0.01, stddev=1.0):
    rng = np.random.default_rng(seed)
    return (quantized(rng, (b, lq, hq, d), qd, stddev), quantized(rng, (b, lk, hkv, d), kd, stddev),
            quantized(rng, (b, lk, hkv, d), vd))


def test_info_lists_float8(client):
    assert "DTYPE_FP8_E4M3" in client.info()["supported_dtypes"]


@pytest.mark.parametrize("causal,mask", [(False, "none"), (True, "top_left"), ("bottom_right", "bottom_right")])
@pytest.mark.parametrize("lq,lk,hq,hkv,d", [(17, 40, 4, 2, 128), (33, 20, 2, 1, 256), (1, 1, 1, 1, 128)])
def test_numpy_codes_match_float64(client, causal, mask, lq, lk, hq, hkv, d):
    qd, kd, vd = 0.012, [0.01 + 0.004 * h for h in range(hkv)], np.full(hkv, 0.02, np.float32)
    q, k, v = inputs(1, 2, lq, lk, hq, hkv, d, qd, kd, vd)
    o, lse = client.attention(q, k, v, causal=causal, return_lse=True, dtype="fp8_e4m3", q_descale=qd, k_descale=kd,
                              v_descale=vd)
    assert o.shape == q.shape and o.dtype.itemsize == 2  # bf16: ml_dtypes.bfloat16, else uint16 bits
    assert lse.shape == (2, hq, lq) and lse.dtype == np.float32
    check(o, lse, q, k, v, qd, kd, vd, mask)


def test_large_logits_and_per_head_descales(client):
    # Q and K with stddev 6: logits in the hundreds; one descale per q head, far apart.
    qd = [0.06 * (h + 1) for h in range(4)]
    q, k, v = inputs(2, 1, 40, 60, 4, 2, 128, qd, 0.06, 0.01, stddev=6.0)
    o, lse = client.attention(q, k, v, causal="bottom_right", return_lse=True, dtype="fp8_e4m3",
                              q_descale=np.asarray(qd, np.float32), k_descale=[0.06], v_descale=0.01)
    check(o, lse, q, k, v, qd, 0.06, 0.01, "bottom_right")


@pytest.mark.parametrize("transport", ["unary", "stream", "shm"])
def test_transports(server, transport):
    q, k, v = inputs(3, 2, 30, 30, 4, 2, 128)
    with attnd.Client(server.target, transport=transport, shm_socket=server.shm) as c:
        o = c.attention(q, k, v, causal=True, dtype="fp8_e4m3", q_descale=0.01, k_descale=0.01, v_descale=0.01)
        assert c.last_info.transport == {"unary": 1, "stream": 2, "shm": 3}[transport]
    check(o, None, q, k, v, 0.01, 0.01, 0.01, "top_left")


def test_over_message_limit_streams(client):
    # Q, K, V 1 MiB each at one byte an element (O 2 MiB): above the 1 MiB message limit, so auto streams.
    q, k, v = inputs(4, 1, 2048, 2048, 4, 4, 128)
    o = client.attention(q, k, v, dtype="fp8_e4m3", q_descale=0.01, k_descale=0.01, v_descale=0.01,
                         causal=True)
    assert client.last_info.transport == 2
    for r in (0, 999, 2047):
        check(o[:, r:r + 1], None, q[:, r:r + 1], k[:, :r + 1], v[:, :r + 1], 0.01, 0.01, 0.01, "none")


def test_async_and_out(client):
    q, k, v = inputs(5, 1, 12, 12, 2, 1, 128)
    d = dict(q_descale=0.01, k_descale=0.01, v_descale=0.01)
    out = np.zeros_like(client.attention(q, k, v, dtype="fp8_e4m3", **d))  # O's type: bf16
    o = client.attention_async(q, k, v, dtype="fp8_e4m3", out=out, **d).result(timeout=60)
    assert o is out
    check(o, None, q, k, v, 0.01, 0.01, 0.01, "none")
    with pytest.raises(attnd.AttndError) as e:  # an out of q's dtype is not O's
        client.attention(q, k, v, dtype="fp8_e4m3", out=np.zeros_like(q), **d)
    assert e.value.code == attnd.StatusCode.INVALID_ARGUMENT and "out" in e.value.message


def test_refusals_name_the_argument(client):
    q, k, v = inputs(6, 1, 8, 8, 2, 2, 128)
    d = dict(q_descale=0.01, k_descale=0.01, v_descale=0.01)
    for change, field in [(dict(k_descale=None), "k_descale: missing"), (dict(v_descale=0.0), "v_descale[0]"),
                          (dict(q_descale=[0.01] * 3), "q_descale: 3 values"),
                          (dict(k_descale=float("nan")), "k_descale[0]")]:
        with pytest.raises(attnd.AttndError) as e:
            client.attention(q, k, v, dtype="fp8_e4m3", **{**d, **change})
        assert e.value.code == attnd.StatusCode.INVALID_ARGUMENT and e.value.message.startswith(field), e.value
    bf16 = np.zeros((1, 8, 2, 128), np.uint16)
    with pytest.raises(attnd.AttndError) as e:
        client.attention(bf16, bf16, bf16, dtype="bf16", q_descale=0.5)
    assert e.value.message.startswith("q_descale: given for a bf16 request"), e.value
    with pytest.raises(ValueError, match="v_descale"):
        client.attention(q, k, v, dtype="fp8_e4m3", q_descale=0.01, k_descale=0.01, v_descale="big")
    with pytest.raises(attnd.AttndError) as e:  # uint8 without the float8 hint is no dtype attnd takes
        client.attention(q, k, v, q_descale=0.01, k_descale=0.01, v_descale=0.01)
    assert e.value.code == attnd.StatusCode.INVALID_ARGUMENT and "float8_e4m3fn" in e.value.message


def test_torch_float8(client):
    torch = pytest.importorskip("torch")
    if not hasattr(torch, "float8_e4m3fn"):
        pytest.skip("this torch has no float8_e4m3fn")
    q, k, v = inputs(7, 1, 20, 24, 4, 2, 128)
    tq, tk, tv = (torch.from_numpy(x).view(torch.float8_e4m3fn) for x in (q, k, v))
    o, lse = client.attention(tq, tk, tv, causal=True, return_lse=True, q_descale=torch.tensor([0.01]),
                              k_descale=0.01, v_descale=[0.01, 0.01])
    assert o.dtype == torch.bfloat16 and o.shape == tq.shape
    check(o.view(torch.int16).numpy().view(np.uint16), lse.numpy(), q, k, v, 0.01, 0.01, 0.01, "top_left")


def test_hadamard_rotation_is_orthogonal():
    torch = pytest.importorskip("torch")
    import attnd.torch as at
    for d in (64, 128, 256):
        r = at.hadamard_rotation(d, seed=3).double()
        assert torch.allclose(r @ r.T, torch.eye(d, dtype=torch.float64), atol=1e-6)
    with pytest.raises(ValueError):
        at.hadamard_rotation(96)


def test_quantize_fp8_with_a_rotation_keeps_qk(client):
    """quantize_fp8's codes and descales served as they are; Q and K rotated alike give the unrotated attention, and
    on outlier inputs (FlashAttention-3's setup) closer to it than without the rotation."""
    torch = pytest.importorskip("torch")
    if not hasattr(torch, "float8_e4m3fn"):
        pytest.skip("this torch has no float8_e4m3fn")
    import attnd.torch as at
    g = torch.Generator().manual_seed(5)

    def gen(h):
        x = torch.randn(1, 256, h, 128, generator=g)
        return x + torch.randn(x.shape, generator=g) * 10 * (torch.rand(x.shape, generator=g) < 0.001)

    q, k, v = gen(4), gen(2), gen(2)
    ref, _ = reference(q.double().numpy(), k.double().numpy(), v.double().numpy())
    errs = []
    for rotation in (None, at.hadamard_rotation(128, seed=1)):
        q8, qd = at.quantize_fp8(q, rotation)
        k8, kd = at.quantize_fp8(k, rotation)
        v8, vd = at.quantize_fp8(v)
        assert q8.dtype == torch.float8_e4m3fn and qd.shape == (4,) and vd.shape == (2,)
        o = client.attention(q8, k8, v8, q_descale=qd, k_descale=kd, v_descale=vd)
        errs.append(float(np.sqrt(np.mean((o.double().numpy() - ref) ** 2))))
    assert errs[1] < errs[0], errs
    assert errs[1] < 0.1 * float(np.sqrt(np.mean(ref ** 2))), errs  # P in e4m3: a few % of a mean-like O
