"""The expert shard_map's collectives through the workspace kernel (jspec.sharding.moe,
`custom_all_reduce`): the tp sum, the ep all-gather as a sum of int32 words in slots of their
own, the ep reduce-scatter as an all-reduce of which each shard keeps its rows.

On the CPU the kernel's sum is stood in by psum over the same axis (no interpreter runs raw
Mosaic GPU), so what is checked is the rest: the slots, the packing, the slicing, the specs of
the address rows, against XLA's own collectives; and the lowering for CUDA, which must hold the
kernel's calls and none of XLA's collectives. The kernel's int32 sums run on 2 GPUs (`gpu`)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jspec.bench.collectives import collectives, counts
from jspec.models.moe_backends import experts_reference
from jspec.pallas_kernels import platform, workspace_all_reduce as wsar
from jspec.sharding import moe
from jspec.sharding.rules import MeshConfig, ShardingRules
from moe_helpers import expert_problem

MESHES = [(1, 1, 2), (1, 1, 4), (2, 1, 2), (1, 2, 2), (1, 2, 1), (1, 4, 2)]  # dp, tp, ep


def _with_workspace(monkeypatch, mesh, custom):
  """sharded_experts built with Hopper patched in (so the address rows exist), run on XLA's
  einsum backend with psum standing in for the kernel's sum."""
  monkeypatch.setattr(moe.Collectives, "_kernel_sum",
                      lambda self, axis, x: jax.lax.psum(x, axis))
  with monkeypatch.context() as hopper:
    hopper.setattr(platform, "on_hopper", lambda: True)
    return moe.sharded_experts(experts_reference, mesh, ShardingRules(),
                               custom_all_reduce=custom)


@pytest.mark.parametrize("dp, tp, ep", MESHES)
@pytest.mark.parametrize("tokens_per_shard", [1, 4])
def test_the_kernel_collectives_give_xlas_sums(monkeypatch, dp, tp, ep, tokens_per_shard):
  """Same outputs as XLA's all-gather / reduce-scatter / psum, and no all-gather or
  reduce-scatter left in the program."""
  mesh = MeshConfig(dp=dp, tp=tp, ep=ep).make_mesh()
  tokens = tokens_per_shard * dp * ep
  x, ids, weights, wg, wu, wd = expert_problem(dp * 100 + tp * 10 + ep + tokens, tokens,
                                               num_experts=4 * ep, top_k=2, dim=64, ffn=32 * tp,
                                               dtype=jnp.float32)
  ids = ids.at[0, 0].set(-1)  # a dropped slot
  custom = jax.jit(_with_workspace(monkeypatch, mesh, True))
  plain = jax.jit(moe.sharded_experts(experts_reference, mesh, ShardingRules()))
  got, want = custom(x, ids, weights, wg, wu, wd), plain(x, ids, weights, wg, wu, wd)
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-6)
  np.testing.assert_allclose(np.asarray(got),
                             np.asarray(experts_reference(x, ids, weights, wg, wu, wd)),
                             rtol=1e-4, atol=1e-5)
  found = counts(collectives(custom.lower(x, ids, weights, wg, wu, wd).compile().as_text()))
  assert "all-gather" not in found and "reduce-scatter" not in found, found


def test_without_the_kernel_option_the_collectives_stay_xlas(monkeypatch):
  mesh = MeshConfig(ep=2).make_mesh()
  fn = jax.jit(_with_workspace(monkeypatch, mesh, False))
  args = expert_problem(3, 4, num_experts=8, top_k=2, dim=64, ffn=32, dtype=jnp.float32)
  found = counts(collectives(fn.lower(*args).compile().as_text()))
  assert found == {"all-gather": 1, "reduce-scatter": 1}, found


