"""scripts/bench.py runs end to end at a tiny shape, every section, both length settings: a smoke test that keeps the tool
every speed number in README.md comes from from rotting. Nothing here is timed or compared to a speed."""
import json
import math
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = ['--prompts=2', '--G=2', '--prompt_len=16', '--new_tokens=16', '--n_layer=1', '--n_embd=32', '--n_head=2',
        '--vocab_size=300', '--repeat=1', '--micro_batch_size=2', '--tokenizer_vocab=3000']


@pytest.mark.parametrize('lengths', ['fixed', 'geometric'])
def test_bench_runs_every_section(tmp_path, lengths):
    out = tmp_path / 'bench.json'
    only = [] if lengths == 'fixed' else ['--only=train_step,iteration']  # the sections that use the lengths
    p = subprocess.run([sys.executable, '-m', 'scripts.bench', *TINY, f'--lengths={lengths}', f'--json={out}', *only], cwd=ROOT,
                       capture_output=True, text=True, timeout=300, env=dict(os.environ, OMP_NUM_THREADS='1'))
    assert p.returncode == 0, p.stderr[-3000:]
    r = json.loads(out.read_text())
    every = {'sampling', 'logprobs', 'tokenizer', 'scale', 'start', 'truncation'}
    assert {'peak', 'train_step', 'iteration'} | (every if lengths == 'fixed' else set()) <= r.keys()
    if lengths == 'fixed':  # FSDP holds half of DDP's parameters and AdamW state on each of 2 ranks, LoRA no reference
        s = r['scale']
        assert s['fsdp_vs_ddp_params_optimizer'] == pytest.approx(0.5, abs=0.05)
        assert s['lora_ref_mb'] == 0 < s['ddp_ref_mb'] and s['lora_grads_mb'] < s['ddp_grads_mb'] / 2
    numbers = [v for section in r.values() for v in section.values() if isinstance(v, float)]
    assert all(math.isfinite(v) for v in numbers)  # the start section's peaks too: each rank's process was found
    for section in ('train_step', 'iteration'):
        assert 0 < r[section]['completion_len'] <= 16 and 0 <= r[section]['pad_share'] < 1
        assert 0 <= r[section]['saved_share'] < 1
    if lengths == 'fixed':  # rows of the longest length: one to a sequence, no padding and no prompt shared
        assert r['train_step']['pad_share'] == r['train_step']['saved_share'] == 0
        assert r['train_step']['completion_len'] == 16
    else:  # shorter rows than the limit, so sorting them had padding to cut
        assert r['train_step']['completion_len'] < 16 and 'time_vs_full_length' in r['train_step']


def test_bench_only_runs_the_named_sections(tmp_path):
    out = tmp_path / 'bench.json'
    p = subprocess.run([sys.executable, '-m', 'scripts.bench', *TINY, '--only=tokenizer', f'--json={out}'], cwd=ROOT,
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    assert set(json.loads(out.read_text())) == {'machine', 'config', 'peak', 'tokenizer'}
