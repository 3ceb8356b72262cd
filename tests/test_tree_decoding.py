"""Token trees in the loop (speculative_config's `speculative_token_tree`): greedy decoding over
a tree emits exactly what greedy vanilla decoding emits, for every drafter that drafts trees,
on GQA and MLA targets, under both schedulers and on dp / tp / ep meshes, with a draft
vocabulary too; logprobs come from
the accepted path; what cannot run a tree is refused before any model work; sampled trees keep
the target's distribution, with a draft model and an EAGLE-3 head. Float32 fixtures on the
CPU.

The trees below have several children at depth 1, so the accepted path is often not the
window's first rows: the caches' compaction (jspec.models.caches.compact) runs for real. A
draft model that is the target itself accepts every top candidate; a one-layer draft model
accepts some; random MTP / EAGLE-3 heads accept almost none.
"""

import numpy as np
import pytest

import jspec
from drafter_checkpoints import eagle3_head, truncated_draft_model
from helpers import cached_llm, fixture_dir, greedy, two_sample_chi2
from jspec.token_tree import TokenTree

RNG = np.random.default_rng(20261128)
# Below every fixture's vocabulary (deepseek_v3: 192).
PROMPTS = [RNG.integers(0, 190, size=n).tolist() for n in (3, 9, 5, 14)]
MAX_TOKENS = 20
WIDE = "[(0,), (1,), (2,), (0, 0), (1, 0), (0, 0, 0), (0, 1)]"      # 7 nodes, depth 3
NO_TOP_PAIR = "[(0,), (1,), (0, 1), (1, 0), (1, 1), (0, 1, 0)]"    # no (0, 0): rank 1 needed
CHAIN3 = "[(0,), (0, 0), (0, 0, 0)]"


def _nodes(tree: str) -> int:
  return tree.count("(")  # one per path


def _vanilla(name, prompts=PROMPTS):
  return [o.token_ids for o in cached_llm(name).generate(prompts, greedy(MAX_TOKENS),
                                                          use_tqdm=False)]


@pytest.fixture(scope="module")
def llama_drafters(tmp_path_factory):
  root, llama = tmp_path_factory.mktemp("tree_drafters"), fixture_dir("llama3")
  return {"itself": llama,
          "one_layer": truncated_draft_model(llama, str(root / "one_layer"), 1),
          "eagle3": eagle3_head(llama, str(root / "eagle3"), 96, aux_layer_ids=(0, 1, 1))}


@pytest.mark.parametrize("drafter, tree", [("itself", NO_TOP_PAIR), ("one_layer", WIDE),
                                           ("eagle3", WIDE)])
def test_greedy_tree_equals_vanilla_with_separate_drafters(llama_drafters, drafter, tree):
  method = "eagle3" if drafter == "eagle3" else "draft_model"
  llm = cached_llm("llama3", method, _nodes(tree), model=llama_drafters[drafter],
                   speculative_token_tree=tree)
  outs = llm.generate(PROMPTS, greedy(MAX_TOKENS), use_tqdm=False)
  assert [o.token_ids for o in outs] == _vanilla("llama3")
  depth = TokenTree.parse(tree).depth
  for o in outs:
    assert len(o.token_ids) == 1 + o.metrics.num_accepted_tokens + o.metrics.num_steps
    # Acceptance is reported by depth: every step drafts each depth once.
    assert o.metrics.num_drafts_per_position == [o.metrics.num_steps] * depth
    assert sum(o.metrics.num_accepted_per_position) == o.metrics.num_accepted_tokens
  if drafter == "itself":
    # Without a (0, 0) node, depth 2 is reached only through a rank-1 child: the accepted
    # path leaves the window's first rows, so the compaction is what keeps tokens exact.
    assert outs.metrics.num_accepted_tokens > outs.metrics.num_steps // 2


def test_a_chain_shaped_tree_is_the_chain(llama_drafters):
  """The same drafts, the same acceptance, step for step: the tree layouts of a chain are the
  chain's slots and causal masks."""
  chain = cached_llm("llama3", "draft_model", 3, model=llama_drafters["one_layer"])
  tree = cached_llm("llama3", "draft_model", 3, model=llama_drafters["one_layer"],
                    speculative_token_tree=CHAIN3)
  a, b = (m.generate(PROMPTS, greedy(MAX_TOKENS), use_tqdm=False) for m in (chain, tree))
  assert [o.token_ids for o in a] == [o.token_ids for o in b]
  assert [o.metrics.num_accepted_tokens for o in a] == [o.metrics.num_accepted_tokens for o in b]
  assert [o.metrics.num_steps for o in a] == [o.metrics.num_steps for o in b]


@pytest.mark.parametrize("name, method, tree, mesh", [
    ("llama3", "draft_model", NO_TOP_PAIR, None),
    ("llama3", "draft_model", NO_TOP_PAIR, jspec.MeshConfig(tp=2)),
    ("glm4_moe", "mtp", WIDE, None)])
