"""Every option of `jspec.LLM`, declared once: `EngineOptions` (vLLM's `EngineArgs` shape).

`LLM(model, **options)` takes them as keywords (its signature is made from this class), the
build reads them from one `EngineOptions`, and the CLI makes its flags from the fields whose
metadata name one (`cli_flags`), with this help text. `check()` refuses, before any weight is
read, every value that needs no model to be judged wrong.
"""

from __future__ import annotations

import dataclasses
import inspect

from jspec.config import SpecConfig, is_int
from jspec.models.caches import RECURRENT_COMMIT_MODES
from jspec.models.decode_attention import ATTENTION_BACKENDS
from jspec.models.projections import PROJECTION_BACKENDS
from jspec.models.row_kernels import NORM_BACKENDS
from jspec.pallas_kernels import platform
from jspec.sharding.moe import EP_STRATEGIES
from jspec.sharding.rules import MeshConfig, ShardingRules
from jspec.sharding.tensor_parallel import ALL_REDUCE_BACKENDS

# batching= -> the scheduler that runs every generate call (jspec.schedulers).
# "continuous": a finished sequence's slot takes the next request inside the loop;
# "waves": batches that end with their longest request (kept to compare against).
BATCHING_MODES = ("continuous", "waves")
MOE_BACKENDS_HELP = "auto | pallas | ragged_dot | dense | reference"


def _option(default, help: str, cli: bool = False, choices=None, type=None):
  """A field with its help text; `cli`: the CLI offers it as --name-with-dashes."""
  return dataclasses.field(default=default, metadata=dict(help=help, cli=cli, choices=choices,
                                                           type=type))


def _int_or_auto(value: str):
  return value if value == "auto" else int(value)


