"""Per test: JAX compile / trace / lower seconds and counts, and wall time (setup+call+teardown)."""
import collections, os, time
from jax import monitoring
CUR = {"id": None}
ROW = collections.defaultdict(lambda: collections.Counter())
T0 = {}
KEYS = {"/jax/core/compile/backend_compile_duration": "compile",
        "/jax/core/compile/jaxpr_trace_duration": "trace",
        "/jax/core/compile/jaxpr_to_mlir_module_duration": "lower"}
def _listen(event, duration, **kw):
  k = KEYS.get(event)
  if k and CUR["id"]:
    ROW[CUR["id"]][k] += duration; ROW[CUR["id"]][k + "_n"] += 1
monitoring.register_event_duration_secs_listener(_listen)
def pytest_runtest_logstart(nodeid, location):
  CUR["id"] = nodeid; T0[nodeid] = time.perf_counter()
def pytest_runtest_logfinish(nodeid, location):
  r = ROW[nodeid]; wall = time.perf_counter() - T0.get(nodeid, time.perf_counter())
  with open(f"/tmp/timing_{os.getpid()}.tsv", "a") as f:
    f.write(f"{wall:.2f}\t{r['compile']:.2f}\t{int(r['compile_n'])}\t{r['trace']:.2f}\t{r['lower']:.2f}\t{nodeid}\n")
  CUR["id"] = None