def test_the_kernel_collectives_lower_to_the_workspace_kernel_for_cuda(monkeypatch):
  """ep = 2 x tp = 2, Hopper patched in, lowered for CUDA without a GPU: the all-gather, the
  tp sum and the reduce-scatter are the kernel's calls; a message past its 256 KB keeps XLA's."""
  from jax.experimental.mosaic.gpu import utils as mosaic_utils
  monkeypatch.setattr(mosaic_utils, "_infer_arch", lambda: (9, 0))
  monkeypatch.setattr(platform, "on_hopper", lambda: True)
  mesh = MeshConfig(tp=2, ep=2).make_mesh()
  fn = moe.sharded_experts(experts_reference, mesh, ShardingRules(), custom_all_reduce=True)
  rules = ShardingRules()
  for tokens, kernel in [(2, True), (512, False)]:
    args = [jax.ShapeDtypeStruct(s, d, sharding=NamedSharding(mesh, spec)) for s, d, spec in [
        ((tokens, 2048), jnp.bfloat16, rules.spec(("batch", None))),
        ((tokens, 8), jnp.int32, rules.spec(("batch", None))),
        ((tokens, 8), jnp.float32, rules.spec(("batch", None))),
        ((8, 2048, 256), jnp.bfloat16, rules.spec(("experts", "embed", "moe_mlp"))),
        ((8, 2048, 256), jnp.bfloat16, rules.spec(("experts", "embed", "moe_mlp"))),
        ((8, 256, 2048), jnp.bfloat16, rules.spec(("experts", "moe_mlp", "embed")))]]
    text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert ("workspace_all_reduce" in text) == kernel
    for op in ("stablehlo.all_gather", "stablehlo.reduce_scatter", "stablehlo.all_reduce"):
      assert (op in text) != kernel, (tokens, op)


def test_the_kernel_takes_int32_words():
  assert wsar.fits((1024,), jnp.int32) and wsar.fits((2, 8, 64), jnp.int32)
  assert not wsar.fits((1000,), jnp.int32)


@pytest.mark.gpu
def test_gpu_int32_sums_are_exact_and_gather_words_bit_for_bit():
  """On 2 GPUs: the kernel's int32 sum wraps as integers do, and words written into slots of
  their own come back on both devices bit for bit (NaN, denormal and all-ones patterns
  included)."""
  gpus = [d for d in jax.devices() if d.platform == "gpu"]
  if len(gpus) < 2:
    pytest.skip("needs 2 GPUs")
  mesh = Mesh(np.asarray(gpus[:2]), ("ep",))
  workspace = wsar.workspace_for(mesh, "ep")
  rng = np.random.default_rng(0)
  words = rng.integers(0, 2**32, (2, 16, 64), dtype=np.uint64).astype(np.uint32)
  words[0, 0, :4] = [0x7FC00001, 0x00000001, 0x80000000, 0xFFFFFFFF]

  def body(w, row):
    c = moe.Collectives({"ep": row.reshape(-1)})
    return c.gather_words(w[0])[None]
  fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("ep"), workspace.row_spec),
                             out_specs=P("ep"), check_vma=False))
  got = np.asarray(fn(jax.device_put(words, NamedSharding(mesh, P("ep"))), workspace.rows))
  want = words.reshape(32, 64).copy()
  for device in range(2):
    np.testing.assert_array_equal(got[device], want)
  assert all(not f.any() for f in workspace.flags().values())
  assert all(workspace.lamport_idle().values())


@pytest.mark.gpu
@pytest.mark.parametrize("mesh", [MeshConfig(ep=2), MeshConfig(tp=2)])
def test_gpu_moe_model_with_the_kernel_collectives_keeps_xlas_tokens(mesh):
  """A float32 MoE fixture on 2 GPUs: all_reduce_backend="kernel" (the MoE layers'
  collectives through the kernel) emits the tokens of "xla"."""
  import jspec
  from helpers import fixture_dir, greedy
  if sum(d.platform == "gpu" for d in jax.devices()) < 2:
    pytest.skip("needs 2 GPUs")
  prompts = [[5, 6, 7, 8, 9], [1, 2]]
  kwargs = dict(model=fixture_dir("qwen3_moe"), dtype="float32", max_model_len=64,
                max_num_seqs=2, mesh=mesh)
  xla = jspec.LLM(all_reduce_backend="xla", **kwargs).generate(prompts, greedy(8))
  kernel = jspec.LLM(all_reduce_backend="kernel", **kwargs).generate(prompts, greedy(8))
  assert [o.token_ids for o in kernel] == [o.token_ids for o in xla]
