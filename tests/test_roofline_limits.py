"""Tests for the measured limits of benchmarks/roofline.py: the dots of a traced program, the
ops of a compiled one, and how the limits combine, against hand-computed cases."""

import jax
import jax.numpy as jnp
import pytest

from benchmarks import roofline

F32 = "float32"


def test_dot_flops_by_hand():
  plain = roofline.Dot((4, 3), (3, 5), (((1,), (0,)), ((), ())), F32, F32, F32)
  assert plain.flops == 2 * 4 * 3 * 5
  # batch 2 (first axes), contract 6, lhs free 3, rhs free 7: 2 x 2 x 3 x 6 x 7
  batched = roofline.Dot((2, 3, 6), (2, 6, 7), (((2,), (1,)), ((0,), (0,))), F32, F32, F32)
  assert batched.flops == 2 * 2 * 3 * 6 * 7


def test_program_dots_reads_shapes_counts_scans_and_nested_jits():
  def program(x, w, v):
    y = x @ w  # [4, 3] x [3, 5], once

    def body(carry, _):
      return carry + jnp.einsum("bij,bjk->bik", v, v).sum(), None  # [2, 6, 6] x [2, 6, 6]

    total, _ = jax.lax.scan(body, jnp.float32(0), None, length=3)
    inner = jax.jit(lambda a, b: a @ b)(x, w)  # the same dot again, inside a pjit
    return y.sum() + total + inner.sum()

  jaxpr = jax.make_jaxpr(program)(jnp.ones((4, 3)), jnp.ones((3, 5)), jnp.ones((2, 6, 6)))
  counts = roofline.program_dots(jaxpr.jaxpr)
  plain = roofline.Dot((4, 3), (3, 5), (((1,), (0,)), ((), ())), F32, F32, F32)
  batched = roofline.Dot((2, 6, 6), (2, 6, 6), (((2,), (1,)), ((0,), (0,))), F32, F32, F32)
  assert counts == {plain: 2, batched: 3}
  assert sum(d.flops * n for d, n in counts.items()) == 2 * 120 + 3 * 2 * 2 * 6 * 6 * 6


def test_program_dots_keeps_dtypes_and_the_preferred_result():
  jaxpr = jax.make_jaxpr(lambda a, b: jax.lax.dot(a, b, preferred_element_type=jnp.float32))(
      jnp.ones((2, 8), jnp.bfloat16), jnp.ones((8, 4), jnp.bfloat16))
  (dot,) = roofline.program_dots(jaxpr.jaxpr)
  assert (dot.lhs_dtype, dot.rhs_dtype, dot.out_dtype) == ("bfloat16", "bfloat16", "float32")


HLO = """HloModule m

%body (p: (s32[], f32[4])) -> (s32[], f32[4]) {
  %p = (s32[], f32[4]{0}) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %x = f32[4]{0} get-tuple-element(%p), index=1
  %add_fusion = f32[4]{0} fusion(%x), kind=kLoop, calls=%fused
  %copy.1 = f32[4]{0} copy(%add_fusion)
  %next = s32[] add(%i, %i)
  ROOT %t = (s32[], f32[4]{0}) tuple(%next, %copy.1)
}

%cond (p: (s32[], f32[4])) -> pred[] {
  %p = (s32[], f32[4]{0}) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %c = s32[] constant(5)
  ROOT %lt = pred[] compare(%i, %c), direction=LT
}

ENTRY %main (a: f32[4]) -> f32[4] {
  %a = f32[4]{0} parameter(0)
  %zero = s32[] constant(0)
  %init = (s32[], f32[4]{0}) tuple(%zero, %a)
  %w = (s32[], f32[4]{0}) while(%init), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"5"}}
  %r = f32[4]{0} get-tuple-element(%w), index=1
  %ynn_fusion = f32[4]{0} fusion(%r, %a), kind=kCustom, calls=%fused2
  ROOT %b = f32[4]{0} bitcast(%ynn_fusion)
}
"""


