"""KV sequences from Python (Client.open_sequence / step / fork / truncate / close) against a CPU-backend server,
each step checked against float64 attention over the sequence's whole history (bottom-right causal)."""
import numpy as np
import pytest

import attnd
from conftest import assert_close, assert_lse_close, bf16_bits_to_f64, random_bf16, reference

LAYERS, KV_HEADS, Q_HEADS, HEAD_DIM = 2, 2, 4, 64


class History:
    """One sequence's K and V per layer as float64, and the reference of a step over it."""

    def __init__(self, layers=LAYERS):
        self.k = [np.zeros((0, KV_HEADS, HEAD_DIM)) for _ in range(layers)]
        self.v = [np.zeros((0, KV_HEADS, HEAD_DIM)) for _ in range(layers)]

    def copy(self):
        h = History(len(self.k))
        h.k, h.v = list(self.k), list(self.v)
        return h

    def append(self, layer, k, v):
        self.k[layer] = np.concatenate([self.k[layer], k])
        self.v[layer] = np.concatenate([self.v[layer], v])

    def truncate(self, tokens):
        self.k = [k[:tokens] for k in self.k]
        self.v = [v[:tokens] for v in self.v]

    def expect(self, layer, q):
        o, lse = reference(q[None], self.k[layer][None], self.v[layer][None], "bottom_right")
        return o[0], lse[0]


def rows(rng, n, heads=Q_HEADS):
    return random_bf16(rng, (n, heads, HEAD_DIM))


def step_checked(seq, hist, layer, rng, n):
    """A step of n new tokens at `layer`, appended to hist, its O and LSE checked."""
    q, k, v = rows(rng, n), rows(rng, n, KV_HEADS), rows(rng, n, KV_HEADS)
    o, lse = seq.step(layer, q, k, v, return_lse=True)
    hist.append(layer, bf16_bits_to_f64(k), bf16_bits_to_f64(v))
    ref_o, ref_lse = hist.expect(layer, bf16_bits_to_f64(q))
    assert o.shape == (n, Q_HEADS, HEAD_DIM) and o.dtype == np.uint16
    assert lse.shape == (Q_HEADS, n) and lse.dtype == np.float32
    assert_close(bf16_bits_to_f64(o), ref_o)
    assert_lse_close(lse, ref_lse)


@pytest.fixture
def open_seq(client):
    opened = []

    def make(**kw):
        args = dict(layers=LAYERS, kv_heads=KV_HEADS, head_dim=HEAD_DIM)
        args.update(kw)
        s = client.open_sequence(**args)
        opened.extend(s if isinstance(s, list) else [s])
        return s

    yield make
    live = [s for s in opened if not s.closed]
    for s in live:
        try:
            s.close()
        except attnd.AttndError:  # a test that closed it by id
            pass


def test_prefill_then_decode_over_two_layers(client, open_seq):
    rng = np.random.default_rng(1)
    seq = open_seq()
    assert isinstance(seq, attnd.Sequence) and seq.id
    assert tuple(seq.shape) == (LAYERS, KV_HEADS, HEAD_DIM, "bf16", "bf16", (), ()) and seq.max_tokens > 0
    hist = History()
    for layer in range(LAYERS):
        step_checked(seq, hist, layer, rng, 37)
    assert seq.lengths == [37, 37]
    for _ in range(4):
        for layer in range(LAYERS):
            step_checked(seq, hist, layer, rng, 1)
    assert seq.lengths == [41, 41]
    info = seq.info()
    assert info["sequence_id"] == seq.id and info["lengths"] == [41, 41]
    assert info["shape"]["head_dim"] == HEAD_DIM


