"""
Hugging Face tokenizers as tiktoken Encodings: load_hf_tokenizer(path) reads a checkpoint's tokenizer.json (or the
older GPT-2 layout, vocab.json + merges.txt) and returns a tiktoken Encoding that tokenizes exactly as Hugging Face
tokenizers does, and eos_ids(path) reads the ids that end a generation.

Why tiktoken: its Rust BPE is fast, it is already the project's tokenizer interface (encode_ordinary, encode,
decode, eot_token, n_vocab), and it saves a dependency on `tokenizers`/`transformers` at run time.

A byte-level BPE tokenizer.json (GPT-2, Qwen2/2.5/3, Llama-3) carries a tiktoken Encoding inside it: the vocab
is the ranks (once the strings are mapped back to bytes), the pre-tokenizer's regex is the pattern, the added
tokens are the special tokens. tiktoken then gives the same ids as Hugging Face if a handful of properties hold;
_from_json checks them and refuses a tokenizer.json that breaks one with a ValueError naming the file and the
problem, rather than tokenize slightly differently from the model's training. Two things tiktoken
lacks are added on top: the NFC normalizer, and added tokens that are matched in any text (not only when special
tokens are allowed).
"""
import functools
import json
import os
import re
import unicodedata

import tiktoken
from tiktoken.core import raise_disallowed_special_token

# the pre-tokenizer regex of GPT-2's ByteLevel(use_regex=true)
GPT2_PATTERN = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
SUPPORTED = "only byte-level BPE tokenizers (GPT-2, Qwen2/2.5/3, Llama-3 style) can be loaded"

def bytes_to_unicode():
    """GPT-2's table from a byte to the printable character that stands for it in vocab and merges strings:
    printable Latin-1 bytes stand for themselves, the other 68 get the characters from U+0100 on, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table

BYTE_OF = {c: b for b, c in bytes_to_unicode().items()}

@functools.lru_cache(maxsize=64)
def _alternation(tokens):
    """A regex with one group matching any of `tokens`, longest first: HF matches added tokens leftmost-longest."""
    return re.compile("(" + "|".join(map(re.escape, sorted(tokens, key=len, reverse=True))) + ")")

def _split(text, tokens):
    """[text, token, text, ..., text]: the even items are plain text, the odd ones are `tokens` found in it."""
    return _alternation(frozenset(tokens)).split(text) if tokens else [text]

class HFEncoding(tiktoken.Encoding):
    """A tiktoken Encoding plus the NFC normalizer and HF's added-token matching. A subclass, so that decode,
    n_vocab, the batch encoders etc. are tiktoken's own: only what differs is overridden."""

    def __init__(self, name, pat_str, ranks, added_tokens, nfc):
        super().__init__(name, pat_str=pat_str, mergeable_ranks=ranks,
                         special_tokens={t["content"]: t["id"] for t in added_tokens})
        self._added_tokens, self._nfc = added_tokens, nfc
        specials = [t["content"] for t in added_tokens if t["special"]]
        self._specials = frozenset(specials)
        # HF matches the added tokens that skip the normalizer in the raw text, and the others in the normalized
        # text between those; the ones that aren't special are matched even with special-token matching off
        plain = [t for t in added_tokens if not t["special"]]
        self._raw = frozenset(t["content"] for t in plain if not (nfc and t["normalized"]))
        self._normalized = frozenset(t["content"] for t in plain if nfc and t["normalized"])
        eot = next((s for s in ("<|endoftext|>", "<|end_of_text|>") if s in specials), (specials or [None])[0])
        self._eot = self._special_tokens.get(eot)

    def __reduce__(self):  # tiktoken pickles its own constructor's arguments: these are ours
        return HFEncoding, (self.name, self._pat_str, self._mergeable_ranks, self._added_tokens, self._nfc)

    @property
    def eot_token(self):
        """The end-of-text token: <|endoftext|>, else <|end_of_text|>, else the first special token. The ids that
        really end a checkpoint's generations are in its generation_config.json: see eos_ids()."""
        return self._eot

    def encode_ordinary(self, text):
        """Special tokens' text is plain text (HF's split_special_tokens=True); non-special added tokens still count."""
        return self._encode(text, frozenset())

    def encode(self, text, *, allowed_special=set(), disallowed_special="all"):  # noqa: B006 (tiktoken's signature)
        allowed = self._specials if allowed_special == "all" else self._specials & set(allowed_special)
        if disallowed_special == "all":
            disallowed_special = self._specials - allowed
        if disallowed_special and (m := _alternation(frozenset(disallowed_special)).search(text)):
            raise_disallowed_special_token(m.group())
        return self._encode(text, allowed)

    def _encode(self, text, specials):
        # tokens are matched before NFC runs, and NFC runs on each piece between them, never across one: NFC of
        # "<|im_start|>\u0338" would compose ">" + U+0338 into "≯" and destroy the token
        ids = []
        for i, piece in enumerate(_split(text, specials | self._raw)):
            if i % 2:
                ids.append(self._special_tokens[piece])
                continue
            piece = unicodedata.normalize("NFC", piece) if self._nfc else piece
            for j, p in enumerate(_split(piece, self._normalized)):
                ids += [self._special_tokens[p]] if j % 2 else super().encode_ordinary(p)
        return ids

