"""
Hugging Face tokenizers as tiktoken Encodings: load_hf_tokenizer(path) reads a checkpoint's tokenizer.json (or the
older GPT-2 layout, vocab.json + merges.txt, or a .gguf file's metadata, which lib/gguf_file.py turns into a
tokenizer.json and the padding tokens llama.cpp's converter adds) and returns a tiktoken Encoding that tokenizes
exactly as Hugging Face tokenizers does, and eos_ids(path) reads the ids that end a generation. The chat templates
are lib/chat.py's.

Why tiktoken: its Rust BPE is fast, it is already the project's tokenizer interface (encode_ordinary, encode,
decode, eot_token, n_vocab), and it saves a dependency on `tokenizers`/`transformers` at run time.

A byte-level BPE tokenizer.json (GPT-2, SmolLM, Qwen2/2.5/3, Llama-3) carries a tiktoken Encoding inside it: the
vocab is the ranks (once the strings are mapped back to bytes; they may start past the added tokens, as SmolLM2's
do), the pre-tokenizer's regex is the pattern, the added tokens are the special tokens. tiktoken then gives the
same ids as Hugging Face if a handful of properties hold; _from_json checks them and refuses a tokenizer.json that
breaks one with a ValueError naming the file and the problem, rather than tokenize slightly differently from the
model's training. Three things tiktoken lacks are added on top: the NFC normalizer, added tokens that are matched in
any text (not only when special tokens are allowed), and dropping the bytes a vocab lacks, as Hugging Face's BPE
does when it has no unknown token.

A tokenizer.json whose BPE has byte_fallback (SentencePiece's, Gemma's) is lib/sentencepiece.py's:
tiktoken cannot run it exactly.
"""
import functools
import json
import math
import os
import re
import unicodedata

import numpy as np
import tiktoken
from tiktoken.core import raise_disallowed_special_token

from lib import gguf_file
from lib.errors import ConfigError

# the pre-tokenizer regex of GPT-2's ByteLevel(use_regex=true)
GPT2_PATTERN = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
# Digits(individual_digits) then GPT-2's regex on the text between the digits (SmolLM, StarCoder) as one regex: a
# digit is a piece alone, so no space joins it, and a whitespace run that ends at a digit ends its stretch of text,
# where GPT-2's \s+(?!\S) takes the whole run
DIGITS_PATTERN = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+|\s+(?![^\s\p{N}])|\s+"
SUPPORTED = ("only byte-level BPE tokenizers (GPT-2, SmolLM, Qwen2/2.5/3, Llama-3 style) and "
             "SentencePiece BPE ones with byte fallback (Gemma: lib/sentencepiece.py) are read")

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
TO_LATIN1 = {ord(c): b for c, b in BYTE_OF.items()}  # str.translate, then latin-1: the bytes of a token at C speed

def _trie(node):
    """The regex of a trie {character: subtrie, '': True where a token ends}: one branch per next
    character, so that a match costs the text's length, not the number of tokens (Gemma has 6,384
    added tokens); where a token ends, going on is optional and tried first: the longest wins."""
    branches = [re.escape(c) + _trie(child) for c, child in sorted(node.items()) if c]
    if not branches:
        return ""
    body = branches[0] if len(branches) == 1 else "(?:" + "|".join(branches) + ")"
    return f"(?:{body})?" if "" in node else body

@functools.lru_cache(maxsize=64)
def _alternation(tokens):
    """A regex with one group matching any of `tokens`, longest first: HF matches added tokens leftmost-longest."""
    root = {}
    for token in tokens:
        node = root
        for c in token:
            node = node.setdefault(c, {})
        node[""] = True
    return re.compile("(" + _trie(root) + ")")

def _split(text, tokens):
    """[text, token, text, ..., text]: the even items are plain text, the odd ones are `tokens` found in it."""
    return _alternation(frozenset(tokens)).split(text) if tokens else [text]

def allowed_specials(specials, text, allowed_special, disallowed_special):
    """The special tokens that tiktoken's encode(text, allowed_special=..., disallowed_special=...)
    matches in text, after raising its ValueError for a disallowed one that text holds."""
    allowed = specials if allowed_special == "all" else specials & set(allowed_special)
    # no new set where none is needed: with Gemma's 6,249 special tokens one a call costs more than
    # the BPE; specials itself when none is allowed, whose regex is cached by the set
    if disallowed_special == "all" and allowed is specials:
        disallowed_special = ()
    elif disallowed_special == "all":
        disallowed_special = specials - allowed if allowed else specials
    if disallowed_special and (m := _alternation(frozenset(disallowed_special)).search(text)):
        raise_disallowed_special_token(m.group())
    return allowed