def test_batched_step_rows_back_to_back(client, open_seq):
    rng = np.random.default_rng(2)
    seqs = open_seq(count=3)
    assert isinstance(seqs, list) and len({s.id for s in seqs}) == 3
    hists = [History() for _ in seqs]
    for n, layer in ((5, 0), (1, 0), (3, 1)):
        tokens = [n, n + 2, 1]
        qs = [rows(rng, m) for m in tokens]
        ks = [rows(rng, m, KV_HEADS) for m in tokens]
        vs = [rows(rng, m, KV_HEADS) for m in tokens]
        # Per-sequence lists, and the same as one [T, ...] array with tokens= (ids instead of objects).
        o, lse = client.step(layer, seqs, qs, ks, vs, return_lse=True)
        assert o.shape == (sum(tokens), Q_HEADS, HEAD_DIM) and len(lse) == 3
        at = 0
        for s, h, q, k, v, m, part in zip(seqs, hists, qs, ks, vs, tokens, lse):
            h.append(layer, bf16_bits_to_f64(k), bf16_bits_to_f64(v))
            ref_o, ref_lse = h.expect(layer, bf16_bits_to_f64(q))
            assert_close(bf16_bits_to_f64(o[at:at + m]), ref_o)
            assert_lse_close(part, ref_lse)
            assert s.lengths[layer] == h.k[layer].shape[0]
            at += m
    # Attend only (no k, v), one row per sequence split evenly, by id.
    q = rows(rng, 3)
    o = client.step(0, [s.id for s in seqs], q=q, dtype="bf16")
    for i, h in enumerate(hists):
        assert_close(bf16_bits_to_f64(o[i:i + 1]), h.expect(0, bf16_bits_to_f64(q[i:i + 1]))[0])
    assert [s.info()["lengths"][0] for s in seqs] == [h.k[0].shape[0] for h in hists]


def test_fork_diverges(client, open_seq):
    rng = np.random.default_rng(3)
    parent = open_seq(layers=1)
    hp = History(1)
    step_checked(parent, hp, 0, rng, 20)
    child = parent.fork()
    assert child.id != parent.id and child.lengths == [20]
    assert child.info()["shared_pages"] > 0
    hc = hp.copy()
    # Each writes its own 21st token into the shared page: neither sees the other's.
    step_checked(child, hc, 0, rng, 1)
    step_checked(parent, hp, 0, rng, 1)
    step_checked(child, hc, 0, rng, 2)
    step_checked(parent, hp, 0, rng, 1)
    assert parent.info()["lengths"] == [22] and child.info()["lengths"] == [23]
    kids = parent.fork(2)
    assert len(kids) == 2 and all(k.lengths == [22] for k in kids)
    for k in kids:
        step_checked(k, hp.copy(), 0, rng, 1)
    client.close_sequences(kids)
    assert all(k.closed for k in kids)


def test_truncate(client, open_seq):
    rng = np.random.default_rng(4)
    seq = open_seq()
    hist = History()
    for layer in range(LAYERS):
        step_checked(seq, hist, layer, rng, 30)
    step_checked(seq, hist, 0, rng, 3)
    assert seq.truncate(25) == [25, 25]
    assert seq.lengths == [25, 25]
    hist.truncate(25)
    for layer in range(LAYERS):
        step_checked(seq, hist, layer, rng, 2)
    assert seq.info()["lengths"] == [27, 27]
    with pytest.raises(attnd.AttndError) as e:
        seq.truncate(-1)
    assert e.value.code == attnd.StatusCode.INVALID_ARGUMENT and "tokens" in e.value.message


def test_close_then_not_found(client, open_seq):
    rng = np.random.default_rng(5)
    seq = open_seq()
    step_checked(seq, History(), 0, rng, 4)
    seq.close()
    assert seq.closed
    seq.close()  # a second close does nothing
    q, k, v = rows(rng, 1), rows(rng, 1, KV_HEADS), rows(rng, 1, KV_HEADS)
    for call in (lambda: seq.step(0, q, k, v), seq.info, lambda: seq.truncate(1), seq.fork,
                 lambda: client.close_sequences([seq.id])):
        with pytest.raises(attnd.AttndError) as e:
            call()
        assert e.value.code == attnd.StatusCode.NOT_FOUND, e.value
    with client.open_sequence(LAYERS, KV_HEADS, HEAD_DIM) as s:
        sid = s.id
        s.step(0, q, k, v)
    with pytest.raises(attnd.AttndError) as e:
        client.sequence_info(sid)
    assert e.value.code == attnd.StatusCode.NOT_FOUND


