"""Attribution: a raw name-stack path -> the layer it belongs to, e.g. "lm_head backward".

JAX writes `jax.named_scope` names into op locations (StableHLO) and metadata op_name (HLO):
"jit(<lambda>)/transpose(jvp(lm_head))/dot_general" is the LM head's backward pass, and
"jit(<lambda>)/jvp()/while/body/closed_call/layers/mlp/mlp/down/btf,fd->btd/dot_general" is the
forward of the scanned MLP down projection. We keep the named scopes and drop JAX's own frames.
"""
from __future__ import annotations

import re

# Frames JAX adds around user scopes; they carry no layer name. (JAX 0.12 adds "eval_jaxpr".)
_NOISE = {"while", "body", "cond", "closed_call", "checkpoint", "remat", "rematted_computation", "pjit",
          "jit", "shard_map", "custom_vjp_call", "custom_jvp_call", "core_call", "call", "scan", "eval_jaxpr"}
_WRAP = re.compile(r"^(jvp|transpose|vmap|jit|pjit|remat|checkpoint|auto_axes)\((.*)\)$")


def _split(path: str) -> list[str]:
  """Splits on '/' outside parentheses (scope names may nest: transpose(jvp(a/b)))."""
  parts, depth, cur = [], 0, []
  for ch in path:
    if ch == "/" and depth == 0:
      parts.append("".join(cur))
      cur = []
      continue
    depth += ch == "("
    depth -= ch == ")"
    cur.append(ch)
  parts.append("".join(cur))
  return [p for p in parts if p]


def attribute(path: str) -> str:
  """'layers/mlp/down backward', 'lm_head forward', or 'other' when no scope is known."""
  backward = False
  names: list[str] = []
  parts = _split(path)
  for i, part in enumerate(parts):
    inner = part
    while True:
      m = _WRAP.match(inner)
      if not m:
        break
      backward |= m.group(1) == "transpose"
      inner = m.group(2)
    last = i == len(parts) - 1
    if inner != part:  # a wrapper's contents are a nested path of scopes; jit(...) holds a function name
      if not part.startswith(("jit(", "pjit(")):
        names += [n for n in _split(inner) if _is_scope(n)]
      continue
    if last:  # the primitive itself (dot_general, transpose, ...)
      continue
    if _is_scope(inner):
      names.append(inner)
  dedup = _collapse_repeats(names)
  if not dedup:
    return "other"
  return "/".join(dedup) + (" backward" if backward else " forward")


def _collapse_repeats(names: list[str]) -> list[str]:
  """names with each run repeated right after itself kept once: a function and its scope sharing a name (mlp/mlp),
  and a custom VJP's backward transposing a function traced under its call's scopes
  (experts/down/transpose(experts)/down: the fused GLU-down's backward, nn/moe/fused.py)."""
  out: list[str] = []
  for n in names:
    out.append(n)
    for k in range(1, len(out) // 2 + 1):
      if out[-k:] == out[-2 * k:-k]:
        del out[-k:]
        break
  return out


def _is_scope(name: str) -> bool:
  if not name or name in _NOISE or "->" in name or "," in name or "(" in name or "<" in name:
    return False
  # lax.cond's branches are traced as "branch_<i>_fun": JAX's, not a layer's.
  return (bool(re.match(r"^[A-Za-z_][\w.-]*$", name)) and not name.startswith("jit")
          and not re.match(r"^branch_\d+_fun$", name))


def join(caller: str, callee: str) -> str:
  """Name stack of an op inside a called function: the call site's frames, then the op's own."""
  if not caller:
    return callee
  return f"{caller}/{callee}" if callee else caller
