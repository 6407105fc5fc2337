"""
Tests for lib/tokenizer.py against tests/fixtures/tiny-bpe-a (a Qwen2.5-layout byte-level BPE tokenizer.json and the
ids Hugging Face tokenizers gives for 38 texts): the loaded tiktoken Encoding reproduces them exactly, with special
tokens allowed and as plain text, and decodes them back; every tokenizer.json that tiktoken could not reproduce is
refused with one line naming the file; non-special added tokens, the older GPT-2 file layout, and
eos_ids. (The chat templates: test_chat_templates.py.)
"""
import json
import os
import pickle
import random
import re
import unicodedata

import pytest
import regex

from lib.tokenizer import GPT2_PATTERN, _hf_bpe, _unreachable, bytes_to_unicode, eos_ids, get_tokenizer, load_hf_tokenizer

FIXTURE = os.path.join(os.path.dirname(__file__), "fixtures", "tiny-bpe-a")
with open(os.path.join(FIXTURE, "reference.json"), encoding="utf-8") as f:
    REF = json.load(f)
CASES = REF["cases"]
CASE = {c["text"]: c for c in CASES}
SPECIAL_RE = re.compile("(" + "|".join(map(re.escape, REF["special_tokens"])) + ")")

def nfc(text):
    return unicodedata.normalize("NFC", text)

def fixture_json():
    with open(os.path.join(FIXTURE, "tokenizer.json"), encoding="utf-8") as f:
        return json.load(f)

def edited(tmp_path, edit):
    """The fixture's tokenizer.json changed by edit(tok), written under tmp_path; returns its path."""
    tok = fixture_json()
    edit(tok)
    path = tmp_path / "tokenizer.json"
    path.write_text(json.dumps(tok), encoding="utf-8")
    return str(path)

def assert_reproduces_reference(enc):
    for c in CASES:
        assert enc.encode(c["text"], allowed_special="all") == c["ids"], c["text"]
        assert enc.encode_ordinary(c["text"]) == c["ids_specials_as_text"], c["text"]

@pytest.fixture(scope="module")
def enc():
    return load_hf_tokenizer(FIXTURE)

def test_reference_has_the_cases_that_catch_nfc_across_a_special():
    """Planted bug 'NFC of the whole text' must fail this case: NFC composes the special token's '>' with the
    combining mark after it into '≯', so the token is no longer in the text."""
    assert len(CASES) == 38
    text = "<|im_start|>\u0338 and =\u0338"
    assert CASE[text]["ids"][0] == REF["special_tokens"]["<|im_start|>"] and "<|im_start|>" not in nfc(text)

@pytest.mark.parametrize("i", range(len(CASES)))
def test_reference_case(enc, i):
    c = CASES[i]
    assert enc.encode(c["text"], allowed_special="all") == c["ids"]
    assert enc.encode_ordinary(c["text"]) == c["ids_specials_as_text"]
    assert enc.encode(c["text"], disallowed_special=()) == c["ids_specials_as_text"]
    # HF decodes to the text with NFC applied to the pieces between special tokens, not across them
    assert enc.decode(c["ids"]) == "".join(p if k % 2 else nfc(p) for k, p in enumerate(SPECIAL_RE.split(c["text"])))
    assert enc.decode(c["ids_specials_as_text"]) == nfc(c["text"])

def test_encoding_attributes(enc):
    assert (enc.n_vocab, enc.eot_token) == (REF["vocab_size_with_specials"], REF["special_tokens"]["<|endoftext|>"])
    # the vocab strings are GPT-2's byte characters: 'Ġ' is a space, 'Ċ' a newline, '!' itself
    assert [enc.decode_single_token_bytes(i) for i in (220, 198, 0)] == [b" ", b"\n", b"!"]
    assert enc.decode([enc.encode_single_token(b"\xcc")]) == "\ufffd"  # half a character: replaced, as tiktoken does
    assert load_hf_tokenizer(os.path.join(FIXTURE, "tokenizer.json")).encode_ordinary("Good morning") == \
        CASE["Good morning"]["ids"]
    text = "<|im_start|>\u0338 and =\u0338"
    assert pickle.loads(pickle.dumps(enc)).encode(text, allowed_special="all") == CASE[text]["ids"]

def test_eot_token(tmp_path):
    """<|endoftext|>, else <|end_of_text|> (Llama-3), else the first special token."""
    def llama3(tok):
        tok["added_tokens"][0]["content"], tok["added_tokens"][2]["content"] = "<|begin_of_text|>", "<|end_of_text|>"
    assert load_hf_tokenizer(edited(tmp_path, llama3)).eot_token == 543
    assert load_hf_tokenizer(edited(tmp_path, lambda tok: tok["added_tokens"].pop(0))).eot_token == 542