def bad(call, code, field):
    with pytest.raises(attnd.AttndError) as e:
        call()
    assert e.value.code == code, e.value
    assert field in e.value.message, e.value


def test_bad_input_names_the_field(client, open_seq):
    rng = np.random.default_rng(6)
    seq = open_seq()
    q, k, v = rows(rng, 2), rows(rng, 2, KV_HEADS), rows(rng, 2, KV_HEADS)
    inv = attnd.StatusCode.INVALID_ARGUMENT
    bad(lambda: client.open_sequence(LAYERS, KV_HEADS, HEAD_DIM, dtype="fp32"), inv, "dtype")
    bad(lambda: client.open_sequence(0, KV_HEADS, HEAD_DIM), inv, "layers")
    bad(lambda: seq.step(0, q[0], k, v), inv, "q")
    bad(lambda: seq.step(0, q, k, None), inv, "k, v")
    bad(lambda: seq.step(0, q, k[:1], v[:1]), inv, "k")
    bad(lambda: seq.step(0, q.astype(np.float32), k, v), inv, "q: dtype")
    bad(lambda: seq.step(LAYERS, q, k, v), inv, "layer")
    bad(lambda: seq.step(0, rows(rng, 2, 3), k, v), inv, "q_heads")
    bad(lambda: seq.step(0, q, k, v, q_heads=8), inv, "q_heads")
    bad(lambda: client.step(0, [seq, seq.id], q, k, v), inv, "sequences")
    bad(lambda: client.step(0, [seq], q, k, v, tokens=[3]), inv, "tokens")
    bad(lambda: client.step(0, [], q, k, v), inv, "sequences")
    bad(lambda: client.step(0, [seq, "nope"], q[:1], k[:1], v[:1]), inv, "tokens")
    bad(lambda: client.step(0, ["nope"], q, k, v, dtype="bf16"), attnd.StatusCode.NOT_FOUND, "nope")
    # Nothing was committed by the failed calls.
    assert seq.info()["lengths"] == [0, 0]


def test_torch_cpu_tensors(client, open_seq):
    torch = pytest.importorskip("torch")
    g = torch.Generator().manual_seed(7)
    for dtype, name in ((torch.bfloat16, "bf16"), (torch.float16, "fp16")):
        seq = open_seq(dtype=name)
        hist = History()
        for n in (37, 1, 1):
            for layer in range(LAYERS):
                q = torch.randn((n, Q_HEADS, HEAD_DIM), generator=g).to(dtype)
                k, v = (torch.randn((n, KV_HEADS, HEAD_DIM), generator=g).to(dtype) for _ in range(2))
                o, lse = seq.step(layer, q, k, v, return_lse=True)
                assert isinstance(o, torch.Tensor) and o.dtype == dtype and o.shape == q.shape
                assert isinstance(lse, torch.Tensor) and lse.shape == (Q_HEADS, n)
                hist.append(layer, k.double().numpy(), v.double().numpy())
                ref_o, ref_lse = hist.expect(layer, q.double().numpy())
                assert_close(o.double().numpy(), ref_o)
                assert_lse_close(lse.numpy(), ref_lse)
        seq.close()


@pytest.mark.parametrize("transport", ["auto", "unary", "shm"])
def test_step_transports(server, transport):
    # Steps over the client's transport: a StepStream (auto), the unary Step RPC, or a Step frame on the
    # shared-memory channel. The shm channel's caller is the owner 'local', as on the unix socket: sequences it
    # steps are opened there.
    rng = np.random.default_rng(8)
    target = f"unix:{server.unix}" if transport == "shm" else server.target
    with attnd.Client(target, transport=transport, shm_socket=server.shm) as c:
        with c.open_sequence(LAYERS, KV_HEADS, HEAD_DIM) as seq:
            hist = History()
            for n in (37, 1):
                step_checked(seq, hist, 0, rng, n)
                assert c.last_info.transport == {"auto": 2, "unary": 1, "shm": 3}[transport]
            # The per-call transport overrides the client's.
            q, k, v = rows(rng, 1), rows(rng, 1, KV_HEADS), rows(rng, 1, KV_HEADS)
            seq.step(1, q, k, v, transport="unary")
            assert c.last_info.transport == 1


