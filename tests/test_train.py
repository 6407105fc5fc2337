"""train.py end to end, as a user runs it: every recipe for two iterations, and a 2-process torchrun (gloo)."""
import ast
import glob
import json
import math
import os
import re
import shutil
import subprocess
import sys

import pytest
import torch

from lib import measure
from model import GPT, GPTConfig

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = sorted(os.listdir(os.path.join(ROOT, 'config')))
# recipes that start from downloaded weights run below on a tiny checkpoint of the same family; one that learns
# from a teacher the user trains first (config/distill_smollm2.py) is run by test_config with a stand-in teacher
REAL = [f for f in CONFIGS
        if any(key in open(os.path.join(ROOT, 'config', f)).read() for key in ('init_from', 'teacher ='))]
RECIPES = [f for f in CONFIGS if f not in REAL]
# a tiny model and batch: seconds per run. 4 prompts x 4 completions = 16 rows per rollout, micro-batches of 4
# split evenly into 1, 2 or 4 optimizer steps per rollout (the recipes' steps_per_generation), on 1 or 2 ranks
TINY = ['--n_layer=1', '--n_head=2', '--n_embd=32', '--sft_iters=3', '--sft_batch_size=8', '--prompts_per_step=4',
        '--num_generations=4', '--micro_batch_size=4', '--eval_size=8', '--eval_interval=1', '--save_interval=1',
        "--task_options={'digits': 1}", '--max_completion_length=4', '--block_size=16',
        '--peak_flops=1e12']  # MFU against a given peak: measuring it costs each run ~2 s (one test measures)


def run(args, out_dir, launcher=(sys.executable,), check=True):
    files, flags = [a for a in args if not a.startswith('--')], [a for a in args if a.startswith('--')]
    cmd = [*launcher, 'train.py', *files, *TINY, *flags, f'--out_dir={out_dir}']  # a test's flags win over TINY's
    env = dict(os.environ, OMP_NUM_THREADS='1')
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=env, timeout=300)
    if check and p.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} failed:\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}")
    return p


def metrics(out_dir):
    with open(os.path.join(out_dir, 'metrics.jsonl')) as f:
        return [json.loads(line) for line in f]


@pytest.mark.parametrize('recipe', RECIPES)
def test_recipe_runs_two_iterations(recipe, tmp_path):
    out = tmp_path / 'out'
    p = run([f'config/{recipe}', '--max_iters=2'], out)
    rows = [m for m in metrics(out) if 'reward' in m]
    assert [m['iter'] for m in rows] == [0, 1]
    for m in rows:
        for key in ('reward', 'acc', 'kl', 'clip_ratio/region', 'grad_norm', 'lr', 'rollout_tok_s', 'mfu'):
            assert m[key] == m[key], f"{key} is NaN in {m}"  # NaN != NaN
    assert 'eval 2: greedy acc' in p.stdout and 'iter 1/2: reward' in p.stdout
    GPT.from_pretrained(os.path.join(out, json.load(open(out / 'latest'))))  # the HF-layout checkpoint loads


def test_torchrun_two_processes_writes_a_loadable_checkpoint(tmp_path):
    out = tmp_path / 'out'
    torchrun = [sys.executable, '-m', 'torch.distributed.run', '--standalone', '--nproc_per_node=2']
    run(['config/dr_grpo.py', '--max_iters=2', '--peak_flops=0'], out, launcher=torchrun)  # each rank measures it
    model = GPT.from_pretrained(os.path.join(out, json.load(open(out / 'latest'))))
    assert model.config.n_layer == 1
    rows = [m for m in metrics(out) if 'reward' in m]
    assert len(rows) == 2  # only the master process logs
    assert all(0 < m['mfu'] < 1 for m in rows)  # against the peak measured at start


def test_dynamic_sampling_logs_every_rank_s_dropped_groups(tmp_path):
    """DAPO's dynamic sampling on 2 ranks with no resampling round: each rank drops its flat groups and, out of
    rounds, fills its batch back with them, so the log's dropped_groups is the flat share of the whole batch times
    its prompts (rank 0's count alone fails it whenever rank 1 has a flat group)."""
    out = tmp_path / 'out'
    torchrun = [sys.executable, '-m', 'torch.distributed.run', '--standalone', '--nproc_per_node=2']
    run(['config/dapo.py', '--max_iters=3', '--max_resample_rounds=0', '--eval_interval=0', '--save_interval=0'],
        out, launcher=torchrun)
    rows = [m for m in metrics(out) if 'reward' in m]
    assert [m['dropped_groups'] for m in rows] == [round(4 * m['flat_groups']) for m in rows]
    assert any(m['dropped_groups'] for m in rows)


