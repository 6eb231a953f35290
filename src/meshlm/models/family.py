"""The layer interface: parts, kinds, the plan, and the family that composes them.

A layer **kind** is a mixer and a feed-forward plus their norms:

    x = x + post_norm(mixer(norm(x)))        # gqa, later mla, gdn, gated_gqa
    x = x + post_norm(ffn(norm(x)))          # glu, moe

Both halves are a `Part` (models/mixers/, models/ffns/; registered in models/registry.py): a small core that
every part sets (`Part`'s docstring), and opt-in records, each a small frozen dataclass grouped by concern, that
only a part with that concern sets: `Compute` (how the decoder runs it), `Replay` (routing replay),
`ModelState` (non-trainable leaves with an after-step rule), `MeshRules` and `Instrument` (what the census and
the model FLOPs count). Each field is documented once, in its class's docstring (tests/test_layer_interface.py
holds that every field is). The generic decoder (models/decoder.py) reads only these fields: it knows no part by
name.
"""
from __future__ import annotations

import dataclasses
import functools
import json
from typing import Any, Callable, ClassVar, Mapping

import jax
import pydantic

from meshlm.config import Config, ModelConfig
from meshlm.errors import ConfigError
from meshlm import spec as S
from meshlm.nn.norm import rms_norm
from meshlm.parallel.sharding import ACT, constrain

COMMITS = ("rows", "replace")


@dataclasses.dataclass(frozen=True)
class LayerInput:
  """A per-layer input a part reads (`ctx.layer[name]`): [n, B, T, *trailing(m)] of `dtype` when given to
  the decoder (n: the layers that read it, model order), [B, T, n, *trailing] as a batch field.

  check(m, array, shape, name) refuses a wrong shape, and bad values when the array is concrete
  (ValueError, one line). A replayed input (Replay.replays) may name `flips`, the metric prefix under which
  RL reports the fraction of the sampler's recorded choices (the last axis holds a token's choices, -1 =
  none) that the trainer's own forward did not make."""
  trailing: Callable[[ModelConfig], tuple[int, ...]]
  check: Callable[..., None]
  dtype: str = "int32"
  flips: str | None = None


@dataclasses.dataclass(frozen=True)
class StateLeaf:
  """One leaf of a layer's decode state.

  commit "rows": the leaf holds C cache slots on its slot_axis (e.g. [B, C, ...]); in prefill the update
  is the prompt's rows (T at slot_axis), moved into the slots; in decode it is the new position's row
  (1 at slot_axis), written at each row's slot in place. "replace": the update is the whole new leaf (a
  recurrent state). Its dtype is the update's (the compute dtype). in_place: in decode a scanned layer gets the leaf
  as `nn.kv_cache.LayerRow` (its row left in the stacked cache, with the scan's layer index), for a kernel that reads
  the layer's slots where they lie (nn/decode_attention.py); `kv_cache.row` slices it out for code that does not.
  """
  shape: tuple[int, ...]
  axes: tuple[str | None, ...]
  commit: str = "rows"
  slot_axis: int = 1  # "rows": the axis of the C slots (batch is axes' "batch")
  in_place: bool = False

  def __post_init__(self):
    assert len(self.shape) == len(self.axes), (self.shape, self.axes)
    assert self.commit in COMMITS, self.commit
    S.check_axes(self.axes, f"StateLeaf axes {self.axes}")


# The counting kinds a part may declare for the census (Instrument.census), each implemented by analysis/counters.py:
# "scope_gathers_scatters": the StableHLO gathers and scatters run per step under the scope (a component of the
#   op's layer path), by direction: {gathers, scatters} x {forward, backward}, under the "stablehlo." fields;
# "scan_dead_work": the compiled step's while loops whose op name holds the scope, and the dead work around them
#   (zero-filled outputs, zero buffers carried by a loop around them, copies and transposes in their bodies).
CENSUS_KINDS = ("scope_gathers_scatters", "scan_dead_work")


