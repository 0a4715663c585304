"""KV sequences with float8 e4m3 caches from Python (open_sequence's kv_dtype, k_descale, v_descale) against a
CPU-backend server: every step checked against float64 attention over the history as the cache holds it (each row
quantized with its layer's and kv head's descale, as attnd does), the descales' forms, and the refusals."""
import math

import numpy as np
import pytest

import attnd
from conftest import (assert_close, assert_lse_close, bf16_bits_to_f64, fp8_cached_bf16, fp8_e4m3, random_bf16,
                      reference)

LAYERS, KV_HEADS, Q_HEADS, HEAD_DIM = 2, 2, 4, 64
# Per layer and kv head (layer-major), down to 1/256, where rows of |x| >= 1.75 saturate at 448 x 1/256.
K_DESCALE = [1 / 64, 1 / 256, 0.5, 1 / 32]
V_DESCALE = [1 / 256, 1 / 16]  # per layer


def per_head(descale):
    """Descales in any of their forms as [layers, kv_heads] float32, as the server expands them."""
    d = np.asarray(descale, np.float32).reshape(-1)
    return np.broadcast_to(d.reshape(LAYERS, -1) if d.size > 1 else d, (LAYERS, KV_HEADS))


class Fp8History:
    """One float8 sequence's K and V per layer as the cache gives them back (float64), and a step's reference."""

    def __init__(self, k_descale, v_descale):
        self.k_descale, self.v_descale = per_head(k_descale), per_head(v_descale)
        self.k = [np.zeros((0, KV_HEADS, HEAD_DIM)) for _ in range(LAYERS)]
        self.v = [np.zeros((0, KV_HEADS, HEAD_DIM)) for _ in range(LAYERS)]

    def append(self, layer, k_bits, v_bits):
        self.k[layer] = np.concatenate([self.k[layer], fp8_cached_bf16(k_bits, self.k_descale[layer])])
        self.v[layer] = np.concatenate([self.v[layer], fp8_cached_bf16(v_bits, self.v_descale[layer])])

    def expect(self, layer, q):
        o, lse = reference(q[None], self.k[layer][None], self.v[layer][None], "bottom_right")
        return o[0], lse[0]


@pytest.fixture
def fp8_seq(client):
    opened = []

    def make(**kw):
        args = dict(layers=LAYERS, kv_heads=KV_HEADS, head_dim=HEAD_DIM, kv_dtype="fp8_e4m3", k_descale=K_DESCALE,
                    v_descale=V_DESCALE)
        args.update(kw)
        s = client.open_sequence(**args)
        opened.append(s)
        return s

    yield make
    for s in opened:
        s.close()


def test_quantizer_mirrors_attnd():
    # Every e4m3 value maps to itself, midpoints tie to the even code, and beyond 448 saturates (NaN stays NaN).
    codes = [(c >> 3 & 15, c & 7) for c in range(128) if c != 127]
    values = np.array([m * 2.0 ** -9 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7) for e, m in codes], np.float32)
    assert np.array_equal(fp8_e4m3(values), values) and np.array_equal(fp8_e4m3(-values), -values)
    assert fp8_e4m3(np.float32([1.0625, 1.1875, 2.0 ** -10, 3 * 2.0 ** -10])).tolist() == [1.0, 1.25, 0.0, 2.0 ** -8]
    assert fp8_e4m3(np.float32([464, 1e30, np.inf, -np.inf])).tolist() == [448, 448, 448, -448]
    assert np.isnan(fp8_e4m3(np.float32([np.nan]))[0])