def test_a_checkpoint_is_evaluated_without_training(tmp_path):
    """README's evaluation command: max_iters=0 from a checkpoint runs the held-out evaluation alone, and writes
    nothing but its metrics line (no checkpoint, no warm start)."""
    run(['--max_iters=1', '--eval_interval=0'], tmp_path / 'run')
    ckpt = tmp_path / 'run' / json.load(open(tmp_path / 'run' / 'latest'))
    p = run(['--max_iters=0', f'--init_from={ckpt}', '--sft_iters=0'], tmp_path / 'eval')
    assert 'eval 0: greedy acc ' in p.stdout and 'iter ' not in p.stdout
    assert os.listdir(tmp_path / 'eval') == ['metrics.jsonl'] and [m['iter'] for m in metrics(tmp_path / 'eval')] == [0]


def test_a_second_run_never_lands_on_the_first(tmp_path):
    """A new run into an out_dir that holds another is refused in one line and changes nothing there; overwrite=True
    replaces it (its checkpoints and metrics go, the warm start's cache stays and is reused)."""
    out = tmp_path / 'out'
    run(['--max_iters=2'], out)
    before = {f: open(f, 'rb').read() for f in glob.glob(f'{out}/**', recursive=True) if os.path.isfile(f)}
    p = run(['--max_iters=1'], out, check=False)
    assert p.returncode != 0 and p.stderr.splitlines() == [
        f"error: out_dir='{out}' holds another run (latest, ckpt-000002, config.json, metrics.jsonl); resume it "
        f"with init_from='resume', name another out_dir, or say overwrite=True to replace it"], p.stderr
    assert {f: open(f, 'rb').read() for f in glob.glob(f'{out}/**', recursive=True) if os.path.isfile(f)} == before
    p = run(['--max_iters=1', '--overwrite=True'], out)
    assert 'warm start: loaded' in p.stdout
    assert [m['iter'] for m in metrics(out)] == [0, 0, 1]  # eval 0, iteration 0, eval 1: this run's alone
    assert json.load(open(out / 'latest')) == 'ckpt-000001' and not (out / 'ckpt-000002').exists()


def test_dtype_auto_trains_in_the_faster_dtype(tmp_path, monkeypatch):
    """dtype='auto': bf16 autocast where this machine's bf16 matmuls run at least twice as fast as float32 (AMX, GPUs),
    else float32; the run records which one it chose and says so at the start, and the rule is the one
    measure.fastest_dtype states."""
    p = run(['--max_iters=1', '--dtype=auto', '--save_interval=1'], tmp_path / 'out')
    chosen = json.load(open(tmp_path / 'out' / json.load(open(tmp_path / 'out' / 'latest')) / 'trainer.json'))
    assert chosen['config']['dtype'] == measure.fastest_dtype('cpu') in ('bfloat16', 'float32')
    assert f"dtype='auto' ({chosen['config']['dtype']})" in p.stdout  # the start line says what it chose
    for bf16, fp32, expected in ((1.0, 0.6, 'float32'), (1.2, 0.6, 'bfloat16'), (0.01, 0.2, 'float32')):
        monkeypatch.setattr(measure, 'matmul_peak', lambda device, dtype: (bf16 if dtype == torch.bfloat16 else fp32,))
        assert measure.fastest_dtype('cpu') == expected


def test_padded_vocab(tmp_path):
    """An output layer wider than the tokenizer (nanoGPT pads to 50304) samples ids the tokenizer cannot decode:
    they stay in the completion's tokens but not in its text."""
    run(['--max_iters=1', '--vocab_size=320', '--sft_iters=0'], tmp_path / 'out')


