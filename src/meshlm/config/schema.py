"""The config schema: one pydantic tree, validated before anything compiles."""
from __future__ import annotations

from typing import Any, ClassVar, Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from meshlm.config.kernel_keys import SplashBlock, splash_refusal


class _Strict(BaseModel):
  model_config = ConfigDict(extra="forbid", validate_assignment=True)


class ModelConfig(_Strict):
  """Shapes of a decoder. Field names are the words used in presets and on the CLI."""
  # The description's family list is written by models/registry.py from its FAMILIES (config/ sits below models/).
  family: str = Field(default="llama", description="model family (models/registry.FAMILIES)")
  vocab_size: int = Field(gt=0, description="vocabulary size: rows of the embedding table and LM head")
  embed_dim: int = Field(gt=0, description="width of the residual stream (hidden size)")
  num_layers: int = Field(gt=0, description="number of decoder layers")
  num_heads: Optional[int] = Field(default=None, gt=0, description="attention query heads (required with attention)")
  num_kv_heads: Optional[int] = Field(default=None, gt=0, description="key/value heads (grouped-query attention); "
                                      "divides num_heads")
  head_dim: Optional[int] = Field(default=None, gt=0, description="width of one attention head (even)")
  mlp_dim: int = Field(gt=0, description="hidden width of the gated MLP")
  max_position: int = Field(default=4096, gt=0, description="longest sequence the model is built for (train.seq_len <= this)")
  rope_theta: float = Field(default=10000.0, gt=0, description="RoPE base frequency")
  # llama3-style rope scaling: {"factor", "low_freq_factor", "high_freq_factor", "original_max_position"}.
  # gemma3's global layers: {"rope_type": "linear", "factor"}.
  rope_scaling: Optional[dict[str, float | str]] = Field(
      default=None, description="RoPE scaling: llama3 {factor, low_freq_factor, high_freq_factor, original_max_position}, "
      "linear {rope_type: linear, factor} or yarn; null: none")
  norm_eps: float = Field(default=1e-5, gt=0, description="RMSNorm epsilon")
  tie_embeddings: bool = Field(default=False, description="the LM head reuses the embedding table")
  # Attention sees at most this many most recent positions (mistral); None is full causal.
  sliding_window: Optional[int] = Field(default=None, gt=0, description="local layers attend to at most this many recent positions; null: full causal")
  # RMSNorm over head_dim on q and k before RoPE (qwen3, gemma3).
  qk_norm: bool = Field(default=False, description="RMSNorm over head_dim on q and k before RoPE (qwen3, gemma3)")
  # Layers' attention contexts repeat this pattern over the depth: "global" layers attend to the whole causal
  # prefix, "local" ones to the last sliding_window positions (gemma2: [local, global]; gemma3:
  # 5 local then 1 global). None: every layer local if sliding_window is set, else global.
  layer_pattern: Optional[list[Literal["global", "local"]]] = Field(
      default=None, description="attention contexts (global, local) repeated over the depth, e.g. [local,global]; null: all local if "
      "sliding_window is set, else all global")
  # RoPE theta of local layers, which then take no rope_scaling (gemma3); None: as global layers.
  rope_local_theta: Optional[float] = Field(default=None, gt=0, description="RoPE theta of local layers (no rope_scaling there); null: as global layers")
  # Attention scores are scaled by query_pre_attn_scalar ** -0.5; None: head_dim ** -0.5.
  query_pre_attn_scalar: Optional[float] = Field(default=None, gt=0, description="scores scaled by this ** -0.5; null: head_dim ** -0.5")
  # cap * tanh(x / cap) on attention scores / final logits (gemma2); None: no capping.
  attn_logit_softcap: Optional[float] = Field(default=None, gt=0, description="cap * tanh(x / cap) on attention scores (gemma2); null: none")
  final_logit_softcap: Optional[float] = Field(default=None, gt=0, description="cap * tanh(x / cap) on the final logits (gemma2); null: none")
  # The GLU's gate activation: silu (llama) or tanh-approximated GELU (gemma).
  hidden_activation: Literal["silu", "gelu_tanh", "gelu"] = Field(default="silu", description="the GLU gate activation: silu (llama) or GELU (gemma)")
  # Hugging Face token ids and generation_config.json, carried from an import to its export (meshlm.hf).
  # They change no shape and no number: checkpoints of the same model with other ids are compatible.
  bos_token_id: Optional[int] = Field(default=None, description="Hugging Face bos_token_id, carried to the export")
  eos_token_id: Optional[int | list[int]] = Field(
      default=None, description="Hugging Face eos_token_id (one id or a list of stop ids), carried to the export")
  pad_token_id: Optional[int] = Field(default=None, description="Hugging Face pad_token_id, carried to the export")
  generation_config: Optional[dict[str, Any]] = Field(
      default=None, description="the imported generation_config.json, written again by the export")
  # The knobs of layer parts that declare their own config section (models/family.Part.config), validated by
  # the part's section when the model resolves: a new part's knobs need no field here.
  parts: dict[str, dict[str, Any]] = Field(
      default_factory=dict, description="knobs of the layer parts that declare their own section: "
      "model.parts.PART.KNOB=value (each part's docs list its knobs); model.parts.PART=null drops a section")
  # Which layers of a MoE family are MoE (its layer plan; the MoE part's own knobs are model.parts.moe.*).
  decoder_sparse_step: int = Field(default=1, gt=0, description="qwen3_moe: layer i is MoE when (i + 1) % this == 0 "
                                   "(and i is not in mlp_only_layers); the others are dense")
  mlp_only_layers: list[int] = Field(default_factory=list, description="qwen3_moe: layer indices that stay dense "
                                     "(a plain MLP of mlp_dim)")
  # Gated DeltaNet hybrids (qwen3_next, qwen3_5, qwen3_5_moe): linear-attention (GDN) layers between gated full
  # attention layers (the hybrid families' layer plan; the gdn part's own knobs are model.parts.gdn.*).
  # Which layers are linear attention: hybrid_layer_types (Hugging Face's layer_types, one entry per layer) or,
  # when that is null, every full_attention_interval-th layer full ((i + 1) % interval == 0), the rest linear.
  hybrid_layer_types: Optional[list[str]] = Field(
      default=None, description="per layer linear_attention or full_attention (HF layer_types); null: from "
      "full_attention_interval")
  full_attention_interval: Optional[int] = Field(
      default=None, gt=0, description="layer i is full attention when (i + 1) % this == 0, else linear (used when "
      "hybrid_layer_types is null)")
  # RoPE rotates the first rot = int(head_dim * factor) dims of each head (half-split pairs within them).
  partial_rotary_factor: float = Field(default=1.0, gt=0, le=1, description="fraction of each head's dims that RoPE "
                                       "rotates (the first ones); 1: all")
  first_k_dense_replace: int = Field(default=0, ge=0, description="deepseek_v3: the first k layers are dense (a GLU "
                                     "of mlp_dim), the rest MoE (model.parts.moe.*)")
  TOKEN_FIELDS: ClassVar[tuple[str, ...]] = ("bos_token_id", "eos_token_id", "pad_token_id", "generation_config")
  # Keys moved into a part's own section: old key -> (part, knob, the old field's default). The old key still sets
  # model.parts.<part>.<knob> (moved); at its default it sets nothing, since a model config saved before the move
  # holds every field, the part's or not, and the section's default is the same (or, for a knob the section
  # requires, the old "none": num_experts 0, moe_mlp_dim null, mla's ranks and gdn's heads null).
  MOVED: ClassVar[dict[str, tuple[str, str, Any]]] = {
      "mla_absorb": ("mla", "absorb", True), "gdn_chunk_size": ("gdn", "chunk_size", 64),
      "gdn_impl": ("gdn", "impl", "chunked"), "linear_conv_kernel_dim": ("gdn", "conv_kernel_dim", 4),
      "num_experts": ("moe", "num_experts", 0), "num_experts_per_tok": ("moe", "num_experts_per_tok", 2),
      "moe_mlp_dim": ("moe", "mlp_dim", None), "norm_topk_prob": ("moe", "norm_topk_prob", True),
      "router_dtype": ("moe", "router_dtype", "float32"), "router_aux_loss_coef": ("moe", "router_aux_loss_coef", 0.0),
      "router_z_loss_coef": ("moe", "router_z_loss_coef", 0.0), "moe_impl": ("moe", "impl", "dropless"),
      "moe_grouped_matmul": ("moe", "grouped_matmul", "auto"), "moe_kernel_fsdp": ("moe", "kernel_fsdp", None),
      "shared_expert_mlp_dim": ("moe", "shared_expert_mlp_dim", None),
      "router_scoring": ("moe", "router_scoring", "softmax"), "n_group": ("moe", "n_group", 1),
      "topk_group": ("moe", "topk_group", 1), "routed_scaling_factor": ("moe", "routed_scaling_factor", 1.0),
      "router_bias_update_rate": ("moe", "router_bias_update_rate", 0.0),
      "router_group_mask": ("moe", "router_group_mask", "zero"),
      "q_lora_rank": ("mla", "q_lora_rank", None), "kv_lora_rank": ("mla", "kv_lora_rank", None),
      "qk_nope_head_dim": ("mla", "qk_nope_head_dim", None), "qk_rope_head_dim": ("mla", "qk_rope_head_dim", None),
      "v_head_dim": ("mla", "v_head_dim", None), "rope_interleave": ("mla", "rope_interleave", False),
      "linear_num_key_heads": ("gdn", "key_heads", None), "linear_num_value_heads": ("gdn", "value_heads", None),
      "linear_key_head_dim": ("gdn", "key_head_dim", None), "linear_value_head_dim": ("gdn", "value_head_dim", None)}

  @model_validator(mode="before")
  @classmethod
  def _moved_keys(cls, data):
    if not isinstance(data, dict):
      return data
    data = cls.moved(data)
    parts = data.get("parts")
    if isinstance(parts, dict) and any(v is None for v in parts.values()):
      # model.parts.<part>=null drops the section: a preset's part that the family set over it lacks.
      data = dict(data, parts={k: v for k, v in parts.items() if v is not None})
    return data

  @classmethod
  def moved(cls, data: dict) -> dict:
    """data with each MOVED key set under parts (a value given there too wins: it is the key's new name), but at
    its old default, which it drops."""
    if not any(k in data for k in cls.MOVED):
      return data
    data, parts = dict(data), {k: dict(v) for k, v in (data.get("parts") or {}).items()}
    for old, (part, knob, default) in cls.MOVED.items():
      if old in data and (value := data.pop(old)) != default:
        parts.setdefault(part, {}).setdefault(knob, value)
    return dict(data, parts=parts)

  @model_validator(mode="after")
  def _heads_group(self):
    if self.num_heads and self.num_kv_heads and self.num_heads % self.num_kv_heads:
      raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")
    if self.head_dim and self.head_dim % 2:
      raise ValueError(f"head_dim ({self.head_dim}) must be even: RoPE rotates pairs of dimensions")
    if self.layer_pattern is not None:
      if not self.layer_pattern:
        raise ValueError("layer_pattern: must name at least one attention context (global or local), or be null")
      if "local" in self.layer_pattern and self.sliding_window is None:
        raise ValueError("layer_pattern: has local layers but sliding_window is null; set model.sliding_window")
    rot = self.rotary_dim()
    if self.head_dim and (rot < 2 or rot % 2):
      raise ValueError(f"partial_rotary_factor={self.partial_rotary_factor}: rotates {rot} of head_dim="
                       f"{self.head_dim} dims; RoPE needs an even number, at least 2")
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

  def hybrid_types(self) -> tuple[str, ...] | None:
    """Each layer's mixer type in a GDN hybrid, "linear_attention" or "full_attention" (Hugging Face's
    layer_types): hybrid_layer_types, else from full_attention_interval; None when neither is set."""
    if self.hybrid_layer_types is not None:
      return tuple(self.hybrid_layer_types)
    n = self.full_attention_interval
    if n is None:
      return None
    return tuple("full_attention" if (i + 1) % n == 0 else "linear_attention" for i in range(self.num_layers))

  def rotary_dim(self) -> int:
    """The dims of each head that RoPE rotates: int(head_dim * partial_rotary_factor) (transformers' rule)."""
    return int((self.head_dim or 0) * self.partial_rotary_factor)

  def context_pattern(self) -> tuple[str, ...]:
    """The repeating pattern of attention contexts (one period); layer i's is pattern[i % len(pattern)]."""
    if self.layer_pattern is not None:
      return tuple(self.layer_pattern)
    return ("local",) if self.sliding_window is not None else ("global",)

  def layer_contexts(self) -> tuple[str, ...]:
    """Each layer's attention context: context_pattern() repeated over the num_layers layers."""
    pattern = self.context_pattern()
    return tuple(pattern[i % len(pattern)] for i in range(self.num_layers))