def test_greedy_tree_through_the_cache_write_kernel_equals_vanilla(llama_drafters, monkeypatch,
                                                                   name, method, tree, mesh):
  """With the row kernels (norm_backend="pallas", as on a GPU; interpreted here), the tree
  windows write their keys and values at the layout's slots through the cache-write kernel
  (the target's verify window of root and nodes; an MTP head's passes too), the accepted
  path's rows go back to their positions' slots through it (GQA caches; a draft model's too),
  and the tokens are vanilla greedy's."""
  from jspec.models import caches as cache_lib
  from jspec.models.tree_attention import active_layout
  from jspec.pallas_kernels import kv_write as kv_lib
  tree_widths = []  # windows written under a tree layout (traced inside a tree pass)
  kernel = kv_lib.write_kv

  def counted(keys, values, k_BTKH, *args, **kwargs):
    if active_layout(k_BTKH.shape[1]) is not None:
      tree_widths.append(k_BTKH.shape[1])
    return kernel(keys, values, k_BTKH, *args, **kwargs)

  compacted = []  # per compaction: how many caches went through a write kernel
  compact = cache_lib.compact

  def counted_compact(caches, path_BD, start_B, writers=None):
    compacted.append(sum(w is not None for w in writers or ()))
    return compact(caches, path_BD, start_B, writers)

  monkeypatch.setattr(kv_lib, "write_kv", counted)
  monkeypatch.setattr(cache_lib, "compact", counted_compact)
  spec = {"method": method, "num_speculative_tokens": _nodes(tree),
          "speculative_token_tree": tree}
  if method == "draft_model":
    spec["model"] = llama_drafters["itself"]
  llm = jspec.LLM(model=fixture_dir(name), dtype="float32", max_model_len=128, mesh=mesh,
                  norm_backend="pallas", speculative_config=spec)
  outs = llm.generate(PROMPTS, greedy(MAX_TOKENS), use_tqdm=False)
  assert [o.token_ids for o in outs] == _vanilla(name)
  assert 1 + _nodes(tree) in tree_widths  # the verify window
  # The target's layers (GQA: the Llama fixture) and the draft model's compact through the
  # kernel; GLM's MTP head keeps no cache of its own to compact.
  assert compacted and all(n > 0 for n in compacted), compacted
  if method == "draft_model":  # the draft model is the target: rank-1 paths accepted
    assert outs.metrics.num_accepted_tokens > outs.metrics.num_steps // 2


@pytest.mark.parametrize("name", ["glm4_moe", "deepseek_v3"])
def test_greedy_tree_equals_vanilla_with_mtp_heads(name):
  """GQA (GLM-4.5) and MLA (DeepSeek-V3, a two-layer head) targets and heads."""
  llm = cached_llm(name, "mtp", _nodes(WIDE), speculative_token_tree=WIDE)
  assert [o.token_ids for o in llm.generate(PROMPTS, greedy(MAX_TOKENS), use_tqdm=False)] == (
      _vanilla(name))


