"""Sampling with a KV cache on a tensor-parallel mesh (fsdp=2 x tensor=2): cached decoding equals
recomputing the prefix, log-probs equal a teacher-forced forward, windowed layers hold past their window, one
compile per shape bucket, bad requests. Cached against recomputed for every family, through the public API on 1
device, is tests/test_conformance.py's; here the sharded KV cache (KV heads over mesh.tensor) of the
preset with local and global layers, and llama2-tiny (one layer) for the compile and sampling controls."""
import functools

import jax
import numpy as np
import pytest

import meshlm
from meshlm.analysis.golden import shrink
from meshlm.errors import ConfigError
from meshlm.models import api, generate as G
from meshlm.nn import kv_cache

# Explicit only: auto samples on context and fsdp meshes in test_generate_context.py and test_rollout.py, and
# explicit == auto in training is every family's row of tests/test_conformance.py.
CASES = [("gemma3-tiny", "explicit"), ("llama2-tiny", "explicit")]
NEW = 64
LENGTHS = (5, 17, 33)  # with 64 new tokens every row runs past mistral's, gemma2's and gemma3's windows


# gemma3-tiny decodes one local and one global layer (golden.shrink) instead of its 8 (a scanned period of 6, then
# 2): both kinds, the window and the ring cache past it, a fraction of the layer bodies to compile in the prefill,
# the decode loop and the teacher-forced forward. The other presets are as shipped (shrink gives ()).
# llama2-tiny, the compile and sampling controls' model, on one layer of its two: the cache's sharding and the
# sampler do not depend on the depth (gemma3-tiny's two layers hold the per-layer caches).
OWN = {"llama2-tiny": ("model.num_layers=1",)}


@functools.cache  # once per (preset, mode) for the module: each makes and compiles the params' init
def setup(preset: str, mode: str):
  cfg = meshlm.load_config(f"model={preset}", *shrink(preset), *OWN.get(preset, ()), "train.compute_dtype=float32",
                           "cpu_devices=4", "mesh.fsdp=2", "mesh.tensor=2", f"shard_mode={mode}")
  params = meshlm.init_params(cfg, jax.random.key(0))
  rng = np.random.default_rng(1)
  prompts = [[int(t) for t in rng.integers(0, cfg.model.vocab_size, n)] for n in LENGTHS]
  return cfg, params, prompts


@functools.cache
def greedy(preset: str, mode: str):
  """(cfg, params, prompts, greedy generate() output, its compilations, teacher_forced of its tokens), once per
  (preset, mode) for the module: the window control reuses gemma3-tiny's instead of compiling another forward."""
  cfg, params, prompts = setup(preset, mode)
  out = G.generate(cfg, params, prompts, max_new_tokens=NEW)
  return cfg, params, prompts, out, dict(out.compilations), teacher_forced(cfg, params, prompts, out.token_lists())


def teacher_forced(cfg, params, prompts, news):
  """For each row: (log p(new[j] | prompt + new[:j]), the greedy token after prompt + new[:j]) from one
  jitted forward over all rows, right-padded. Causal attention makes position i's logits those of the
  prefix up to i, so this is uncached greedy decoding, every step of it at once."""
  seqs = [p + n for p, n in zip(prompts, news)]
  block = np.zeros((len(seqs), max(map(len, seqs))), np.int32)
  for i, s in enumerate(seqs):
    block[i, :len(s)] = s
  logits = np.asarray(jax.jit(lambda p, t: meshlm.forward(cfg, p, t))(params, block), np.float32)
  logp = np.asarray(jax.nn.log_softmax(logits, axis=-1))
  out = []
  for i, (prompt, new) in enumerate(zip(prompts, news)):
    rows = [len(prompt) - 1 + j for j in range(len(new))]
    out.append((np.array([logp[i, r, t] for r, t in zip(rows, new)]), [int(np.argmax(logits[i, r])) for r in rows]))
  return out


