"""
Chat templates: every checkpoint's own Jinja template, found where checkpoints keep it
(load_template) and rendered as transformers renders it, in jinja2's sandbox with transformers'
settings, filters and globals (apply_chat_template). No family is written out by hand, so none can
drift from its model. Then a prompt's tokens under the run's template (encode_prompt), the tokens
that end a turn (stop_ids) and what a multi-turn rollout appends for tool results (tool_turn), where
only the template's own text makes special tokens (encode_chat, encode_pieces).
docs/chat_templates.md says why exactness matters for RL.
"""
import datetime
import functools
import json
import os
import re
from types import SimpleNamespace

import jinja2
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

from lib import gguf_file
from lib.errors import ConfigError
from lib.hf import read_json
from lib.tokenizer import _alternation, _split, eos_ids

# the special-token strings a template reads, as transformers passes them (its special_tokens_map)
TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token",
               "mask_token")
# a template's own control tokens: <|im_start|>, DeepSeek's <｜User｜>, Gemma's <start_of_turn>
CONTROL = re.compile(r"<\|[^<>|\s]{1,40}\|>|<｜[^<>｜]{1,40}｜>|<(?:start|end)_of_turn>")
# stand-ins for the policy's turn and the results, to find what a template writes around them
TURN, PLACEHOLDER = "nanoGRPO's turn", "nanoGRPO-result-"
HOW = ("give chat_template= a .jinja file or the template's text, or chat_template='none' for raw "
       "string prompts")


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # jinja2's tojson escapes <, >, & and ' for HTML; templates are written against transformers'
    # filter, json.dumps with these keywords, so tools keep their non-ASCII text and key order
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _raise(message):
    raise jinja2.TemplateError(message)


class _Generation(Extension):
    """{% generation %}...{% endgeneration %} marks the assistant's own text (for an SFT loss mask
    in transformers); rendering it is rendering its body."""
    tags = {"generation"}

    def parse(self, parser):
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


@functools.lru_cache(maxsize=32)
def compile_template(text):
    """A template's text compiled once per run (lru_cache): the sandbox transformers renders in,
    with its trim_blocks, lstrip_blocks, loop controls, tojson and raise_exception (strftime_now
    comes at render time)."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_Generation, loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise
    try:
        return env.from_string(text)
    except jinja2.TemplateSyntaxError as e:
        raise ConfigError(f"the chat template is not valid Jinja: {e.message} (its line "
                          f"{e.lineno}); {HOW}") from None


def find_template(path):
    """(the chat template, {token name: string}) of the checkpoint at path: a Hugging Face
    directory's chat_template.jinja (transformers 5 writes it), chat_template.json or
    tokenizer_config.json's chat_template (a string, or a list of named templates: then {name:
    text}), or a .gguf's tokenizer.chat_template; None if it has none. The tokens are
    tokenizer_config.json's (or special_tokens_map.json's), a GGUF's by their ids."""
    if str(path).endswith(".gguf"):
        return gguf_file.chat_template(path), gguf_file.special_tokens(path)
    fix = "restore it from the checkpoint's files"
    files = [os.path.join(path, f) for f in ("tokenizer_config.json", "special_tokens_map.json")]
    config, tokens = (read_json(f, "", fix) if os.path.isfile(f) else {} for f in files)
    tokens = {k: config.get(k, tokens.get(k)) for k in TOKEN_NAMES}  # a string or AddedToken dict
    tokens = {k: v.get("content") if isinstance(v, dict) else v for k, v in tokens.items() if v}
    if os.path.isfile(os.path.join(path, "chat_template.jinja")):
        with open(os.path.join(path, "chat_template.jinja"), encoding="utf-8") as f:
            return f.read(), tokens
    if os.path.isfile(os.path.join(path, "chat_template.json")):
        file = os.path.join(path, "chat_template.json")
        return read_json(file, "", fix).get("chat_template"), tokens
    template = config.get("chat_template")
    if isinstance(template, list):  # [{"name": "default", "template": ...}, {"name": ...}]
        template = {t["name"]: t["template"] for t in template}
    return template, tokens


