"""
A catalogue of bad input, through `python train.py` as a user types it: each case must exit non-zero with one line
`error: ...` that says what is wrong (asserted), no traceback, and leave an existing run untouched, even told to
replace it (overwrite=True deletes it only once every check has passed). The cases run in forks of one process that
has imported torch (tests/fork_run.py); one is also run as a plain `python train.py` to show that the fork changes
nothing a user would see. Then what is found before any work: a reward function that raises, a tokenizer that is
not the model's.
"""
import hashlib
import json
import os
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIXTURE = os.path.join(ROOT, 'tests', 'fixtures', 'tiny-gpt2-a')
TINY = ['--n_layer=1', '--n_head=2', '--n_embd=32', '--sft_iters=2', '--sft_batch_size=8', '--prompts_per_step=4',
        '--num_generations=4', '--micro_batch_size=4', '--eval_size=8', '--eval_interval=0',
        "--task_options={'digits': 1}", '--max_completion_length=4', '--block_size=16', '--peak_flops=1e12']

REWARDS = '''
import math
def raises(prompts, completions, **kw):
    return [1.0 / (len(c) - len(c)) if c == completions[-1] else 0.0 for c in completions]
def short(prompts, completions, **kw):
    return [0.0] * (len(completions) - 1)
def nan(prompts, completions, **kw):
    return [math.nan for c in completions]
def text(prompts, completions, **kw):
    return ['good' for c in completions]
'''


