"""
Tests for lib/gguf_file.py on tiny GGUFs written here with the gguf package's writer (tests/gguf_writer.py): a Llama, a
Qwen2 with q/k/v biases and a Qwen3 with q/k norms, in float and quantized types. The loaded weights are the
dequantization gguf itself gives, the logits those of the same weights loaded from safetensors, llama.cpp's q/k row
order is undone (and a file without it is caught), the tokenizer from the metadata tokenizes as the tokenizer.json
it came from (against Hugging Face tokenizers' ids), and every refusal is one line naming what is unsupported.
tests/fixtures/gguf holds a few such files with the logits transformers' own GGUF loader computes from them.
"""
import json
import os
import sys

import numpy as np
import pytest
import regex
import torch
from safetensors.torch import load_file, save_file

gguf = pytest.importorskip("gguf", reason="gguf_file needs the gguf package: pip install gguf")

from lib import gguf_file  # noqa: E402
from configurator import ConfigError  # noqa: E402
from gguf_writer import gguf_name, llama_cpp_order, tiny_model, write_gguf  # noqa: E402
from model import GPT  # noqa: E402
from lib.chat import load_template, stop_ids  # noqa: E402
from lib.tokenizer import get_tokenizer, load_hf_tokenizer  # noqa: E402

HERE = os.path.dirname(__file__)
BPE_REF = os.path.join(HERE, "fixtures", "tiny-bpe-a", "reference.json")
FIXTURES = os.path.join(HERE, "fixtures", "gguf")
IDS = torch.tensor([[3, 17, 250, 9, 400, 31, 77, 5, 123, 6]])


@pytest.fixture(autouse=True)
def fresh_reader():
    gguf_file._reader.cache_clear()  # each test writes its own files, some at the same path
    yield
    gguf_file._reader.cache_clear()


def dequantized(path):
    """{Hugging Face name: float32 tensor} as gguf dequantizes the file, a Llama's q/k rows put back by hand."""
    reader, out = gguf.GGUFReader(path), {}
    arch = reader.fields["general.architecture"].contents()
    heads = {".attn_q.": reader.fields[f"{arch}.attention.head_count"].contents(),
             ".attn_k.": reader.fields[f"{arch}.attention.head_count_kv"].contents()}
    names = {gguf_name(n): n for n in tiny_names(reader)}
    for t in reader.tensors:
        w = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
        for part, n in heads.items():
            if arch == "llama" and part in t.name:  # llama_cpp_order's inverse: the pairs back to two halves
                hd = w.shape[0] // n
                w = w.reshape(n, hd // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
        out[names[t.name]] = torch.from_numpy(w.copy())
    return out


def tiny_names(reader):
    layers = reader.fields[f"{reader.fields['general.architecture'].contents()}.block_count"].contents()
    names = ["model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"]
    for i in range(layers):
        for part in ("input_layernorm", "post_attention_layernorm", "self_attn.q_proj", "self_attn.k_proj",
                     "self_attn.v_proj", "self_attn.o_proj", "self_attn.q_norm", "self_attn.k_norm", "mlp.gate_proj",
                     "mlp.up_proj", "mlp.down_proj"):
            names += [f"model.layers.{i}.{part}.weight", f"model.layers.{i}.{part}.bias"]
    return names


def same_weights_from_safetensors(path, tmp_path):
    """The model whose weights are gguf's dequantization of path, loaded through the safetensors path."""
    model = GPT.from_pretrained(path)
    folder = tmp_path / "as_safetensors"
    model.save_pretrained(folder)  # its config.json; the weights are replaced by gguf's own dequantization
    save_file(dequantized(path), folder / "model.safetensors")
    return model, GPT.from_pretrained(folder)


CASES = [("llama", "F32"), ("llama", "Q8_0"), ("llama", "Q4_1"), ("qwen2", "F16"), ("qwen2", "Q4_0"),
         ("qwen3", "BF16"), ("qwen3", "Q5_1"), ("qwen2", "Q5_0")]


@pytest.mark.parametrize("arch, qtype", CASES + [(arch, k) for arch in ("llama", "qwen2")
                                                 for k in ("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")])
def test_weights_are_ggufs_dequantization_and_logits_match_safetensors(tmp_path, arch, qtype):
    """Each parameter equals what gguf.quants.dequantize gives for its tensor (q/k rows put back), and the model's
    logits equal those of the same float32 weights written as safetensors and loaded as a Hugging Face directory.
    K-quant blocks need rows of 256 values: those models are 256 wide."""
    wide = qtype.endswith("_K")
    model = tiny_model(arch, n_embd=256 if wide else 64, n_inner=512 if wide else 128)
    path = write_gguf(str(tmp_path / f"{arch}-{qtype}.gguf"), model, qtype)
    loaded, reference = same_weights_from_safetensors(path, tmp_path)
    ours, theirs = loaded.state_dict(), reference.state_dict()
    for name in theirs:
        assert torch.equal(ours[name], theirs[name]), name
    assert torch.equal(loaded.logits(IDS), reference.logits(IDS))
    if qtype == "F32":  # no rounding at all: the model written is the model read
        assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), loaded.state_dict().values()))


