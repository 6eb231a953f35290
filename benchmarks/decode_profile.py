"""Where a decode step's time goes: one decode step with the KV cache against a plain `forward` of the
same [B, 1] tokens with no cache, plus the compiled step's cost and memory analysis.

  .venv/bin/python benchmarks/decode_profile.py qwen3-0.6b

Prints the cache size, the decode step's FLOPs and bytes accessed (`compiled.cost_analysis()`), its
`memory_analysis()` (a temp the size of the cache means the step copies the cache), and 5 timed
steps of each (process CPU seconds / wall seconds) after 2 warm-up steps. Batch 8, a 32-token
prompt, a 512-slot cache, float32, one device.
"""
import os, time, sys
os.environ.setdefault("JAX_PLATFORMS", "cpu")
import jax, jax.numpy as jnp, numpy as np
import meshlm
from meshlm.models import decoder, generate as G
from meshlm.parallel.mesh import make_mesh
model = sys.argv[1] if len(sys.argv) > 1 else "qwen3-0.6b"
extra = sys.argv[2:]
cfg = meshlm.load_config(f"model={model}", "train.compute_dtype=float32", "cpu_devices=1", "mesh.fsdp=1", *extra)
print("scan_layers", cfg.scan_layers, "remat", cfg.remat, "layers", cfg.model.num_layers)
mesh = make_mesh(cfg)
t=time.process_time(); params = decoder.init_params(cfg, jax.random.key(0), mesh); print("init cpu s", time.process_time()-t)
prefill, decode = G._steps(cfg.model_dump_json(), mesh, 0.0, None, 1.0)
B=8
block = np.ones((B, 32), np.int32); lengths = np.full(B, 32, np.int32)
with jax.set_mesh(mesh):
  tok, lp, cache = prefill(params, block, lengths, jax.random.key(1), cache_len=512)
  print("cache bytes", sum(a.nbytes for a in jax.tree.leaves(cache))/1e6, "MB")
  lowered = decode.lower(params, tok, jnp.asarray(lengths), cache, jax.random.key(2))
  comp = lowered.compile()
  ca = comp.cost_analysis(); ca = ca[0] if isinstance(ca, list) else ca
  print("decode flops", ca.get("flops"), "bytes accessed", ca.get("bytes accessed"))
  print(comp.memory_analysis())
  txt = comp.as_text()
  print("copies in decode HLO:", txt.count(" copy("), "while:", txt.count(" while("), "dynamic-update-slice:", txt.count("dynamic-update-slice("))
  for i in range(2):
    tok, lp, cache = decode(params, tok, jnp.asarray(lengths + i), cache, jax.random.key(3)); tok.block_until_ready()
  ts=[]
  for i in range(5):
    t0=time.process_time(); w0=time.perf_counter()
    tok, lp, cache = decode(params, tok, jnp.asarray(lengths + 2 + i), cache, jax.random.key(3)); tok.block_until_ready()
    ts.append((time.process_time()-t0, time.perf_counter()-w0))
  print("decode step cpu/wall s:", [f"{a:.3f}/{b:.3f}" for a,b in ts])
  fwd = jax.jit(lambda p, t: decoder.forward(cfg, p, t))
  x = jnp.ones((B, 1), jnp.int32); fwd(params, x).block_until_ready()
  ts=[]
  for i in range(5):
    t0=time.process_time(); w0=time.perf_counter(); fwd(params, x).block_until_ready(); ts.append((time.process_time()-t0, time.perf_counter()-w0))
  print("forward [8,1] no cache cpu/wall s:", [f"{a:.3f}/{b:.3f}" for a,b in ts])
