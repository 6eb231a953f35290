"""Where the suite's time goes, per test: CPU seconds and every XLA compile. Off unless MESHLM_TEST_COMPILE_LOG
names a directory (tests/conftest.py then loads this as a plugin):

  MESHLM_TEST_COMPILE_LOG=/tmp/clog python -m pytest -n 0 tests/test_X.py   # one JSON line per test per process
  python tests/compile_log.py /tmp/clog [--top N]                             # per file, per test, shared programs

Each line: the test's node id, the CPU seconds of the process (user + sys) and of its waited-for children over the
test (setup + call + teardown), its wall seconds, jax's trace / lower seconds (jax.monitoring's duration events),
and each program that went to XLA: its module name, the persistent-cache key (the program with debug info
stripped, its compile options and devices: the same program in two files has one key), whether it was read from
the persistent cache, and the compile's wall and process-CPU seconds. Subprocesses (`meshlm train` runs) count
only as the children's CPU seconds.

The report sums per file, lists the heaviest tests, and lists the programs built in more than one file (by key):
whichever file builds one second reads it from the shared cache if its compile took at least 1 s, and compiles it
again if it took less (tests/conftest.py's jax_persistent_cache_min_compile_time_secs); either way it traces and
lowers it again.
"""
from __future__ import annotations

import collections
import json
import os
import resource
import sys
import time

ENV = "MESHLM_TEST_COMPILE_LOG"


def _cpu() -> tuple[float, float]:
  s, c = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
  return s.ru_utime + s.ru_stime, c.ru_utime + c.ru_stime


def _signature(computation) -> str:
  """A short hash of the program's main function type (its argument and result shapes, dtypes and shardings): two
  programs with one signature but two keys take the same inputs and differ inside (another setting)."""
  import hashlib
  for op in computation.body.operations:
    if "sym_name" in op.attributes and str(op.attributes["sym_name"]) == '"main"':
      return hashlib.sha1(str(op.attributes["function_type"]).encode()).hexdigest()[:10]
  return ""


class Recorder:
  """The pytest plugin: wraps jax's compile_or_get_cached and listens to jax.monitoring's durations."""

  def __init__(self, out_dir: str):
    os.makedirs(out_dir, exist_ok=True)
    self.path = os.path.join(out_dir, f"{os.getpid()}.jsonl")
    self.compiles: list[dict] = []
    self.durations: collections.Counter = collections.Counter()
    self._install()

  def _install(self):
    from jax._src import compiler, monitoring
    real_compile, real_resolve = compiler.backend_compile_and_load, compiler._resolve_compilation_strategy
    real_cached = compiler.compile_or_get_cached
    rec = self
    pending: list[dict] = []

    def resolve(computation, *a, **kw):
      key, options = real_resolve(computation, *a, **kw)
      if pending:
        pending[-1]["key"] = key
      return key, options

    def backend_compile(*a, **kw):
      t, c = time.perf_counter(), time.process_time()
      try:
        return real_compile(*a, **kw)
      finally:
        if pending:
          pending[-1].update(hit=False, compile_s=round(time.perf_counter() - t, 3),
                             compile_cpu_s=round(time.process_time() - c, 3))

    def cached(backend, computation, *a, **kw):
      from jax._src.interpreters import mlir
      name = mlir.ir.StringAttr(computation.operation.attributes["sym_name"]).value
      pending.append({"module": name, "sig": _signature(computation), "key": None, "hit": True, "compile_s": 0.0, "compile_cpu_s": 0.0})
      t = time.perf_counter()
      try:
        return real_cached(backend, computation, *a, **kw)
      finally:
        entry = pending.pop()
        entry["total_s"] = round(time.perf_counter() - t, 3)
        if entry["key"] is None:
          entry["hit"] = False
        rec.compiles.append(entry)

    compiler._resolve_compilation_strategy = resolve
    compiler.backend_compile_and_load = backend_compile
    compiler.compile_or_get_cached = cached
    # pxla imports compile_or_get_cached by module attribute (compiler.compile_or_get_cached), so the patch holds.

    def duration(event, secs, **_):
      if event.startswith("/jax/core/compile/"):
        rec.durations[event.rsplit("/", 1)[-1].removesuffix("_duration")] += secs
    monitoring.register_event_duration_secs_listener(duration)

  def pytest_runtest_logstart(self, nodeid, location):
    self.compiles.clear()
    self.durations.clear()
    self._start = (_cpu(), time.perf_counter())

  def pytest_runtest_logfinish(self, nodeid, location):
    (s0, c0), w0 = self._start
    s1, c1 = _cpu()
    line = {"test": nodeid, "cpu_s": round(s1 - s0, 3), "children_cpu_s": round(c1 - c0, 3),
            "wall_s": round(time.perf_counter() - w0, 3), "pid": os.getpid(),
            **{k: round(v, 3) for k, v in self.durations.items()}, "compiles": list(self.compiles)}
    with open(self.path, "a") as f:
      f.write(json.dumps(line) + "\n")


def register(config) -> None:
  """In each process that runs tests: an xdist worker, or the one process of -n 0 (not xdist's controller, which
  sees every test's log hooks too)."""
  controller = getattr(config.option, "numprocesses", None) and not hasattr(config, "workerinput")
  if os.environ.get(ENV) and not controller:
    config.pluginmanager.register(Recorder(os.environ[ENV]), "meshlm_compile_log")


# --- the report ---------------------------------------------------------------------------------------------

