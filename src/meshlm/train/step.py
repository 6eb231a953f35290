"""The train step: loss, gradients over micro-batches, the AdamW update. One builder for all.

`build_train_step(cfg, mesh, loss_fn=..., batch_spec=...)` is what `meshlm train`, `census`, `compare`
and `bench` all compile. The loss is pluggable: next-token cross-entropy by default; an RL loss
takes extra batch fields (advantages, old log-probs, a replay's per-layer inputs) declared in batch_spec.

    loss_fn(cfg, params, batch, num_tokens) -> (loss, metrics)

num_tokens is the loss-mask count of the whole batch (so micro-batches sum to the big-batch loss);
metrics is a dict of scalars logged next to the loss, summed over micro-batches, except those named
`*_max` and `*_min`, which take the max and the min over them (METRIC_REDUCE).
"""
from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from meshlm.config import Config
from meshlm.errors import ConfigError
from meshlm.models.logprobs import target_logprobs
from meshlm.models.params import (after_step, after_step_side, init_model_state, init_params, merge_state,
                                  model_state_shardings, model_state_specs, param_shardings, param_specs)
from meshlm.models.model import resolve
from meshlm.models.registry import check_mesh
from meshlm import spec as S
from meshlm.parallel.mesh import make_mesh
from meshlm.parallel.sharding import constrain, logical_spec
from meshlm.train.optimizer import make_optimizer

BATCH_AXES = ("batch", "length")


@dataclasses.dataclass(frozen=True)
class BatchField:
  """One field of a batch: [B, T, *trailing] when per_token, else [B, *trailing]. check(name, host array),
  when given, refuses bad values in TrainStep.put_batch (on the host, before the step runs)."""
  dtype: str = "int32"
  per_token: bool = True
  trailing: tuple[int, ...] = ()
  check: Any = dataclasses.field(default=None, compare=False)

  def shape(self, batch: int, seq_len: int) -> tuple[int, ...]:
    return (batch,) + ((seq_len,) if self.per_token else ()) + self.trailing

  def axes(self) -> tuple[str | None, ...]:
    return ("batch",) + (("length",) if self.per_token else ()) + (None,) * len(self.trailing)


# What the data pipeline yields and the default loss reads.
BATCH_SPEC: dict[str, BatchField] = {"inputs": BatchField(), "targets": BatchField(), "segment_ids": BatchField(),
                                     "positions": BatchField(), "loss_mask": BatchField("float32")}
BATCH_KEYS = tuple(BATCH_SPEC)


def layer_input_field(cfg: Config, name: str) -> BatchField:
  """The batch field of the per-layer input `name` (models/family.LayerInput): [B, T, n, *trailing] (n: the
  layers that read it, in model order), sharded like the tokens on batch and length (the trailing axes stay
  whole, so micro-batches split it as they split the tokens). The default loss passes it to
  decoder.forward as [n, B, T, *trailing]; put_batch refuses what the part's check refuses."""
  M = resolve(cfg)
  n, li = len(M.input_readers(name)), M.layer_input(name)
  trailing = (n, *li.trailing(M.m))

  def check(field, a):
    li.check(M.m, a, (a.shape[0] if a.ndim else 0, M.cfg.train.seq_len, *trailing), field)
  return BatchField(li.dtype, True, trailing, check=check)


def replay_batch_spec(cfg: Config, base: dict[str, BatchField] = BATCH_SPEC) -> dict[str, BatchField]:
  """base plus a field for each per-layer input that replays a part's recorded choices (Replay.replays),
  laid out as layer_input_field says; ConfigError when no layer replays."""
  M = resolve(cfg)
  if not M.replays:
    raise ConfigError(f"replay: model family {M.m.family!r} here has no layer whose choices a replay forces")
  return dict(base, **{name: layer_input_field(M, name) for name in dict.fromkeys(M.replays.values())})


def layer_inputs_of(cfg: Config, batch: dict) -> dict | None:
  """The batch's per-layer input fields as decoder.forward takes them ([n, B, T, ...]); None when none."""
  got = {n: jnp.moveaxis(batch[n], 2, 0) for n in resolve(cfg).layer_input_names if n in batch}
  return got or None


class TrainState(NamedTuple):
  """step: batches consumed; params: the trainable tree (what the optimizer sees); opt_state; and
  model_state: the non-trainable leaves the layer parts declare (params.model_state_specs), changed
  only by their after-step rules ({} for models without any)."""
  step: jax.Array
  params: Any
  opt_state: Any
  model_state: Any = {}


