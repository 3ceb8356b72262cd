"""Drafters that read the target's hidden states: MTP heads and EAGLE heads.

Both pair the target's hidden state at position i with the token at i+1 to predict the token
at i+2 (DeepSeek-V3 MTP; EAGLE, Li et al. 2024), through layers with their own caches:

  - draft extend (prefill and after every verify): the head's first layer runs over the
    committed positions from the target's hidden states, so its cache always holds
    target-derived entries (SGLang / vLLM draft extend); its output at the last emitted
    position gives the next step's first draft (`logits_BV`) and the hidden state fed to the
    second (`feedback_BD`);
  - draft step j > 1: layer (j - 1) mod n is applied at the next position to the previous
    step's feedback hidden state (the head's own output, not the target's).

The head module supplies what differs between heads:
  head.layers[i](target, next_tokens_BT, hidden_BTD, positions_BT, cache, kv_window,
                 experts_fn) -> (normed_BTD, feedback_BTD, cache)
  head.layers[i].logits(target, normed_BTD) -> float32 logits over the target's padded vocab
  head.target_features(target, hidden_BTD, aux_BTD) -> [B, T, D] the first layer's input
  head.aux_layers, head.init_caches(batch, slots, dtype)
"""

from __future__ import annotations

import jax.numpy as jnp

from jspec.models import caches as cache_lib
from jspec.models.moe_backends import live_tokens_only
from jspec.models.tree_attention import tree_layout
from jspec.speculative import tree as tree_lib
from jspec.shapes.chunks import in_chunks
from jspec.speculative.drafters.base import DraftState, Drafter, TargetOut, take_rows
from jspec.shapes.rows import set_row_items


