"""Multi-host: every process runs the same program over one global mesh.

Call `jspec.distributed.initialize(...)` in every process before creating an `LLM`; then
`MeshConfig(dp, tp, ep)` takes the first dp*tp*ep of `jax.devices()` — the devices of all
processes, process by process; the mesh must reach every process — and each process passes
the same prompts to `generate` and receives the same outputs.
"""

from __future__ import annotations

import jax


def initialize(coordinator_address: str | None = None, num_processes: int | None = None,
               process_id: int | None = None, local_device_ids=None, **kwargs):
  """Wraps `jax.distributed.initialize` (arguments may come from the cluster environment).

  On CPU the cross-process collectives go through gloo, which JAX needs to be told to use.
  """
  if jax.config.jax_platforms in (None, "", "cpu") or "cpu" in str(jax.config.jax_platforms):
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.distributed.initialize(coordinator_address=coordinator_address,
                             num_processes=num_processes, process_id=process_id,
                             local_device_ids=local_device_ids, **kwargs)
  return jax.process_index(), jax.process_count()


def is_coordinator() -> bool:
  """True in exactly one process: print or write results there."""
  return jax.process_index() == 0