# The loss metric holding the side outputs that the model state's after-step rules read (summed over
# micro-batches, each weighted by its share of the tokens); train_step takes it out of the metrics.
MODEL_SIDE = "model_side"


def next_token_loss(cfg: Config, params, batch: dict, num_tokens: jax.Array) -> tuple[jax.Array, dict]:
  """The default loss: mean next-token cross-entropy over the loss mask, plus the parts' own loss terms
  that are on (Part.losses, each on when its coefficient is set; `part_losses`). The head and the
  cross-entropy are models/logprobs.target_logprobs's (materialized or blockwise, as loss_impl says)."""
  M = resolve(cfg)
  aux = bool(M.losses) or bool(M.metrics)
  state_side = after_step_side(M)
  want_side = aux or bool(state_side)
  logp, _, side = target_logprobs(M, params, batch, layer_inputs=layer_inputs_of(M, batch))
  mask = batch["loss_mask"]
  with jax.named_scope("loss"):
    loss = -jnp.sum(logp * mask) / num_tokens
  mb_tokens = jnp.sum(mask)
  if not want_side:
    return loss, {}
  # This micro-batch's share of the batch's tokens (exactly 1 without micro-batches): the per-micro-batch
  # part losses then sum to their token-weighted mean, as the cross-entropy sums to the batch's.
  share = mb_tokens / num_tokens
  extra, metrics = part_losses(M, side, share) if aux else (0.0, {})
  if state_side:
    # "mean" side outputs add up to the batch's token mean, "sum" ones (counts) to the batch's total.
    metrics[MODEL_SIDE] = {n: jax.lax.stop_gradient(side[n].astype(jnp.float32)) * (share if how == "mean" else 1.0)
                           for n, how in state_side.items()}
  return loss + extra, metrics


def part_losses(cfg: Config, side: dict, weight: jax.Array) -> tuple[jax.Array, dict]:
  """(sum of coef * weight * term over the parts' loss terms that are on, {metric: weight * term}), from the
  side outputs stacked over the layers (Part.losses: each part computes its terms; only those on are
  computed and logged), and the parts' logged statistics (Part.metrics: weight * value, or the value itself
  for a *_max or *_min one, which METRIC_REDUCE reduces over micro-batches as it is)."""
  M = resolve(cfg)
  total, metrics = jnp.zeros((), jnp.float32), {}
  for name, (coef, term) in M.losses.items():
    metrics[name] = weight * term(side)
    total = total + coef * metrics[name]
  for name, term in M.metrics.items():
    value = jax.lax.stop_gradient(term(side)).astype(jnp.float32)
    metrics[name] = value if name.endswith(tuple(METRIC_REDUCE)) else weight * value
  return total, metrics


# How a loss metric accumulates over micro-batches, by its name's suffix (the rest are sums), with the
# reduction's identity as the accumulator's start: the batch's max of per-micro-batch maxes, not their sum.
METRIC_REDUCE = {"_max": (jnp.maximum, -jnp.inf), "_min": (jnp.minimum, jnp.inf)}


def metric_reduce(name: str):
  """(how loss metric `name` accumulates over micro-batches, its start value): METRIC_REDUCE's by suffix, else a sum."""
  return next((r for suffix, r in METRIC_REDUCE.items() if name.endswith(suffix)), (jnp.add, 0.0))


def _split_micro(x: jax.Array, m: int, axes) -> jax.Array:
  """[M*b, ...] -> [M, b, ...] where micro-batch i takes rows i, M+i, ...: every shard stays local."""
  b = x.shape[0] // m
  y = jnp.reshape(x, (b, m) + x.shape[1:])
  y = constrain(y, (axes[0], None) + tuple(axes[1:]))
  return jnp.swapaxes(y, 0, 1)


def param_paths(cfg: Config) -> Any:
  """Each parameter's dotted path ("layers.dense.attn.q", "embed"), in the parameter tree's structure."""
  return jax.tree_util.tree_map_with_path(lambda p, _: ".".join(str(k.key) for k in p), param_specs(cfg),
                                          is_leaf=S.is_spec)