def load(out_dir: str) -> list[dict]:
  rows = []
  for name in sorted(os.listdir(out_dir)):
    if name.endswith(".jsonl"):
      rows += [json.loads(line) for line in open(os.path.join(out_dir, name))]
  return rows


def report(out_dir: str, top: int = 40) -> str:
  rows = load(out_dir)
  per_file = collections.defaultdict(lambda: collections.Counter())
  programs = collections.defaultdict(list)  # key -> [(file, test, compile_cpu_s, hit, module)]
  signatures = collections.defaultdict(list)  # (module, signature) -> [(file, key, compile_cpu_s)] compiled
  for r in rows:
    f = r["test"].split("::")[0]
    c = per_file[f]
    c["tests"] += 1
    c["cpu_s"] += r["cpu_s"] + r["children_cpu_s"]
    c["children_cpu_s"] += r["children_cpu_s"]
    for k in ("jaxpr_trace", "jaxpr_to_mlir_module"):
      c[k] += r.get(k, 0.0)
    for p in r["compiles"]:
      if p["hit"]:
        c["hits"] += 1
      else:
        c["compiles"] += 1
        c["compile_cpu_s"] += p["compile_cpu_s"]
        c["compile_s"] += p["compile_s"]
        if p["compile_s"] >= 1.0:
          c["compiles_1s"] += 1
      if p["key"]:
        programs[p["key"]].append((f, r["test"], p["compile_cpu_s"], p["hit"], p["module"]))
      if p.get("sig") and not p["hit"]:
        signatures[(p["module"], p["sig"])].append((f, p["key"], p["compile_cpu_s"]))
  out = ["| file | tests | CPU s (children) | compiles (>= 1 s) | compile CPU s | compile wall s | cache hits | "
         "trace s | lower s |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
  total = collections.Counter()
  for f, c in sorted(per_file.items(), key=lambda kv: -kv[1]["cpu_s"]):
    total.update(c)
    out.append(f"| {f} | {c['tests']} | {c['cpu_s']:.1f} ({c['children_cpu_s']:.1f}) | {c['compiles']} "
               f"({c['compiles_1s']}) | {c['compile_cpu_s']:.1f} | {c['compile_s']:.1f} | {c['hits']} | "
               f"{c['jaxpr_trace']:.1f} | {c['jaxpr_to_mlir_module']:.1f} |")
  c = total
  out.append(f"| all | {c['tests']} | {c['cpu_s']:.1f} ({c['children_cpu_s']:.1f}) | {c['compiles']} "
             f"({c['compiles_1s']}) | {c['compile_cpu_s']:.1f} | {c['compile_s']:.1f} | {c['hits']} | "
             f"{c['jaxpr_trace']:.1f} | {c['jaxpr_to_mlir_module']:.1f} |")
  out += ["", "| test | CPU s | compiles | compile CPU s |", "| --- | --- | --- | --- |"]
  for r in sorted(rows, key=lambda r: -(r["cpu_s"] + r["children_cpu_s"]))[:top]:
    built = [p for p in r["compiles"] if not p["hit"]]
    out.append(f"| {r['test']} | {r['cpu_s'] + r['children_cpu_s']:.1f} | {len(built)} | "
               f"{sum(p['compile_cpu_s'] for p in built):.1f} |")
  shared = [(k, v) for k, v in programs.items() if len({f for f, *_ in v}) > 1]
  shared.sort(key=lambda kv: -sum(cpu for _, _, cpu, hit, _ in kv[1]))
  out += ["", f"Programs built in more than one file: {len(shared)} (compiled again: "
          f"{sum(sum(1 for *_, hit, _ in v if not hit) - 1 for _, v in shared)} times, "
          f"{sum(sum(cpu for _, _, cpu, hit, _ in v if not hit) - max(cpu for _, _, cpu, _, _ in v) for _, v in shared):.1f}"
          " s CPU; read from the cache: "
          f"{sum(sum(1 for *_, hit, _ in v if hit) for _, v in shared)} times)", "",
          "| module | key | files (compiled / read) | compile CPU s each |", "| --- | --- | --- | --- |"]
  for k, v in shared[:top]:
    files = collections.defaultdict(lambda: [0, 0])
    for f, _, _, hit, _ in v:
      files[f][hit] += 1
    cpu = max(c for _, _, c, _, _ in v)
    out.append(f"| {v[0][4]} | {k[-10:]} | " + ", ".join(f"{f.removeprefix('tests/')} ({a}/{b})"
                                                          for f, (a, b) in files.items()) + f" | {cpu:.1f} |")
  alike = [(k, v) for k, v in signatures.items() if len({f for f, _, _ in v}) > 1 and len({key for _, key, _ in v}) > 1
           and max(c for *_, c in v) >= 0.5]
  alike.sort(key=lambda kv: -sum(c for *_, c in kv[1]))
  out += ["", f"Programs of one signature (inputs and outputs) compiled as several programs in several files: "
          f"{len(alike)}", "", "| module | signature | programs | files (compiles) | compile CPU s in all |",
          "| --- | --- | --- | --- | --- |"]
  for (module, sig), v in alike[:top]:
    files = collections.Counter(f.removeprefix("tests/") for f, _, _ in v)
    out.append(f"| {module} | {sig} | {len({key for _, key, _ in v})} | "
               + ", ".join(f"{f} ({n})" for f, n in files.items()) + f" | {sum(c for *_, c in v):.1f} |")
  return "\n".join(out)


if __name__ == "__main__":
  args = sys.argv[1:]
  top = int(args[args.index("--top") + 1]) if "--top" in args else 40
  print(report(args[0], top))
