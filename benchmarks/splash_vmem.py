"""The splash kernel alone compiled for a TPU topology on this CPU at one scoped-VMEM limit: whether each case's
kernel fits, and where it does not, at least how much it needs (Mosaic's "Scoped allocation with size X and limit L").
The evidence nn/splash_rule.py's estimate is fitted to (no chip needed; seconds to a minute per case).

  python benchmarks/splash_vmem.py v5e:1x1 16384 cases.json out.jsonl      # JAX 0.12 / libtpu 0.0.50.1
  python benchmarks/splash_vmem.py v5e:2x2 16384 cases.json out.jsonl      # libtpu 0.0.42.1 refuses v5e:1x1

A case (JSON): {"kernel": fwd | dkv | dq, "blocks": [q, kv, kv_compute] (dq: [q, kv]), "H": qk head dim, "Hv", and
optionally "N", "K", "T", "B" (the rows vmapped over), "seg", "softcap", "window", "fused", "dt"}; the other kernels of
the program run at 512 blocks. The limit (KiB) is XLA's --xla_tpu_scoped_vmem_limit_kib (16384: the default).
"""
import os, sys, json, re, time
os.environ["LIBTPU_INIT_ARGS"] = f"--xla_tpu_scoped_vmem_limit_kib={sys.argv[2]}"
for k, v in {"TPU_SKIP_MDS_QUERY": "1", "TPU_HOST_BOUNDS": "1,1,1", "TPU_WORKER_HOSTNAMES": "localhost", "ALLOW_MULTIPLE_LIBTPU_LOAD": "1"}.items():
  os.environ.setdefault(k, v)
import jax, jax.numpy as jnp
jax.config.update("jax_platforms", "cpu")
from jax.experimental import topologies
from jax.experimental.pallas.ops.tpu import splash_attention as SA
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
topo = sys.argv[1]
devs = list(topologies.get_topology_desc(platform="tpu", topology_name=topo).devices)[:1]
mesh = Mesh(devs, ("x",))
SMALL = (512, 512, 512)

def program(kernel, blocks, H, Hv, N=8, K=4, T=2048, B=1, seg=True, softcap=None, window=None, fused=True, dt="bfloat16"):
  dt = jnp.dtype(dt)
  fwd = tuple(blocks) if kernel == "fwd" else SMALL
  dkv = tuple(blocks) if kernel == "dkv" else SMALL
  dq = tuple(blocks) if kernel == "dq" else (None if fused else SMALL[:2])
  if kernel == "dq": fused = False
  sizes = SA.BlockSizes(block_q=fwd[0], block_kv=fwd[1], block_kv_compute=fwd[2], block_q_dkv=dkv[0], block_kv_dkv=dkv[1],
      block_kv_dkv_compute=dkv[2], block_q_dq=None if fused else dq[0], block_kv_dq=None if fused else dq[1], use_fused_bwd_kernel=fused)
  one = SA.CausalMask((T, T)) if window is None else SA.LocalMask((T, T), window_size=(window - 1, 0), offset=0)
  kern = SA.make_splash_mha(SA.MultiHeadMask([one] * N), block_sizes=sizes, head_shards=1, q_seq_shards=1, attn_logits_soft_cap=softcap)
  def attend(q, k, v, s):
    if seg: return jax.vmap(lambda q, k, v, s: kern(q, k, v, SA.SegmentIds(s, s)))(q, k, v, s)
    return jax.vmap(lambda q, k, v: kern(q, k, v))(q, k, v)
  def f(q, k, v, s, ct):
    if kernel == "fwd": return attend(q, k, v, s)
    out, vjp = jax.vjp(lambda q, k, v: attend(q, k, v, s), q, k, v)
    return vjp(ct)
  sh = NamedSharding(mesh, P())
  args = [jax.ShapeDtypeStruct(s, d, sharding=sh) for s, d in [((B, N, T, H), dt), ((B, K, T, H), dt), ((B, K, T, Hv), dt), ((B, T), jnp.int32), ((B, N, T, Hv), dt)]]
  return jax.jit(f).lower(*args)

out = open(sys.argv[4], "a")
for case in json.load(open(sys.argv[3])):
  t0 = time.time()
  try:
    program(**case).compile(); res = {"fits": True}
  except Exception as e:
    m = re.search(r"Scoped allocation with size ([\d.]+)([KMG]?) and limit ([\d.]+)([KMG]?)", str(e))
    kn = re.search(r"splash_mha_\w+", str(e))
    res = {"fits": False, "at_least_mib": float(m.group(1)) * {"K": 1 / 1024, "M": 1, "G": 1024, "": 1 / 2**20}[m.group(2)], "failed": kn.group(0) if kn else None} if m else {"error": str(e).splitlines()[0][:300]}
  rec = dict(case, limit_mib=int(sys.argv[2]) / 1024, jax=jax.__version__, topo=topo, s=round(time.time() - t0, 1), **res)
  print(json.dumps(rec), flush=True); out.write(json.dumps(rec) + "\n"); out.flush()
