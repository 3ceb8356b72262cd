"""What a program hands to XLA, counted outside its kernels (jspec.bench.program_ops): a Pallas
call counts once whatever its body holds; nested jits, loops and branches count their
equations each time they appear; step_programs traces every step kind without compiling."""

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

import jspec
from helpers import fixture_dir
from jspec.bench.collectives import step_programs
from jspec.bench.program_ops import equation_counts


def _kernel(x_ref, o_ref):
  o_ref[...] = jnp.sin(x_ref[...]) * 2.0 + 1.0


@jax.jit
def _inner(x):
  return jnp.cos(x) + 1.0


def test_kernel_bodies_are_left_out_and_nested_jaxprs_counted_where_they_appear():
  def program(x):
    y = pl.pallas_call(_kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
                       interpret=True)(x)
    z = _inner(y) * _inner(y + 1.0)
    loop = jax.lax.while_loop(lambda c: c[0] < 3, lambda c: (c[0] + 1, jnp.tanh(c[1])), (0, z))
    return loop[1]

  found = equation_counts(jax.make_jaxpr(program)(jnp.ones((8, 128), jnp.float32)))
  assert found["pallas_call"] == 1 and found["sin"] == 0  # the kernel's body is not counted
  assert found["jit"] == 2 and found["cos"] == 2          # each call's body, each time
  assert found["tanh"] == 1 and found["while"] == 1       # a loop's body once
  assert found["mul"] == 1 and found["add"] == 4          # y + 1, the bodies', the counter


def test_step_programs_trace_each_kind_without_compiling():
  llm = jspec.LLM(model=fixture_dir("qwen3_dense"), dtype="float32", max_model_len=64,
                  max_num_seqs=1)
  traced = step_programs(llm, 1, kinds=("decode", "prefill"), chunk=16, traced=True)
  assert set(traced) == {"decode", "prefill"}
  for kind, program in traced.items():
    found = equation_counts(program.jaxpr)
    # every layer's products reach XLA as dot_generals, the prefill's over its 16 tokens
    assert found["dot_general"] >= 2 * llm.config.num_layers, kind
  assert traced["prefill"].jaxpr.in_avals[-1].shape == (1, 16)