def test_compile(tmp_path):
    """compile=True (the CUDA recipe's setting) on the CPU: the compiled training forward and decode step run, the
    first rollout, sampled by the compiled step from the same weights, is the eager one, and so is its gradient."""
    first = {}
    for flag in ('False', 'True'):
        run(['config/dr_grpo.py', '--max_iters=2', f'--compile={flag}'], tmp_path / flag)
        rows = [m for m in metrics(tmp_path / flag) if 'reward' in m]
        assert len(rows) == 2 and all(math.isfinite(m['grad_norm']) for m in rows)
        first[flag] = rows[0]
    for key in ('reward', 'len_mean', 'truncated'):
        assert first['True'][key] == first['False'][key], key
    assert first['True']['grad_norm'] == pytest.approx(first['False']['grad_norm'], rel=1e-4)


@pytest.mark.parametrize('family', ['tiny-qwen2-a', 'tiny-llama-a', 'tiny-qwen3-a'])
def test_trains_from_each_family(family, tmp_path):
    """init_from= a Hugging Face Llama/Qwen2/Qwen3 directory (the byte tokenizer fits their vocabularies): two
    iterations with activation checkpointing, and the checkpoint is the same family in the same HF layout."""
    out, src = tmp_path / 'out', os.path.join(ROOT, 'tests', 'fixtures', family)
    run(['config/dr_grpo.py', '--max_iters=2', f'--init_from={src}', '--gradient_checkpointing=True'], out)
    rows = [m for m in metrics(out) if 'reward' in m]
    assert [m['iter'] for m in rows] == [0, 1] and all(math.isfinite(m['grad_norm']) for m in rows)
    ckpt = os.path.join(out, json.load(open(out / 'latest')))
    trained, original = GPT.from_pretrained(ckpt), GPT.from_pretrained(src)
    assert trained.config == original.config
    assert json.load(open(os.path.join(ckpt, 'config.json')))['model_type'] == original.config.model_type
    assert any(not torch.equal(a, b.float()) for a, b in zip(trained.parameters(), original.parameters()))


def test_chat_run_with_the_checkpoints_tokenizer(tmp_path):
    """tiny-qwen2-a with the Qwen2.5-layout tokenizer tiny-bpe-a (544 ids fit its 640 rows) and a
    template named by its file (the checkpoint has none): the prompts are rendered as chat turns and
    completions stop on <|im_end|>."""
    out, fixtures = tmp_path / 'out', os.path.join(ROOT, 'tests', 'fixtures')
    p = run(['config/dr_grpo.py', '--max_iters=2', f"--init_from={fixtures}/tiny-qwen2-a", '--block_size=32',
             f"--tokenizer={fixtures}/tiny-bpe-a",
             f'--chat_template={fixtures}/chat_templates/qwen2_5.jinja',
             "--system_prompt='Add.'"], out)
    assert [m['iter'] for m in metrics(out) if 'reward' in m] == [0, 1] and 'eval 2' in p.stdout
    ckpt = os.path.join(out, json.load(open(out / 'latest')))  # a whole HF model directory: weights and tokenizer
    assert open(os.path.join(ckpt, 'tokenizer.json')).read() == open(f'{fixtures}/tiny-bpe-a/tokenizer.json').read()