class HFEncoding(tiktoken.Encoding):
    """A tiktoken Encoding plus the NFC normalizer and HF's added-token matching. A subclass, so that decode,
    n_vocab, the batch encoders etc. are tiktoken's own: only what differs is overridden. padding {text: id}: a GGUF's
    UNUSED tokens, which fill the ids up to the embedding's rows: tiktoken special tokens, so that they decode to
    their text and count in n_vocab, but none of the added tokens that encode and encode_ordinary match, so that no
    text ever encodes to one (nor does any in HF, whose BPE has no merge making them)."""

    def __init__(self, name, pat_str, ranks, added_tokens, nfc, padding=None):
        super().__init__(name, pat_str=pat_str, mergeable_ranks=ranks,
                         special_tokens={**(padding or {}), **{t["content"]: t["id"] for t in added_tokens}})
        self._added_tokens, self._nfc, self._padding = added_tokens, nfc, padding
        specials = [t["content"] for t in added_tokens if t["special"]]
        self._specials = frozenset(specials)
        # HF matches the added tokens that skip the normalizer in the raw text, and the others in the normalized
        # text between those; the ones that aren't special are matched even with special-token matching off
        plain = [t for t in added_tokens if not t["special"]]
        self._raw = frozenset(t["content"] for t in plain if not (nfc and t["normalized"]))
        self._normalized = frozenset(t["content"] for t in plain if nfc and t["normalized"])
        eot = next((s for s in ("<|endoftext|>", "<|end_of_text|>") if s in specials), (specials or [None])[0])
        self._eot = self._special_tokens.get(eot)
        self._lacks = bytes(b for b in range(256) if bytes([b]) not in ranks)  # single bytes the vocab lacks

    def __reduce__(self):  # tiktoken pickles its own constructor's arguments: these are ours
        return HFEncoding, (self.name, self._pat_str, self._mergeable_ranks, self._added_tokens, self._nfc,
                            self._padding)

    @property
    def eot_token(self):
        """The end-of-text token: <|endoftext|>, else <|end_of_text|>, else the first special token. The ids that
        really end a checkpoint's generations are in its generation_config.json: see eos_ids()."""
        return self._eot

    def encode_ordinary(self, text):
        """Special tokens' text is plain text (HF's split_special_tokens=True); non-special added tokens still count."""
        return self._encode(text, frozenset())

    def encode(self, text, *, allowed_special=set(), disallowed_special="all"):  # noqa: B006 (tiktoken's signature)
        allowed = allowed_specials(self._specials, text, allowed_special, disallowed_special)
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
                ids += [self._special_tokens[p]] if j % 2 else self._bpe(p)
        return ids

    def _bpe(self, text):
        """tiktoken's encode_ordinary, but for a byte the vocab lacks (SmolLM2's lacks 21, six of them control
        characters): HF's BPE without an unk_token drops it from its pre-token and merges what is left, where
        tiktoken would fail. Such text takes this slower path, pre-token by pre-token."""
        data = text.encode("utf-8", "surrogatepass")
        if not self._lacks or len(data.translate(None, self._lacks)) == len(data):
            return super().encode_ordinary(text)
        import regex  # tiktoken's own dependency, the regex dialect of its patterns
        pieces = (p.encode("utf-8", "surrogatepass").translate(None, self._lacks)
                  for p in regex.findall(self._pat_str, text))
        return [i for p in pieces if p for i in self._encode_single_piece(p)]

def _hf_bpe(word, merge_rank):
    """HF's BPE of one pre-token: merge the adjacent pair that comes first in the merge list (leftmost on a tie)
    until no adjacent pair is in the list. (The reference that _unreachable runs on every vocab token at once.)"""
    parts, none = list(word), math.inf  # not len(merge_rank): a pair listed twice leaves a rank above that
    ranks = [merge_rank.get(pair, none) for pair in zip(parts, parts[1:])]  # ranks[i]: the pair parts[i], parts[i+1]
    while ranks:
        first = min(ranks)
        if first == none:
            break
        i = ranks.index(first)
        parts[i:i + 2] = [parts[i] + parts[i + 1]]
        del ranks[i]
        if i > 0:
            ranks[i - 1] = merge_rank.get((parts[i - 1], parts[i]), none)
        if i < len(ranks):
            ranks[i] = merge_rank.get((parts[i], parts[i + 1]), none)
    return parts