def test_greedy_tree_with_a_draft_vocabulary_equals_vanilla():
  """The trained demo model's MTP head (real acceptance) restricted to a draft vocabulary
  (FR-Spec's, `draft_vocab`) drafts a tree's nodes from it: with one that holds every token
  vanilla decoding emits (and a tenth of the rest) nodes are accepted; with one as large that
  holds none of them no node is; the tokens are vanilla greedy's either way. (The two
  vocabularies' equal sizes give their LLMs the same programs: one compile.)"""
  demo = lambda spec=None: jspec.LLM(model=jspec.demo_model_path(), dtype="float32",
                                      max_model_len=128, speculative_config=spec)
  vanilla = demo()
  want = [o.token_ids for o in vanilla.generate(PROMPTS, greedy(MAX_TOKENS), use_tqdm=False)]
  emitted = {t for tokens in want for t in tokens}
  rest = [t for t in np.random.default_rng(5).permutation(vanilla.config.vocab_size).tolist()
          if t not in emitted]
  inside = tuple(sorted(emitted)) + tuple(rest[:len(rest) // 10])
  outside = tuple(rest[-len(inside):])
  for draft_vocab, accepted in ((inside, True), (outside, False)):
    llm = demo({"method": "mtp", "num_speculative_tokens": _nodes(WIDE),
                "speculative_token_tree": WIDE, "draft_vocab": draft_vocab})
    outs = llm.generate(PROMPTS, greedy(MAX_TOKENS), use_tqdm=False)
    assert [o.token_ids for o in outs] == want
    assert (outs.metrics.num_accepted_tokens > 0) == accepted, len(draft_vocab)


@pytest.mark.parametrize("mesh, batching", [(jspec.MeshConfig(tp=2), "continuous"),
                                            (jspec.MeshConfig(dp=2), "waves")])
def test_greedy_tree_on_meshes_and_both_schedulers(llama_drafters, mesh, batching):
  llm = jspec.LLM(model=fixture_dir("llama3"), dtype="float32", max_model_len=128,
                  mesh=mesh, batching=batching,
                  speculative_config={"method": "draft_model", "num_speculative_tokens": 6,
                                      "model": llama_drafters["itself"],
                                      "speculative_token_tree": NO_TOP_PAIR})
  outs = llm.generate(PROMPTS, greedy(MAX_TOKENS), use_tqdm=False)
  assert [o.token_ids for o in outs] == _vanilla("llama3")


def test_greedy_tree_with_experts_over_dp_and_ep():
  """An MoE target (GLM-4.5) and its MTP head with attention over dp and experts over ep."""
  llm = jspec.LLM(model=fixture_dir("glm4_moe"), dtype="float32", max_model_len=128,
                  mesh=jspec.MeshConfig(dp=2, ep=2),
                  speculative_config={"method": "mtp", "num_speculative_tokens": _nodes(WIDE),
                                      "speculative_token_tree": WIDE})
  outs = llm.generate(PROMPTS, greedy(MAX_TOKENS), use_tqdm=False)
  assert [o.token_ids for o in outs] == _vanilla("glm4_moe")


def test_logprobs_come_from_the_accepted_path(llama_drafters):
  """logprobs under a tree are the target's log-softmax where each emitted token was chosen:
  the rows of the accepted path, which leaves the window's first rows here."""
  from test_logprobs import _check
  llm = cached_llm("llama3", "draft_model", _nodes(NO_TOP_PAIR), model=llama_drafters["itself"],
                   speculative_token_tree=NO_TOP_PAIR)
  outs = llm.generate(PROMPTS, greedy(MAX_TOKENS, logprobs=3), use_tqdm=False)
  for prompt, out in zip(PROMPTS, outs):
    logits = llm.compute_logits([prompt + out.token_ids])[0]
    _check(out.logprobs, out.token_ids, logits[len(prompt) - 1:-1], 3)
  assert outs.metrics.num_accepted_tokens > outs.metrics.num_steps // 2


def test_what_cannot_run_a_tree_is_refused(llama_drafters):
  spec = lambda **kw: {"method": "draft_model", "num_speculative_tokens": 3,
                       "model": llama_drafters["itself"], **kw}
  with pytest.raises(ValueError, match="must be equal"):
    jspec.LLM(model=fixture_dir("llama3"), speculative_config=spec(
        speculative_token_tree=WIDE))
  with pytest.raises(ValueError, match="not a list of paths"):
    jspec.LLM(model=fixture_dir("llama3"), speculative_config=spec(
        speculative_token_tree="[(0,), (0"))
  with pytest.raises(ValueError, match="no parent"):
    jspec.LLM(model=fixture_dir("llama3"), speculative_config=spec(
        speculative_token_tree=[(0,), (0, 0), (1, 0, 0)]))
  with pytest.raises(ValueError, match="drafter with logits"):
    jspec.LLM(model=fixture_dir("llama3"), speculative_config={
        "method": "ngram", "num_speculative_tokens": 3, "speculative_token_tree": CHAIN3})
  with pytest.raises(ValueError, match="recurrent state"):
    jspec.LLM(model=fixture_dir("qwen3_5_text"), speculative_config={
        "method": "mtp", "num_speculative_tokens": 3, "speculative_token_tree": CHAIN3})


@pytest.mark.runs_programs_often
@pytest.mark.parametrize("drafter", ["one_layer", "eagle3"])
def test_sampled_tree_keeps_the_target_distribution(llama_drafters, drafter):
  """Temperature 1, top-k 8: the first three generated tokens (the second and third decided by
  the tree's multi-candidate rejection sampling) follow the target's own distribution, as the
  chain's do (tests/test_drafters.py: a two-sample chi-square of 1500 samples, one request's
  n = 1500, against draws from the marginals `compute_logits` gives). Siblings are
  independent draws from the same draft distribution, so they may repeat a token."""
  from test_drafters import CHI_PROMPT, VOCAB, _target_marginals
  params = jspec.SamplingParams(temperature=1.0, top_k=8, max_tokens=4, seed=0, n=1500,
                                ignore_eos=True)
  tree = "[(0,), (1,), (0, 0), (1, 0)]"
  method = "eagle3" if drafter == "eagle3" else "draft_model"
  # Each sample its own random stream: the same samples on any number of slots; two draw
  # them fastest on the CPU (a step's cost grows with its rows).
  llm = cached_llm("llama3", method, _nodes(tree), model=llama_drafters[drafter],
                   speculative_token_tree=tree, max_num_seqs=2)
  outs = llm.generate([CHI_PROMPT], params, use_tqdm=False)
  samples = outs[0].outputs
  rng = np.random.default_rng(_nodes(tree))
  for i, probs_V in enumerate(_target_marginals(CHI_PROMPT, 8, 3)):
    sampled = np.array([c.token_ids[i] for c in samples])
    stat, critical, dof = two_sample_chi2(sampled, rng.choice(VOCAB, size=len(sampled),
                                                              p=probs_V))
    assert dof >= 3 and stat < critical, (i, stat, critical, dof)
  # The one-layer draft model accepts some drafts; the random EAGLE-3 head may accept none,
  # which leaves every step to the residual distributions.
  assert outs.metrics.num_accepted_tokens < outs.metrics.num_draft_tokens
  if drafter == "one_layer":
    assert outs.metrics.num_accepted_tokens > 0