@pytest.mark.parametrize("preset, mode", CASES)
def test_cached_greedy_equals_uncached_and_logprobs_equal_forward(preset, mode):
  _, _, _, out, compilations, forced = greedy(preset, mode)
  assert compilations == {"prefill": 1, "decode": 1}
  for new, lp, (want_lp, want_tokens) in zip(out.token_lists(), out.logprob_lists(), forced):
    assert new == want_tokens
    np.testing.assert_allclose(lp, want_lp, atol=1e-5, rtol=0)


def test_recompute_reference_agrees_token_for_token():
  """The plain reference (the whole prefix through forward for each new token) gives the same tokens: the first 31
  of the cached run's 64 (greedy decoding is prefix-consistent), so every row's buffer is one bucket of 64 (one
  compile) and the reference runs 93 forwards instead of 192. All 64 tokens of every row equal the teacher-forced
  forward's argmax in test_cached_greedy_equals_uncached_and_logprobs_equal_forward."""
  cfg, params, prompts, out, _, _ = greedy("llama2-tiny", "explicit")
  n = 31
  assert {G.bucket(len(p) + n, cfg.model.max_position) for p in prompts} == {64}
  assert G.recompute_greedy(cfg, params, prompts, n) == [t[:n] for t in out.token_lists()]


def test_a_window_bug_is_caught(monkeypatch):
  """Negative control: local layers given a full-length cache attend past their window, and the
  log-probs after the window no longer match the teacher-forced forward."""
  # The correct run and its teacher-forced forward (all rows at once; row 2 is the longest, so the
  # padded block is as wide as for row 2 alone).
  cfg, params, prompts, out, _, forced = greedy("gemma3-tiny", "explicit")
  monkeypatch.setattr(kv_cache, "cache_size", lambda length, window: length)
  api.clear_programs()
  bad = G.generate(cfg, params, prompts, max_new_tokens=NEW, top_k=1, temperature=1.0)  # same tokens as greedy
  api.clear_programs()
  new = out.token_lists()[2]
  want, _ = forced[2]
  diff = np.abs(np.array(bad.logprob_lists()[2][:len(new)]) - want)
  assert diff.max() > 1e-3


def test_one_compile_per_bucket_and_sampling_controls():
  cfg, params, prompts = setup("llama2-tiny", "explicit")
  first = G.generate(cfg, params, prompts, max_new_tokens=NEW)
  # Other prompt lengths in the same buckets reuse both compiled steps.
  again = G.generate(cfg, params, [prompts[0][:-1], prompts[1][:-2], prompts[2]], max_new_tokens=NEW - 1)
  assert again.compilations == {"prefill": 0, "decode": 0}
  # top_k=1 and a tiny top_p are greedy whatever the temperature; log-probs stay the model's.
  for kw in (dict(temperature=1.5, top_k=1), dict(temperature=1.5, top_p=1e-6)):
    out = G.generate(cfg, params, prompts, max_new_tokens=NEW, **kw)
    assert out.token_lists() == first.token_lists()
    np.testing.assert_allclose(out.logprobs, first.logprobs, atol=1e-6)
  a = G.generate(cfg, params, prompts, max_new_tokens=16, temperature=1.0, seed=1)
  b = G.generate(cfg, params, prompts, max_new_tokens=16, temperature=1.0, seed=1)
  c = G.generate(cfg, params, prompts, max_new_tokens=16, temperature=1.0, seed=2)
  assert a.token_lists() == b.token_lists() and a.token_lists() != c.token_lists()
  assert all(x <= 0 for row in a.logprob_lists() for x in row)
  # A stop token ends its row right after it is sampled.
  stop = first.tokens[1][3]
  out = G.generate(cfg, params, prompts, max_new_tokens=NEW, stop_tokens=[stop])
  for row, full in zip(out.token_lists(), first.token_lists()):
    cut = full.index(stop) + 1 if stop in full else len(full)
    assert row == full[:cut]


