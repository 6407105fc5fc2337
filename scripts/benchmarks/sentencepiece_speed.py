"""
Encoding speed of lib/sentencepiece.py beside Hugging Face's `tokenizers` (Rust) and transformers,
on a GSM8K-sized synthetic corpus (7,473 questions of ~250 characters) with a real SentencePiece
tokenizer, and the ids of all three compared text by text. Run in a side environment that has
tokenizers and transformers (never nanoGRPO's own):

    python scripts/benchmarks/sentencepiece_speed.py /tmp/gemma3-hf/tokenizer.json

(transformers' tokenizer.json of the Gemma 3 270M GGUF: AutoTokenizer.from_pretrained(dir,
gguf_file=...).save_pretrained(...)). The words come from a Zipf law over a made-up 20,000-word
lexicon, so that the corpus repeats words about as much as English does and the cache of
lib/sentencepiece.py gets no easier text.
"""
import itertools
import os
import random
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
from lib.tokenizer import load_hf_tokenizer  # noqa: E402

QUESTIONS, CHARS = 7473, 250  # GSM8K's training set: 7,473 questions, ~240 characters on average


def corpus(seed=0):
    rng = random.Random(seed)
    syllables = [c + v for c in "bcdfghjklmnprstvwz" for v in ("a", "e", "i", "o", "u", "ai", "ou")]
    lengths = (1, 2, 2, 3, 4)  # syllables a word
    lexicon = ["".join(rng.choices(syllables, k=rng.choice(lengths))) for _ in range(20_000)]
    cumulative = list(itertools.accumulate(1 / (r + 1) for r in range(len(lexicon))))
    out = []
    for _ in range(QUESTIONS):
        words = []
        while sum(map(len, words)) + len(words) < CHARS:
            roll = rng.random()
            if roll < 0.1:
                word = str(rng.randint(0, 5000))
            elif roll < 0.2:
                word = rng.choice((",", ".", "?", "$", "%"))
            else:
                word = rng.choices(lexicon, cum_weights=cumulative)[0]
            words.append(word.capitalize() if rng.random() < 0.05 else word)
        out.append(" ".join(words))
    return out


def timed(f):
    start = time.perf_counter()
    out = f()
    return out, time.perf_counter() - start


def main(file):
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast
    texts = corpus()
    print(f"{len(texts)} texts, {sum(map(len, texts)):,} characters")
    ours, load = timed(lambda: load_hf_tokenizer(file))
    ids, cold = timed(lambda: [ours.encode(t, allowed_special="all") for t in texts])
    _, warm = timed(lambda: [ours.encode(t, allowed_special="all") for t in texts])
    rust = Tokenizer.from_file(file)
    rust_ids, rust_loop = timed(lambda: [rust.encode(t, add_special_tokens=False).ids
                                         for t in texts])
    _, rust_batch = timed(lambda: rust.encode_batch(texts, add_special_tokens=False))
    hf = PreTrainedTokenizerFast(tokenizer_file=file)
    hf_ids, hf_batch = timed(lambda: hf(texts, add_special_tokens=False).input_ids)
    assert ids == rust_ids == hf_ids, "the ids differ"
    print(f"ids equal on all {len(texts)} texts ({sum(map(len, ids)):,} tokens)")
    for name, s in (("lib/sentencepiece.py load", load),
                    ("lib/sentencepiece.py, empty cache", cold),
                    ("lib/sentencepiece.py, cache filled", warm),
                    ("tokenizers, one text a call", rust_loop),
                    ("tokenizers encode_batch", rust_batch),
                    ("transformers, one batch call", hf_batch)):
        print(f"{name:40s} {s:7.2f} s")


if __name__ == "__main__":
    main(sys.argv[1])
