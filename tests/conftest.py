"""Fixtures shared by the test files that run train.py end to end (test_exact.py, test_scale.py): built once."""
import pytest

from test_exact import BASE, launch


@pytest.fixture(scope='session')
def policy(tmp_path_factory):
    """A policy that gets some answers right (a short supervised warm start), so rewards and advantages vary."""
    out = tmp_path_factory.mktemp('warm')
    launch([BASE + ['--sft_iters=60', '--sft_target_acc=0', '--max_iters=0', '--n_layer=2', '--n_head=2',
                    '--n_embd=32', f'--out_dir={out}']], out)
    return str(out / 'warmstart')
