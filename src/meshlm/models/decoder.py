"""The generic decoder: embed -> scan over stacked layers -> final norm -> head.

A family module (FAMILIES) provides `layer_spec(model_cfg)` and `block(p, x_BTD, ctx)`, and may set
`NORM_PLUS_ONE` (RMSNorms scale by 1 + w, so the final norm is zero-initialized) and
`EMBED_SCALE` (embeddings are multiplied by sqrt(D) in the compute dtype), both False by default.

Layer types ("global" / "local" attention, ModelConfig.layer_types()) repeat with a period P. The
stack is stored one array per layer-parameter with a "layers" axis, and grouped only at run time:
a scan over groups of P layers, then the remaining L % P layers unrolled.
"""
from __future__ import annotations

import dataclasses
import functools
import importlib
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from meshlm.config import Config, ConfigError
from meshlm.models import spec as S
from meshlm.nn.attention import attention_mask
from meshlm.nn.dense import dense
from meshlm.nn.embed import attend, embed
from meshlm.nn.norm import rms_norm
from meshlm.nn.rope import freqs_at, inv_frequencies, rope_angles
from meshlm.parallel.sharding import constrain, logical_spec

ACT = ("batch", "length", "act_embed")
LOGITS = ("batch", "length", "vocab")

FAMILIES = {
    "llama": "meshlm.models.llama",
    "mistral": "meshlm.models.mistral",
    "qwen3": "meshlm.models.qwen3",
    "gemma": "meshlm.models.gemma",
    "gemma2": "meshlm.models.gemma2",
    "gemma3": "meshlm.models.gemma3",
}


def family(cfg: Config):
  name = cfg.model.family
  if name not in FAMILIES:
    raise ConfigError(f"model.family={name!r}: unknown; known families: {', '.join(sorted(FAMILIES))}")
  return importlib.import_module(FAMILIES[name])


def _norm_plus_one(cfg: Config) -> bool:
  return getattr(family(cfg), "NORM_PLUS_ONE", False)


def _embed_scale(cfg: Config) -> bool:
  return getattr(family(cfg), "EMBED_SCALE", False)


@dataclasses.dataclass(frozen=True)
class Context:
  """What every block needs besides its parameters and input.

  cos/sin/mask belong to layer_type; `variants` holds (cos, sin, mask) of the other layer types in
  the stack, and `as_type` swaps them in (local layers: sliding-window mask, maybe another theta).
  """
  model: Any
  cos: jax.Array
  sin: jax.Array
  mask: jax.Array
  segment_ids: jax.Array | None
  kernel_order: bool
  impl: str
  layer_type: str = "global"
  variants: dict = dataclasses.field(default_factory=dict)

  def as_type(self, layer_type: str) -> "Context":
    if layer_type == self.layer_type:
      return self
    cos, sin, mask = self.variants[layer_type]
    return dataclasses.replace(self, cos=cos, sin=sin, mask=mask, layer_type=layer_type)


def param_specs(cfg: Config) -> dict:
  m = cfg.model
  specs = {
      # Untied embedding rows have unit scale. A tied head reuses the rows as its kernel, and families
      # that multiply embeddings by sqrt(D) scale them up: both draw rows at D ** -0.5, so the
      # logits (and the scaled input) start at unit scale.
      "embed": S.ParamSpec((m.vocab_size, m.embed_dim), ("vocab", "embed"), "normal",
                           fan_in=m.embed_dim if (_embed_scale(cfg) or m.tie_embeddings) else 1),
      "layers": S.stack(family(cfg).layer_spec(m), m.num_layers, cfg.param_scan_axis),
      "final_norm": S.zeros(m.embed_dim) if _norm_plus_one(cfg) else S.ones(m.embed_dim),
  }
  if not m.tie_embeddings:
    specs["lm_head"] = S.kernel((m.embed_dim, m.vocab_size), ("embed", "vocab"))
  return specs


def param_shardings(cfg: Config, mesh) -> dict:
  from jax.sharding import NamedSharding
  return S.map_specs(lambda s: NamedSharding(mesh, logical_spec(s.axes, s.shape, mesh)), param_specs(cfg))


def init_params(cfg: Config, key: jax.Array, mesh=None) -> dict:
  """Initializes every parameter straight onto its sharding.

  Each leaf is drawn on the host with numpy (seeded by the key and the leaf's path), one leaf at a
  time, and placed onto its sharding: no XLA compile (a jitted init takes longer to compile than
  the tiny models take to train), the same numbers on every backend, and never more than one leaf
  on the host. Under tracing (jax.eval_shape, jit) it draws with jax.random instead: use that for
  shapes, not for numbers.
  """
  specs = param_specs(cfg)
  dtype = jnp.dtype(cfg.train.param_dtype)
  try:
    seed = tuple(int(v) for v in np.asarray(jax.random.key_data(key)).ravel())
  except jax.errors.TracerArrayConversionError:
    return S.init_tree(specs, key, dtype)
  shardings = param_shardings(cfg, mesh) if mesh is not None else S.map_specs(lambda _: None, specs)

  def leaf(path, s, sharding):
    host = S.init_leaf_host(s, seed, path).astype(dtype)
    if sharding is None:
      return jnp.asarray(host)
    return jax.make_array_from_callback(host.shape, sharding, lambda idx: host[idx])
  return jax.tree_util.tree_map_with_path(leaf, specs, shardings, is_leaf=S.is_spec)


def _layer(stack: Any, i: int, axis: int) -> Any:
  return jax.tree.map(lambda a: jax.lax.index_in_dim(a, i, axis=min(axis, a.ndim - 1), keepdims=False), stack)


