"""A Llama-shaped decoder serving a batch of sequences with its attention in attnd KV sequences,
measured beside the same model running torch's own attention (SDPA) over a torch KV cache.

This is the engine shape of docs/sequences.md: the weights, norms, projections, RoPE and MLP stay
in this process, attnd keeps every layer's K and V, and each layer's attention is one Step for the
whole batch. The prefill sends the prompts' rows (CUDA tensors by reference, in one Step; host tensors inline,
in passes of --prefill_batch sequences that keep a Step within the server's message limits), each
decode step one row per sequence; attnd
appends k and v and attends q causally over everything it has cached. The baseline is the same
model (the same weights object) with a preallocated torch cache and
torch.nn.functional.scaled_dot_product_attention, pinned to one backend on CUDA (--sdpa_kernel).

With --backend both (the default) the two run in lock step on the same prompts, both fed the tokens
the SDPA model picks, and their logits are compared at every step: the run exits 1 when the relative
error passes --tolerance. Then each back end is timed alone: decode tokens/s, and for one layer's
attention call its device time (CUDA events on the current stream) and its host time.

The default shape is Llama 3 8B's (32 layers, 32:8 heads of 128, hidden 4096, MLP 14336) with random
weights: 64 sequences of a 1792-token prompt, then 256 decode steps. K and V take 128 KiB a token
(32 layers x 8 heads x 128 x 2 x bf16), so the sequences need about 16.1 GiB of pool at their
longest (the timing pass adds --timing_steps tokens to the 2048):

    attnd --backend=cuda --enable_cuda_ipc --unix_socket=/tmp/attnd.sock \\
        --shm_socket=/tmp/attnd-shm.sock --kv_pool_mb=20480
    python3 llama_engine.py --target=unix:/tmp/attnd.sock --json=engine.json

The model's weights (about 15 GB) and the SDPA cache (about 17 GB) share the GPU with that pool.

The baseline's kernel is torch's FlashAttention by default: torch's cuDNN attention builds a cuDNN
graph for each new key length (about 57 ms of host time on an H200 with torch 2.11), and every
decode step brings one, so a cuDNN decode (--sdpa_kernel=cudnn) is mostly those builds.

A tiny run on CPU, against a server started with --backend=cpu (CPU tensors travel inline):

    python3 llama_engine.py --device=cpu --target=127.0.0.1:50051 --layers=2 --batch=2 \\
        --heads=4 --kv_heads=2 --head_dim=64 --hidden=64 --intermediate=128 --vocab=100 \\
        --prompt=8 --steps=4 --warmup=1 --timing_steps=2
"""
import argparse
import contextlib
import json
import math
import sys
import time

import torch
import torch.nn.functional as F

import attnd

BF16 = torch.bfloat16
ROPE_THETA = 500000.0
NORM_EPS = 1e-5
# Sequences per prefill pass when --prefill_batch is 0: as many as keep one Step's q, k and v
# within this. A Step's request is one message (and its reply another): the server refuses one above
# --max_message_bytes (256 MiB by default), and a shared-memory channel's area is --shm_max_bytes
# (64 MiB by default).
PREFILL_STEP_BYTES = 64 << 20


# -- the model -------------------------------------------------------------------------------------

class Layer:
    """One decoder layer's weights, stored [in, out]: the projections are torch.mm and addmm_."""

    def __init__(self, cfg, randn):
        h, d, i = cfg.hidden, cfg.head_dim, cfg.intermediate
        qkv = (cfg.heads + 2 * cfg.kv_heads) * d
        # normal / sqrt(fan_in) keeps each projection's output O(1); the two that add to the
        # residual are scaled down by sqrt(2 x layers) more, so that it stays O(1) over the depth.
        depth = 1.0 / math.sqrt(2 * cfg.layers)
        self.attn_norm = torch.ones(h, dtype=BF16, device=cfg.device)
        self.wqkv = randn(h, qkv, 1.0 / math.sqrt(h))
        self.wo = randn(cfg.heads * d, h, depth / math.sqrt(cfg.heads * d))
        self.mlp_norm = torch.ones(h, dtype=BF16, device=cfg.device)
        self.w13 = randn(h, 2 * i, 1.0 / math.sqrt(h))  # gate and up, fused
        self.w2 = randn(i, h, depth / math.sqrt(i))