def test_special_tokens_allowed_one_by_one(enc):
    text = "text<|im_end|>more"
    with pytest.raises(ValueError, match="disallowed special token '<\\|im_end\\|>'"):
        enc.encode(text)  # tiktoken's default: special-token text is an error unless allowed or disallowed_special=()
    assert enc.encode(text, allowed_special={"<|im_end|>"}) == CASE[text]["ids"]
    assert enc.encode(text, allowed_special={"<|im_start|>"}, disallowed_special=()) == \
        CASE[text]["ids_specials_as_text"]

def test_merges_as_pairs_and_ignore_merges(tmp_path):
    """tokenizers >= 0.20 writes merges as ["a", "b"] pairs; ignore_merges changes nothing here since every vocab
    token is reachable by its merges."""
    def edit(tok):
        tok["model"]["merges"] = [m.split(" ") for m in tok["model"]["merges"]]
        tok["model"]["ignore_merges"] = True
    assert_reproduces_reference(load_hf_tokenizer(edited(tmp_path, edit)))

def test_llama3_style_merges_accepted(tmp_path):
    """Every two-token split of every token, sorted by the merged token's id (several merges per token), as in
    Llama-3's tokenizer.json, is in rank order: accepted (and the ids come from the vocab, so they are unchanged)."""
    def edit(tok):
        vocab = tok["model"]["vocab"]
        splits = [(vocab[s], f"{s[:k]} {s[k:]}") for s in vocab for k in range(1, len(s))
                  if s[:k] in vocab and s[k:] in vocab]
        tok["model"]["merges"] = [m for _, m in sorted(splits)]
    assert_reproduces_reference(load_hf_tokenizer(edited(tmp_path, edit)))

def test_no_normalizer(tmp_path):
    enc = load_hf_tokenizer(edited(tmp_path, lambda tok: tok.update(normalizer=None)))
    text = "Vie\u0323\u0302t Nam"  # decomposed: kept as it is without NFC
    assert enc.decode(enc.encode_ordinary(text)) == text != nfc(text)

# -----------------------------------------------------------------------------
# added tokens that are not special (Qwen's <think>, <tool_call>): matched in the text even as encode_ordinary

def with_think(normalized):
    def edit(tok):
        tok["added_tokens"].append(dict(id=544, content="<think>", single_word=False, lstrip=False, rstrip=False,
                                        normalized=normalized, special=False))
    return edit

def test_non_special_added_token(tmp_path):
    enc = load_hf_tokenizer(edited(tmp_path, with_think(normalized=False)))
    assert enc.n_vocab == 545 and enc.decode([544]) == "<think>"
    # the pieces around the token are encoded on their own, as the reference encodes them: "Good morning" is a case,
    # and the case "<|im_start|>\u0338 and =\u0338" minus its first id is the encoding of "\u0338 and =\u0338"
    a, b = CASE["Good morning"], CASE["<|im_start|>\u0338 and =\u0338"]
    text = a["text"] + "<think>" + b["text"]
    assert enc.encode_ordinary(text) == a["ids"] + [544] + b["ids_specials_as_text"]
    assert enc.encode(text, allowed_special="all") == a["ids"] + [544] + b["ids"]
    # matched before NFC, like a special token: "<think>\u0338" keeps its '>'
    text = a["text"] + "<think>" + b["text"].removeprefix("<|im_start|>")
    assert enc.encode_ordinary(text) == enc.encode(text) == a["ids"] + [544] + b["ids"][1:]

def test_added_tokens_matched_longest_first(tmp_path):
    """HF matches added tokens leftmost-longest: "<think>" wins over "<th" where both match."""
    def edit(tok):
        with_think(normalized=False)(tok)
        tok["added_tokens"].append(dict(tok["added_tokens"][-1], id=545, content="<th"))
    enc = load_hf_tokenizer(edited(tmp_path, edit))
    assert enc.encode_ordinary("<th<think>") == [545, 544]

def test_normalized_non_special_added_token(tmp_path, enc):
    """normalized: true means HF matches the token in the NFC'd text, where '>' + U+0338 has become '≯'."""
    enc_think = load_hf_tokenizer(edited(tmp_path, with_think(normalized=True)))
    assert enc_think.encode_ordinary("Good morning<think>") == CASE["Good morning"]["ids"] + [544]
    text = "Good morning<think>\u0338"
    assert enc_think.encode_ordinary(text) == enc.encode_ordinary(text)  # no 544: the text now has '<think≯'


# -----------------------------------------------------------------------------
# refusals: one line naming the file and what is wrong

def set_key(d, old, new):
    d[new] = d.pop(old)

