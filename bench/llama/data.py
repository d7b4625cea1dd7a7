"""The benchmark's text: the Python standard library's ``.py`` source (docstrings, comments and
``pydoc_data``'s topics included), tokenized with a 32k byte-level BPE vocabulary trained on it.

  python -m bench.llama.data OUT_DIR [--vocab 32768]

needs the ``tokenizers`` package (PyPI) and writes ``OUT_DIR/tokenizer.json``, ``train.npy`` and
``heldout.npy`` (uint16 token ids, each file followed by the end-of-text token) and
``info.json``; the standard library of Python 3.11 gives about 9M tokens (18 MB). The benchmark
only reads the ``.npy`` files, so the GPU machine needs neither the tokenizer nor its library.
Without a token directory the benchmark and its CPU test read the same files' bytes as tokens
(``byte_tokens``), which any vocabulary of 256 or more covers.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import json
import pathlib
import sys
import time

import numpy as np

from bench import convergence
from bench.convergence import is_heldout, stdlib_files

END_OF_TEXT = "<|endoftext|>"


@functools.cache
def byte_tokens() -> tuple[np.ndarray, np.ndarray]:
  """(train, heldout): the files' bytes as token ids 0-255 (the CPU configuration's text), split
  as ``bench/convergence.py`` splits the same files."""
  corpus = convergence.stdlib_corpus()
  return corpus.train.astype(np.uint16), corpus.heldout.astype(np.uint16)


def load_tokens(directory) -> tuple[np.ndarray, np.ndarray, dict]:
  """(train, heldout, info) as written by ``build``."""
  directory = pathlib.Path(directory)
  info = json.loads((directory / "info.json").read_text())
  return (np.load(directory / "train.npy"), np.load(directory / "heldout.npy"), info)


def build(out_dir, vocab: int = 32768) -> dict:
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

  out = pathlib.Path(out_dir)
  out.mkdir(parents=True, exist_ok=True)
  root, files = stdlib_files()
  texts = {name: (root / name).read_bytes().decode("utf-8", errors="replace") for name in files}
  start = time.perf_counter()
  tokenizer = Tokenizer(models.BPE())
  tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tokenizer.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(
    vocab_size=vocab,
    min_frequency=2,
    special_tokens=[END_OF_TEXT],
    initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    show_progress=False,
  )
  train_names = [n for n in files if not is_heldout(n)]
  tokenizer.train_from_iterator((texts[n] for n in train_names), trainer=trainer)
  train_s = time.perf_counter() - start
  if tokenizer.get_vocab_size() > 65535:
    raise ValueError(f"vocabulary of {tokenizer.get_vocab_size()} does not fit uint16")
  eot = tokenizer.token_to_id(END_OF_TEXT)
  tokenizer.save(str(out / "tokenizer.json"))
  arrays = {}
  for split, names in (("train", train_names), ("heldout", [n for n in files if is_heldout(n)])):
    ids = []
    for enc in tokenizer.encode_batch([texts[n] for n in names]):
      ids.extend(enc.ids)
      ids.append(eot)
    arrays[split] = np.asarray(ids, np.uint16)
    np.save(out / f"{split}.npy", arrays[split])
  n_bytes = sum(len(texts[n].encode()) for n in train_names)
  info = dict(
    python=sys.version.split()[0],
    files=len(files),
    vocab=tokenizer.get_vocab_size(),
    train_tokens=int(arrays["train"].size),
    heldout_tokens=int(arrays["heldout"].size),
    train_bytes_per_token=n_bytes / arrays["train"].size,
    tokenizer_train_s=train_s,
    sha256=hashlib.sha256(arrays["train"].tobytes() + arrays["heldout"].tobytes()).hexdigest()[:16],
  )
  (out / "info.json").write_text(json.dumps(info, indent=1) + "\n")
  return info


def main(argv=None) -> None:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("out_dir")
  p.add_argument("--vocab", type=int, default=32768)
  args = p.parse_args(argv)
  print(json.dumps(build(args.out_dir, args.vocab)))


if __name__ == "__main__":
  main()
