"""A small Llama-style decoder block in plain PyTorch whose attention runs in attnd: a prefill, then a few decode
steps, each compared with the same block using torch's own attention.

    python3 llama_block.py [TARGET] [--device cuda]

With --device cuda and a server on this host started with --enable_cuda_ipc, the tensors go by CUDA IPC (target
unix:/path of the server's --unix_socket). Decode steps send the whole KV cache each time: attnd's KV sequences
API (keeping the cache on the server) does not exist yet.
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

    def forward(self, x, start, cache, attention):
        """x [batch, seq, dim] at positions start.. ; cache: dict with 'k', 'v' [batch, len, kv_heads, head_dim]."""
        b, l, _ = x.shape
        pos = torch.arange(start, start + l, device=x.device)
        h = self.norm1(x)
        q = rope(self.wq(h).view(b, l, self.heads, self.head_dim), pos)
        k = rope(self.wk(h).view(b, l, self.kv_heads, self.head_dim), pos)
        v = self.wv(h).view(b, l, self.kv_heads, self.head_dim)
        cache["k"] = k if cache.get("k") is None else torch.cat((cache["k"], k), 1)
        cache["v"] = v if cache.get("v") is None else torch.cat((cache["v"], v), 1)
        # Queries are the last l positions of the cache: bottom-right causal.
        a = attention(q, cache["k"], cache["v"], True)
        x = x + self.wo(a.reshape(b, l, -1))
        h = self.norm2(x)
        return x + self.w2(torch.nn.functional.silu(self.w1(h)) * self.w3(h))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("target", nargs="?", default="127.0.0.1:50051")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--prefill", type=int, default=64)
    ap.add_argument("--steps", type=int, default=4)
    args = ap.parse_args()
    torch.manual_seed(0)
    dev = torch.device(args.device)
    block = Block().to(dev, torch.bfloat16).eval()
    x = torch.randn(1, args.prefill, 512, device=dev).to(torch.bfloat16)

    with attnd.Client(args.target) as client, torch.no_grad():
        def attnd_attention(q, k, v, causal):
            return client.attention(q, k, v, causal="bottom_right" if causal else False)

        ours, theirs = {}, {}
        y = block(x, 0, ours, attnd_attention)
        y_ref = block(x, 0, theirs, torch_attention)
        print(f"prefill {args.prefill} tokens: max |attnd - torch| = {(y - y_ref).abs().max().item():.4g}")
        pos = args.prefill
        tok, tok_ref = y[:, -1:], y_ref[:, -1:]
        for step in range(args.steps):
            tok = block(tok, pos, ours, attnd_attention)
            tok_ref = block(tok_ref, pos, theirs, torch_attention)
            pos += 1
            print(f"decode step {step} (kv {pos}): max |attnd - torch| = {(tok - tok_ref).abs().max().item():.4g}")


if __name__ == "__main__":
    main()
