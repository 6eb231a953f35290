"""The config schema: one pydantic tree, validated before anything compiles."""
from __future__ import annotations

from typing import Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, model_validator


class _Strict(BaseModel):
  model_config = ConfigDict(extra="forbid", validate_assignment=True)


class ModelConfig(_Strict):
  """Shapes of a decoder. Field names are the words used in presets and on the CLI."""
  family: str = "llama"
  vocab_size: int = Field(gt=0)
  embed_dim: int = Field(gt=0)
  num_layers: int = Field(gt=0)
  num_heads: int = Field(gt=0)
  num_kv_heads: int = Field(gt=0)
  head_dim: int = Field(gt=0)
  mlp_dim: int = Field(gt=0)
  max_position: int = Field(default=4096, gt=0)
  rope_theta: float = Field(default=10000.0, gt=0)
  # llama3-style rope scaling: {"factor", "low_freq_factor", "high_freq_factor", "original_max_position"}.
  # gemma3's global layers: {"rope_type": "linear", "factor"}.
  rope_scaling: Optional[dict[str, float | str]] = None
  norm_eps: float = Field(default=1e-5, gt=0)
  tie_embeddings: bool = False
  # Attention sees at most this many most recent positions (mistral); None is full causal.
  sliding_window: Optional[int] = Field(default=None, gt=0)
  # RMSNorm over head_dim on q and k before RoPE (qwen3, gemma3).
  qk_norm: bool = False
  # Layer types repeat this pattern over the depth: "global" layers attend to the whole causal
  # prefix, "local" ones to the last sliding_window positions (gemma2: [local, global]; gemma3:
  # 5 local then 1 global). None: every layer local if sliding_window is set, else global.
  layer_pattern: Optional[list[Literal["global", "local"]]] = None
  # RoPE theta of local layers, which then take no rope_scaling (gemma3); None: as global layers.
  rope_local_theta: Optional[float] = Field(default=None, gt=0)
  # Attention scores are scaled by query_pre_attn_scalar ** -0.5; None: head_dim ** -0.5.
  query_pre_attn_scalar: Optional[float] = Field(default=None, gt=0)
  # cap * tanh(x / cap) on attention scores / final logits (gemma2); None: no capping.
  attn_logit_softcap: Optional[float] = Field(default=None, gt=0)
  final_logit_softcap: Optional[float] = Field(default=None, gt=0)
  # The GLU's gate activation: silu (llama) or tanh-approximated GELU (gemma).
  hidden_activation: Literal["silu", "gelu_tanh", "gelu"] = "silu"

  @model_validator(mode="after")
  def _heads_group(self):
    if self.num_heads % self.num_kv_heads:
      raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")
    if self.head_dim % 2:
      raise ValueError(f"head_dim ({self.head_dim}) must be even: RoPE rotates pairs of dimensions")
    if self.layer_pattern is not None:
      if not self.layer_pattern:
        raise ValueError("layer_pattern: must name at least one layer type (global or local), or be null")
      if "local" in self.layer_pattern and self.sliding_window is None:
        raise ValueError("layer_pattern: has local layers but sliding_window is null; set model.sliding_window")
    kind = (self.rope_scaling or {}).get("rope_type", "llama3")
    if self.rope_scaling and kind not in ("llama3", "linear", "yarn"):
      raise ValueError(f"rope_scaling.rope_type: {kind!r} is not supported; expected llama3, linear or yarn")
    if self.rope_scaling:
      # The keys each kind reads; a missing one would otherwise fail only while tracing.
      needed = ("factor",) if kind == "linear" else ("factor", "original_max_position")
      missing = [k for k in needed if k not in self.rope_scaling]
      if missing:
        raise ValueError(f"rope_scaling: {kind} scaling needs {', '.join(missing)} "
                         f"(set model.rope_scaling.{missing[0]}=...)")
    return self

  def layer_types(self) -> tuple[str, ...]:
    """The repeating layer-type pattern (one period); layer i has type pattern[i % len(pattern)]."""
    if self.layer_pattern is not None:
      return tuple(self.layer_pattern)
    return ("local",) if self.sliding_window is not None else ("global",)


