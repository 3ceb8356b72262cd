"""`jspec generate | demo | convert | bench`."""

from __future__ import annotations

import argparse
import signal
import sys
import threading


def _add_model_args(parser, model_required: bool):
  parser.add_argument("--model", required=model_required, default=None,
                      help="local Hugging Face checkpoint directory"
                      + ("" if model_required else " (default: the built-in demo model)"))
  # The engine's own options, their help and choices declared once (jspec.options; imported
  # here, after main's Ctrl-C handler: it imports JAX); the CLI reads the checkpoint's dtype
  # unless told otherwise.
  from jspec.options import cli_flags
  cli_flags(parser, defaults={"dtype": "auto"})
  parser.add_argument("--dp", type=int, default=1,
                      help="data parallelism: sequences split over this many device groups")
  parser.add_argument("--tp", type=int, default=1,
                      help="tensor parallelism: heads and MLP columns split over this many "
                           "devices")
  parser.add_argument("--ep", type=int, default=1,
                      help="expert parallelism (MoE models): experts split over this many "
                           "devices")
  parser.add_argument("--vocab-replicated", action="store_true",
                      help="keep the embedding and lm_head whole on every tp shard: one more "
                           "copy of them per GPU, no vocabulary collectives in the step "
                           "(measured no faster than the split vocabulary: tp = 2, batch 1 on "
                           "2 H100s, 1.15x against 1.16x one GPU)")


def _add_spec_args(parser):
  from jspec.config import SPEC_METHODS
  parser.add_argument("--spec", default="none", choices=["none", *SPEC_METHODS],
                      help="drafter: the checkpoint's MTP head, n-gram lookup, a separate draft "
                           "model or an EAGLE-3 head (both from --draft-model), or none")
  parser.add_argument("--draft-model", default=None, metavar="DIR",
                      help="draft_model / eagle3: the drafter's local Hugging Face directory")
  parser.add_argument("--k", type=int, default=3, help="draft tokens per step")
  parser.add_argument("--prompt-lookup-min", type=int, default=1,
                      help="ngram: the shortest n-gram of the context matched against its end")
  parser.add_argument("--prompt-lookup-max", type=int, default=3,
                      help="ngram: the longest n-gram matched (longer matches are tried first)")


def _spec_config(args):
  if getattr(args, "spec", "none") == "none":
    if getattr(args, "draft_model", None) is not None:
      raise ValueError("--draft-model needs --spec draft_model or --spec eagle3")
    return None
  spec = {"method": args.spec, "num_speculative_tokens": args.k}
  if args.spec == "ngram":
    spec.update(prompt_lookup_min=args.prompt_lookup_min, prompt_lookup_max=args.prompt_lookup_max)
  if args.draft_model is not None:  # SpecConfig refuses it for methods that take no drafter
    spec["model"] = args.draft_model
  return spec


def _build_llm(args, model_dir):
  import jspec
  # The mesh takes the first dp*tp*ep devices (jspec.MeshConfig).
  mesh = jspec.MeshConfig(dp=args.dp, tp=args.tp, ep=args.ep)
  rules = jspec.ShardingRules(vocab=None) if args.vocab_replicated else None
  from jspec.options import cli_option_names
  options = {name: getattr(args, name) for name in cli_option_names()}
  return jspec.LLM(model=model_dir, mesh=mesh, speculative_config=_spec_config(args),
                   sharding_rules=rules, **options)


def _token_ids(text: str, flag: str) -> list[int]:
  """'1, 2 3' -> [1, 2, 3]."""
  try:
    return [int(t) for t in text.replace(",", " ").split()]
  except ValueError:
    raise ValueError(f"{flag} takes integer token ids separated by commas or spaces, got "
                     f"{text!r}") from None


def cmd_generate(args):
  import jspec
  from jspec.assets import demo_model_path
  # Everything the request says is checked before the model is loaded.
  stop = None if args.stop_token_ids is None else _token_ids(args.stop_token_ids,
                                                             "--stop-token-ids")
  params = jspec.SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                                max_tokens=args.max_tokens, seed=args.seed,
                                stop_token_ids=stop, ignore_eos=args.ignore_eos, stop=args.stop)
  jspec.SpecConfig.parse(_spec_config(args))
  prompts = args.prompt
  if args.token_ids:
    prompts = [_token_ids(p, "--prompt") for p in prompts]
  llm = _build_llm(args, args.model or demo_model_path())
  outs = llm.generate(prompts, params)  # one batch: repeated --prompt run together
  for i, result in enumerate(outs):
    if len(outs) > 1:
      print(f"--- prompt {i} [finish: {result.finish_reason}]")
    print(result.text if result.text is not None else result.token_ids)
  finish = f"[finish: {outs[0].finish_reason}] " if len(outs) == 1 else ""
  print(f"{finish}{outs.metrics.summary()}", file=sys.stderr)


