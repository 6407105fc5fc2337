"""
Chat templates: the text each model's own Jinja template (tokenizer_config.json's chat_template) renders for a
conversation with add_generation_prompt=True, written out as plain string code, tools included for Qwen2.5's
(render_chat(..., tools=...), and render_tool_turn for the tools' results in a multi-turn rollout); a prompt's tokens
under one (encode_prompt), the special tokens a template needs (check_template) and the ids that end a completion
(stop_ids).
"""
import itertools
import json
import os

from lib import gguf_file
from lib.errors import ConfigError
from lib.hf import read_json
from lib.tokenizer import eos_ids

# the system message that Qwen2-Instruct's and Qwen2.5-Instruct's templates insert when the first one is not
QWEN2_SYSTEM = "You are a helpful assistant."
QWEN25_SYSTEM = "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."
SMOLLM2_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"  # SmolLM2-Instruct's
LLAMA3_DATES = "Cutting Knowledge Date: December 2023\nToday Date: 26 Jul 2024\n\n"  # Llama-3.1's system header
# Qwen2.5-Instruct's system message with tools: the system prompt, then these around one JSON line per tool
QWEN25_TOOLS_HEAD = ("\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are "
                     "provided with function signatures within <tools></tools> XML tags:\n<tools>")
QWEN25_TOOLS_TAIL = ("\n</tools>\n\nFor each function call, return a json object with function name and arguments "
                     "within <tool_call></tool_call> XML tags:\n<tool_call>\n"
                     '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>')
TEMPLATE_TOKENS = {"none": (), "chatml": ("<|im_start|>", "<|im_end|>"),
                   "llama3": ("<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>")}


def _template_tokens(template):
    if template not in TEMPLATE_TOKENS:
        raise ConfigError(f"chat_template {template!r} is not one of {list(TEMPLATE_TOKENS)}")
    return TEMPLATE_TOKENS[template]


def check_template(enc, template):
    """Refuse a chat template whose special tokens `enc` lacks: their text would be tokenized as plain text."""
    missing = [t for t in _template_tokens(template) if t not in enc.special_tokens_set]
    if missing:
        raise ConfigError(f"chat_template {template!r} needs the special tokens {missing}, which tokenizer "
                          f"{enc.name!r} lacks; use the template of the model's own tokenizer, or 'none'")


def _messages(prompt, tools=False):
    """The messages of a prompt, checked: a string is one user message. With tools, messages may also be tool
    results (role 'tool'), and the prompt may end with them."""
    roles, last = (("system", "user", "assistant", "tool"), ("user", "tool")) if tools else \
        (("system", "user", "assistant"), ("user",))
    if isinstance(prompt, str):
        return [dict(role="user", content=prompt)]
    if not isinstance(prompt, list) or not prompt:
        raise ConfigError(f"a prompt is a string or a non-empty list of messages, not {prompt!r:.100}")
    for i, m in enumerate(prompt):
        if not isinstance(m, dict) or set(m) != {"role", "content"}:
            raise ConfigError(f"prompt message {i} is not a dict with the keys 'role' and 'content' only: {m!r:.100}")
        if m["role"] not in roles:
            raise ConfigError(f"prompt message {i} has role {m['role']!r}, not {', '.join(map(repr, roles[:-1]))} "
                              f"or {roles[-1]!r}")
        if not isinstance(m["content"], str):
            raise ConfigError(f"prompt message {i} has content of type {type(m['content']).__name__}, not str")
    # the model answers the last message; after an assistant one, Qwen3's template would also add a <think> block
    if prompt[-1]["role"] not in last:
        raise ConfigError(f"the last prompt message is from {prompt[-1]['role']!r}: it must be the user's" +
                          (" or a tool result" if tools else "") + ", to answer")
    return prompt


