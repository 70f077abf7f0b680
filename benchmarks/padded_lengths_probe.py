"""Padded batch: one launch with lengths (gluon_lengths) vs one call per row (pieces) vs the dense batch; key-pass
tiles for the lengths path. Paired rounds."""
import functools, json, os, statistics, sys
import torch
from triton.testing import do_bench
from streamkl import attention_kl, dispatch
from streamkl._triton_common.tiles import LaunchConfig
import streamkl._hopper.backward as hb

real_select = dispatch.select
PIECES = [r for r in dispatch.TABLE if r.kernel == "pieces"][0]
def no_lengths(stage, q):
    return PIECES if stage == "padded batch" else real_select(stage, q)

real_cfg = hb.ws_key_pass_config
def shape_case(d, causal, fractions, n=8192, b=4, h=16, dtype=torch.bfloat16):
    g = torch.Generator(device="cuda").manual_seed(0)
    t = [torch.randn(b, h, n, d, device="cuda", dtype=dtype, generator=g).requires_grad_(i >= 2) for i in range(4)]
    lengths = [round(f * n) for f in fractions]
    mask = torch.arange(n, device="cuda") < torch.tensor(lengths, device="cuda")[:, None]
    if causal:
        work = sum(L * (L + 1) / 2 for L in lengths) / (b * n * (n + 1) / 2)
    else:
        work = sum(L * L for L in lengths) / (b * n * n)
    return t, mask, work

def fn(t, causal, mask):
    kw = dict(key_padding_mask=mask, query_mask=mask) if mask is not None else {}
    def run():
        kl = attention_kl(*t, causal=causal, reduction="mean", **kw)
        torch.autograd.grad(kl, (t[2], t[3]))
    return run

def main():
  out = {}
  for d, causal in ((64, True), (128, True), (64, False)):
      t, mask, work = shape_case(d, causal, (1.0, 0.8, 0.55, 0.3))
      variants = {"dense": lambda: fn(t, causal, None), "lengths": lambda: fn(t, causal, mask)}
      def pieces():
          f = fn(t, causal, mask)
          def run():
              dispatch.select = no_lengths
              try: f()
              finally: dispatch.select = real_select
          return run
      variants["pieces"] = pieces
      if d == 64:
          for cfg in ((64, 64, 4, 2), (64, 64, 4, 3), (64, 64, 4, 4)):
              def with_cfg(cfg=cfg):
                  f = fn(t, causal, mask)
                  def run():
                      hb.ws_key_pass_config = lambda da, db: LaunchConfig(*cfg)
                      try: f()
                      finally: hb.ws_key_pass_config = real_cfg
                  return run
              variants[f"lengths bm{cfg[0]} st{cfg[3]}"] = with_cfg
      fns = {k: v() for k, v in variants.items()}
      for f in fns.values(): f()
      torch.cuda.synchronize()
      times = {k: [] for k in fns}
      for r in range(5):
          for k, f in fns.items():
              times[k].append(do_bench(f, warmup=25, rep=150))
      med = {k: statistics.median(v) for k, v in times.items()}
      name = f"D{d}{'-causal' if causal else ''}"
      out[name] = {"work": work, "ms": med, "rounds": times,
                   "same_work": {k: med[k] / (med["dense"] * work) for k in med if k != "dense"}}
      print(name, "work", round(work, 3), {k: round(v, 3) for k, v in med.items()},
            {k: round(v, 3) for k, v in out[name]["same_work"].items()}, flush=True)
  json.dump(out, open(os.path.join(os.environ.get("OUT", "/tmp"), "lenbench.json"), "w"), indent=1)

if __name__ == "__main__":
    main()
