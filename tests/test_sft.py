"""Fine-tuning on conversations end to end on CPU (issue 46): a tiny llama with the chat fixtures' tokenizer and
Llama 3's generation-marked template, a conversational JSONL, data.assistant_only=true and a validation set. Float32,
one train step compiled for the module (the gradient test builds its own step once)."""
import json
import re
import os

import jax
import numpy as np
import pytest

from meshlm.cli import main
from meshlm.config import load_config
from meshlm.errors import ConfigError
from meshlm.train.data import make_dataset
from meshlm.train.loop import train
from meshlm.train.step import build_train_step, grads_and_loss

FIX = os.path.join(os.path.dirname(__file__), "fixtures", "chat_templates")
STEPS, EVERY = 6, 2


def _conversations(path, start, n):
  rows = [{"messages": [{"role": "user", "content": f"What is {i} + {i}?"},
                        {"role": "assistant", "content": f"It is {2 * i}."}]} for i in range(start, start + n)]
  path.write_text("".join(json.dumps(r) + "\n" for r in rows))
  return str(path)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
  d = tmp_path_factory.mktemp("sft")
  return _conversations(d / "train.jsonl", 0, 40), _conversations(d / "val.jsonl", 40, 12), d


def _cfg(files, *overrides):
  train_path, val_path, _ = files
  return load_config("model=llama2-tiny", "model.vocab_size=512", "cpu_devices=2", "train.compute_dtype=float32",
                     "train.seq_len=48", "train.per_device_batch_size=1", f"train.steps={STEPS}",
                     "train.warmup_steps=0", "train.sample_tokens=0", f"data.path={train_path}",
                     f"data.tokenizer={FIX}/tokenizer.json", f"data.chat_template={FIX}/llama3_training.jinja",
                     "data.assistant_only=true", f"eval.path={val_path}", f"eval.every={EVERY}", "eval.batches=2",
                     *overrides)


def test_masked_targets_are_not_in_the_gradient(files):
  """Perturbing only the targets the assistant mask leaves out changes no gradient bit; perturbing one trained target
  (the negative control) does."""
  cfg = _cfg(files)
  step = build_train_step(cfg)
  batch = next(make_dataset(cfg, global_batch=step.global_batch, seq_len=cfg.train.seq_len))
  mask = batch["loss_mask"]
  assert 0 < mask.sum() < 0.5 * (batch["segment_ids"] != 0).sum()  # the user turns and headers are left out
  state = step.init_state(jax.random.key(0))
  grads = jax.jit(lambda p, b: grads_and_loss(cfg, p, b)[1])

  def grad_of(targets):
    with jax.set_mesh(step.mesh):
      return jax.device_get(grads(state.params, step.put_batch(dict(batch, targets=targets))))
  base = grad_of(batch["targets"])
  prompt = np.where(mask == 0, (batch["targets"] + 7) % 300, batch["targets"]).astype(np.int32)
  assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(base), jax.tree.leaves(grad_of(prompt))))
  one = batch["targets"].copy()
  r, c = np.argwhere(mask > 0)[0]
  one[r, c] = (one[r, c] + 7) % 300
  assert not all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(base), jax.tree.leaves(grad_of(one))))


@pytest.fixture(scope="module")
def fine_tuned(files):
  """stop_after=3, then the same command: (first TrainResult, second TrainResult, run_dir)."""
  run_dir = str(files[2] / "run")
  first = train(_cfg(files, f"run_dir={run_dir}", "train.stop_after=3"), show_progress=False)
  second = train(_cfg(files, f"run_dir={run_dir}"), show_progress=False)
  return first, second, run_dir


def test_fine_tune_learns_the_answers_and_validates_on_schedule_across_a_resume(fine_tuned):
  """stop_after=3, then the same command: the loss on the assistant tokens falls, the validation loss is in
  metrics.jsonl after steps 2, 4 and 6 (eval.every=2, the last included) once each, and falls too; every record has
  the step's trained tokens, the assistant tokens only."""
  first, second, run_dir = fine_tuned
  assert first.stop_reason == "stop_after"
  assert second.start_step == 3
  with open(os.path.join(run_dir, "metrics.jsonl")) as f:
    records = [json.loads(line) for line in f]
  assert [r["step"] for r in records] == list(range(1, STEPS + 1))  # the updates done, as the console counts
  validated = [r["step"] for r in records if "val_loss" in r]
  assert validated == [EVERY, 2 * EVERY, STEPS]
  val = [r["val_loss"] for r in records if "val_loss" in r]
  assert val[-1] < val[0] and all(np.isclose(np.exp(r["val_loss"]), r["val_ppl"]) for r in records if "val_loss" in r)
  assert len({r["val_tokens"] for r in records if "val_tokens" in r}) == 1  # the same batches each time
  losses = first.losses + second.losses
  assert losses[-1] < 0.5 * losses[0], losses
  assert all(0 < r["trained_tokens"] < 2 * 48 / 2 for r in records)


