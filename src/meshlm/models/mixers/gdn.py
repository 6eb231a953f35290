"""The `gdn` mixer: Gated DeltaNet (qwen3-next, qwen3.5 linear-attention layers).

Letters (docs/architecture.md): D embed, K key heads, N value heads (G = N / K per key head; value head
n reads key head n // G), H key head dim, J value head dim, Q conv taps, C = 2KH + NJ conv channels.

    q|k|v, z, b, a = projections of x                        (one layout or the other, below)
    q|k|v = silu(causal_conv(q|k|v))                         nn/short_conv.py, reset at documents
    q = l2norm(q) * H ** -0.5, k = l2norm(k)                 float32, per key head
    beta = sigmoid(b), g = -exp(A_log) * softplus(a + dt_bias)   float32, [B, T, N]
    o = gated_delta_rule(q, k, v, g, beta)                   nn/gdn.py, reset at documents
    o = rms_norm(o over J) * norm * silu(z)                  per value head, float32; norm starts at ones
    y = out_proj(o)

Every per-head step runs on the flat [B, T, heads * dim] arrays (q | k | v, z, o): a head's sum is a product with
the heads' indicator (`head_sums`), never a reshape to [B, T, heads, dim], which on TPU is a relayout copy in float32
(tiles of 8 positions x 128 channels against 8 heads x 128); the kernels take and give the flat layout too.

Parameters of one layer, under the part key "linear_attn" (Hugging Face torch weights in brackets; every
kernel is stored inputs first, so the maps transpose and reshape, never permute rows):

  fused layout (qwen3-next, `gdn(fused=True)`):
    in_proj_qkvz [D, K, 2H + 2GJ]   per key head k: q(H) | k(H) | v(G*J) | z(G*J), value head n = k*G + g
                                    [in_proj_qkvz.weight [K*(2H + 2GJ), D]: .T.reshape(D, K, 2H + 2GJ)]
    in_proj_ba   [D, K, 2G]         per key head k: b(G) | a(G)  [in_proj_ba.weight [2N, D]: .T.reshape(D, K, 2G)]
  separate layout (qwen3.5, `gdn(fused=False)`):
    in_proj_qkv  [D, C]             q all (K*H) | k all (K*H) | v all (N*J)  [in_proj_qkv.weight [C, D]: .T]
    in_proj_z    [D, N, J]          [in_proj_z.weight [N*J, D]: .T.reshape(D, N, J)]
    in_proj_b    [D, N]             [in_proj_b.weight [N, D]: .T]
    in_proj_a    [D, N]             [in_proj_a.weight [N, D]: .T]
  both:
    conv1d       [Q, C]             channels q all | k all | v all, as in_proj_qkv; tap Q - 1 is the current
                                    position  [conv1d.weight [C, 1, Q]: [:, 0, :].T]
    A_log        [N]                zeros (A = 1); no weight decay  [A_log]
    dt_bias      [N]                ones; no weight decay  [dt_bias]
    norm         [J]                ones (a plain scale, not (1 + w)), shared by the value heads  [norm.weight]
    out_proj     [N, J, D]          [out_proj.weight [D, N*J]: .T.reshape(N, J, D)]

Its own knobs, model.parts.gdn.<knob> (`GDNConfig`; the old keys model.linear_num_key_heads,
model.linear_num_value_heads, model.linear_key_head_dim, model.linear_value_head_dim, model.gdn_chunk_size,
model.gdn_impl and model.linear_conv_kernel_dim still set them): key_heads K, value_heads N (a multiple of K),
key_head_dim H and value_head_dim J are required; chunk_size, impl and inverse say how the rule computes (COMPUTE:
a checkpoint resumes under other values), conv_kernel_dim is Q, a parameter's shape. What computes the chunked rule of
training and prefill is the top-level key gdn_impl (auto | jax | pallas), which the layer reads from the run's
config on its Context (ctx.config): pure JAX (nn/gdn.py) or the Pallas TPU kernels
(nn/gdn_pallas.py; interpret mode off TPU), auto resolved when the step is traced (`rule_kernel`: pallas on TPU where
the kernel takes the shapes). inverse: how the kernel inverts a chunk's I + A in a bf16 run (gdn_pallas.INVERSES).
Which layers are GDN is the hybrid family's plan (model.hybrid_layer_types or full_attention_interval,
models/plans.py), not a knob.

The GDN kernels shard on embed only (FSDP): their head axes stay whole over mesh.tensor (not built).
Training on mesh.context > 1 (`context_parallel`): T stays sharded through the layer; the conv takes the previous
shard's last Q - 1 inputs as a halo (short_conv.causal_conv_context_parallel) and the rule runs per shard
(rule.gated_delta_rule_context_parallel). Prefill and decode run the sequence whole.

Decode state (both replaced whole each step, StateLeaf commit "replace"):
  conv       [B, Q - 1, C]   the last Q - 1 pre-conv inputs q|k|v (zeros before the row's first token)
  recurrent  [B, N, H, J]    the delta rule's state, float32
A prefill (right-padded rows, ctx.here.lengths) returns the states at each row's last real token: padded
positions get g = 0 and beta = 0, which keep the state, and the conv window is gathered from the last
Q - 1 real inputs. A decode step is the conv against its window and one step of the rule.
"""
from __future__ import annotations

