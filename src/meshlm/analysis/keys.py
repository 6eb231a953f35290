"""The keys that change the compiled program without changing what it computes, as the reports print them
(`meshlm census` and `compare`'s config, `meshlm compile`, chip.py's rows): resolved for the platform the program is
for, and as one `keys:` line of a report. The attention core's own (flash_block, splash_backward, splash_blocks)
come from its record (nn/attention.Core.summary)."""
from __future__ import annotations

from typing import Any


def program_keys(cfg, platform: str | None = None) -> dict[str, Any]:
  """The keys that change the compiled program beside the attention core's (Core.summary), resolved on platform
  (by default JAX's backend): rope_swap, layer_cast, remat_attention, scatter_leading."""
  import jax
  from meshlm.nn.rope import resolve_swap
  from meshlm.parallel.sharding import scatter_rule
  platform = platform or jax.default_backend()
  return {"rope_swap": resolve_swap(cfg.rope_swap, platform), "layer_cast": cfg.layer_cast,
          "remat_attention": cfg.remat_attention, "scatter_leading": scatter_rule(cfg.scatter_leading, platform)}


PROGRAM_KEYS = ("flash_block", "rope_swap", "layer_cast", "remat_attention", "scatter_leading", "splash_backward")


def keys_line(c: dict) -> str | None:
  """The config summary's program keys as one report line ("  keys: rope_swap=roll ... splash 256/256: fwd
  1024/1024/512 dkv 1024/1024/512 fused"), those it has and that are set; None if none."""
  slash = lambda bs: "/".join(map(str, bs))  # noqa: E731
  words = [f"{k}={c[k]}" for k in PROGRAM_KEYS if c.get(k) is not None]
  for shape, b in (c.get("splash_blocks") or {}).items():
    words.append(f"splash {shape}: fwd {slash(b['fwd'])} dkv {slash(b['dkv'])} "
                 + ("fused" if b["dq"] is None else f"dq {slash(b['dq'])}"))
  return "  keys: " + "  ".join(words) if words else None