def test_validation_batches_do_not_depend_on_the_process_rows(files):
  """The validation stream is global: the rows of two processes, each keeping half of every batch, are the rows of
  one process keeping all (what makes 2 x 2 devices report the validation loss of 1 x 4), and it starts over
  identically."""
  from meshlm.train.validation import eval_dataset
  cfg = _cfg(files)
  whole = eval_dataset(cfg, global_batch=4, seq_len=48)
  halves = [eval_dataset(cfg, global_batch=4, seq_len=48, rows=np.array(r)) for r in ([0, 1], [2, 3])]
  again = eval_dataset(cfg, global_batch=4, seq_len=48)
  for _ in range(2):
    w, a, b, w2 = next(whole), next(halves[0]), next(halves[1]), next(again)
    for k in w:
      assert np.array_equal(w[k], np.concatenate([a[k], b[k]])) and np.array_equal(w[k], w2[k])


@pytest.mark.parametrize("override, detail", [
    ("data.format=chat", "data.format"), ("data.truncation=left", "data.truncation"),
    ("data.completion_only=maybe", "data.completion_only"), ("data.assistant_only=2", "data.assistant_only"),
    ("eval.every=-1", "eval.every"), ("eval.batches=0", "eval.batches"),
    ("eval.every=5", "eval.every=5 needs a validation set: set eval.path=GLOB")])
def test_new_keys_refuse_bad_values_in_one_line(override, detail):
  with pytest.raises(ConfigError) as info:
    load_config(override)
  assert detail in str(info.value) and "\n" not in str(info.value)


def test_new_keys_are_in_train_help_and_a_bad_one_exits_2(capsys, files):
  assert main(["train", "--help"]) == 0
  out = capsys.readouterr().out
  for key in ("data.format", "data.chat_template", "data.completion_only", "data.assistant_only", "data.truncation",
              "eval.path", "eval.every", "eval.batches"):
    assert key in out, key
  assert main(["train", "data.format=chat"]) == 2
  train_path = files[0]
  assert main(["train", f"data.path={train_path}", f"data.tokenizer={FIX}/tokenizer.json", "model.vocab_size=512",
               "data.chat_template=/nonexistent.jinja", f"run_dir={files[2]}/refused"]) == 2
  assert "data.chat_template=/nonexistent.jinja: cannot read it" in capsys.readouterr().err


def test_generate_chat_renders_the_conversation_with_the_template(fine_tuned, files, tmp_path, monkeypatch, capsys):
  """meshlm generate RUN chat=true: the prompt the model sees is the template's rendering of one user message with the
  generation prompt (messages=FILE: of those messages), and the reply is printed alone; without chat=true, the plain
  text (negative control). The run directory carries the template beside its tokenizer."""
  from meshlm.commands import generate as G
  from meshlm.commands.train import carry_tokenizer
  from meshlm.train.data.chat import load_chat_template
  from meshlm.train.data.tokenizers import HFTokenizer
  _, _, run_dir = fine_tuned
  carry_tokenizer(_cfg(files, f"run_dir={run_dir}"))
  with open(os.path.join(run_dir, "chat_template.jinja")) as f, open(f"{FIX}/llama3_training.jinja") as g:
    assert f.read() == g.read()
  seen = []
  monkeypatch.setattr(G, "_completion", lambda cfg, params, ids, *a: seen.append(ids) or [])
  tok = HFTokenizer(f"{FIX}/tokenizer.json")
  template = load_chat_template(f"{FIX}/llama3_training.jinja", None)
  user = [{"role": "user", "content": "What is 3 + 3?"}]
  base = [run_dir, "cpu_devices=2"]
  assert main(["generate", *base, "prompt=What is 3 + 3?", "chat=true"]) == 0
  want = tok.encode_offsets(template.render(user, add_generation_prompt=True)[0])[0].tolist()
  assert seen[-1] == want and want[-1] != tok.encode("What is 3 + 3?").tolist()[-1]
  (tmp_path / "m.json").write_text(json.dumps({"messages": user + [{"role": "assistant", "content": "6."}] + user}))
  assert main(["generate", *base, f"messages={tmp_path}/m.json"]) == 0
  two = user + [{"role": "assistant", "content": "6."}] + user
  assert seen[-1] == tok.encode_offsets(template.render(two, add_generation_prompt=True)[0])[0].tolist()
  assert main(["generate", *base, "prompt=What is 3 + 3?"]) == 0
  assert seen[-1] == tok.encode("What is 3 + 3?").tolist()
  capsys.readouterr()
  assert main(["generate", *base, "prompt_ids=1,2", "chat=true"]) == 2
  assert "chat=true renders text with the chat template" in capsys.readouterr().err