class HiddenStateDrafter(Drafter):

  prefill_reads_target = True  # its first layer reads the target's hidden states

  def __init__(self, target, head, plan, ctx):
    self.target, self.head, self.plan, self.ctx = target, head, plan, ctx
    self.aux_layers = tuple(head.aux_layers)

  def _first_layer(self, next_tokens_BT, target_out: TargetOut, positions_BT, cache,
                   kv_window: int, live_BT=None):
    """The head's first layer over a window. Its MoE (an MoE MTP head's) routes the tokens of
    live_BT [B, T] only (moe_backends.live_tokens_only): the window's other positions are a
    prompt's padding, a verify's rejected tail or a finished row's, whose outputs are never
    read, and a head is one layer, so a position's MoE output reaches nothing but that
    position's outputs (its keys and values come from the layer's input)."""
    hidden_BTD = self.head.target_features(self.target, target_out.hidden_BTD,
                                           target_out.aux_BTD)
    experts_fn = self.ctx.draft_experts_fn
    if live_BT is not None:
      experts_fn = live_tokens_only(experts_fn, live_BT)
    return self.head.layers[0](self.target, next_tokens_BT, hidden_BTD, positions_BT, cache,
                               kv_window, experts_fn)

  def _last_emitted(self, draft: DraftState, normed_BTD, feedback_BTD, last_B) -> DraftState:
    logits_BV = self.head.layers[0].logits(self.target, take_rows(normed_BTD, last_B)[:, None])
    return draft.replace(logits_BV=logits_BV[:, 0], feedback_BD=take_rows(feedback_BTD, last_B))

  def prefill(self, tokens_BP, prompt_lens_B, first_B, target_out: TargetOut,
              chunk: int) -> DraftState:
    batch, prompt_bucket = tokens_BP.shape
    last_B = prompt_lens_B - 1
    positions_BP = jnp.broadcast_to(jnp.arange(prompt_bucket, dtype=jnp.int32), tokens_BP.shape)
    # Position i pairs h_i with t_{i+1}: the prompt shifted left, the first token at the end.
    next_BP = jnp.concatenate([tokens_BP[:, 1:], tokens_BP[:, :1]], axis=1)
    next_BP = set_row_items(next_BP, last_B, first_B)
    caches = cache_lib.constrain(self.head.init_caches(batch, self.plan.cache_len, self.ctx.dtype),
                                 self.ctx.draft_cache_shardings)

    def extend(next_tokens, hidden, positions, *aux_and_cache):
      *aux, cache = aux_and_cache
      normed, feedback, cache = self._first_layer(next_tokens, TargetOut(hidden, tuple(aux)),
                                                  positions, cache, prompt_bucket,
                                                  positions < prompt_lens_B[:, None])
      return (normed, feedback), cache

    (normed_BPD, feedback_BPD), cache0 = in_chunks(
        extend, (next_BP, target_out.hidden_BTD, positions_BP, *target_out.aux_BTD), caches[0],
        chunk)
    draft = DraftState(caches=(cache0,) + tuple(caches[1:]))
    return self._last_emitted(draft, normed_BPD, feedback_BPD, last_B)

  def _step_experts(self, live_B, width: int):
    """The draft steps' experts_fn: the MoE of an MoE head routes the rows of live_B only,
    where there are several rows (one runs until it ends)."""
    if live_B is None or live_B.shape[0] == 1:
      return self.ctx.draft_experts_fn
    return live_tokens_only(self.ctx.draft_experts_fn,
                            jnp.broadcast_to(live_B[:, None], (live_B.shape[0], width)))

  def propose(self, draft: DraftState, tokens_BS, lengths_B, choose, live_B=None):
    plan, layers = self.plan, self.head.layers
    experts_fn = self._step_experts(live_B, 1)
    token_B, probs_BV = choose(draft.logits_BV, 0)
    drafts, probs = [token_B], [probs_BV]
    feedback_BD, caches = draft.feedback_BD, list(draft.caches)
    for j in range(2, plan.k + 1):
      index = (j - 1) % len(layers)
      # Draft j sits at position L + j - 1; the head's input pairs it with position L + j - 3.
      positions_B1 = (lengths_B + j - 3)[:, None]
      normed_B1D, feedback_B1D, caches[index] = layers[index](
          self.target, token_B[:, None], feedback_BD[:, None], positions_B1, caches[index],
          plan.cache_len, experts_fn)
      token_B, probs_BV = choose(layers[index].logits(self.target, normed_B1D)[:, 0], j - 1)
      feedback_BD = feedback_B1D[:, 0]
      drafts.append(token_B)
      probs.append(probs_BV)
    probs_BKV = None if probs[0] is None else jnp.stack(probs, axis=1)
    draft_len_B = jnp.full(lengths_B.shape, plan.k, jnp.int32)
    return jnp.stack(drafts, axis=1), draft_len_B, probs_BKV, draft.replace(caches=tuple(caches))

  def propose_tree(self, draft: DraftState, tokens_BS, lengths_B, tree, choose, live_B=None):
    """The root's children from the extend's logits; then, depth by depth, one head pass over
    the nodes with children (a node pairs its token with its parent's feedback, as draft step
    j pairs draft j - 1 with step j - 1's), laid out by jspec.speculative.tree.draft_layout."""
    layers, plan = self.head.layers, self.plan
    tokens, probs = choose((0,), draft.logits_BV[:, None])
    feedback = {0: draft.feedback_BD}
    caches = list(draft.caches)
    for depth in range(1, tree.depth):
      nodes, layout = tree_lib.draft_layout(tree, depth)
      index = depth % len(layers)
      tokens_BW = jnp.stack([tokens[i] for i in nodes], axis=1)
      hidden_BWD = jnp.stack([feedback[tree.parents[i]] for i in nodes], axis=1)
      positions_BW = jnp.broadcast_to((lengths_B + depth - 2)[:, None], tokens_BW.shape)
      with tree_layout(layout):
        normed_BWD, feedback_BWD, caches[index] = layers[index](
            self.target, tokens_BW, hidden_BWD, positions_BW, caches[index], plan.cache_len,
            self._step_experts(live_B, len(nodes)))
      feedback.update({i: feedback_BWD[:, w] for w, i in enumerate(nodes)})
      more, more_probs = choose(nodes, layers[index].logits(self.target, normed_BWD))
      tokens.update(more)
      probs = tree_lib.join_probs(probs, more_probs)
    drafts_BK = jnp.stack([tokens[i] for i in range(1, tree.num_nodes)], axis=1)
    return drafts_BK, probs, draft.replace(caches=tuple(caches))

  def prefill_chunk(self, draft: DraftState, tokens_BC, positions_BC, next_tokens_BC,
                    prompt_lens_B, last_B, target_out: TargetOut) -> DraftState:
    """The first layer over the chunk, as `prefill` runs it over a whole prompt; the outputs
    at the prompt's last position (in its last chunk) give the first draft."""
    del tokens_BC
    normed_BCD, feedback_BCD, cache0 = self._first_layer(
        next_tokens_BC, target_out, positions_BC, draft.caches[0], self.plan.cache_len,
        positions_BC < prompt_lens_B[:, None])
    draft = draft.replace(caches=(cache0,) + tuple(draft.caches[1:]))
    return self._last_emitted(draft, normed_BCD, feedback_BCD, last_B)

  def extend(self, draft: DraftState, out_tokens_BT, positions_BT, num_emit_B, running_B,
             target_out: TargetOut) -> DraftState:
    # Only the emitted positions of running rows are read (at num_emit_B - 1).
    emitted_BT = jnp.arange(out_tokens_BT.shape[1])[None, :] < num_emit_B[:, None]
    normed_BTD, feedback_BTD, cache0 = self._first_layer(
        out_tokens_BT, target_out, positions_BT, draft.caches[0], self.plan.cache_len,
        emitted_BT & running_B[:, None])
    draft = draft.replace(caches=(cache0,) + tuple(draft.caches[1:]))
    return self._last_emitted(draft, normed_BTD, feedback_BTD, num_emit_B - 1)
