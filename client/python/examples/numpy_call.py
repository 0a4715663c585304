"""One attention call from NumPy: q, k, v [batch, seq, heads, head_dim] in bf16, checked against float64.

    python3 numpy_call.py [TARGET]      (default 127.0.0.1:50051; start a server with `attnd --backend=cpu`)

bf16 arrays are ml_dtypes.bfloat16 when ml_dtypes is installed; here they are uint16 bf16 bits with
dtype="bf16", which works everywhere.
"""
import sys

import numpy as np

import attnd


def to_bf16(x):
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)


def from_bf16(bits):
    return (bits.astype(np.uint32) << 16).view(np.float32)


def main():
    target = sys.argv[1] if len(sys.argv) > 1 else "127.0.0.1:50051"
    rng = np.random.default_rng(0)
    b, lq, lk, hq, hkv, d = 1, 128, 128, 8, 2, 128
    q = to_bf16(rng.standard_normal((b, lq, hq, d)))
    k = to_bf16(rng.standard_normal((b, lk, hkv, d)))
    v = to_bf16(rng.standard_normal((b, lk, hkv, d)))

    with attnd.Client(target) as client:
        o = client.attention(q, k, v, causal=True, dtype="bf16")

    # float64 reference: GQA by repeating K/V heads, top-left causal.
    qf, kf, vf = (from_bf16(x).astype(np.float64) for x in (q, k, v))
    kf, vf = np.repeat(kf, hq // hkv, axis=2), np.repeat(vf, hq // hkv, axis=2)
    s = np.einsum("bqhd,bkhd->bhqk", qf, kf) / np.sqrt(d)
    s = np.where(np.tril(np.ones((lq, lk), bool)), s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    ref = np.einsum("bhqk,bkhd->bqhd", p / p.sum(-1, keepdims=True), vf)
    print(f"O {o.shape}, max |O - O_f64| = {np.abs(from_bf16(o) - ref).max():.4g}")


if __name__ == "__main__":
    main()
