"""optax training loops: target + MTP head jointly, or the MTP head alone on a frozen target.

Parameters are kept in float32 (the optimizer's master copy) and cast to `compute_dtype` for
the forward, so that bf16 matrix units do the work while small updates are not rounded away.
"""

from __future__ import annotations

import dataclasses
import math
import sys
import time
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from tqdm.auto import tqdm

from jspec.config import ModelConfig
from jspec.models.mtp import MTPHead, MTPSpec
from jspec.models.qwen3 import Qwen3CausalLM
from jspec.progress import enabled as progress_enabled
from jspec.train import objective

QWEN3_NEXT_HEAD = MTPSpec(layout="qwen3_next", num_layers=1, is_moe=False)


@dataclasses.dataclass(frozen=True)
class TrainConfig:
  seq_len: int = 512
  batch_size: int = 64
  learning_rate: float = 2e-3
  min_lr_ratio: float = 0.1
  warmup_steps: int = 200
  weight_decay: float = 0.1
  grad_clip: float = 1.0
  mtp_weight: float = 0.3         # DeepSeek-V3's lambda for the first 10T tokens
  steps: int | None = 1000        # fixed step count (exactly reproducible) ...
  time_budget_s: float | None = None  # ... or: time the first steps, then fix the step count
  source_weights: dict | None = None  # sampling weight per corpus source; None: by size
  seed: int = 0
  compute_dtype: str = "bfloat16"
  log_every: int = 50


class WindowSampler:
  """Random windows of a fixed length from token streams, source chosen by weight (seeded)."""

  def __init__(self, streams: dict[str, np.ndarray], window: int, weights: dict | None,
               seed: int):
    self.names = sorted(n for n, s in streams.items() if len(s) > window)
    if not self.names:
      raise ValueError(f"no token stream is longer than one window ({window} tokens)")
    self.streams = [np.asarray(streams[n], np.int32) for n in self.names]
    raw = np.array([(weights or {}).get(n, len(s)) if weights else len(s)
                    for n, s in zip(self.names, self.streams)], np.float64)
    self.probs = raw / raw.sum()
    self.window = window
    self.rng = np.random.default_rng(seed)

  def __call__(self, batch: int) -> np.ndarray:
    sources = self.rng.choice(len(self.streams), size=batch, p=self.probs)
    out = np.empty((batch, self.window), np.int32)
    for row, s in enumerate(sources):
      start = self.rng.integers(0, len(self.streams[s]) - self.window + 1)
      out[row] = self.streams[s][start:start + self.window]
    return out


def _cast(tree, dtype):
  return jax.tree.map(lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x,
                      tree)


def _optimizer(tc: TrainConfig):
  decay_mask = lambda params: jax.tree.map(lambda x: x.ndim >= 2, params)
  return optax.chain(
      optax.clip_by_global_norm(tc.grad_clip),
      optax.inject_hyperparams(optax.adamw)(learning_rate=tc.learning_rate, b1=0.9, b2=0.95,
                                            weight_decay=tc.weight_decay, mask=decay_mask))


