"""One MoE dispatch round trip at the 397B per-device geometry, compiled for TPU through libtpu (nothing runs):
`jax.lax.all_to_all` of fixed [ep, C, D] buffers (ep_impl=compact's form) against `jax.lax.ragged_all_to_all`.

  .venv/bin/python benchmarks/ep_collectives.py [--topology tpu7x-8] [--tokens 16384] [--k 10] [--dim 4096]
      [--experts 512] [--factor 2.75] [--recv-rows 225280] [--json PATH]
  .venv/bin/python benchmarks/ep_collectives.py --check    # both forms' numbers on CPU (ragged emulated)

Per device of an ep-device expert group (ep = the topology's devices): M tokens [M, D] bf16, their top-k expert ids
and float32 weights, A = M x k routed rows. Each program sorts the rows by expert id (so by destination), sends them,
runs silu on the received rows (empty rows masked; the expert matmuls are left out: both forms run the same ones),
sends the results back to their slots and combines them with the weights: y [M, D]. "fwd" is that; "fwd+bwd" is its
VJP for a cotangent of y, w.r.t. x and the weights (the transposes of the collectives included).
- all_to_all: expert_parallel.send_layout's [ep * C, D] send buffer, C = capacity(A, ep, factor) rows per peer
  (rows past C dropped), the local expert ids beside it in an [ep * C] buffer; the same all_to_all pair as
  `dispatch_compact`, whose receive buffer is also ep * C rows.
- ragged R: the sorted [A, D] rows are the send buffer; each destination receives into R rows, its senders' rows
  packed in sender order (offsets from an all_gather of the [ep] per-destination counts, rows past R dropped);
  the ids travel the same way; the reverse ragged_all_to_all returns the rows into an [A, D] buffer at their
  sorted slots. R = ep * C (the same receive rows as all_to_all) and --recv-rows (the seed's 225,280).
Reported per program: compile success (or the compiler's error, first line), compile seconds, the executable's
memory_analysis() (temporaries, peak, arguments), the heap of XLA's memory-usage report (its "Total bytes": the
buffer assignment's allocation, live ranges overlapped) and its largest buffers, and its collective instructions by
kind with the bytes of their results (for ragged-all-to-all that is its receive buffer: the rows moved at run time
are only the routed ones).
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import tempfile
import time


def _layout(ids_A, E_l: int, ep: int):
  """(perm [A], count [ep], start [ep]): the rows sorted by expert id, per destination count and first row."""
  import jax.numpy as jnp
  perm = jnp.argsort(ids_A, stable=True).astype(jnp.int32)
  count = jnp.zeros((ep,), jnp.int32).at[ids_A // E_l].add(1)
  return perm, count, jnp.cumsum(count) - count


def round_trip_a2a(x_MD, ids_Mk, w_Mk, *, E_l: int, ep: int, C: int, axis: str):
  """compact's form: [ep, C] rows per peer through jax.lax.all_to_all, there and back."""
  import jax
  import jax.numpy as jnp
  from meshlm.nn.moe import dropless
  from meshlm.nn.moe.expert_parallel import send_layout
  k, D = ids_Mk.shape[-1], x_MD.shape[-1]
  ids_A = ids_Mk.reshape(-1)
  perm, slot, src, valid, _ = send_layout(ids_A, E_l, ep, C)
  a = perm[src]  # [ep * C]
  x_send = jnp.where(valid[:, None], x_MD[a // k], jnp.zeros((), x_MD.dtype))  # [ep * C, D]
  d = jnp.arange(ep * C, dtype=jnp.int32) // C
  lid_send = jnp.where(valid, ids_A[a] - d * E_l, E_l)  # [ep * C]
  x_recv, lid_recv = (jax.lax.all_to_all(v.reshape(ep, C, *v.shape[1:]), axis, 0, 0, tiled=True)
                      .reshape(ep * C, *v.shape[1:]) for v in (x_send, lid_send))
  y_recv = jax.nn.silu(x_recv) * (lid_recv < E_l)[:, None].astype(x_recv.dtype)  # [ep * C, D]
  y_back = jax.lax.all_to_all(y_recv.reshape(ep, C, D), axis, 0, 0, tiled=True).reshape(ep * C, D)
  y_flat = jnp.take(y_back, slot, axis=0, mode="fill", fill_value=0)  # [A, D]
  return dropless.combine(y_flat, w_Mk)


def round_trip_ragged(x_MD, ids_Mk, w_Mk, *, E_l: int, ep: int, R: int, axis: str, ragged=None):
  """jax.lax.ragged_all_to_all (or `ragged`, the same signature): the sorted rows into an R-row receive buffer per
  device, and back."""
  import jax
  import jax.numpy as jnp
  from meshlm.nn.moe import dropless
  ragged = ragged or jax.lax.ragged_all_to_all
  k, D = ids_Mk.shape[-1], x_MD.shape[-1]
  A = ids_Mk.size
  ids_A = ids_Mk.reshape(-1)
  perm, count, start = _layout(ids_A, E_l, ep)
  ids_s = ids_A[perm]
  xs = x_MD[perm // k]  # [A, D] the send buffer, rows grouped by destination
  lid_s = ids_s - (ids_s // E_l) * E_l  # [A]
  counts = jax.lax.all_gather(count, axis)  # [ep senders, ep destinations]
  off = jnp.cumsum(counts, axis=0) - counts  # sender i's first row in destination j's buffer
  sizes = jnp.clip(R - off, 0, counts)  # the rows that fit
  off = jnp.minimum(off, R - 1)  # (only where nothing is sent)
  starts = jnp.cumsum(counts, axis=1) - counts  # sender i's first sorted row for destination j
  me = jax.lax.axis_index(axis)
  # The result takes its type from `output`: an invariant buffer would make the received rows invariant, and the
  # backward would psum their cotangent over the axis (a wrong gradient, and an [M, k, D] all-reduce). Varying.
  buf = lambda shape, fill, dt: jax.lax.pcast(jnp.full(shape, fill, dt), (axis,), to="varying")  # noqa: E731
  there = dict(input_offsets=start, send_sizes=sizes[me], output_offsets=off[me], recv_sizes=sizes[:, me])
  x_recv = ragged(xs, buf((R, D), 0, xs.dtype), **there, axis_name=axis)
  lid_recv = ragged(lid_s, buf((R,), E_l, lid_s.dtype), **there, axis_name=axis)
  y_recv = jax.nn.silu(x_recv) * (lid_recv < E_l)[:, None].astype(x_recv.dtype)  # [R, D]
  y_sorted = ragged(y_recv, buf((A, D), 0, y_recv.dtype), input_offsets=off[:, me], send_sizes=sizes[:, me],
                    output_offsets=starts[:, me], recv_sizes=sizes[me], axis_name=axis)  # [A, D], dropped rows zero
  y_flat = y_sorted[dropless.inverse_permutation(perm)]
  return dropless.combine(y_flat, w_Mk)


def emulated_ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, *,
                               axis_name):
  """jax.lax.ragged_all_to_all's documented result, built from all_gathers (XLA:CPU has no ragged-all-to-all):
  receiver `me` writes sender i's rows operand_i[input_offsets_i[me] :][: send_sizes_i[me]] at output_offsets_i[me]."""
  import jax
  import jax.numpy as jnp
  del recv_sizes  # = the senders' send_sizes to me
  ops = jax.lax.all_gather(operand, axis_name)  # [ep, N, ...]
  src0, n, lo = (jax.lax.all_gather(v, axis_name)[:, jax.lax.axis_index(axis_name)]
                 for v in (input_offsets, send_sizes, output_offsets))  # [ep senders] each
  r = jnp.arange(output.shape[0])
  hit = (r[None] >= lo[:, None]) & (r[None] < (lo + n)[:, None])  # [ep, R]
  i = jnp.argmax(hit, axis=0)
  got = ops[i, jnp.clip(src0[i] + r - lo[i], 0, operand.shape[0] - 1)]
  return jnp.where(hit.any(0).reshape((-1,) + (1,) * (output.ndim - 1)), got, output)


def check(ep: int = 4, M: int = 16, k: int = 2, D: int = 8, E: int = 8) -> dict:
  """On ep fake CPU devices (started by the caller), float32: y and its VJP w.r.t. x and the weights of each form
  with buffers that drop nothing (all_to_all C = A; ragged R = ep x A, the primitive emulated) against the plain
  y = silu(x) x sum_k w (every slot of a token returns silu(x)): {form: max |diff| / max(1, max |ref|)}."""
  import functools

  import jax
  import jax.numpy as jnp
  import numpy as np
  from jax.sharding import NamedSharding, PartitionSpec as P
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.standard_normal((ep * M, D)), jnp.float32)
  ids = jnp.asarray(np.argsort(rng.random((ep * M, E)), axis=1)[:, :k], jnp.int32)  # k distinct experts a token
  w = jnp.asarray(rng.random((ep * M, k)), jnp.float32)
  ct = jnp.asarray(rng.standard_normal((ep * M, D)), jnp.float32)
  mesh = jax.sharding.Mesh(np.asarray(jax.devices("cpu")[:ep]), ("expert",))
  put = lambda a: jax.device_put(a, NamedSharding(mesh, P("expert")))  # noqa: E731

  def vjp_of(f, x, ids, w, ct):
    y, back = jax.vjp(lambda x, w: f(x, ids, w), x, w)
    return (y, *back(ct))
  forms = {"all_to_all": functools.partial(round_trip_a2a, C=M * k),
           "ragged": functools.partial(round_trip_ragged, R=ep * M * k, ragged=emulated_ragged_all_to_all)}
  ref = vjp_of(lambda x, ids, w: jax.nn.silu(x) * jnp.sum(w, axis=-1, keepdims=True), x, ids, w, ct)
  out = {}
  for name, fn in forms.items():
    body = jax.shard_map(functools.partial(fn, E_l=E // ep, ep=ep, axis="expert"), mesh=mesh,
                         in_specs=(P("expert"),) * 3, out_specs=P("expert"))
    got = jax.jit(functools.partial(vjp_of, body))(*map(put, (x, ids, w, ct)))  # (y, dx, dw)
    out[name] = max(float(jnp.max(jnp.abs(a - b)) / max(1.0, float(jnp.max(jnp.abs(b))))) for a, b in zip(got, ref))
  return out


COLLECTIVE_KINDS = ("all-to-all", "ragged-all-to-all", "all-gather", "all-reduce", "reduce-scatter",
                    "collective-permute")


def collectives(hlo_text: str) -> dict:
  """{kind: {"count", "bytes"}} of the compiled HLO's collective instructions (an async pair once, at its start;
  per step: each loop body times its trip count), bytes of each result's largest array."""
  from meshlm.analysis import hlo as H
  mod = H.parse(hlo_text)
  out = {}
  for kind in COLLECTIVE_KINDS:
    found = [i for i in mod.instrs() if i.opcode in (kind, f"{kind}-start")]
    times = [mod.multipliers.get(i.comp, 1) for i in found]
    out[kind] = {"count": sum(times),
                 "bytes": sum(t * max((a.bytes for a in i.result), default=0) for i, t in zip(found, times)),
                 "shapes": sorted({str(max(i.result, key=lambda a: a.bytes)) for i in found if i.result})}
  return {k: v for k, v in out.items() if v["count"]}


def compile_one(fn, devices, args: dict, backward: bool) -> dict:
  """Compiles fn (per device, in a shard_map over all devices on one axis "expert") for the devices."""
  import jax
  import jax.numpy as jnp
  import numpy as np
  from jax.sharding import NamedSharding, PartitionSpec as P

  from meshlm.analysis.aot import largest_buffers
  mesh = jax.sharding.Mesh(np.asarray(devices), ("expert",))
  spec = P("expert")
  body = jax.shard_map(fn, mesh=mesh, in_specs=(spec,) * 3, out_specs=spec)
  if backward:
    def program(x, ids, w, ct):
      y, vjp = jax.vjp(lambda x, w: body(x, ids, w), x, w)
      return (y, *vjp(ct))
  else:
    def program(x, ids, w):
      return body(x, ids, w)
  sds = lambda shape, dt: jax.ShapeDtypeStruct(shape, dt, sharding=NamedSharding(mesh, spec))  # noqa: E731
  ep, M, k, D = len(devices), args["M"], args["k"], args["D"]
  inputs = [sds((ep * M, D), jnp.bfloat16), sds((ep * M, k), jnp.int32), sds((ep * M, k), jnp.float32)]
  inputs += [sds((ep * M, D), jnp.bfloat16)] if backward else []
  lowered = jax.jit(program).lower(*inputs)
  with tempfile.TemporaryDirectory(prefix="ep-collectives-") as dump:
    start = time.perf_counter()
    try:
      compiled = lowered.compile(compiler_options={"xla_dump_to": dump})  # the dump: XLA's memory-usage report
    except Exception as e:  # the finding, in the compiler's words
      return {"compiled": False, "compile_s": round(time.perf_counter() - start, 1),
              "error": str(e).strip().splitlines()[0][:400]}
    seconds = time.perf_counter() - start
    largest = largest_buffers(dump, top=4)
    heap = max((int(ln.split()[2]) for f in glob.glob(os.path.join(dump, "*memory-usage-report.txt"))
                for ln in open(f, encoding="utf-8", errors="replace") if ln.startswith("Total bytes:")), default=None)
  mem = compiled.memory_analysis()
  return {"compiled": True, "compile_s": round(seconds, 1), "temp_bytes": int(mem.temp_size_in_bytes),
          "peak_bytes": int(mem.peak_memory_in_bytes), "argument_bytes": int(mem.argument_size_in_bytes),
          "output_bytes": int(mem.output_size_in_bytes), "collectives": collectives(compiled.as_text()),
          "heap_bytes": heap, "largest_buffers": largest}


def _gib(b) -> str:
  return "-" if b is None else f"{b / (1 << 30):.2f}"


def _coll(c: dict) -> str:
  return "; ".join(f"{v['count']} {k} {_gib(v['bytes'])} GiB" for k, v in c.items()) or "none"


def _largest(rows: list[dict]) -> str:
  return "; ".join(f"{_gib(r['bytes'])} {r['shapes'][:60]}" for r in rows[:3])


def _row(r: dict) -> str:
  if not r["compiled"]:
    return f"| {r['form']} | {r['program']} | no: {r['error']} | {r['compile_s']} | | | | | | |"
  gib = " | ".join(_gib(r[f"{k}_bytes"]) for k in ("temp", "peak", "heap", "argument"))
  return (f"| {r['form']} | {r['program']} | yes | {r['compile_s']} | {gib} | {_coll(r['collectives'])} "
          f"| {_largest(r['largest_buffers'])} |")


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--topology", default="tpu7x-8", help="a TPU slice whose devices are the expert group (ep)")
  p.add_argument("--tokens", type=int, default=16384, help="tokens per device (M)")
  p.add_argument("--k", type=int, default=10)
  p.add_argument("--dim", type=int, default=4096)
  p.add_argument("--experts", type=int, default=512)
  p.add_argument("--factor", type=float, default=2.75, help="all_to_all's buffer factor (ep_buffer_factor)")
  p.add_argument("--recv-rows", type=int, nargs="*", default=[225280], help="more ragged receive buffers (rows)")
  p.add_argument("--json", help="write the results here too")
  p.add_argument("--check", action="store_true", help="only check both forms' numbers on 4 fake CPU devices")
  a = p.parse_args(argv)
  if a.check:
    import os
    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"
    diffs = check()
    print(f"check (float32, 4 fake CPU devices, nothing dropped; against silu(x) x sum_k w, fwd and VJP): {diffs}")
    return 0 if max(diffs.values()) <= 1e-6 else 1
  import functools

  import jax

  from meshlm.nn.moe.expert_parallel import capacity
  from meshlm.parallel import topology

  devices = topology.devices(topology.parse(a.topology))
  ep = len(devices)
  E_l, A = a.experts // ep, a.tokens * a.k
  C = capacity(A, ep, a.factor)
  forms = [(f"all_to_all [ep, C] = [{ep}, {C}]", functools.partial(round_trip_a2a, C=C))]
  forms += [(f"ragged R = {R:,}", functools.partial(round_trip_ragged, R=R)) for R in [ep * C] + a.recv_rows]
  shapes = {"M": a.tokens, "k": a.k, "D": a.dim}
  print(f"# ep_collectives: {a.topology} ({devices[0].device_kind}, ep={ep}), M={a.tokens} tokens per device, "
        f"top-{a.k}, D={a.dim}, E={a.experts} (E_l={E_l}), A={A:,} routed rows, factor {a.factor}: C={C:,}; x bf16, "
        f"jax {jax.__version__}", flush=True)
  print("| form | program | compiled | compile s | temp GiB | peak GiB | heap GiB | arguments GiB "
        "| collectives (count kind bytes) | largest buffers |")
  print("|---|---|---|---|---|---|---|---|---|---|")
  results = []
  for name, fn in forms:
    for backward in (False, True):
      r = compile_one(functools.partial(fn, E_l=E_l, ep=ep, axis="expert"), devices, shapes, backward)
      r |= {"form": name, "program": "fwd+bwd" if backward else "fwd"}
      results.append(r)
      print(_row(r), flush=True)
  if a.json:
    with open(a.json, "w") as f:
      json.dump({"args": vars(a), "ep": ep, "C": C, "A": A, "results": results}, f, indent=1)
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