def test_torch_lists_batched(client, open_seq):
    torch = pytest.importorskip("torch")
    g = torch.Generator().manual_seed(9)
    seqs = open_seq(count=2)
    hists = [History(), History()]
    for tokens in ([7, 3], [1, 1]):
        qs = [torch.randn((n, Q_HEADS, HEAD_DIM), generator=g).to(torch.bfloat16) for n in tokens]
        ks = [torch.randn((n, KV_HEADS, HEAD_DIM), generator=g).to(torch.bfloat16) for n in tokens]
        vs = [torch.randn((n, KV_HEADS, HEAD_DIM), generator=g).to(torch.bfloat16) for n in tokens]
        o = client.step(1, seqs, qs, ks, vs)
        assert isinstance(o, torch.Tensor) and o.shape == (sum(tokens), Q_HEADS, HEAD_DIM)
        at = 0
        for h, q, k, v, n in zip(hists, qs, ks, vs, tokens):
            h.append(1, k.double().numpy(), v.double().numpy())
            assert_close(o[at:at + n].double().numpy(), h.expect(1, q.double().numpy())[0])
            at += n
    assert [s.lengths for s in seqs] == [[0, 8], [0, 4]]


def test_c_abi_rejects_wrong_buffers_before_sending(client, open_seq):
    # attnd_step checks the caller's O and LSE sizes before the step is sent: a step whose result could not be
    # delivered must not be committed.
    import ctypes
    from attnd import _lib
    rng = np.random.default_rng(10)
    seq = open_seq()
    q, k, v = rows(rng, 3), rows(rng, 3, KV_HEADS), rows(rng, 3, KV_HEADS)
    o = np.empty_like(q)
    lse = np.empty(3 * Q_HEADS, dtype=np.float32)
    for o_bytes, lse_bytes, tokens, field in ((o.nbytes - 2, lse.nbytes, 3, "o_bytes"),
                                              (o.nbytes, lse.nbytes + 4, 3, "lse_bytes"),
                                              (o.nbytes, lse.nbytes, 0, "tokens[0]")):
        a = _lib.StepArgs()
        a.layer, a.q_heads, a.count = 0, Q_HEADS, 1
        a.sequence_ids = (ctypes.c_char_p * 1)(seq.id.encode())
        a.tokens = (ctypes.c_int64 * 1)(tokens)
        a.want_lse, a.transport = 1, -1
        a.q, a.q_bytes = q.ctypes.data, q.nbytes
        a.k, a.k_bytes = k.ctypes.data, k.nbytes
        a.v, a.v_bytes = v.ctypes.data, v.nbytes
        a.o, a.o_bytes = o.ctypes.data, o_bytes
        a.lse, a.lse_bytes = lse.ctypes.data, lse_bytes
        err = _lib.Error()
        rc = client._lib.attnd_step(client._h(), ctypes.byref(a), None, ctypes.byref(err))
        assert rc == attnd.StatusCode.INVALID_ARGUMENT and err.message.decode().startswith(field), err.message
    assert seq.info()["lengths"] == [0, 0]


def test_step_out(client, open_seq):
    # O straight into the caller's array, as attention(out=) does; a wrong out is refused before the step is sent.
    rng = np.random.default_rng(11)
    seq = open_seq()
    hist = History()
    out = np.full((3, Q_HEADS, HEAD_DIM), 0xFFFF, np.uint16)
    for n in (3, 1):
        q, k, v = rows(rng, n), rows(rng, n, KV_HEADS), rows(rng, n, KV_HEADS)
        o, lse = seq.step(0, q, k, v, return_lse=True, out=out[:n])
        assert o.base is out or o is out
        hist.append(0, bf16_bits_to_f64(k), bf16_bits_to_f64(v))
        ref_o, ref_lse = hist.expect(0, bf16_bits_to_f64(q))
        assert_close(bf16_bits_to_f64(out[:n]), ref_o)
        assert_lse_close(lse, ref_lse)
    q, k, v = rows(rng, 2), rows(rng, 2, KV_HEADS), rows(rng, 2, KV_HEADS)
    inv = attnd.StatusCode.INVALID_ARGUMENT
    bad(lambda: seq.step(0, q, k, v, out=np.empty((2, Q_HEADS, 32), np.uint16)), inv, "out")
    bad(lambda: seq.step(0, q, k, v, out=np.empty((2, Q_HEADS, HEAD_DIM), np.float16)), inv, "out")
    bad(lambda: seq.step(0, q, k, v, out=np.empty((Q_HEADS, 2, HEAD_DIM), np.uint16).transpose(1, 0, 2)), inv,
        "out: must be contiguous")
    frozen = np.empty((2, Q_HEADS, HEAD_DIM), np.uint16)
    frozen.setflags(write=False)
    bad(lambda: seq.step(0, q, k, v, out=frozen), inv, "out")
    bad(lambda: seq.step(0, None, k, v, out=np.empty((2, Q_HEADS, HEAD_DIM), np.uint16)), inv, "out")
    assert seq.info()["lengths"] == [4, 0]