def test_quantized_logits_stay_near_the_float_model(tmp_path):
    """Q8_0 is 8 bits a weight: the logits of the quantized model stay close to the float32 model's, so nothing
    is scrambled on the way (a wrong row order or a swapped tensor would change them completely)."""
    model = tiny_model("llama")
    loaded = GPT.from_pretrained(write_gguf(str(tmp_path / "q8.gguf"), model, "Q8_0"))
    with torch.no_grad():
        assert torch.allclose(loaded.logits(IDS), model.logits(IDS), atol=2e-2)


def test_the_llama_q_k_reordering_is_undone_and_a_wrong_order_is_caught(tmp_path):
    """A Llama written without llama.cpp's q/k reordering (a converter that forgot it) loads to other weights and
    other logits; written with it, it loads back bit for bit. Qwen2 and Qwen3 are stored unreordered."""
    model = tiny_model("llama")
    good = GPT.from_pretrained(write_gguf(str(tmp_path / "good.gguf"), model))
    bad = GPT.from_pretrained(write_gguf(str(tmp_path / "bad.gguf"), model, reorder=False))
    with torch.no_grad():
        assert torch.equal(good.logits(IDS), model.logits(IDS))
        assert not torch.allclose(bad.logits(IDS), model.logits(IDS), atol=1e-3)
    q = model.transformer.h[0].attn.c_attn.weight[:64]
    assert not torch.equal(torch.from_numpy(llama_cpp_order(q.detach().numpy(), 4)), q)  # the order does differ
    for arch in ("qwen2", "qwen3"):
        m = tiny_model(arch)
        with torch.no_grad():
            assert torch.equal(GPT.from_pretrained(write_gguf(str(tmp_path / f"{arch}.gguf"), m)).logits(IDS), m.logits(IDS))


@pytest.mark.parametrize("tied", [True, False])
def test_tied_and_untied_output_layer(tmp_path, tied):
    model = tiny_model("llama", tied=tied)
    loaded = GPT.from_pretrained(write_gguf(str(tmp_path / "m.gguf"), model))
    assert loaded.config.tie_word_embeddings is tied
    assert (loaded.lm_head.weight is loaded.transformer.wte.weight) is tied
    with torch.no_grad():
        assert torch.equal(loaded.logits(IDS), model.logits(IDS))


def test_config_from_metadata(tmp_path):
    model = tiny_model("qwen3", n_layer=2)
    cfg = GPT.from_pretrained(write_gguf(str(tmp_path / "m.gguf"), model)).config
    for key in ("model_type", "n_layer", "n_head", "n_kv_head", "n_embd", "head_dim", "n_inner", "vocab_size",
                "block_size", "qk_norm", "qkv_bias", "bias", "rope_theta", "tie_word_embeddings", "rope_scaling"):
        assert getattr(cfg, key) == getattr(model.config, key), key
    assert cfg.norm_eps == pytest.approx(1e-6)