@pytest.mark.parametrize('recipe', [f for f in REAL if f.startswith('qwen')])
def test_qwen_recipes_on_a_tiny_qwen(recipe, tmp_path):
    """The Qwen recipes as written (task, rewards, loss, checkpointing; the checkpoint's own
    template), with the model and the GSM8K files swapped for tiny ones, in float32 without
    compile: two iterations run. The tiny model is laid out as Qwen2.5-Instruct's directory is: its
    tokenizer, and its template in tokenizer_config.json."""
    fixtures = os.path.join(ROOT, 'tests', 'fixtures')
    model = shutil.copytree(f'{fixtures}/tiny-qwen2-a', tmp_path / 'qwen')
    shutil.copy(f'{fixtures}/tiny-bpe-a/tokenizer.json', model)
    template = open(f'{fixtures}/chat_templates/qwen2_5.jinja', encoding='utf-8').read()
    config = dict(chat_template=template, eos_token='<|im_end|>')
    (model / 'tokenizer_config.json').write_text(json.dumps(config))
    for split, n in (('train', 8), ('test', 4)):  # the GSM8K layout: a question and a worked answer ending '#### N'
        rows = [dict(question=f"Tom has {i} apples and buys {i + 2}. How many now?", answer=f"{i} + {i + 2} = "
                     f"{2 * i + 2}\n#### {2 * i + 2}") for i in range(n)]
        (tmp_path / f'{split}.jsonl').write_text(''.join(json.dumps(r) + '\n' for r in rows))
    out = tmp_path / 'out'
    p = run([f'config/{recipe}', '--max_iters=2', f'--init_from={model}', '--block_size=256',
             '--dtype=float32', '--compile=False', '--eval_interval=2']
            + ([f"--task={tmp_path}/{{split}}.jsonl", '--task_options={}'] if 'gsm8k' in recipe else
               ["--task_options={'count': (3,)}"]), out)
    rows = [m for m in metrics(out) if 'reward' in m]
    assert [m['iter'] for m in rows] == [0, 1] and 'eval 2: greedy acc' in p.stdout
    fns = ('numeric_match', 'boxed') if 'gsm8k' in recipe else ('countdown_reward', 'boxed')  # accuracy, then format
    assert all(f'reward/{f}' in m for f in fns for m in rows) and '| boxed ' in p.stdout
    ckpt = os.path.join(out, json.load(open(out / 'latest')))
    saved = json.load(open(os.path.join(ckpt, 'trainer.json')))['config']
    assert saved['chat_template'] == str(model)


def test_a_users_jsonl_file_needs_no_task_flags(tmp_path):
    """README's 'bring data' line: --task=FILE alone, with the default task_options (the built-in task's)."""
    for split in ('train', 'test'):
        rows = [{'prompt': f'{a}+{a}=', 'answer': str(2 * a)} for a in range(10 if split == 'test' else 0, 30)]
        (tmp_path / f'{split}.jsonl').write_text(''.join(json.dumps(r) + '\n' for r in rows))
    out = tmp_path / 'out'
    tiny = [a for a in TINY if 'task_options' not in a]
    cmd = [sys.executable, 'train.py', *tiny, f'--task={tmp_path}/{{split}}.jsonl', '--max_iters=1', f'--out_dir={out}']
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS='1'))
    assert p.returncode == 0, p.stderr[-2000:]
    assert 'iter 0/1: reward' in p.stdout


def test_long_phases_report_progress(tmp_path):
    """With progress_interval=0 every step of the warm start and every chunk of an evaluation prints a progress line
    (the default 10 s keeps short phases quiet)."""
    p = run(['config/dr_grpo.py', '--max_iters=1', '--progress_interval=0'], tmp_path / 'out')
    assert 'warm start: 1/3 steps, loss ' in p.stdout  # TINY: 3 warm-start steps, 8 eval prompts, 4 per chunk
    assert 'eval 0, greedy: 4/8 prompts (' in p.stdout and 'eval 0, sampled: 4/8 prompts (' in p.stdout
    assert ', eta ' in p.stdout


def test_warm_start_stops_at_its_target_accuracy(tmp_path):
    """sft_target_acc: the warm start checks greedy accuracy on train prompts every 50 steps and ends once it is
    reached (here a low target, reached by step 100 of 120), and runs all its steps when it is not (1.0)."""
    for target, steps in ((0.05, 100), (1.0, 120)):
        p = run(['config/dr_grpo.py', '--max_iters=0', '--eval_interval=0', '--sft_iters=120',
                 f'--sft_target_acc={target}'], tmp_path / f'out{target}')
        assert f'warm start: trained {steps} iters' in p.stdout


def test_readme_s_brevity_example_logs_the_verifier_s_accuracy(tmp_path, monkeypatch):
    """README's --reward_funcs="('myrewards:brevity', 'exact_match')", brevity = 1 / (1 + length) first:
    the start names exact_match as the accuracy, acc is exact_match's share of right answers, and each
    iteration's line shows both functions' means, the user's first."""
    (tmp_path / 'myrewards.py').write_text('def brevity(prompts, completions, **kwargs):\n'
                                           '    return [1 / (1 + len(c)) for c in completions]\n')
    monkeypatch.setenv('PYTHONPATH', str(tmp_path))
    p = run(['--max_iters=2', '--eval_interval=0', '--sft_target_acc=0',
             '--reward_funcs=("myrewards:brevity", "exact_match")'], tmp_path / 'out')
    assert "accuracy: exact_match (the task's verifier)\n" in p.stdout
    rows = [m for m in metrics(tmp_path / 'out') if 'acc' in m]
    assert len(rows) == 2 and all(m['acc'] == m['reward/exact_match'] for m in rows)
    assert re.search(r"^iter 1/2: .* \| acc [\d.]+ \| brevity [\d.]+ \| exact_match [\d.]+ \| flat", p.stdout, re.M)