def test_top_p_keeps_the_smallest_set_reaching_p():
  logits = np.log(np.array([[0.5, 0.3, 0.15, 0.05]], np.float32))
  seen = set()
  for s in range(200):
    tok, lp, lq = G.sample(logits, jax.random.key(s), 1.0, None, 0.75)
    seen.add(int(tok[0]))
    # The drawn-from distribution is {0: 0.5/0.8, 1: 0.3/0.8}; the model's is the untruncated one.
    assert abs(float(lq[0]) - np.log([0.5 / 0.8, 0.3 / 0.8][int(tok[0])])) < 1e-6
    assert abs(float(lp[0]) - np.log([0.5, 0.3][int(tok[0])])) < 1e-6
  assert seen == {0, 1}  # 0.5 < 0.75 <= 0.5 + 0.3
  tok, lp, _ = G.sample(logits, jax.random.key(0), 0.0, None, 1.0)
  assert int(tok[0]) == 0 and abs(float(lp[0]) - np.log(0.5)) < 1e-6


def test_kv_cache_ring_slots_hold_the_last_positions():
  # A ring of 4 over prompts of length 6 and 2 (padded to 8): row 0 keeps positions 4, 5, 2, 3.
  slots = kv_cache.prefill_slots(np.array([6, 2]), 8, 4)
  np.testing.assert_array_equal(slots.src, [[4, 5, 2, 3], [0, 1, 2, 3]])
  np.testing.assert_array_equal(slots.valid, [[1, 1, 1, 1], [1, 1, 0, 0]])
  d = kv_cache.decode_slots(np.array([6, 2]), 4)
  np.testing.assert_array_equal(d.write, [[0, 0, 1, 0], [0, 0, 1, 0]])
  np.testing.assert_array_equal(d.valid, [[1, 1, 1, 1], [1, 1, 1, 0]])


@pytest.mark.parametrize("kw, msg", [
    (dict(prompts=[[1] * 2049]), "longer than model.max_position=2048"),
    (dict(max_new_tokens=2040), "overflow model.max_position=2048; at most 2038 fit"),
    (dict(prompts=[[1], []]), "prompt 1: empty"),
    (dict(prompts=[]), "prompts: empty"),
    (dict(top_p=0.0), "top_p=0.0: must be in (0, 1]"),
    (dict(top_p=1.5), "top_p=1.5: must be in (0, 1]"),
    (dict(temperature=-0.1), "temperature=-0.1: must be >= 0"),
    (dict(prompts=[[1, 512]]), "token id 512 is outside the vocabulary [0, 512)"),
])
def test_bad_requests_fail_in_one_line_before_compiling(kw, msg):
  cfg = meshlm.load_config("model=llama2-tiny", "cpu_devices=1")
  args = dict(prompts=[[1, 2, 3, 4, 5, 6, 7, 8, 9, 10]], max_new_tokens=4) | kw
  with pytest.raises(ConfigError, match=None) as e:
    G.check_request(cfg, args["prompts"], args["max_new_tokens"], args.get("temperature", 0.0), None,
                    args.get("top_p", 1.0))
  assert msg in str(e.value) and "\n" not in str(e.value)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
  """A meshlm model directory of a freshly initialized llama2-tiny (convert's layout)."""
  from meshlm.commands.convert import save_meshlm
  cfg = meshlm.load_config("model=llama2-tiny", "cpu_devices=1", "train.compute_dtype=float32")
  return save_meshlm(cfg, meshlm.init_params(cfg, jax.random.key(0)), tmp_path_factory.mktemp("gen") / "model")


def test_generate_command_samples_from_a_model_directory(model_dir, capsys):
  from meshlm.cli import main
  assert main(["generate", str(model_dir), "prompt=def f(", "max_new_tokens=6", "cpu_devices=1"]) == 0
  out = capsys.readouterr().out
  # The directory's config and parameters as the command reads them: its compiled sampler serves this call too.
  cfg, params = meshlm.load(model_dir, "cpu_devices=1")
  want = G.generate(cfg, params, [list(b"def f(")], max_new_tokens=6)
  assert want.compilations == {"prefill": 0, "decode": 0}
  from meshlm.console import printable
  from meshlm.train.data import ByteTokenizer
  assert out == printable("def f(" + ByteTokenizer().decode(want.token_lists()[0])) + "\n"


