"""vLLM's `LLM(...)` keywords that jspec spells otherwise: mapped where the meaning is the
same, refused with jspec's spelling where it is not, and any other unknown keyword refused
with the nearest jspec option, before anything is loaded."""

from __future__ import annotations

import difflib

from jspec.sharding.rules import MeshConfig

# vLLM keyword -> MeshConfig field: the same split of the same devices.
MESH_KEYWORDS = {"tensor_parallel_size": "tp", "data_parallel_size": "dp"}

# vLLM keyword -> how jspec says it (not the same meaning, so not mapped silently).
JSPEC_SPELLING = {
    "enable_expert_parallel": "mesh=jspec.MeshConfig(ep=N): experts (and sequences) split over "
                              "N devices",
    "gpu_memory_utilization": "device_memory_bytes=<bytes per device for weights and caches>; "
                              "max_num_seqs='auto' then fits the caches to it",
    "pipeline_parallel_size": "nothing: jspec has no pipeline parallelism; use "
                              "mesh=jspec.MeshConfig(tp=N)",
    "quantization": "nothing: FP8 checkpoints are read as published (their config's "
                    "quantization_config)",
    "enforce_eager": "nothing: jspec always compiles its fixed-shape loop",
    "trust_remote_code": "nothing: jspec builds its own modules for the architectures it lists",
    "tokenizer": "nothing: the tokenizer is read from the model directory",
}


def mesh_from_vllm(mesh: MeshConfig | None, options: dict, known: list[str]) -> MeshConfig | None:
  """The mesh `LLM` uses given vLLM's parallel sizes among `options` (the keywords LLM did
  not recognise); refuses a size given beside `mesh`, a keyword whose meaning differs
  (naming jspec's spelling), and anything else unknown (naming the nearest of `known`)."""
  sizes = {}
  for name, value in options.items():
    if name in MESH_KEYWORDS:
      if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name}={value!r} must be an integer >= 1")
      sizes[MESH_KEYWORDS[name]] = value
    elif name in JSPEC_SPELLING:
      raise ValueError(f"{name} is vLLM's option; jspec's spelling: {JSPEC_SPELLING[name]}")
    else:
      near = difflib.get_close_matches(name, known + list(MESH_KEYWORDS), n=1)
      hint = f"; did you mean {near[0]!r}?" if near else ""
      raise ValueError(f"LLM got an unknown option {name!r}{hint}")
  if not sizes:
    return mesh
  if mesh is not None:
    given = ", ".join(f"{k}={v}" for k, v in options.items() if k in MESH_KEYWORDS)
    raise ValueError(f"{given} and mesh={mesh!r} both say how to split the model: pass one "
                     f"(mesh=jspec.MeshConfig(...) is jspec's spelling)")
  return MeshConfig(**sizes)
