"""Figures for a trained checkpoint: held-out prompts, acceptance per draft position and mean
acceptance length through `jspec.LLM`, batch-1 tokens/s, and greedy parity with transformers."""

from __future__ import annotations

import random

import numpy as np

from jspec.config import SamplingParams
from jspec.train.corpus import Document


def heldout_prompts(docs: list[Document], source: str, n: int, seed: int) -> list[str]:
  """Seeded prompts from held-out documents: 3 consecutive verses (Bible) or 8 consecutive
  non-blank-starting lines of code (Python), each starting at a line start."""
  rng = random.Random(f"{seed}-{source}-prompts")
  group = [d for d in docs if d.source == source]
  prompts = []
  lines_per_prompt = 3 if source == "bible" else 8
  while len(prompts) < n:
    lines = rng.choice(group).text.splitlines()
    if len(lines) <= lines_per_prompt:
      continue
    start = rng.randrange(0, len(lines) - lines_per_prompt)
    chunk = lines[start:start + lines_per_prompt]
    if not chunk[0].strip() or sum(len(x) for x in chunk) < 40 or sum(map(len, chunk)) > 400:
      continue
    prompts.append("\n".join(chunk) + "\n")
  return prompts


def pooled(outputs, k: int) -> dict:
  drafted = np.zeros(k, np.int64)
  accepted = np.zeros(k, np.int64)
  steps = 0
  for out in outputs:
    drafted += np.asarray(out.metrics.num_drafts_per_position, np.int64)
    accepted += np.asarray(out.metrics.num_accepted_per_position, np.int64)
    steps += out.metrics.num_steps
  return {"acceptance_rate_per_position": [float(a / d) if d else 0.0
                                           for a, d in zip(accepted, drafted)],
          "mean_acceptance_length": float((accepted.sum() + steps) / steps) if steps else 0.0,
          "steps": int(steps)}


def acceptance_table(model_dir: str, prompts: dict[str, list[str]], ks=(1, 2, 3, 4),
                     temperatures=(0.0, 0.7), max_tokens: int = 128, dtype="bfloat16",
                     seed: int = 0, log=print) -> dict:
  """{"acceptance": {"k{k}_t{T}_{source}": pooled figures}} over every prompt set."""
  import jspec
  results = {}
  for k in ks:
    llm = jspec.LLM(model=model_dir, dtype=dtype, max_model_len=1024, seed=seed,
                    speculative_config={"method": "mtp", "num_speculative_tokens": k})
    for temperature in temperatures:
      params = SamplingParams(temperature=temperature, max_tokens=max_tokens, seed=seed,
                              ignore_eos=True)
      for source, texts in prompts.items():
        key = f"k{k}_t{temperature}_{source}"
        results[key] = pooled(llm.generate(texts, params), k)
        log(f"{key}: {results[key]}")
  return {"acceptance": results}


def batch1_speed(model_dir: str, prompt: str, ks=(0, 1, 2, 3, 4), max_tokens: int = 256,
                 dtype="bfloat16", seed: int = 0, repeats: int = 3, log=print) -> dict:
  """Greedy batch-1 tokens/s per k (0: no speculation), median of `repeats` after a warm-up."""
  import jspec
  speed = {}
  for k in ks:
    spec = {"method": "mtp", "num_speculative_tokens": k} if k else None
    llm = jspec.LLM(model=model_dir, speculative_config=spec, dtype=dtype, max_model_len=1024,
                    seed=seed)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    llm.generate([prompt], params)  # compile + warm up
    runs = [llm.generate([prompt], params).metrics for _ in range(repeats)]
    speed[k] = {"tokens_per_second": float(np.median([m.tokens_per_second for m in runs])),
                "mean_acceptance_length": runs[0].mean_acceptance_length}
    log(f"k={k} batch-1: {speed[k]}")
  return speed


def hf_parity(model_dir: str, prompts: list[str], max_new_tokens: int = 64) -> dict:
  """Greedy generation by transformers (torch, float32) vs jspec (float32, highest precision)."""
  import jax
  import torch
  from transformers import AutoModelForCausalLM, AutoTokenizer

  import jspec
  jax.config.update("jax_default_matmul_precision", "highest")
  device = "cuda" if torch.cuda.is_available() else "cpu"
  tok = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
  model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32,
                                               local_files_only=True).to(device).eval()
  llm = jspec.LLM(model=model_dir, dtype="float32", max_model_len=1024)
  ours = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=max_new_tokens))
  rows = []
  for prompt, out in zip(prompts, ours):
    ids = tok(prompt, add_special_tokens=False, return_tensors="pt")["input_ids"].to(device)
    with torch.no_grad():
      gen = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False,
                           pad_token_id=tok.eos_token_id)
    theirs = gen[0, ids.shape[1]:].tolist()
    rows.append({"prompt": prompt[:40], "equal": theirs == list(out.token_ids),
                 "hf_len": len(theirs), "jspec_len": len(out.token_ids),
                 "first_diff": next((i for i, (a, b) in enumerate(zip(theirs, out.token_ids))
                                     if a != b), None)})
  return {"all_equal": all(r["equal"] for r in rows), "rows": rows,
          "transformers_class": type(model).__name__}