def load_template(source, checkpoint=None, date=None):
    """The chat template `source` names, or None for 'none': a checkpoint (a Hugging Face directory
    or a .gguf; 'auto' is `checkpoint`'s), a .jinja file or the template's text (their special
    tokens `checkpoint`'s). A template writes `date` (YYYY-MM-DD) where it calls strftime_now; None:
    today's, as transformers does."""
    tokens = find_template(checkpoint)[1] if checkpoint and os.path.exists(checkpoint) else {}
    if source == "none" or source == "auto" and not (checkpoint and os.path.exists(checkpoint)):
        return None
    where = checkpoint if source == "auto" else source
    if os.path.isdir(where) or str(where).endswith(".gguf") and os.path.isfile(where):
        text, tokens = find_template(where)
        if text is None:
            return None if source == "auto" else _missing(where)
    elif os.path.isfile(where):
        with open(where, encoding="utf-8") as f:
            text = f.read()
    elif isinstance(source, str) and ("{{" in source or "{%" in source):
        text, where = source, "the chat template given"
    else:
        raise ConfigError(f"chat_template={source!r} is not 'auto', 'none', a checkpoint, a .jinja "
                          f"file or a template's text (Jinja, with {{{{ or {{%)")
    texts = text if isinstance(text, dict) else {"default": text}
    for t in texts.values():
        compile_template(t)  # invalid Jinja fails now, not at the first prompt
    return SimpleNamespace(texts=texts, tokens=tokens, date=date, where=where)


def _missing(path, how=HOW):
    raise ConfigError(f"{path} has no chat template (chat_template.jinja, chat_template.json or "
                      f"tokenizer_config.json's chat_template); {how}")


def checkpoint_template(path, date=None):
    """The chat template of the checkpoint at path, which needs one (a reward model, a judge)."""
    if find_template(path)[0] is None:
        _missing(path, "a reward model or judge reads its own: put the one it was trained with "
                       "there, as chat_template.jinja")
    return load_template(path, date=date)


def _strftime_now(date):
    day = datetime.datetime.fromisoformat(date) if date else datetime.datetime.now()
    return lambda fmt: day.strftime(fmt)


def apply_chat_template(template, messages, tools=None, add_generation_prompt=False, **kwargs):
    """The text transformers' tokenizer.apply_chat_template(messages, tools=tools, tokenize=False,
    add_generation_prompt=..., **kwargs) renders, byte for byte. template: load_template's, a
    checkpoint's path or a template's text. kwargs are the template's own (documents,
    enable_thinking, ...) and override its special tokens; messages' keys that are None are left
    out, as transformers does. A template that refuses the conversation (its raise_exception, e.g.
    roles that must alternate), or tries to reach Python internals, is a ConfigError of one line."""
    if not isinstance(template, SimpleNamespace):
        template = load_template(template) or _missing(template)
    texts = template.texts
    name = kwargs.pop("chat_template", None) or (
        "tool_use" if tools is not None and "tool_use" in texts else "default")
    if name not in texts:
        raise ConfigError(f"{template.where} has the chat templates {sorted(texts)}, none named "
                          f"{name!r}")
    messages = [{k: v for k, v in m.items() if v is not None} for m in messages]
    try:
        return compile_template(texts[name]).render(
            messages=messages, tools=tools, documents=kwargs.pop("documents", None),
            add_generation_prompt=add_generation_prompt, strftime_now=_strftime_now(template.date),
            **{**template.tokens, **kwargs})
    except jinja2.exceptions.SecurityError as e:
        raise ConfigError(f"{template.where}'s chat template tried to reach Python internals, "
                          f"which the sandbox refuses ({e}); {HOW}") from None
    except jinja2.TemplateError as e:
        raise ConfigError(f"{template.where}'s chat template refuses the conversation: "
                          f"{e.message}") from None


def _probe(template):
    """A short conversation as the template renders it, with a system message if it takes one."""
    user, answer = dict(role="user", content="2+2?"), dict(role="assistant", content="4")
    system = dict(role="system", content="S")
    for messages in ([system, user, answer, user], [user, answer, user], [user]):
        try:
            return apply_chat_template(template, messages, add_generation_prompt=True)
        except ConfigError:
            continue
    return apply_chat_template(template, [user], add_generation_prompt=True)  # its own error, then