@dataclasses.dataclass(frozen=True)
class CensusCounter:
  """A count the census reports for a part: `kind` (CENSUS_KINDS) of the ops under the named scope `scope`,
  at the census's dotted path `field` ("stablehlo.<name>" for a kind that reads the StableHLO)."""
  field: str
  kind: str
  scope: str

  def __post_init__(self):
    assert self.kind in CENSUS_KINDS, (self.kind, CENSUS_KINDS)
    assert self.field and self.scope, self


SIDE_SUMS = ("mean", "sum")  # how the train step adds an after-step side output over micro-batches


@dataclasses.dataclass(frozen=True)
class Compute:
  """How the decoder runs a part, beyond apply (gqa, gated_gqa and moe set it).

  - prepare(stack, specs, dtype) -> stack: runs once before the layer scan on the part's stacked parameters (a
    "layers" axis leading or at param_scan_axis; dtype: the compute dtype): gather-once transforms live here.
  - remat_save_names: names (jax.ad_checkpoint.checkpoint_name) a remat policy must save.
  - with_plus_one(part, on) -> Part: `part` (this part, or a copy with other fields replaced) with its own
    RMSNorms (gqa's q/k norms) scaling by (1 + w) (on) or plainly, every other field kept. The Family calls it
    with its `norm_plus_one`, the one switch for every RMSNorm of the model; None for a part whose norms do not
    follow it (gdn's gated norm and mla's norms are plain, gated_gqa's q/k norms are always (1 + w), as in
    Hugging Face)."""
  prepare: Callable[[dict, dict, Any], dict] | None = None
  remat_save_names: tuple[str, ...] = ()
  with_plus_one: Callable[["Part", bool], "Part"] | None = None


@dataclasses.dataclass(frozen=True)
class Replay:
  """Routing replay: per-layer inputs a part reads, and the side outputs they force (moe sets it).

  - layer_inputs: {name: LayerInput}: per-layer inputs the part reads from `ctx.layer[name]`, given to the decoder
    stacked over the model layers that read them ([n, B, T, *trailing]); the train step takes each as a batch
    field [B, T, n, *trailing] of that name, and LayerInput.check refuses a bad one either way.
  - replays: {side output: the per-layer input that forces it} (MoE: the routed ids replay as forced ids), what a
    sampler records for a replay."""
  layer_inputs: Mapping[str, LayerInput] = dataclasses.field(default_factory=dict)
  replays: Mapping[str, str] = dataclasses.field(default_factory=dict)

  def __post_init__(self):
    assert set(self.replays.values()) <= set(self.layer_inputs), (self.replays, tuple(self.layer_inputs))


@dataclasses.dataclass(frozen=True)
class ModelState:
  """Non-trainable leaves of a part with the rule that updates them after each step (moe's group_sigmoid routing
  sets it: the router bias).

  - spec(m) -> ParamSpec tree of the leaves (merged into the part's p, never seen by the optimizer).
  - after_step(leaves, side, m) -> leaves: the rule, from the part's side outputs (stacked over the kind's layers).
  - side: {side output: "mean" | "sum"}, the side outputs the rule reads and how the train step adds them over
    micro-batches: "mean" weights each by its micro-batch's share of the tokens (a token mean), "sum" adds them as
    they are (counts: the whole batch's total); empty = every side output of the part, "mean"."""
  spec: Callable[[ModelConfig], dict]
  after_step: Callable[[dict, dict, ModelConfig], dict]
  side: Mapping[str, str] = dataclasses.field(default_factory=dict)

  def __post_init__(self):
    assert set(self.side.values()) <= set(SIDE_SUMS), self.side


