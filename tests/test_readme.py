"""The README's Python lines work as written: every ```python block, in order, as one fresh script."""
import os
import re
import subprocess
import sys
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"
FENCE = re.compile(r"^```python\n(.*?)^```", re.S | re.M)


def python_blocks(text: str) -> list[str]:
  return FENCE.findall(text)


def test_block_extraction_finds_each_python_block_and_nothing_else():
  text = "a\n```python\nx = 1\n```\n```\nshell only\n```\n```python\ny = x\n```\n"
  assert python_blocks(text) == ["x = 1\n", "y = x\n"]


def test_every_python_block_of_the_readme_runs(tmp_path):
  blocks = python_blocks(README.read_text())
  assert len(blocks) >= 2, "the README's Python API section should hold Python blocks"
  script = tmp_path / "readme_blocks.py"
  script.write_text("\n".join(blocks))
  # A fresh interpreter: in this process other tests have imported meshlm.hf already, which would
  # hide an `import meshlm` that does not reach meshlm.hf. The cwd is a scratch dir for its files.
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  p = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
                     timeout=300)
  assert p.returncode == 0, p.stderr[-3000:]


def test_import_meshlm_reaches_hf_lazily():
  code = ("import sys, meshlm\n"
          "assert 'meshlm.hf' not in sys.modules  # import meshlm stays cheap\n"
          "assert callable(meshlm.hf.load) and callable(meshlm.hf.save)\n"
          "assert 'hf' in dir(meshlm)\n"
          "try:\n  meshlm.no_such_name\nexcept AttributeError as e:\n  print(e)\n")
  p = subprocess.run([sys.executable, "-c", code], env=dict(os.environ, JAX_PLATFORMS="cpu"),
                     capture_output=True, text=True, timeout=600)
  assert p.returncode == 0, p.stderr[-3000:]
  assert "no attribute 'no_such_name'" in p.stdout


# The front pages stay short (issues 32 and 47): what meshlm is and links in the README, the map in
# docs/architecture.md, current figures in docs/performance.md; detail goes to docs/ pages and module docstrings,
# history to docs/performance-log.md.
LINE_LIMITS = {"README.md": 250, "docs/architecture.md": 250, "docs/performance.md": 300}


def too_long(root: Path, limits: dict[str, int]) -> list[str]:
  return [f"{name}: {n} lines (at most {limit})" for name, limit in limits.items()
          if (n := len((root / name).read_text().splitlines())) > limit]


def test_the_readme_and_the_performance_page_stay_short(tmp_path):
  assert too_long(README.parent, LINE_LIMITS) == []
  (tmp_path / "long.md").write_text("x\n" * 11)  # control: one line over its limit is named
  assert too_long(tmp_path, {"long.md": 10}) == ["long.md: 11 lines (at most 10)"]
  (tmp_path / "docs").mkdir()  # control: each page's limit is its own, so a page at 251 lines is named
  (tmp_path / "README.md").write_text("x\n" * 250)
  (tmp_path / "docs" / "architecture.md").write_text("x\n" * 251)
  (tmp_path / "docs" / "performance.md").write_text("x\n" * 300)
  assert too_long(tmp_path, LINE_LIMITS) == ["docs/architecture.md: 251 lines (at most 250)"]


# Every relative link of the README and docs/*.md resolves: the file exists, and a #anchor names a heading of the
# target page by GitHub's rule (the heading's text lower-cased, punctuation but - and _ dropped, spaces to -; a
# repeated heading gets -1, -2, ...). Links inside code (fenced or inline) are not links.
PAGES = [README, *sorted((README.parent / "docs").glob("*.md"))]
CODE = re.compile(r"^```.*?^```|`[^`\n]*`", re.S | re.M)
LINK = re.compile(r"\[[^\]]*\]\(([^()\s]+)\)")
HEADING = re.compile(r"^#{1,6}\s+(.*?)\s*#*\s*$", re.M)