def _remat(fn, policy: str):
  if policy == "none":
    return fn
  if policy == "full":
    return jax.checkpoint(fn)
  return jax.checkpoint(fn, policy=jax.checkpoint_policies.checkpoint_dots)


def make_context(cfg: Config, tokens_BT, positions_BT=None, segment_ids_BT=None) -> Context:
  """The global-layer context, with the local-layer variant when the stack has local layers."""
  m = cfg.model
  B, T = tokens_BT.shape
  if positions_BT is None:
    positions_BT = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
  cos, sin = freqs_at(positions_BT, m.head_dim, m.rope_theta, m.rope_scaling)
  variants = {}
  if "local" in m.layer_types():
    local_rope = (cos, sin)
    if m.rope_local_theta is not None:
      local_rope = rope_angles(positions_BT, inv_frequencies(m.head_dim, m.rope_local_theta))
    variants["local"] = local_rope + (attention_mask(segment_ids_BT, T, m.sliding_window),)
  return Context(model=m, cos=cos, sin=sin, mask=attention_mask(segment_ids_BT, T), segment_ids=segment_ids_BT,
                 kernel_order=cfg.dense_kernel_order, impl=cfg.weight_grad_impl, variants=variants)


def run_layers(cfg: Config, params_layers: Any, x_BTD: jax.Array, ctx: Context,
               collect: bool = False) -> tuple[jax.Array, jax.Array | None]:
  """Runs the stack. With collect, also returns every layer's output stacked in layer order: [L, B, T, D].

  With a layer-type period P, scans over L // P groups of P layers, then runs the last L % P layers.
  """
  fam = family(cfg)
  types = cfg.model.layer_types()
  P, L = len(types), cfg.model.num_layers
  blocks = [_remat(functools.partial(_block, fam, ctx.as_type(t)), cfg.remat) for t in types]
  axis = cfg.param_scan_axis
  if not cfg.scan_layers:
    outs = []
    for i in range(L):
      with jax.named_scope(f"layer_{i}"):
        x_BTD = blocks[i % P](_layer(params_layers, i, axis), x_BTD)
        outs.append(x_BTD)
    return x_BTD, (jnp.stack(outs) if collect else None)
  stack = params_layers
  if axis != 0:
    stack = jax.tree.map(lambda a: jnp.moveaxis(a, min(axis, a.ndim - 1), 0), stack)
  G, R = divmod(L, P)
  hidden = []
  if G:
    groups = stack if R == 0 else jax.tree.map(lambda a: a[:G * P], stack)
    if P > 1:
      groups = jax.tree.map(lambda a: jnp.reshape(a, (G, P) + a.shape[1:]), groups)  # [G, P, ...]
    def body(x, p):
      with jax.named_scope("layers"):
        if P == 1:
          x = blocks[0](p, x)
          return x, (x if collect else None)
        ys = []
        for j in range(P):
          # Each position in the period names its scope ("layers/local_0"), so profiles tell them apart.
          with jax.named_scope(f"{types[j]}_{j}"):
            x = blocks[j](_layer(p, j, 0), x)
          ys.append(x)
        return x, (jnp.stack(ys) if collect else None)
    x_BTD, h = jax.lax.scan(body, x_BTD, groups)
    if collect:
      hidden.append(h if P == 1 else jnp.reshape(h, (G * P,) + h.shape[2:]))  # [G*P, B, T, D]
  for j in range(R):
    i = G * P + j
    with jax.named_scope(f"layer_{i}"):
      x_BTD = blocks[j](_layer(stack, i, 0), x_BTD)
      if collect:
        hidden.append(x_BTD[None])
  if not collect:
    return x_BTD, None
  return x_BTD, (hidden[0] if len(hidden) == 1 else jnp.concatenate(hidden))


def _block(fam, ctx: Context, p: Any, x_BTD: jax.Array) -> jax.Array:
  return fam.block(p, x_BTD, ctx)


def head(cfg: Config, params: dict, x_BTD: jax.Array) -> jax.Array:
  """Logits [B, T, V] from the final-normed activations, soft-capped when the model asks for it."""
  with jax.named_scope("lm_head"):
    if cfg.model.tie_embeddings:
      logits = attend(params["embed"], x_BTD)
    else:
      logits = dense(x_BTD, params["lm_head"].astype(x_BTD.dtype), "btd,dv->btv", LOGITS,
                     kernel_order=cfg.lm_head_kernel_order, impl=cfg.weight_grad_impl)
    cap = cfg.model.final_logit_softcap
    if cap is not None:
      logits = (cap * jnp.tanh(logits.astype(jnp.float32) / cap)).astype(logits.dtype)
    return logits


def forward(cfg: Config, params: dict, tokens_BT: jax.Array, positions_BT=None, segment_ids_BT=None,
            return_hidden: bool = False):
  """Logits [B, T, V] in the compute dtype.

  With return_hidden, returns (logits, hidden) where hidden [L, B, T, D] holds each layer's output
  (before the final norm), in layer order, for layer-by-layer comparison with a reference.
  """
  m = cfg.model
  dt = jnp.dtype(cfg.train.compute_dtype)
  ctx = make_context(cfg, tokens_BT, positions_BT, segment_ids_BT)
  x = constrain(embed(params["embed"], tokens_BT, dt), ACT)  # [B, T, D]
  if _embed_scale(cfg):
    # sqrt(D) rounded to the compute dtype first, as HF does: bf16 runs see the same factor.
    x = x * jnp.asarray(m.embed_dim ** 0.5, dt)
  x, hidden = run_layers(cfg, params["layers"], x, ctx, collect=return_hidden)
  x = rms_norm(params["final_norm"], x, m.norm_eps, plus_one=_norm_plus_one(cfg))
  logits = head(cfg, params, x)
  return (logits, hidden) if return_hidden else logits