def trainable_mask(cfg: Config) -> Any | None:
  """True for every parameter train.freeze leaves trainable; None when nothing is frozen. A pattern that
  is not a regex, or matches no parameter, is refused in one line."""
  import re
  if not cfg.train.freeze:
    return None
  paths = param_paths(cfg)
  names = jax.tree.leaves(paths)
  pats = []
  for pat in cfg.train.freeze:
    try:
      rx = re.compile(pat)
    except re.error as e:
      raise ConfigError(f"train.freeze: {pat!r} is not a regular expression ({e})") from None
    if not any(rx.fullmatch(n) for n in names):
      raise ConfigError(f"train.freeze: {pat!r} matches no parameter (paths look like {names[0]}, "
                        f"{names[len(names) // 2]}, {names[-1]})")
    pats.append(rx)
  return jax.tree.map(lambda n: not any(rx.fullmatch(n) for rx in pats), paths)


def frozen(params, trainable) -> Any:
  """params with every frozen leaf behind stop_gradient: autodiff then emits no gradient work for it."""
  if trainable is None:
    return params
  return jax.tree.map(lambda p, t: p if t else jax.lax.stop_gradient(p), params, trainable)


def grads_and_loss(cfg: Config, params, batch: dict, loss_fn=next_token_loss,
                   batch_spec: dict[str, BatchField] = BATCH_SPEC, trainable=None,
                   model_state=None) -> tuple[jax.Array, Any, dict]:
  """(loss, grads, loss metrics), summed over cfg.train.micro_batches. Frozen leaves (trainable False)
  get zero gradients without any backward work; the model state's leaves are read, never differentiated."""
  num_tokens = jnp.maximum(jnp.sum(batch["loss_mask"]), 1.0)
  fixed = jax.lax.stop_gradient(model_state or {})
  grad_fn = jax.value_and_grad(
      lambda p, b: loss_fn(cfg, merge_state(frozen(p, trainable), fixed), b, num_tokens), has_aux=True)
  m = cfg.train.micro_batches
  if m == 1:
    (loss, metrics), grads = grad_fn(params, batch)
    return loss, grads, metrics
  micro = {k: _split_micro(v, m, batch_spec[k].axes()) for k, v in batch.items()}
  def body(carry, mb):
    (loss, metrics), grads = grad_fn(params, {k: constrain(v, batch_spec[k].axes()) for k, v in mb.items()})
    c_loss, c_grads, c_metrics = carry
    # The model-side tree (MODEL_SIDE) is a sum whatever its leaves are named.
    acc = {k: jax.tree.map(metric_reduce(k)[0] if k != MODEL_SIDE else jnp.add, c_metrics[k], v)
           for k, v in metrics.items()}
    return (c_loss + loss, jax.tree.map(jnp.add, c_grads, grads), acc), None
  first = {k: v[0] for k, v in micro.items()}
  metrics_shape = jax.eval_shape(lambda b: grad_fn(params, b)[0][1], first)
  start = {k: jax.tree.map(lambda a, s=(metric_reduce(k)[1] if k != MODEL_SIDE else 0.0):
                           jnp.full(a.shape, s, a.dtype), v) for k, v in metrics_shape.items()}
  zeros = (jnp.zeros((), jnp.float32), jax.tree.map(jnp.zeros_like, params), start)
  (loss, grads, metrics), _ = jax.lax.scan(body, zeros, micro)
  return loss, grads, metrics


def train_step(cfg: Config, optimizer: optax.GradientTransformation, state: TrainState, batch: dict,
               loss_fn=next_token_loss, batch_spec: dict[str, BatchField] = BATCH_SPEC, trainable=None):
  """One update. A NaN/Inf loss or gradient norm skips it: params and optimizer state come back
  unchanged (so the optimizer's own count, which drives the LR schedule, does not advance), while
  `state.step` still advances, because it counts batches consumed and names the checkpoint."""
  loss, grads, loss_metrics = grads_and_loss(cfg, state.params, batch, loss_fn, batch_spec, trainable,
                                             state.model_state)
  params, opt_state, metrics = guarded_update(optimizer, state.params, state.opt_state, loss, grads, trainable)
  model_state = state.model_state
  side = loss_metrics.pop(MODEL_SIDE, None)
  if model_state and side is not None:
    # Each part's rule, from this step's side outputs; a skipped (non-finite) step changes nothing. A loss
    # that returns no side outputs (RL's) leaves the model state frozen.
    new = after_step(cfg, model_state, side)
    model_state = jax.tree.map(lambda a, b: jnp.where(metrics["nonfinite"], a, b), model_state, new)
  return TrainState(state.step + 1, params, opt_state, model_state), {**loss_metrics, **metrics}