def write_files(d):
    """Everything the cases point at: data files, broken checkpoints, a reward module."""
    (d / 'rewards_mod.py').write_text(REWARDS)
    (d / 'bad_json_train.jsonl').write_text('{"prompt": "1+1=", "answer": "2"}\n{"prompt": "2+2=", "answer": 4\n')
    (d / 'no_answer_train.jsonl').write_text('{"prompt": "1+1=", "answer": "2"}\n{"prompt": "2+2="}\n')
    (d / 'empty_train.jsonl').write_text('')
    (d / 'few_train.jsonl').write_text(''.join(json.dumps({'prompt': f'{i}+1=', 'answer': str(i + 1)}) + '\n'
                                               for i in range(3)))
    (d / 'few_test.jsonl').write_text((d / 'few_train.jsonl').read_text())
    (d / 'long_train.jsonl').write_text(json.dumps({'prompt': '9' * 40 + '+1=', 'answer': '1'}) + '\n' +
                                        (d / 'few_train.jsonl').read_text())
    (d / 'long_test.jsonl').write_text((d / 'long_train.jsonl').read_text())
    (d / 'config_typo.py').write_text("lerning_rate = 1e-3\n")
    (d / 'bad.jinja').write_text("{% for m in messages %}{{ m.content }}")
    (d / 'raises.jinja').write_text("{{ raise_exception('Conversation roles must alternate') }}")
    (d / 'internals.jinja').write_text("{{ messages.__class__.__mro__ }}")
    for split in ('train', 'test'):
        rows = [{'prompt': [{'role': 'user', 'content': f'{i}+1='}], 'answer': str(i + 1)}
                for i in range(8)]
        (d / f'messages_{split}.jsonl').write_text(''.join(json.dumps(r) + '\n' for r in rows))
    (d / 'config_syntax.py').write_text("beta = 0.1\nloss_type = 'grpo\n")
    for name, edit in [('bert', lambda c: c.update(model_type='bert')), ('nokey', lambda c: c.pop('n_layer'))]:
        (d / name).mkdir()
        cfg = json.load(open(os.path.join(FIXTURE, 'config.json')))
        edit(cfg)
        (d / name / 'config.json').write_text(json.dumps(cfg))
        (d / name / 'model.safetensors').write_bytes(open(os.path.join(FIXTURE, 'model.safetensors'), 'rb').read())
    (d / 'metaspace').mkdir()  # a SentencePiece tokenizer.json whose layout is not reproduced
    tok = json.load(open(os.path.join(ROOT, 'tests', 'fixtures', 'tiny-gemma3', 'tokenizer.json')))
    tok.update(normalizer=None, pre_tokenizer=dict(type='Metaspace', replacement='\u2581'))
    (d / 'metaspace' / 'tokenizer.json').write_text(json.dumps(tok))
    weights = open(os.path.join(FIXTURE, 'model.safetensors'), 'rb').read()
    # a model with a tokenizer of its own beside it (544 ids in its 640 rows)
    shutil.copytree(os.path.join(ROOT, 'tests', 'fixtures', 'tiny-qwen2-a'), d / 'own_tokenizer')
    shutil.copy(os.path.join(ROOT, 'tests', 'fixtures', 'tiny-bpe-a', 'tokenizer.json'), d / 'own_tokenizer')
    for name, data in [('truncated', weights[:len(weights) // 2]), ('garbage', b'\x07' * 4096), ('noweights', None)]:
        (d / name).mkdir()
        (d / name / 'config.json').write_text(open(os.path.join(FIXTURE, 'config.json')).read())
        if data is not None:
            (d / name / 'model.safetensors').write_bytes(data)


# (name, arguments, what the error line must contain); {d} is the folder of write_files. Every case runs into an
# out_dir holding a finished run, with overwrite=True (but the first): no case may change it
CASES = [
    ('out_dir holds a run', ['--overwrite=False'], "holds another run (latest, ckpt-000001, config.json, "
     "metrics.jsonl); resume it with init_from='resume', name another out_dir, or say overwrite=True"),
    ('unknown key', ['--lerning_rate=1e-3'], "unknown config key 'lerning_rate'. Did you mean learning_rate"),
    ('wrong type', ['--max_iters=ten'], "config key 'max_iters' expects int, got str 'ten'"),
    ('bool as int', ['--compile=1'], "config key 'compile' expects bool, got int 1"),
    ('no value', ['--beta'], "override '--beta' has no value"),
    ('missing config file', ['config/nope.py'], "config file 'config/nope.py' not found"),
    ('config file typo', ['{d}/config_typo.py'], "config_typo.py: unknown config key 'lerning_rate'"),
    ('config file syntax', ['{d}/config_syntax.py'], "config_syntax.py' line 2"),
    ('unknown loss_type', ['--loss_type=ppo'], "unknown loss_type 'ppo'; choose one of"),
    ('vespo at sequence level', ['--surrogate=vespo', '--importance_sampling_level=sequence'],
     "surrogate='vespo' weighs each sequence by its whole ratio already; set importance_sampling_level='token'"),
    ('entropy quantile 0', ['--top_entropy_quantile=0'], "top_entropy_quantile=0.0 must be in (0, 1]"),
    ('batch does not split', ['--micro_batch_size=3'], "which must split into steps_per_generation=1"),
    ('G=1 with std scaling', ['--num_generations=1', '--scale_rewards=group'], "num_generations=1 must be >= 2"),
    ('G=1 without scaling', ['--num_generations=1', '--micro_batch_size=4', '--scale_rewards=none'],
     "num_generations=1 must be >= 2; GRPO learns from differences"),
    ('eval_size=0', ['--eval_size=0'], "eval_size=0 must be >= 1; eval_interval=0 turns evaluation off"),
    ('negative save_interval', ['--save_interval=-1'], "save_interval=-1 must be >= 0"),
    ('beta2 out of range', ['--beta2=1.5'], "beta2=1.5 must be in [0, 1)"),
    ('device not here', ['--device=cuda:99'], "device='cuda:99' is not on this machine"),
    ('device without MPS', ['--device=mps'], "device='mps' is not on this machine"),
    ('KL with no reference', ['--beta=0.1', '--sft_iters=0'], "beta > 0 needs a reference policy"),
    ('prompt + completion > block_size', ['--block_size=6'], "> block_size=6"),
    ('resume with no checkpoint', ['--init_from=resume', '--out_dir={d}/empty_out'], "holds no checkpoint"),
    ('init_from not a directory', ['--init_from={d}/nowhere'], "is neither 'scratch', 'resume', a Hugging Face"),
    ('missing data file', ['--task={d}/missing.jsonl', '--task_options={}'], "missing.jsonl not found"),
    ('malformed JSON line', ['--task={d}/bad_json_{split}.jsonl', '--task_options={}'], "bad_json_train.jsonl:2: invalid JSON"),
    ('row without answer', ['--task={d}/no_answer_{split}.jsonl', '--task_options={}'], 'no_answer_train.jsonl:2: no "answer"'),
    ('empty dataset', ['--task={d}/empty_{split}.jsonl', '--task_options={}'], "empty_train.jsonl is empty"),
    ('fewer prompts than a step', ['--task={d}/few_{split}.jsonl', '--task_options={}'], "has 3 prompts but prompts_per_step=4"),
    ('prompt longer than block_size', ['--task={d}/long_{split}.jsonl', '--task_options={}'], "longest prompt is 43 tokens"),
    ('unknown task', ['--task=division'], "unknown dataset 'division'"),
    ('not a chat template', ['--chat_template=chatml'],
     "chat_template='chatml' is not 'auto', 'none', a checkpoint"),
    ('chat template not Jinja', ['--chat_template={d}/bad.jinja'],
     "the chat template is not valid Jinja: "),
    ('chat template raises', ['--chat_template={d}/raises.jinja'],
     "raises.jinja's chat template refuses the conversation: Conversation roles must alternate"),
    ('chat template reaches internals', ['--chat_template={d}/internals.jinja'],
     "internals.jinja's chat template tried to reach Python internals, which the sandbox refuses"),
    ('chat template tokens the tokenizer lacks',
     [f'--chat_template={ROOT}/tests/fixtures/chat_templates/qwen2_5.jinja'],
     "writes the special tokens ['<|im_end|>', '<|im_start|>'], which tokenizer 'bytes' lacks"),
    ('chat messages without a template', ['--task={d}/messages_{split}.jsonl', '--task_options={}'],
     "a prompt is a list of messages but the run has no chat template; give chat_template="),
    ('chat date not a date', ['--chat_date=tomorrow'],
     "chat_date='tomorrow' is not a day written YYYY-MM-DD"),
    ('unknown task option', ["--task_options={'digit': 2}"], "task 'addition' has no option 'digit'"),
    ('unsupported model_type', ['--init_from={d}/bert'], "model_type 'bert' is not supported"),
    ('config.json missing a key', ['--init_from={d}/nokey'], "missing key 'n_layer'"),
    ('truncated safetensors', ['--init_from={d}/truncated'], "truncated/model.safetensors"),
    ('corrupted safetensors', ['--init_from={d}/garbage'], "garbage/model.safetensors"),
    ('missing model.safetensors', ['--init_from={d}/noweights'], "noweights/model.safetensors not found"),
    ('unknown reward', ["--reward_funcs=('exact',)"], "unknown reward function 'exact'"),
    ('reward weights mismatch', ["--reward_funcs=('exact_match', 'format')", "--reward_weights=(1.0,)"],
     "2 reward functions but 1 weights"),
    ('reward not importable', ["--reward_funcs=('rewards_mod:nope',)"], "'rewards_mod:nope' cannot be imported"),
    ('reward raises', ["--reward_funcs=('rewards_mod:raises',)"],
     "reward function raises raised ZeroDivisionError: float division by zero ({d}/rewards_mod.py:4) on completion"),
    ('reward wrong length', ["--reward_funcs=('rewards_mod:short',)"], "reward function short returned 3 values"),
    ('reward NaN', ["--reward_funcs=('rewards_mod:nan',)"], "reward function nan returned nan"),
    ('reward wrong type', ["--reward_funcs=('rewards_mod:text',)"], "reward function text returned 'good'"),
    ('tokenizer too big for model', ['--tokenizer=bytes', '--init_from={d}/small_vocab'], "vocab_size 100 <"),
    ('tokenizer not the model\'s own', ['--tokenizer=bytes', '--chat_template=none', '--init_from={d}/own_tokenizer',
                                       '--sft_iters=0'],
     "init_from='{d}/own_tokenizer' comes with its own tokenizer (544 ids), but tokenizer='bytes' is another (257 ids)"),
    ('SentencePiece layout not reproduced', ['--tokenizer={d}/metaspace'],
     "metaspace/tokenizer.json: normalizer [] is not Replace(' ', '▁')"),
    ('a causal LM as reward model', ["--reward_funcs=('exact_match', 'rm:" + FIXTURE + "')"],
     "not a sequence classifier (LlamaForSequenceClassification, ...); a causal LM can judge instead"),
    ('a judge prompt without the answer', ["--reward_funcs=('exact_match', 'judge:" + FIXTURE + "')",
                                           "--judge_prompt='Is this good?'"], "judge_prompt must hold {prompt} and"),
    ('unknown parallel', ['--parallel=zero3'], "unknown parallel 'zero3'; choose one of ddp, fsdp"),
    ('FSDP without torchrun', ['--parallel=fsdp'], "parallel='fsdp' shards over torchrun's processes"),
    ('LoRA target that matches nothing', ['--init_from=' + FIXTURE, '--sft_iters=0', '--lora_rank=4',
                                          "--lora_targets=('q_proj',)"],
     "LoRA target 'q_proj' matches no linear layer of this gpt2 model; use some of c_attn, c_proj, c_fc"),
    ('LoRA after a warm start', ['--lora_rank=4', '--sft_iters=10'], "LoRA adapts a pretrained model"),
    ('LoRA with reference syncs', ['--init_from=' + FIXTURE, '--sft_iters=0', '--lora_rank=4', '--beta=0.1',
                                   '--ref_sync_every=2'], "set ref_sync_every=0"),
    ('LoRA alpha of zero', ['--lora_rank=4', '--lora_alpha=0'], "lora_alpha=0.0 must be > 0"),
]


def digest(path):
    h = hashlib.sha256()
    for root, _, files in sorted(os.walk(path)):
        for f in sorted(files):
            h.update(f.encode() + open(os.path.join(root, f), 'rb').read())
    return h.hexdigest()


@pytest.fixture(scope='module')
def setup(tmp_path_factory):
    d = tmp_path_factory.mktemp('bad')
    write_files(d)
    ckpt = d / 'ckpt'
    env = dict(os.environ, OMP_NUM_THREADS='1')
    subprocess.run([sys.executable, 'train.py', *TINY, '--max_iters=1', f'--out_dir={ckpt}'], cwd=ROOT, env=env,
                   check=True, capture_output=True)
    from model import GPT, GPTConfig  # a model whose vocab the byte tokenizer does not fit
    GPT(GPTConfig(block_size=32, vocab_size=100, n_layer=1, n_head=1, n_embd=8)).save_pretrained(d / 'small_vocab')
    return d, ckpt


def test_bad_input_catalogue(setup, tmp_path):
    d, ckpt = setup
    before = digest(ckpt)
    runs = [dict(args=[*TINY, '--max_iters=1', f'--out_dir={ckpt}', '--overwrite=True',
                       *(a.replace('{d}', str(d)) for a in args)], path=str(d)) for _, args, _ in CASES]
    (tmp_path / 'runs.json').write_text(json.dumps(runs))
    subprocess.run([sys.executable, os.path.join(ROOT, 'tests', 'fork_run.py'), tmp_path / 'runs.json',
                    tmp_path / 'results.json'], env=dict(os.environ, OMP_NUM_THREADS='1'), check=True, timeout=600)
    results = json.loads((tmp_path / 'results.json').read_text())
    plain = subprocess.run([sys.executable, 'train.py', *runs[0]['args']], cwd=ROOT, capture_output=True, text=True,
                           env=dict(os.environ, OMP_NUM_THREADS='1', PYTHONPATH=str(d)))
    assert (plain.returncode, plain.stderr) == (results[0]['rc'], results[0]['stderr'])
    failures = []
    for (name, _, expected), p in zip(CASES, results):
        lines = p['stderr'].strip().splitlines()
        ok = (p['rc'] != 0 and 'Traceback' not in p['stderr'] and len(lines) >= 1
              and lines[-1].startswith('error: ') and expected.replace('{d}', str(d)) in lines[-1])
        if not ok:
            failures.append(f"{name}: rc={p['rc']}\n{p['stderr'][-1500:]}")
    assert not failures, '\n\n'.join(failures)
    assert digest(ckpt) == before  # no case touched the existing checkpoint
    assert len(CASES) >= 25


def test_a_bug_keeps_its_traceback(tmp_path):
    """Only ConfigError, the project's word for bad input, is one line: a forker's bug that raises a plain ValueError
    (or anything else) deep in their code shows its whole traceback, down to the line that raised it."""
    (tmp_path / 'forked.py').write_text("def unpack():\n    a, b = (1, 2, 3)\n\nunpack()\n")
    p = subprocess.run([sys.executable, 'train.py', str(tmp_path / 'forked.py'), *TINY], cwd=ROOT, capture_output=True,
                       text=True, env=dict(os.environ, OMP_NUM_THREADS='1'))
    assert p.returncode != 0 and 'Traceback' in p.stderr and 'forked.py", line 2, in unpack' in p.stderr
    assert p.stderr.strip().splitlines()[-1] == 'ValueError: too many values to unpack (expected 2)'
    assert 'error: ' not in p.stderr


def test_a_raising_reward_fails_before_any_work(setup, tmp_path):
    """Each reward function is called on train rows with stand-in completions at start: one that raises stops the
    run in one line naming it and the line of its own code that raised, before the warm start, with nothing
    written."""
    d, _ = setup
    out = tmp_path / 'out'
    p = subprocess.run([sys.executable, 'train.py', *TINY, '--sft_iters=50', '--eval_interval=1', f'--out_dir={out}',
                        "--reward_funcs=('exact_match', 'rewards_mod:raises')"], cwd=ROOT, capture_output=True,
                       text=True, env=dict(os.environ, OMP_NUM_THREADS='1', PYTHONPATH=str(d)))
    assert p.returncode != 0 and 'Traceback' not in p.stderr
    assert p.stderr.strip().splitlines()[-1].startswith(
        f"error: reward function raises raised ZeroDivisionError: float division by zero ({d}/rewards_mod.py:4)")
    assert 'warm start' not in p.stdout and 'eval 0' not in p.stdout and not out.exists()


def test_a_tokenizer_is_the_model_s_own_or_refused(setup, tmp_path):
    """check_tokenizer: where the model has a tokenizer of its own, another one is refused and the same one passes,
    whatever path names it; a model without one must end text with an id the tokenizer has."""
    from configurator import ConfigError, check_tokenizer
    from lib.tokenizer import get_tokenizer
    d, _ = setup
    own = str(d / 'own_tokenizer')
    shutil.copy(os.path.join(own, 'tokenizer.json'), tmp_path / 'copy.json')
    for same in (own, os.path.join(own, 'tokenizer.json'), str(tmp_path / 'copy.json')):
        check_tokenizer(get_tokenizer(same), same, own, None)
    for other in ('bytes', os.path.join(ROOT, 'tests', 'fixtures', 'tiny-gemma3', 'tokenizer.json')):
        with pytest.raises(ConfigError, match="comes with its own tokenizer"):
            check_tokenizer(get_tokenizer(other), other, own, None)
    with pytest.raises(ConfigError, match="the run in out_dir was trained with its own tokenizer"):
        check_tokenizer(get_tokenizer('bytes'), 'bytes', 'resume', dict(config=dict(tokenizer=own)))
    bare = shutil.copytree(os.path.join(ROOT, 'tests', 'fixtures', 'tiny-qwen2-a'), tmp_path / 'bare')
    check_tokenizer(get_tokenizer('bytes'), 'bytes', str(bare), None)  # no tokenizer of its own, no eos: fits
    (bare / 'generation_config.json').write_text(json.dumps(dict(eos_token_id=[5, 600])))
    with pytest.raises(ConfigError, match="ends text with token id 600, which tokenizer 'bytes' .257 ids. lacks"):
        check_tokenizer(get_tokenizer('bytes'), 'bytes', str(bare), None)


def test_plot_of_a_folder_without_a_run_is_one_line(tmp_path):
    pytest.importorskip('matplotlib')
    for folder in (tmp_path / 'nowhere', tmp_path):
        p = subprocess.run([sys.executable, 'scripts/plot.py', str(folder)], cwd=ROOT, capture_output=True,
                           text=True, timeout=120)
        assert p.returncode != 0 and p.stderr.splitlines() == [
            f"error: {folder} holds no metrics.jsonl; give the out_dir of a run (train.py's out_dir)"], p.stderr
