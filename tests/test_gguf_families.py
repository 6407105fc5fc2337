"""
GGUF files laid out as llama.cpp's converter writes them for each family nanoGRPO reads (tests/gguf_writer.py, HUBS):
a Qwen2.5 whose embedding has more rows than its tokenizer has tokens, so that the file fills the ids between with
[PAD{id}] tokens of type UNUSED (real Qwen2/2.5/3 files have 271: 151,936 rows, 151,665 tokens); a Qwen3 with its
added tokens that are not special (USER_DEFINED <think>) and one that only looks special (<|fim_prefix|>, CONTROL);
a Llama-3 (tokenizer.ggml.pre 'llama-bpe', add_bos_token, no padding). From each file: the tokenizer gives Hugging
Face tokenizers' ids (tests/fixtures/tiny-bpe-a's reference) and the tokenizer.json's, the padding decodes to its
text and is never encoded, the chat template's stop ids, and train.py trains two iterations from it. (GPT-2 GGUFs
are not read: gguf_file.ARCHITECTURES.)
"""
import json
import os
import pickle
import unicodedata

import pytest
import regex
import torch
from safetensors.torch import load_file

pytest.importorskip("gguf", reason="gguf_file needs the gguf package: pip install gguf")

from lib import gguf_file  # noqa: E402
from lib.chat import load_template, stop_ids  # noqa: E402
from configurator import ConfigError  # noqa: E402
from gguf_writer import FIXTURES, HUBS, LLAMA3_REGEX, llama_cpp_vocab, tiny_model, write_gguf  # noqa: E402
from model import GPT  # noqa: E402
from test_train import metrics, run  # noqa: E402
from lib.tokenizer import get_tokenizer, load_hf_tokenizer  # noqa: E402

with open(os.path.join(FIXTURES, "tiny-bpe-a", "reference.json"), encoding="utf-8") as f:
    CASES = json.load(f)["cases"]
QWEN2_REGEX = gguf_file.QWEN2_REGEX
# (the model, its quantization, the stop ids of its chat template (the file's own), the run's
# extra flags) for each family's file
FAMILIES = {
    "qwen2.5": (lambda: GPT.from_pretrained(os.path.join(FIXTURES, "tiny-qwen2-a"), dtype=torch.float32), "F32",
                [543, 541], ["--block_size=32"]),  # tiny-qwen2-a's 640 rows for 544 tokens
    "qwen3": (lambda: tiny_model("qwen3", vocab_size=576), "Q8_0", [543, 541],
              # each answer opens with an empty <think> block
              ["--block_size=40", "--chat_template_kwargs={'enable_thinking': False}"]),
    "llama3": (lambda: tiny_model("llama", n_embd=256, n_inner=512, vocab_size=552), "Q4_K",
               [550, 542], ["--block_size=96"]),  # Llama-3.1's system header is long here
}
# texts with what each family adds: its added tokens, the padding's text, digits (Llama-3 groups them in threes)
EXTRA = ["<think>\nok</think> <tool_call>{}</tool_call>", "[PAD600] [PAD549]x [PAD2]", "<|fim_prefix|>def f():",
         "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\n12345 + 678<|eot_id|>"]


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """written(hub) -> (hub, the family's .gguf file, the tokenizer.json it was converted from), each written once."""
    files = {}

    def write(hub):
        if hub not in files:
            folder, (model, qtype) = tmp_path_factory.mktemp(hub), FAMILIES[hub][:2]
            gguf_file._reader.cache_clear()
            path = write_gguf(str(folder / f"{hub}.gguf"), model(), qtype, hub=hub)
            (folder / "tokenizer.json").write_text(json.dumps(HUBS[hub]["tokenizer"]()), encoding="utf-8")
            files[hub] = hub, path, str(folder / "tokenizer.json")
        return files[hub]
    return write


@pytest.fixture(params=sorted(FAMILIES))
def family(request, written):
    return written(request.param)


def nfc(text):
    return unicodedata.normalize("NFC", text)


