"""Checkpoint layouts of the Gated DeltaNet hybrids, rewritten by the HF tests (test_hf.py, test_hf_qwen3_next.py).

transformers' save_pretrained writes the text models (Qwen3NextForCausalLM, Qwen3_5ForCausalLM,
Qwen3_5MoeForCausalLM) with `model.` names and one tensor per expert; the published Qwen3.5 checkpoints are
multimodal (config.json nests the text model under text_config, tensors under `model.language_model.`, beside
`model.visual.*` and `mtp.*`), and transformers 5 holds experts fused (`mlp.experts.gate_up_proj` [E, 2F, D],
`mlp.experts.down_proj` [E, D, F]). These helpers turn one layout into another on numpy tensor dicts.
"""
from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file, save_file

PREFIX = "model.language_model."
SKIPPED = ("model.visual.", "mtp.")
EXPERT = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


def reference_forms(path: Path) -> tuple[str, ...]:
  """Overrides that run a fixture's recurrence and dispatch in their reference forms: model.parts.gdn.impl=reference
  for a Gated DeltaNet hybrid, model.parts.moe.impl=reference (every expert on every token, masked) for a MoE one.
  Each compiles in about half the CPU time of the default form; the HF tests' wrong-config controls run them, their
  mistakes being outside both (measured: every control's error the same to 5 digits under either form)."""
  cfg = json.loads((Path(path) / "config.json").read_text())
  text = cfg.get("text_config", cfg)
  return ((("model.parts.gdn.impl=reference",) if text.get("linear_num_value_heads") else ())
          + (("model.parts.moe.impl=reference",) if text.get("num_local_experts") or text.get("num_experts") else ()))


def fuse(tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
  """Per-expert tensors -> each layer's gate_up_proj [E, 2F, D] (gate rows first) and down_proj [E, D, F]."""
  out, experts = {}, {}
  for name, w in tensors.items():
    m = EXPERT.match(name)
    if m:
      experts.setdefault(m[1], {}).setdefault(m[3], {})[int(m[2])] = w
    else:
      out[name] = w
  for head, projs in experts.items():
    n = len(projs["gate_proj"])
    out[head + ".gate_up_proj"] = np.stack([np.concatenate([projs["gate_proj"][e], projs["up_proj"][e]])
                                            for e in range(n)])
    out[head + ".down_proj"] = np.stack([projs["down_proj"][e] for e in range(n)])
  return out


def unfuse(tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
  """The inverse of fuse."""
  out = {}
  for name, w in tensors.items():
    if name.endswith(".mlp.experts.gate_up_proj"):
      head, f = name[:-len(".gate_up_proj")], w.shape[1] // 2
      for e in range(w.shape[0]):
        out[f"{head}.{e}.gate_proj.weight"], out[f"{head}.{e}.up_proj.weight"] = w[e, :f], w[e, f:]
    elif name.endswith(".mlp.experts.down_proj"):
      head = name[:-len(".down_proj")]
      for e in range(w.shape[0]):
        out[f"{head}.{e}.down_proj.weight"] = w[e]
    else:
      out[name] = w
  return out


def text_layout(tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
  """Any of the layouts as the text model's own, per expert (what meshlm's export writes)."""
  kept = {("model." + k[len(PREFIX):] if k.startswith(PREFIX) else k): v for k, v in tensors.items()
          if not k.startswith(SKIPPED)}
  return unfuse(kept)


def read_tensors(path: Path) -> dict[str, np.ndarray]:
  out = {}
  for f in sorted(path.glob("*.safetensors")):
    out.update(load_file(f))
  return out


def write_tensors(path: Path, tensors: dict[str, np.ndarray]) -> None:
  for f in path.glob("*.safetensors*"):
    f.unlink()
  save_file({k: np.ascontiguousarray(v) for k, v in tensors.items()}, str(path / "model.safetensors"),
            metadata={"format": "pt"})


def copy_fused(src: Path, dst: Path) -> Path:
  """A copy of a text-layout fixture with its experts fused."""
  shutil.copytree(src, dst)
  write_tensors(dst, fuse(read_tensors(src)))
  return dst


def copy_multimodal(src: Path, dst: Path, model_type: str, architecture: str, *, fused: bool = False) -> Path:
  """A copy of a text-layout fixture in the published multimodal layout: config.json nests it under
  text_config (the head's tie flag at the top level, as transformers reads it), tensors under
  model.language_model., plus a few model.visual.* and mtp.* tensors."""
  shutil.copytree(src, dst)
  text = json.loads((src / "config.json").read_text())
  top = {"architectures": [architecture], "model_type": model_type, "text_config": {
      k: v for k, v in text.items() if k not in ("architectures", "transformers_version")},
      "vision_config": {"model_type": model_type + "_vision", "depth": 1, "hidden_size": 16},
      "tie_word_embeddings": text["tie_word_embeddings"], "image_token_id": 150, "video_token_id": 149}
  (dst / "config.json").write_text(json.dumps(top))
  tensors = read_tensors(src)
  tensors = {(PREFIX + k[len("model."):] if k.startswith("model.") else k): v
             for k, v in (fuse(tensors) if fused else tensors).items()}
  rng = np.random.default_rng(0)
  extra = {"model.visual.patch_embed.proj.weight": (16, 3, 2, 4, 4), "model.visual.merger.linear_fc2.weight": (45, 64),
           "mtp.fc.weight": (45, 90), "mtp.norm.weight": (45,)}
  tensors.update({k: rng.standard_normal(s).astype(np.float32) for k, s in extra.items()})
  write_tensors(dst, tensors)
  return dst
