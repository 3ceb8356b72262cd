"""The workspace kernels' handover without flags (jspec.pallas_kernels.lamport_exchange).

On the CPU: the Lamport regions' layout (inside the workspace, past the flag regions, a set of
norm slots per chunk count that never overlap), a fresh workspace's empty slots, the protocol
choice, and both kernels built for Hopper in both protocols. On 2 GPUs (`gpu` marker): sums and
norms bit for bit equal to the flag protocol's and to psum, parts that hold the sentinel's own
bits, long chains that mix message sizes and row widths, and every slot's next two phases empty
afterwards."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jspec.pallas_kernels import lamport_exchange as lamport
from jspec.pallas_kernels import workspace_all_reduce as wsar
from jspec.pallas_kernels import workspace_norm


@pytest.mark.parametrize("size", [2, 4, 8])
def test_the_lamport_regions_follow_the_flag_regions_inside_the_workspace(size):
  sums, norms = wsar.lamport_sum_region(size), wsar.lamport_norm_region(size)
  assert sums.offset == wsar.norm_region(size).end(size)
  assert norms.offset == sums.end(size)
  for region in (sums, norms):
    assert region.counters_offset + 4 * region.slots <= region.data_offset
    assert region.data_offset % 4096 == 0
  assert norms.end(size) == wsar.workspace_bytes(size)
  assert sums.slot_bytes == wsar.BLOCK_BYTES and norms.slot_bytes == wsar.TILE_BYTES


def test_each_chunk_count_has_norm_slots_of_its_own():
  """Rows of different widths never share a slot, so a row's chunk slots count the same calls
  (the phase every block of the row assumes)."""
  rows, max_chunks = wsar.NORM_ROWS, wsar.NORM_ROW_SLOTS
  slots = [lamport.first_row_slot(rows, chunks, row) + c
           for chunks in range(1, max_chunks + 1) for row in range(rows) for c in range(chunks)]
  assert sorted(slots) == list(range(lamport.row_slots(rows, max_chunks)))
  assert wsar.lamport_norm_region(2).slots == lamport.row_slots(rows, max_chunks)


def test_a_fresh_workspace_has_every_lamport_slot_empty_and_its_flags_at_zero():
  mesh = Mesh(np.asarray(jax.devices()[:4]), ("tp",))
  workspace = wsar.PeerWorkspace(mesh, "tp")
  assert all(workspace.lamport_idle().values())
  assert all(not f.any() for f in workspace.flags().values())
  words = next(iter(workspace._read().values()))
  region = wsar.lamport_norm_region(4)
  assert (words[region.data_offset // 4:region.end(4) // 4] == -1).all()
  assert not words[region.counters_offset // 4:][:region.slots].any()


def test_lamport_idle_checks_the_next_two_phases_of_every_slot(monkeypatch):
  """A slot's next two phases (its count and count + 1, mod 3) must be empty between
  programs; the third holds its last call's parts and may hold anything."""
  mesh = Mesh(np.asarray(jax.devices()[:2]), ("tp",))
  workspace = wsar.PeerWorkspace(mesh, "tp")
  fresh = {d: w.copy() for d, w in workspace._read().items()}
  region = wsar.lamport_norm_region(2)
  slot, count = 37, 5   # phases: next 5 % 3 = 2, then 0; the last call's is 1

  def word(phase, source):  # the first word of [phase][source][slot]
    n = (phase * 2 + source) * region.slots + slot
    return (region.data_offset + n * region.slot_bytes) // 4

  def state(phase_written):
    words = {d: w.copy() for d, w in fresh.items()}
    for w in words.values():
      w[region.counters_offset // 4 + slot] = count
      w[word(phase_written, 1)] = 12345
    return words

  for phase, idle in [(1, True), (2, False), (0, False)]:
    monkeypatch.setattr(workspace, "_read", lambda phase=phase: state(phase))
    assert all(workspace.lamport_idle().values()) == idle, phase


def test_int32_messages_keep_the_flags_and_bad_protocols_are_refused():
  assert wsar.protocol_for(jnp.int32, None) == "flags"
  with pytest.raises(ValueError, match="int32 messages take the flags"):
    wsar.protocol_for(jnp.int32, "lamport")  # an int32 word may be the all-ones sentinel
  assert wsar.protocol_for(jnp.bfloat16, None) == wsar.DEFAULT_PROTOCOL
  assert wsar.protocol_for(jnp.float32, "flags") == "flags"
  with pytest.raises(ValueError, match="protocol must be one of"):
    wsar.protocol_for(jnp.bfloat16, "nvls")


def test_both_kernels_build_for_hopper_in_both_protocols_without_a_gpu(monkeypatch):
  """The Mosaic GPU modules (polling loops, sentinel checks, phase refills) build and verify;
  their values are checked on GPUs, since no interpreter runs raw Mosaic GPU."""
  from jax.experimental.mosaic.gpu import utils as mosaic_utils
  monkeypatch.setattr(mosaic_utils, "_infer_arch", lambda: (9, 0))
  for protocol in wsar.PROTOCOLS:
    for n, dtype, size, blocks, per in [(4096, jnp.bfloat16, 2, 4, 1),
                                        (65536, jnp.float32, 4, 32, 4),
                                        (1024, jnp.float16, 8, 1, 1)]:
      assert callable(wsar._build(n, jnp.dtype(dtype), size, blocks, per, protocol))
    for rows, width, dtype, size in [(1, 4096, jnp.bfloat16, 2), (32, 2048, jnp.float32, 4),
                                     (8, 7168, jnp.float16, 8)]:
      for prefetch in (False, True):
        assert callable(workspace_norm._build(rows, width, jnp.dtype(dtype), size, 1e-6, False,
                                              protocol, prefetch))


def _gpu_pair():
  gpus = [d for d in jax.devices() if d.platform == "gpu"]
  if len(gpus) < 2:
    pytest.skip("needs 2 GPUs")
  return Mesh(np.asarray(gpus[:2]), ("tp",))


def _run(mesh, fn, *args):
  """fn(shard, *replicated, row) on each device of the pair, its results stacked."""
  workspace = wsar.workspace_for(mesh, "tp")
  program = jax.jit(jax.shard_map(
      lambda v, *rest: fn(v[0], *rest)[None], mesh=mesh,
      in_specs=(P("tp"),) + (P(),) * (len(args) - 1) + (workspace.row_spec,),
      out_specs=P("tp"), check_vma=False))
  return np.asarray(program(*args, workspace.rows).astype(jnp.float32)), workspace


@pytest.mark.gpu
@pytest.mark.parametrize("elements, dtype, max_blocks", [
    (1024, jnp.bfloat16, 32), (4096, jnp.bfloat16, 1), (4096, jnp.bfloat16, 32),
    (131072, jnp.bfloat16, 32), (4096, jnp.float16, 8), (65536, jnp.float32, 64)])
def test_gpu_lamport_sums_equal_psum_and_the_flags(elements, dtype, max_blocks):
  mesh = _gpu_pair()
  rng = np.random.default_rng(elements + max_blocks)
  x = jax.device_put(jnp.asarray(rng.standard_normal((2, elements)), dtype),
                     NamedSharding(mesh, P("tp")))
  reduce = lambda protocol: lambda v, row: wsar.workspace_all_reduce(
      v, row, 2, max_blocks=max_blocks, protocol=protocol)
  got, workspace = _run(mesh, reduce("lamport"), x)
  flags, _ = _run(mesh, reduce("flags"), x)
  want, _ = _run(mesh, lambda v, row: jax.lax.psum(v, "tp"), x)
  np.testing.assert_array_equal(got, want)
  np.testing.assert_array_equal(got, flags)
  assert all(workspace.lamport_idle().values())


@pytest.mark.gpu
def test_gpu_parts_holding_the_sentinels_bits_arrive():
  """All-ones elements (a NaN) are sent as a quiet NaN: their sums are NaN and the call ends;
  the other elements' sums are psum's."""
  mesh = _gpu_pair()
  rng = np.random.default_rng(3)
  bits = rng.integers(0, 1 << 16, (2, 4096), dtype=np.uint16)
  bits[0, ::7] = 0xFFFF
  bits[1, 3::11] = 0xFFFF
  x = jax.device_put(jnp.asarray(bits.view(jnp.bfloat16)), NamedSharding(mesh, P("tp")))
  got, workspace = _run(mesh, lambda v, row: wsar.workspace_all_reduce(
      v, row, 2, protocol="lamport"), x)
  want, _ = _run(mesh, lambda v, row: jax.lax.psum(v, "tp"), x)
  np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
  assert np.isnan(got[:, ::7]).all()
  finite = ~np.isnan(want)
  np.testing.assert_array_equal(got[finite], want[finite])
  assert all(workspace.lamport_idle().values())


@pytest.mark.gpu
@pytest.mark.parametrize("rows, width, dtype, zero_centered", [
    (1, 4096, jnp.bfloat16, False), (8, 4096, jnp.bfloat16, False),
    (32, 2048, jnp.bfloat16, True), (3, 7168, jnp.bfloat16, False),
    (2, 1024, jnp.float32, True), (4, 4096, jnp.float16, False)])
@pytest.mark.parametrize("prefetch", [False, True])
def test_gpu_lamport_norms_equal_the_flag_protocols(monkeypatch, rows, width, dtype,
                                                    zero_centered, prefetch):
  """Bit for bit the flag protocol's norm (which reads the residual and scale after the
  exchange), with the Lamport kernel's reads before it (`PREFETCH`) or after."""
  mesh = _gpu_pair()
  rng = np.random.default_rng(rows * width + 1)
  partials = jax.device_put(jnp.asarray(rng.standard_normal((2, rows, width)), dtype),
                            NamedSharding(mesh, P("tp")))
  residual = jnp.asarray(rng.standard_normal((rows, width)) * 4, dtype)
  scale = jnp.asarray(rng.standard_normal(width), dtype)

  def add_norm(protocol):
    return lambda p, r, s, row: jnp.stack(workspace_norm.workspace_add_norm(
        p, r, s, row, 2, eps=1e-6, zero_centered=zero_centered, protocol=protocol))

  want, _ = _run(mesh, add_norm("flags"), partials, residual, scale)
  monkeypatch.setattr(workspace_norm, "PREFETCH", prefetch)
  got, workspace = _run(mesh, add_norm("lamport"), partials, residual, scale)
  np.testing.assert_array_equal(got, want)
  np.testing.assert_array_equal(got[0], got[1])
  assert all(workspace.lamport_idle().values())


@pytest.mark.gpu
def test_gpu_chains_of_sums_and_norms_of_two_widths_match_the_flags():
  """150 rounds of a plain sum (1, 8 and 32 blocks) and norms of one and eight rows, 2048 and
  4096 wide (two chunk counts, so two slot sets at different call counts): bit for bit the
  flag protocol's chain on both devices, and every slot's next two phases empty afterwards."""
  mesh = _gpu_pair()
  rng = np.random.default_rng(5)
  x = jax.device_put(jnp.asarray(rng.standard_normal((2, 8, 4096)), jnp.bfloat16),
                     NamedSharding(mesh, P("tp")))
  scale = jnp.asarray(rng.standard_normal(4096), jnp.bfloat16)

  def chain(protocol):
    reduce = lambda v, row: wsar.workspace_all_reduce(v, row, 2, protocol=protocol)
    norm = lambda p, r, s, row: workspace_norm.workspace_add_norm(p, r, s, row, 2, eps=1e-6,
                                                                  protocol=protocol)

    def fn(v, s, row):
      def step(i, h):
        total = reduce(v * 0.5 + h * 0.01, row)                       # 64 KB: 32 blocks
        small = reduce(h[:1, :1024] * 0.3, row)                       # 2 KB: 1 block
        h1, n1 = norm(total[:1, :2048] * 0.1, h[:1, :2048] * 0.5, s[:2048], row)
        h8, n8 = jax.lax.cond(i % 3 == 0, lambda: norm(v * 0.1 + n8_in(h), h * 0.5, s, row),
                              lambda: (h, h))
        return (h8 + n8 * 0.01).at[:1, :2048].add(h1 * 0.01 + n1 * 0.001).at[:1, :1024].add(
            small * 0.001)
      n8_in = lambda h: h * 0.02
      return jax.lax.fori_loop(0, 150, step, reduce(v, row))
    return fn

  got, workspace = _run(mesh, chain("lamport"), x, scale)
  want, _ = _run(mesh, chain("flags"), x, scale)
  np.testing.assert_array_equal(got, want)
  np.testing.assert_array_equal(got[0], got[1])
  assert np.isfinite(got).all()
  assert all(workspace.lamport_idle().values())
  counters = list(workspace.counters().values())
  np.testing.assert_array_equal(counters[0], counters[1])