def test_steps_see_the_quantized_history(client, fp8_seq):
    rng = np.random.default_rng(11)
    seq = fp8_seq()
    assert seq.shape.kv_dtype == "fp8_e4m3" and seq.shape.dtype == "bf16"
    assert seq.shape.k_descale == tuple(K_DESCALE) and seq.shape.v_descale == tuple(V_DESCALE)
    hist = Fp8History(K_DESCALE, V_DESCALE)
    for n in (8, 1, 1, 3):
        for layer in range(LAYERS):
            q, k, v = random_bf16(rng, (n, Q_HEADS, HEAD_DIM)), *(random_bf16(rng, (n, KV_HEADS, HEAD_DIM))
                                                                  for _ in range(2))
            o, lse = seq.step(layer, q, k, v, return_lse=True)
            if n == 8:
                # The first query sees one key: its O is that key's V as cached, far from V as sent.
                raw = reference(bf16_bits_to_f64(q)[None], bf16_bits_to_f64(k)[None], bf16_bits_to_f64(v)[None],
                                "bottom_right")[0][0]
                assert np.abs(bf16_bits_to_f64(o) - raw).max() > 0.05
            hist.append(layer, k, v)
            ref_o, ref_lse = hist.expect(layer, bf16_bits_to_f64(q))
            assert_close(bf16_bits_to_f64(o), ref_o)
            assert_lse_close(lse, ref_lse)
    info = seq.info()
    assert info["lengths"] == [13, 13]
    shape = info["shape"]
    assert shape["kv_dtype"] == "DTYPE_FP8_E4M3"
    assert np.allclose(shape["k_descale"], K_DESCALE) and np.allclose(shape["v_descale"], [1 / 256] * 2 + [1 / 16] * 2)


@pytest.mark.parametrize("k_descale,v_descale", [
    (0.125, np.float32(1 / 64)),                                      # one for all: a float, a NumPy scalar
    ((0.25, 0.125), np.array([1 / 32, 1 / 16], np.float32)),          # per layer
    (np.array([[0.25, 0.5], [1 / 64, 1 / 8]]), [1 / 16, 1 / 32, 1 / 64, 1 / 128]),  # [layers, kv_heads], flat
])
def test_descale_forms(client, fp8_seq, k_descale, v_descale):
    rng = np.random.default_rng(12)
    seq = fp8_seq(k_descale=k_descale, v_descale=v_descale)
    hist = Fp8History(k_descale, v_descale)
    for n in (5, 1):
        for layer in range(LAYERS):
            q, k, v = random_bf16(rng, (n, Q_HEADS, HEAD_DIM)), *(random_bf16(rng, (n, KV_HEADS, HEAD_DIM))
                                                                  for _ in range(2))
            o = seq.step(layer, q, k, v)
            hist.append(layer, k, v)
            assert_close(bf16_bits_to_f64(o), hist.expect(layer, bf16_bits_to_f64(q))[0])
    got = seq.info()["shape"]
    assert np.allclose(got["k_descale"], hist.k_descale.reshape(-1))
    assert np.allclose(got["v_descale"], hist.v_descale.reshape(-1))


def test_bad_descales_are_the_servers_invalid_argument(client, fp8_seq):
    inv = attnd.StatusCode.INVALID_ARGUMENT
    for kw, field in [(dict(k_descale=None), "shape.k_descale"),
                      (dict(v_descale=[1.0, 1.0, 1.0]), "shape.v_descale"),
                      (dict(k_descale=[1.0, 0.0]), "shape.k_descale[1]"),
                      (dict(v_descale=-1.0), "shape.v_descale[0]"),
                      (dict(k_descale=math.nan), "shape.k_descale[0]"),
                      (dict(v_descale=math.inf), "shape.v_descale[0]"),
                      (dict(kv_dtype=None), "shape.k_descale"),  # descales for a 16-bit cache
                      (dict(kv_dtype="bf16", k_descale=None), "shape.v_descale")]:
        with pytest.raises(attnd.AttndError) as e:
            fp8_seq(**kw)
        assert e.value.code == inv and e.value.message.startswith(field), (kw, e.value)


def test_bad_arguments_are_value_errors(client):
    for kw, name in [(dict(kv_dtype="int8"), "kv_dtype"), (dict(kv_dtype="fp16"), "kv_dtype"),
                     (dict(kv_dtype=np.float32), "kv_dtype"), (dict(k_descale="1/64"), "k_descale"),
                     (dict(k_descale=[[1.0, 2.0]]), "k_descale"), (dict(v_descale=True), "v_descale"),
                     (dict(v_descale={1.0}), "v_descale")]:
        args = dict(kv_dtype="fp8_e4m3", k_descale=1.0, v_descale=1.0)
        args.update(kw)
        with pytest.raises(ValueError, match=f"^{name}: "):
            client.open_sequence(LAYERS, KV_HEADS, HEAD_DIM, **args)