@pytest.mark.parametrize("args, msg", [
    (["prompt="], "prompt 0: empty"),
    (["prompt=x", "top_p=0"], "top_p=0.0: must be in (0, 1]"),
    (["prompt=x", "temperature=-1"], "temperature=-1.0: must be >= 0"),
    (["prompt=x", "max_new_tokens=5000"], "overflow model.max_position=2048"),
    (["prompt=" + "x" * 2049], "longer than model.max_position=2048"),
    (["prompt=x", "top_k=many"], "top_k='many': expected int"),
])
def test_generate_command_refuses_bad_input_in_one_line(model_dir, capsys, args, msg):
  from meshlm.cli import main
  assert main(["generate", str(model_dir), *args, "cpu_devices=1"]) == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1 and msg in err[0], err


def test_generate_command_refuses_a_path_without_a_model(tmp_path, capsys):
  from meshlm.cli import main
  assert main(["generate", str(tmp_path), "prompt=x"]) == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1 and "not a Hugging Face model directory" in err[0], err


def test_generate_command_on_a_tokenizer_less_hf_dir_says_what_to_pass(tmp_path, capsys):
  """The llama fixture (vocab 151) has no tokenizer.json: the refusal names data.tokenizer and prompt_ids, not
  training's synthetic data; with prompt_ids it samples and prints the new ids, those generate() draws."""
  import shutil
  from meshlm.cli import main
  from test_hf import FIXTURES
  src = tmp_path / "llama-hf"
  shutil.copytree(FIXTURES / "llama", src)
  assert main(["generate", str(src), "prompt=hello", "cpu_devices=1"]) == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert err == ["meshlm: error: model.vocab_size=151 is too small for the byte tokenizer, which has 257 ids (256 "
                 "bytes + EOS); give data.tokenizer=PATH (the model's tokenizer.json), or give the prompt as token "
                 "ids (prompt_ids=ID,ID)"], err
  assert main(["generate", str(src), "prompt_ids=1,2,3", "max_new_tokens=5", "stop=", "cpu_devices=1"]) == 0
  cfg, params = meshlm.load(src, "cpu_devices=1")
  want = meshlm.generate(cfg, params, [[1, 2, 3]], max_new_tokens=5, stop_tokens=()).token_lists()[0]
  assert capsys.readouterr().out == " ".join(map(str, want)) + "\n"
  for args, msg in ((["prompt=x", "prompt_ids=1"], "give prompt=TEXT or prompt_ids=ID,ID (one of them)"),
                    ([], "give prompt=TEXT or prompt_ids=ID,ID (one of them)"),
                    (["prompt_ids=1,x"], "prompt_ids='1,x': expected token ids separated by commas")):
    assert main(["generate", str(src), *args, "cpu_devices=1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and msg in err[0], err


def _metaspace_tokenizer(path, vocab_size: int):
  """A SentencePiece-style tokenizer.json (word starts marked "▁", one id per word): ids 0..vocab_size - 1 are
  "▁w<i>", with "▁the", "▁quick" and "</s>" among them."""
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers
  words = ["</s>", "▁the", "▁quick"] + [f"▁w{i}" for i in range(3, vocab_size)]
  tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="</s>"))
  tok.pre_tokenizer = pre_tokenizers.Metaspace()
  tok.decoder = decoders.Metaspace()
  tok.save(str(path))


def test_generate_command_keeps_the_completions_leading_space(model_dir, tmp_path, capsys):
  from meshlm.cli import main
  from meshlm.train.data.tokenizers import HFTokenizer
  path = tmp_path / "tokenizer.json"
  _metaspace_tokenizer(path, 512)
  tok = HFTokenizer(str(path))
  assert list(tok.encode("the quick")) == [1, 2] and tok.decode([1, 2, 7]) == "the quick w7"
  assert tok.decode([7]) == "w7"  # decoded alone, the completion loses its leading space
  assert main(["generate", str(model_dir), "prompt=the quick", "max_new_tokens=4", f"data.tokenizer={path}",
               "cpu_devices=1"]) == 0
  out = capsys.readouterr().out
  cfg, params = meshlm.load(model_dir, "cpu_devices=1")
  new = meshlm.generate(cfg, params, [[1, 2]], max_new_tokens=4).token_lists()[0]
  assert out == "the quick " + tok.decode(new) + "\n"