class MeshConfig(_Strict):
  """Mesh shape. -1 on one axis fills the devices the others leave."""
  data: int = Field(default=1, description="data-parallel size (-1: the devices left)")
  fsdp: int = Field(default=-1, description="FSDP size: shards parameters along embed (-1: the devices left)")
  tensor: int = Field(default=1, description="tensor-parallel size: shards heads, mlp and vocab (-1: the devices left)")
  expert: int = Field(default=1, description="expert-parallel size: shards the MoE experts (must divide model.parts.moe.num_experts)")
  context: int = Field(default=1, description="context-parallel size: training shards the sequence over it (GDN layers per shard, attention as context_attention says)")

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
  steps: int = Field(default=200, gt=0, description="total optimizer steps of the run")
  per_device_batch_size: int = Field(default=1, gt=0, description="sequences per device per step; global batch = this x devices")
  micro_batches: int = Field(default=1, gt=0, description="gradient accumulation: the batch is split into this many micro-batches")
  seq_len: int = Field(default=128, gt=0, description="tokens per training sequence")
  learning_rate: float = Field(default=3e-3, gt=0, description="peak AdamW learning rate")
  warmup_steps: int = Field(default=20, ge=0, description="linear warmup steps before the cosine decay")
  min_lr_ratio: float = Field(default=0.1, ge=0, le=1, description="final learning rate as a fraction of the peak")
  weight_decay: float = Field(default=0.1, ge=0, description="AdamW decoupled weight decay")
  b1: float = Field(default=0.9, ge=0, lt=1, description="AdamW beta1")
  b2: float = Field(default=0.95, ge=0, lt=1, description="AdamW beta2")
  grad_clip: float = Field(default=1.0, gt=0, description="clip the gradients to this global norm")
  param_dtype: Literal["float32"] = Field(default="float32", description="dtype of the stored parameters")
  compute_dtype: DType = Field(default="bfloat16", description="dtype of the forward and backward computation")
  matmul_precision: Literal["default", "high", "highest"] = Field(
      default="default", description="precision of the step's float32 matmuls (jax.default_matmul_precision): default "
      "(on TPU one bf16 pass), high (3 passes), highest (float32, as on CPU: float32 parity with a CPU run)")
  seed: int = Field(default=0, description="seed of parameter init and training randomness")
  log_every: int = Field(default=1, gt=0, description="write metrics every N steps")
  sample_tokens: int = Field(default=96, ge=0, description="length of the sample printed at the end (0: none); it "
                             "continues 'The ', or a chat fine-tune's first user turn (prompt-completion: its prompt)")
  sample_temperature: float = Field(default=0.7, ge=0, description="temperature of the sample printed at the end, "
                                    "drawn with train.seed (0: greedy, which a tiny model ends in repeats)")
  # A NaN/Inf loss or gradient norm: skip the update (params and optimizer state unchanged), or
  # stop the run at once. Either way the run stops after this many non-finite steps in a row.
  on_nonfinite: Literal["skip", "stop"] = Field(default="skip", description="on a NaN/Inf loss or grad norm: skip the update, or stop with a checkpoint")
  max_nonfinite_in_a_row: int = Field(default=10, gt=0, description="stop after this many non-finite steps in a row")
  # Run at most this many steps in this invocation, then save a checkpoint and exit as a preemption
  # would; running the same command again continues. None: run to train.steps.
  stop_after: Optional[int] = Field(default=None, gt=0, description="run at most N steps now, save, exit; the same command continues (null: to train.steps)")
  # Frozen parameters: stop_gradient inside the loss (no weight-gradient dots or collectives for
  # them), no optimizer state, and their values never change.
  freeze: list[str] = Field(default_factory=list, description="regexes, each matching whole parameter paths (e.g. layers.dense.attn.q, .*norm.*): those parameters are frozen")


