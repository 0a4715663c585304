"""KV-sequence steps from torch CUDA tensors: by reference into the caller's memory and ordered on its CUDA stream
(docs/sequences.md, "Steps from CUDA memory"), against a CUDA-backend server of the same build on this host. Every
answer is checked against float64 attention over the sequence's whole history; the ordering test fails when the
server reads Q before the caller's producer wrote it; the failure tests check that nothing hangs and nothing is
half done when a step fails, the server dies, or a caller dies while its step waits for its stream."""
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import attnd  # noqa: E402
from conftest import Server, assert_close, reference  # noqa: E402

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")

KV, HQ, D = 2, 8, 128
SLEEP_CYCLES = 200_000_000  # ~0.1 s of GPU time: long enough that an unordered read sees the old bytes


def f64(t):
    return t.detach().to("cpu", torch.float64).numpy()


def start_cuda_server(tmpdir, name, *args):
    if not os.environ.get("ATTND_SERVER"):
        pytest.skip("ATTND_SERVER is not set")
    s = Server(["--backend=cuda", "--enable_cuda_ipc", *args], tmpdir, name)
    c = attnd.Client("unix:" + s.unix, transport="shm", shm_socket=s.shm)
    if c.info()["backend"] != "cuda":
        c.close()
        s.stop()
        pytest.skip("the server has no CUDA backend")
    return s, c


@pytest.fixture(scope="module")
def cuda_server(tmpdir_short):
    s, c = start_cuda_server(tmpdir_short, "cudasteps")
    yield s, c
    c.close()
    s.stop()


class History:
    def __init__(self):
        self.k = np.zeros((0, KV, D))
        self.v = np.zeros((0, KV, D))

    def add(self, k, v):
        self.k = np.concatenate([self.k, f64(k)])
        self.v = np.concatenate([self.v, f64(v)])

    def expect(self, q):
        return reference(f64(q)[None], self.k[None], self.v[None], "bottom_right")[0][0]


def rand(g, n, heads, scale=1.0):
    return (torch.randn((n, heads, D), generator=g) * scale).to(torch.bfloat16).cuda()


def test_stream_ordered_prefill_then_decode(cuda_server):
    s, c = cuda_server
    assert c.stream_ordered, "a CUDA server with IPC on an H100/H200 orders steps on the caller's stream"
    g = torch.Generator().manual_seed(1)
    with c.open_sequence(layers=2, kv_heads=KV, head_dim=D) as seq:
        hists = [History(), History()]
        # Prefill (the prefill kernels), then one-token decode steps; hard rows too: large logits, rising scores.
        for layer, n in ((0, 300), (1, 300), (0, 1), (1, 1), (0, 5), (0, 1)):
            q, k, v = rand(g, n, HQ), rand(g, n, KV), rand(g, n, KV)
            if n == 1 and layer == 1:
                q = q * 8  # large logits
            o = torch.full_like(q, float("nan"))  # poisoned: a step that writes nothing fails the check
            o = seq.step(layer, q, k, v, out=o)
            hists[layer].add(k, v)
            assert seq.lengths[layer] == hists[layer].k.shape[0]
            assert_close(f64(o), hists[layer].expect(q), atol=3e-2)
        assert seq.info()["lengths"] == [hists[0].k.shape[0], hists[1].k.shape[0]]


def test_batch_of_sequences(cuda_server):
    s, c = cuda_server
    g = torch.Generator().manual_seed(2)
    seqs = c.open_sequence(layers=1, kv_heads=KV, head_dim=D, count=8)
    try:
        batch = c.batch(seqs)
        hists = [History() for _ in seqs]
        for n in (40, 1, 1, 3):
            q, k, v = rand(g, 8 * n, HQ), rand(g, 8 * n, KV), rand(g, 8 * n, KV)
            o = batch.step(0, q, k, v)
            assert batch.lengths == [h.k.shape[0] + n for h in hists]
            for i, h in enumerate(hists):
                part = slice(i * n, (i + 1) * n)
                h.add(k[part], v[part])
                assert_close(f64(o[part]), h.expect(q[part]), atol=3e-2)
        # Attend only and append only, through the same batch.
        q = rand(g, 8, HQ)
        o = batch.step(0, q)
        for i, h in enumerate(hists):
            assert_close(f64(o[i:i + 1]), h.expect(q[i:i + 1]), atol=3e-2)
        k, v = rand(g, 8, KV), rand(g, 8, KV)
        assert batch.step(0, k=k, v=v) is None
        assert batch.lengths == [h.k.shape[0] + 1 for h in hists]
    finally:
        c.close_sequences(seqs)


