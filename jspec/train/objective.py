"""Training forwards and losses, through jspec's own inference modules.

The target runs over a window with a KV cache exactly as long as the window and positions
0..T-1 (one prefill), so training and decoding share every line of model code. The MTP
objective is DeepSeek-V3's (report section 2.2, eq. 19-25), in the Qwen3-Next layout that
jspec.models.mtp documents: MTP position i pairs the target's post-final-norm hidden state h_i
with embed(t_{i+1}) and predicts t_{i+2}:

    L = CE(target logits_i, t_{i+1}) + lambda * CE(mtp logits_i, t_{i+2})

For a window of T + 2 tokens t_0..t_{T+1}: the target reads t_0..t_{T-1}, the head reads
(h_0..h_{T-1}, t_1..t_T) and is scored on t_2..t_{T+1}.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax



def _positions(tokens_BT):
  return jnp.broadcast_to(jnp.arange(tokens_BT.shape[1], dtype=jnp.int32), tokens_BT.shape)


def target_forward(target, tokens_BT, experts_fn=None):
  """Post-final-norm hidden states [B, T, D] of one full-window prefill."""
  b, t = tokens_BT.shape
  caches = target.init_caches(b, t, target.embed[...].dtype)
  hidden_BTD, _ = target(tokens_BT, _positions(tokens_BT), caches, t, experts_fn,
                         seq_lens_B=jnp.full((b,), t, jnp.int32))
  return hidden_BTD


def mtp_forward(target, mtp, hidden_BTD, next_tokens_BT, experts_fn=None):
  """float32 logits [B, T, V] of the head's first layer: position i predicts t_{i+2}."""
  b, t = next_tokens_BT.shape
  layer = mtp.layers[0]
  cache = mtp.init_caches(b, t, layer.proj[...].dtype)[0]
  normed_BTD, _, _ = layer(target, next_tokens_BT, hidden_BTD, _positions(next_tokens_BT), cache,
                           t, experts_fn)
  return layer.logits(target, normed_BTD)


def cross_entropy(logits_BTV, labels_BT):
  return optax.softmax_cross_entropy_with_integer_labels(logits_BTV, labels_BT).mean()


def joint_losses(target, mtp, windows_BW, mtp_weight: float, experts_fn=None):
  """(total, next-token CE, MTP CE) over windows of T + 2 tokens."""
  t = windows_BW.shape[1] - 2
  inputs_BT, next_BT, next2_BT = windows_BW[:, :t], windows_BW[:, 1:t + 1], windows_BW[:, 2:]
  hidden_BTD = target_forward(target, inputs_BT, experts_fn)
  next_loss = cross_entropy(target.logits(hidden_BTD), next_BT)
  mtp_loss = cross_entropy(mtp_forward(target, mtp, hidden_BTD, next_BT, experts_fn), next2_BT)
  return next_loss + mtp_weight * mtp_loss, next_loss, mtp_loss


def distill_loss(target, mtp, windows_BW, experts_fn=None):
  """Self-distillation of the head on a frozen target, over windows of T + 1 tokens.

  The soft label at MTP position i is the target's own distribution for t_{i+2}, read from its
  logits at position i+1 (it has seen t_0..t_{i+1}); the head sees only h_i and t_{i+1}. Returns
  (cross-entropy to the soft labels, agreement of the head's argmax with the target's).
  """
  t = windows_BW.shape[1] - 1
  hidden_BTD = jax.lax.stop_gradient(target_forward(target, windows_BW, experts_fn))
  teacher_logits_BTV = jax.lax.stop_gradient(target.logits(hidden_BTD[:, 1:]))
  student_logits_BTV = mtp_forward(target, mtp, hidden_BTD[:, :t], windows_BW[:, 1:],
                                   experts_fn)
  teacher_probs_BTV = jax.nn.softmax(teacher_logits_BTV, axis=-1)
  loss = optax.softmax_cross_entropy(student_logits_BTV, teacher_probs_BTV).mean()
  agree = jnp.mean(jnp.argmax(student_logits_BTV, -1) == jnp.argmax(teacher_logits_BTV, -1))
  return loss, agree
