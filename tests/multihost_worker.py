"""One process of the two-process test: 4 CPU devices each, one 8-device mesh (2, 2, 2)."""

import json
import os
import sys

import jax

jax.config.update("jax_default_matmul_precision", "highest")
os.environ.setdefault("JSPEC_PROGRESS", "0")

import jspec  # noqa: E402
import jspec.distributed  # noqa: E402

port, process_id = int(sys.argv[1]), int(sys.argv[2])
jspec.distributed.initialize(f"localhost:{port}", num_processes=2, process_id=process_id)
assert jax.device_count() == 8 and jax.local_device_count() == 4
llm = jspec.LLM(model=os.path.join(os.path.dirname(__file__), "fixtures", "qwen3_moe"),
                mesh=jspec.MeshConfig(dp=2, tp=2, ep=2), dtype="float32", max_model_len=64,
                speculative_config={"method": "mtp", "num_speculative_tokens": 2})
prompts = [[5, 6, 7, 8, 9], [1, 2], [7, 8, 7, 8, 7, 8], [100, 3, 44, 9]]
outs = llm.generate(prompts, jspec.SamplingParams(temperature=0.0, max_tokens=10,
                                                   ignore_eos=True))
print(json.dumps([o.token_ids for o in outs]))
