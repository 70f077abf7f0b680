"""Where the padded batch's time goes: per variant, wall per call (events around one call, after a sync) and the sum of
its kernels' GPU time, from torch.profiler; the kernels listed."""
import torch, sys
from torch.profiler import profile, ProfilerActivity
sys.path.insert(0, "benchmarks")
import padded_lengths_probe as lb
from streamkl import dispatch

for d, causal in ((128, True), (64, True)):
    t, mask, work = lb.shape_case(d, causal, (1.0, 0.8, 0.55, 0.3))
    runs = {"dense": lb.fn(t, causal, None), "lengths": lb.fn(t, causal, mask)}
    f = lb.fn(t, causal, mask)
    def pieces(f=f):
        dispatch.select = lb.no_lengths
        try: f()
        finally: dispatch.select = lb.real_select
    runs["pieces"] = pieces
    for name, fn in runs.items():
        for _ in range(3): fn()
        torch.cuda.synchronize()
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        walls = []
        for _ in range(5):
            torch.cuda.synchronize(); s.record(); fn(); e.record(); torch.cuda.synchronize(); walls.append(s.elapsed_time(e))
        with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
            fn(); torch.cuda.synchronize()
        ev = [x for x in prof.key_averages() if x.device_type.name == "CUDA" or getattr(x, "self_device_time_total", 0) > 0]
        kern = sorted(((x.key, x.self_device_time_total / 1e3, x.count) for x in prof.key_averages()
                       if x.self_device_time_total > 0), key=lambda r: -r[1])
        total = sum(k[1] for k in kern)
        print(f"D{d} causal={causal} {name}: wall {sorted(walls)[2]:.3f} ms, kernels {total:.3f} ms", flush=True)
        for k in kern[:8]:
            print(f"    {k[1]:8.3f} ms x{k[2]:3d}  {k[0][:90]}")