import functools
from typing import ClassVar, Literal

import jax
import jax.numpy as jnp
import pydantic

from meshlm.config import ModelConfig
from meshlm import spec as S
from meshlm.models.family import CensusCounter, Instrument, MeshRules, Part, PartConfig, StateLeaf, section
from meshlm.errors import ConfigError
from meshlm.nn import gdn as rule
from meshlm.nn import gdn_pallas
from meshlm.nn import short_conv
from meshlm.nn.short_conv import causal_conv, window_at
from meshlm.parallel.sharding import ACT, auto_region_many, axes, context_size, platform

KEY = "linear_attn"
OUT = ACT
ROWS = axes("batch", "length", None)  # a projection's per-position output: heads and channels stay whole


class GDNConfig(PartConfig):
  """The gdn part's own knobs: model.parts.gdn.<knob> (their old keys, ModelConfig.MOVED, still set them)."""
  # How the layer computes with the same parameters (a checkpoint resumes under other values).
  COMPUTE: ClassVar[tuple[str, ...]] = ("chunk_size", "impl", "inverse")
  # Knobs this section had and no longer reads, dropped where a saved config (a run's config.yaml) still holds them:
  # kernel, a copy of the top-level gdn_impl (which a resumed run reads from its own config).
  RETIRED: ClassVar[tuple[str, ...]] = ("kernel",)
  key_heads: int = pydantic.Field(gt=0, description="key heads K (HF linear_num_key_heads)")
  value_heads: int = pydantic.Field(gt=0, description="value heads N, a multiple of key_heads (value head n reads "
                                    "key head n // (N / K); HF linear_num_value_heads)")
  key_head_dim: int = pydantic.Field(gt=0, description="key head dim H (HF linear_key_head_dim)")
  value_head_dim: int = pydantic.Field(gt=0, description="value head dim J (HF linear_value_head_dim)")
  chunk_size: int = pydantic.Field(default=64, gt=0, description="chunk length of the chunked gated delta rule (a "
                                   "power of two); a mesh.context shard runs whole chunks")
  impl: Literal["chunked", "reference"] = pydantic.Field(
      default="chunked", description="the gated delta rule in training and prefill: chunked (WY form, a scan over "
      "chunks) or reference (the naive recurrence, one position at a time); decode steps use the recurrence")
  inverse: Literal["split", "refine"] = pydantic.Field(
      default="split", description="how the Pallas kernel inverts a chunk's (I + A) in a bf16 run (the inverse is "
      "rounded to bf16 wherever it is used): split (every product in three bf16 passes) or refine (its doubling "
      "products in one bf16 pass, then one Newton step with the residual in three: fewer bundles, not faster on a "
      "v5e, docs/gdn.md); float32 runs: float32 products")
  conv_kernel_dim: int = pydantic.Field(default=4, gt=0, description="taps Q of the causal depthwise conv over q|k|v "
                                        "(HF linear_conv_kernel_dim)")

  @pydantic.field_validator("value_heads")
  @classmethod
  def _groups(cls, n: int, info) -> int:
    k = info.data.get("key_heads")  # validated before it (field order)
    if k is not None and n % k:
      raise ValueError(f"{n} must be a multiple of key_heads={k} (value head n reads key head n // (N / K)); set "
                       f"model.parts.gdn.value_heads to a multiple of {k}")
    return n

  @pydantic.field_validator("chunk_size")
  @classmethod
  def _power_of_two(cls, c: int) -> int:
    if c & (c - 1):
      raise ValueError(f"{c} must be a power of two; set model.parts.gdn.chunk_size=64 (or 16, 32, 128)")
    return c