def test_warm_start_is_cached_while_its_settings_match(tmp_path):
    """out_dir/warmstart is reused by the next run with the same settings (a tuple option included, which its JSON
    file reads back as a list) and trained again when one of them changes."""
    args = ['--max_iters=0', '--eval_interval=0', '--task=countdown', "--task_options={'count': (3,)}",
            '--block_size=256']
    said = lambda *more: run(args + list(more), tmp_path / 'out').stdout.split('warm start: ')[1].split(' (')[0]
    assert said() == 'trained 3 iters' and said() == 'loaded'
    assert said('--sft_learning_rate=0.01') == 'trained 3 iters'


def imported(path):
    """The modules a file imports ('from lib import hf' counts as lib.hf)."""
    tree = ast.parse(open(path).read())
    return [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names] + \
        [f"{n.module}.{a.name}" if n.module == 'lib' else n.module for n in ast.walk(tree)
         if isinstance(n, ast.ImportFrom) for a in n.names]


def test_imports_run_one_way():
    """The core (the top level) imports lib/, never scripts/; lib/ imports neither the core nor scripts/."""
    core = {f[:-3] for f in os.listdir(ROOT) if f.endswith('.py')}
    for f in os.listdir(ROOT):
        if f.endswith('.py'):
            assert not any(m.startswith('scripts') for m in imported(os.path.join(ROOT, f))), f
    for f in os.listdir(os.path.join(ROOT, 'lib')):
        if f.endswith('.py'):
            bad = [m for m in imported(os.path.join(ROOT, 'lib', f)) if m.split('.')[0] in core | {'scripts'}]
            assert not bad, f"lib/{f} imports {bad}"


def test_one_plain_iteration_reads_in_40_functions():
    """Issue 56's measure of how plain the loop reads: scripts/count_calls.py's plain path (one single-turn
    iteration, plain=True) calls at most 40 named functions in at most 8 files of the project."""
    # a smaller model and batch: the same functions, less to trace
    flags = ['--plain=True', '--n_layer=1', '--n_embd=32', '--n_head=2', '--prompts_per_step=2', '--num_generations=2',
             '--micro_batch_size=4', '--peak_flops=1e12']
    code = f"from scripts.count_calls import count; print(sorted(count({flags!r}).items()))"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300,
                         check=True).stdout
    seen = dict(ast.literal_eval(out.splitlines()[-1]))
    assert sum(map(len, seen.values())) <= 40 and len(seen) <= 8, seen


def packing_case(case):
    """(idx, start, need, size) of test_micro_batches...: rows of their own prompts; groups of rows sharing one; and
    two groups laid out in one sequence, a prompt's second row after the other prompt's tokens."""
    g = torch.Generator().manual_seed(0)
    if case == 'one sequence, two groups':  # [A + row 1][row 0][B + row 2][row 3] and row 4 alone: capacity 13
        idx, start, need = torch.randint(0, 50, (5, 13), generator=g), torch.tensor([3, 3, 3, 3, 6]), [1, 2, 1, 1, 7]
        idx[1, :3], idx[3, :3] = idx[0, :3], idx[2, :3]
        return idx, start, torch.tensor(need), 5
    need = torch.tensor([2, 1, 6, 7, 0, 3, 1, 7, 2, 5])  # two rows run to the limit, one has no token that counts
    idx, start = torch.randint(0, 50, (10, 12), generator=g), torch.randint(1, 6, (10,), generator=g)
    if case == 'groups':  # rows 0-3 share a prompt, 4-6 and 7-8 others; row 9's prompt is a single token
        idx[:, :5] = idx[[0, 0, 0, 0, 4, 4, 4, 7, 7, 9], :5]
        start = torch.tensor([4, 4, 4, 4, 3, 3, 3, 3, 3, 1])
    return idx, start, need, 3