def _hf_bpe(word, merge_rank):
    """HF's BPE of one pre-token: merge the adjacent pair that comes first in the merge list (leftmost on a tie)
    until no adjacent pair is in the list."""
    parts = list(word)
    while len(parts) > 1:
        i = min(range(len(parts) - 1), key=lambda i: merge_rank.get((parts[i], parts[i + 1]), len(merge_rank)))
        if (parts[i], parts[i + 1]) not in merge_rank:
            break
        parts[i:i + 2] = [parts[i] + parts[i + 1]]
    return parts

def _pattern(pre, refuse):
    """The pat_str of a pre-tokenizer: ByteLevel's own regex (GPT-2), or Split(Regex) then ByteLevel without one."""
    steps = pre.get("pretokenizers", []) if pre and pre.get("type") == "Sequence" else [pre]
    kinds = [s.get("type") if s else None for s in steps]
    if kinds and kinds[-1] == "ByteLevel" and steps[-1].get("add_prefix_space"):
        refuse("ByteLevel add_prefix_space is true (tiktoken adds no space)")
    if kinds == ["ByteLevel"] and steps[0].get("use_regex", True):
        return GPT2_PATTERN
    if kinds == ["Split", "ByteLevel"] and not steps[1].get("use_regex", True):
        split = steps[0]
        if "Regex" in split["pattern"] and split.get("behavior") == "Isolated" and not split.get("invert"):
            return split["pattern"]["Regex"]
    refuse(f"pre_tokenizer {kinds} is not ByteLevel(use_regex) nor Split(Regex, Isolated) + ByteLevel; {SUPPORTED}")