def rope_views(x, out):
    """What rope_into reads and writes: x, out and their halves on head_dim."""
    half = x.shape[-1] // 2
    return x, out, x[..., :half], x[..., half:], out[..., :half], out[..., half:]


def rope_into(views, cos, sin):
    """Rotary embedding, rotate-half form: out = x cos + rotate_half(x) sin, rotate_half(x) being
    [-x_hi, x_lo]. views: rope_views(x, out); cos [.., head_dim] and sin [.., head_dim / 2]
    broadcast over the rows and heads. Three kernels and no temporaries."""
    x, out, x_lo, x_hi, out_lo, out_hi = views
    torch.mul(x, cos, out=out)
    out_lo.addcmul_(x_hi, sin, value=-1.0)
    out_hi.addcmul_(x_lo, sin)
    return out


class Workspace:
    """A decode step's tensors, made once: the step writes into them (out=, in place) instead of
    allocating. Their views are made here too: a slice costs host time each time it is taken."""

    def __init__(self, cfg):
        b, d, hq, hkv, i = cfg.batch, cfg.head_dim, cfg.heads, cfg.kv_heads, cfg.intermediate

        def empty(*shape):
            return torch.empty(shape, dtype=BF16, device=cfg.device)

        self.x = empty(b, cfg.hidden)  # the residual stream
        self.qkv = empty(b, (hq + 2 * hkv) * d)
        # q and k after RoPE: contiguous [rows, heads, head_dim], as a Step reads them. v stays a
        # strided view of the projection; each back end copies it where it needs to.
        self.q, self.k = empty(b, hq, d), empty(b, hkv, d)
        self.v = self.qkv[:, (hq + hkv) * d:].view(b, hkv, d)
        self.rope_q = rope_views(self.qkv[:, :hq * d].view(b, hq, d), self.q)
        self.rope_k = rope_views(self.qkv[:, hq * d:(hq + hkv) * d].view(b, hkv, d), self.k)
        self.gu = empty(b, 2 * i)
        self.gate, self.up = self.gu[:, :i], self.gu[:, i:]
        self.act = empty(b, i)