def _unreachable(vocab, merges, made):
    """The vocab tokens that HF's BPE (_hf_bpe) does not rebuild whole from their characters. It runs on every token
    at once, in numpy: the tokens of one length form a (tokens, parts) array of ids, and each round merges one pair
    in every row (its lowest-ranked one, leftmost on a tie), so the rows stay equally long; a row with no mergeable
    pair left is a token that HF splits. A 150k vocabulary takes ~0.6 s, a Python loop over it ~2.5 s.
    made[r] is the id of merge r's token; a pair listed twice has its last rank, as in HF's merge map."""
    n, none = max(vocab.values()) + 1, len(merges)
    keys = np.array([vocab[a] * n + vocab[b] for a, b in merges], dtype=np.int64)  # a pair as one int
    order = np.argsort(keys, kind="stable")
    keys, made = keys[order], np.asarray(made, dtype=np.int64)

    def rank(left, right):  # the merge rank of each pair of ids (none where the pair is no merge)
        k = left * n + right
        i = np.maximum(np.searchsorted(keys, k, side="right") - 1, 0)  # the last of equal keys: the last rank
        return np.where(keys[i] == k, order[i], none)

    char_id = np.zeros(max(map(ord, BYTE_OF)) + 1, dtype=np.int64)  # a vocab character's code point -> its id
    for c in BYTE_OF:
        char_id[ord(c)] = vocab.get(c, 0)
    by_length, bad = {}, []
    for s in vocab:  # but the tokens holding a byte the vocab lacks: neither HF nor tiktoken ever makes them
        if all(c in vocab for c in s):
            by_length.setdefault(len(s), []).append(s)
    for length, words in by_length.items():
        if length < 2:
            continue
        code_points = np.frombuffer("".join(words).encode("utf-32-le"), dtype=np.uint32)
        parts = char_id[code_points].reshape(len(words), length)  # (tokens, w) ids
        which = np.arange(len(words))  # the word of each row
        ranks = rank(parts[:, :-1], parts[:, 1:])  # (tokens, w - 1): the rank of each adjacent pair
        while parts.shape[1] > 1:
            i = ranks.argmin(1)  # (tokens,) the first lowest-ranked pair of each row
            first = ranks[np.arange(len(i)), i]
            if (stuck := first == none).any():  # no pair to merge: HF leaves these tokens in pieces
                bad += [words[j] for j in which[stuck]]
                parts, ranks, i, first, which = (x[~stuck] for x in (parts, ranks, i, first, which))
            rows, w = np.arange(len(i)), parts.shape[1] - 1
            col = np.arange(w)
            parts = np.take_along_axis(parts, col + (col > i[:, None]), 1)  # drop the pair's right part ...
            parts[rows, i] = made[first]  # ... and put the merged token in its left part's place
            if w == 1:
                break
            ranks = np.take_along_axis(ranks, col[:-1] + (col[:-1] >= i[:, None]), 1)  # drop the merged pair
            for j in (np.maximum(i - 1, 0), np.minimum(i, w - 2)):  # the pairs left and right of the new token
                ranks[rows, j] = rank(parts[rows, j], parts[rows, j + 1])
    return bad

def _pattern(pre, refuse):
    """The pat_str of a pre-tokenizer: ByteLevel's own regex (GPT-2), or Split(Regex) then ByteLevel without one."""
    steps = pre.get("pretokenizers", []) if pre and pre.get("type") == "Sequence" else [pre]
    kinds = [s.get("type") if s else None for s in steps]
    if kinds and kinds[-1] == "ByteLevel" and steps[-1].get("add_prefix_space"):
        refuse("ByteLevel add_prefix_space is true (tiktoken adds no space)")
    if kinds == ["ByteLevel"] and steps[0].get("use_regex", True):
        return GPT2_PATTERN
    if kinds == ["Digits", "ByteLevel"] and steps[0].get("individual_digits") and steps[1].get("use_regex", True):
        return DIGITS_PATTERN
    if kinds == ["Split", "ByteLevel"] and not steps[1].get("use_regex", True):
        split = steps[0]
        if "Regex" in split["pattern"] and split.get("behavior") == "Isolated" and not split.get("invert"):
            return split["pattern"]["Regex"]
    refuse(f"pre_tokenizer {kinds} is not ByteLevel(use_regex), Digits(individual_digits) + ByteLevel(use_regex) "
           f"nor Split(Regex, Isolated) + ByteLevel; {SUPPORTED}")