def anchors(text: str) -> set[str]:
  """The #anchors GitHub gives a page's headings."""
  seen: dict[str, int] = {}
  out = set()
  for title in HEADING.findall(re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)):
    title = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", title)  # a link in a heading: its text
    slug = re.sub(r"[^\w\- ]", "", title.lower()).replace(" ", "-")
    n = seen.get(slug, 0)
    seen[slug] = n + 1
    out.add(slug if n == 0 else f"{slug}-{n}")
  return out


def broken_links(pages: list[Path]) -> list[str]:
  """'page: target (why)' for each relative link that does not resolve."""
  bad = []
  for page in pages:
    for target in LINK.findall(CODE.sub("", page.read_text())):
      if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto: ...: not a file of the tree
        continue
      path, _, anchor = target.partition("#")
      dest = (page.parent / path).resolve() if path else page
      if not dest.exists():
        bad.append(f"{page.name}: {target} (no such file)")
      elif anchor and dest.suffix == ".md" and anchor not in anchors(dest.read_text()):
        bad.append(f"{page.name}: {target} (no such heading)")
  return bad


def test_the_slug_rule_is_githubs():
  text = "# The MoE layer under a mesh\n## Under `mesh.context` > 1 (training)\n## Moved from architecture.md (issue 47)\n" \
         "## Notes\n## Notes\n```\n# not a heading\n```\n"
  assert anchors(text) == {"the-moe-layer-under-a-mesh", "under-meshcontext--1-training",
                           "moved-from-architecturemd-issue-47", "notes", "notes-1"}


def test_every_relative_link_of_the_readme_and_docs_resolves():
  assert broken_links(PAGES) == []


def test_a_broken_link_or_anchor_is_named(tmp_path):
  (tmp_path / "b.md").write_text("# Real heading\n")
  a = tmp_path / "a.md"
  a.write_text("[ok](b.md) [ok](b.md#real-heading) [ok](#top) [web](https://example.com/x.md) `[code](gone.md)`\n"
               "# Top\n[gone](gone.md) [bad anchor](b.md#no-heading) ![img](missing.png)\n")
  assert broken_links([a]) == ["a.md: gone.md (no such file)", "a.md: b.md#no-heading (no such heading)",
                               "a.md: missing.png (no such file)"]


# The README's sentence on what `auto` picks is written from the code: nn/attention.resolve_impl per platform and
# models/logprobs.BLOCKWISE_FROM (issue 62: it said "flash on GPU/TPU" after TPU moved to splash).
def auto_sentence(resolve) -> str:
  """The sentence `resolve` (resolve_impl's signature) makes true, as the README words it."""
  from meshlm.models.logprobs import BLOCKWISE_FROM
  from meshlm.nn.attention import CPU_FLASH_FROM
  tpu, tpu_split, gpu = resolve("auto", 2048, "tpu"), resolve("auto", 2048, "tpu", 2), resolve("auto", 2048, "gpu")
  cpu_long, cpu_short = resolve("auto", CPU_FLASH_FROM, "cpu"), resolve("auto", CPU_FLASH_FROM - 1, "cpu")
  gpu_cpu = f"{gpu} on GPU and on CPU" if gpu == cpu_long else f"{gpu} on GPU and {cpu_long} on CPU"
  return (f"`auto` picks {tpu} on TPU ({tpu_split} with `mesh.context` > 1), {gpu_cpu} from a measured length up "
          f"({cpu_short} below), blockwise from 2^{BLOCKWISE_FROM.bit_length() - 1} logits per micro-batch")


def test_the_readme_says_what_attention_auto_picks():
  from meshlm.nn.attention import resolve_impl
  readme = " ".join(README.read_text().split())
  assert auto_sentence(resolve_impl) in readme
  # Controls: a resolve_impl that picked flash on TPU (the README's old claim) makes another sentence, not in it.
  flash_on_tpu = lambda impl, T, platform, context=1: resolve_impl(impl, T, "gpu" if platform == "tpu" else platform,
                                                                  context)
  assert auto_sentence(flash_on_tpu) not in readme
