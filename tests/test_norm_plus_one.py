"""Family.norm_plus_one is the one switch for (1 + w) RMSNorms: a family that declares it gets (1 + w) in its
layer norms, its parts' own norms that follow it (gqa's q/k norms) and the final norm, each starting at zero;
a family without it gets plain scales starting at one. Neither a kind nor a part can be told otherwise.

Each preset runs as two twins of its family, one with the switch and one without. The leaves whose init the
switch flips must be exactly the expected norms, and the twins must give the same logits when the plain twin's
scales are the (1 + w) twin's plus one: a norm whose apply ignored the switch would break that.
"""
import dataclasses
import functools

import jax
import numpy as np
import pytest

from meshlm import spec as S
from meshlm.config import load_config
from meshlm.models import decoder, registry
from meshlm.models.params import init_params, param_specs
from meshlm.models.family import Family, Kind
from meshlm.models.ffns.glu import glu
from meshlm.models.mixers.gqa import gqa

# preset -> the leaves the switch flips (layers/<kind>/...), beside final_norm. gdn's gated norm (plain) and
# gated_gqa's q/k norms ((1 + w) always, as Hugging Face's) do not follow it.
FLIPPED = {
    "gemma3-tiny": {"dense": ("attn_norm", "mlp_norm", "attn_post_norm", "mlp_post_norm", "attn/q_norm",
                              "attn/k_norm")},
    "qwen3-tiny": {"dense": ("attn_norm", "mlp_norm", "attn/q_norm", "attn/k_norm")},
    "qwen3.5-tiny": {"linear_attn": ("attn_norm", "mlp_norm"), "full_attn": ("attn_norm", "mlp_norm")},
}


def _path(path) -> str:
  return "/".join(str(k.key) for k in path)


def _inits(cfg) -> dict[str, str]:
  flat, _ = jax.tree_util.tree_flatten_with_path(param_specs(cfg), is_leaf=S.is_spec)
  return {_path(p): s.init for p, s in flat}


@pytest.fixture
def twins(monkeypatch):
  """{preset: (cfg with the switch, cfg without)}: the preset's family as two registered twins."""
  get = registry.get
  made = {}

  def fake(name):
    return made[name] if name in made else get(name)
  monkeypatch.setattr(registry, "get", fake)
  out = {}
  for preset in FLIPPED:
    base = load_config(f"model={preset}")
    fam = get(base.model.family)
    pair = []
    for on in (True, False):
      name = f"{fam.name}_{'plus_one' if on else 'plain'}"
      made[name] = dataclasses.replace(fam, name=name, norm_plus_one=on)
      pair.append(load_config(f"model={preset}", f"model.family={name}", "train.compute_dtype=float32"))
    out[preset] = tuple(pair)
  return out


@pytest.mark.parametrize("preset", sorted(FLIPPED))
def test_the_switch_flips_exactly_the_norms_at_init(twins, preset):
  on, off = (_inits(c) for c in twins[preset])
  assert on.keys() == off.keys()
  flipped = {k for k in on if on[k] != off[k]}
  expected = {"final_norm"} | {f"layers/{kind}/{leaf}" for kind, leaves in FLIPPED[preset].items() for leaf in leaves}
  assert flipped == expected
  assert {on[k] for k in flipped} == {"zeros"} and {off[k] for k in flipped} == {"ones"}


@pytest.mark.parametrize("preset", sorted(FLIPPED))
def test_the_switch_reaches_every_norm_it_flips(twins, preset):
  """(1 + w) with w equals plain with 1 + w, in every flipped norm at once; the same scales under the other twin
  give other logits (the control: the switch is read at all)."""
  cfg_on, cfg_off = twins[preset]
  on_init, off_init = _inits(cfg_on), _inits(cfg_off)
  params = init_params(cfg_on, jax.random.key(0))
  flat, tree = jax.tree_util.tree_flatten_with_path(params)
  keys = jax.random.split(jax.random.key(1), len(flat))
  # Random scales in the flipped norms, so that a norm reading the wrong flag changes the output.
  w = [0.3 * jax.random.normal(k, x.shape, x.dtype) if on_init[_path(p)] != off_init[_path(p)] else x
       for k, (p, x) in zip(keys, flat)]
  plain = [x + 1.0 if on_init[_path(p)] != off_init[_path(p)] else x for x, (p, _) in zip(w, flat)]
  w, plain = jax.tree.unflatten(tree, w), jax.tree.unflatten(tree, plain)
  ids = jax.random.randint(jax.random.key(2), (2, 11), 0, cfg_on.model.vocab_size)
  fwd_on, fwd_off = (jax.jit(functools.partial(decoder.forward, cfg)) for cfg in (cfg_on, cfg_off))
  a, b = np.asarray(fwd_on(w, ids), np.float64), np.asarray(fwd_off(plain, ids), np.float64)
  np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
  assert np.max(np.abs(np.asarray(fwd_off(w, ids), np.float64) - a)) > 1e-2


def test_every_registered_kind_takes_its_family_switch():
  for name in registry.FAMILIES:
    fam = registry.get(name)
    assert {k.plus_one for k in fam.kinds.values()} == {fam.norm_plus_one}, name


def test_a_kind_or_a_part_cannot_be_told_otherwise():
  with pytest.raises(TypeError):
    Kind(gqa(), glu(), plus_one=True)
  with pytest.raises(TypeError):
    gqa(plus_one=True)
  fam = Family("t", kinds={"dense": Kind(gqa(), glu())}, norm_plus_one=True)
  assert fam.kinds["dense"].plus_one and dataclasses.replace(fam, norm_plus_one=False).kinds["dense"].plus_one is False


def test_the_switch_keeps_every_other_field_of_a_replaced_part():
  """A copy of gqa with another name and no state (tests/test_conformance.py's throwaway family) keeps them under
  the switch, on or off; a copy whose apply is no longer gqa's is kept as it is without the switch and refused
  with it (the switch cannot reach into another apply)."""
  renamed = dataclasses.replace(gqa(), name="stateless", state_spec=None)
  for on in (True, False):
    mixer = Family("t", kinds={"dense": Kind(renamed, glu())}, norm_plus_one=on).kinds["dense"].mixer
    assert (mixer.name, mixer.state_spec) == ("stateless", None)
    assert mixer.spec.keywords == {"plus_one": on}
  broken = dataclasses.replace(gqa(), apply=lambda p, x, ctx, state=None: (x, None, {}))
  assert Family("t", kinds={"dense": Kind(broken, glu())}).kinds["dense"].mixer.apply is broken.apply
  with pytest.raises(ValueError, match="not gqa's"):
    Family("t", kinds={"dense": Kind(broken, glu())}, norm_plus_one=True)