@dataclasses.dataclass(frozen=True)
class MeshRules:
  """What a part asks of the mesh and of the run (moe and gdn set it).

  - axes: the mesh axes that only such a part shards over (moe: "expert"); a model none of whose parts names an
    axis refuses a size above 1 for it.
  - check(m, sizes): refuses mesh axis sizes the part cannot shard over (sizes: {axis: size}, only the axes known
    so far), one ConfigError line naming the keys.
  - shard_multiple(m) -> int: with the sequence split over mesh.context, each shard's length must be a multiple of
    it (gdn: whole chunks, model.parts.gdn.chunk_size); 1 for a part with no such need.
  - run_knobs(cfg) -> {knob: value}: the knobs of its section that the config leaves null for the run to decide
    from the mesh and the batch, filled in when the model resolves (registry.resolved); {} when none is left.
  - stack_rows: names of parameters the part reads by row from their stacks itself: in an unrolled layer it gets
    them as `nn.stack_row.StackRow(stack, layer row)` instead of the sliced row (a copy on XLA:CPU), so a part
    whose parameters are large reads only what it uses (MoE: one expert's kernel at a time).
  - search: {knob: values}: knobs of its section that the layout search (`meshlm compile --fit=layout`,
    analysis/layout.py) tries when the user left them unset, every combination of their values (one the config
    refuses is skipped).
  - drops(values) -> bool: whether searched knob values ({knob: value}) change the model's numbers (MoE: a compact
    buffer that drops rows); the search ranks such a layout after one that keeps them, and says so.
  - memory(cfg, sizes, mesh, tokens) -> LayerMemory: how one of its layers counts in the layout estimate beyond the
    dense kernels and activations (sizes: {mesh axis: size}, mesh: that abstract mesh, tokens: per device); None:
    it adds nothing."""
  axes: tuple[str, ...] = ()
  check: Callable[[ModelConfig, Mapping[str, int]], None] = lambda m, sizes: None
  shard_multiple: Callable[[ModelConfig], int] = lambda m: 1
  run_knobs: Callable[[Config], dict] = lambda cfg: {}
  stack_rows: tuple[str, ...] = ()
  search: Mapping[str, tuple] = dataclasses.field(default_factory=dict)
  drops: Callable[[Mapping[str, Any]], bool] = lambda values: False
  memory: Callable[..., "LayerMemory"] | None = None


@dataclasses.dataclass(frozen=True)
class LayerMemory:
  """A part's own terms in the layout estimate of one of its layers (MeshRules.memory; analysis/layout.py).

  - buffers: bytes per device of its working buffers beyond the dense activations (MoE: the dispatch's routed rows).
  - split(s) -> int | None: for a kernel of its spec (a ParamSpec, one layer's) whose activations its buffers count
    (MoE's expert kernels), how many devices it stays split over as its dots read it (the expert-parallel group; 1:
    gathered whole); None for a dense projection (gathered whole, its output counted among the layer's activations).
  - grads_every_layer: whether the float32 gradients of its own kernels (split not None) may be live for every such
    layer of the scanned period at once rather than one layer's (MoE without grad_reduce_barrier: XLA leaves their
    reductions in flight)."""
  buffers: int = 0
  split: Callable[[S.ParamSpec], int | None] = lambda s: None
  grads_every_layer: bool = False


@dataclasses.dataclass(frozen=True)
class Instrument:
  """What the instruments count of a part (the census, the model FLOPs).

  - census: (CensusCounter, ...): what the census counts for the part in the compiled step, as data: a counting
    kind (CENSUS_KINDS, which analysis/counters.py implements) over the ops under one of the part's named scopes,
    reported at a dotted census field. The census reads the counters of every registered part, so a model without
    the part shows the field with zeros.
  - attention_width(m) -> N x (qk + v head dims) for a part whose queries attend over earlier keys (the model
    FLOPs count 6 x that x the keys a query sees), None for a part that does not attend.
  - attention_shape(m) -> nn/attention.Shape (query and KV heads, q/k and v head dims, the soft-cap) of a part that
    calls the attention core: what the core's blocks are chosen over (models/context.attention_core) and what the
    registry's TPU compile check compiles (tests/test_attention_tpu.py); None for a part that does not.
  - active_fraction(m, s): the share of one of its parameters (a ParamSpec of spec(m), stacked) that one token's
    matmuls meet (MoE's routed experts: k / E), 1.0 by default.
  - report(cfg, platform, context) -> {key: value}: what the part's train step runs under the config cfg (its model
    sections resolved), for a program built for
    `platform` with `context` sequence shards (gdn: {"gdn_impl": "pallas"}), which the config summary of census and
    compile (and train's banner) print; {} by default."""
  census: tuple[CensusCounter, ...] = ()
  attention_width: Callable[[ModelConfig], int] | None = None
  attention_shape: Callable[[ModelConfig], Any] | None = None
  active_fraction: Callable[[ModelConfig, S.ParamSpec], float] = lambda m, s: 1.0
  report: Callable[[Any, str, int], dict] = lambda cfg, platform, context: {}