def test_producer_still_writing_q_and_consumer_reading_o(cuda_server):
    """The producer writes Q after a long GPU sleep, on the current stream, and the step is called at once: the
    server must start it only after the producer (else it reads the zeros), and the consumer's copy of O right after
    the call must see the answer."""
    s, c = cuda_server
    assert c.stream_ordered
    g = torch.Generator().manual_seed(3)
    stream = torch.cuda.Stream()
    with c.open_sequence(layers=1, kv_heads=KV, head_dim=D) as seq, torch.cuda.stream(stream):
        h = History()
        k0, v0 = rand(g, 64, KV), rand(g, 64, KV)
        seq.step(0, k=k0, v=v0)
        h.add(k0, v0)
        for i in range(3):
            q_true, k, v = rand(g, 1, HQ, 4.0), rand(g, 1, KV), rand(g, 1, KV)
            q = torch.zeros_like(q_true)
            o = torch.full_like(q_true, float("nan"))
            stream.synchronize()
            torch.cuda._sleep(SLEEP_CYCLES)
            q.copy_(q_true)  # the producer: done ~0.1 s after the call below was made
            seq.step(0, q, k, v, out=o)
            seen = o.clone()  # the consumer
            stream.synchronize()
            h.add(k, v)
            assert_close(f64(seen), h.expect(q_true), atol=3e-2)


def test_failed_step_leaves_the_stream_free(cuda_server):
    s, c = cuda_server
    g = torch.Generator().manual_seed(4)
    with c.open_sequence(layers=1, kv_heads=KV, head_dim=D) as seq:
        q, k, v = rand(g, 1, HQ), rand(g, 1, KV), rand(g, 1, KV)
        with pytest.raises(attnd.AttndError) as e:
            seq.step(3, q, k, v)  # no layer 3
        assert e.value.code == attnd.StatusCode.INVALID_ARGUMENT and "layer" in e.value.message
        t0 = time.perf_counter()
        torch.cuda.current_stream().synchronize()
        assert time.perf_counter() - t0 < 1.0
        assert seq.info()["lengths"] == [0]
        o = seq.step(0, q, k, v)
        h = History()
        h.add(k, v)
        assert_close(f64(o), h.expect(q), atol=3e-2)


def test_server_death_while_a_step_waits(tmpdir_short):
    """The server is killed while a step waits for the caller's stream: the call fails UNAVAILABLE once the server's
    process is gone, and the stream, which never waits on the server, runs on. (The killed process is gone only when
    the driver has torn its context down: on the H200 that came when the caller's 2 s kernel ended.)"""
    s, c = start_cuda_server(tmpdir_short, "dying")
    try:
        g = torch.Generator().manual_seed(5)
        seq = c.open_sequence(layers=1, kv_heads=KV, head_dim=D)
        q, k, v = rand(g, 1, HQ), rand(g, 1, KV), rand(g, 1, KV)
        seq.step(0, q, k, v)
        torch.cuda.synchronize()
        torch.cuda._sleep(SLEEP_CYCLES * 20)  # ~2 s: the server waits for the stream meanwhile
        killer = threading.Timer(0.5, lambda: s.proc.send_signal(signal.SIGKILL))
        killer.start()
        t0 = time.time()
        with pytest.raises(attnd.AttndError) as e:
            seq.step(0, q, k, v)
        assert e.value.code == attnd.StatusCode.UNAVAILABLE, e.value
        assert time.time() - t0 < 10
        killer.join()
        s.proc.wait()
        t0 = time.time()
        torch.cuda.current_stream().synchronize()
        assert time.time() - t0 < 5
    finally:
        c.close()
        s.stop()