REFUSALS = [  # (the message, as a regex; how the fixture's tokenizer.json is edited to deserve it)
    ("model type 'WordPiece' is not BPE", lambda tok: tok["model"].update(type="WordPiece")),
    ("normalizer \\['NFC'\\] is not Replace",  # to lib/sentencepiece.py, which wants '▁'
     lambda tok: tok["model"].update(byte_fallback=True)),
    ("continuing_subword_prefix/end_of_word_suffix", lambda tok: tok["model"].update(continuing_subword_prefix="##")),
    ("continuing_subword_prefix/end_of_word_suffix", lambda tok: tok["model"].update(end_of_word_suffix="</w>")),
    ("BPE dropout is set", lambda tok: tok["model"].update(dropout=0.1)),
    ("normalizer 'NFKC' is not NFC or none", lambda tok: tok.update(normalizer={"type": "NFKC"})),
    ("pre_tokenizer \\['Split', 'Split', 'ByteLevel'\\]", lambda tok: tok["pre_tokenizer"]["pretokenizers"].insert(
        0, dict(type="Split", pattern={"Regex": "\\p{N}"}, behavior="Isolated", invert=False))),
    ("pre_tokenizer \\['Metaspace'\\]",
     lambda tok: tok.update(pre_tokenizer=dict(type="Metaspace", replacement="▁"))),
    ("pre_tokenizer \\['Split', 'ByteLevel'\\]",
     lambda tok: tok["pre_tokenizer"]["pretokenizers"][0].update(behavior="Removed")),
    ("pre_tokenizer \\['Split', 'ByteLevel'\\]",
     lambda tok: tok["pre_tokenizer"]["pretokenizers"][1].update(use_regex=True)),
    ("ByteLevel add_prefix_space is true",
     lambda tok: tok.update(pre_tokenizer=dict(type="ByteLevel", add_prefix_space=True))),
    ("added token '<\\|im_start\\|>' has lstrip", lambda tok: tok["added_tokens"][1].update(lstrip=True)),
    ("added token '<\\|im_end\\|>' has lstrip/rstrip", lambda tok: tok["added_tokens"][2].update(rstrip=True)),
    ("added token '<\\|endoftext\\|>' has lstrip/rstrip/single_word",
     lambda tok: tok["added_tokens"][0].update(single_word=True)),
    ("special token '<\\|endoftext\\|>' is normalized", lambda tok: tok["added_tokens"][0].update(normalized=True)),
    ("vocab strings are not GPT-2 byte-level characters", lambda tok: set_key(tok["model"]["vocab"], "man", "m€n")),
    ("the vocab lacks some of the 256 single bytes and unk_token is set",
     lambda tok: (set_key(tok["model"]["vocab"], "!", "Ā!"), tok["model"].update(unk_token="Ā!"))),
    ("two vocab tokens have the same id", lambda tok: tok["model"]["vocab"].update(man=tok["model"]["vocab"]["m"])),
    ("merge 'Ġ' 'a' is out of rank order", lambda tok: tok["model"]["merges"].append(tok["model"]["merges"].pop(0))),
    ("merge 'Ā' 'Ā' makes a token that is not in the vocab", lambda tok: tok["model"]["merges"].append("Ā Ā")),
    ("vocab token 'man' is not reachable by its merges", lambda tok: tok["model"]["merges"].pop()),
]

@pytest.mark.parametrize("message, edit", REFUSALS)
def test_refused(tmp_path, message, edit):
    path = edited(tmp_path, edit)
    with pytest.raises(ValueError, match=re.escape(path) + ": " + message) as e:
        load_hf_tokenizer(path)
    assert "\n" not in str(e.value)

def test_unreachable_token_is_fine_with_ignore_merges(tmp_path):
    """HF then returns a pre-token that is a vocab token whole, as tiktoken does; 'man' was made by the last merge."""
    def edit(tok):
        tok["model"]["merges"].pop()
        tok["model"]["ignore_merges"] = True
    assert load_hf_tokenizer(edited(tmp_path, edit)).encode_ordinary("man") == [fixture_json()["model"]["vocab"]["man"]]

@pytest.mark.parametrize("seed", range(4))
def test_unreachable_is_hf_bpe_token_by_token(seed):
    """The all-tokens-at-once numpy check finds exactly the tokens that _hf_bpe, run on each token alone, splits: on
    random vocabularies of 3000 tokens whose merge lists then lose some merges, get some out of order, and list some
    pairs twice (the last rank counts)."""
    rng = random.Random(seed)
    tokens = list(bytes_to_unicode().values())
    vocab, merges = {t: i for i, t in enumerate(tokens)}, []
    while len(tokens) < 3000:  # short tokens are the likelier parts, so that long ones form too
        a, b = tokens[int(len(tokens) * rng.random() ** 3)], rng.choice(tokens[:600])
        if a + b not in vocab:
            vocab[a + b] = len(tokens)
            tokens.append(a + b)
            merges.append((a, b))
    merges = [m for m in merges if rng.random() > 0.03]
    for _ in range(30):
        i = rng.randrange(len(merges) - 1)
        merges[i], merges[i + 1] = merges[i + 1], merges[i]
        merges.insert(rng.randrange(len(merges)), merges[rng.randrange(len(merges))])
    rank = {pair: r for r, pair in enumerate(merges)}  # a pair listed twice: its last rank
    expected = {s for s in vocab if len(s) > 1 and _hf_bpe(s, rank) != [s]}
    found = _unreachable(vocab, merges, [vocab[a + b] for a, b in merges])
    assert 50 < len(expected) < 2500 and sorted(found) == sorted(expected)