class PartConfig(pydantic.BaseModel):
  """The base of a part's own config section (Part.config, model.parts.<part>): unknown keys are refused. COMPUTE:
  the knobs that change how the layer computes the same parameters (a checkpoint resumes under other values).
  RETIRED: knobs the section had and no longer reads, dropped where a saved config (a run's config.yaml) still
  holds them."""
  model_config = pydantic.ConfigDict(extra="forbid")
  COMPUTE: ClassVar[tuple[str, ...]] = ()
  RETIRED: ClassVar[tuple[str, ...]] = ()

  @pydantic.model_validator(mode="before")
  @classmethod
  def _drop_retired(cls, data):
    return {k: v for k, v in data.items() if k not in cls.RETIRED} if isinstance(data, dict) else data


@dataclasses.dataclass(frozen=True)
class Part:
  """A mixer or a feed-forward: the declared interface of one half of a layer kind. The core, which a part with
  no replay, model state or mesh rules sets alone:

  - name: the part's name (models/registry.PARTS, its config section's).
  - key: its subtree in one layer's parameters ("attn", "mlp", "moe").
  - spec(m) -> one layer's ParamSpec tree, stored under `key` in the layer's parameters.
  - apply(p, x_BTD, ctx, state) -> (y_BTD, update, side). p: the part's parameters for one layer (after
    `prepare`, with the model-state leaves merged in); ctx: the `Context` (models/context.py); state: the layer's
    decode state (its leaves as `state_spec` declares them) in decode, else None; update: what the layer wrote
    (None when training), committed by the decoder after the layer scan; side: per-layer side outputs ({name:
    array}), {} when there are none.
  - state_spec(m, batch, size) -> {leaf: StateLeaf}: the decode state of one layer whose context holds `size`
    cache slots, and how its update is committed ("rows" or "replace").
  - position_wise: True for a part whose output at a position reads that position's input alone (a feed-forward),
    so it keeps no decode state. Every part declares one or the other: a state_spec, or position_wise
    (tests/test_conformance.py refuses a part with neither, and samples from every family against recomputing,
    which catches a wrong one).
  - config: the part's own config section, a PartConfig whose fields are the part's knobs (with defaults, or
    required: moe's num_experts), set as model.parts.<part name>.<knob> (presets: `parts: {name: {knob: value}}`)
    and read in the part with `section(m, part)`. The family refuses a section that none of its parts declares,
    and checks each section its parts declare, given or not: an unknown knob, a bad value or a missing required
    one is refused naming the key, when the model resolves.
  - needs: the ModelConfig fields the part reads that default to null, because a model without the part has no
    use for them but several parts share them (attention's heads, read by gqa, gated_gqa and mla); the registry
    refuses a family with the part when one is null, naming the key, before the family's own checks run. A value
    only the part reads is a knob of its section instead, required there when it has no default.
  - rotary_dims(m) -> the RoPE widths the part reads from its context (`ctx.here.rope[dim]`).
  - side_names: the side outputs apply returns (every one, every call).
  - losses(m) -> {metric: (coef, fn(side) -> scalar)}: the part's own loss terms (MoE: the router's
    load-balancing and z losses), {} when none is on; the train step adds coef x the token-weighted value to the
    loss and logs the weighted value under the metric's name.
  - metrics(m) -> {metric: fn(side) -> scalar}: statistics logged beside the loss and never added to it (MoE: the
    compact dispatch's dropped slots), {} when none is on; token-weighted over micro-batches like the losses, except
    names ending in _max or _min, which take the max or min over them (train/step.py METRIC_REDUCE).

  The opt-in records, each a frozen dataclass documented in its own docstring; a part without the concern leaves
  its default, which declares nothing:

  - compute: Compute, how the decoder runs it (prepare, remat names, its own (1 + w) norms).
  - replay: Replay, routing replay (per-layer inputs, the side outputs they force).
  - model_state: ModelState or None, non-trainable leaves and their after-step rule.
  - mesh: MeshRules, what it asks of the mesh and the run.
  - instrument: Instrument, what the census and the model FLOPs count of it."""
  name: str
  key: str
  spec: Callable[[ModelConfig], dict]
  apply: Callable[..., tuple[jax.Array, Any, dict]]
  state_spec: Callable[[ModelConfig, int, int], dict[str, StateLeaf]] | None = None
  position_wise: bool = False
  config: type[PartConfig] | None = None
  needs: tuple[str, ...] = ()
  rotary_dims: Callable[[ModelConfig], tuple[int, ...]] = lambda m: ()
  side_names: tuple[str, ...] = ()
  losses: Callable[[ModelConfig], Mapping[str, tuple[float, Callable[[dict], jax.Array]]]] = lambda m: {}
  metrics: Callable[[ModelConfig], Mapping[str, Callable[[dict], jax.Array]]] = lambda m: {}
  compute: Compute = dataclasses.field(default_factory=Compute)
  replay: Replay = dataclasses.field(default_factory=Replay)
  model_state: ModelState | None = None
  mesh: MeshRules = dataclasses.field(default_factory=MeshRules)
  instrument: Instrument = dataclasses.field(default_factory=Instrument)

  def __post_init__(self):
    assert not (self.position_wise and self.state_spec is not None), f"{self.name}: position_wise with a state_spec"
    assert set(self.replay.replays) <= set(self.side_names), (self.replay.replays, self.side_names)
    if self.model_state is not None:
      assert set(self.model_state.side) <= set(self.side_names), (self.model_state.side, self.side_names)

  def state_side(self) -> dict[str, str]:
    """{side output: "mean" | "sum"} that the model-state rule reads (none without one)."""
    if self.model_state is None:
      return {}
    return dict(self.model_state.side) or {n: "mean" for n in self.side_names}