def test_count_executed_ops_runs_a_while_body_its_trip_count():
  counts = roofline.count_executed_ops(HLO)
  # entry: while, one fusion; body x 5: fusion, copy, add; condition x 6: compare
  assert counts == {"while": 1, "fusion": 1 + 5, "copy": 5, "add": 5, "compare": 6}


def test_count_executed_ops_without_a_known_trip_count_counts_one_trip():
  counts = roofline.count_executed_ops(HLO.replace(', backend_config={"known_trip_count":{"n":"5"}}',
                                                   ""))
  assert counts == {"while": 1, "fusion": 2, "copy": 1, "add": 1, "compare": 2}


def test_summarize_dots_sums_counts_and_drops_negative_noise():
  rows = [{"count": 4, "mflop": 1.5, "in_program_us": 10.0, "alone_us": 30.0, "call_us": 6.0},
          {"count": 2, "mflop": 0.5, "in_program_us": -1.0, "alone_us": 5.0, "call_us": 6.0},
          {"count": 1, "mflop": 2.0, "in_program_us": 50.0, "alone_us": 26.0, "call_us": 6.0}]
  summary = roofline.summarize_dots(rows)
  assert summary["dots_in_program_s"] == pytest.approx(90e-6)  # 4 x 10 + 0 (not -1) + 50 us
  assert summary["dots_alone_called_s"] == pytest.approx(116e-6)  # 4 x 24 + 0 (5 - 6) + 20 us
  assert summary["dots_alone_s"] == pytest.approx(60e-6)  # the smaller each: 4 x 10 + 0 + 20
  assert summary["dots"] == 7 and summary["distinct_dots"] == 3
  assert summary["dots_gflop"] == pytest.approx(0.009)
  assert summary["dots_alone_gflops"] == pytest.approx(0.009 / 60e-6)


def test_op_floor_adds_the_ops_beyond_the_floor_programs_at_the_cost_per_op():
  # floor program: 50 ops in 105 us; the real one 200 ops, 150 more at 2 us: 105 + 300 us.
  floor = roofline.op_floor(200, 105e-6, 50, 2e-6)
  assert floor["per_op_us"] == pytest.approx(2.0)
  assert floor["op_floor_s"] == pytest.approx(405e-6)
  # never below the floor program itself
  assert roofline.op_floor(30, 105e-6, 50, 2e-6)["op_floor_s"] == pytest.approx(105e-6)


def test_measure_per_op_s_is_positive_and_small():
  per_op = roofline.measure_per_op_s(steps=16, repeats=5)
  assert 0 < per_op < 1e-3


def test_machine_limits_take_the_largest_limit_and_add_dots_to_the_floor():
  limits = roofline.machine_limits(bound_s=1e-4, measured_s=1e-3, dots_alone_s=3e-4,
                                   op_floor_s=4e-4)
  assert limits["machine_limit_s"] == pytest.approx(4e-4)  # the op floor is the largest
  assert limits["fraction_of_machine_limit"] == pytest.approx(0.4)
  assert limits["fraction_of_dots_alone"] == pytest.approx(0.3)
  assert limits["fraction_of_op_floor"] == pytest.approx(0.4)
  assert limits["dots_and_floor_s"] == pytest.approx(7e-4)
  assert limits["fraction_of_dots_and_floor"] == pytest.approx(0.7)
  compute = roofline.machine_limits(bound_s=5e-4, measured_s=1e-3, dots_alone_s=3e-4,
                                    op_floor_s=4e-4)
  assert compute["machine_limit_s"] == pytest.approx(5e-4)


def test_time_dot_measures_a_small_dot():
  dot = roofline.Dot((16, 16), (16, 16), (((1,), (0,)), ((), ())), F32, F32, F32)
  timed = roofline.time_dot(dot, repeats=2, copies=3)
  assert timed["alone_us"] > 0 and timed["call_us"] > 0
  assert set(timed) == {"in_program_us", "alone_us", "call_us"}
