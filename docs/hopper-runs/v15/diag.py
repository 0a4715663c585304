#!/usr/bin/env python3
"""v15 calls 2-6 (session 14; run on each call's build of kv2.diff): which q tiles of the _kv2 kernel are wrong,
and against which alternative reference they match.
Per 128-row tile: max |O - ref| against the fp32 reference, and for wrong tiles the alternatives: the Q of the
pair's other tile, keys of one half of each 128-key block only, V's halves swapped against K's."""
import sys
import torch
sys.path.insert(0, "kernels/bench")
from hopper_bench import Attnd

lib = Attnd(sys.argv[1])
cfgs = sys.argv[2].split(",")
torch.manual_seed(0)


def ref(q, k, v, keymask=None):
    qf, kf, vf = (t.float().transpose(1, 2) for t in (q, k, v))
    g = qf.shape[1] // kf.shape[1]
    kf, vf = kf.repeat_interleave(g, 1), vf.repeat_interleave(g, 1)
    s = (qf @ kf.transpose(-1, -2)) * q.shape[-1] ** -0.5
    if keymask is not None:
        s = s.masked_fill(~keymask, float("-inf"))
    return (s.softmax(-1) @ vf).transpose(1, 2)


def swap_halves(t):
    t = t.clone()
    n = t.shape[1] // 128 * 128
    blk = t[:, :n].reshape(t.shape[0], n // 128, 2, 64, *t.shape[2:])
    t[:, :n] = blk.flip(2).reshape(t.shape[0], n, *t.shape[2:])
    return t


for (b, sq, skv, h) in [(1, 256, 128, 1), (1, 256, 256, 1), (1, 129, 129, 2), (1, 512, 64, 1), (1, 1000, 1000, 2)]:
    q = torch.randn(b, sq, h, 128, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(b, skv, h, 128, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(b, skv, h, 128, device="cuda", dtype=torch.bfloat16)
    r = ref(q, k, v)
    kidx = torch.arange(skv, device="cuda")
    alts = {"keys%128<64": ref(q, k, v, (kidx % 128 < 64)), "keys%128>=64": ref(q, k, v, (kidx % 128 >= 64)),
            "Vhalves_swapped": ref(q, k, swap_halves(v)), "Khalves_swapped": ref(q, swap_halves(k), v)}
    for cfg in cfgs:
        o = torch.full_like(q, float("nan"))
        plan, name = lib.plan(q, k, v, o, False, cfg)
        lib.launch(plan)
        torch.cuda.synchronize()
        lib.lib.attnd_kernels_plan_destroy(plan)
        line = []
        for t in range((sq + 127) // 128):
            rows = slice(t * 128, min(sq, t * 128 + 128))
            ot = o[:, rows].float()
            nan = int(torch.isnan(ot).sum())
            err = float((ot - r[:, rows]).abs().nan_to_num(0).max())
            desc = f"t{t}: err {err:.3g} nan {nan}"
            if err > 0.02 or nan:
                for an, a in alts.items():
                    ae = float((ot - a[:, rows]).abs().nan_to_num(0).max())
                    if ae < 0.02:
                        desc += f" ~{an}"
                if t % 2 == 1:
                    pr = slice((t - 1) * 128, t * 128)
                    n = rows.stop - rows.start
                    ae = float((ot - r[:, pr][:, :n]).abs().nan_to_num(0).max())
                    desc += f" vsQprev {ae:.3g}"
                # per 16-row group / 64-row half
                halves = [float((o[:, t*128+x:min(sq, t*128+x+64)].float() - r[:, t*128+x:min(sq, t*128+x+64)]).abs().nan_to_num(0).max()) if t*128+x < sq else 0 for x in (0, 64)]
                desc += f" halves {halves[0]:.2g}/{halves[1]:.2g}"
            line.append(desc)
        print(f"{name} b{b} q{sq} kv{skv} h{h}:\n   " + "\n   ".join(line), flush=True)