class DataConfig(_Strict):
  """Training data; docs/data.md describes the pipeline, the tokenizer rules and the errors."""
  source: Literal["stdlib", "synthetic", "text", "jsonl", "parquet"] = Field(
      default="stdlib", description="training data: the stdlib .py corpus, synthetic tokens, or files at data.path "
      "(unset with data.path: inferred from its ending, .txt/.md text, .jsonl, .parquet)")
  path: Optional[str] = Field(default=None, description="glob of the data files (** recurses), for source=text|jsonl|parquet")
  field: str = Field(default="text", min_length=1, description="the JSONL key / Parquet column holding the text")
  tokenizer: str = Field(default="byte", min_length=1, description="byte, a Hugging Face tokenizer.json, or a directory holding one")
  seed: int = Field(default=0, description="seed of the data order")
  format: Literal["auto", "language_modeling", "prompt_completion", "conversational",
                  "conversational_prompt_completion"] = Field(
      default="auto", description="TRL's dataset formats: text in data.field, prompt/completion strings, messages, "
      "or prompt/completion message lists (auto: from the first row's fields)")
  chat_template: Optional[str] = Field(
      default=None, description="a Jinja chat template file for conversational data; null: data.tokenizer's "
      "directory (chat_template.jinja, or tokenizer_config.json's chat_template)")
  completion_only: bool = Field(default=True, description="prompt-completion data: the loss is on the completion "
                                "only (TRL's completion_only_loss)")
  assistant_only: bool = Field(default=False, description="conversational data: the loss is on the assistant's "
                               "tokens only (TRL's assistant_only_loss)")
  truncation: Literal["cut", "drop"] = Field(
      default="cut", description="a prompt-completion or conversational row longer than train.seq_len + 1 tokens: "
      "cut to that length, or dropped (counted either way)")

  # data.path with no data.source once trained on the stdlib corpus without a word: infer it instead.
  SUFFIX_SOURCES: ClassVar[dict[str, str]] = {".txt": "text", ".md": "text", ".jsonl": "jsonl", ".parquet": "parquet"}

  @model_validator(mode="before")
  @classmethod
  def _source_from_path(cls, data):
    if isinstance(data, dict) and data.get("path") and data.get("source") is None:
      path = str(data["path"])
      suffix = next((x for x in cls.SUFFIX_SOURCES if path.endswith(x)), None)
      if suffix is None:
        raise ValueError(f"data.path={path}: data.source is not set and the name does not say it (a .txt, .md, "
                         ".jsonl or .parquet ending); set data.source=text|jsonl|parquet")
      data = {**data, "source": cls.SUFFIX_SOURCES[suffix]}
    return data


