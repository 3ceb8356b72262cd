"""Training text available on every machine here: the King James Bible and Python's stdlib.

Documents are whole units so that the held-out split never leaks a neighbour of a training
window: one Bible *book* per document (read through Debian's `bible` command, package
`bible-kjv`, needed only to build the corpus, never at run time) and one stdlib *file* per
document (the `.py` files under `sysconfig.get_paths()["stdlib"]`, test suites included: the
library alone is only ~2.5M tokens, and a small model over-fits that within minutes). The split
is seeded and by document.

A built corpus is a folder of JSON lines (`train.jsonl`, `heldout.jsonl`, one
{"source", "name", "text"} per line) so that it can be built on one machine and trained on
another that lacks `bible`.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import re
import shutil
import subprocess
import sysconfig

SOURCES = ("bible", "python")
_BIBLE_RANGE = "Genesis1:1-Revelation22:21"
_SKIPPED_DIRS = {"site-packages", "__pycache__", "encodings"}
_MAX_FILE_BYTES = 200_000  # a few generated tables (unicode data, big test vectors) dominate


@dataclasses.dataclass(frozen=True)
class Document:
  source: str  # "bible" or "python"
  name: str    # book abbreviation or path relative to the stdlib
  text: str


def bible_documents() -> list[Document]:
  """One document per book: the verses as `bible -f` prints them ("Ge1:1 In the beginning...")."""
  if shutil.which("bible") is None:
    raise FileNotFoundError("the `bible` command is missing: install Debian's bible-kjv package "
                            "(apt-get install bible-kjv) to build the corpus")
  out = subprocess.run(["bible", "-f", _BIBLE_RANGE], check=True, capture_output=True,
                       text=True).stdout
  books: dict[str, list[str]] = {}
  for line in out.splitlines():
    line = line.strip()
    m = re.match(r"^([1-3]?[A-Za-z]+)\d+:\d+ ", line)
    if not m:
      continue
    books.setdefault(m.group(1), []).append(line)
  return [Document("bible", book, "\n".join(lines) + "\n") for book, lines in books.items()]


def python_documents(stdlib: str | None = None) -> list[Document]:
  """One document per stdlib `.py` file (sorted, so the list is the same on every run)."""
  stdlib = stdlib or sysconfig.get_paths()["stdlib"]
  docs = []
  for root, dirs, files in os.walk(stdlib):
    dirs[:] = sorted(d for d in dirs if d not in _SKIPPED_DIRS)
    for fname in sorted(files):
      path = os.path.join(root, fname)
      if not fname.endswith(".py") or os.path.getsize(path) > _MAX_FILE_BYTES:
        continue
      with open(path, encoding="utf-8", errors="replace") as f:
        text = f.read()
      if text.strip():
        docs.append(Document("python", os.path.relpath(path, stdlib), text))
  return docs


def split_documents(docs: list[Document], heldout_fraction: float, seed: int):
  """(train, heldout): a seeded shuffle of whole documents, per source, at least one each."""
  train, heldout = [], []
  for source in SOURCES:
    group = [d for d in docs if d.source == source]
    order = list(range(len(group)))
    random.Random(f"{seed}-{source}").shuffle(order)
    n_held = max(1, round(heldout_fraction * len(group))) if group else 0
    held_ids = set(order[:n_held])
    for i, d in enumerate(group):
      (heldout if i in held_ids else train).append(d)
  return train, heldout


def build_corpus(out_dir: str, heldout_fraction: float = 0.05, seed: int = 0,
                 stdlib: str | None = None) -> dict:
  """Writes train.jsonl / heldout.jsonl / stats.json under out_dir; returns the stats."""
  docs = bible_documents() + python_documents(stdlib)
  train, heldout = split_documents(docs, heldout_fraction, seed)
  os.makedirs(out_dir, exist_ok=True)
  for name, part in (("train", train), ("heldout", heldout)):
    with open(os.path.join(out_dir, f"{name}.jsonl"), "w") as f:
      for d in part:
        f.write(json.dumps(dataclasses.asdict(d)) + "\n")
  stats = {f"{name}_{source}": {"documents": sum(d.source == source for d in part),
                                "chars": sum(len(d.text) for d in part if d.source == source)}
           for name, part in (("train", train), ("heldout", heldout)) for source in SOURCES}
  stats["heldout_names"] = sorted(d.name for d in heldout if d.source == "bible")
  stats["seed"], stats["heldout_fraction"] = seed, heldout_fraction
  with open(os.path.join(out_dir, "stats.json"), "w") as f:
    json.dump(stats, f, indent=1)
  return stats


def load_corpus(corpus_dir: str, split: str) -> list[Document]:
  path = os.path.join(corpus_dir, f"{split}.jsonl")
  if not os.path.isfile(path):
    raise FileNotFoundError(f"{path} is missing: build the corpus first (build_corpus)")
  with open(path) as f:
    return [Document(**json.loads(line)) for line in f]
