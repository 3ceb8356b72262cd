"""The profile summary reads a trace's device plane: kernels summed by name, the "XLA Ops"
line preferred when the trace has one, categories by name, shares of the wall time."""

import pytest
from jax.profiler import ProfileData

from jspec.bench.profile import category, large_moves, op_times, summary

NAMES = {1: "ncclDevKernel_AllGather_RING_LL", 2: "gemm_fusion_dot_1", 3: "loop_add_fusion",
         4: "all-gather-start.2", 5: "fusion.7"}


def _line(line_id, name, events):
  body = " ".join(f"events {{ metadata_id: {m} offset_ps: {i * 10**7} duration_ps: {ps} }}"
                  for i, (m, ps) in enumerate(events))
  return f'lines {{ id: {line_id} name: "{name}" {body} }}'


def _write_trace(tmp_path, lines, plane="/device:GPU:0"):
  metadata = " ".join(f'event_metadata {{ key: {k} value {{ id: {k} name: "{v}" }} }}'
                      for k, v in NAMES.items())
  text = f'planes {{ id: 1 name: "{plane}" {" ".join(lines)} {metadata} }}'
  (tmp_path / "host.xplane.pb").write_bytes(ProfileData.text_proto_to_serialized_xspace(text))
  return str(tmp_path)


def test_kernels_are_summed_by_name_when_there_is_no_op_line(tmp_path):
  trace = _write_trace(tmp_path, [_line(1, "Stream #1(compute)",
                                        [(1, 2_000_000), (2, 1_000_000), (1, 3_000_000)]),
                                  _line(2, "Stream #2(nccl)", [(3, 500_000)])])
  times = op_times(trace)
  assert times["ncclDevKernel_AllGather_RING_LL"] == (2, 5_000)
  assert times["gemm_fusion_dot_1"] == (1, 1_000)
  assert times["loop_add_fusion"] == (1, 500)
  assert times[None] == (0, 6_500)  # every stream kernel


def test_the_xla_ops_line_is_preferred(tmp_path):
  trace = _write_trace(tmp_path, [_line(1, "Stream #1(compute)", [(1, 4_000_000)]),
                                  _line(2, "XLA Ops", [(4, 4_000_000), (5, 1_000_000)])])
  times = op_times(trace)
  assert set(times) == {"all-gather-start.2", "fusion.7", None}
  assert times[None] == (0, 4_000)


def test_a_trace_without_the_device_names_what_it_has(tmp_path):
  trace = _write_trace(tmp_path, [], plane="/host:CPU")
  with pytest.raises(ValueError, match=r"no plane '/device:GPU:0'.*/host:CPU"):
    op_times(trace)


@pytest.mark.parametrize("name, want", [
    ("ncclDevKernel_AllReduce_Sum_bf16_RING_LL", "collective"),
    ("all-reduce-start.3", "collective"),
    ("gemm_fusion_dot_1445", "matmul"), ("sm90_xmma_gemm_bf16", "matmul"),
    ("input_reduce_fusion_94", "fusion"), ("loop_select_fusion", "fusion"),
    ("memcpy", "other")])
def test_categories(name, want):
  assert category(name) == want


def test_summary_shares_add_up_to_the_kernel_time():
  times = {"ncclDevKernel_AllGather": (2, 3_000_000), "gemm_fusion_dot": (4, 1_000_000),
           None: (0, 4_000_000)}
  text = summary(0.010, times)  # 10 ms of wall
  assert "GPU kernels 4.00 ms (40% of wall)" in text
  assert "collective      3.00 ms  30.0%" in text
  assert text.index("ncclDevKernel_AllGather") < text.index("gemm_fusion_dot")


HLO = """\
HloModule m

%fused_computation (p: bf16[64,8,1024,128]) -> bf16[64,8,1024,128] {
  %p = bf16[64,8,1024,128]{3,2,1,0} parameter(0)
  ROOT %negate.9 = bf16[64,8,1024,128]{3,2,1,0} negate(%p)
}

ENTRY %main (a: bf16[64,8,1024,128], b: f32[16]) -> (bf16[64,8,1024,128], f32[16]) {
  %a = bf16[64,8,1024,128]{3,2,1,0} parameter(0)
  %b = f32[16]{0} parameter(1)
  %copy.3 = bf16[64,8,1024,128]{3,2,1,0} copy(%a)
  %small.1 = f32[16]{0} negate(%b)
  %fusion.2 = (bf16[64,8,1024,128]{3,2,1,0}, f32[4194304]{0}) fusion(%copy.3), kind=kLoop, calls=%fused_computation
  %gte = bf16[64,8,1024,128]{3,2,1,0} get-tuple-element(%fusion.2), index=0
  ROOT %t = (bf16[64,8,1024,128]{3,2,1,0}, f32[16]{0}) tuple(%gte, %small.1)
}
"""


