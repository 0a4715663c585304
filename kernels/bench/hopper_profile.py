#!/usr/bin/env python3
"""Where the sustained benchmark's time goes: clocks and power under load, and single launches for ncu.

  power: each kernel (attnd's and cuDNN's through torch SDPA, same inputs) runs back to back for --seconds
         while nvidia-smi samples the SM clock, power and throttle reasons every 50 ms; prints per kernel the
         TFLOP/s over the phase with the mean clock and power, so a kernel's speed per clock cycle can be told
         apart from the clock it ran at.
  once:  --launches launches of each kernel, nothing else (for `ncu -k ...` to pick one by name).

  python3 hopper_profile.py --lib path/libattnd_kernels_c.so power|once [--shapes d128nc16k,...]
Shapes: d<head_dim><nc|c><seq>, batch x seq = 16k tokens, hidden 2048 (hopper_bench.py's rows).
"""
import argparse
import re
import subprocess
import threading
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from hopper_bench import Attnd


def parse_shape(text):
    m = re.fullmatch(r"d(\d+)(nc|c)(\d+)(k?)", text)
    if not m:
        raise SystemExit(f"shape {text!r}: expected d<head_dim><nc|c><seq>[k], e.g. d128nc16k")
    d, seq = int(m.group(1)), int(m.group(3)) * (1024 if m.group(4) else 1)
    return dict(d=d, causal=m.group(2) == "c", seq=seq, batch=16384 // seq, heads=2048 // d)


class Sampler:
    """nvidia-smi in the background; phases are marked by wall-clock time."""

    def __init__(self):
        self.samples = []
        self.proc = subprocess.Popen(
            ["nvidia-smi", "--query-gpu=clocks.sm,power.draw,temperature.gpu,clocks_event_reasons.active",
             "--format=csv,noheader,nounits", "-lms", "50"],
            stdout=subprocess.PIPE, text=True)
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self):
        for line in self.proc.stdout:
            parts = [p.strip() for p in line.split(",")]
            if len(parts) >= 4:
                try:
                    self.samples.append((time.time(), float(parts[0]), float(parts[1]), float(parts[2]), parts[3]))
                except ValueError:
                    pass

    def between(self, t0, t1):
        return [s for s in self.samples if t0 <= s[0] <= t1]

    def stop(self):
        self.proc.terminate()


def kernels_for(attnd, shape, configs):
    b, s, h, d, causal = shape["batch"], shape["seq"], shape["heads"], shape["d"], shape["causal"]
    q = torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16)
    k = torch.randn_like(q)
    v = torch.randn_like(q)
    o = torch.full_like(q, float("nan"))
    qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    out = []

    def cudnn():
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            return F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)

    out.append(("cudnn", cudnn))
    for c in configs:
        plan, name = attnd.plan(q, k, v, o, causal, c)
        out.append((name, lambda plan=plan: attnd.launch(plan)))
    flops = 4.0 * b * h * s * s * d * (0.5 if causal else 1.0)
    return out, flops, (q, k, v, o)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--lib", required=True)
    ap.add_argument("mode", choices=("power", "once"))
    ap.add_argument("--shapes", default="d128nc16k,d128c16k,d256nc16k,d64nc16k")
    ap.add_argument("--configs", default="hopper")
    ap.add_argument("--seconds", type=float, default=2.0)
    ap.add_argument("--launches", type=int, default=3)
    args = ap.parse_args()
    attnd = Attnd(args.lib)
    configs = [c for c in args.configs.split(",") if c]
    sampler = Sampler() if args.mode == "power" else None
    if sampler:
        time.sleep(0.5)
        idle = sampler.between(time.time() - 0.5, time.time())
        if idle:
            print(f"idle: {sum(x[1] for x in idle) / len(idle):.0f} MHz, {sum(x[2] for x in idle) / len(idle):.0f} W")
        print(f"{'shape':>10} {'kernel':>34} {'TFLOP/s':>8} {'MHz':>6} {'W':>5} {'degC':>4} "
              f"{'TFLOP/s/GHz':>11}  reasons")
    for text in args.shapes.split(","):
        shape = parse_shape(text)
        kernels, flops, keep = kernels_for(attnd, shape, configs)
        for name, fn in kernels:
            fn()
            torch.cuda.synchronize()
            if args.mode == "once":
                for _ in range(args.launches):
                    fn()
                torch.cuda.synchronize()
                continue
            # Back to back, no L2 flush: the sustained state a loaded server sees.
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            t0 = time.time()
            n = 0
            start.record()
            while time.time() - t0 < args.seconds:
                for _ in range(10):
                    fn()
                n += 10
                torch.cuda.synchronize()
            end.record()
            torch.cuda.synchronize()
            t1 = time.time()
            ms = start.elapsed_time(end) / n
            tf = flops / ms / 1e9
            # The phase's second half: clocks settle after the first few hundred milliseconds.
            s = sampler.between(t0 + (t1 - t0) / 2, t1)
            mhz = sum(x[1] for x in s) / max(1, len(s))
            w = sum(x[2] for x in s) / max(1, len(s))
            temp = sum(x[3] for x in s) / max(1, len(s))
            reasons = sorted({x[4] for x in s})
            print(f"{text:>10} {name[:34]:>34} {tf:8.1f} {mhz:6.0f} {w:5.0f} {temp:4.0f} {tf / (mhz / 1000):11.1f}  "
                  f"{' '.join(reasons)}", flush=True)
        del keep
    if sampler:
        sampler.stop()


if __name__ == "__main__":
    main()
