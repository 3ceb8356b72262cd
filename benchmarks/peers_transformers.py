"""The peer a researcher would pick instead: transformers' `generate`, same shapes, same GPU.

    PYTHONPATH=. python3 benchmarks/peers_transformers.py --model qwen3-8b --batch 1 8 32 128

Two configurations, as the performance issue asks:
  static    static KV cache, greedy; on CUDA `generate` then compiles the forward itself
            (`torch.compile`, mode "reduce-overhead": CUDA graphs), transformers' own fast path;
  lookup    prompt-lookup assisted generation (`prompt_lookup_num_tokens=k`), batch 1 only
            (transformers' assisted generation takes one sequence).
Random bf16 weights of the jspec preset's shapes, built directly on the GPU. Each figure is the
median of --repeats timed calls after two warm-up calls (compilation). Writes JSON lines.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time


def hf_config(preset):
  """A transformers config with exactly the shapes of a jspec preset (a ModelConfig)."""
  from transformers import Qwen3Config, Qwen3MoeConfig
  common = dict(vocab_size=preset.vocab_size, hidden_size=preset.hidden_size,
                intermediate_size=preset.intermediate_size,
                num_hidden_layers=preset.num_layers, num_attention_heads=preset.num_heads,
                num_key_value_heads=preset.num_kv_heads, head_dim=preset.head_dim,
                rms_norm_eps=preset.rms_norm_eps, tie_word_embeddings=preset.tie_word_embeddings,
                max_position_embeddings=preset.max_position_embeddings,
                rope_parameters={"rope_type": "default", "rope_theta": preset.rope_theta})
  if preset.is_moe:
    return Qwen3MoeConfig(num_experts=preset.moe.num_experts,
                          num_experts_per_tok=preset.moe.num_experts_per_tok,
                          moe_intermediate_size=preset.moe.intermediate_size,
                          norm_topk_prob=preset.moe.norm_topk_prob, **common)
  return Qwen3Config(**common)


def _time(fn, repeats):
  import torch
  for _ in range(2):
    fn()
  torch.cuda.synchronize()
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    times.append(time.perf_counter() - start)
  return statistics.median(times)


def main():
  import torch
  from transformers import AutoModelForCausalLM

  from jspec.bench.presets import PRESETS

  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--model", default="qwen3-8b", choices=sorted(PRESETS))
  parser.add_argument("--layers", type=int, default=0)
  parser.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32, 128])
  parser.add_argument("--prompt-len", type=int, default=128)
  parser.add_argument("--max-tokens", type=int, default=128)
  parser.add_argument("--k", type=int, default=3, help="prompt_lookup_num_tokens")
  parser.add_argument("--repeats", type=int, default=3)
  parser.add_argument("--out", default="")
  args = parser.parse_args()

  preset = PRESETS[args.model]
  if args.layers:
    preset = dataclasses.replace(preset, num_layers=args.layers)
  torch.manual_seed(0)
  with torch.device("cuda"):
    model = AutoModelForCausalLM.from_config(hf_config(preset), dtype=torch.bfloat16).eval()
  rows = []

  def record(**row):
    row.update(model=args.model, layers=preset.num_layers, device=torch.cuda.get_device_name())
    rows.append(row)
    print(json.dumps(row), flush=True)

  generation = dict(max_new_tokens=args.max_tokens, min_new_tokens=args.max_tokens,
                    do_sample=False, pad_token_id=0)
  # Prompt lookup first: eager, so a compile failure below cannot cost its row.
  ids = torch.randint(0, preset.vocab_size, (1, args.prompt_len), device="cuda")
  with torch.no_grad():
    seconds = _time(lambda: model.generate(ids, prompt_lookup_num_tokens=args.k, **generation),
                    args.repeats)
  record(peer=f"transformers prompt lookup k={args.k}", batch=1,
         tokens_per_second=args.max_tokens / seconds)
  for batch in args.batch:
    ids = torch.randint(0, preset.vocab_size, (batch, args.prompt_len), device="cuda")
    with torch.no_grad():
      seconds = _time(lambda: model.generate(ids, cache_implementation="static", **generation),
                      args.repeats)
    record(peer="transformers static cache + compile", batch=batch,
           tokens_per_second=batch * args.max_tokens / seconds)
  if args.out:
    with open(args.out, "w") as f:
      json.dump(rows, f, indent=1)


if __name__ == "__main__":
  main()
