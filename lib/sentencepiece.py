"""
SentencePiece's BPE with byte fallback (Gemma; Llama-2, Mistral up to v0.3 and Phi-3 share it) as
Hugging Face tokenizers runs such a tokenizer.json, in pure Python, behind the tiktoken-like
interface of lib/tokenizer.py. lib/gguf_file.py turns a Gemma GGUF's SentencePiece vocabulary
(tokenizer.ggml.model 'llama') into such a tokenizer.json.

Why not tiktoken: it merges bytes, where SentencePiece merges characters and spells a character
missing from the vocab as its UTF-8 bytes (<0xNN> tokens), which never merge; a multi-byte character
would need byte pairs that are no token. Why not the `tokenizers` library: this is exact without a
dependency, about as fast on prompts (docs/gemma3.md has the measurements) and short enough to read.

What Hugging Face does: the added tokens are matched in the raw text (leftmost, longest); the text
between them is normalized (' ' -> '▁', and in Llama-2's layout a '▁' before each non-empty piece);
BPE splits it into characters, a character not in the vocab into its byte tokens, then merges the
adjacent pair that comes first in the merge list (leftmost on a tie) until no pair is a merge. The
speed-ups here keep that exact: a merge (a, b) joins two symbols only across the boundary between
a's last character and b's first, so no symbol ever spans two neighbouring characters that are no
merge's (a[-1], b[0]); the text is cut there, and each piece's ids are computed once and cached;
a long piece (a run of spaces) merges through a heap.
"""
import heapq

from lib.errors import ConfigError
from lib.tokenizer import _split, allowed_specials

SPACE = "\u2581"  # SentencePiece's '▁', which stands for a space in its vocab
SUPPORTED = ("SentencePiece BPE tokenizers in Gemma's layout (normalizer Replace ' ' with '▁', "
             "after Prepend '▁' in Llama-2's; no pre-tokenizer or a Split on ' ') can be loaded")


def bpe(word, merge_rank):
    """lib/tokenizer.py's _hf_bpe (merge the adjacent pair that comes first in the merge list,
    leftmost on a tie, until none is a merge) in time n log n, not n^2, for a long piece such as a
    run of 10,000 spaces: the pairs wait in a heap by (rank, position), the parts in a linked list,
    and a pair whose parts have changed since it was pushed is skipped when it comes up."""
    parts = list(word)
    after = list(range(1, len(parts))) + [None]  # the next part's index, or None
    before = [None] + list(range(len(parts) - 1))
    heap = [(merge_rank[p], i, *p) for i, p in enumerate(zip(parts, parts[1:])) if p in merge_rank]
    heapq.heapify(heap)
    while heap:
        _, i, left, right = heapq.heappop(heap)
        j = after[i]
        if j is None or parts[i] != left or parts[j] != right:
            continue  # no longer the pair it was
        parts[i], parts[j] = left + right, None
        after[i] = after[j]
        if after[i] is not None:
            before[after[i]] = i
        for k in (before[i], i):  # the new pairs on either side of the merged part
            if k is not None and after[k] is not None:
                pair = (parts[k], parts[after[k]])
                if pair in merge_rank:
                    heapq.heappush(heap, (merge_rank[pair], k, *pair))
    return [p for p in parts if p is not None]


class SentencePieceEncoding:
    """The tiktoken Encoding's interface (encode, encode_ordinary, decode, n_vocab, eot_token, name,
    decode_single_token_bytes, encode_single_token, special_tokens_set) for a SentencePiece BPE.
    Like tiktoken's, encode adds no BOS: bos_token is the id the checkpoint puts before each text
    (None if it puts none), for the prompt's renderer to add."""

    def __init__(self, name, vocab, merges, added_tokens, prepend, strip, bos):
        self.name, self._vocab, self.bos_token = name, vocab, bos
        self._prepend, self._strip = prepend, strip
        self._rank = {pair: r for r, pair in enumerate(merges)}  # a pair listed twice: last rank
        self._joins = {a[-1] + b[0] for a, b in merges}  # the character pairs that some merge joins
        self._added = {t["content"]: t["id"] for t in added_tokens}
        self._specials = frozenset(t["content"] for t in added_tokens if t["special"])
        self._plain = frozenset(self._added) - self._specials  # matched even with specials off
        self._every = frozenset(self._added)  # one set, so that its regex is built and found once
        self._text = {i: s for s, i in vocab.items()} | {i: s for s, i in self._added.items()}
        self._bytes = [vocab[f"<0x{b:02X}>"] for b in range(256)]
        self._byte_of = {i: b for b, i in enumerate(self._bytes)}
        self.n_vocab = max(self._text) + 1
        first = min(self._specials, default=None, key=self._added.get)
        eot = next((s for s in ("<eos>", "</s>") if s in self._specials), first)
        self.eot_token = self._added.get(eot)
        self._cache = {}

    @property
    def special_tokens_set(self):
        return set(self._specials)

    def encode_ordinary(self, text):
        """Special tokens' text is plain text (HF's split_special_tokens=True); the added tokens
        that are not special are still matched."""
        return self._encode(text, frozenset())

    def encode(self, text, *, allowed_special=set(), disallowed_special="all"):  # noqa: B006
        allowed = allowed_specials(self._specials, text, allowed_special, disallowed_special)
        return self._encode(text, allowed)

    def _encode(self, text, specials):
        ids = []
        matched = self._every if specials is self._specials else specials | self._plain
        for i, piece in enumerate(_split(text, matched)):
            if i % 2:
                ids.append(self._added[piece])
            elif piece:
                ids += self._bpe((SPACE if self._prepend else "") + piece.replace(" ", SPACE))
        return ids

    def _bpe(self, text):
        """The ids of a normalized text, piece by piece between character pairs no merge joins."""
        cuts = [i for i in range(1, len(text)) if text[i - 1:i + 1] not in self._joins]
        cuts = [0, *cuts, len(text)]
        ids = []
        for start, end in zip(cuts, cuts[1:]):
            piece = text[start:end]
            if (known := self._cache.get(piece)) is None:
                if len(self._cache) > 1 << 17:  # a bound on memory for endless distinct text
                    self._cache.clear()
                known = self._cache[piece] = self._word(piece)
            ids += known
        return ids

    def _word(self, piece):
        ids = []
        for part in bpe(piece, self._rank):
            if part in self._vocab:
                ids.append(self._vocab[part])
            else:  # a character the vocab lacks: its UTF-8 bytes
                ids += [self._bytes[b] for b in part.encode("utf-8")]
        return ids

    def decode_single_token_bytes(self, token):
        if token in self._byte_of:
            return bytes([self._byte_of[token]])
        return self._text[token].replace(SPACE, " ").encode("utf-8")

    def decode(self, tokens):
        """HF's decoder: '▁' as a space, a run of byte tokens as the UTF-8 it spells (one U+FFFD a
        byte where it spells none), in Llama-2's layout one leading space stripped."""
        out, run = [], bytearray()
        for token in [*tokens, None]:
            if token in self._byte_of:
                run.append(self._byte_of[token])
                continue
            if run:
                try:
                    out.append(run.decode("utf-8"))
                except UnicodeDecodeError:
                    out.append("\ufffd" * len(run))
                run = bytearray()
            if token is not None:
                out.append(self._text[token].replace(SPACE, " "))
        text = "".join(out)
        return text[1:] if self._strip and text.startswith(" ") else text

    def encode_single_token(self, text):
        """The id of the token whose text this is (str or UTF-8 bytes); KeyError if none is."""
        text = text.decode("utf-8") if isinstance(text, bytes) else text
        return self._added[text] if text in self._added else self._vocab[text.replace(" ", SPACE)]


