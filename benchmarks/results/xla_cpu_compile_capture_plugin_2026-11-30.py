"""pytest plugin: time each backend compile per test, optionally save the programs for replay."""
import os, time, json, pickle, io, collections
import jax
from jax import monitoring

SAVE = os.environ.get("CAPTURE_DIR")
STATS = collections.defaultdict(lambda: collections.defaultdict(float))
CUR = ["<none>"]
N = [0]

def _listener(event, duration, **kw):
  STATS[CUR[0]][event] += duration
monitoring.register_event_duration_secs_listener(_listener)

def pytest_collection_finish(session):
  import shared_executables
  orig = shared_executables._compile
  def timed(backend, module, executable_devices, options, host_callbacks):
    t = time.perf_counter()
    r = orig(backend, module, executable_devices, options, host_callbacks)
    dt = time.perf_counter() - t
    STATS[CUR[0]]["xla_compile"] += dt
    STATS[CUR[0]]["n_compiles"] += 1
    if SAVE and not host_callbacks:
      os.makedirs(SAVE, exist_ok=True)
      bc = io.BytesIO(); module.operation.write_bytecode(file=bc)
      bo = options.executable_build_options
      da = options.device_assignment
      rec = dict(test=CUR[0], seconds=dt, bytecode=bc.getvalue(),
                 options=options.SerializeAsString(),
                 devices=[d.id for d in executable_devices],
                 num_replicas=options.num_replicas, num_partitions=options.num_partitions,
                 env=list(options.env_option_overrides),
                 shardy=bo.use_shardy_partitioner,
                 tupled=options.parameter_is_tupled_arguments,
                 prop_in=list(bo.allow_spmd_sharding_propagation_to_parameters),
                 prop_out=list(bo.allow_spmd_sharding_propagation_to_output),
                 detailed=bo.debug_options.xla_detailed_logging)
      with open(os.path.join(SAVE, f"{N[0]:05d}.pkl"), "wb") as f:
        pickle.dump(rec, f)
      N[0] += 1
    return r
  shared_executables._compile = timed

def pytest_runtest_logstart(nodeid, location):
  CUR[0] = nodeid

def pytest_sessionfinish(session):
  out = os.environ.get("STATS_OUT", "/tmp/xlabench/stats.json")
  with open(out, "w") as f:
    json.dump({k: dict(v) for k, v in STATS.items()}, f, indent=1)
  tot = collections.defaultdict(float)
  for v in STATS.values():
    for k, x in v.items(): tot[k] += x
  print("\nCAPTURE TOTALS:", {k: round(v, 1) for k, v in sorted(tot.items())})