class EvalConfig(_Strict):
  """A validation set: its loss every eval.every steps and at the end, or alone with `meshlm eval` (docs/data.md,
  "Validation")."""
  path: Optional[str] = Field(default=None, description="glob of the validation files (.jsonl, .parquet, .txt), in any "
                              "data.format; read with the data.* settings; null: no validation")
  every: int = Field(default=0, ge=0, description="the validation loss after every N steps (and after the last); "
                     "0: after the last only")
  batches: Optional[int] = Field(default=None, gt=0, description="cap each evaluation at the first N global batches "
                                 "of the validation set (the same ones each time); null: the whole set, each row once")

  @model_validator(mode="after")
  def _needs_path(self):
    if self.every and self.path is None:
      raise ValueError(f"eval.every={self.every} needs a validation set: set eval.path=GLOB")
    return self


class CheckpointConfig(_Strict):
  """Orbax checkpoints; docs/multihost.md and train/checkpoint.py describe resume and layout."""
  every: int = Field(default=1000, gt=0, description="save every N steps (and always at the last step)")
  keep: int = Field(default=3, gt=0, description="keep the last N complete checkpoints")
  dir: Optional[str] = Field(default=None, description="where checkpoints go; null: <run_dir>/checkpoints")
  # Start a new run from these parameters: a meshlm run_dir / checkpoints dir / step dir, or a
  # Hugging Face model directory (config.json + *.safetensors).
  load_params_from: Optional[str] = Field(
      default=None, description="start a new run from these parameters: a meshlm run, checkpoint or model dir, "
      "or a Hugging Face model dir")


