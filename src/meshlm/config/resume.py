"""The keys that may change when a run resumes: declared once, here.

A resume with another value of any other key is refused (train/run_dir.py reads RESUMABLE). `meshlm train --help`
marks these keys (config/keys.py), and the README's "Stopping and resuming" table lists exactly these rows
(tests/test_loop.py holds the two together). A layer part's own knobs are declared by its config section instead:
the knobs its `COMPUTE` names change how the layer computes the same parameters, so they too may change on resume
and under checkpoint.load_params_from (train/checkpoint.py reads them; the README table's last row lists them).

An entry is a key, or a section ending in ".*" (every key under it).
"""
from __future__ import annotations

# (keys, why they may change): the rows of the README's table, in its order.
RESUMABLE_ROWS: tuple[tuple[tuple[str, ...], str], ...] = (
    (("train.steps",), "train longer (or stop earlier); the learning-rate schedule follows the new total"),
    (("train.stop_after", "train.log_every", "train.sample_tokens", "train.sample_temperature", "train.on_nonfinite",
      "train.max_nonfinite_in_a_row", "checkpoint.every", "checkpoint.keep"),
     "when the run stops, logs and saves, not what it trains"),
    (("train.micro_batches",), "the same global batch, accumulated in other pieces"),
    (("cpu_devices", "mesh.*", "distributed.*"), "a checkpoint restores onto any mesh and process count "
     "(docs/multihost.md)"),
    # The compute-only keys: how the step computes and is compiled, not what.
    (("shard_mode", "remat", "lm_head_weight_grad_in_kernel_order", "dense_weight_grad_in_kernel_order",
      "weight_grad_impl", "attention_impl", "splash_backward", "gdn_impl", "context_attention",
      "decode_attention_impl", "decode_attention_block", "scan_layers", "stack_rows", "loss_impl", "loss_block",
      "loss_grad_reduce", "train.matmul_precision", "sa_block_q", "sa_block_kv", "sa_block_kv_compute",
      "sa_block_q_dkv", "sa_block_kv_dkv", "sa_block_kv_dkv_compute", "sa_block_q_dq", "sa_block_kv_dq", "flash_block",
      "rope_swap", "layer_cast", "remat_attention", "scatter_leading"),
     "how the step is compiled; the stored parameters are the same"),
    (("checkpoint.load_params_from",), "ignored on resume: the run's own checkpoint wins"),
    (("rl.eval_every", "rl.eval_prompts", "rl.log_completions"),
     "what `meshlm rl`'s evaluation measures and logs, and how often, not what it trains"),
    (("eval.*",), "the validation set and how often it is measured, not what the run trains"),
)
RESUMABLE: tuple[str, ...] = tuple(k for keys, _ in RESUMABLE_ROWS for k in keys)
# What the README's last row says of the parts' COMPUTE knobs.
PART_COMPUTE_WHY = ("how a layer part computes the same parameters (its section's COMPUTE knobs); also under "
                    "`checkpoint.load_params_from`")


def matches(key: str, entries: tuple[str, ...]) -> bool:
  """key is an entry, or under an entry "section.*"."""
  return any(key == e or (e.endswith(".*") and key.startswith(e[:-1])) for e in entries)


def may_change_on_resume(key: str) -> bool:
  """A schema key (dotted) that a resume may change."""
  return matches(key, RESUMABLE)