def _from_json(tok, file):
    """The HFEncoding of a parsed tokenizer.json, after checking what makes tiktoken exact."""
    def refuse(problem):
        raise ValueError(f"{file}: {problem}")

    model, normalizer = tok["model"], tok.get("normalizer")
    if model.get("type") != "BPE":
        refuse(f"model type {model.get('type')!r} is not BPE; {SUPPORTED}")
    if model.get("byte_fallback"):
        refuse(f"byte_fallback is true (a SentencePiece-style BPE, e.g. Llama-2/Mistral); {SUPPORTED}")
    if model.get("continuing_subword_prefix") or model.get("end_of_word_suffix"):
        refuse(f"continuing_subword_prefix/end_of_word_suffix is set (a WordPiece-like BPE); {SUPPORTED}")
    if model.get("dropout"):
        refuse("BPE dropout is set (random merges); set it to null")
    if normalizer not in (None, {"type": "NFC"}):
        refuse(f"normalizer {normalizer.get('type')!r} is not NFC or none; only those are reproduced")
    pat_str = _pattern(tok.get("pre_tokenizer"), refuse)

    added = tok.get("added_tokens", [])
    for t in added:
        if t.get("lstrip") or t.get("rstrip") or t.get("single_word"):
            refuse(f"added token {t['content']!r} has lstrip/rstrip/single_word set; only exact strings are matched")
        if t["special"] and t.get("normalized") and normalizer:
            refuse(f"special token {t['content']!r} is normalized (matched after NFC); only special tokens matched "
                   "in the raw text (normalized: false, as in hub files) are reproduced")
    # an added token may also be in the vocab (GPT-2's <|endoftext|>): it is matched whole, never a merge's product
    added_ids = {t["id"] for t in added}
    vocab = {s: i for s, i in model["vocab"].items() if i not in added_ids}
    if any(c not in BYTE_OF for s in vocab for c in s):
        refuse(f"vocab strings are not GPT-2 byte-level characters; {SUPPORTED}")
    ranks = {bytes(BYTE_OF[c] for c in s): i for s, i in vocab.items()}
    if sorted(ranks.values()) != list(range(len(ranks))):
        refuse("the BPE vocab ids are not contiguous from 0 (tiktoken's rank is the id)")
    if any(bytes([b]) not in ranks for b in range(256)):
        refuse(f"the vocab lacks some of the 256 single bytes; {SUPPORTED}")

    # HF merges the pair that comes first in the merge list, tiktoken the pair whose merged token has the lowest id:
    # the same choice when the merged token's id never decreases along the list (several merges per token are fine)
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in model["merges"]]
    last = -1
    for a, b in merges:
        if a + b not in vocab:
            refuse(f"merge {a!r} {b!r} makes a token that is not in the vocab")
        if vocab[a + b] < last:
            refuse(f"merge {a!r} {b!r} is out of rank order (merged tokens' ids must not decrease along the list)")
        last = vocab[a + b]
    # tiktoken returns a pre-token that is a vocab token whole; HF does only with ignore_merges, else it runs BPE
    if not model.get("ignore_merges"):
        merge_rank = {pair: r for r, pair in enumerate(merges)}
        for s in vocab:
            if len(s) > 1 and _hf_bpe(s, merge_rank) != [s]:
                refuse(f"vocab token {s!r} is not reachable by its merges and ignore_merges is false: HF would "
                       f"split it where tiktoken keeps it whole; {SUPPORTED}")
    return HFEncoding(os.path.basename(os.path.dirname(os.path.abspath(file))), pat_str, ranks, added,
                      nfc=normalizer is not None)

def _gpt2_files(path):
    """The older GPT-2 layout as a tokenizer.json would say it: ByteLevel regex, no normalizer, <|endoftext|>."""
    with open(os.path.join(path, "vocab.json"), encoding="utf-8") as f:
        vocab = json.load(f)
    with open(os.path.join(path, "merges.txt"), encoding="utf-8") as f:
        merges = [line for line in f.read().splitlines() if line and not line.startswith("#version")]
    added = [dict(id=vocab["<|endoftext|>"], content="<|endoftext|>", special=True)] if "<|endoftext|>" in vocab else []
    return dict(model=dict(type="BPE", vocab=vocab, merges=merges), pre_tokenizer=dict(type="ByteLevel"),
                added_tokens=added)

def load_hf_tokenizer(path):
    """A tiktoken Encoding from a tokenizer.json, or a directory holding one (or else vocab.json + merges.txt)."""
    if os.path.isdir(path) and not os.path.exists(os.path.join(path, "tokenizer.json")):
        return _from_json(_gpt2_files(path), os.path.join(path, "vocab.json"))
    file = os.path.join(path, "tokenizer.json") if os.path.isdir(path) else path
    with open(file, encoding="utf-8") as f:
        return _from_json(json.load(f), file)

def eos_ids(path):
    """The ids that end a generation of the checkpoint in directory `path`, sorted: generation_config.json's
    eos_token_id (an int or a list: instruct models stop on several), else config.json's; None if neither names one."""
    for name in ("generation_config.json", "config.json"):
        if os.path.exists(os.path.join(path, name)):
            with open(os.path.join(path, name)) as f:
                eos = json.load(f).get("eos_token_id")
            if eos is not None and eos != []:
                return sorted({eos} if isinstance(eos, int) else set(eos))
    return None