class DistributedConfig(_Strict):
  """Multi-process runs through jax.distributed (docs/multihost.md)."""
  coordinator: Optional[str] = Field(default=None, description="HOST:PORT of process 0")
  num_processes: Optional[int] = Field(default=None, gt=0, description="number of processes in the run")
  process_id: Optional[int] = Field(default=None, ge=0, description="this process's index, 0 to num_processes - 1")
  # true: jax.distributed.initialize() with no arguments, for clusters JAX detects (SLURM, TPU).
  auto: bool = Field(default=False, description="jax.distributed.initialize() with no arguments (SLURM, TPU)")
  timeout_s: int = Field(default=300, gt=0, description="seconds to wait for the coordinator and peers")

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


class RLConfig(_Strict):
  """`meshlm rl`: GRPO on prompts with rewards (docs/rl.md describes every key)."""
  prompts: Optional[str] = Field(default=None, description="JSONL file of prompts: a `prompt` field per line plus any "
                                 "fields the rewards read (e.g. `answer`)")
  prompts_per_step: int = Field(default=4, gt=0, description="prompts per RL step; the step trains on "
                                "prompts_per_step x num_generations completions")
  num_generations: int = Field(default=4, description="G: completions sampled per prompt (at least 2: the group "
                               "normalizes the rewards)")
  max_new_tokens: int = Field(default=32, gt=0, description="longest completion sampled")
  temperature: float = Field(default=1.0, gt=0, description="sampling temperature (> 0)")
  top_k: Optional[int] = Field(default=None, gt=0, description="sample from the k most likely tokens; null (or 0, "
                               "TRL's spelling): all")
  top_p: float = Field(default=1.0, gt=0, le=1, description="sample from the smallest set of tokens whose mass reaches "
                       "top_p")
  reward: list[str] = Field(default_factory=lambda: ["exact_match"], description="reward, or a list of them: exact_match, "
                            "numeric_match, regex, length_penalty, module:function or path/to/file.py:function, called "
                            "(prompt, completion, row) -> float, or once per step TRL's way (prompts, completions, "
                            "**columns) -> list when it has a `completions` parameter")
  reward_weights: Optional[list[float]] = Field(default=None, description="one weight per rl.reward; null: all 1")
  reward_regex: Optional[str] = Field(default=None, description="the pattern the `regex` reward searches the completion "
                                      "for (1 if found, else 0)")
  failed_reward: Literal["zero", "exclude"] = Field(
      default="zero", description="a reward call that raises or returns NaN: zero scores it 0; exclude leaves it out "
      "of the weighted sum, and a completion whose every reward failed out of its group's mean and std (advantage 0; "
      "TRL's rule for None). A reward that fails on every call of a step stops the run either way")
  scale_rewards: Literal["group", "batch", "none"] = Field(
      default="group", description="advantage = (reward - group mean) / std of the group | the batch | 1 (none: "
      "Dr. GRPO); TRL's true / false are group / none")
  policy_loss: Literal["clip", "cispo"] = Field(
      default="clip", description="clip: PPO's clipped surrogate (GRPO); cispo: the capped ratio, gradient stopped, "
      "times A times logp on every token (MiniMax-M1; TRL loss_type=cispo)")
  epsilon: float = Field(default=0.2, gt=0, description="clip the ratio below at 1 - epsilon")
  epsilon_high: Optional[float] = Field(default=None, gt=0, description="clip the ratio above at 1 + epsilon_high "
                                        "(DAPO clip-higher); null: epsilon")
  delta: Optional[float] = Field(default=None, gt=1, description="two-sided clip (INTELLECT-2, TRL's delta): the "
                                 "unclipped ratio is capped at delta, above 1 + epsilon_high; null: off")
  cispo_cap: float = Field(default=5.0, gt=0, description="rl.policy_loss=cispo: the cap of the importance weight "
                           "(TRL's epsilon_high under loss_type=cispo; ScaleRL's 5.0)")
  ratio_level: Literal["token", "sequence"] = Field(
      default="token", description="importance ratio per token, or per sequence (GSPO: exp of the mean log-ratio)")
  loss_agg: Literal["token_mean", "sequence_mean", "constant", "bnpo"] = Field(
      default="token_mean", description="token_mean over all completion tokens (DAPO), sequence_mean of per-sequence "
      "means (GRPO), constant: the sum over B x max_new_tokens (Dr. GRPO), bnpo: each micro-batch's token mean, "
      "averaged over train.micro_batches (TRL's bnpo)")
  mask_truncated_completions: bool = Field(
      default=False, description="completions cut by rl.max_new_tokens (no stop token at the end) add no loss "
      "(DAPO's overlong filtering; TRL's flag); false: they train like the rest")
  top_entropy_quantile: float = Field(
      default=1.0, ge=0, le=1, description="the policy term trains only on this top fraction of each micro-batch's "
      "completion tokens by entropy (the 80/20 rule's 0.2; TRL's flag); 1: all tokens")
  beta: float = Field(default=0.0, ge=0, description="KL coefficient to the frozen starting policy (k3 estimator); 0 "
                      "keeps no reference")
  kl_estimator: Literal["k3", "k3_ratio"] = Field(
      default="k3", description="k3: exp(ref - logp) - (ref - logp) - 1; k3_ratio: k3 times the ratio to the old "
      "policy (TRL's use_bias_correction_kl=true, DeepSeek-V3.2)")
  num_iterations: int = Field(default=1, gt=0, description="policy updates per batch of samples")
  score_truncated: bool = Field(default=True, description="the trainer scores completions under the sampler's "
                                "temperature, top-k and top-p (false: temperature only, the biased comparison)")
  sampler_is: Literal["none", "token", "sequence", "token_truncate", "token_mask", "sequence_truncate",
                      "sequence_mask"] = Field(
      default="none", description="importance sampling of the train/sample mismatch (the trainer scores the rollout "
      "once more), per token or per sequence, TRL's modes: *_truncate clips the weight to [sampler_is_min, "
      "sampler_is_cap], *_mask zeroes it outside; token = token_truncate, sequence = sequence_truncate")
  sampler_is_cap: float = Field(default=2.0, gt=0, description="upper bound of the sampler_is weight")
  sampler_is_min: Optional[float] = Field(default=None, gt=0, description="lower bound of the sampler_is weight; "
                                          "null: none")
  router_replay: bool = Field(default=False, description="the training forward routes every token with the "
                              "sampler's expert ids (MoE models)")
  eval_every: int = Field(default=0, ge=0, description="every N steps (and after the last), the greedy and a sampled "
                          "reward on the eval prompts, and their completions in run_dir/completions.jsonl (0: never)")
  eval_prompts: int | str = Field(default=64, description="the eval prompts: N, the first N of rl.prompts, or PATH, "
                                  "a JSONL file of its own")
  log_completions: int = Field(default=0, ge=0, description="every step, the first N of the rollout's completions "
                               "(prompt, completion, rewards, advantage) into run_dir/completions.jsonl, mode rollout "
                               "(TRL's log_completions); 0: none")

  @field_validator("scale_rewards", mode="before")
  @classmethod
  def _trl_scale_rewards(cls, v):
    return {True: "group", False: "none"}.get(v, v) if isinstance(v, bool) else v  # TRL's true / false

  @field_validator("top_k", mode="before")
  @classmethod
  def _trl_top_k(cls, v):
    return None if v == 0 and not isinstance(v, bool) else v  # TRL's top_k=0: no top-k

  @field_validator("reward", mode="before")
  @classmethod
  def _one_reward(cls, v):
    return [v] if isinstance(v, str) else v  # rl.reward=exact_match names one reward

  @field_validator("eval_prompts")
  @classmethod
  def _eval_prompts(cls, v):
    if (isinstance(v, int) and v <= 0) or (isinstance(v, str) and not v):
      raise ValueError("give a count above 0 (the first prompts of rl.prompts) or a JSONL path")
    return v

  @model_validator(mode="after")
  def _groups(self):
    if self.num_generations < 2:
      raise ValueError(f"rl.num_generations={self.num_generations}: GRPO normalizes each prompt's rewards over its "
                       "group, so it needs at least 2 completions per prompt; set rl.num_generations=4")
    if self.reward_weights is not None and len(self.reward_weights) != len(self.reward):
      raise ValueError(f"rl.reward_weights: {len(self.reward_weights)} weights for {len(self.reward)} rewards "
                       f"({', '.join(self.reward)}); give one per reward")
    hi = self.epsilon if self.epsilon_high is None else self.epsilon_high
    if self.delta is not None and self.policy_loss == "cispo":
      raise ValueError(f"rl.delta={self.delta}: caps the clipped objective's ratio, and rl.policy_loss=cispo has no "
                       "clip; drop rl.delta or use rl.policy_loss=clip")
    if self.delta is not None and self.delta <= 1 + hi:
      raise ValueError(f"rl.delta={self.delta} must be above 1 + rl.epsilon_high = {1 + hi:g} (below it, it clips "
                       "positive advantages tighter than the clip does); raise it, or drop it")
    if self.sampler_is_min is not None and self.sampler_is_min >= self.sampler_is_cap:
      raise ValueError(f"rl.sampler_is_min={self.sampler_is_min} must be below rl.sampler_is_cap="
                       f"{self.sampler_is_cap}")
    if self.sampler_is_min is not None and self.sampler_is == "none":
      raise ValueError(f"rl.sampler_is_min={self.sampler_is_min} bounds the sampler_is weight, and rl.sampler_is "
                       "is none; set rl.sampler_is (token_truncate, token_mask, sequence_truncate, sequence_mask)")
    return self


