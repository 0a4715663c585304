"""A small Llama-style decoder (a few blocks in plain PyTorch) whose attention runs in attnd: a prefill, then a
few decode steps, each compared with the same model using torch's own attention and KV cache.

    python3 llama_block.py [TARGET] [--device cuda] [--layers 2]

attnd keeps the KV cache: the model opens one KV sequence (docs/sequences.md) with a layer per block, and every
block's attention is one Step sending only the new tokens' q, k and v. CUDA tensors are copied through host
memory for steps.
"""
import argparse
import math

import torch

import attnd


class RMSNorm(torch.nn.Module):
    def __init__(self, dim, eps=1e-5):
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.ones(dim))

    def forward(self, x):
        x32 = x.float()
        return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype) * self.weight


def rope(x, pos, theta=10000.0):
    """Rotary embedding of x [batch, seq, heads, head_dim] at positions pos [seq]."""
    d = x.shape[-1]
    freqs = 1.0 / (theta ** (torch.arange(0, d, 2, device=x.device, dtype=torch.float32) / d))
    ang = pos.float()[:, None] * freqs[None, :]
    cos, sin = ang.cos()[None, :, None, :], ang.sin()[None, :, None, :]
    x1, x2 = x.float()[..., 0::2], x.float()[..., 1::2]
    out = torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)
    return out.to(x.dtype)


def torch_attention(q, k, v, causal):
    """[b, l, h, d] attention in float32 with torch (SDPA when this torch has it), bottom-right causal."""
    hq, hkv = q.shape[2], k.shape[2]
    qh, kh, vh = (x.transpose(1, 2).float() for x in (q, k, v))
    kh, vh = kh.repeat_interleave(hq // hkv, 1), vh.repeat_interleave(hq // hkv, 1)
    lq, lk = q.shape[1], k.shape[1]
    mask = None
    if causal:
        mask = torch.ones(lq, lk, dtype=torch.bool, device=q.device).tril(lk - lq)
    if hasattr(torch.nn.functional, "scaled_dot_product_attention"):
        o = torch.nn.functional.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask)
    else:
        s = qh @ kh.transpose(-1, -2) / math.sqrt(q.shape[-1])
        if mask is not None:
            s = s.masked_fill(~mask, float("-inf"))
        o = s.softmax(-1) @ vh
    return o.transpose(1, 2).to(q.dtype)


class Block(torch.nn.Module):
    def __init__(self, dim=512, heads=8, kv_heads=2, hidden=1408):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, dim // heads
        self.wq = torch.nn.Linear(dim, heads * self.head_dim, bias=False)
        self.wk = torch.nn.Linear(dim, kv_heads * self.head_dim, bias=False)
        self.wv = torch.nn.Linear(dim, kv_heads * self.head_dim, bias=False)
        self.wo = torch.nn.Linear(heads * self.head_dim, dim, bias=False)
        self.w1 = torch.nn.Linear(dim, hidden, bias=False)
        self.w2 = torch.nn.Linear(hidden, dim, bias=False)
        self.w3 = torch.nn.Linear(dim, hidden, bias=False)
        self.norm1, self.norm2 = RMSNorm(dim), RMSNorm(dim)

    def forward(self, x, start, layer, attend):
        """x [batch, seq, dim] at positions start.. ; attend(layer, q, k, v) appends k, v to the layer's cache and
        returns q's attention over all of it."""
        b, l, _ = x.shape
        pos = torch.arange(start, start + l, device=x.device)
        h = self.norm1(x)
        q = rope(self.wq(h).view(b, l, self.heads, self.head_dim), pos)
        k = rope(self.wk(h).view(b, l, self.kv_heads, self.head_dim), pos)
        v = self.wv(h).view(b, l, self.kv_heads, self.head_dim)
        a = attend(layer, q, k, v)
        x = x + self.wo(a.reshape(b, l, -1))
        h = self.norm2(x)
        return x + self.w2(torch.nn.functional.silu(self.w1(h)) * self.w3(h))


class TorchCache:
    """The reference: K and V per layer in local tensors, attention by torch."""

    def __init__(self, layers):
        self.k, self.v = [None] * layers, [None] * layers

    def __call__(self, layer, q, k, v):
        self.k[layer] = k if self.k[layer] is None else torch.cat((self.k[layer], k), 1)
        self.v[layer] = v if self.v[layer] is None else torch.cat((self.v[layer], v), 1)
        # Queries are the last l positions of the cache: bottom-right causal.
        return torch_attention(q, self.k[layer], self.v[layer], True)


class SequenceCache:
    """K and V in an attnd KV sequence: each call sends the new rows only (one sequence, so batch 1)."""

    def __init__(self, seq):
        self.seq = seq

    def __call__(self, layer, q, k, v):
        return self.seq.step(layer, q[0], k[0], v[0])[None]


def run(blocks, x, start, attend):
    for layer, block in enumerate(blocks):
        x = block(x, start, layer, attend)
    return x


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("target", nargs="?", default="127.0.0.1:50051")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--prefill", type=int, default=64)
    ap.add_argument("--steps", type=int, default=4)
    args = ap.parse_args()
    torch.manual_seed(0)
    dev = torch.device(args.device)
    blocks = [Block().to(dev, torch.bfloat16).eval() for _ in range(args.layers)]
    b0 = blocks[0]
    x = torch.randn(1, args.prefill, 512, device=dev).to(torch.bfloat16)

    with attnd.Client(args.target) as client, torch.no_grad(), \
            client.open_sequence(args.layers, b0.kv_heads, b0.head_dim, dtype="bf16") as seq:
        ours, theirs = SequenceCache(seq), TorchCache(args.layers)
        y = run(blocks, x, 0, ours)
        y_ref = run(blocks, x, 0, theirs)
        print(f"prefill {args.prefill} tokens: max |attnd - torch| = {(y - y_ref).abs().max().item():.4g}")
        pos = args.prefill
        tok, tok_ref = y[:, -1:], y_ref[:, -1:]
        for step in range(args.steps):
            tok = run(blocks, tok, pos, ours)
            tok_ref = run(blocks, tok_ref, pos, theirs)
            pos += 1
            print(f"decode step {step} (kv {pos}, cached in attnd: {seq.lengths[0]}): "
                  f"max |attnd - torch| = {(tok - tok_ref).abs().max().item():.4g}")


if __name__ == "__main__":
    main()