def check_template(template, enc, name):
    """Refuse a template writing a control token (<|im_start|>, its bos_token, ...) that tokenizer
    `name` lacks as a special token: as plain text, it makes a prompt the model never saw."""
    if template is None:
        return
    text = _probe(template)
    wanted = set(CONTROL.findall(text)) | {t for t in template.tokens.values() if t in text}
    missing = sorted(wanted - enc.special_tokens_set)
    if missing:
        raise ConfigError(f"{template.where}'s chat template writes the special tokens {missing}, "
                          f"which tokenizer {name!r} lacks; use the checkpoint's own tokenizer, or "
                          f"chat_template='none'")


def prompt_messages(prompt, system_prompt=None):
    """The messages of a prompt, checked: a string is one user message; system_prompt comes first
    where the first message is not a system one. The model answers the last message, so it is not
    the assistant's."""
    if isinstance(prompt, str):
        prompt = [dict(role="user", content=prompt)]
    if not isinstance(prompt, list) or not prompt:
        raise ConfigError(f"a prompt is a string or a non-empty list of messages, not "
                          f"{prompt!r:.100}")
    for i, m in enumerate(prompt):
        if not (isinstance(m, dict) and isinstance(m.get("role"), str) and
                isinstance(m.get("content"), str)):
            raise ConfigError(f"prompt message {i} is not a dict with a string 'role' and "
                              f"'content': {m!r:.100}")
    if prompt[-1]["role"] == "assistant":
        raise ConfigError("the last prompt message is the assistant's: the model answers the last "
                          "message")
    if system_prompt is not None and prompt[0]["role"] != "system":
        prompt = [dict(role="system", content=system_prompt), *prompt]
    return prompt


def tools_of(env):
    """The tool descriptions an environment puts in the prompt (QwenTools' .tools), or None."""
    tools = getattr(env, "tools", None)
    return [d for _, d in tools.values()] if isinstance(tools, dict) else None


def encode_prompt(prompt, cfg, enc):
    """A row's prompt (a string or a list of messages) as token ids. With no template (cfg.template
    None), a string as it is, after the checkpoint's BOS if it has one; else rendered by the run's
    template with add_generation_prompt, the system_prompt, the environment's tools and
    chat_template_kwargs, the template's special tokens their ids, the messages' text ordinary
    (encode_chat)."""
    if cfg.template is None:
        if not isinstance(prompt, str):
            raise ConfigError(f"a prompt is a list of messages but the run has no chat template; "
                              f"{HOW}")
        bos = getattr(enc, "bos_token", None)  # SentencePiece's: the checkpoint starts each text so
        return ([] if bos is None else [bos]) + enc.encode_ordinary(prompt)
    return encode_chat(cfg.template, prompt_messages(prompt, cfg.system_prompt), enc,
                       tools=tools_of(getattr(cfg, "environment", None)),
                       add_generation_prompt=True, **cfg.chat_template_kwargs)


def encode_chat(template, messages, enc, **kwargs):
    """The token ids of `messages` as apply_chat_template(template, messages, **kwargs) renders
    them, where only the template's own text makes special tokens: a message's text that spells one
    (a completion writing '<|im_end|>\n<|im_start|>user\n...' to forge a turn) is ordinary text, as
    a tool's result is (encode_pieces). An honest conversation's ids are enc.encode(its text,
    allowed_special="all"), as transformers tokenizes it."""
    texts = [m["content"] for m in messages if isinstance(m.get("content"), str)]
    spelt = {t for text in texts for t in _split(text, _spelt(enc))[1::2]}
    if not spelt:
        return enc.encode(apply_chat_template(template, messages, **kwargs), allowed_special="all")
    # while the template renders, each token a message spells is a character no text holds, which
    # leaves what the template does with the messages as it was (trim, tojson, a split on </think>)
    held = set().union(*texts, apply_chat_template(template, messages, **kwargs))
    free = (chr(c) for c in range(0xF0000, 0x10FFFE) if chr(c) not in held)
    stand = dict(zip(sorted(spelt), free))
    swap = _alternation(_spelt(enc))
    messages = [dict(m, content=swap.sub(lambda t: stand[t.group()], m["content"]))
                if isinstance(m.get("content"), str) else m for m in messages]
    token = {c: t for t, c in stand.items()}
    parts = _split(apply_chat_template(template, messages, **kwargs), frozenset(token))
    pieces = [(token[p], False) if i % 2 else (p, True) for i, p in enumerate(parts)]
    return encode_pieces(pieces, enc)