def _lr_at(step: int, total: int, tc: TrainConfig) -> float:
  """Linear warm-up, then cosine down to min_lr_ratio of the peak."""
  warmup = min(tc.warmup_steps, max(1, total // 10))
  if step < warmup:
    return tc.learning_rate * (step + 1) / warmup
  progress = min(1.0, (step - warmup) / max(1, total - warmup))
  cosine = 0.5 * (1 + math.cos(math.pi * progress))
  return tc.learning_rate * (tc.min_lr_ratio + (1 - tc.min_lr_ratio) * cosine)


def _set_lr(opt_state, lr: float):
  opt_state[1].hyperparams["learning_rate"] = jnp.asarray(lr, jnp.float32)
  return opt_state


def init_models(cfg: ModelConfig, seed: int, embed_std: float = 0.02):
  """float32 target + one-layer Qwen3-Next MTP head. The embedding (tied to the lm_head) starts
  at std 0.02 (GPT-2's choice) rather than the inference default of 1, so initial logits are
  small and the first loss is near log(V)."""
  target = Qwen3CausalLM(cfg, jnp.float32, nnx.Rngs(seed))
  target.embed.set_value(embed_std * jax.random.normal(jax.random.key(seed + 1000),
                                                       target.embed[...].shape, jnp.float32))
  mtp = MTPHead(cfg, QWEN3_NEXT_HEAD, jnp.float32, nnx.Rngs(seed + 1), Qwen3CausalLM)
  return target, mtp


def _loop(step_fn: Callable, params, opt_state, sampler: WindowSampler, tc: TrainConfig,
          window_tokens: int, describe: Callable, log: Callable | None):
  """Runs step_fn for tc.steps steps (or as many as fit tc.time_budget_s), tqdm showing the
  losses and tokens/s. Returns (params, history, steps run, seconds)."""
  total = tc.steps
  timing_steps = 20
  if total is None:
    if tc.time_budget_s is None:
      raise ValueError("TrainConfig needs steps or time_budget_s")
    total = 10 ** 9  # fixed after the timing steps
  history = []
  bar = tqdm(total=None if tc.steps is None else total, desc="training", file=sys.stderr,
             mininterval=2.0, dynamic_ncols=True, disable=not progress_enabled())
  start = time.perf_counter()
  timing_start = None
  step = 0
  while step < total:
    opt_state = _set_lr(opt_state, _lr_at(step, total, tc))
    batch = jnp.asarray(sampler(tc.batch_size))
    params, opt_state, metrics = step_fn(params, opt_state, batch)
    step += 1
    if step == 2:  # compiled and run once: time from here
      jax.block_until_ready(params)
      timing_start = time.perf_counter()
    if tc.steps is None and step == 2 + timing_steps:
      jax.block_until_ready(params)
      per_step = (time.perf_counter() - timing_start) / timing_steps
      left = tc.time_budget_s - (time.perf_counter() - start)
      total = step + max(0, int(left / per_step))
      bar.reset(total=total)
      bar.update(step)
    if step % tc.log_every == 0 or step == total:
      metrics = {k: float(v) for k, v in metrics.items()}
      elapsed = time.perf_counter() - (timing_start or start)
      counted = step - 2 if timing_start else step
      tps = counted * window_tokens / elapsed if elapsed > 0 and counted > 0 else 0.0
      metrics.update(step=step, tokens_per_s=tps, lr=_lr_at(step - 1, total, tc))
      history.append(metrics)
      bar.set_postfix_str(describe(metrics))
      if log:
        log(metrics)
    bar.update(1)
  jax.block_until_ready(params)
  bar.close()
  return params, opt_state, history, step, time.perf_counter() - start


def train_joint(cfg: ModelConfig, streams: dict[str, np.ndarray], tc: TrainConfig,
                log: Callable | None = None, models=None):
  """Trains a fresh Qwen3 target and its MTP head with L = CE_next + lambda * CE_mtp.

  Returns (target, mtp, info) with float32 modules and info = {history, steps, seconds, ...}.
  """
  target, mtp = models or init_models(cfg, tc.seed)
  graph_t, params_t = nnx.split(target)
  graph_m, params_m = nnx.split(mtp)
  params = {"target": params_t, "mtp": params_m}
  tx = _optimizer(tc)
  opt_state = tx.init(params)
  dtype = jnp.dtype(tc.compute_dtype)

  def loss_fn(p, windows_BW):
    t = nnx.merge(graph_t, _cast(p["target"], dtype))
    m = nnx.merge(graph_m, _cast(p["mtp"], dtype))
    total, next_loss, mtp_loss = objective.joint_losses(t, m, windows_BW, tc.mtp_weight)
    return total, {"loss": next_loss, "mtp_loss": mtp_loss}

  @jax.jit
  def step_fn(p, opt_state, windows_BW):
    (_, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(p, windows_BW)
    updates, opt_state = tx.update(grads, opt_state, p)
    metrics["grad_norm"] = optax.tree.norm(grads)
    return optax.apply_updates(p, updates), opt_state, metrics

  sampler = WindowSampler(streams, tc.seq_len + 2, tc.source_weights, tc.seed)
  describe = lambda m: (f"loss {m['loss']:.3f} mtp {m['mtp_loss']:.3f} "
                        f"{m['tokens_per_s'] / 1e3:.0f}k tok/s")
  params, _, history, steps, seconds = _loop(step_fn, params, opt_state, sampler, tc,
                                             tc.batch_size * tc.seq_len, describe, log)
  target = nnx.merge(graph_t, params["target"])
  mtp = nnx.merge(graph_m, params["mtp"])
  return target, mtp, {"history": history, "steps": steps, "seconds": seconds,
                       "tokens": steps * tc.batch_size * tc.seq_len}


def train_head_distill(target, streams: dict[str, np.ndarray], tc: TrainConfig,
                       log: Callable | None = None, mtp=None):
  """Trains a (fresh or given) one-layer MTP head on a frozen target by self-distillation."""
  mtp = mtp or MTPHead(target.cfg, QWEN3_NEXT_HEAD, jnp.float32, nnx.Rngs(tc.seed + 1),
                        type(target))
  dtype = jnp.dtype(tc.compute_dtype)
  graph_t, params_t = nnx.split(target)
  frozen_t = _cast(params_t, dtype)
  graph_m, params_m = nnx.split(mtp)
  tx = _optimizer(tc)
  opt_state = tx.init(params_m)

  def loss_fn(p, windows_BW):
    t = nnx.merge(graph_t, frozen_t)
    m = nnx.merge(graph_m, _cast(p, dtype))
    loss, agree = objective.distill_loss(t, m, windows_BW)
    return loss, {"loss": loss, "agree": agree}

  @jax.jit
  def step_fn(p, opt_state, windows_BW):
    (_, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(p, windows_BW)
    updates, opt_state = tx.update(grads, opt_state, p)
    return optax.apply_updates(p, updates), opt_state, metrics

  sampler = WindowSampler(streams, tc.seq_len + 1, tc.source_weights, tc.seed)
  describe = lambda m: (f"distill {m['loss']:.3f} agree {m['agree']:.2f} "
                        f"{m['tokens_per_s'] / 1e3:.0f}k tok/s")
  params_m, _, history, steps, seconds = _loop(step_fn, params_m, opt_state, sampler, tc,
                                               tc.batch_size * tc.seq_len, describe, log)
  return nnx.merge(graph_m, params_m), {"history": history, "steps": steps, "seconds": seconds}


def evaluate(target, mtp, tokens: np.ndarray, seq_len: int, max_windows: int = 64,
             batch_size: int = 16, dtype=jnp.float32) -> dict:
  """Held-out figures over consecutive non-overlapping windows of a token stream: perplexity
  of the target, and the MTP head's cross-entropy and top-1 accuracy on t_{i+2}."""
  tokens = np.asarray(tokens, np.int32)
  n = min(max_windows, (len(tokens) - 2) // seq_len)
  if n < 1:
    raise ValueError(f"stream of {len(tokens)} tokens is shorter than one window ({seq_len + 2})")
  windows = np.stack([tokens[i * seq_len:i * seq_len + seq_len + 2] for i in range(n)])
  graph_t, params_t = nnx.split(target)
  graph_m, params_m = nnx.split(mtp)

  @jax.jit
  def sums(pt, pm, windows_BW):
    t = nnx.merge(graph_t, _cast(pt, dtype))
    m = nnx.merge(graph_m, _cast(pm, dtype))
    s = windows_BW.shape[1] - 2
    hidden = objective.target_forward(t, windows_BW[:, :s])
    logits = t.logits(hidden)
    mtp_logits = objective.mtp_forward(t, m, hidden, windows_BW[:, 1:s + 1])
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, windows_BW[:, 1:s + 1]).sum()
    mce = optax.softmax_cross_entropy_with_integer_labels(mtp_logits, windows_BW[:, 2:]).sum()
    acc1 = jnp.sum(jnp.argmax(logits, -1) == windows_BW[:, 1:s + 1])
    acc2 = jnp.sum(jnp.argmax(mtp_logits, -1) == windows_BW[:, 2:])
    return jnp.stack([ce, mce, acc1.astype(jnp.float32), acc2.astype(jnp.float32)])

  total = np.zeros(4)
  for i in range(0, n, batch_size):
    total += np.asarray(sums(params_t, params_m, jnp.asarray(windows[i:i + batch_size])))
  count = n * seq_len
  return {"perplexity": float(np.exp(total[0] / count)), "next_token_ce": total[0] / count,
          "next_token_top1": total[2] / count, "mtp_ce": total[1] / count,
          "mtp_top1": total[3] / count, "tokens": count}