def knobs(m: ModelConfig) -> GDNConfig:
  """model.parts.gdn, its defaults filled in."""
  return section(m, _SECTION)


def dims(m: ModelConfig) -> tuple[int, int, int, int, int, int]:
  """(K, N, G, H, J, Q)."""
  own = knobs(m)
  K, N = own.key_heads, own.value_heads
  return K, N, N // K, own.key_head_dim, own.value_head_dim, own.conv_kernel_dim


def channels(m: ModelConfig) -> int:
  K, N, _, H, J, _ = dims(m)
  return 2 * K * H + N * J


def spec(m: ModelConfig, *, fused: bool) -> dict:
  D = m.embed_dim
  K, N, G, H, J, Q = dims(m)
  if fused:
    proj = {"in_proj_qkvz": S.kernel((D, K, 2 * H + 2 * G * J), ("embed", None, None)),
            "in_proj_ba": S.kernel((D, K, 2 * G), ("embed", None, None))}
  else:
    proj = {"in_proj_qkv": S.kernel((D, channels(m)), ("embed", None)),
            "in_proj_z": S.kernel((D, N, J), ("embed", None, None)),
            "in_proj_b": S.kernel((D, N), ("embed", None)),
            "in_proj_a": S.kernel((D, N), ("embed", None))}
  return {
      **proj,
      "conv1d": S.ParamSpec((Q, channels(m)), (None, None), "normal", fan_in=Q),
      "A_log": S.vector(N, "zeros", decay=False),
      "dt_bias": S.vector(N, "ones", decay=False),
      "norm": S.vector(J, "ones"),
      "out_proj": S.kernel((N, J, D), (None, None, "embed"), n_in=2),
  }


def state_spec(m: ModelConfig, batch: int, size: int) -> dict[str, StateLeaf]:
  K, N, G, H, J, Q = dims(m)
  return {"conv": StateLeaf((batch, Q - 1, channels(m)), ("batch", None, None), commit="replace"),
          "recurrent": StateLeaf((batch, N, H, J), ("batch", None, None, None), commit="replace")}


def project(p: dict, x_BTD: jax.Array, ctx, *, fused: bool) -> tuple[jax.Array, ...]:
  """The projections through ctx.dense, as the kernels store them: fused (in_proj_qkvz [B, T, K, 2H + 2GJ],
  in_proj_ba [B, T, K, 2G]) or separate (q|k|v [B, T, C], z [B, T, N J], b [B, T, N], a [B, T, N])."""
  dt = x_BTD.dtype
  dense = ctx.dense
  if fused:
    with jax.named_scope("in_proj_qkvz"):
      qkvz = dense(x_BTD, ctx.cast(p["in_proj_qkvz"], dt), "btd,dke->btke", ROWS + (None,))
    with jax.named_scope("in_proj_ba"):
      ba = dense(x_BTD, ctx.cast(p["in_proj_ba"], dt), "btd,dke->btke", ROWS + (None,))
    return qkvz, ba
  with jax.named_scope("in_proj_qkv"):
    qkv = dense(x_BTD, ctx.cast(p["in_proj_qkv"], dt), "btd,dc->btc", ROWS)
  with jax.named_scope("in_proj_z"):
    w_z = ctx.cast(p["in_proj_z"], dt)  # [D, N, J], used as [D, N J]: z comes out flat
    z = dense(x_BTD, jnp.reshape(w_z, (w_z.shape[0], -1)), "btd,dc->btc", ROWS)
  with jax.named_scope("in_proj_b"):
    b = dense(x_BTD, ctx.cast(p["in_proj_b"], dt), "btd,dn->btn", ROWS)
  with jax.named_scope("in_proj_a"):
    a = dense(x_BTD, ctx.cast(p["in_proj_a"], dt), "btd,dn->btn", ROWS)
  return qkv, z, b, a


