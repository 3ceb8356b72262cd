"""Replay captured programs' XLA compiles under this process's XLA_FLAGS / jax config."""
import resource, glob, os, pickle, sys, time, json
import numpy as np
import jax
from jax._src import compiler
from jax._src.interpreters import mlir
from jax._src.lib.mlir import ir
from jax._src.lib import xla_client as xc

d = sys.argv[1]
limit = int(sys.argv[2]) if len(sys.argv) > 2 else 10**9
for kv in os.environ.get("JAXCFG", "").split(","):
  if kv:
    k, v = kv.split("=")
    jax.config.update(k, {"True": True, "False": False}.get(v, v))
backend = jax.devices()[0].client
devs = {x.id: x for x in jax.devices()}
jax.jit(lambda x: x + 1)(np.float32(1)).block_until_ready()  # warm up
files = sorted(glob.glob(os.path.join(d, "*.pkl")))[:limit]
cpu = 0.0; tot = 0.0; mism = 0; per = []
for fn in files:
  rec = pickle.load(open(fn, "rb"))
  ctx = mlir.make_ir_context()
  with ctx:
    module = ir.Module.parse(rec["bytecode"])
  ndev = len(rec["devices"])
  da = np.array(rec["devices"]).reshape(rec["num_replicas"], rec["num_partitions"])
  opts = compiler.get_compile_options(rec["num_replicas"], rec["num_partitions"], da,
                                      env_options_overrides=dict(rec["env"]) or None, backend=backend)
  opts.parameter_is_tupled_arguments = rec["tupled"]
  opts.executable_build_options.allow_spmd_sharding_propagation_to_parameters = rec["prop_in"]
  opts.executable_build_options.allow_spmd_sharding_propagation_to_output = rec["prop_out"]
  opts.executable_build_options.debug_options.xla_detailed_logging = rec["detailed"]
  if os.environ.get("CHECK") and opts.SerializeAsString() != rec["options"]:
    mism += 1
  exdevs = xc.DeviceList(tuple(devs[i] for i in rec["devices"]))
  ru = resource.getrusage(resource.RUSAGE_SELF); c0 = ru.ru_utime + ru.ru_stime
  t = time.perf_counter()
  exe = compiler.backend_compile_and_load(backend, module, exdevs, opts, [])
  dt = time.perf_counter() - t
  ru = resource.getrusage(resource.RUSAGE_SELF); cpu += ru.ru_utime + ru.ru_stime - c0
  tot += dt; per.append(dt)
  del exe
print(json.dumps(dict(n=len(files), wall=round(tot, 2), cpu=round(cpu, 2), mismatched_options=mism,
                      top=[round(x, 2) for x in sorted(per)[-5:]])))