def test_meshlm_eval_of_the_run_equals_its_last_validation_loss(fine_tuned, files, capsys):
  """`meshlm eval model=RUN` evaluates the run as it validated, from its config.yaml: the assistant-only mask, the
  template, train.seq_len=48, float32, and (no eval.path given) its validation set with eval.batches=2: the loss and
  token count of its last validation, and the line says which settings came from the run. eval.path=FILE is that
  file whole, by the same rules. Control: data.assistant_only=false on the command line wins, as the old reading
  (every token) did, and gives another number over more tokens."""
  _, _, run_dir = fine_tuned
  _, val_path, _ = files
  with open(os.path.join(run_dir, "metrics.jsonl")) as f:
    last = [r for r in map(json.loads, f) if "val_loss" in r][-1]

  def evaluate(*args):
    assert main(["eval", f"model={run_dir}", "cpu_devices=2", "train.per_device_batch_size=1", *args, "--json"]) == 0
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])
  got = evaluate()
  assert (got["val_loss"], got["val_tokens"]) == (last["val_loss"], last["val_tokens"])
  run = got["from_run"]
  assert (run["data.assistant_only"], run["train.seq_len"], run["eval.path"], run["eval.batches"]) == \
      (True, 48, val_path, 2)
  whole = evaluate(f"eval.path={val_path}")
  assert whole["val_rows"] == 12 and whole["val_tokens"] > got["val_tokens"] and "eval.path" not in whole["from_run"]
  every = evaluate("eval.batches=2", f"eval.path={val_path}", "data.assistant_only=false")
  assert every["val_tokens"] > 2 * got["val_tokens"] and abs(every["val_loss"] - got["val_loss"]) > 0.1
  assert "data.assistant_only" not in every["from_run"] and every["from_run"]["train.seq_len"] == 48
  assert main(["eval", f"model={run_dir}", "cpu_devices=2", "train.per_device_batch_size=1"]) == 0
  line = capsys.readouterr().out.strip().splitlines()[-1]
  assert "as the run validated (its config.yaml; key=value overrides win): " in line
  assert "data.assistant_only=true" in line and "train.seq_len=48" in line


def _conv(user, reply=None):
  return {"messages": [{"role": "user", "content": user}] + ([{"role": "assistant", "content": reply}] if reply else [])}


GOOD = _conv("What is 1 + 1?", "It is 2.")
# Each case: (the file's rows, a raw line in their place where it is no JSON, extra keys, what the one error line says).
BAD_DATA = {
    "drop": ([{"prompt": "one, two, " * 20, "completion": "three"}] * 3, ["data.truncation=drop"],
             r"data.path=\S*drop.jsonl: data.truncation=drop dropped every one of its 3 rows"),
    "cut": ([_conv("word " * 40, "yes")] * 3, ["data.assistant_only=true"],
            r"data.path=\S*cut.jsonl: none of its 3 rows has a trained token within its first train.seq_len \+ 1"),
    "json": ([GOOD, '{"messages": [}'], [], r"\S*json.jsonl:2: not valid JSON"),
    "role": ([GOOD, {"messages": [{"role": 5, "content": "x"}]}], [],
             r"\S*role.jsonl:2: messages\[0\] must be an object with a string role"),
    "no_assistant": ([GOOD, _conv("Hi")], ["data.assistant_only=true"],
                     r"\S*no_assistant.jsonl:2: data.assistant_only=true and the conversation has no assistant tokens"),
    "template": ([GOOD, {"messages": [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]}],
                 [f"data.chat_template={FIX}/gemma3.jinja"],
                 r"\S*template.jsonl:2: the chat template \(.*gemma3.jinja\) refused the conversation: Conversation "
                 r"roles must alternate"),
    "mixed": ([GOOD, {"prompt": "a", "completion": "b"}], [],
              r"\S*mixed.jsonl:2: no field 'messages'.*; data.format=auto took conversational from \S*mixed.jsonl:1 "),
    "eval": ([GOOD] * 4, [], r"\S*eval.jsonl:2: messages\[0\] must be an object with a string role"),
    "eval_cut": ([GOOD] * 4, [], r"eval.path=\S*eval_cut.jsonl: none of its 3 rows has a trained token"),
}