class Llama:
    """Random bf16 weights (seeded) and the forward passes. Attention is a back end's
    (SdpaAttention, AttndAttention): attn.prefill(layer, first, count, q, k, v) for the prompts of
    sequences first..first+count-1 and attn.decode(layer, pos, q, k, v) for one token of every
    sequence, each returning O like q: [rows, heads, head_dim], the sequences' rows back to back."""

    def __init__(self, cfg, seed):
        self.cfg = cfg
        self.gen = torch.Generator(device=cfg.device)
        self.gen.manual_seed(seed)

        def randn(rows, cols, std):
            w = torch.randn(rows, cols, generator=self.gen, device=cfg.device)
            return w.mul_(std).to(BF16)

        self.embed = randn(cfg.vocab, cfg.hidden, 1.0)
        self.layers = [Layer(cfg, randn) for _ in range(cfg.layers)]
        self.final_norm = torch.ones(cfg.hidden, dtype=BF16, device=cfg.device)
        self.lm_head = randn(cfg.hidden, cfg.vocab, 1.0 / math.sqrt(cfg.hidden))
        # RoPE tables for every position the run reaches, computed in float32 and kept in bf16: RoPE
        # is then same-dtype kernels (CPU torch does not take mixed dtypes in place everywhere).
        d = cfg.head_dim
        f32 = dict(dtype=torch.float32, device=cfg.device)
        inv_freq = ROPE_THETA ** (-torch.arange(0, d, 2, **f32) / d)
        angles = torch.arange(cfg.max_len, **f32)[:, None] * inv_freq
        self.cos = torch.cat((angles.cos(), angles.cos()), dim=-1).to(BF16)  # [max_len, head_dim]
        self.sin = angles.sin().to(BF16)  # [max_len, head_dim / 2]
        self.ws = Workspace(cfg)
        self._norm_shape = (cfg.hidden,)
        self._rms_norm = getattr(F, "rms_norm", None)  # torch 2.4 and later

    def random_prompts(self):
        c = self.cfg
        return torch.randint(0, c.vocab, (c.batch, c.prompt), generator=self.gen, device=c.device)

    def norm(self, x, weight):
        if self._rms_norm is not None:
            return self._rms_norm(x, self._norm_shape, weight, NORM_EPS)
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + NORM_EPS)
        return x32.to(x.dtype) * weight

    def logits(self, x):
        return torch.mm(self.norm(x, self.final_norm), self.lm_head)

    def prefill(self, attn, tokens, first):
        """The prompts tokens [count, prompt] of sequences first..: the logits [count, vocab] of
        their last position. Not timed, so it allocates as it goes."""
        c = self.cfg
        count, n = tokens.shape
        t = count * n
        hq, hkv, d = c.heads, c.kv_heads, c.head_dim
        cos = self.cos[:n].repeat(count, 1)[:, None]  # [t, 1, head_dim]: row r is at position r % n
        sin = self.sin[:n].repeat(count, 1)[:, None]
        x = F.embedding(tokens.reshape(-1), self.embed)
        for layer, w in enumerate(self.layers):
            qkv = torch.mm(self.norm(x, w.attn_norm), w.wqkv)
            q_in = qkv[:, :hq * d].view(t, hq, d)
            k_in = qkv[:, hq * d:(hq + hkv) * d].view(t, hkv, d)
            q = rope_into(rope_views(q_in, torch.empty_like(q_in)), cos, sin)
            k = rope_into(rope_views(k_in, torch.empty_like(k_in)), cos, sin)
            v = qkv[:, (hq + hkv) * d:].view(t, hkv, d)
            o = attn.prefill(layer, first, count, q, k, v)
            x.addmm_(o.reshape(t, hq * d), w.wo)
            gu = torch.mm(self.norm(x, w.mlp_norm), w.w13)
            x.addmm_(F.silu(gu[:, :c.intermediate]) * gu[:, c.intermediate:], w.w2)
        return self.logits(x.view(count, n, c.hidden)[:, -1])

    def decode(self, attn, tokens, pos, probe=None):
        """One token of every sequence, tokens [batch], at position pos: the logits [batch, vocab].
        probe(fn, *args), when given, makes each layer's attention call (the timing pass)."""
        ws, batch = self.ws, self.cfg.batch
        cos, sin = self.cos[pos], self.sin[pos]  # every sequence is at the same position
        torch.index_select(self.embed, 0, tokens, out=ws.x)
        for layer, w in enumerate(self.layers):
            torch.mm(self.norm(ws.x, w.attn_norm), w.wqkv, out=ws.qkv)
            rope_into(ws.rope_q, cos, sin)
            rope_into(ws.rope_k, cos, sin)
            if probe is None:
                o = attn.decode(layer, pos, ws.q, ws.k, ws.v)
            else:
                o = probe(attn.decode, layer, pos, ws.q, ws.k, ws.v)
            ws.x.addmm_(o.reshape(batch, -1), w.wo)
            torch.mm(self.norm(ws.x, w.mlp_norm), w.w13, out=ws.gu)
            F.silu(ws.gate, inplace=True)
            torch.mul(ws.gate, ws.up, out=ws.act)
            ws.x.addmm_(ws.act, w.w2)
        return self.logits(ws.x)


# -- attention back ends ---------------------------------------------------------------------------

def _sdpa_takes_gqa():
    """Whether this torch's SDPA takes enable_gqa (2.5 and later)."""
    if not hasattr(F, "scaled_dot_product_attention"):
        return False
    q, kv = torch.zeros(1, 2, 1, 8), torch.zeros(1, 1, 1, 8)
    try:
        F.scaled_dot_product_attention(q, kv, kv, enable_gqa=True)
    except TypeError:
        return False
    return True


def _attention_repeat_kv(q, k, v, is_causal=False, enable_gqa=True):
    """SDPA's result on a torch without enable_gqa (or without SDPA): K and V heads repeated, and
    the attention in float32."""
    group = q.shape[1] // k.shape[1]
    k, v = (x.repeat_interleave(group, dim=1).float() for x in (k, v))
    s = q.float() @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if is_causal:
        future = torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).triu(1)
        s = s.masked_fill(future, float("-inf"))
    return (s.softmax(-1) @ v).to(q.dtype)