def test_step_out_torch(client, open_seq):
    torch = pytest.importorskip("torch")
    g = torch.Generator().manual_seed(12)
    seq = open_seq()
    q = torch.randn((2, Q_HEADS, HEAD_DIM), generator=g).bfloat16()
    k, v = (torch.randn((2, KV_HEADS, HEAD_DIM), generator=g).bfloat16() for _ in range(2))
    out = torch.empty((2, Q_HEADS, HEAD_DIM), dtype=torch.bfloat16)
    assert seq.step(0, q, k, v, out=out) is out
    hist = History()
    hist.append(0, k.double().numpy(), v.double().numpy())
    assert_close(out.double().numpy(), hist.expect(0, q.double().numpy())[0])
    bad(lambda: seq.step(0, q, k, v, out=torch.empty((2, Q_HEADS, HEAD_DIM))), attnd.StatusCode.INVALID_ARGUMENT,
        "out")


def test_read_only_and_strided_step_inputs(client, open_seq):
    # Inputs the fast pointer path does not take (read-only, non-contiguous) go the general way, same result.
    rng = np.random.default_rng(13)
    seq = open_seq()
    q, k, v = rows(rng, 4), rows(rng, 4, KV_HEADS), rows(rng, 4, KV_HEADS)
    for x in (q, k, v):
        x.setflags(write=False)
    kt = np.ascontiguousarray(k.transpose(1, 0, 2)).transpose(1, 0, 2)
    assert not kt.flags.c_contiguous
    o = seq.step(0, q, kt, v)
    hist = History()
    hist.append(0, bf16_bits_to_f64(k), bf16_bits_to_f64(v))
    assert_close(bf16_bits_to_f64(o), hist.expect(0, bf16_bits_to_f64(q))[0])


def test_step_batch_host_tensors(client, open_seq):
    """A StepBatch of host arrays steps through Client.step: the same rows, the same answers; a CPU server offers no
    stream order, and says so."""
    rng = np.random.default_rng(9)
    seqs = open_seq(count=4)
    batch = client.batch(seqs)
    assert isinstance(batch, attnd.StepBatch) and len(batch) == 4
    assert client.stream_ordered is False
    hists = [History() for _ in seqs]
    for n, layer in ((3, 0), (1, 0), (1, 1)):
        q, k, v = rows(rng, 4 * n), rows(rng, 4 * n, KV_HEADS), rows(rng, 4 * n, KV_HEADS)
        o = batch.step(layer, q, k, v)
        for i, (s, h) in enumerate(zip(seqs, hists)):
            part = slice(i * n, (i + 1) * n)
            h.append(layer, bf16_bits_to_f64(k[part]), bf16_bits_to_f64(v[part]))
            assert_close(bf16_bits_to_f64(o[part]), h.expect(layer, bf16_bits_to_f64(q[part]))[0])
            assert s.lengths[layer] == h.k[layer].shape[0]
    with pytest.raises(attnd.AttndError) as e:
        batch.step(0, rows(rng, 6), rows(rng, 6, KV_HEADS), rows(rng, 6, KV_HEADS), tokens=2)
    assert e.value.code == attnd.StatusCode.INVALID_ARGUMENT and "tokens" in e.value.message
    batch.close()