def _from_json(tok, file, padding=None):
    """The HFEncoding of a parsed tokenizer.json, after checking what makes tiktoken exact (padding: a GGUF's, see
    HFEncoding)."""
    def refuse(problem):
        raise ConfigError(f"{file}: {problem}")

    model, normalizer = tok["model"], tok.get("normalizer")
    name = os.path.basename(os.path.dirname(os.path.abspath(file)))
    if model.get("type") != "BPE":
        refuse(f"model type {model.get('type')!r} is not BPE; {SUPPORTED}")
    if model.get("byte_fallback"):  # SentencePiece's BPE (Gemma), which tiktoken cannot run exactly
        from lib import sentencepiece  # here, not above: it builds on this module's helpers
        return sentencepiece.from_json(tok, file, name)
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
    if not set(BYTE_OF).issuperset("".join(vocab)):
        refuse(f"vocab strings are not GPT-2 byte-level characters; {SUPPORTED}")
    # tiktoken's rank is the id: the ranks may start past the added tokens (SmolLM2's 17 come first) and have gaps
    ranks = {s.translate(TO_LATIN1).encode("latin-1"): i for s, i in vocab.items()}
    if len(set(ranks.values())) < len(ranks):
        refuse("two vocab tokens have the same id; use the tokenizer.json that came with the model")
    if model.get("unk_token") and any(bytes([b]) not in ranks for b in range(256)):
        refuse(f"the vocab lacks some of the 256 single bytes and unk_token is set (HF writes the unknown token "
               f"for them; tiktoken cannot); {SUPPORTED}")

    # HF merges the pair that comes first in the merge list, tiktoken the pair whose merged token has the lowest id:
    # the same choice when the merged token's id never decreases along the list (several merges per token are fine)
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in model["merges"]]
    for a, b in merges:
        if a + b not in vocab or a not in vocab or b not in vocab:
            refuse(f"merge {a!r} {b!r} makes a token that is not in the vocab, or joins one")
    made = [vocab[a + b] for a, b in merges]
    if (r := next((r for r in range(1, len(made)) if made[r] < made[r - 1]), None)) is not None:
        refuse(f"merge {merges[r][0]!r} {merges[r][1]!r} is out of rank order (merged tokens' ids must not decrease "
               f"along the list)")
    # tiktoken returns a pre-token that is a vocab token whole; HF does only with ignore_merges, else it runs BPE
    if not model.get("ignore_merges") and (bad := _unreachable(vocab, merges, made)):
        refuse(f"vocab token {bad[0]!r} is not reachable by its merges and ignore_merges is false: HF would "
               f"split it where tiktoken keeps it whole, so tiktoken cannot tokenize exactly as this tokenizer does")
    return HFEncoding(name, pat_str, ranks, added, nfc=normalizer is not None, padding=padding)

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
    """A tiktoken Encoding from a tokenizer.json, or a directory holding one (or else vocab.json + merges.txt), or
    the tokenizer that a .gguf file's metadata describes."""
    if path.endswith(".gguf"):
        tok, padding = gguf_file.tokenizer(path)
        return _from_json(tok, path, padding)
    if os.path.isdir(path) and not os.path.exists(os.path.join(path, "tokenizer.json")):
        return _from_json(_gpt2_files(path), os.path.join(path, "vocab.json"))
    file = os.path.join(path, "tokenizer.json") if os.path.isdir(path) else path
    with open(file, encoding="utf-8") as f:
        return _from_json(json.load(f), file)

def eos_ids(path):
    """The ids that end a generation of the checkpoint in directory `path`, sorted: generation_config.json's
    eos_token_id (an int or a list: instruct models stop on several), else config.json's; None if neither names one.
    For a .gguf file, its end-of-sequence and end-of-turn ids."""
    if path.endswith(".gguf"):
        return gguf_file.eos_ids(path)
    for name in ("generation_config.json", "config.json"):
        if os.path.exists(os.path.join(path, name)):
            with open(os.path.join(path, name)) as f:
                eos = json.load(f).get("eos_token_id")
            if eos is not None and eos != []:
                return sorted({eos} if isinstance(eos, int) else set(eos))
    return None

def get_tokenizer(name):
    """The tokenizer called name: 'bytes' (one token per byte and an end of text, 257 in all, built here for tiny
    models), 'gpt2' (tiktoken's, downloaded on first use), a Hugging Face tokenizer.json or its directory, or a .gguf
    file."""
    if name == "bytes":
        ranks = {bytes([i]): i for i in range(256)}
        return tiktoken.Encoding(name="bytes", pat_str=r"\S+|\s+", mergeable_ranks=ranks,
                                 special_tokens={"<|endoftext|>": 256})
    if name == "gpt2":
        try:
            return tiktoken.get_encoding("gpt2")
        except Exception as e:  # no network and no cache: requests' errors, tiktoken's own, ...
            raise ConfigError(f"tokenizer 'gpt2' needs tiktoken's GPT-2 files, which it downloads on first use, and "
                              f"that failed ({type(e).__name__}); set tokenizer= to the checkpoint's tokenizer.json or "
                              f"its directory instead") from None
    if os.path.exists(name):
        return load_hf_tokenizer(name)
    raise ConfigError(f"unknown tokenizer {name!r}; use 'bytes' (built in, no download), 'gpt2', a Hugging Face "
                      f"tokenizer.json or the directory that holds it, or a .gguf file")