class Config(_Strict):
  model_name: str = Field(default="llama2-tiny", description="the preset's name, recorded in config.yaml and checkpoints")
  model: ModelConfig
  shard_mode: Literal["auto", "explicit"] = Field(default="explicit", description="mesh axis types: explicit (sharding in types) or auto")
  lm_head_weight_grad_in_kernel_order: Optional[bool] = Field(
      default=None, description="LM head weight gradient in kernel order; null: on for an untied head under explicit")
  dense_weight_grad_in_kernel_order: Optional[bool] = Field(
      default=None, description="in-layer projections' weight gradient in kernel order; null: on under explicit")
  weight_grad_impl: Literal["auto_axes", "custom_vjp"] = Field(
      default="custom_vjp", description="how the kernel-order weight gradient is produced")
  attention_impl: Literal["auto", "xla", "flash", "splash"] = Field(
      default="auto", description="the attention core: xla (materialized scores, the reference), flash (blockwise, "
      "pure JAX), splash (the TPU Pallas kernel; Pallas interpret mode off TPU, slow); auto: splash on TPU (flash "
      "with mesh.context > 1), flash on GPU and on CPU from a measured length up, else xla")
  splash_backward: Literal["auto", "fused", "split"] = Field(
      default="auto", description="the splash kernel's backward: fused (one kernel; one partial dq per key block, "
      "its memory growing with the sequence), split (a dq and a dkv kernel), or auto: fused where its dkv kernel fits "
      "the chip's scoped VMEM at blocks as large as the split one's (nn/splash_attention.Rule), else split")
  # The splash kernel's blocks per phase (MaxText's sa_block_* keys): auto, chosen by nn/splash_attention.Rule over
  # the head dims, dtype, backward, segment ids, rows per device and the chip's scoped VMEM; a number forces one.
  sa_block_q: SplashBlock = Field(default="auto", description="splash forward: query block (auto or a multiple of 128)")
  sa_block_kv: SplashBlock = Field(default="auto", description="splash forward: key block")
  sa_block_kv_compute: SplashBlock = Field(default="auto", description="splash forward: key block per inner step")
  sa_block_q_dkv: SplashBlock = Field(default="auto", description="splash dkv (or fused) backward: query block")
  sa_block_kv_dkv: SplashBlock = Field(default="auto", description="splash dkv (or fused) backward: key block")
  sa_block_kv_dkv_compute: SplashBlock = Field(default="auto", description="splash dkv backward: key block per step")
  sa_block_q_dq: SplashBlock = Field(default="auto", description="splash dq backward (split): query block")
  sa_block_kv_dq: SplashBlock = Field(default="auto", description="splash dq backward (split): key block")
  flash_block: int = Field(default=512, ge=1, description="the flash and ring cores' query and key block length")
  rope_swap: Literal["auto", "matmul", "roll"] = Field(
      default="auto", description="how RoPE swaps a row's halves: matmul (a permutation on the MXU, one fused pass "
      "on TPU), roll (two slices); auto: matmul on TPU, roll elsewhere; bit-identical either way")
  layer_cast: Literal["bits", "astype"] = Field(
      default="bits", description="how a layer casts its float32 kernels to bfloat16: bits (integer rounding, kept "
      "in the layer loop), astype (which XLA:TPU hoists as whole-stack copies); bit-identical either way")
  scatter_leading: Literal["auto", "tpu", "all", "none"] = Field(
      default="auto", description="weight gradients whose FSDP dim is the kernel's minor one (down, o, the embedding "
      "table), formed with that dim leading so XLA reduce-scatters them (parallel/sharding.scatter_rule): tpu (those "
      "XLA:TPU would all-reduce whole: bf16 shards an odd multiple of 128 wide), all (every sharded one), none; auto: "
      "tpu on TPU, none elsewhere; equal numbers either way")
  remat_attention: Literal["recompute", "save"] = Field(
      default="recompute", description="under remat, the attention core's output and row log-sum-exp: recompute "
      "(the backward reruns the forward kernel) or save (named residuals kept per layer; no rerun)")
  gdn_impl: Literal["auto", "jax", "pallas"] = Field(
      default="auto", description="the Gated DeltaNet chunked rule of training and prefill: jax (nn/gdn.py, the "
      "reference), pallas (the TPU Pallas kernels, nn/gdn_pallas.py; Pallas interpret mode off TPU, slow); auto: "
      "pallas on TPU where the kernel takes the heads and chunk, else jax. mesh.context > 1 trains with the JAX rule")
  context_attention: Literal["ring", "gather"] = Field(
      default="ring", description="attention over a sequence sharded on mesh.context > 1 (training, flash core): ring "
      "(K/V blocks passed around the context axis, merged into flash's online softmax; zigzag-balanced) or gather "
      "(XLA's partitioner all-gathers K/V over the context axis)")
  decode_attention_impl: Literal["auto", "xla", "pallas"] = Field(
      default="auto", description="sampling's decode attention: xla (the whole cache buffer, the reference), pallas "
      "(a TPU kernel reading only each row's filled slots; Pallas interpret mode off TPU, slow), or auto: pallas on "
      "TPU, xla elsewhere; a cache no block of decode_attention_block slots divides runs xla (nn/decode_attention)")
  decode_attention_block: int = Field(default=128, ge=16, description="at most this many cache slots per step of "
                                      "the pallas decode attention (a row reads its filled slots in such blocks)")
  loss_impl: Literal["auto", "materialized", "blockwise"] = Field(
      default="auto", description="the LM head and loss: materialized [B, T, V] logits (the reference), blockwise "
      "(head and log-softmax per block of loss_block positions at most, custom VJP; never [B, T, V]), or auto: blockwise "
      "when a micro-batch's rows x seq_len x vocab reaches 2^28")
  loss_block: int = Field(default=256, ge=1,
                          description="at most this many sequence positions per block of the blockwise loss")
  loss_grad_reduce: Literal["auto", "barrier", "overlap"] = Field(
      default="auto", description="the blockwise loss's one reduction of the head's weight gradient per micro-batch: "
      "barrier (the layers' backward waits for it, so its float32 accumulator is freed before them), overlap (left "
      "to XLA's scheduler, which may hold the accumulator over the layers' backward), or auto: barrier (never a higher "
      "peak, by analysis/layout.py's estimate; docs/compile.md); bit-identical either way")
  scan_layers: bool = Field(default=True, description="scan over stacked layers (false: unrolled)")
  param_scan_axis: Literal[0, 1] = Field(default=0, description="axis of the stacked layer dimension in parameters")
  stack_rows: bool = Field(default=True, description="unrolled layers read the parameters a part lists in "
                           "MeshRules.stack_rows (MoE expert kernels) in place from their stacks; false: every row "
                           "sliced out")
  remat: Literal["none", "full", "dots"] = Field(default="none", description="rematerialization per layer: none, full, or save dots")
  cpu_devices: Optional[int] = Field(default=None, gt=0, description="N fake host devices (CPU only); null: the real devices")
  mesh: MeshConfig = MeshConfig()
  train: TrainConfig = TrainConfig()
  data: DataConfig = DataConfig()
  checkpoint: CheckpointConfig = CheckpointConfig()
  eval: EvalConfig = EvalConfig()
  distributed: DistributedConfig = DistributedConfig()
  rl: RLConfig = RLConfig()
  run_dir: Optional[str] = Field(default=None, description="where metrics.jsonl, config.yaml and checkpoints go; "
                                 "null: a fresh runs/<model_name>-<YYYYmmdd-HHMMSS>")

  @model_validator(mode="after")
  def _flags(self):
    if self.lm_head_weight_grad_in_kernel_order and self.model.tie_embeddings:
      raise ValueError(
          "lm_head_weight_grad_in_kernel_order=true needs an untied LM head, but model.tie_embeddings "
          "is true (the tied head is an einsum over the embedding table); leave the flag unset or false")
    refusal = splash_refusal(self.attention_impl, self.mesh.context)
    if refusal:
      raise ValueError(refusal)
    if self.train.seq_len > self.model.max_position:
      raise ValueError(
          f"train.seq_len={self.train.seq_len} is beyond model.max_position={self.model.max_position}; "
          f"lower train.seq_len or raise model.max_position")
    return self

  def resolved(self) -> "Config":
    """Resolves the tri-state flags: null means on under explicit (untied head for the LM head flag). (A part's
    knob left to the run, such as model.parts.moe.kernel_fsdp, is filled in when its model resolves.)"""
    explicit = self.shard_mode == "explicit"
    lm, dense = self.lm_head_weight_grad_in_kernel_order, self.dense_weight_grad_in_kernel_order
    update = {
        "lm_head_weight_grad_in_kernel_order": (explicit and not self.model.tie_embeddings) if lm is None else lm,
        "dense_weight_grad_in_kernel_order": explicit if dense is None else dense,
    }
    return self.model_copy(update=update)

  @property
  def lm_head_kernel_order(self) -> bool:
    """Whether the LM head acts: the flag is inert under auto, where XLA folds the transpose itself."""
    return bool(self.lm_head_weight_grad_in_kernel_order) and self.shard_mode == "explicit"

  @property
  def dense_kernel_order(self) -> bool:
    return bool(self.dense_weight_grad_in_kernel_order) and self.shard_mode == "explicit"