def section(m: ModelConfig, part: Part) -> pydantic.BaseModel:
  """part's config section (Part.config) from model.parts[part.name], its defaults filled in."""
  return _section(part.config, json.dumps(m.parts.get(part.name, {}), sort_keys=True))


@functools.lru_cache(maxsize=256)
def _section(cls: type[pydantic.BaseModel], text: str) -> pydantic.BaseModel:
  return cls.model_validate(json.loads(text))


def check_needs(m: ModelConfig, parts: list[Part]) -> None:
  """Each field the given parts need (Part.needs) is set: one ConfigError line naming the key otherwise."""
  for part in parts:
    for key in part.needs:
      if getattr(m, key) is None:
        raise ConfigError(f"model.{key}: required by model.family={m.family} (its {part.name} layers); set "
                          f"model.{key}=...")


def check_sections(m: ModelConfig, parts: list[Part]) -> None:
  """model.parts against the sections the given parts declare, each one checked whether model.parts holds it or
  not (a knob a section requires has no default): one ConfigError line naming the key."""
  own = {p.name: p for p in parts if p.config is not None}
  for name in m.parts:
    if name not in own:
      raise ConfigError(f"model.parts.{name}: model family {m.family!r} has no part {name!r} with knobs of its own "
                        f"(parts with knobs: {', '.join(sorted(own)) or 'none'})")
  for name, part in own.items():
    try:
      part.config.model_validate(m.parts.get(name, {}))
    except pydantic.ValidationError as err:
      first = err.errors()[0]
      key = ".".join(["model.parts", name, *(str(x) for x in first["loc"])])
      field = part.config.model_fields.get(str(first["loc"][0])) if first["loc"] else None
      if first["type"] == "missing" or (first.get("input") is None and field is not None and field.is_required()):
        raise ConfigError(f"{key}: required by model.family={m.family} (its {name} layers); set {key}=...") from None
      known = ", ".join(part.config.model_fields)
      msg = "unknown knob" if first["type"] == "extra_forbidden" else first["msg"].removeprefix("Value error, ")
      if first["type"] not in ("extra_forbidden", "value_error") and not isinstance(first.get("input"), dict):
        msg = f"{msg} (got {first['input']!r})"  # a value error's own message names the value
      raise ConfigError(f"{key}: {msg} (the {name} part's knobs: {known})") from None