def render_chat(prompt, template, system_prompt=None, enable_thinking=None, tools=None):
    """The text to tokenize (special tokens as text, for encode(allowed_special="all")) for `prompt`, a string or a
    list of {"role", "content"} messages, ending with the header of the assistant's answer. `system_prompt` becomes
    the first message when the first message is not a system one. The templates, and what each reproduces exactly:

    'none': a string prompt as it is (no messages, system_prompt or enable_thinking).
    'chatml': Qwen2, Qwen2.5 and Qwen3's templates. Qwen2's and Qwen2.5's insert a default system message when the
        first message is not one: give them system_prompt=QWEN2_SYSTEM / QWEN25_SYSTEM to match them byte for byte
        (without it this is Qwen3's, which has none). enable_thinking is Qwen3's switch: False opens the answer with an
        empty <think> block, True and None (thinking, its default) add nothing. Deliberate difference: an assistant
        turn is rendered as given, where Qwen3's drops the <think>...</think> reasoning from past turns.
    'llama3': Llama-3.1/3.2/3.3-Instruct's template: a system header always, holding the date lines LLAMA3_DATES and
        then the system message if any, and every message's content stripped (its `| trim`). Deliberate difference:
        the date is always 26 Jul 2024, the default of Llama-3.1's template (Llama-3.2's uses today's date where
        strftime_now is defined, as in transformers), so that a prompt's tokens never change. Llama-3.0's template
        (no system header unless given, no date lines) is not reproduced.
    tools: a list of tool descriptions in the OpenAI/Qwen function format (tools.TOOLS' second items), with 'chatml'
        only: Qwen2.5-Instruct's template with tools (Qwen3's differs), whose system message is the system prompt,
        or QWEN25_SYSTEM without one, and then the tools' JSON lines. Messages may then also be tool results (role
        'tool', content the result string), each run of them one user turn of <tool_response> blocks, and the
        prompt may end with them. An assistant turn is its raw text, <tool_call> blocks included: the template
        writes structured tool calls as exactly that text. No enable_thinking with tools.
    """
    _template_tokens(template)
    if tools and template != "chatml":
        raise ConfigError(f"tools need chat_template 'chatml' (Qwen2.5's tool calls), not {template!r}")
    if tools and enable_thinking is not None:
        raise ConfigError("enable_thinking is Qwen3's switch; with tools, 'chatml' renders Qwen2.5's template, which "
                          "has none")
    if tools and (not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools)):
        raise ConfigError(f"tools is a list of tool descriptions (dicts), not {tools!r:.100}")
    if template == "none":
        if not isinstance(prompt, str):
            raise ConfigError("the prompt is a list of messages: set chat_template to 'chatml' or 'llama3' to "
                              "render it")
        if system_prompt is not None or enable_thinking is not None:
            raise ConfigError("system_prompt and enable_thinking need chat_template 'chatml' or 'llama3', not 'none'")
        return prompt
    if enable_thinking is not None and template != "chatml":
        raise ConfigError(f"enable_thinking is Qwen3's switch (chat_template 'chatml'); {template!r} has none")
    messages = _messages(prompt, tools)
    if system_prompt is not None and messages[0]["role"] != "system":
        messages = [dict(role="system", content=system_prompt), *messages]
    if tools:
        return _render_with_tools(messages, tools)
    if template == "chatml":
        turns = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
        return turns + "<|im_start|>assistant\n" + ("<think>\n\n</think>\n\n" if enable_thinking is False else "")
    def header(role):
        return f"<|start_header_id|>{role}<|end_header_id|>\n\n"
    system, messages = (messages[0]["content"], messages[1:]) if messages[0]["role"] == "system" else ("", messages)
    turns = "".join(header(m["role"]) + m["content"].strip() + "<|eot_id|>" for m in messages)
    return (f"<|begin_of_text|>{header('system')}{LLAMA3_DATES}{system.strip()}<|eot_id|>" + turns +
            header("assistant"))


def _tool_results(results):
    """A run of tool results as Qwen2.5's template renders it, one user turn of <tool_response> blocks, in parts
    that alternate the template's markup and the results."""
    parts = ["<|im_start|>user"]
    for result in results:
        parts[-1] += "\n<tool_response>\n"
        parts += [result, "\n</tool_response>"]
    parts[-1] += "<|im_end|>\n"
    return parts


def _render_with_tools(messages, tools):
    """Qwen2.5-Instruct's template with tools (see render_chat)."""
    system, rest = ((messages[0]["content"], messages[1:]) if messages[0]["role"] == "system" else
                    (QWEN25_SYSTEM, messages))
    # one line per tool, as the template's tojson writes it in transformers: json.dumps, non-ASCII kept, keys in order
    lines = "".join("\n" + json.dumps(tool, ensure_ascii=False) for tool in tools)
    text = f"<|im_start|>system\n{system}{QWEN25_TOOLS_HEAD}{lines}{QWEN25_TOOLS_TAIL}<|im_end|>\n"
    for is_tool, run in itertools.groupby(rest, key=lambda m: m["role"] == "tool"):
        text += "".join(_tool_results([m["content"] for m in run])) if is_tool else \
            "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in run)
    return text + "<|im_start|>assistant\n"