def end_of_turn(template, enc):
    """The id of the special token the template closes an answered turn with (<|im_end|>,
    <|eot_id|>, Gemma's <end_of_turn>, ...), or None: what follows the assistant's text where it
    renders an answered conversation."""
    mark = "nanoGRPO's answer"
    try:
        text = apply_chat_template(template, [dict(role="user", content="2+2?"),
                                              dict(role="assistant", content=mark)])
    except ConfigError:
        return None
    after = text[text.rfind(mark) + len(mark):] if mark in text else ""
    token = next((t for t in sorted(enc.special_tokens_set, key=len, reverse=True)
                  if after.startswith(t)), None)
    return token and enc.encode_single_token(token)


def stop_ids(enc, template=None, path=None, stop=()):
    """The ids that end a completion; the first is the one a finished answer is written with (warm
    start, padding): the chat template's end of turn, then the eos ids of the checkpoint the
    tokenizer came from (path: its directory, tokenizer.json or .gguf file; instruct models list
    several), then the tokenizer's end of text, then those of `stop`, strings of one token each
    (train.py's stop_tokens). Checks first that enc has the template's special tokens."""
    check_template(template, enc, path)
    turn_end = end_of_turn(template, enc) if template is not None else None
    ids = [turn_end] if turn_end is not None else []
    path = path if path and os.path.exists(path) else None  # a built-in tokenizer's name: none
    folder = path if path is None or os.path.isdir(path) or path.endswith(".gguf") else \
        os.path.dirname(path)
    ids += (folder and eos_ids(folder)) or []
    ids += [enc.eot_token] if enc.eot_token is not None else []
    for text in stop:
        one = enc.encode(text, allowed_special="all")
        if len(one) != 1:
            raise ConfigError(f"stop_tokens: {text!r} is {len(one)} tokens of this tokenizer, "
                              f"not one; give strings that are one token each (a newline, "
                              f"'</answer>', ...)")
        ids += one
    return list(dict.fromkeys(ids))  # no repeats, first one first


def tool_turn(template, messages, results, end="", tools=None, **kwargs):
    """What a multi-turn rollout appends after the policy's turn, never re-rendering what it
    sampled: what the template writes after that turn in the conversation rendered with `results`
    (messages, e.g. {'role': 'tool', 'content': ...}) after it and add_generation_prompt, less the
    policy's sampled end of turn `end`. `messages`: the conversation before the turn (its prompt,
    earlier turns and results); tools and kwargs as the prompt was rendered with. The policy's turn
    is a stand-in here: what follows it does not depend on its text. Returns [(text, is the
    template's)]: the results' text as the template writes it is ordinary text, whatever it holds
    (never special tokens); where the template writes a result in a way that depends on its text,
    the result goes as it is where the template wrote a stand-in's."""
    def render(results):
        turn = dict(role="assistant", content=TURN)
        return apply_chat_template(template, [*messages, turn, *results], tools=tools,
                                   add_generation_prompt=True, **kwargs)
    held = render([dict(m, content=f"{PLACEHOLDER}{i}|") for i, m in enumerate(results)])
    written = render(results)
    if TURN not in held:
        raise ConfigError(f"{template.where}'s chat template drops the policy's turn once "
                          f"{results[0]['role']!r} messages follow it; a multi-turn rollout "
                          f"appends to what it sampled and cannot use it")
    at = held.rindex(TURN) + len(TURN)
    # [the template's text, a result's index, the template's, ...]
    parts = re.split(f"{re.escape(PLACEHOLDER)}(\\d+)\\|", held[at:])
    if sorted(map(int, parts[1::2])) != list(range(len(results))):
        raise ConfigError(f"{template.where}'s chat template does not write {results[0]['role']!r} "
                          f"messages after the policy's turn as they come; the environment's "
                          f"results would not reach the model")
    between = "(.*?)".join(map(re.escape, parts[::2]))
    found = held[:at] == written[:at] and re.fullmatch(between, written[at:], re.DOTALL)
    texts = found.groups() if found else [results[int(i)]["content"] for i in parts[1::2]]
    pieces = [(parts[0][len(end):] if end and parts[0].startswith(end) else parts[0], True)]
    for text, after in zip(texts, parts[2::2]):
        pieces += [(text, False), (after, True)]
    return pieces