HALVES = ("attn", "mlp")  # a layer's two halves, its parts' scopes and its norms' names


@dataclasses.dataclass(frozen=True)
class Kind:
  """A kind of layer: a mixer and a feed-forward, each pre-normed, post-normed when `sandwich`
  (gemma2/3). Its parameters are one stack, `params["layers"][kind]`: {"attn_norm", mixer.key,
  "mlp_norm", ffn.key[, "attn_post_norm", "mlp_post_norm"]} (the norm names are the checkpoints' and
  Hugging Face maps'). Its norms scale by (1 + w) when `plus_one`, which only its Family sets (from
  `Family.norm_plus_one`, with the parts' own norms), so no kind can disagree with its model."""
  mixer: Part
  ffn: Part
  sandwich: bool = False
  plus_one: bool = dataclasses.field(default=False, init=False)

  @property
  def parts(self) -> tuple[Part, Part]:
    return (self.mixer, self.ffn)

  def with_plus_one(self, on: bool) -> "Kind":
    """This kind with (1 + w) norms (on) or plain ones: its own and its parts' (Compute.with_plus_one)."""
    mixer, ffn = (p if p.compute.with_plus_one is None else p.compute.with_plus_one(p, on) for p in self.parts)
    kind = dataclasses.replace(self, mixer=mixer, ffn=ffn)
    object.__setattr__(kind, "plus_one", on)  # init=False: a family file cannot set it by hand
    return kind

  def spec(self, m: ModelConfig) -> dict:
    norm = S.zeros if self.plus_one else S.ones
    out = {"attn_norm": norm(m.embed_dim), self.mixer.key: self.mixer.spec(m),
           "mlp_norm": norm(m.embed_dim), self.ffn.key: self.ffn.spec(m)}
    if self.sandwich:
      out["attn_post_norm"] = norm(m.embed_dim)
      out["mlp_post_norm"] = norm(m.embed_dim)
    return out

  def state_spec(self, m: ModelConfig, batch: int, size: int) -> dict:
    """{part key: {leaf: StateLeaf}} for the parts that keep decode state."""
    return {p.key: p.state_spec(m, batch, size) for p in self.parts if p.state_spec is not None}

  def model_state(self, m: ModelConfig) -> dict:
    """{part key: ParamSpec tree} of the parts' non-trainable leaves."""
    return {p.key: p.model_state.spec(m) for p in self.parts if p.model_state is not None}

  def apply(self, p: dict, x_BTD: jax.Array, ctx, state: dict | None = None) -> tuple[jax.Array, dict, dict]:
    """One layer: (x [B, T, D], {part key: update} for the parts that returned one, side outputs)."""
    updates, side = {}, {}
    for i, part in enumerate(self.parts):
      x_BTD, update, part_side = self.half(i, p, x_BTD, ctx, state)
      if update is not None:
        updates[part.key] = update
      side.update(part_side)
    return constrain(x_BTD, ACT), updates, side

  def half_keys(self, i: int) -> tuple[str, ...]:
    """The layer's parameter keys half i reads (0: the mixer's, 1: the feed-forward's): its norms and its part's."""
    half = HALVES[i]
    return (f"{half}_norm", self.parts[i].key) + ((f"{half}_post_norm",) if self.sandwich else ())

  def half(self, i: int, p: dict, x_BTD: jax.Array, ctx, state: dict | None = None) -> tuple[jax.Array, Any, dict]:
    """Half i of the layer, in its scope ("attn", "mlp"): (x + [post-norm](part(norm(x))), the part's update or
    None, its side outputs). p: the layer's parameters (at least half_keys(i)); state: the layer's."""
    m, part = ctx.model, self.parts[i]
    with jax.named_scope(HALVES[i]):
      h = rms_norm(p[f"{HALVES[i]}_norm"], x_BTD, m.norm_eps, plus_one=self.plus_one)
      h, update, side = part.apply(p[part.key], h, ctx, None if state is None else state.get(part.key))
      if self.sandwich:
        h = rms_norm(p[f"{HALVES[i]}_post_norm"], h, m.norm_eps, plus_one=self.plus_one)
      return x_BTD + h, update, side