def _bos(post):
    """The id a TemplateProcessing post-processor puts first before a text, if it puts one there."""
    for p in (post or {}).get("processors", [post] if post else []):
        if p.get("type") == "TemplateProcessing" and "SpecialToken" in p["single"][0]:
            return p["special_tokens"][p["single"][0]["SpecialToken"]["id"]]["ids"][0]
    return None


def from_json(tok, file, name):
    """The SentencePieceEncoding of a parsed tokenizer.json whose model is a BPE with byte_fallback,
    after checking that its layout is one reproduced here exactly; a ConfigError naming the file and
    the problem if not."""
    def refuse(problem):
        raise ConfigError(f"{file}: {problem}; {SUPPORTED}")

    model, normalizer, pre = tok["model"], tok.get("normalizer") or {}, tok.get("pre_tokenizer")
    steps = normalizer.get("normalizers", [normalizer]) if normalizer else []
    replace = dict(type="Replace", pattern=dict(String=" "), content=SPACE)
    prepend = dict(type="Prepend", prepend=SPACE)
    if steps not in ([replace], [prepend, replace], [replace, prepend]):
        kinds = [s.get("type") for s in steps]
        refuse(f"normalizer {kinds} is not Replace(' ', '▁') (after Prepend('▁'))")
    # a Split on ' ' after the normalizer has made every ' ' a '▁' splits nothing
    if pre is not None and (pre.get("type"), pre.get("pattern")) != ("Split", {"String": " "}):
        refuse(f"pre_tokenizer {pre.get('type')!r} is not none or a Split on ' '")
    for key in ("dropout", "continuing_subword_prefix", "end_of_word_suffix", "ignore_merges"):
        if model.get(key):
            refuse(f"model {key} is set")
    decoder = tok.get("decoder") or {}
    decoders = decoder.get("decoders", [decoder])
    kinds = [d.get("type") for d in decoders]
    strip = decoders[3:] == [dict(type="Strip", content=" ", start=1, stop=0)]
    space = dict(type="Replace", pattern=dict(String=SPACE), content=" ")
    if kinds[:3] != ["Replace", "ByteFallback", "Fuse"] or decoders[0] != space or not (
            len(kinds) == 3 or strip):
        refuse(f"decoder {kinds} is not Replace('▁', ' '), ByteFallback, Fuse (then Strip)")
    added = tok.get("added_tokens", [])
    for t in added:
        if t.get("lstrip") or t.get("rstrip") or t.get("single_word") or t.get("normalized"):
            refuse(f"added token {t['content']!r} has lstrip/rstrip/single_word/normalized set; "
                   f"only exact strings matched in the raw text are reproduced")
    vocab = model["vocab"]
    missing = [f"<0x{b:02X}>" for b in range(256) if f"<0x{b:02X}>" not in vocab]
    if missing:
        refuse(f"the vocab lacks the byte token {missing[0]} (the byte fallback spells what "
               f"the vocab lacks with those)")
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in model["merges"]]
    for a, b in merges:
        if a not in vocab or b not in vocab or a + b not in vocab:
            refuse(f"merge {a!r} {b!r} makes a token that is not in the vocab, or joins one")
    return SentencePieceEncoding(name, vocab, merges, added, prepend=prepend in steps, strip=strip,
                                 bos=_bos(tok.get("post_processor")))