def test_submitted_steps_layer_after_layer(cuda_server):
    """wait=False: each layer's Q is made on the stream from the previous layer's O and its step submitted without
    waiting; the consumer's copy of O queued right after each call must see that step's answer."""
    s, c = cuda_server
    g = torch.Generator().manual_seed(7)
    seqs = c.open_sequence(layers=2, kv_heads=KV, head_dim=D, count=4)
    try:
        batch = c.batch(seqs, wait=False)
        hists = [[History() for _ in seqs] for _ in range(2)]
        o = rand(g, 4, HQ)
        seen, sent = [], []
        for step in range(6):
            n = 16 if step == 0 else 1  # a prefill chunk, then decode steps
            for layer in range(2):
                q = (o[:4].repeat_interleave(n, 0) * 3.0).contiguous()  # the producer reads the last O
                k, v = rand(g, 4 * n, KV), rand(g, 4 * n, KV)
                o = torch.full_like(q, float("nan"))
                batch.step(layer, q, k, v, out=o)
                seen.append(o.clone())  # the consumer, queued right after the call
                sent.append((layer, n, q.clone(), k, v))
        batch.synchronize()
        for (layer, n, q, k, v), got in zip(sent, seen):
            for i, h in enumerate(hists[layer]):
                part = slice(i * n, (i + 1) * n)
                h.add(k[part], v[part])
                assert_close(f64(got[part]), h.expect(q[part]), atol=3e-2)
        assert [c.sequence_info(x.id)["lengths"] for x in seqs] == [[21, 21]] * 4
    finally:
        c.close_sequences(seqs)


def test_submitted_step_returns_before_its_producer_ends(cuda_server):
    s, c = cuda_server
    g = torch.Generator().manual_seed(8)
    stream = torch.cuda.Stream()
    with c.open_sequence(layers=1, kv_heads=KV, head_dim=D) as seq, torch.cuda.stream(stream):
        batch = c.batch([seq], wait=False)
        h = History()
        k0, v0 = rand(g, 64, KV), rand(g, 64, KV)
        batch.step(0, k=k0, v=v0)
        h.add(k0, v0)
        q_true, k, v = rand(g, 1, HQ, 4.0), rand(g, 1, KV), rand(g, 1, KV)
        q = torch.zeros_like(q_true)
        o = torch.full_like(q_true, float("nan"))
        stream.synchronize()
        torch.cuda._sleep(SLEEP_CYCLES)
        q.copy_(q_true)
        t0 = time.perf_counter()
        batch.step(0, q, k, v, out=o)
        took = time.perf_counter() - t0
        seen = o.clone()
        stream.synchronize()
        assert took < 0.05, f"the call waited {took:.3f} s for its producer"
        h.add(k, v)
        assert_close(f64(seen), h.expect(q_true), atol=3e-2)
        batch.synchronize()


def test_a_failed_submitted_step_poisons_o_and_stops_the_steps_behind_it(cuda_server):
    """A submitted step the server refuses (no layer 3): its O and that of the step submitted behind it become
    NaN before the stream reads them, the second is not sent (nothing appended), the next call raises the
    failure, and steps after that run normally."""
    s, c = cuda_server
    g = torch.Generator().manual_seed(9)
    with c.open_sequence(layers=1, kv_heads=KV, head_dim=D) as seq:
        batch = c.batch([seq], wait=False)
        q, k, v = rand(g, 1, HQ), rand(g, 1, KV), rand(g, 1, KV)
        torch.cuda.synchronize()
        torch.cuda._sleep(SLEEP_CYCLES)  # the first step waits for this, so the others queue behind it
        o1, o2, o3 = torch.zeros_like(q), torch.zeros_like(q), torch.zeros_like(q)
        batch.step(0, q, k, v, out=o1)
        batch.step(3, q, k, v, out=o2)  # refused by the server
        batch.step(0, q, k, v, out=o3)  # behind it: not sent
        seen2, seen3 = o2.clone(), o3.clone()
        with pytest.raises(attnd.AttndError) as e:
            batch.synchronize()
        assert e.value.code == attnd.StatusCode.INVALID_ARGUMENT and "layer" in e.value.message, e.value
        torch.cuda.synchronize()
        assert torch.isnan(seen2).all() and torch.isnan(seen3).all()
        h = History()
        h.add(k, v)
        assert_close(f64(o1), h.expect(q), atol=3e-2)
        assert seq.info()["lengths"] == [1]
        batch.synchronize()  # reported once
        q2, k2, v2 = rand(g, 1, HQ), rand(g, 1, KV), rand(g, 1, KV)
        o = batch.step(0, q2, k2, v2)
        batch.synchronize()
        h.add(k2, v2)
        assert_close(f64(o), h.expect(q2), atol=3e-2)