def _bad_data_args(tmp_path, case):
  rows, extra, _ = BAD_DATA[case]
  path = tmp_path / f"{case}.jsonl"
  path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
  if case.startswith("eval"):  # good training rows; the validation file has a bad role on line 2, or its rows cut
    bad = [GOOD, BAD_DATA["role"][0][1]] if case == "eval" else BAD_DATA["cut"][0]
    path.write_text("".join(json.dumps(r) + "\n" for r in bad))
    extra = [f"eval.path={path}", "data.assistant_only=true"]
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
  return ["train", "model=llama2-tiny", "model.vocab_size=512", "cpu_devices=2", "train.seq_len=32",
          "train.per_device_batch_size=1", "train.steps=2", "train.sample_tokens=0", f"data.path={path}",
          f"data.tokenizer={FIX}/tokenizer.json", f"data.chat_template={FIX}/llama3_training.jinja", *extra,
          f"run_dir={tmp_path}/runs/run"]


@pytest.mark.parametrize("case", list(BAD_DATA))
def test_bad_data_stops_the_run_in_one_line_with_nothing_left_behind(tmp_path, capsys, case):
  """Each data problem meshlm train meets in the first batch or the validation set: exit 2, one error line naming the
  file (and line), no hang, and nothing left behind: the run directory it created (no config.yaml, metrics.jsonl or
  tensorboard/) is gone again, as for a data.path that matches nothing. (The module's fine-tune is the control: the
  same keys on good rows train and write their records.)"""
  from deadline import deadline
  with deadline(120):
    code = main(_bad_data_args(tmp_path, case))
  err = capsys.readouterr().err
  errors = [ln for ln in err.splitlines() if ln.startswith("meshlm: error:")]
  assert code == 2 and len(errors) == 1, err
  assert re.search(BAD_DATA[case][2], errors[0]), errors[0]
  assert not (tmp_path / "runs").exists()


def test_a_bad_validation_file_ends_the_process_on_its_one_line(tmp_path):
  """The one process of this module: an eval-file error is the process's last word (exit 2, one line, naming
  eval.path's file) and no TensorBoard writer thread left open prints a traceback at interpreter shutdown (the
  validation set is read before metrics.jsonl and tensorboard/ are made)."""
  import subprocess
  import sys
  src = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "src")
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=os.pathsep.join([src, os.environ.get("PYTHONPATH", "")]))
  proc = subprocess.run([sys.executable, "-m", "meshlm.cli", *_bad_data_args(tmp_path, "eval")], env=env,
                        capture_output=True, text=True, timeout=300, cwd=tmp_path)
  lines = [ln for ln in proc.stderr.strip().splitlines() if not ln.startswith("meshlm train ")]  # but the banner
  assert proc.returncode == 2 and len(lines) == 1, proc.stderr
  assert re.search(BAD_DATA["eval"][2], lines[0]) and "Traceback" not in proc.stderr
  assert not (tmp_path / "runs").exists()


def test_a_first_step_that_trained_no_token_is_summed_up_without_dividing_by_it(files, monkeypatch, capsys):
  """A fine-tune whose first batch had no trained token (warned, EmptyBatchWarning) has a first loss of 0: the end line
  leaves out the share of the first step's loss instead of dividing by 0 (cli.py raised ZeroDivisionError, exit 1).
  Control: a nonzero first loss keeps its share."""
  import meshlm.commands.train as CT
  import meshlm.train.loop as LP
  for losses, want in (([0.0, 1.5], "loss 0.0000 -> 1.5000 in 2 steps"),
                       ([2.0, 1.0], "loss 2.0000 -> 1.0000 (50% of the first step) in 2 steps")):
    monkeypatch.setattr(LP, "train", lambda cfg, **kw: LP.TrainResult(losses, [1.0, 1.0], None, None, 0.1,
                                                                        run_dir=cfg.run_dir))
    monkeypatch.setattr(CT, "carry_tokenizer", lambda cfg: None)
    assert main(["train", "cpu_devices=2", f"run_dir={files[2]}/summed"]) == 0
    assert want in capsys.readouterr().err  # the console is on stderr