class MeshConfig(_Strict):
  """Mesh shape. -1 on one axis fills the devices the others leave."""
  data: int = 1
  fsdp: int = -1
  tensor: int = 1
  expert: int = 1
  context: int = 1

  @model_validator(mode="after")
  def _sizes(self):
    sizes = self.sizes()
    if sum(s == -1 for s in sizes.values()) > 1:
      raise ValueError("at most one mesh axis may be -1")
    for k, s in sizes.items():
      if s == 0 or s < -1:
        raise ValueError(f"mesh.{k} must be a positive size or -1, got {s}")
    return self

  def sizes(self) -> dict[str, int]:
    return {"data": self.data, "fsdp": self.fsdp, "tensor": self.tensor, "expert": self.expert,
            "context": self.context}


DType = Literal["float32", "bfloat16"]


class TrainConfig(_Strict):
  steps: int = Field(default=200, gt=0)
  per_device_batch_size: int = Field(default=1, gt=0)
  micro_batches: int = Field(default=1, gt=0)  # gradient accumulation
  seq_len: int = Field(default=128, gt=0)
  learning_rate: float = Field(default=3e-3, gt=0)
  warmup_steps: int = Field(default=20, ge=0)
  min_lr_ratio: float = Field(default=0.1, ge=0, le=1)
  weight_decay: float = Field(default=0.1, ge=0)
  b1: float = Field(default=0.9, ge=0, lt=1)
  b2: float = Field(default=0.95, ge=0, lt=1)
  grad_clip: float = Field(default=1.0, gt=0)
  param_dtype: Literal["float32"] = "float32"
  compute_dtype: DType = "bfloat16"
  seed: int = 0
  log_every: int = Field(default=1, gt=0)
  sample_tokens: int = Field(default=96, ge=0)
  # A NaN/Inf loss or gradient norm: skip the update (params and optimizer state unchanged), or
  # stop the run at once. Either way the run stops after this many non-finite steps in a row.
  on_nonfinite: Literal["skip", "stop"] = "skip"
  max_nonfinite_in_a_row: int = Field(default=10, gt=0)
  # Run at most this many steps in this invocation, then save a checkpoint and exit as a preemption
  # would; running the same command again continues. None: run to train.steps.
  stop_after: Optional[int] = Field(default=None, gt=0)


class DataConfig(_Strict):
  """Training data; docs/data.md describes the pipeline, the tokenizer rules and the errors."""
  source: Literal["stdlib", "synthetic", "text", "jsonl", "parquet"] = "stdlib"
  path: Optional[str] = None  # glob (`**` recurses), for source=text|jsonl|parquet
  field: str = Field(default="text", min_length=1)  # the JSONL key / Parquet column holding the text
  tokenizer: str = Field(default="byte", min_length=1)  # "byte", or a path to a Hugging Face tokenizer.json
  seed: int = 0


class CheckpointConfig(_Strict):
  """Orbax checkpoints; docs/multihost.md and train/checkpoint.py describe resume and layout."""
  every: int = Field(default=1000, gt=0)  # save every N steps (and always at the last step)
  keep: int = Field(default=3, gt=0)  # keep the last N complete checkpoints
  dir: Optional[str] = None  # None: <run_dir>/checkpoints
  # Start a new run from these parameters: a meshlm run_dir / checkpoints dir / step dir, or a
  # Hugging Face model directory (config.json + *.safetensors).
  load_params_from: Optional[str] = None