def guarded_update(optimizer: optax.GradientTransformation, params, opt_state, loss: jax.Array, grads,
                   trainable=None):
  """(params, opt_state, metrics) after one optimizer update, or the inputs unchanged when the loss or
  the global gradient norm is NaN/Inf. One NaN or Inf anywhere in the gradients makes the norm
  non-finite, so a finite loss with a bad gradient is caught too. Frozen leaves (trainable False)
  come back as they went in.

  The skip is a lax.cond, not a select per leaf: a select reads each old leaf beside the new one, and
  with the state donated XLA:CPU then copies every optimizer-state leaf it updates in place (the update
  was 3x the plain update's time at 6M parameters; docs/performance-log.md, 2026-12-01)."""
  grad_norm = optax.tree.norm(grads)
  finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)

  def update(params, opt_state):
    updates, new_opt_state = optimizer.update(grads, opt_state, params)
    new_params = optax.apply_updates(params, updates)
    if trainable is not None:
      new_params = jax.tree.map(lambda new, old, t: new if t else old, new_params, params, trainable)
    return new_params, new_opt_state

  new_params, new_opt_state = jax.lax.cond(finite, update, lambda p, s: (p, s), params, opt_state)
  return new_params, new_opt_state, {"loss": loss, "grad_norm": grad_norm, "nonfinite": ~finite}


@dataclasses.dataclass
class TrainStep:
  """The compiled-or-compilable step for one config on one mesh."""
  cfg: Config
  mesh: Any
  optimizer: optax.GradientTransformation
  global_batch: int
  loss_fn: Any = next_token_loss
  batch_spec: dict = dataclasses.field(default_factory=lambda: dict(BATCH_SPEC))
  trainable: Any = None  # train.freeze's mask: True for trainable leaves; None when nothing is frozen

  def __post_init__(self):
    # Pinning both ends keeps the state's sharding fixed from step to step in either mode, so the
    # donated buffers are reused and the step compiles once.
    state_sh = self.state_shardings()
    batch_sh = {k: self.batch_sharding(k) for k in self.batch_spec}
    precision = self.cfg.train.matmul_precision

    def step(s, b):
      # Traced under the key's precision: every dot of the step (forward, loss, custom VJPs) records it.
      with jax.default_matmul_precision(None if precision == "default" else precision):
        return train_step(self.cfg, self.optimizer, s, b, self.loss_fn, self.batch_spec, self.trainable)
    self.fn = jax.jit(step, donate_argnums=(0,), in_shardings=(state_sh, batch_sh), out_shardings=(state_sh, None))

  def state_shardings(self) -> TrainState:
    """Shardings of the whole state: parameters from their specs, optimizer moments like their parameter."""
    from jax.sharding import NamedSharding, PartitionSpec
    replicated = NamedSharding(self.mesh, PartitionSpec())
    param_sh = param_shardings(self.cfg, self.mesh)
    abstract_params = jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, self.cfg.train.param_dtype, sharding=sh),
                                   param_specs(self.cfg), param_sh, is_leaf=S.is_spec)
    with jax.set_mesh(self.mesh):
      abstract_opt = jax.eval_shape(self.optimizer.init, abstract_params)
    # Frozen leaves have no optimizer state: optax.masked leaves a MaskedNode (no leaves) in their place.
    param_like = param_sh if self.trainable is None else jax.tree.map(
        lambda sh, t: sh if t else optax.MaskedNode(), param_sh, self.trainable)
    opt_sh = optax.tree_map_params(self.optimizer, lambda _, sh: sh, abstract_opt, param_like,
                                   transform_non_params=lambda _: replicated)
    return TrainState(replicated, param_sh, opt_sh, model_state_shardings(self.cfg, self.mesh))

  def _init(self, key: jax.Array) -> TrainState:
    dtype = jnp.dtype(self.cfg.train.param_dtype)
    params = S.init_tree(param_specs(self.cfg), key, dtype)
    return TrainState(jnp.zeros((), jnp.int32), params, self.optimizer.init(params),
                      S.init_tree(model_state_specs(self.cfg), key, dtype))

  def init_state(self, key: jax.Array) -> TrainState:
    """A fresh state, every leaf created straight onto its sharding."""
    sh = self.state_shardings()
    params = init_params(self.cfg, key, self.mesh)
    with jax.set_mesh(self.mesh):
      opt_state = jax.jit(self.optimizer.init, out_shardings=sh.opt_state)(params)
    return TrainState(jax.device_put(jnp.zeros((), jnp.int32), sh.step), params, opt_state,
                      init_model_state(self.cfg, key, self.mesh))

  def abstract_state(self) -> TrainState:
    # The key is made inside the trace: a concrete one would be placed on the mesh's devices, which a
    # compile-only topology (meshlm compile topology=...) cannot hold.
    with jax.set_mesh(self.mesh):
      shapes = jax.eval_shape(lambda: self._init(jax.random.key(0)))
    return jax.tree.map(lambda a, sh: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sh), shapes,
                        self.state_shardings())

  def batch_sharding(self, key: str = "inputs"):
    from jax.sharding import NamedSharding
    f = self.batch_spec[key]
    shape = f.shape(self.global_batch, self.cfg.train.seq_len)
    return NamedSharding(self.mesh, logical_spec(f.axes(), shape, self.mesh))

  def abstract_batch(self) -> dict:
    return {k: jax.ShapeDtypeStruct(f.shape(self.global_batch, self.cfg.train.seq_len), jnp.dtype(f.dtype),
                                    sharding=self.batch_sharding(k)) for k, f in self.batch_spec.items()}

  def put_batch(self, batch: dict) -> dict:
    """Global numpy batch (or this process's rows of it) -> sharded device arrays, one per batch_spec field."""
    missing = [k for k in self.batch_spec if k not in batch]
    if missing:
      raise ConfigError(f"batch: missing field {missing[0]!r} (the step's batch_spec needs {', '.join(self.batch_spec)})")
    for k, f in self.batch_spec.items():
      if f.check is not None:
        f.check(k, np.asarray(batch[k]))
    return {k: jax.make_array_from_process_local_data(self.batch_sharding(k), batch[k]) for k in self.batch_spec}

  def lower(self):
    """jax Lowered of the real step, from abstract inputs: nothing is allocated or run."""
    # The abstract inputs are made outside the mesh: optax builds its state's structure from concrete zeros,
    # which a compile-only topology's devices (meshlm compile topology=...) cannot hold.
    state, batch = self.abstract_state(), self.abstract_batch()
    with jax.set_mesh(self.mesh):
      return self.fn.lower(state, batch)

  def __call__(self, state: TrainState, batch: dict):
    with jax.set_mesh(self.mesh):
      return self.fn(state, batch)