def render_tool_turn(results, template="chatml"):
    """The text that follows an assistant turn ending in tool calls, and its '<|im_end|>', once `results` (the
    tools' result strings, in the order of the calls) are in: the end of that line, the results as one user turn of
    <tool_response> blocks, and the header of the assistant's next answer. So that render_chat(prompt, 'chatml',
    tools=...) + the assistant's text + '<|im_end|>' + render_tool_turn(results) is render_chat of the conversation
    with the assistant's turn and the results: a multi-turn rollout extends its text, and never re-renders it."""
    return "".join(tool_turn_parts(results, template))


def tool_turn_parts(results, template="chatml"):
    """render_tool_turn's text in parts that alternate the template's markup and the results, as a multi-turn
    rollout encodes it: the markup's special tokens are theirs, the results are ordinary text whatever they hold."""
    if template != "chatml":
        raise ConfigError(f"render_tool_turn renders chat_template 'chatml' (Qwen2.5's tool results), not "
                          f"{template!r}")
    if not isinstance(results, list) or not results or not all(isinstance(r, str) for r in results):
        raise ConfigError(f"render_tool_turn takes a non-empty list of result strings, not {results!r:.100}")
    parts = _tool_results(results)
    parts[0], parts[-1] = "\n" + parts[0], parts[-1] + "<|im_start|>assistant\n"
    return parts


def encode_prompt(prompt, cfg, enc):
    """A row's prompt (a string or a list of messages) as token ids: the text as it is, or rendered by the chat
    template, whose special tokens then become their ids."""
    text = render_chat(prompt, cfg.chat_template, cfg.system_prompt, cfg.enable_thinking)
    return enc.encode_ordinary(text) if cfg.chat_template == 'none' else enc.encode(text, allowed_special='all')


def stop_ids(enc, template="none", path=None):
    """The ids that end a completion; the first is the one a finished answer is written with (warm start, padding):
    the chat template's end of turn, then the eos ids of the checkpoint the tokenizer came from (path: its
    directory, tokenizer.json or .gguf file; instruct models list several), then the tokenizer's end of text.
    Checks first that enc has the template's special tokens."""
    check_template(enc, template)
    turn_end = {"chatml": "<|im_end|>", "llama3": "<|eot_id|>"}.get(template)
    ids = [enc.encode_single_token(turn_end)] if turn_end else []
    path = path if path and os.path.exists(path) else None  # a built-in tokenizer's name is no checkpoint
    folder = path if path is None or os.path.isdir(path) or path.endswith(".gguf") else os.path.dirname(path)
    ids += (folder and eos_ids(folder)) or []
    ids += [enc.eot_token] if enc.eot_token is not None else []
    return list(dict.fromkeys(ids))  # no repeats, first one first


def text_of(ids, cfg, enc):
    """The text of a trajectory's tokens, as the environment and the reward functions read it: its final eos left out
    (a stop token kept, and the eos ids inside it, such as the end of a chat turn), and ids past the tokenizer's
    vocabulary, which a padded output layer can sample."""
    ids = ids[:-1] if ids and ids[-1] in cfg.eos_ids else ids
    return enc.decode([x for x in ids if x < enc.n_vocab])


def template_of(path):
    """(chat_template, system_prompt) that render_chat needs to reproduce the template of the checkpoint at path (a
    Hugging Face directory's tokenizer_config.json, or a .gguf's tokenizer.chat_template): 'chatml' or 'llama3' by
    their special tokens, with the default system message the template inserts, if it is one of those it knows."""
    if str(path).endswith(".gguf"):
        jinja = gguf_file.chat_template(path)
    else:
        file = os.path.join(path, "tokenizer_config.json")
        jinja = read_json(file, "", "restore it from the checkpoint's files").get("chat_template") \
            if os.path.isfile(file) else None
    jinja = jinja if isinstance(jinja, str) else ""  # a list of named templates, or none
    if "<|im_start|>" in jinja:
        return "chatml", next((s for s in (QWEN25_SYSTEM, SMOLLM2_SYSTEM, QWEN2_SYSTEM) if s in jinja), None)
    if "<|start_header_id|>" in jinja:
        return "llama3", None
    raise ConfigError(f"{path}: its chat template is {'missing' if not jinja else 'neither ChatML (Qwen) nor Llama-3'}"
                      f"; nanoGRPO renders those two (lib/chat.py): use a checkpoint with one of them")


def render_answered(prompt, completion, template, system_prompt=None):
    """The text of `prompt` answered by `completion` as the template renders the whole conversation (transformers'
    apply_chat_template with the assistant's message, no generation prompt): what a reward model reads."""
    if template == "none":
        return render_chat(prompt, template) + completion
    head = render_chat(prompt, template, system_prompt)
    return head + (completion + "<|im_end|>\n" if template == "chatml" else completion.strip() + "<|eot_id|>")