def split(m: ModelConfig, proj: tuple[jax.Array, ...]) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
  """(q|k|v [B, T, C] before the conv, z [B, T, N J], b [B, T, N], a [B, T, N]) from either layout: the fused
  one regrouped from per key head (q | k | v | z and b | a) into q all | k all | v all, value head n = k*G + g."""
  if len(proj) == 4:
    return proj
  qkvz, ba = proj
  B, T = qkvz.shape[:2]
  K, N, G, H, J, _ = dims(m)
  q, k = qkvz[..., :H], qkvz[..., H:2 * H]  # [B, T, K, H]
  v = jnp.reshape(qkvz[..., 2 * H:2 * H + G * J], (B, T, N * J))
  z = jnp.reshape(qkvz[..., 2 * H + G * J:], (B, T, N * J))
  qkv = jnp.concatenate([jnp.reshape(q, (B, T, K * H)), jnp.reshape(k, (B, T, K * H)), v], axis=-1)
  return qkv, z, jnp.reshape(ba[..., :G], (B, T, N)), jnp.reshape(ba[..., G:], (B, T, N))


def _heads(C: int, heads: int) -> jax.Array:
  """[C, heads] float32: channel c belongs to head c // (C / heads)."""
  return (jnp.arange(C)[:, None] // (C // heads) == jnp.arange(heads)[None, :]).astype(jnp.float32)


def head_sums(x_BTC: jax.Array, heads: int) -> jax.Array:
  """[B, T, heads]: the sum of each head's channels of x (float32; heads side by side along C), a product with the
  heads' indicator (float32 exact: HIGHEST) rather than a reshape to [B, T, heads, C / heads] (the module docstring:
  on TPU that reshape is a relayout copy, forward and backward; measured in docs/gdn.md)."""
  return jnp.einsum("btc,ch->bth", x_BTC, _heads(x_BTC.shape[-1], heads), precision=jax.lax.Precision.HIGHEST)


def head_spread(s_BTh: jax.Array, C: int) -> jax.Array:
  """[B, T, C]: each head's value on every one of its channels (head_sums' transpose)."""
  return jnp.einsum("bth,ch->btc", s_BTh, _heads(C, s_BTh.shape[-1]), precision=jax.lax.Precision.HIGHEST)


def l2_normalize_heads(x_BTC: jax.Array, heads: int, eps: float = 1e-6) -> jax.Array:
  """rule.l2_normalize over each head's channels of the flat [B, T, heads d], float32, in that layout."""
  xf = x_BTC.astype(jnp.float32)
  return xf * head_spread(jax.lax.rsqrt(head_sums(xf * xf, heads) + eps), xf.shape[-1])


def gated_rms_norm(w_J: jax.Array, o_BTC: jax.Array, z_BTC: jax.Array, eps: float) -> jax.Array:
  """rms_norm(o) * w * silu(z) over each value head's J channels of the flat [B, T, N J] (o and z), in float32, back
  in z's dtype."""
  J = w_J.shape[0]
  of = o_BTC.astype(jnp.float32)
  scale = head_spread(jax.lax.rsqrt(head_sums(of * of, of.shape[-1] // J) / J + eps), of.shape[-1])
  w_C = jnp.tile(w_J.astype(jnp.float32), of.shape[-1] // J)
  return (of * scale * w_C * jax.nn.silu(z_BTC.astype(jnp.float32))).astype(z_BTC.dtype)


def context_parallel(m: ModelConfig, mode: str) -> bool:
  """Training with the sequence sharded over mesh.context > 1 (chunked rule): the conv takes a halo from the
  previous shard and the rule runs its three passes per shard (nn/gdn.py) instead of gathering the sequence."""
  return mode == "train" and knobs(m).impl == "chunked" and context_size() > 1


def resolve_kernel(gdn_impl: str, on: str, m: ModelConfig) -> str:
  """gdn_impl (auto | jax | pallas) for a program built for platform `on`: jax or pallas. auto is pallas on TPU where
  the kernel takes the model's heads and chunk (gdn_pallas.fits), else jax; pallas on TPU with shapes it does not
  take is a ConfigError (off TPU the kernel runs in interpret mode, any shapes)."""
  if gdn_impl not in ("auto", "jax", "pallas"):
    raise ValueError(f"gdn_impl={gdn_impl!r}: expected auto, jax or pallas")
  K, N, _, H, J, _ = dims(m)
  fits = gdn_pallas.fits(K, N, H, J, knobs(m).chunk_size)
  if gdn_impl == "pallas" and on == "tpu" and not fits:
    raise ConfigError(f"gdn_impl=pallas: the TPU kernel needs model.parts.gdn.chunk_size={knobs(m).chunk_size} a "
                      f"multiple of 16 and a tile of at most {gdn_pallas.MAX_HEADS_PER_STEP} value heads whose key "
                      f"and value dims fill whole {gdn_pallas.LANES}-lane blocks (key_heads={K} key_head_dim={H}, "
                      f"value_heads={N} value_head_dim={J}); use gdn_impl=jax or auto")
  if gdn_impl == "auto":
    return "pallas" if on == "tpu" and fits else "jax"
  return gdn_impl


def rule_kernel(m: ModelConfig, mode: str, gdn_impl: str = "auto", on: str | None = None,
                context: int | None = None) -> str:
  """What computes the rule in this mode: "reference" (model.parts.gdn.impl=reference, and every decode step),
  "jax" (the chunked rule in pure JAX; also the context-parallel rule of training on mesh.context > 1) or "pallas"
  (the kernel), under the key gdn_impl, for a program built for platform `on` (default: the one being traced) and
  `context` shards."""
  own = knobs(m)
  if mode == "decode" or own.impl == "reference":
    return "reference"
  context = context_size() if context is None else context
  if mode == "train" and context > 1:
    return "jax"
  return resolve_kernel(gdn_impl, platform() if on is None else on, m)


def report(cfg, on: str, context: int) -> dict:
  """What the reports print (Instrument.report): gdn_impl, resolved for the train step (`rule_kernel`)."""
  return {"gdn_impl": rule_kernel(cfg.model, "train", cfg.gdn_impl, on, context)}


def delta_rule(m: ModelConfig, mode: str = "train", gdn_impl: str = "auto"):
  """The gated delta rule for this mode: fn(q, k, v, g, beta, segment_ids_BT=, initial_state_BNHJ=). Training and
  prefill use model.parts.gdn.impl (chunked, in chunks of model.parts.gdn.chunk_size, or the reference recurrence),
  the chunked rule by the key gdn_impl (`rule_kernel`); a decode step is one step of the recurrence.
  Training on mesh.context > 1: the context-parallel chunked rule (pure JAX)."""
  own = knobs(m)
  if context_parallel(m, mode):
    return functools.partial(rule.gated_delta_rule_context_parallel, chunk_size=own.chunk_size)
  if rule_kernel(m, mode, gdn_impl) == "pallas":
    return functools.partial(gdn_pallas.gated_delta_rule_pallas, chunk_size=own.chunk_size, inverse=own.inverse)
  impl = "reference" if mode == "decode" else own.impl
  return functools.partial(rule.gated_delta_rule, impl=impl, chunk_size=own.chunk_size)


def core(m: ModelConfig, mode: str, dense, gdn_impl: str, proj: tuple, w: dict, segment_ids_BT, lengths_B, state):
  """split -> conv -> gates -> delta rule -> gated norm -> out_proj: (y [B, T, D], conv window or None, final
  state or None). gdn_impl: the key (ctx.config.gdn_impl); proj: `project`'s outputs; w: conv1d, A_log, dt_bias, norm,
  out_proj [N J, D] (in the compute dtype); state: the decode state or None."""
  qkv_BTC, z_BTC, b_BTN, a_BTN = split(m, proj)
  dt = qkv_BTC.dtype
  B, T, _ = qkv_BTC.shape
  K, N, G, H, J, Q = dims(m)
  decode = mode == "decode"
  with jax.named_scope("conv1d"):
    if context_parallel(m, mode):
      mixed = short_conv.causal_conv_context_parallel(qkv_BTC, w["conv1d"], segment_ids_BT=segment_ids_BT)
    else:
      mixed = causal_conv(qkv_BTC, w["conv1d"], segment_ids_BT=segment_ids_BT,
                          history=state["conv"] if decode else None)
    mixed = jax.nn.silu(mixed.astype(jnp.float32))
  # Each head normalized in the flat layout; the rule's [B, T, heads, dim] views are reshapes the kernel undoes.
  q = jnp.reshape(l2_normalize_heads(mixed[..., :K * H], K) * (H ** -0.5), (B, T, K, H))
  k = jnp.reshape(l2_normalize_heads(mixed[..., K * H:2 * K * H], K), (B, T, K, H))
  v = jnp.reshape(mixed[..., 2 * K * H:], (B, T, N, J)).astype(dt)
  f32 = jnp.float32
  beta = jax.nn.sigmoid(b_BTN.astype(f32))  # [B, T, N]
  g = -jnp.exp(w["A_log"].astype(f32)) * jax.nn.softplus(a_BTN.astype(f32) + w["dt_bias"].astype(f32))
  if mode == "prefill":
    # Right-padded rows: a padded position neither decays nor writes, so the final state is the last real one's.
    real = (jnp.arange(T)[None, :] < lengths_B[:, None])[..., None]  # [B, T, 1]
    g, beta = jnp.where(real, g, 0.0), jnp.where(real, beta, 0.0)
  with jax.named_scope("delta_rule"):
    o, final = delta_rule(m, mode, gdn_impl)(q, k, v, g, beta, segment_ids_BT=segment_ids_BT,
                                   initial_state_BNHJ=state["recurrent"] if decode else None)
  with jax.named_scope("norm"):
    o = gated_rms_norm(w["norm"], jnp.reshape(o, (B, T, N * J)), z_BTC, m.norm_eps)  # [B, T, N J]
  with jax.named_scope("out_proj"):
    y = dense(o, w["out_proj"], "btc,cd->btd", OUT)
  if mode == "train":
    return y, None, None
  if decode:
    window = jnp.concatenate([state["conv"].astype(dt), qkv_BTC], axis=1)[:, 1:]  # [B, Q - 1, C]
  else:
    window = window_at(qkv_BTC, lengths_B, Q - 1)
  return y, window, final


def apply(p: dict, x_BTD: jax.Array, ctx, state: dict | None = None, *, fused: bool):
  """(y [B, T, D], update, {}). update: {"conv" [B, Q - 1, C], "recurrent" [B, N, H, J]} in prefill and decode,
  None when training. state (decode): the layer's {"conv", "recurrent"}."""
  m = ctx.model
  dt = x_BTD.dtype
  B, T, _ = x_BTD.shape
  here = ctx.here
  proj = project(p, x_BTD, ctx, fused=fused)
  w = {"conv1d": p["conv1d"].astype(dt), "A_log": p["A_log"], "dt_bias": p["dt_bias"], "norm": p["norm"],
       "out_proj": jnp.reshape(ctx.cast(p["out_proj"], dt), (-1, m.embed_dim))}  # [N J, D]: o is flat
  segment_ids = here.segment_ids if ctx.mode == "train" else None
  lengths = here.lengths if ctx.mode == "prefill" else None
  gdn_impl = "auto" if ctx.config is None else ctx.config.gdn_impl
  fn = functools.partial(core, m, ctx.mode, ctx.dense, gdn_impl)
  # The split, the conv, the rule and the norm run in one auto-axes region (as gqa's attention core): under
  # explicit sharding their reshapes of batch-sharded rows (the fused layout's regrouping), scans and elementwise
  # steps would otherwise each need a sharding decision.
  out_y = (OUT, (B, T, m.embed_dim))
  if ctx.mode == "train":
    region = auto_region_many(lambda *args: fn(*args)[:1], (out_y,))
    (y,) = region(proj, w, segment_ids, lengths, None)
    return y, None, {}
  leaves = state_spec(m, B, 0)
  region = auto_region_many(fn, (out_y, (leaves["conv"].axes, leaves["conv"].shape),
                                 (leaves["recurrent"].axes, leaves["recurrent"].shape)))
  y, window, final = region(proj, w, segment_ids, lengths, state)
  return y, {"conv": window, "recurrent": final}, {}


# The census field "gdn": the dead work around the chunk scans of the compiled step (docs/analysis.md).
CENSUS = (CensusCounter(field="gdn", kind="scan_dead_work", scope=rule.CHUNK_SCOPE),)


def gdn(*, fused: bool = False) -> Part:
  """fused: qwen3-next's per-key-head in_proj_qkvz / in_proj_ba; else qwen3.5's in_proj_qkv, _z, _b, _a."""
  return Part(name="gdn", key=KEY, spec=functools.partial(spec, fused=fused),
              apply=functools.partial(apply, fused=fused), state_spec=state_spec,
              config=GDNConfig, mesh=MeshRules(shard_multiple=lambda m: knobs(m).chunk_size),
              instrument=Instrument(census=CENSUS, report=report))


_SECTION = gdn()  # what `section` reads of the part (its name and config) is the same in both layouts
