"""A decode step's expert kernels left split on their embed dim (model.parts.moe.decode_kernels, kernel_fsdp=embed,
ep_impl=compact: expert_parallel.expert_rows_split): the routed rows' embed slices go to the kernels, not the kernels
to the rows.

- On expert=2 x fsdp=2 x context=2 (the embed dim split over fsdp x context, 4 slices; one token per row, as a decode
  step), the split layer equals the unsharded layer and the gathered one (float32, within test_moe_ep's TOL).
- Its compiled program gathers no expert kernel (no all-gather of the kernels' shapes; the gathered program has
  them: control). With the two split axes taken in the wrong order (the rows' slices paired with other kernel
  slices), the output differs.
- auto splits a decode step's few rows and not a training step's many (split_pays at the 397B rollout's sizes).
"""
import functools

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding

from meshlm.nn import moe
from meshlm.nn.dense import dense
from meshlm.nn.moe import expert_parallel, layer
from meshlm.parallel.sharding import logical_spec
from moe_helpers import settings
from test_moe_ep import D, E, F, K, SPEC, TOL, _inputs, _mesh

AXES = {"expert": 2, "fsdp": 2, "context": 2}
DECODE = type("Ctx", (), {"dense": staticmethod(functools.partial(dense, kernel_order=True)), "mode": "decode"})


def _layer(choice: str):
  def f(p, x):
    return moe.moe_mlp(p, x, DECODE, *settings(E, K, norm_topk_prob=True, ep_impl="compact",
                                               decode_kernels=choice))[0]
  return f


def _run(choice: str):
  """(y, compiled HLO text) of the decode layer on AXES, x one token per row [B, 1, D]."""
  x, p = _inputs()
  x = x[:, :1]
  mesh = _mesh(AXES, "explicit")
  put = lambda a, axes: jax.device_put(a, NamedSharding(mesh, logical_spec(axes, a.shape, mesh)))  # noqa: E731
  with jax.set_mesh(mesh):
    ps, xs = {k: put(v, SPEC[k].axes) for k, v in p.items()}, put(x, ("batch", "length", "act_embed"))
    compiled = jax.jit(_layer(choice)).lower(ps, xs).compile()
    return np.asarray(jax.device_get(compiled(ps, xs))), compiled.as_text()


@pytest.fixture(scope="module")
def outputs():
  x, p = _inputs()
  return {"unsharded": np.asarray(jax.jit(_layer("gathered"))(p, x[:, :1])), "split": _run("split"),
          "gathered": _run("gathered")}


def _kernel_gathers(text: str) -> int:
  """All-gathers whose result has an expert group's kernel shape (E / 2 experts, gate/up [D, F] or down [F, D])."""
  shapes = (f"[{E // 2},{D},{F}]", f"[{E // 2},{F},{D}]")
  return sum(1 for line in text.splitlines() if "all-gather" in line and "=" in line
             and any(s in line.split("=", 1)[1].split("all-gather")[0] for s in shapes))


def test_split_equals_the_unsharded_and_the_gathered_layer(outputs):
  split, text = outputs["split"]
  gathered, gathered_text = outputs["gathered"]
  ref = outputs["unsharded"]
  scale = max(1.0, float(np.max(np.abs(ref))))
  assert np.max(np.abs(split - ref)) / scale <= TOL and np.max(np.abs(gathered - ref)) / scale <= TOL
  assert _kernel_gathers(text) == 0 and _kernel_gathers(gathered_text) > 0


def test_split_axes_in_the_wrong_order_differ(outputs, monkeypatch):
  # The storage order of the embed dim's axes (fsdp, context) gives each device's slice; reversed, rows meet the
  # wrong kernel slices.
  real = layer._axes_tuple
  monkeypatch.setattr(layer, "_axes_tuple", lambda part: tuple(reversed(real(part))))
  broken, _ = _run("split")
  assert np.max(np.abs(broken - outputs["unsharded"])) > 1e-3


def test_auto_splits_a_decode_steps_rows_not_a_training_steps():
  # The 397B rollout (expert=16, embed over fsdp x context = 16, 32 local experts, D 4096, F 1024): 64 received rows
  # per device in decode, 112,640 in a 4,096-token training step.
  assert expert_parallel.split_pays(64, 16, 32, 4096, 1024)
  assert not expert_parallel.split_pays(112_640, 16, 32, 4096, 1024)
  assert not expert_parallel.split_pays(64, 1, 32, 4096, 1024)  # nothing split: nothing to gain
  _, p = _inputs()
  with jax.set_mesh(_mesh(AXES, "explicit")):
    spec = layer._batch_spec((4, 1, D))
    kernels = (p["gate"], p["up"], p["down"])
    knobs, _ = settings(E, K, ep_impl="compact")
    mesh = jax.sharding.get_abstract_mesh()
    assert layer._split_axes(knobs, kernels, (4, 1, D), spec, ("expert",), mesh) == ("fsdp", "context")
    assert layer._split_axes(knobs, kernels, (4, 64, D), spec, ("expert",), mesh) == ()  # a prefill's 64 tokens a row