def global_batch_size(cfg: Config, num_devices: int) -> int:
  return cfg.train.per_device_batch_size * num_devices


def build_train_step(cfg: Config, mesh=None, *, loss_fn=next_token_loss,
                     batch_spec: dict[str, BatchField] | None = None) -> TrainStep:
  """The step for cfg on mesh. loss_fn(cfg, params, batch, num_tokens) -> (loss, metrics); batch_spec
  declares every batch field (default BATCH_SPEC; it must keep "loss_mask", which counts the tokens)."""
  mesh = make_mesh(cfg) if mesh is None else mesh
  # The family's checks first (cached), then what the model's parts ask of this mesh (MeshRules.check, mesh_axes).
  check_mesh(resolve(cfg).cfg, dict(mesh.shape))
  batch_spec = dict(BATCH_SPEC if batch_spec is None else batch_spec)
  if "loss_mask" not in batch_spec:
    raise ConfigError("batch_spec: needs a loss_mask field (the token count that normalizes the loss)")
  global_batch = global_batch_size(cfg, mesh.size)
  m = cfg.train.micro_batches
  if global_batch % m:
    # Checked here, not in the schema: the global batch depends on the device count.
    raise ConfigError(f"train.micro_batches={m} must divide the global batch of {global_batch} rows "
                      f"(train.per_device_batch_size={cfg.train.per_device_batch_size} x {mesh.size} devices)")
  trainable = trainable_mask(cfg)
  optimizer = make_optimizer(cfg.train, trainable, S.no_decay_mask(param_specs(cfg)))
  return TrainStep(cfg, mesh, optimizer, global_batch, loss_fn, batch_spec, trainable)
