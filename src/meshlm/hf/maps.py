"""The vocabulary of Hugging Face name maps, and the config.json fields llama-like families share.

A family's adapter (hf/adapters/<family>.py, apart from its block in models/) is one `Adapter`:

- `model_type`: the config.json `model_type` it reads and writes, e.g. "llama".
- `architectures`: the `architectures` entries it accepts; the first is the one it writes.
- `from_hf_config(hf: dict) -> dict`: ModelConfig fields from a config.json dict.
- `to_hf_config(m: ModelConfig) -> dict`: a config.json dict (without `architectures`/`model_type`,
  which meshlm.hf adds).
- `layer_map(m: ModelConfig) -> dict[str, Tensor]`: one entry per leaf of a layer kind's spec, keyed
  by its dotted path without the kind ("attn.q"), naming the HF tensor. The name is a template:
  `{i}` is the model layer index (never a position in a kind's stack, so the grouping of layers
  into kinds and scanned periods never reaches a checkpoint). `{e}` indexes a second stacked axis
  (the inner stack, `Tensor.inner_axes`): one HF tensor per row of it, formatted the same way.
- `top_map(m: ModelConfig) -> dict[str, Tensor]` for the non-layer leaves; `default_top_map` is
  llama's (`model.embed_tokens`, `model.norm`, `lm_head`).

- `skipped`: name prefixes of tensors a checkpoint may carry beside the model that meshlm does not read
  (qwen3-next's multi-token-prediction head `mtp.`); load names them in a one-line notice.
- `mtp_layers`: the checkpoint's layers past num_hidden_layers are multi-token prediction (DeepSeek-V3's
  `model.layers.61.*`), not read; load names them in the same notice.
- `wrapped`: the multimodal checkpoints whose text model is this family (`Wrapped`): another model_type
  and architecture, config.json nesting the text model's fields under `text_config`, and the text
  model's tensors under `model.language_model.` beside the vision tower's. Import reads their text
  part; export always writes the text model's own layout.

Layouts. An HF `nn.Linear` weight is [out, in]. meshlm kernels put the input dims first:
q [D, N, H], k/v [D, K, H], o [N, H, D], gate/up [D, F], down [F, D], lm_head [D, V]. `Linear(name,
n_in)` says the first n_in meshlm dims are inputs; converting is a reshape plus a transpose. RoPE
needs no q/k row permutation: HF checkpoints and meshlm both rotate halves (`rotate_half`). An inner stack's
tensors may also be found in transformers' fused layout (`Fused`), which import reads and export never
writes.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable

import numpy as np

from meshlm.config import ModelConfig
from meshlm.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class Fused:
  """Where transformers' fused tensor holds an inner stack's tensors: the [out, in] tensor of row e is rows
  [part * out, (part + 1) * out) of fused[e], the fused tensor being [rows, parts * out, in]. Two tensors
  fused side by side are parts 0 and 1 of 2 (hf/adapters/qwen3_next.py's `gate_up_proj`); one alone is
  part 0 of 1. The name is a template in `{i}` only."""
  name: str
  part: int = 0
  parts: int = 1

  def rows(self, out: int) -> slice:
    return slice(self.part * out, (self.part + 1) * out)


@dataclasses.dataclass(frozen=True)
class Tensor:
  """An HF tensor stored exactly in meshlm's layout (embeddings, norm scales)."""
  name: str
  # With {e} in the name: the logical axis names {e} may index, the leaf's first axis so named being the inner
  # stack (declared by the adapter, which knows the part whose spec names it).
  inner_axes: tuple[str, ...] = dataclasses.field(default=(), kw_only=True)
  # An inner stack's tensor that checkpoints may also hold fused; None: never fused.
  fused: Fused | None = dataclasses.field(default=None, kw_only=True)

  def hf_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(shape)

  def to_meshlm(self, w: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    return w

  def to_hf(self, w: np.ndarray) -> np.ndarray:
    return w

  def hf_index(self, index: tuple[slice, ...], shape: tuple[int, ...]) -> tuple[tuple[slice, ...], bool] | None:
    """The HF slice that holds meshlm's `index` (and whether to transpose it), or None to read it whole."""
    return index, False


@dataclasses.dataclass(frozen=True)
class Linear(Tensor):
  """An HF nn.Linear weight [prod(out dims), prod(in dims)] <-> a meshlm kernel [*in dims, *out dims]."""
  n_in: int = 1

  def hf_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
    return (math.prod(shape[self.n_in:]), math.prod(shape[:self.n_in]))

  def to_meshlm(self, w: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    ins, outs = shape[:self.n_in], shape[self.n_in:]
    w = w.reshape(outs + ins)  # [*out, *in]
    perm = tuple(range(len(outs), len(shape))) + tuple(range(len(outs)))
    return np.transpose(w, perm)  # [*in, *out]

  def to_hf(self, w: np.ndarray) -> np.ndarray:
    n_out = w.ndim - self.n_in
    perm = tuple(range(self.n_in, w.ndim)) + tuple(range(self.n_in))
    w = np.transpose(w, perm)  # [*out, *in]
    return np.ascontiguousarray(w.reshape(math.prod(w.shape[:n_out]), -1))

  def hf_index(self, index, shape):
    # A 2-D kernel [in, out] is a plain transpose: read exactly the slice. Heads folded into rows
    # ([N*H, D]) are read whole per layer, which is at most one layer's projection.
    if len(shape) == 2 and self.n_in == 1:
      return (index[1], index[0]), True
    return None


@dataclasses.dataclass(frozen=True)
class Conv1d(Tensor):
  """A depthwise nn.Conv1d weight [C, 1, W] (no bias) <-> a meshlm kernel [W, C], tap W - 1 the current position."""

  def hf_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
    W, C = shape
    return (C, 1, W)

  def to_meshlm(self, w: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    return np.ascontiguousarray(w[:, 0, :].T)

  def to_hf(self, w: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(w.T[:, None, :])

  def hf_index(self, index, shape):
    return None


@dataclasses.dataclass(frozen=True)
class Wrapped:
  """A multimodal checkpoint holding a family's text model (Qwen3.5's published checkpoints): its config.json
  has `model_type` and `architectures` of its own and the text model's fields under `config_key`; the text
  model's tensors are named with `prefix` where the text model's own checkpoints have `model.`; tensors under
  `skipped` (the vision tower) are not read."""
  model_type: str
  architectures: tuple[str, ...]
  config_key: str = "text_config"
  prefix: str = "model.language_model."
  skipped: tuple[str, ...] = ("model.visual.",)

  def rename(self, name: str) -> str:
    """A text-model tensor name as this layout stores it (lm_head and mtp stay where they are)."""
    return self.prefix + name[len("model."):] if name.startswith("model.") else name


@dataclasses.dataclass(frozen=True)
class Adapter:
  """A family's Hugging Face mapping (see the module docstring)."""
  model_type: str
  architectures: tuple[str, ...]
  from_hf_config: Callable[[dict], dict]
  to_hf_config: Callable[[ModelConfig], dict]
  layer_map: Callable[[ModelConfig], dict[str, Tensor]]
  top_map: Callable[[ModelConfig], dict[str, Tensor]] = lambda m: default_top_map(m)
  skipped: tuple[str, ...] = ()
  wrapped: tuple[Wrapped, ...] = ()
  mtp_layers: bool = False


def require(hf: dict, key: str) -> Any:
  if key not in hf or hf[key] is None:
    raise ConfigError(f"config.json: missing field {key!r}")
  return hf[key]


def refuse(hf: dict, key: str, allowed: Any, why: str) -> None:
  """Fails on a config.json field whose value meshlm cannot represent. A missing field is fine."""
  if key not in hf:
    return
  value = hf[key]
  ok = value in allowed if isinstance(allowed, tuple) else value == allowed
  if not ok:
    raise ConfigError(f"config.json: {key}={value!r} is not supported ({why})")


def rope_from_hf(hf: dict) -> tuple[float, dict[str, float | str] | None]:
  """(rope_theta, linear or llama3 scaling) from either transformers 5's `rope_parameters` or the older
  `rope_theta` + `rope_scaling` fields."""
  params = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
  if not isinstance(params, dict):
    raise ConfigError(f"config.json: rope_parameters must be an object, got {params!r}")
  theta = params.get("rope_theta", hf.get("rope_theta", 10000.0))
  kind = params.get("rope_type", params.get("type", "default"))
  if kind == "default":
    return float(theta), None
  if kind == "linear":
    return float(theta), {"rope_type": "linear", "factor": float(params["factor"])}
  if kind != "llama3":
    raise ConfigError(f"config.json: rope_type={kind!r} is not supported (meshlm reads default, linear and "
                      "llama3 rope)")
  try:
    scaling = {"rope_type": "llama3", "factor": float(params["factor"]),
               "low_freq_factor": float(params.get("low_freq_factor", 1.0)),
               "high_freq_factor": float(params.get("high_freq_factor", 4.0)),
               "original_max_position": float(params.get("original_max_position_embeddings",
                                                         require(hf, "max_position_embeddings")))}
  except KeyError as e:
    raise ConfigError(f"config.json: llama3 rope parameters lack {e.args[0]!r}") from None
  return float(theta), scaling


def rope_to_hf(m: ModelConfig) -> dict:
  """Writes rope both ways: `rope_parameters` (transformers >= 5) and `rope_theta`/`rope_scaling`, the
  only fields transformers 4 reads (without them it would silently take theta 10000 and no scaling)."""
  params: dict[str, Any] = {"rope_type": "default", "rope_theta": m.rope_theta}
  out: dict[str, Any] = {"rope_theta": m.rope_theta}
  s = m.rope_scaling or {}
  if s.get("rope_type") == "linear":
    params.update(rope_type="linear", factor=s["factor"])
    out["rope_scaling"] = dict(params)
  elif s:
    params.update(rope_type="llama3", factor=s["factor"], low_freq_factor=s.get("low_freq_factor", 1.0),
                  high_freq_factor=s.get("high_freq_factor", 4.0),
                  original_max_position_embeddings=int(s["original_max_position"]))
    out["rope_scaling"] = dict(params)
  out["rope_parameters"] = params
  return out


def llama_like_from_hf(hf: dict) -> dict:
  """ModelConfig fields every llama-like config.json carries (llama, mistral, qwen3)."""
  refuse(hf, "hidden_act", ("silu",), "the MLP is SwiGLU")
  refuse(hf, "attention_bias", False, "projections have no bias")
  refuse(hf, "mlp_bias", False, "projections have no bias")
  heads = int(require(hf, "num_attention_heads"))
  embed = int(require(hf, "hidden_size"))
  theta, scaling = rope_from_hf(hf)
  return {
      "vocab_size": int(require(hf, "vocab_size")),
      "embed_dim": embed,
      "num_layers": int(require(hf, "num_hidden_layers")),
      "num_heads": heads,
      "num_kv_heads": int(hf.get("num_key_value_heads") or heads),
      "head_dim": int(hf.get("head_dim") or embed // heads),
      "mlp_dim": int(require(hf, "intermediate_size")),
      "max_position": int(hf.get("max_position_embeddings", 4096)),
      "rope_theta": theta,
      "rope_scaling": scaling,
      "norm_eps": float(hf.get("rms_norm_eps", 1e-6)),
      "tie_embeddings": bool(hf.get("tie_word_embeddings", False)),
  }


def llama_like_to_hf(m: ModelConfig) -> dict:
  return {
      "vocab_size": m.vocab_size,
      "hidden_size": m.embed_dim,
      "num_hidden_layers": m.num_layers,
      "num_attention_heads": m.num_heads,
      "num_key_value_heads": m.num_kv_heads,
      "head_dim": m.head_dim,
      "intermediate_size": m.mlp_dim,
      "max_position_embeddings": m.max_position,
      "rms_norm_eps": m.norm_eps,
      "tie_word_embeddings": m.tie_embeddings,
      "hidden_act": "silu",
      "attention_bias": False,
      "mlp_bias": False,
      "attention_dropout": 0.0,  # meshlm trains without dropout
      "use_cache": True,
      **rope_to_hf(m),
  }


def llama_like_layer_map(m: ModelConfig) -> dict[str, Tensor]:
  p = "model.layers.{i}."
  out = {
      "attn_norm": Tensor(p + "input_layernorm.weight"),
      "attn.q": Linear(p + "self_attn.q_proj.weight"),
      "attn.k": Linear(p + "self_attn.k_proj.weight"),
      "attn.v": Linear(p + "self_attn.v_proj.weight"),
      "attn.o": Linear(p + "self_attn.o_proj.weight", n_in=2),
      "mlp_norm": Tensor(p + "post_attention_layernorm.weight"),
      "mlp.gate": Linear(p + "mlp.gate_proj.weight"),
      "mlp.up": Linear(p + "mlp.up_proj.weight"),
      "mlp.down": Linear(p + "mlp.down_proj.weight"),
  }
  if m.qk_norm:
    out["attn.q_norm"] = Tensor(p + "self_attn.q_norm.weight")
    out["attn.k_norm"] = Tensor(p + "self_attn.k_norm.weight")
  return out


def default_top_map(m: ModelConfig) -> dict[str, Tensor]:
  out = {"embed": Tensor("model.embed_tokens.weight"), "final_norm": Tensor("model.norm.weight")}
  if not m.tie_embeddings:
    out["lm_head"] = Linear("lm_head.weight")
  return out


@dataclasses.dataclass(frozen=True)
class HeadSplit(Tensor):
  """One of the meshlm kernels an HF nn.Linear weight holds side by side within each head's rows: DeepSeek's
  kv_b_proj [N * (Hn + Hv), R] is, per head, Hn rows of k_b [R, N, Hn] then Hv rows of v_b [R, N, Hv]. `sizes` are
  the parts' widths per head, `part` this kernel's. Import reads the whole tensor per layer and takes its rows;
  export joins the parts again (`join`)."""
  sizes: tuple[int, ...] = ()
  part: int = 0

  def hf_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
    r, n, _ = shape
    return (n * sum(self.sizes), r)

  def to_meshlm(self, w: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    r, n, h = shape
    start = sum(self.sizes[:self.part])
    return np.transpose(w.reshape(n, sum(self.sizes), r)[:, start:start + h], (2, 0, 1))  # [R, N, H]

  def to_hf(self, w: np.ndarray) -> np.ndarray:
    return np.transpose(w, (1, 2, 0))  # this part's rows of each head, [N, H, R]

  def hf_index(self, index, shape):
    return None

  @staticmethod
  def join(parts: list[np.ndarray]) -> np.ndarray:
    """The HF tensor from every part's to_hf, in part order."""
    w = np.concatenate(parts, axis=1)  # [N, sum(sizes), R]
    return np.ascontiguousarray(w.reshape(-1, w.shape[-1]))
