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
  rope_scaling: Optional[dict[str, float]] = None
  norm_eps: float = Field(default=1e-5, gt=0)
  tie_embeddings: bool = False

  @model_validator(mode="after")
  def _heads_group(self):
    if self.num_heads % self.num_kv_heads:
      raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")
    return self


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


class DataConfig(_Strict):
  source: Literal["stdlib", "synthetic", "text"] = "stdlib"
  path: Optional[str] = None  # glob, for source=text
  seed: int = 0


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
  run_dir: str = "runs/default"

  @model_validator(mode="after")
  def _flags(self):
    if self.lm_head_weight_grad_in_kernel_order and self.model.tie_embeddings:
      raise ValueError(
          "lm_head_weight_grad_in_kernel_order=true needs an untied LM head, but model.tie_embeddings "
          "is true (the tied head is an einsum over the embedding table); leave the flag unset or false")
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
