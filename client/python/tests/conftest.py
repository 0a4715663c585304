"""Fixtures: attnd servers (the build's binary, CPU backend) started for the session, and a float64 reference.

ctest sets ATTND_SERVER (the attnd binary) and ATTND_CLIENT_LIB (the build's libattnd_client_c.so) and puts
client/python on PYTHONPATH. Without ATTND_SERVER the suite skips.
"""
import os
import re
import shutil
import subprocess
import tempfile
import time

import numpy as np
import pytest

# The server's one-message limit in the suite: small, so that a few-MiB request must stream.
MAX_MESSAGE_BYTES = 1 << 20


class Server:
    def __init__(self, args, tmp, name):
        binary = os.environ.get("ATTND_SERVER")
        if not binary:
            pytest.skip("ATTND_SERVER (the attnd binary) is not set")
        self.unix = os.path.join(tmp, f"{name}.sock")
        self.shm = os.path.join(tmp, f"{name}.shm.sock")
        self.log_path = os.path.join(tmp, f"{name}.log")
        cmd = [binary, "--backend=cpu", "--threads=2", "--listen=127.0.0.1:0", f"--unix_socket={self.unix}",
               f"--shm_socket={self.shm}", f"--max_message_bytes={MAX_MESSAGE_BYTES}", "--access_log=false",
               "--log_level=info", "--kv_pool_mb=64", "--kv_max_pools=4"] + args
        self.log = open(self.log_path, "w+")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT)
        self.port = self._wait_for_port()
        self.target = f"127.0.0.1:{self.port}"

    def _wait_for_port(self):
        end = time.time() + 30
        while time.time() < end:
            with open(self.log_path) as f:
                m = re.search(r"\[port (\d+)\]", f.read())
            if m:
                return int(m.group(1))
            if self.proc.poll() is not None:
                break
            time.sleep(0.05)
        with open(self.log_path) as f:
            raise RuntimeError(f"attnd did not start: {f.read()}")

    def stop(self):
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


@pytest.fixture(scope="session")
def tmpdir_short():
    # unix socket paths are limited to 107 bytes: a short folder of its own.
    d = tempfile.mkdtemp(prefix="attnd_py_")
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(scope="session")
def server(tmpdir_short):
    s = Server([], tmpdir_short, "plain")
    yield s
    s.stop()


@pytest.fixture(scope="session")
def secure_server(tmpdir_short):
    """TLS on TCP (a self-signed certificate for localhost) and a bearer token on every transport."""
    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed (TLS certificate)")
    cert, key = os.path.join(tmpdir_short, "cert.pem"), os.path.join(tmpdir_short, "key.pem")
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", "/CN=localhost",
                    "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1", "-keyout", key, "-out", cert],
                   check=True, capture_output=True)
    tokens = os.path.join(tmpdir_short, "tokens.txt")
    with open(tokens, "w") as f:
        f.write("s3cret-token\n")
    s = Server([f"--tls_cert={cert}", f"--tls_key={key}", f"--auth_token_file={tokens}"], tmpdir_short, "secure")
    s.ca, s.token = cert, "s3cret-token"
    yield s
    s.stop()


@pytest.fixture
def client(server):
    import attnd
    with attnd.Client(server.target) as c:
        yield c


# -- data and the reference ---------------------------------------------------------------------------------------

def f32_to_bf16_bits(x):
    """Round-to-nearest-even float32 -> bf16 bits (uint16)."""
    b = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    rounded = b + 0x7FFF + ((b >> 16) & 1)
    return (rounded >> 16).astype(np.uint16)


def bf16_bits_to_f64(bits):
    return (bits.astype(np.uint32) << 16).view(np.float32).astype(np.float64)


def fp8_e4m3(y):
    """float32 values as attnd's float8 e4m3 conversion gives them back (kernels/reference/include/attnd/fp8.h:
    FloatToFp8E4M3, then Fp8E4M3ToFloat): the nearest of 3 mantissa bits, ties to even, steps of 2^-9 below 2^-6,
    saturating at +-448."""
    y = np.asarray(y, dtype=np.float32)
    a = np.abs(y).astype(np.float64)
    small = a < 2.0 ** -6
    _, e = np.frexp(np.where(small, 1.0, a))  # a = m * 2^e, m in [0.5, 1): 8 steps between 2^(e-1) and 2^e
    step = np.where(small, 2.0 ** -9, np.ldexp(1.0, e - 4))
    q = np.minimum(np.rint(a / step) * step, 448.0)  # rint: ties to even, as the library's nearbyint
    return np.where(np.isnan(y), np.nan, np.copysign(q, y)).astype(np.float32)


def fp8_cached_bf16(bits, descale):
    """bf16 rows [n, kv_heads, head_dim] (uint16 bits) as a float8 cache with `descale` (one per kv head, or one)
    gives them back to attention, as float64: the e4m3 value of x / d, times d, rounded to bf16."""
    d = np.broadcast_to(np.asarray(descale, dtype=np.float32).reshape(-1), (bits.shape[1],))[None, :, None]
    x = bf16_bits_to_f64(bits).astype(np.float32)
    return bf16_bits_to_f64(f32_to_bf16_bits(fp8_e4m3(x / d) * d))


def random_bf16(rng, shape):
    return f32_to_bf16_bits(rng.standard_normal(shape).astype(np.float32))


def reference(q, k, v, mask="none", scale=None):
    """float64 attention of [b, l, h, d] arrays: O [b, lq, hq, d] and LSE [b, hq, lq] (-inf for rows with no key)."""
    b, lq, hq, d = q.shape
    lk, hkv = k.shape[1], k.shape[2]
    scale = 1.0 / np.sqrt(d) if scale is None else scale
    kk = np.repeat(k, hq // hkv, axis=2)
    vv = np.repeat(v, hq // hkv, axis=2)
    s = np.einsum("bqhd,bkhd->bhqk", q, kk) * scale
    i = np.arange(lq)[:, None]
    j = np.arange(lk)[None, :]
    if mask == "top_left":
        s = np.where(j <= i, s, -np.inf)
    elif mask == "bottom_right":
        s = np.where(j <= i + lk - lq, s, -np.inf)
    m = s.max(axis=-1, keepdims=True)
    m = np.where(np.isfinite(m), m, 0.0)
    p = np.exp(s - m)
    l = p.sum(axis=-1, keepdims=True)
    o = np.einsum("bhqk,bkhd->bqhd", p / np.where(l > 0, l, 1.0), vv)
    lse = np.where(l[..., 0] > 0, np.log(np.where(l[..., 0] > 0, l[..., 0], 1.0)) + m[..., 0], -np.inf)
    return o, lse


def assert_close(o, ref, atol=2e-2):
    o = np.asarray(o, dtype=np.float64)
    err = np.abs(o - ref).max()
    assert err <= atol, f"max |O - O_f64| = {err} > {atol}"


def assert_lse_close(lse, ref):
    lse = np.asarray(lse, dtype=np.float64)
    fin = np.isfinite(ref)
    assert np.array_equal(np.isfinite(lse), fin), "LSE: -inf rows differ"
    err = np.abs(lse[fin] - ref[fin]).max() if fin.any() else 0.0
    assert err <= 2e-3 * max(1.0, np.abs(ref[fin]).max()), f"max |LSE - LSE_f64| = {err}"