class SdpaAttention:
    """The baseline: a preallocated torch KV cache per layer, [batch, kv_heads, max_len, head_dim]
    (SDPA's layout, so that cache[:, :, :n] is read in place), and scaled_dot_product_attention."""

    def __init__(self, cfg):
        shape = (cfg.batch, cfg.kv_heads, cfg.max_len, cfg.head_dim)
        self.k = [torch.zeros(shape, dtype=BF16, device=cfg.device) for _ in range(cfg.layers)]
        self.v = [torch.zeros(shape, dtype=BF16, device=cfg.device) for _ in range(cfg.layers)]
        self.kernels = "default"
        self._scope = contextlib.ExitStack()
        want = cfg.sdpa_kernel
        if not _sdpa_takes_gqa():
            print(f"note: torch {torch.__version__} has no scaled_dot_product_attention with "
                  "enable_gqa: the SDPA back end repeats K/V heads and computes in float32")
            self._sdpa = _attention_repeat_kv
            return
        self._sdpa = F.scaled_dot_product_attention
        if want == "default":
            return
        if cfg.device.type != "cuda":
            print(f"note: {want} attention needs CUDA: torch's default SDPA kernels on "
                  f"{cfg.device}")
            return
        # Pinned for the whole run rather than per call, since the context manager's own host time
        # would be charged to every layer of the baseline. Only SDPA reads these flags.
        from torch.nn.attention import SDPBackend, sdpa_kernel
        backend = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION}[want]
        self._scope.enter_context(sdpa_kernel(backend))
        self.kernels = want

    def _attend(self, q, k, v, causal):
        try:
            return self._sdpa(q, k, v, is_causal=causal, enable_gqa=True)
        except RuntimeError as e:  # "No available kernel": the pinned kernel refuses this shape
            if self.kernels == "default":
                raise
            print(f"note: {self.kernels} attention refused q {list(q.shape)}, k {list(k.shape)} "
                  f"({e}); torch's default SDPA kernels from here on")
            self._scope.close()
            self.kernels = "default"
            return self._sdpa(q, k, v, is_causal=causal, enable_gqa=True)

    def prefill(self, layer, first, count, q, k, v):
        t, hq, d = q.shape
        n = t // count
        kc = self.k[layer][first:first + count, :, :n]
        vc = self.v[layer][first:first + count, :, :n]
        kc.copy_(k.view(count, n, -1, d).transpose(1, 2))
        vc.copy_(v.view(count, n, -1, d).transpose(1, 2))
        o = self._attend(q.view(count, n, hq, d).transpose(1, 2), kc, vc, True)
        return o.transpose(1, 2).reshape(t, hq, d)

    def decode(self, layer, pos, q, k, v):
        kc, vc = self.k[layer], self.v[layer]
        kc[:, :, pos].copy_(k)
        vc[:, :, pos].copy_(v)
        # The query is the last position, so it sees every cached key: no mask.
        return self._attend(q.unsqueeze(2), kc[:, :, :pos + 1], vc[:, :, :pos + 1], False)

    def reset(self):
        pass  # the next prefill writes the cache from position 0

    def close(self):
        self._scope.close()