SMALL = dict(block_size=16, vocab_size=50, n_layer=2, n_head=2, n_embd=16)
GEMMA3 = dict(SMALL, model_type='gemma3_text', bias=False, qk_norm=True, sliding_window=3, rope_local_theta=1e4,
              layer_types=('sliding_attention', 'full_attention'), query_pre_attn_scalar=5.0)  # windows of 3


@pytest.mark.parametrize('family', ['gpt2', 'gemma3_text'])
@pytest.mark.parametrize('case', ['rows', 'groups', 'one sequence, two groups'])
def test_micro_batches_pack_rows_and_change_nothing_but_the_work(case, family):
    """rollout.micro_batches: ceil(B / size) micro-batches of at most `size` packed sequences, none longer than the
    longest row, every row once with its own tokens and positions, each sequence holding the tokens of a prompt
    once however many of its rows it holds; the log-probs, entropies and gradients of packed micro-batches equal
    those of each row alone (float64), and the log-prob pass equals one over the padded batch; for Gemma 3 too,
    whose sliding layers see only the last 3 positions of a row (its prompt's included)."""
    from rollout import logprobs, micro_batches
    from types import SimpleNamespace
    idx, start, need, size = packing_case(case)
    B, C = len(need), int(need.max())
    mask = torch.arange(C) < need[:, None]  # (B, C) prefixes
    batch = dict(idx=idx, start=start, mask=mask, advantages=torch.randn(B, generator=torch.Generator()))
    model = GPT(GPTConfig(**(SMALL if family == 'gpt2' else GEMMA3))).double()
    for name, p in model.named_parameters():  # Gemma's norms start at w = 0, the identity: make them matter
        if family != 'gpt2' and 'norm' in name:
            torch.nn.init.normal_(p, std=0.5, generator=torch.Generator().manual_seed(len(name)))
    w1, w2 = torch.randn(B, C, dtype=torch.float64), torch.randn(B, C, dtype=torch.float64)
    seen, packed, sequences, tokens = [], 0.0, 0, 0
    for rows, mb in micro_batches(batch, size):
        L = max(int(need[rows].max()), 1)
        S, T = mb['idx'].shape
        assert S <= size and T <= int((start + need).max()) and mb['mask'].shape == (len(rows), L)
        assert torch.equal(mb['mask'], mask[rows, :L]) and torch.equal(mb['advantages'], batch['advantages'][rows])
        for k, r in enumerate(rows.tolist()):  # the row's last prompt token and counted completion, their positions
            span = slice(int(mb['start'][k]) - 1, int(mb['start'][k]) + int(need[r]))
            assert torch.equal(mb['idx'].flatten()[span], batch['idx'][r, int(start[r]) - 1:int(start[r] + need[r])])
            assert mb['pos'].flatten()[span].tolist() == list(range(int(start[r]) - 1, int(start[r] + need[r])))
        # placed: each row's last prompt token and completion, and once per sequence the rest of each prompt in it
        held = {(int(mb['start'][k] - 1) // T, tuple(idx[r, :int(start[r])].tolist())) for k, r in enumerate(rows)}
        assert mb['tokens'] == int((need[rows] + 1).sum()) + sum(len(p) - 1 for _, p in held) <= S * T
        lp, ent = model.logprobs(mb['idx'], mb['start'], L, 0.7, True, need[rows], mb['pos'])
        packed = packed + (lp * w1[rows, :L] + ent * w2[rows, :L]).sum()
        seen.append(rows)
        sequences, tokens = sequences + S, tokens + mb['tokens']
    assert len(seen) == -(-B // size) and sorted(torch.cat(seen).tolist()) == list(range(B)) and sequences < B
    # every row's tokens are placed when each has its own prompt; with groups, fewer
    assert (tokens == int((start + need).sum())) == (case == 'rows')
    packed.backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    alone = 0.0
    for r in range(B):
        lp, ent = model.logprobs(batch['idx'][r:r + 1], start[r:r + 1], C, 0.7, True, need[r:r + 1])
        alone = alone + (lp * w1[r] + ent * w2[r]).sum()
    alone.backward()
    torch.testing.assert_close(packed, alone, rtol=1e-12, atol=1e-12)
    for a, p in zip(grads, model.parameters()):
        torch.testing.assert_close(a, p.grad, rtol=1e-10, atol=1e-12)
    cfg = SimpleNamespace(micro_batch_size=size, dtype='float64', ptdtype=torch.float64, autocast=False,
                          temperature=0.7, plain=False, logp_top_k=None, logp_top_p=None)
    with torch.no_grad():
        whole = model.logprobs(batch['idx'], start, C, 0.7)  # (B, C) in one pass, padded to the longest row
    torch.testing.assert_close(logprobs(model, batch, cfg)[mask], whole[mask], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize('dtype,mu', [('float32', 1), ('bfloat16', 1), ('bfloat16', 2)])
def test_sampler_gap_is_logged(tmp_path, dtype, mu):
    """sampler/logp_diff: mean |log-prob the trainer uses - the sampler's|. In float32 the two are the same numbers
    up to rounding; under bf16 autocast they differ (on-policy the training forward's own serve, with no pass of
    their own; off-policy the rollout recomputes them)."""
    run(['config/dr_grpo.py', '--max_iters=2', f'--dtype={dtype}', f'--num_iterations={mu}'], tmp_path)
    gaps = [m['sampler/logp_diff'] for m in metrics(tmp_path) if 'reward' in m]
    assert len(gaps) == 2 and all(0 <= g < (1e-4 if dtype == 'float32' else 0.5) for g in gaps), gaps


def test_update_metrics_counts_each_micro_batch_once():
    """update_metrics from row_flops' table: the FLOPs are each micro-batch's update_flops (its rows, length and
    completion tokens), the MFU those over seconds x the peak of all ranks (train.py sums the FLOPs over ranks, so
    it reads the same at every world size); stats summed, maxima the largest; the memory held is the parameters,
    their gradients and AdamW's two moments."""
    model = GPT(GPTConfig(block_size=32, vocab_size=50, n_layer=2, n_head=2, n_embd=16))
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randint(50, (2, 8)), start=torch.tensor([3, 4]), length=4).sum().backward()
    optimizer.step()
    shapes = [(4, 20, 30, 70, 80), (3, 32, 50, 90, 96)]  # (rows, T, completion tokens, tokens, row tokens)
    stats = [dict(kl=torch.tensor(0.5), top=torch.tensor(2.0)), dict(kl=torch.tensor(0.25), top=torch.tensor(1.0))]
    flops = sum(measure.update_flops(model, b, T, n / b) for b, T, n, _, _ in shapes)
    for world_size in (1, 2):
        speed, rest = measure.update_metrics(stats, shapes, maxima=('top',), steps=1, seconds=2.0,
                                             flops=measure.row_flops(model, 32), peak=1e9, world_size=world_size,
                                             distributed=False, held=(model, optimizer, None, None))
        assert speed['mfu'] == pytest.approx(flops / 2.0 / (1e9 * world_size), rel=1e-12)
    assert speed['train_tok_s'] == (4 * 20 + 3 * 32) / 2.0 and rest['kl'] == 0.75 and rest['top'] == 2.0
    assert rest['pad_share'] == pytest.approx(1 - 160 / 176) and rest['saved_share'] == pytest.approx(1 - 160 / 176)
    params = sum(p.numel() for p in model.parameters()) * 4 / 2**20
    assert rest['mem/params_mb'] == rest['mem/grads_mb'] == pytest.approx(params) and rest['mem/ref_mb'] == 0
    assert rest['mem/optimizer_mb'] == pytest.approx(2 * params, rel=0.01)  # and a step count per tensor
    # a teacher's weights only with one (a run without keeps its metrics' keys)
    assert 'mem/teacher_mb' not in rest
    teacher = GPT(GPTConfig(block_size=32, vocab_size=50, n_layer=1, n_head=2, n_embd=16)).double()
    _, rest = measure.update_metrics(stats, shapes, maxima=('top',), steps=1, seconds=2.0,
                                     flops=measure.row_flops(model, 32), peak=1e9, world_size=1,
                                     distributed=False, held=(model, optimizer, None, teacher))
    assert rest['mem/teacher_mb'] == sum(p.numel() for p in teacher.parameters()) * 8 / 2**20