def test_llama3_rope_scaling_from_rope_freqs(tmp_path):
    """llama.cpp stores Llama-3.1's rope scaling as per-frequency divisors (rope_freqs): read back as the
    config.json rope_scaling that makes the same frequencies; divisors of another scaling are refused."""
    model = tiny_model("llama", n_embd=128)
    head_dim, theta = model.config.head_dim, model.config.rope_theta
    inv = 1.0 / theta ** (np.arange(0, head_dim, 2) / head_dim)
    wavelen = 2 * np.pi / inv
    # Llama-3.1's rule as its paper's code states it, with factor 8 and an original context of 8192
    divisor = np.where(wavelen < 8192 / 4, 1.0, np.where(wavelen > 8192, 8.0, 0.0))
    mid = divisor == 0
    smooth = (8192 / wavelen[mid] - 1) / 3
    divisor[mid] = 1 / ((1 - smooth) / 8 + smooth)
    path = write_gguf(str(tmp_path / "m.gguf"), model, extra={"rope_freqs.weight": divisor})
    cfg = GPT.from_pretrained(path).config
    assert cfg.rope_scaling == dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                    original_max_position_embeddings=8192)
    bad = write_gguf(str(tmp_path / "bad.gguf"), model, extra={"rope_freqs.weight": divisor ** 0.5})
    one_line(lambda: GPT.from_pretrained(bad), "its rope_freqs are not Llama-3.1's rope scaling")


# -----------------------------------------------------------------------------
# the tokenizer from the metadata

def test_tokenizer_from_metadata_matches_hf_tokenizers(tmp_path):
    """tiny-bpe-a's tokenizer.json (Qwen2.5's layout) written as GGUF metadata with pre 'qwen2': the tokenizer built
    from it gives Hugging Face tokenizers' ids for all 38 reference texts, special tokens allowed and as text."""
    path = write_gguf(str(tmp_path / "m.gguf"), tiny_model("qwen2"))
    enc = get_tokenizer(path)
    with open(BPE_REF, encoding="utf-8") as f:
        cases = json.load(f)["cases"]
    for c in cases:
        assert enc.encode(c["text"], allowed_special="all") == c["ids"], c["text"]
        assert enc.encode_ordinary(c["text"]) == c["ids_specials_as_text"], c["text"]
    assert enc.n_vocab == 544 and enc.eot_token == 541


@pytest.mark.parametrize("pre, pieces", [
    ("gpt-2", ["Hello", " 12345", " ", " x"]),
    ("llama-bpe", ["Hello", " ", "123", "45", " ", " x"]),  # Llama-3: digits in threes
    ("smollm", ["Hello", " ", "1", "2", "3", "4", "5", " ", " x"]),  # Digits first: a space before a digit alone
    ("qwen2", ["Hello", " ", "1", "2", "3", "4", "5", " ", " x"]),
])
def test_each_pre_tokenizer_splits_as_its_model(tmp_path, pre, pieces):
    """tokenizer.ggml.pre picks the pre-tokenizer of the model's own tokenizer.json, and Qwen2's NFC normalizer."""
    enc = get_tokenizer(write_gguf(str(tmp_path / "m.gguf"), tiny_model("qwen2"), pre=pre))
    assert regex.findall(enc._pat_str, "Hello 12345  x") == pieces
    assert enc._nfc == (pre == "qwen2")


def test_eos_ids_and_stop_ids(tmp_path):
    path = write_gguf(str(tmp_path / "m.gguf"), tiny_model("qwen2"),
                      metadata={"tokenizer.ggml.eot_token_id": 541})
    assert gguf_file.eos_ids(path) == [541, 543]
    assert stop_ids(get_tokenizer(path), load_template(path), path) == [543, 541]


def test_hf_tokenizer_files_written_from_a_gguf_load_the_same(tmp_path):
    path = write_gguf(str(tmp_path / "m.gguf"), tiny_model("qwen2"),
                      metadata={"tokenizer.chat_template": "{{ messages }}"})
    gguf_file.write_hf_tokenizer(path, str(tmp_path / "tok"))
    enc, again = get_tokenizer(path), load_hf_tokenizer(str(tmp_path / "tok"))
    text = "<|im_start|>user\nCafé 123  x<|im_end|>"
    assert again.encode(text, allowed_special="all") == enc.encode(text, allowed_special="all")
    with open(tmp_path / "tok" / "tokenizer_config.json") as f:
        config = json.load(f)
    assert config["chat_template"] == "{{ messages }}" and config["eos_token"] == "<|im_end|>"
    with open(tmp_path / "tok" / "generation_config.json") as f:
        assert json.load(f)["eos_token_id"] == [543]


# -----------------------------------------------------------------------------
# refusals: one line, naming the file and what is unsupported

def one_line(call, match):
    with pytest.raises(ConfigError, match=match) as e:
        call()
    assert "\n" not in str(e.value)