class AttndAttention:
    """K and V in attnd: a KV sequence per batch row, a layer per decoder layer. A call sends the
    new rows only (q, k, v [rows, heads, head_dim], the sequences' rows back to back) and gets O."""

    def __init__(self, client, cfg):
        self.client = client
        self.wait = cfg.wait
        self.seqs = client.open_sequence(layers=cfg.layers, kv_heads=cfg.kv_heads,
                                         head_dim=cfg.head_dim, dtype="bf16", count=cfg.batch)
        # A StepBatch (client.batch) takes the sequence list once, where client.step checks and
        # packs it on every call; both send the same Step. Older packages have client.step only.
        self.api = "client.batch" if hasattr(client, "batch") else "client.step"
        self._batches = []
        self._decode_step = self._stepper(self.seqs)
        self._prefill_steps = {}
        # The decode step's v, contiguous as a Step reads it, and its O, written in place rather
        # than allocated per layer.
        self.v = torch.empty(cfg.batch, cfg.kv_heads, cfg.head_dim, dtype=BF16, device=cfg.device)
        self.out = torch.empty(cfg.batch, cfg.heads, cfg.head_dim, dtype=BF16, device=cfg.device)

    def _stepper(self, seqs):
        """step(layer, q, k, v, out=None) -> O for these sequences, rows // len(seqs) rows each."""
        if self.api == "client.batch":
            try:
                # wait=False: the call returns before the step runs, so this process queues the layer's output
                # projection and MLP while attnd attends (the current stream waits for the step on the GPU).
                b = self.client.batch(seqs, wait=self.wait)
            except TypeError:  # an older package: every step waits
                b = self.client.batch(seqs)
            self._batches.append(b)
            return b.step
        client, n = self.client, len(seqs)

        def step(layer, q, k, v, out=None):
            return client.step(layer, seqs, q, k, v, tokens=q.shape[0] // n, out=out)
        return step

    def prefill(self, layer, first, count, q, k, v):
        step = self._prefill_steps.get(first)
        if step is None:
            step = self._prefill_steps[first] = self._stepper(self.seqs[first:first + count])
        return step(layer, q, k, v.contiguous())

    def decode(self, layer, pos, q, k, v):
        self.v.copy_(v)
        return self._decode_step(layer, q, k, self.v, out=self.out)

    def reset(self):
        for s in self.seqs:
            s.truncate(0)

    def close(self):
        for b in self._batches:
            close = getattr(b, "close", None)  # a batch may hold the client library's packed ids
            if close is not None:
                close()
        self.client.close_sequences(self.seqs)


# -- runs ------------------------------------------------------------------------------------------

def prefill_all(model, attn, prompts, group):
    """Every sequence's prompt, `group` sequences a pass: the logits [batch, vocab] of the last
    position."""
    return torch.cat([model.prefill(attn, prompts[i:i + group], i)
                      for i in range(0, prompts.shape[0], group)])


def compare(model, ref, ours, prompts, cfg):
    """Both in lock step, each fed the reference's tokens: per step, our logits against its."""
    rows = []
    agree = 0

    def record(step, got, want):
        nonlocal agree
        got, want = got.float(), want.float()
        diff = (got - want).abs().max().item()
        rel = diff / max(want.abs().max().item(), 1e-30)
        same = (got.argmax(-1) == want.argmax(-1)).sum().item()
        agree += same
        rows.append({"step": step, "max_abs": diff, "max_rel": rel, "top1": same / got.shape[0]})

    want = prefill_all(model, ref, prompts, cfg.prefill_batch)
    record("prefill", prefill_all(model, ours, prompts, cfg.prefill_batch), want)
    pos = cfg.prompt
    for i in range(cfg.steps):
        tokens = want.argmax(-1)
        want = model.decode(ref, tokens, pos)
        record(i, model.decode(ours, tokens, pos), want)
        pos += 1
    # The JSON gets every step; the log a few, and every step past the tolerance (NaN included).
    every = max(1, cfg.steps // 16)
    for r in rows:
        bad = not r["max_rel"] <= cfg.tolerance
        if bad or r["step"] == "prefill" or r["step"] % every == 0 or r["step"] == cfg.steps - 1:
            print(f"  step {r['step']!s:>7}: max |attnd - sdpa| {r['max_abs']:.4g}, relative "
                  f"{r['max_rel']:.3e}, top-1 agreement {r['top1']:.3f}{'  FAIL' if bad else ''}")
    worst = max(r["max_rel"] if r["max_rel"] == r["max_rel"] else math.inf for r in rows)
    return {"steps": rows, "max_rel_err": worst, "top1_agreement": agree / (len(rows) * cfg.batch)}


class AttentionTimer:
    """A probe for Llama.decode: CUDA events on the current stream, and perf_counter, around each
    attention call."""

    def __init__(self, calls, cuda):
        self.cuda = cuda
        self.host = [0.0] * calls
        self.events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                       for _ in range(calls)] if cuda else []
        self.n = 0

    def __call__(self, fn, *args):
        i = self.n
        if self.cuda:
            self.events[i][0].record()
        t0 = time.perf_counter()
        o = fn(*args)
        self.host[i] = time.perf_counter() - t0
        if self.cuda:
            self.events[i][1].record()
        self.n = i + 1
        return o

    def summary(self):
        n = self.n
        out = {"attention_calls": n, "attention_host_us": 1e6 * sum(self.host[:n]) / n,
               "attention_device_us": None}
        if self.cuda:
            torch.cuda.synchronize()
            ms = sum(start.elapsed_time(end) for start, end in self.events[:n])
            out["attention_device_us"] = 1e3 * ms / n
        return out


def measure(model, attn, prompts, cfg):
    """One back end alone: the prefill, --warmup untimed decode steps, the timed rest of --steps,
    then the attention timing pass of --timing_steps more steps."""
    cuda = cfg.device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    attn.reset()
    sync()
    t0 = time.perf_counter()
    tokens = prefill_all(model, attn, prompts, cfg.prefill_batch).argmax(-1)
    sync()
    prefill_s = time.perf_counter() - t0
    pos = cfg.prompt
    for _ in range(cfg.warmup):
        tokens = model.decode(attn, tokens, pos).argmax(-1)
        pos += 1
    timed = cfg.steps - cfg.warmup
    sync()
    t0 = time.perf_counter()
    for _ in range(timed):
        tokens = model.decode(attn, tokens, pos).argmax(-1)
        pos += 1
    sync()
    wall = time.perf_counter() - t0
    result = {"prefill_s": prefill_s, "decode_s": wall, "timed_steps": timed,
              "tokens_per_s": cfg.batch * timed / wall, "step_ms": 1e3 * wall / timed}
    if cfg.timing_steps:
        timer = AttentionTimer(cfg.timing_steps * cfg.layers, cuda)
        for _ in range(cfg.timing_steps):
            tokens = model.decode(attn, tokens, pos, probe=timer).argmax(-1)
            pos += 1
        result.update(timer.summary())
    if isinstance(attn, SdpaAttention):
        result["kernels"] = attn.kernels
    else:
        result["api"] = attn.api if attn.wait else attn.api + "(wait=False)"
    return result


def print_table(report, names):
    def fmt(x, spec):
        return "-" if x is None else format(x, spec)

    print(f"{'backend':<8} {'tokens/s':>10} {'step ms':>9} {'attn device us':>15} "
          f"{'attn host us':>13}")
    for name in names:
        r = report[name]
        print(f"{name:<8} {r['tokens_per_s']:>10.1f} {r['step_ms']:>9.2f} "
              f"{fmt(r.get('attention_device_us'), '.1f'):>15} "
              f"{fmt(r.get('attention_host_us'), '.1f'):>13}")
    if report["ratio_tokens_per_s"] is not None:
        print(f"attnd / sdpa tokens/s: {report['ratio_tokens_per_s']:.3f}")


def write_json(path, report):
    if path:
        with open(path, "w") as f:
            json.dump(report, f, indent=2)
            f.write("\n")


SHAPE = ("layers", "heads", "kv_heads", "head_dim", "hidden", "intermediate", "vocab", "batch",
         "prompt", "steps")


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default="unix:/tmp/attnd.sock", help="host:port or unix:PATH")
    ap.add_argument("--transport", default="auto", choices=("auto", "unary", "stream", "shm"))
    ap.add_argument("--shm_socket", default=None, help="the server's --shm_socket (transport shm)")
    ap.add_argument("--token", default=None, help="bearer token (a server with --auth_token_file)")
    ap.add_argument("--backend", default="both", choices=("sdpa", "attnd", "both"))
    ap.add_argument("--sdpa_kernel", default="flash", choices=("cudnn", "flash", "default"),
                    help="the SDPA back end's kernel on CUDA (default: torch picks)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--heads", type=int, default=32, help="query heads")
    ap.add_argument("--kv_heads", type=int, default=8)
    ap.add_argument("--head_dim", type=int, default=128)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--intermediate", type=int, default=14336)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--batch", type=int, default=64, help="sequences")
    ap.add_argument("--prompt", type=int, default=1792, help="prompt tokens per sequence")
    ap.add_argument("--steps", type=int, default=256, help="greedy decode steps")
    ap.add_argument("--prefill_batch", type=int, default=0,
                    help="sequences per prefill pass (0: all on CUDA, else as many as keep a Step within 64 MiB)")
    ap.add_argument("--wait", action="store_true",
                    help="attnd's steps return after they ran (default: before, ordered on the stream)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--warmup", type=int, default=4, help="decode steps left out of the timing")
    ap.add_argument("--timing_steps", type=int, default=8, help="decode steps of the timing pass")
    ap.add_argument("--tolerance", type=float, default=0.05,
                    help="largest relative logits error (--backend both)")
    ap.add_argument("--json", default=None, help="write the figures here")
    args = ap.parse_args(argv)
    for name in SHAPE:
        if getattr(args, name) < 1:
            ap.error(f"--{name} must be at least 1")
    if args.heads % args.kv_heads:
        ap.error("--heads must be a multiple of --kv_heads")
    if args.head_dim % 2:
        ap.error("--head_dim must be even (RoPE)")
    if not 0 <= args.warmup < args.steps:
        ap.error("--warmup must be at least 0 and less than --steps")
    if args.timing_steps < 0 or args.prefill_batch < 0:
        ap.error("--timing_steps and --prefill_batch must not be negative")
    args.device = torch.device(args.device)
    args.max_len = args.prompt + args.steps + args.timing_steps
    if args.prefill_batch == 0 and args.device.type == "cuda":
        args.prefill_batch = args.batch  # CUDA tensors travel as references: one Step takes every prompt
    elif args.prefill_batch == 0:
        step_bytes = 2 * (args.heads + 2 * args.kv_heads) * args.head_dim * args.prompt
        args.prefill_batch = max(1, PREFILL_STEP_BYTES // step_bytes)
    args.prefill_batch = min(args.prefill_batch, args.batch)
    return args


def main(argv=None) -> int:
    cfg = parse_args(argv)
    cuda = cfg.device.type == "cuda"
    if cuda and cfg.device.index is not None:
        torch.cuda.set_device(cfg.device)  # events and the current stream are the current device's
    config = {k: getattr(cfg, k) for k in SHAPE}
    config.update(prefill_batch=cfg.prefill_batch, seed=cfg.seed, warmup=cfg.warmup,
                  timing_steps=cfg.timing_steps, tolerance=cfg.tolerance, backend=cfg.backend,
                  sdpa_kernel=cfg.sdpa_kernel,
                  device=str(cfg.device),
                  device_name=torch.cuda.get_device_name(cfg.device) if cuda else "cpu",
                  target=cfg.target, transport=cfg.transport, wait=cfg.wait, torch=torch.__version__)
    report = {"config": config, "sdpa": None, "attnd": None, "ratio_tokens_per_s": None,
              "max_rel_err": None, "top1_agreement": None}
    names = ("sdpa", "attnd") if cfg.backend == "both" else (cfg.backend,)
    with torch.inference_mode(), contextlib.ExitStack() as stack:
        model = Llama(cfg, cfg.seed)
        prompts = model.random_prompts()
        backends = {}
        if "sdpa" in names:
            backends["sdpa"] = SdpaAttention(cfg)
            stack.callback(backends["sdpa"].close)
        if "attnd" in names:
            client = stack.enter_context(attnd.Client(cfg.target, transport=cfg.transport,
                                                      shm_socket=cfg.shm_socket, token=cfg.token))
            backends["attnd"] = AttndAttention(client, cfg)
            stack.callback(backends["attnd"].close)  # unwinds before the client closes
        print(f"{cfg.layers} layers, {cfg.heads}:{cfg.kv_heads} heads of {cfg.head_dim}, hidden "
              f"{cfg.hidden}: {cfg.batch} sequences x ({cfg.prompt} prompt + {cfg.steps} decode) "
              f"on {cfg.device}")

        if cfg.backend == "both":
            print("lock step, attnd's logits against sdpa's:")
            lock = compare(model, backends["sdpa"], backends["attnd"], prompts, cfg)
            report.update(compare=lock["steps"], max_rel_err=lock["max_rel_err"],
                          top1_agreement=lock["top1_agreement"])
            print(f"max relative error {lock['max_rel_err']:.3e} (tolerance {cfg.tolerance}), "
                  f"top-1 agreement {lock['top1_agreement']:.4f}")
            if not lock["max_rel_err"] <= cfg.tolerance:
                # The timing of a model that computes something else is not worth reporting.
                print("FAIL: attnd's logits differ from sdpa's beyond --tolerance", file=sys.stderr)
                write_json(cfg.json, report)
                return 1

        for name in names:
            report[name] = measure(model, backends[name], prompts, cfg)
        if cfg.backend == "both":
            report["ratio_tokens_per_s"] = (report["attnd"]["tokens_per_s"]
                                            / report["sdpa"]["tokens_per_s"])
        print_table(report, names)
        write_json(cfg.json, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
