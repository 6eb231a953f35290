"""The generic decoder: embed -> scan over stacked layers -> final norm -> head."""
from __future__ import annotations

import dataclasses
import importlib
from typing import Any

import jax
import jax.numpy as jnp

from meshlm.config import Config
from meshlm.models import spec as S
from meshlm.nn.attention import attention_mask
from meshlm.nn.dense import dense
from meshlm.nn.embed import attend, embed
from meshlm.nn.norm import rms_norm
from meshlm.nn.rope import inv_frequencies, rope_angles
from meshlm.parallel.sharding import constrain, logical_spec

ACT = ("batch", "length", "act_embed")
LOGITS = ("batch", "length", "vocab")

FAMILIES = {"llama": "meshlm.models.llama"}


def family(cfg: Config):
  name = cfg.model.family
  if name not in FAMILIES:
    raise ValueError(f"model.family={name!r}: unknown; known families: {', '.join(sorted(FAMILIES))}")
  return importlib.import_module(FAMILIES[name])


@dataclasses.dataclass(frozen=True)
class Context:
  """What every block needs besides its parameters and input."""
  model: Any
  cos: jax.Array
  sin: jax.Array
  mask: jax.Array
  segment_ids: jax.Array | None
  kernel_order: bool
  impl: str


def param_specs(cfg: Config) -> dict:
  m = cfg.model
  specs = {
      # Embedding rows have unit scale (fan_in 1); the tied head reuses them.
      "embed": S.ParamSpec((m.vocab_size, m.embed_dim), ("vocab", "embed"), "normal", fan_in=1),
      "layers": S.stack(family(cfg).layer_spec(m), m.num_layers, cfg.param_scan_axis),
      "final_norm": S.ones(m.embed_dim),
  }
  if not m.tie_embeddings:
    specs["lm_head"] = S.kernel((m.embed_dim, m.vocab_size), ("embed", "vocab"))
  return specs


def param_shardings(cfg: Config, mesh) -> dict:
  from jax.sharding import NamedSharding
  return S.map_specs(lambda s: NamedSharding(mesh, logical_spec(s.axes, s.shape, mesh)), param_specs(cfg))


def init_params(cfg: Config, key: jax.Array, mesh=None) -> dict:
  """Initializes every parameter straight onto its sharding (no host copy of the whole model)."""
  specs = param_specs(cfg)
  dtype = jnp.dtype(cfg.train.param_dtype)
  fn = lambda k: S.init_tree(specs, k, dtype)
  if mesh is None:
    return jax.jit(fn)(key)
  with jax.set_mesh(mesh):
    return jax.jit(fn, out_shardings=param_shardings(cfg, mesh))(key)


def _layer(stack: Any, i: int, axis: int) -> Any:
  return jax.tree.map(lambda a: jax.lax.index_in_dim(a, i, axis=min(axis, a.ndim - 1), keepdims=False), stack)


def _remat(fn, policy: str):
  if policy == "none":
    return fn
  if policy == "full":
    return jax.checkpoint(fn)
  return jax.checkpoint(fn, policy=jax.checkpoint_policies.checkpoint_dots)


def make_context(cfg: Config, tokens_BT, positions_BT=None, segment_ids_BT=None) -> Context:
  m = cfg.model
  B, T = tokens_BT.shape
  if positions_BT is None:
    positions_BT = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
  cos, sin = rope_angles(positions_BT, inv_frequencies(m.head_dim, m.rope_theta, m.rope_scaling))
  return Context(model=m, cos=cos, sin=sin, mask=attention_mask(segment_ids_BT, T), segment_ids=segment_ids_BT,
                 kernel_order=cfg.dense_kernel_order, impl=cfg.weight_grad_impl)


def run_layers(cfg: Config, params_layers: Any, x_BTD: jax.Array, ctx: Context,
               collect: bool = False) -> tuple[jax.Array, jax.Array | None]:
  """Runs the stack. With collect, also returns every layer's output stacked: [L, B, T, D]."""
  fam = family(cfg)
  block = _remat(lambda p, x: fam.block(p, x, ctx), cfg.remat)
  axis = cfg.param_scan_axis
  if cfg.scan_layers:
    stack = params_layers
    if axis != 0:
      stack = jax.tree.map(lambda a: jnp.moveaxis(a, min(axis, a.ndim - 1), 0), stack)
    def body(x, p):
      with jax.named_scope("layers"):
        y = block(p, x)
        return y, (y if collect else None)
    x_BTD, hidden = jax.lax.scan(body, x_BTD, stack)
    return x_BTD, hidden
  outs = []
  for i in range(cfg.model.num_layers):
    with jax.named_scope(f"layer_{i}"):
      x_BTD = block(_layer(params_layers, i, axis), x_BTD)
      outs.append(x_BTD)
  return x_BTD, (jnp.stack(outs) if collect else None)


def head(cfg: Config, params: dict, x_BTD: jax.Array) -> jax.Array:
  with jax.named_scope("lm_head"):
    if cfg.model.tie_embeddings:
      return attend(params["embed"], x_BTD)
    return dense(x_BTD, params["lm_head"].astype(x_BTD.dtype), "btd,dv->btv", LOGITS,
                 kernel_order=cfg.lm_head_kernel_order, impl=cfg.weight_grad_impl)


def forward(cfg: Config, params: dict, tokens_BT: jax.Array, positions_BT=None, segment_ids_BT=None,
            return_hidden: bool = False):
  """Logits [B, T, V] in the compute dtype.

  With return_hidden, returns (logits, hidden) where hidden [L, B, T, D] holds each layer's output
  (before the final norm), for layer-by-layer comparison with a reference.
  """
  dt = jnp.dtype(cfg.train.compute_dtype)
  ctx = make_context(cfg, tokens_BT, positions_BT, segment_ids_BT)
  x = constrain(embed(params["embed"], tokens_BT, dt), ACT)
  x, hidden = run_layers(cfg, params["layers"], x, ctx, collect=return_hidden)
  x = rms_norm(params["final_norm"], x, cfg.model.norm_eps)
  logits = head(cfg, params, x)
  return (logits, hidden) if return_hidden else logits
