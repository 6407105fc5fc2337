"""
lib/chat.py's apply_chat_template exact against transformers: the real chat templates of 17 families (TRL 1.16.0's
byte-exact copies and SmolLM2's from its GGUF, in tests/fixtures/chat_templates) on 18 conversations each (with and
without a system message, several turns, whitespace at the ends, non-ASCII text, tools and tool results, answered
turns, reasoning, enable_thinking, documents), against what transformers' apply_chat_template rendered once
(make_reference.py there, in a side virtualenv: never a test dependency), its errors included.
"""
import json
import os

import pytest

from lib.chat import apply_chat_template, load_template
from lib.errors import ConfigError

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
        call = lambda: apply_chat_template(t, c["messages"], tools=c.get("tools"), documents=c.get("documents"),  # noqa
                                           add_generation_prompt=generation, **c.get("kwargs", {}))
        if isinstance(want, str):
            assert call() == want, case
        else:  # the template's raise_exception: its message, one line
            with pytest.raises(ConfigError, match="chat template refuses the conversation: ") as e:
                call()
            assert str(e.value).endswith(want["error"].split(": ", 1)[1]), case


def test_the_reference_covers_the_families_and_cases():
    assert len(REF["renders"]) == 17 and len(REF["cases"]) == 18
    texts = [v for r in REF["renders"].values() for v in r.values() if isinstance(v, str)]
    assert len(texts) >= 270 and any("09 Mar 2025" in t for t in texts)  # strftime_now, held at the run's date