def cmd_demo(args):
  from jspec.demo import run_demo
  run_demo(args)


def cmd_convert(args):
  if args.quantize == "fp8":
    from jspec.quantize_fp8 import quantize_checkpoint
    summary = quantize_checkpoint(args.model, args.out,
                                  128 if args.block_size is None else args.block_size)
    print(f"wrote {args.out}: {summary.quantized} FP8 weights, {summary.kept} tensors kept")
    return
  if args.block_size is not None:
    raise ValueError("--block-size is the FP8 block of --quantize fp8; add --quantize fp8")
  import jspec
  from jspec.checkpoint import check_output_dir, save_converted
  check_output_dir(args.out)  # before the model is loaded
  # One slot: the conversion reads and writes the weights; its caches are never used.
  llm = jspec.LLM(model=args.model, dtype=args.dtype, max_num_seqs=1)
  save_converted(llm, args.out)
  print(f"wrote {args.out}")


def cmd_bench(args):
  import jax
  # Refused at once: on a CPU the grid builds real-size models for minutes, then prints
  # bandwidths and roofline shares that mean nothing.
  platform = jax.devices()[0].platform
  if platform != "gpu" and not args.allow_cpu:
    raise ValueError(f"jspec bench measures a GPU (step times against its HBM roofline), and "
                     f"this machine has none (JAX's devices are {platform!r}); run it on a "
                     f"GPU, or pass --allow-cpu for a smoke run whose timings mean nothing")
  from jspec.bench.report import run_bench
  run_bench(args)


class _ShowDefaults(argparse.ArgumentDefaultsHelpFormatter):
  """Every option's default in its help, except None and False (whose help says what they
  mean: no seed, the demo model, a flag not given)."""

  def _get_help_string(self, action):
    if action.default in (None, False) or action.default is argparse.SUPPRESS:
      return action.help
    return super()._get_help_string(action)


def _subcommand(sub, name: str, **kwargs):
  """A subcommand whose --help shows its defaults, and which takes no option for a prefix of
  another (`--stop` was once read as `--stop-token-ids`)."""
  return sub.add_parser(name, formatter_class=_ShowDefaults, allow_abbrev=False, **kwargs)