class DistributedConfig(_Strict):
  """Multi-process runs through jax.distributed (docs/multihost.md)."""
  coordinator: Optional[str] = None  # HOST:PORT of process 0
  num_processes: Optional[int] = Field(default=None, gt=0)
  process_id: Optional[int] = Field(default=None, ge=0)
  # true: jax.distributed.initialize() with no arguments, for clusters JAX detects (SLURM, TPU).
  auto: bool = False
  timeout_s: int = Field(default=300, gt=0)  # how long to wait for the coordinator and peers

  @model_validator(mode="after")
  def _complete(self):
    given = {k: v for k, v in (("coordinator", self.coordinator), ("num_processes", self.num_processes),
                               ("process_id", self.process_id)) if v is not None}
    if self.auto and given:
      raise ValueError(f"distributed.auto=true detects the cluster itself; drop distributed.{next(iter(given))}")
    if given and len(given) < 3:
      missing = [k for k in ("coordinator", "num_processes", "process_id") if k not in given]
      raise ValueError(f"distributed.{missing[0]} is required with distributed.{next(iter(given))} "
                       "(set coordinator, num_processes and process_id together)")
    if self.coordinator is not None:
      host, _, port = self.coordinator.rpartition(":")
      if not host or not port.isdigit():
        raise ValueError(f"distributed.coordinator={self.coordinator!r}: expected HOST:PORT, e.g. 10.0.0.1:1234")
    if self.process_id is not None and self.num_processes is not None and self.process_id >= self.num_processes:
      raise ValueError(f"distributed.process_id={self.process_id} must be below distributed.num_processes="
                       f"{self.num_processes}")
    return self

  @property
  def enabled(self) -> bool:
    return self.auto or self.coordinator is not None


class Config(_Strict):
  model_name: str = "llama2-tiny"
  model: ModelConfig
  shard_mode: Literal["auto", "explicit"] = "explicit"
  lm_head_weight_grad_in_kernel_order: Optional[bool] = None
  dense_weight_grad_in_kernel_order: Optional[bool] = None
  weight_grad_impl: Literal["auto_axes", "custom_vjp"] = "custom_vjp"
  scan_layers: bool = True
  param_scan_axis: Literal[0, 1] = 0
  remat: Literal["none", "full", "dots"] = "none"
  cpu_devices: Optional[int] = Field(default=None, gt=0)
  mesh: MeshConfig = MeshConfig()
  train: TrainConfig = TrainConfig()
  data: DataConfig = DataConfig()
  checkpoint: CheckpointConfig = CheckpointConfig()
  distributed: DistributedConfig = DistributedConfig()
  run_dir: str = "runs/default"

  @model_validator(mode="after")
  def _flags(self):
    if self.lm_head_weight_grad_in_kernel_order and self.model.tie_embeddings:
      raise ValueError(
          "lm_head_weight_grad_in_kernel_order=true needs an untied LM head, but model.tie_embeddings "
          "is true (the tied head is an einsum over the embedding table); leave the flag unset or false")
    if self.train.seq_len > self.model.max_position:
      raise ValueError(
          f"train.seq_len={self.train.seq_len} is beyond model.max_position={self.model.max_position}; "
          f"lower train.seq_len or raise model.max_position")
    return self

  def resolved(self) -> "Config":
    """Resolves the tri-state flags: null means on under explicit (untied head for the LM head flag)."""
    explicit = self.shard_mode == "explicit"
    lm = self.lm_head_weight_grad_in_kernel_order
    dense = self.dense_weight_grad_in_kernel_order
    return self.model_copy(update={
        "lm_head_weight_grad_in_kernel_order": (explicit and not self.model.tie_embeddings) if lm is None else lm,
        "dense_weight_grad_in_kernel_order": explicit if dense is None else dense,
    })

  @property
  def lm_head_kernel_order(self) -> bool:
    """Whether the LM head acts: the flag is inert under auto, where XLA folds the transpose itself."""
    return bool(self.lm_head_weight_grad_in_kernel_order) and self.shard_mode == "explicit"

  @property
  def dense_kernel_order(self) -> bool:
    return bool(self.dense_weight_grad_in_kernel_order) and self.shard_mode == "explicit"