def test_tokenizer_ids_are_hugging_faces(family):
    """The reference's ids for all 38 texts (Qwen: its own layout; Llama-3: where its regex splits a text as Qwen2's
    does and NFC leaves it as it is, Llama-3 having no normalizer), and the tokenizer.json's own ids for every text,
    those with each family's added tokens included."""
    hub, path, json_file = family
    enc, reference = get_tokenizer(path), load_hf_tokenizer(json_file)
    same = [c for c in CASES if hub != "llama3" or (nfc(c["text"]) == c["text"] and regex.findall(
        LLAMA3_REGEX, c["text"]) == regex.findall(QWEN2_REGEX, c["text"]))]
    assert len(same) == (38 if hub != "llama3" else 29)
    for c in same:
        as_text = hub == "llama3"  # the reference's special tokens are Qwen's, plain text to Llama-3
        assert enc.encode(c["text"], allowed_special="all") == c["ids_specials_as_text" if as_text else "ids"]
        assert enc.encode_ordinary(c["text"]) == c["ids_specials_as_text"], c["text"]
    for text in [c["text"] for c in CASES] + EXTRA:
        assert enc.encode(text, allowed_special="all") == reference.encode(text, allowed_special="all"), text
        if hub != "qwen3" or "<|fim_prefix|>" not in text:  # see test_a_token_that_looks_special_is_control
            assert enc.encode_ordinary(text) == reference.encode_ordinary(text), text


def test_padding_decodes_and_is_never_encoded(family):
    """The UNUSED [PAD{id}] tokens keep their ids, so the tokenizer's ids are the embedding's rows: each decodes to
    its text, and its text encodes as any text does (HF's BPE has no merge making it), whatever is allowed."""
    hub, path, json_file = family
    enc, reference = get_tokenizer(path), load_hf_tokenizer(json_file)
    tokens, types = llama_cpp_vocab(HUBS[hub]["tokenizer"](), GPT.from_pretrained(path).config.vocab_size)
    padding = [i for i, t in enumerate(types) if t == 5]
    assert enc.n_vocab == len(tokens) == reference.n_vocab + len(padding)
    assert len(padding) == {"qwen2.5": 96, "qwen3": 27, "llama3": 0}[hub]
    for i in padding:
        text = f"[PAD{i}]"
        assert tokens[i] == text and enc.decode([i]) == text and pickle.loads(pickle.dumps(enc)).decode([i]) == text
        for ids in (enc.encode(text, allowed_special="all"), enc.encode(text, allowed_special={text}),
                    enc.encode_ordinary(text)):
            assert ids == reference.encode_ordinary(text) and max(ids) < reference.n_vocab


def test_stop_ids_and_the_tokenizer_files_written_from_the_file(family, tmp_path):
    """The chat template's end of turn, the file's eos and the end of text; write_hf_tokenizer's directory (which
    each checkpoint of a run holds) is the tokenizer.json without the padding, and tokenizes the same."""
    hub, path, _ = family
    assert stop_ids(get_tokenizer(path), load_template(path), path) == FAMILIES[hub][2]
    gguf_file.write_hf_tokenizer(path, str(tmp_path))
    again, enc = load_hf_tokenizer(str(tmp_path)), get_tokenizer(path)
    assert all(again.encode(t, allowed_special="all") == enc.encode(t, allowed_special="all") for t in EXTRA)
    config = json.load(open(tmp_path / "tokenizer_config.json"))
    assert config["add_bos_token"] is (hub == "llama3") and config["chat_template"] == HUBS[hub]["config"][
        "chat_template"]


def test_padded_qwen_embedding_keeps_its_rows(written):
    """The Qwen2.5 file holds tiny-qwen2-a's weights, 640 rows for 544 tokens: loaded from it, they compute the
    logits transformers computes from the Hugging Face checkpoint."""
    _, path, _ = written("qwen2.5")
    model = GPT.from_pretrained(path).eval()
    ref = load_file(os.path.join(FIXTURES, "tiny-qwen2-a", "reference.safetensors"))
    assert model.config.vocab_size == 640
    with torch.no_grad():
        torch.testing.assert_close(model.logits(ref["input_ids"]), ref["logits"], atol=1e-4, rtol=0)