@dataclasses.dataclass(frozen=True)
class LayerPlan:
  """Which kind and which attention context each model layer is, and how the decoder groups them.

  Layers [0, prefix) run unrolled first (deepseek's dense first k). The rest repeat a pattern of
  `period` layers: the decoder scans over whole periods and unrolls the remainder. Each kind's
  parameters are one stack holding that kind's layers in model order; `slots()` maps a model layer
  index to (kind, row in that kind's stack). Checkpoints and HF maps see model indices only.
  """
  kinds: tuple[str, ...]  # per model layer
  contexts: tuple[str, ...]  # per model layer: "global" or "local" attention inputs
  period: int = 1
  prefix: int = 0

  def __post_init__(self):
    assert len(self.kinds) == len(self.contexts), (self.kinds, self.contexts)
    assert 0 <= self.prefix <= len(self.kinds) and self.period >= 1

  @property
  def num_layers(self) -> int:
    return len(self.kinds)

  @property
  def groups(self) -> int:
    """Whole periods after the prefix: the scan's length."""
    return (self.num_layers - self.prefix) // self.period

  @property
  def rest(self) -> int:
    """Layers after the last whole period, run unrolled."""
    return (self.num_layers - self.prefix) % self.period

  def kind_names(self) -> tuple[str, ...]:
    """The kinds present, in order of first appearance."""
    return tuple(dict.fromkeys(self.kinds))

  def slots(self) -> list[tuple[str, int]]:
    """Model layer index -> (kind, row in that kind's stack)."""
    seen: dict[str, int] = {}
    out = []
    for k in self.kinds:
      out.append((k, seen.get(k, 0)))
      seen[k] = seen.get(k, 0) + 1
    return out

  def count(self, kind: str) -> int:
    return self.kinds.count(kind)


@dataclasses.dataclass(frozen=True)
class Family:
  """A model family: its layer kinds, its plan, the two decoder-level switches and its own checks.

  norm_plus_one is the one switch for (1 + w) RMSNorms: the kinds' layer norms, their parts' own norms
  (Compute.with_plus_one: gqa's q/k norms) and the final norm all follow it."""
  name: str
  kinds: Mapping[str, Kind]
  # The layer plan for a config; default: every layer of the first kind, contexts repeating
  # ModelConfig.context_pattern() with that pattern as the period.
  plan: Callable[[ModelConfig], LayerPlan] | None = None
  norm_plus_one: bool = False  # RMSNorms scale by (1 + w); the final norm starts at zero
  embed_scale: bool = False  # embeddings are multiplied by sqrt(D) in the compute dtype
  # Refuses config fields this family cannot run (raise meshlm's ConfigError, one line naming the key).
  validate: Callable[[ModelConfig], None] = lambda m: None

  def __post_init__(self):
    # Forgetting the flag on one kind or one part would run with wrong numbers: they all take this one.
    object.__setattr__(self, "kinds", {n: k.with_plus_one(self.norm_plus_one) for n, k in self.kinds.items()})

  def layer_plan(self, m: ModelConfig) -> LayerPlan:
    if self.plan is not None:
      return self.plan(m)
    kind = next(iter(self.kinds))
    return LayerPlan(kinds=(kind,) * m.num_layers, contexts=m.layer_contexts(), period=len(m.context_pattern()))