def test_server_death_releases_a_stream_waiting_on_submitted_steps(tmpdir_short):
    """Steps submitted behind a 2 s producer when the server is killed: the stream, which waits for them on the
    GPU, is released once the client sees the server gone (their O filled with NaN), and the next call raises
    UNAVAILABLE. On a stream of its own, as test_submitted_step_returns_before_its_producer_ends: on the legacy
    default stream two such calls were seen to return only after the producer (2.02 s), cause not found yet."""
    s, c = start_cuda_server(tmpdir_short, "dying2")
    stream = torch.cuda.Stream()
    try:
        g = torch.Generator().manual_seed(10)
        seq = c.open_sequence(layers=1, kv_heads=KV, head_dim=D)
        with torch.cuda.stream(stream):
            batch = c.batch([seq], wait=False)
            q, k, v = rand(g, 1, HQ), rand(g, 1, KV), rand(g, 1, KV)
            # Everything the stream needs is allocated (and registered by a step) first, and every kernel it runs
            # after the sleep launched once: CUDA loads a kernel's module at its first launch (lazy loading), and
            # that load waits for the device, sleep included.
            o1, o2 = torch.zeros_like(q), torch.zeros_like(q)
            seen = torch.empty((2,) + tuple(q.shape[1:]), dtype=q.dtype, device=q.device)
            batch.step(0, q, k, v, out=o1)
            batch.step(0, q, k, v, out=o2)
            torch.cat([o1, o2], out=seen)
            batch.synchronize()
            o1.zero_()
            o2.zero_()
            torch.cuda.synchronize()
            torch.cuda._sleep(SLEEP_CYCLES * 20)
            t0 = time.time()
            batch.step(0, q, k, v, out=o1)
            t1 = time.time() - t0
            batch.step(0, q, k, v, out=o2)
            t2 = time.time() - t0
            torch.cat([o1, o2], out=seen)
            killed = time.time() - t0
            s.proc.send_signal(signal.SIGKILL)
            s.proc.wait()
            gone = time.time() - t0
            stream.synchronize()
            done = time.time() - t0
            err = None
            try:
                batch.synchronize()
            except attnd.AttndError as e:
                err = e
        detail = (f"steps returned after {t1:.3f} and {t2:.3f} s, the read after {killed:.3f} s, server gone "
                  f"after {gone:.2f} s, stream done after "
                  f"{done:.2f} s, error {err!r}, O {seen[:, 0, :4].tolist()}")
        assert killed < 1.0, detail
        assert done < 10, detail
        assert torch.isnan(seen).all(), detail
        assert err is not None and err.code == attnd.StatusCode.UNAVAILABLE, detail
    finally:
        c.close()
        s.stop()


CALLER = textwrap.dedent("""
    import sys, time, torch, attnd
    c = attnd.Client(sys.argv[1], transport="shm", shm_socket=sys.argv[2])
    seq = c.open_sequence(layers=1, kv_heads=2, head_dim=128)
    q = torch.randn(1, 8, 128, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(1, 2, 128, device="cuda", dtype=torch.bfloat16)
    seq.step(0, q, k, k)
    print(seq.id, flush=True)
    torch.cuda.synchronize()
    torch.cuda._sleep(40_000_000_000)  # ~20 s: the process dies long before its stream writes the wait word
    seq.step(0, q, k, k)
""")


def test_caller_death_while_its_step_waits(tmpdir_short):
    """A caller killed while its step waits for its stream: the server drops the step (nothing appended) as soon as
    the caller's channel closes, long before --step_order_timeout_s, and serves others."""
    s, c = start_cuda_server(tmpdir_short, "orphan", "--step_order_timeout_s=60")
    try:
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
        p = subprocess.Popen([sys.executable, "-c", CALLER, "unix:" + s.unix, s.shm], stdout=subprocess.PIPE,
                             env=env, text=True)
        seq_id = p.stdout.readline().strip()
        assert seq_id, "the caller did not step"
        time.sleep(1.0)  # its second step is waiting for the stream by now
        p.send_signal(signal.SIGKILL)
        p.wait()
        t0 = time.time()
        while time.time() - t0 < 10:
            info = c.sequence_info(seq_id)
            if not info["step_in_flight"]:
                break
            time.sleep(0.05)
        assert c.sequence_info(seq_id)["lengths"] == [1], "the orphaned step appended its row"
        assert time.time() - t0 < 10
        g = torch.Generator().manual_seed(6)
        with c.open_sequence(layers=1, kv_heads=KV, head_dim=D) as seq:
            q, k, v = rand(g, 1, HQ), rand(g, 1, KV), rand(g, 1, KV)
            o = seq.step(0, q, k, v)
            h = History()
            h.add(k, v)
            assert_close(f64(o), h.expect(q), atol=3e-2)
        c.close_sequences([seq_id])
    finally:
        c.close()
        s.stop()
