"""Train the CPU default model's tokenizer: byte-level BPE over source code, one line per word.

Why: with the byte tokenizer a 200 KB source tar is ~200k tokens, and the pin's indexer cost
grows with the square of the token count. This BPE turns the same text into ~4x fewer tokens
(``bench/results/pin-cpu.json``). Pre-tokenizing by *lines* (not GPT-2's word regex) lets merges
take a line's indentation with its first words ("        return self."), which is where source
code's redundancy is: 4.97 bytes per token at 16,384 ids on the prometheus_client 0.26.0 source
tar of the README, against 3.56 with GPT-2's regex.

The training text is this Python's own standard library (``*.py``, tests and IDLE left out,
sorted), so no corpus a user pins was seen in training. The result is committed as
``corpusd/model/tiny_tokenizer.json``; it enters the tiny model's fingerprint through the
``tokenizer.json`` that ``corpusd model init`` writes beside the weights.

    python -m tools.train_tokenizer [--vocab 16384] [--out corpusd/model/tiny_tokenizer.json]
"""

from __future__ import annotations

import argparse
import sysconfig
import time
from pathlib import Path

#: Ids 0 and 1: the tiny model's ``bos_token_id`` / ``eos_token_id``.
SPECIALS = ("<bos>", "<eos>")
_LEFT_OUT = frozenset({"test", "tests", "idlelib", "site-packages", "lib2to3"})


def training_files() -> list[str]:
    std = Path(sysconfig.get_paths()["stdlib"])
    return [
        str(f)
        for f in sorted(std.rglob("*.py"))
        if not _LEFT_OUT.intersection(f.relative_to(std).parts)
    ]


def train(files: list[str], vocab: int) -> object:
    """A ``tokenizers.Tokenizer`` trained on ``files``: lines split out (newline kept at the end
    of its line), then GPT-2's byte-to-unicode map, then BPE with tokens of at most 32 bytes."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(r"[^\n]*\n?"), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        special_tokens=list(SPECIALS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        max_token_length=32,
        show_progress=False,
    )
    tok.train(files, trainer)
    return tok


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--vocab", type=int, default=16384)
    p.add_argument("--out", default="corpusd/model/tiny_tokenizer.json")
    a = p.parse_args()
    files = training_files()
    t = time.perf_counter()
    tok = train(files, a.vocab)
    tok.save(a.out)  # type: ignore[attr-defined]
    size = sum(Path(f).stat().st_size for f in files)
    print(
        f"trained {a.vocab:,} ids on {len(files)} files ({size / 1e6:.1f} MB) in "
        f"{time.perf_counter() - t:.0f} s → {a.out}"
    )


if __name__ == "__main__":
    main()
