"""
Environments for multi-turn rollouts (train.py's env): after each turn the policy ends, the environment says what
the policy observes next, or that the episode is over. An environment is any object with

    step(row, text) -> str, message(s) or None
                                     row: the dataset row ('prompt', 'answer', ...); text: the
                                     trajectory so far, the policy's turns and the observations
                                     between them. Returns text to append as it is (ordinary text,
                                     never special tokens), or a message or list of them, e.g.
                                     {'role': 'tool', 'content': result}, which the run's chat
                                     template renders after the policy's turn, or None: the
                                     episode is over.
    stop                             optional: strings that end a turn besides the end of turn: where the
                                     policy's text comes to end with one (of one token or several).

Write one in your own file and name it as a reward function is named: --env=myenvs:maze (an object, or a class, which
is then instantiated). step must depend on its arguments alone: the calls of rows that end a turn together run in
threads (train.py's tool_workers), and a resumed run must see what the first one saw. One that runs the policy's code
calls tools.python(code, sandbox=...) after check_sandbox(sandbox) at its start. The observation's tokens are
context, never actions: engine.py reads them into the KV cache after the policy's, and the loss masks them. Rewards
still come from reward functions, which see each row's observations as a column.
"""
from lib import tools
from lib.sandbox import SANDBOXES, sandbox_problem
from lib.errors import ConfigError, import_named


class Calculator:
    """For a model without a chat template (the tiny one): it writes an expression between < and >, e.g.
    '<123*456>', reads the exact value after it on a line of its own, '56088\\n', then answers."""
    stop = ('>',)

    def step(self, row, text):
        if not text.endswith('>') or '<' not in text:
            return None  # an answer, not a call
        return tools.calculator(text[text.rindex('<') + 1:-1]) + '\n'


class QwenTools:
    """Qwen's tool calls: an assistant turn that ends with <tool_call>{"name": ..., "arguments": {...}}</tool_call>
    gets the tool's result as a tool message, which the run's chat template renders
    (chat.tool_turn); a malformed call gets one that says what is wrong with it. The tools'
    descriptions (chat.tools_of) go into every prompt through the template's `tools`, as any
    template that takes tools writes them. The python tool runs in the
    sandbox named (SANDBOXES), checked here: a policy that cannot be isolated stops the run before it starts."""
    def __init__(self, available=None, sandbox='bwrap'):
        self.tools = available or tools.tool_set(sandbox)
        if 'python' in self.tools:
            check_sandbox(sandbox)

    def step(self, row, text):
        if not text.rstrip().endswith('</tool_call>'):
            return None  # an answer, not a call
        return dict(role='tool', content=tools.call_tool(text, self.tools))


ENVS = {'calculator': Calculator, 'qwen_tools': QwenTools}


def check_sandbox(sandbox):
    """Before any rollout: a ConfigError unless tools.python can isolate the policy's programs as `sandbox` says
    ('none' runs them unisolated, with a warning)."""
    if sandbox not in SANDBOXES:
        raise ConfigError(f"unknown sandbox {sandbox!r}; choose one of {', '.join(SANDBOXES)}")
    if sandbox == 'none':
        print("warning: sandbox='none': the python tool runs the policy's programs unisolated, as this user, with "
              "its files, network and processes; use it only for programs you would run yourself")
    elif problem := sandbox_problem():
        raise ConfigError(f"the python tool cannot isolate the policy's programs here: {problem}; or set "
                          f"sandbox='none' to run them unisolated")


def get_env(name, sandbox='bwrap'):
    """The environment called `name`: a key of ENVS, or 'module:attribute' for one of your own, imported from the
    Python path; a class is instantiated (QwenTools and its subclasses with the sandbox its python tool runs in)."""
    if ':' in name:
        env = import_named(name, 'environment')
    elif name in ENVS:
        env = ENVS[name]
    else:
        raise ConfigError(f"unknown environment {name!r}; use one of {', '.join(ENVS)} or 'module:attribute'")
    if isinstance(env, type):
        env = env(sandbox=sandbox) if issubclass(env, QwenTools) else env()
    if not callable(getattr(env, 'step', None)):
        raise ConfigError(f"environment {name!r} has no step(row, text) method; give it one that returns the text "
                          f"the policy observes next, or None to end the episode")
    stop = getattr(env, 'stop', ())
    if isinstance(stop, str) or not all(isinstance(s, str) and s for s in stop):
        raise ConfigError(f"environment {name!r} has stop={stop!r}; make it a tuple of non-empty strings, e.g. "
                          f"('</calc>',)")
    return env