def encode_pieces(pieces, enc):
    """The token ids of [(text, is the template's)]: the special tokens in the template's text
    become theirs, all other text (a tool's, whatever it holds) is ordinary, tokenized across the
    pieces' seams as one text is."""
    ids, run = [], ""
    for text, own in pieces:
        if not own:
            run += text
            continue
        for i, part in enumerate(_split(text, _spelt(enc))):
            if i % 2:  # a special token: the ordinary text before it ends
                ids += (enc.encode_ordinary(run) if run else []) + [enc.encode_single_token(part)]
                run = ""
            else:
                run += part
    return ids + (enc.encode_ordinary(run) if run else [])


@functools.lru_cache(maxsize=8)
def _spelt(enc):
    """enc's special tokens that its encode_ordinary reads as text (HF's added tokens that are not
    special, such as Qwen3's </think>, are matched in any text): those only a template writes."""
    return frozenset(t for t in enc.special_tokens_set
                     if enc.encode(t, allowed_special="all") != enc.encode_ordinary(t))


def rewrites_history(template, **kwargs):
    """Whether the template renders a conversation differently from its prompt and the policy's turn
    once a user or tool turn follows (Qwen3 drops past reasoning; DeepSeek-R1's prompt opens a
    <think> its turns lose): then a multi-turn trajectory, which only appends, is not what
    re-rendering its conversation would give."""
    user = dict(role="user", content="2+2?")
    turn = dict(role="assistant", content="<think>\n2+2\n</think>\n\n4")
    for after in (user, dict(role="tool", content="4")):
        try:
            head = apply_chat_template(template, [user], add_generation_prompt=True, **kwargs)
            if not apply_chat_template(template, [user, turn, after], add_generation_prompt=True,
                                       **kwargs).startswith(head + turn["content"]):
                return True
        except ConfigError:  # a template that takes no such turn
            continue
    return False


def run_template(chat_template, chat_date, *, init_from, tokenizer, saved=None):
    """The run's chat template and the two settings it settles, saved with the run: (template,
    chat_template: where it came from, chat_date: the day strftime_now writes, today's unless
    given). 'auto' is init_from's own template, none for a model from scratch; the special tokens
    are init_from's or the tokenizer's checkpoint's. A resumed run (saved: its first config)
    renders as its first one did: with 'auto', the template saved, and always its date."""
    if saved:
        chat_date = chat_date or saved.get("chat_date", "")
        chat_template = saved["chat_template"] if chat_template == "auto" else chat_template
    pretrained = init_from not in ("scratch", "resume")
    source = "none" if chat_template == "auto" and not pretrained else chat_template
    checkpoint = init_from if pretrained else tokenizer
    chat_date = chat_date or datetime.date.today().isoformat()
    try:
        datetime.date.fromisoformat(chat_date)
    except ValueError:
        raise ConfigError(f"chat_date={chat_date!r} is not a day written YYYY-MM-DD "
                          f"(e.g. 2025-03-09), nor '' for the day the run starts") from None
    template = load_template(source, checkpoint, chat_date)
    where = "none" if template is None else checkpoint if source == "auto" else source
    return template, where, chat_date


def text_of(ids, cfg, enc):
    """The text of a trajectory's tokens, as the environment and the reward functions read it: its
    final eos left out (a stop token kept, and the eos ids inside it, such as the end of a chat
    turn), and ids past the tokenizer's vocabulary, which a padded output layer can sample."""
    ids = ids[:-1] if ids and ids[-1] in cfg.eos_ids else ids
    return enc.decode([x for x in ids if x < enc.n_vocab])

