"""Training a small Qwen3 target with an MTP head (DeepSeek-V3's objective), or an MTP head
alone for an existing target, and saving both as a Hugging Face checkpoint. Needs optax
(`pip install jspec[train]`); building the corpus needs Debian's `bible` command."""

from jspec.train.corpus import Document, build_corpus, load_corpus
from jspec.train.mtp_head import train_mtp_head, write_mtp_head
from jspec.train.saver import save_pretrained
from jspec.train.tokenizer import EOS_TOKEN, train_tokenizer
from jspec.train.trainer import TrainConfig, evaluate, init_models, train_joint

__all__ = ["Document", "EOS_TOKEN", "TrainConfig", "build_corpus", "evaluate", "init_models",
           "load_corpus", "save_pretrained", "train_joint", "train_mtp_head", "train_tokenizer",
           "write_mtp_head"]