def test_trains_two_iterations_from_the_file(family, tmp_path):
    """train.py with init_from= the file, whose chat template renders the prompts (the default,
    'auto'): two iterations, and a checkpoint whose weights keep every row and whose tokenizer (the
    file's, as Hugging Face files) tokenizes as the file's."""
    hub, path, _ = family
    out = tmp_path / "out"
    run(["config/dr_grpo.py", "--max_iters=2", f"--init_from={path}", "--system_prompt='Add.'",
         *FAMILIES[hub][3]], out)
    assert [m["iter"] for m in metrics(out) if "reward" in m] == [0, 1]
    ckpt = os.path.join(out, json.load(open(out / "latest")))
    saved = json.load(open(os.path.join(ckpt, "trainer.json")))["config"]
    assert saved["chat_template"] == path  # 'auto', resolved and saved
    assert GPT.from_pretrained(ckpt).config.vocab_size == GPT.from_pretrained(path).config.vocab_size
    text = EXTRA[0] + EXTRA[3]
    assert load_hf_tokenizer(ckpt).encode(text, allowed_special="all") == \
        get_tokenizer(path).encode(text, allowed_special="all")


def test_a_token_that_looks_special_is_control(written):
    """The converter makes an added token CONTROL when it looks special (<|...|>) though its tokenizer.json says
    special: false (Qwen's <|fim_prefix|>), and llama.cpp then matches it only where special tokens are: so does the
    file's tokenizer, where the tokenizer.json's matches it in any text. <think> stays USER_DEFINED: matched in any
    text, as the tokenizer.json does."""
    _, path, json_file = written("qwen3")
    enc, reference = get_tokenizer(path), load_hf_tokenizer(json_file)
    assert enc.encode("<|fim_prefix|>", allowed_special="all") == reference.encode_ordinary("<|fim_prefix|>") == [546]
    assert len(enc.encode_ordinary("<|fim_prefix|>")) > 1 and enc.encode_ordinary("<think>") == [547]


# -----------------------------------------------------------------------------
# the vocabulary against the embedding

def test_an_embedding_with_more_rows_than_tokens_loads_and_fewer_is_refused(tmp_path):
    """A file whose tokenizer lists fewer tokens than the embedding has rows (padded as a Hugging Face checkpoint is,
    without [PAD] tokens) loads, the model with every row; one listing more tokens than rows is refused."""
    tokens, types = llama_cpp_vocab(HUBS["qwen2.5"]["tokenizer"](), 544)
    short = {"tokenizer.ggml.tokens": tokens, "tokenizer.ggml.token_type": types}
    path = write_gguf(str(tmp_path / "rows.gguf"), tiny_model("qwen2", vocab_size=600), metadata=short)
    assert GPT.from_pretrained(path).config.vocab_size == 600 and get_tokenizer(path).n_vocab == 544
    gguf_file._reader.cache_clear()
    long = {"tokenizer.ggml.tokens": tokens + ["[PAD544]"], "tokenizer.ggml.token_type": types + [5]}
    path = write_gguf(str(tmp_path / "tokens.gguf"), tiny_model("qwen2"), metadata=long)
    with pytest.raises(ConfigError, match="the tokenizer has 545 tokens but token_embd.weight 544 rows") as e:
        GPT.from_pretrained(path)
    assert "\n" not in str(e.value)


def test_padding_typed_normal_is_refused_for_what_it_is(tmp_path):
    """The same [PAD] tokens typed NORMAL (BPE vocabulary, which no merge makes) cannot be reproduced: refused for
    that reason, in one line that names no family as loadable."""
    _, types = llama_cpp_vocab(HUBS["qwen2.5"]["tokenizer"](), 560)
    path = write_gguf(str(tmp_path / "normal.gguf"), tiny_model("qwen2", vocab_size=560),
                      metadata={"tokenizer.ggml.token_type": [1 if t == 5 else t for t in types]})
    with pytest.raises(ConfigError, match="vocab token '\\[PAD544\\]' is not reachable by its merges") as e:
        get_tokenizer(path)
    assert "\n" not in str(e.value) and "Qwen" not in str(e.value)