def build_parser() -> argparse.ArgumentParser:
  from jspec import __version__
  parser = argparse.ArgumentParser(prog="jspec", description=__doc__, allow_abbrev=False)
  parser.add_argument("--version", action="version", version=f"jspec {__version__}")
  sub = parser.add_subparsers(dest="command", required=True)

  gen = _subcommand(sub, "generate", help="generate from one or more prompts (one batch)")
  _add_model_args(gen, model_required=False)
  _add_spec_args(gen)
  gen.add_argument("--prompt", required=True, action="append",
                   help="repeat for several prompts, generated as one batch")
  gen.add_argument("--token-ids", action="store_true",
                   help="read --prompt as token ids (for checkpoints without a tokenizer)")
  gen.add_argument("--max-tokens", type=int, default=64,
                   help="new tokens per prompt at most (prompt + max tokens <= --max-model-len)")
  gen.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
  gen.add_argument("--top-k", type=int, default=0, help="0 or -1: no top-k")
  gen.add_argument("--top-p", type=float, default=1.0,
                   help="nucleus sampling: the smallest set of tokens holding this much "
                        "probability (1: all)")
  gen.add_argument("--seed", type=int, default=None,
                   help="sampling seed: the same seed gives the same tokens in any batch")
  gen.add_argument("--stop-token-ids", default=None, metavar="IDS",
                   help="token ids that end a sequence besides EOS, e.g. '13,198'")
  gen.add_argument("--stop", action="append", default=None, metavar="TEXT",
                   help="a string that ends a completion (the text ends before it); repeat "
                        "for several; needs the model's tokenizer")
  gen.add_argument("--ignore-eos", action="store_true",
                   help="generate --max-tokens tokens even past EOS")
  gen.set_defaults(func=cmd_generate)

  demo = _subcommand(sub, "demo", help="the built-in model: text, acceptance and tokens/s")
  demo.add_argument("--k", type=int, default=3, help="MTP draft tokens per step")
  demo.add_argument("--max-tokens", type=int, default=96, help="new tokens per prompt")
  demo.set_defaults(func=cmd_demo)

  conv = _subcommand(sub, "convert", help="convert a HF checkpoint to jspec's orbax format, or "
                                         "quantize it to FP8 (--quantize fp8)")
  conv.add_argument("--model", required=True, help="local Hugging Face checkpoint directory")
  conv.add_argument("--dtype", default="auto",
                    help="auto (the checkpoint's own) | float32 | bfloat16 | float16 (orbax "
                         "copies; --quantize fp8 keeps the unquantized tensors as stored)")
  conv.add_argument("--out", required=True,
                    help="the directory to write (new, or empty)")
  conv.add_argument("--quantize", choices=["fp8"], default=None,
                    help="fp8: write the checkpoint as block-scaled FP8 safetensors in the "
                         "published layout (DeepSeek-V3, Qwen FP8), not orbax")
  conv.add_argument("--block-size", type=int, default=None,
                    help="FP8 block (square) of --quantize fp8 (default 128)")
  conv.set_defaults(func=cmd_convert)

  bench = _subcommand(sub, "bench", help="step costs vs the HBM roofline on real-size random "
                                       "models (run on a GPU)")
  bench.add_argument("--models", nargs="+", default=["qwen3-8b", "qwen3-30b-a3b"],
                     help="presets: qwen3-8b, qwen3-30b-a3b, qwen3.5-9b, qwen3.5-35b-a3b, "
                          "deepseek-v3, glm-4.5-air, llama-3.1-8b, llama-3.2-1b, "
                          "mixtral-8x7b, tiny-moe, tiny-mla, tiny-glm (MLA presets also time "
                          "the attention over the latent cache)")
  bench.add_argument("--layers", type=int, default=0, help="override the presets' layer count")
  bench.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32, 128],
                     help="sequences per step")
  bench.add_argument("--context", type=int, nargs="+", default=[512, 8192],
                     help="tokens already in the cache")
  bench.add_argument("--k", type=int, default=3, help="MTP draft tokens per step")
  bench.add_argument("--acceptance", type=float, nargs="+", default=[2.0, 2.5, 3.0],
                     help="mean acceptance lengths for the derived speedup")
  bench.add_argument("--draft-vocab-size", type=int, default=0,
                     help="time the MTP head over a reduced draft vocabulary of this many tokens")
  bench.add_argument("--dtype", default="bfloat16", help="the weights' and caches' dtype")
  bench.add_argument("--fp8", action="store_true",
                     help="the presets as FP8 checkpoints (e4m3 projections and experts with "
                          "128 x 128 block scales, as DeepSeek-V3 and the Qwen FP8 releases); "
                          "the roofline counts their bytes")
  from jspec.options import cli_flags
  cli_flags(bench, names=("moe_backend", "attention_backend", "norm_backend",
                          "recurrent_commit"))
  bench.add_argument("--bandwidth-bytes", type=int, default=2 << 30,
                     help="bytes the HBM read / copy probes move")
  bench.add_argument("--proof", action="store_true",
                     help="also time the trained demo model with and without MTP")
  bench.add_argument("--out", default="benchmarks/results",
                     help="where bench.json and bench.png go")
  bench.add_argument("--allow-cpu", action="store_true",
                     help="run without a GPU: a smoke test of the report (its timings mean "
                          "nothing)")
  bench.set_defaults(func=cmd_bench)
  return parser


def main(argv=None):
  previous = _exit_on_ctrl_c()  # first: everything after may import JAX
  parser = build_parser()
  try:
    args = parser.parse_args(argv)
    args.func(args)
  except (ValueError, FileNotFoundError, FileExistsError) as err:
    print(f"jspec: error: {err}", file=sys.stderr)
    return 2
  except KeyboardInterrupt:
    _interrupted()
  finally:
    if previous is not None:
      signal.signal(signal.SIGINT, previous)
  return 0


def _interrupted(*_):
  """Ctrl-C: device work under way on jspec's threads cannot be stopped; not waited for."""
  from jspec import interrupt
  print("jspec: interrupted", file=sys.stderr)
  interrupt.exit_now(130)


def _exit_on_ctrl_c():
  """Ctrl-C ends the command from the signal handler itself (the previous handler returned;
  None off the main thread, where none can be set). A KeyboardInterrupt raised instead can be
  lost: Python drops one raised inside a finalizer or a weakref callback ("Exception ignored
  in ..."), the likely reason why a command once ran to its end with status 0 after a Ctrl-C
  while compiling."""
  if threading.current_thread() is not threading.main_thread():
    return None
  return signal.signal(signal.SIGINT, _interrupted)


if __name__ == "__main__":
  sys.exit(main())