# -----------------------------------------------------------------------------
# the older GPT-2 layout: vocab.json + merges.txt

def test_gpt2_files(tmp_path):
    """vocab.json + merges.txt load to the same Encoding as a tokenizer.json with the same vocab and merges and GPT-2's
    pre-tokenizer (ByteLevel's own regex, no normalizer, <|endoftext|> the only special token). Where the GPT-2 and
    Qwen patterns split a text the same way and NFC leaves it unchanged, that is also the reference's ids."""
    tok = fixture_json()
    vocab = {**tok["model"]["vocab"], "<|endoftext|>": 541}
    (tmp_path / "vocab.json").write_text(json.dumps(vocab), encoding="utf-8")
    (tmp_path / "merges.txt").write_text("#version: 0.2\n" + "\n".join(tok["model"]["merges"]) + "\n", encoding="utf-8")
    gpt2 = load_hf_tokenizer(str(tmp_path))
    assert (gpt2.n_vocab, gpt2.eot_token) == (542, 541)

    def as_gpt2(tok):
        tok.update(normalizer=None, added_tokens=tok["added_tokens"][:1],
                   pre_tokenizer=dict(type="ByteLevel", add_prefix_space=False, trim_offsets=False, use_regex=True))
    (tmp_path / "json").mkdir()
    same = load_hf_tokenizer(edited(tmp_path / "json", as_gpt2))
    qwen_pattern = fixture_json()["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"]
    coincide = 0
    for c in CASES:
        text = c["text"]
        assert gpt2.encode_ordinary(text) == same.encode_ordinary(text)
        assert gpt2.encode(text, allowed_special="all") == same.encode(text, allowed_special="all")
        if regex.findall(GPT2_PATTERN, text) == regex.findall(qwen_pattern, text) and nfc(text) == text:
            coincide += 1
            assert gpt2.encode_ordinary(text) == c["ids_specials_as_text"]
    # and the pattern is GPT-2's, not the fixture's: Qwen's keeps a newline with the punctuation before it, GPT-2's not
    code = 'fn main() {\n    println!("hi");\n}\n'
    assert coincide >= 10 and gpt2.encode_ordinary(code) != CASE[code]["ids"]

# -----------------------------------------------------------------------------
# eos_ids

def write_json(path, obj):
    path.write_text(json.dumps(obj), encoding="utf-8")

def test_eos_ids(tmp_path):
    assert eos_ids(str(tmp_path)) is None
    write_json(tmp_path / "config.json", {"eos_token_id": None})
    assert eos_ids(str(tmp_path)) is None
    write_json(tmp_path / "config.json", {"eos_token_id": 7})
    assert eos_ids(str(tmp_path)) == [7]
    write_json(tmp_path / "generation_config.json", {"bos_token_id": 1})  # names none: config.json's
    assert eos_ids(str(tmp_path)) == [7]
    write_json(tmp_path / "generation_config.json", {"eos_token_id": 2})
    assert eos_ids(str(tmp_path)) == [2]
    write_json(tmp_path / "generation_config.json", {"eos_token_id": [151645, 151643, 151645]})
    assert eos_ids(str(tmp_path)) == [151643, 151645]

# -----------------------------------------------------------------------------
# get_tokenizer

def test_get_tokenizer_by_name_and_path():
    assert get_tokenizer("bytes").n_vocab == 257
    for path in (FIXTURE, os.path.join(FIXTURE, "tokenizer.json")):
        assert get_tokenizer(path).n_vocab == 544
    with pytest.raises(ValueError, match=r"unknown tokenizer 'gpt3'; use 'bytes' \(built in, no download\), 'gpt2'"):
        get_tokenizer("gpt3")

def test_gpt2_without_network_is_a_clear_error(tmp_path, monkeypatch):
    import requests
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path))  # nothing cached
    monkeypatch.setattr(requests, "get", lambda *a, **k: (_ for _ in ()).throw(requests.ConnectionError("offline")))
    with pytest.raises(ValueError, match=r"tokenizer 'gpt2' needs tiktoken's GPT-2 files.*\(ConnectionError\); set "
                                         r"tokenizer= to the checkpoint's tokenizer.json"):
        get_tokenizer("gpt2")