def test_torch_dtypes(client, fp8_seq):
    torch = pytest.importorskip("torch")
    with pytest.raises(ValueError, match="^kv_dtype: "):
        fp8_seq(kv_dtype=torch.float32)
    with pytest.raises(ValueError, match="^kv_dtype: "):
        fp8_seq(kv_dtype=torch.float16, k_descale=None, v_descale=None)
    with client.open_sequence(LAYERS, KV_HEADS, HEAD_DIM, kv_dtype=torch.bfloat16) as plain:
        assert plain.shape.kv_dtype == "bf16"
    # Descales as tensors: [layers, kv_heads] is layer-major.
    seq = fp8_seq(k_descale=torch.tensor(K_DESCALE).reshape(LAYERS, KV_HEADS), v_descale=torch.tensor(V_DESCALE))
    assert seq.shape.k_descale == tuple(K_DESCALE) and np.allclose(seq.info()["shape"]["k_descale"], K_DESCALE)


def test_torch_float8_tensors_and_reference(client, fp8_seq):
    torch = pytest.importorskip("torch")
    if not hasattr(torch, "float8_e4m3fn"):
        pytest.skip(f"torch {torch.__version__} has no float8_e4m3fn")
    k_descale = torch.tensor(K_DESCALE).reshape(LAYERS, KV_HEADS)
    seq = fp8_seq(kv_dtype=torch.float8_e4m3fn, k_descale=k_descale, v_descale=torch.tensor(V_DESCALE))
    assert seq.shape.kv_dtype == "fp8_e4m3" and seq.shape.k_descale == tuple(K_DESCALE)
    g = torch.Generator().manual_seed(13)
    hist = [[torch.zeros((0, KV_HEADS, HEAD_DIM), dtype=torch.float64)] * 2 for _ in range(LAYERS)]
    for n in (6, 1, 1):
        for layer in range(LAYERS):
            q = torch.randn((n, Q_HEADS, HEAD_DIM), generator=g).to(torch.bfloat16)
            k, v = ((3 * torch.randn((n, KV_HEADS, HEAD_DIM), generator=g)).to(torch.bfloat16) for _ in range(2))
            o, lse = seq.step(layer, q, k, v, return_lse=True)
            kd, vd = k_descale[layer], torch.tensor([V_DESCALE[layer]] * KV_HEADS)
            for i, (x, d) in enumerate(((k, kd), (v, vd))):
                cached = torch_cached(torch, x, d)
                # torch's conversion, clamped first (it gives NaN where attnd saturates), is attnd's, bit for bit.
                bits = x.view(torch.int16).numpy().view(np.uint16)
                assert torch.equal(cached, torch.from_numpy(fp8_cached_bf16(bits, d.numpy())))
                hist[layer][i] = torch.cat([hist[layer][i], cached])
            ref_o, ref_lse = reference(q.double().numpy()[None], hist[layer][0].numpy()[None],
                                       hist[layer][1].numpy()[None], "bottom_right")
            # O comes back rounded to bf16 once (half an ulp is |O| / 512; V here is 3 x N(0, 1), |O| up to ~10).
            assert_close(o.double().numpy(), ref_o[0], atol=max(2e-2, np.abs(ref_o[0]).max() / 128))
            assert_lse_close(lse.numpy(), ref_lse[0])


def torch_cached(torch, x, d):
    """bf16 rows [n, kv_heads, head_dim] as a float8 cache with per-head descales d gives them back, in float64."""
    d = d.float()[None, :, None]
    codes = (x.float() / d).clamp(-448, 448).to(torch.float8_e4m3fn)
    return (codes.float() * d).to(torch.bfloat16).double()