REFUSED = [  # (what is written, what the line says)
    (dict(metadata={"general.architecture": "phi3"}), "architecture 'phi3' is not supported"),
    (dict(qtype="IQ4_NL"), "is IQ4_NL, which is not supported"),
    (dict(drop=("blk.0.ffn_up.weight",)), "missing tensor 'model.layers.0.mlp.up_proj.weight'"),
    (dict(metadata={"llama.embedding_length": None}), "metadata 'llama.embedding_length' is missing"),
    (dict(metadata={"llama.rope.scaling.type": "yarn", "llama.rope.scaling.factor": 4.0}),
     "rope scaling 'yarn' is not supported"),
]


@pytest.mark.parametrize("kwargs, match", REFUSED)
def test_refused_models(tmp_path, kwargs, match):
    path = write_gguf(str(tmp_path / "m.gguf"), tiny_model("llama"), **kwargs)
    one_line(lambda: GPT.from_pretrained(path), match)


def retyped(i, kind):
    """metadata giving token i of the usual file (541 NORMAL, then 3 CONTROL) token type kind instead."""
    types = [1] * 541 + [3] * 3
    types[i] = kind
    return {"tokenizer.ggml.token_type": types}


@pytest.mark.parametrize("kwargs, match", [
    (dict(metadata={"tokenizer.ggml.model": "llama"}),
     "a SentencePiece tokenizer .* in a 'llama' GGUF; nanoGRPO reads those of gemma"),
    (dict(metadata={"tokenizer.ggml.model": "bert"}),
     "tokenizer.ggml.model 'bert' is not a byte-level BPE"),
    (dict(metadata=retyped(0, 2)), "token '!' \\(id 0\\) has token type UNKNOWN \\(2\\), which llama.cpp's converter "
                                   "writes for SentencePiece vocabularies"),
    (dict(metadata=retyped(33, 6)), "token 'B' \\(id 33\\) has token type BYTE \\(6\\)"),
    (dict(metadata=retyped(541, 9)), "token '<\\|endoftext\\|>' \\(id 541\\) has token type 9, none of llama.cpp's"),
    (dict(metadata={"tokenizer.ggml.token_type": [1] * 540}), "token_type has 540 entries for 544 tokens"),
    (dict(pre="deepseek-llm"), "tokenizer.ggml.pre 'deepseek-llm' is not supported"),
    (dict(metadata={"tokenizer.ggml.merges": None}), "metadata 'tokenizer.ggml.merges' is missing"),
])
def test_refused_tokenizers(tmp_path, kwargs, match):
    path = write_gguf(str(tmp_path / "m.gguf"), tiny_model("llama"), **kwargs)
    one_line(lambda: get_tokenizer(path), match)


def test_a_damaged_or_missing_file_and_a_missing_package(tmp_path, monkeypatch):
    path = write_gguf(str(tmp_path / "m.gguf"), tiny_model("llama"))
    with open(path, "rb") as f:
        head = f.read(4096)
    (tmp_path / "cut.gguf").write_bytes(head)
    one_line(lambda: GPT.from_pretrained(str(tmp_path / "cut.gguf")), "cut.gguf cannot be read as GGUF")
    (tmp_path / "text.gguf").write_text("not a gguf file")
    one_line(lambda: get_tokenizer(str(tmp_path / "text.gguf")), "text.gguf cannot be read as GGUF")
    one_line(lambda: GPT.from_pretrained(str(tmp_path / "none.gguf")), "none.gguf not found")
    gguf_file._reader.cache_clear()
    monkeypatch.setitem(sys.modules, "gguf", None)  # as if not installed
    one_line(lambda: GPT.from_pretrained(path), "needs the gguf package.*pip install gguf")


# -----------------------------------------------------------------------------
# against transformers' own GGUF loader (tests/fixtures/gguf, computed once in a side virtualenv)

@pytest.mark.parametrize("name", sorted(f for f in os.listdir(FIXTURES) if f.endswith(".gguf"))
                         if os.path.isdir(FIXTURES) else [])
def test_logits_match_transformers_gguf_loading(name):
    """The logits that transformers computes from each fixture file, loaded with
    AutoModelForCausalLM.from_pretrained(folder, gguf_file=name) in float32."""
    reference = load_file(os.path.join(FIXTURES, name.replace(".gguf", ".safetensors")))
    model = GPT.from_pretrained(os.path.join(FIXTURES, name))
    with torch.no_grad():
        logits = model.logits(reference["ids"][None])[0]
    torch.testing.assert_close(logits, reference["logits"], atol=2e-5, rtol=1e-4)