def test_large_moves_lists_instructions_that_write_big_buffers():
  moves = large_moves(HLO, 64 * 2**20)
  # The copy, and the fusion (its tuple's arrays summed: 128 MB + 16 MB); not the fused
  # computation's own instructions, nor parameters, get-tuple-element or tuple.
  assert [(m.op, m.mb) for m in moves] == [("copy", 128.0), ("fusion", 144.0)]
  assert moves[0].line.startswith("%copy.3 = ")
  assert (moves[0].name, moves[0].shape) == ("copy", "bf16[64,8,1024,128]")
  assert moves[1].shape == "(bf16[64,8,1024,128], f32[4194304])"
  assert large_moves(HLO, 145 * 2**20) == []


def test_idle_gaps_are_charged_to_the_kernel_after_them():
  """Two streams overlapping: a gap opens only where no stream runs a kernel, and is charged
  to the kernel that ends it."""
  from jspec.bench.profile import idle_from_events
  events = [(0, 10, "a"), (5, 20, "b"),       # overlap: busy 0-20
            (30, 40, "c"),                     # gap 20-30 before c
            (35, 38, "d"), (45, 50, "c"),      # d inside c; gap 40-45 before c
            (52, 60, "e")]                     # gap 50-52 before e
  idle = idle_from_events(events)
  assert idle.span_ns == 60
  assert idle.busy_ns == 20 + 10 + 5 + 8
  assert sorted(idle.gaps_ns) == [2, 5, 10]
  assert idle.before == {"c": (2, 15), "e": (1, 2)}


def test_idle_summary_counts_launch_gaps_apart_from_longer_waits():
  """Gaps of at most 2 us (a graph's kernel-to-kernel latency) are summed apart from 2-20 us
  gaps and longer ones; each gap lands in exactly one bucket."""
  from jspec.bench.profile import idle_from_events, idle_summary
  # Kernels of 1 us with gaps of 0.5, 1.5, 2, 3, 19 and 25 us before them.
  starts, t = [], 0
  for gap_ns in (0, 500, 1_500, 2_000, 3_000, 19_000, 25_000):
    t += gap_ns
    starts.append(t)
    t += 1_000
  text = idle_summary(idle_from_events([(s, s + 1_000, f"k{i}") for i, s in enumerate(starts)]))
  assert "idle in 6 gaps: 0.00 ms in 3 gaps of at most 2 us" in text
  assert "0.02 ms in gaps of 2-20 us, 0.03 ms in longer ones" in text


def test_a_step_is_cut_between_host_copies_and_reported_with_its_gaps():
  """middle_step: the runs between MemcpyD2H copies, the middle one of the most common length;
  step_report: kernels summed by name with the gaps before them, overlaps counted apart."""
  from jspec.bench.step_trace import middle_step, step_report
  events, t = [], 0

  def add(name, gap, ran):
    nonlocal t
    t += gap
    events.append((t, t + ran, name))
    t += ran

  for step in range(4):
    add("MemcpyD2H", 50_000, 1_000)
    add("gemm", 500, 10_000)
    add("norm", -300, 2_000)     # started 0.3 us before gemm ended
    add("gemm", 1_500, 10_000)
    if step == 3:                # a shorter last run: not the common length
      break
    add("attention", 3_000, 4_000)
  add("MemcpyD2H", 50_000, 1_000)
  step = middle_step(events)
  assert [name for _, _, name in step] == ["MemcpyD2H", "gemm", "norm", "gemm", "attention"]
  assert step[0] == events[5]    # runs 0-2 have 5 kernels: the middle one is run 1
  text = step_report(step, top=3, start=1, show=2)
  assert "5 kernels" in text and "busy 27.0 us" in text
  assert "2 gaps of at most 2 us (2.0 us), 3.0 us in longer ones, 0.3 us overlapped" in text
  assert any(line.split()[:4] == ["gemm", "2", "20.0", "2.0"] for line in text.splitlines())
  assert text.splitlines()[-2:] == [
      f"  {'gemm':60s} gap   0.50 us, ran   10.00 us",
      f"  {'norm':60s} gap  -0.30 us, ran    2.00 us"]
  with pytest.raises(ValueError, match="no MemcpyD2H"):
    middle_step([(0, 1, "gemm")])
