"""
Run train.py several times in one process, as `python train.py ARGS` would, one ARGS list per entry of a JSON file:

$ python tests/multi_run.py runs.json
$ torchrun --standalone --nproc_per_node=2 tests/multi_run.py runs.json

Under torchrun every rank runs every entry, so each run is a real DDP run of train.py's own code; only the
interpreter, torch start-up and the process group are shared (created once here: gloo does not survive being torn
down and set up again many times in one process), which keeps the split-invariance and resume tests fast. An entry
may carry "diverge": true to nudge rank 1's weights after each optimizer step (the test of the ranks' checksum).
"""
import json
import os
import runpy
import sys

import torch
import torch.distributed as dist

root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, root)
from lib import parallelism  # noqa: E402 (the root is on the path only now)

end = parallelism.end


class Ended(Exception):
    """A run's end: the next one starts (a sampler rank's run ends inside train.py)."""


def ended(code=0):
    """As on one process, the group staying: exit with a code that is not 0, else end the run."""
    if code:
        sys.exit(code)
    raise Ended


if 'RANK' in os.environ:  # train.py's own init and end become no-ops on the group made here
    dist.init_process_group(backend='gloo')
    dist.init_process_group = lambda *args, **kwargs: None
    parallelism.end = ended
for run in json.load(open(sys.argv[1])):
    args = run['args'] if isinstance(run, dict) else run
    if isinstance(run, dict) and run.get('diverge') and os.environ.get('RANK') == '1':
        step = torch.optim.AdamW.step

        def nudged(self, *a, **k):
            out = step(self, *a, **k)
            with torch.no_grad():
                self.param_groups[0]['params'][0].add_(1e-3)
            return out
        torch.optim.AdamW.step = nudged
    sys.argv = [os.path.join(root, 'train.py'), *args]
    try:
        runpy.run_path(sys.argv[0], run_name='__main__')
    except Ended:
        pass
if 'RANK' in os.environ:
    end()  # the group made here; parallelism.end says why the process skips the interpreter's shutdown