@dataclasses.dataclass(frozen=True)
class EngineOptions:
  """How `jspec.LLM` builds and runs a model (every keyword but `model`)."""

  mesh: MeshConfig | None = _option(
      None, "dp / tp / ep sizes (jspec.MeshConfig); None: one device")
  speculative_config: SpecConfig | dict | None = _option(
      None, "a dict such as {'method': 'mtp', 'num_speculative_tokens': 3}; None: no drafter")
  max_model_len: int | None = _option(
      None, "default: the model's max_position_embeddings, at most 4096", cli=True, type=int)
  dtype: str = _option(
      "bfloat16", "auto (the checkpoint's own) | float32 | bfloat16 | float16", cli=True)
  moe_backend: str = _option("auto", MOE_BACKENDS_HELP, cli=True)
  seed: int = _option(0, "the seed of random weights and of sampling without a request seed")
  max_num_seqs: int | str = _option(
      "auto", "sequences decoded at once (slots); 'auto': as many as the memory plan fits",
      cli=True, type=_int_or_auto)
  compilation_cache_dir: str | None = _option(
      None, "JAX's persistent compilation cache (default: $JSPEC_COMPILATION_CACHE or "
            "~/.cache/jspec/xla; 'off': none)")
  ep_strategy: str = _option(
      "auto", "how MoE layers exchange tokens over ep (jspec.sharding.moe)", cli=True,
      choices=EP_STRATEGIES)
  device_memory_bytes: int | None = _option(
      None, "bytes per device for weights and caches (default: the device's own)")
  prefill_chunk_size: int = _option(
      256, "prompt tokens prefilled per step (a power of two >= 16)", cli=True, type=int)
  attention_backend: str = _option(
      "auto", "decode/verify attention: XLA, or the split-S Pallas kernels (auto: the kernels "
              "on Hopper GPUs)", cli=True, choices=ATTENTION_BACKENDS)
  recurrent_commit: str = _option(
      "store", "linear-attention layers after a verify: store each position's state, or "
               "replay the accepted tokens", cli=True, choices=RECURRENT_COMMIT_MODES)
  sharding_rules: ShardingRules | None = _option(
      None, "the logical-axis -> mesh-axis table (jspec.ShardingRules)")
  batching: str = _option(
      "continuous", "continuous: a finished sequence's slot takes the next request inside "
                    "the loop; waves: batches that end with their longest request",
      cli=True, choices=BATCHING_MODES)
  projection_backend: str = _option(
      "auto", "attention projections of a few rows: XLA's dot, or the skinny Pallas kernel "
              "(auto: jspec.models.projections)", cli=True, choices=PROJECTION_BACKENDS)
  norm_backend: str = _option(
      "auto", "decode/verify steps' residual adds, norms and RoPE: XLA's fusions, or one "
              "Pallas kernel per group (auto: the kernels on GPUs)", cli=True,
      choices=NORM_BACKENDS)
  all_reduce_backend: str = _option(
      "auto", "tensor-parallel layers: partitioner = XLA places products and all-reduces; "
              "xla / kernel = jspec's shard-by-shard products reduced by XLA's all-reduce / "
              "jspec's workspace one-shot kernel (Hopper GPUs of one process); auto = kernel "
              "where it runs, else partitioner", cli=True, choices=ALL_REDUCE_BACKENDS)

  def check(self) -> SpecConfig | None:
    """The options that need no model, refused with the offending value and what is valid;
    returns the parsed speculative_config."""
    def one_of(name, valid):
      value = getattr(self, name)
      if value not in valid:
        raise ValueError(f"{name}={value!r} is not supported; choose one of {tuple(valid)}")

    if not is_int(self.seed):
      raise ValueError(f"seed={self.seed!r} must be an integer")
    one_of("attention_backend", ATTENTION_BACKENDS)
    one_of("projection_backend", PROJECTION_BACKENDS)
    one_of("norm_backend", NORM_BACKENDS)
    one_of("all_reduce_backend", ALL_REDUCE_BACKENDS)
    reduce, project = self.all_reduce_backend, self.projection_backend
    if reduce in ("xla", "kernel") and project == "xla":
      raise ValueError(f"all_reduce_backend={reduce!r} reduces the tensor-parallel "
                       "products jspec writes shard by shard; projection_backend='xla' leaves "
                       "them to XLA's partitioner: use projection_backend='auto' or 'pallas'")
    if reduce == "partitioner" and project == "pallas":
      raise ValueError("all_reduce_backend='partitioner' leaves the tensor-parallel products "
                       "to XLA's partitioner; projection_backend='pallas' writes them shard by "
                       "shard: use projection_backend='auto' or 'xla'")
    if reduce == "kernel" and not platform.on_hopper():
      raise ValueError("all_reduce_backend='kernel' needs Hopper GPUs (its one-shot kernel "
                       "reads peer memory over NVLink, which no interpreter simulates); use "
                       "'auto'")
    one_of("ep_strategy", EP_STRATEGIES)  # checked on every mesh, not only where ep > 1
    one_of("recurrent_commit", RECURRENT_COMMIT_MODES)
    spec = SpecConfig.parse(self.speculative_config)
    length = self.max_model_len
    if length is not None and (not isinstance(length, int) or length < 2):
      raise ValueError(f"max_model_len={length!r} must be an integer >= 2")
    seqs = self.max_num_seqs
    if seqs != "auto" and (not isinstance(seqs, int) or seqs < 1):
      raise ValueError(f"max_num_seqs={seqs!r} must be an integer >= 1 or 'auto'")
    chunk = self.prefill_chunk_size
    if not (isinstance(chunk, int) and chunk >= 16 and chunk & (chunk - 1) == 0):
      raise ValueError(f"prefill_chunk_size={chunk!r} must be a power of two >= 16")
    one_of("batching", BATCHING_MODES)
    if spec and spec.draft_tp not in (None, 1, (self.mesh or MeshConfig()).tp):
      raise ValueError(f"draft_tp={spec.draft_tp} must be 1 (the draft replicated over tp) "
                       f"or the target's tp={(self.mesh or MeshConfig()).tp}")
    return spec


OPTION_NAMES = tuple(field.name for field in dataclasses.fields(EngineOptions))


def signature_with_options(function, after: str):
  """`function`'s signature with EngineOptions' fields as keyword-only parameters in place of
  its **kwargs, after the parameter `after` (for help(), IDEs and Jupyter)."""
  signature = inspect.signature(function)
  params = [p for p in signature.parameters.values() if p.kind != p.VAR_KEYWORD]
  at = [p.name for p in params].index(after) + 1
  options = [inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=f.default,
                               annotation=f.type) for f in dataclasses.fields(EngineOptions)]
  return signature.replace(parameters=params[:at] + options + params[at:])


def cli_option_names() -> tuple[str, ...]:
  return tuple(f.name for f in dataclasses.fields(EngineOptions) if f.metadata["cli"])


def cli_flags(parser, names=None, defaults: dict | None = None):
  """Adds --name-with-dashes for each option the CLI offers (or those in `names`), with its
  help, choices and type; `defaults` overrides an option's default for this parser."""
  defaults = defaults or {}
  for field in dataclasses.fields(EngineOptions):
    meta = field.metadata
    if not meta["cli"] or (names is not None and field.name not in names):
      continue
    kwargs = dict(default=defaults.get(field.name, field.default), help=meta["help"])
    if meta["choices"] is not None:
      kwargs["choices"] = list(meta["choices"])
    if meta["type"] is not None:
      kwargs["type"] = meta["type"]
    parser.add_argument("--" + field.name.replace("_", "-"), **kwargs)
