"""
Run `python train.py ARGS` for many ARGS lists, each in a process of its own, without paying torch's start-up for
each: this process imports what train.py imports once, then forks a child per run, which runs train.py as __main__
exactly as the interpreter would (an exception that escapes goes to sys.excepthook, then exit 1).

$ python tests/fork_run.py runs.json results.json

runs.json: [{"args": [...], "path": "dir to put first on sys.path"}, ...]. results.json: [{"rc": int, "stderr":
str}, ...] in the same order. Two children run at a time. The test of bad input uses it: each case's exit code,
its one error line and the absence of a traceback are the point, and they are what a user sees.
"""
import importlib
import json
import os
import runpy
import sys
import tempfile

root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, root)
os.chdir(root)
for name in ('lib.checkpoint', 'configurator', 'data', 'lib.lora', 'loss', 'lib.measure', 'model', 'reward', 'rollout',
             'lib.tokenizer'):
    importlib.import_module(name)  # what train.py imports, once for every child


def child(run, err):
    os.dup2(err.fileno(), 2)
    os.dup2(os.open(os.devnull, os.O_WRONLY), 1)
    sys.path.insert(0, run.get('path') or root)
    sys.argv = ['train.py', *run['args']]
    code = 0
    try:
        runpy.run_path('train.py', run_name='__main__')
    except SystemExit as e:  # as the interpreter does: None is 0, an int the code, anything else printed, then 1
        if e.code is None or isinstance(e.code, int):
            code = e.code or 0
        else:
            print(e.code, file=sys.stderr)
            code = 1
    except BaseException:
        sys.excepthook(*sys.exc_info())
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


runs = json.load(open(sys.argv[1]))
results, running, queue = [None] * len(runs), {}, list(enumerate(runs))
while queue or running:
    while queue and len(running) < 2:
        i, run = queue.pop(0)
        err = tempfile.TemporaryFile(mode='w+')
        sys.stdout.flush()
        pid = os.fork()
        if pid == 0:
            child(run, err)
        running[pid] = (i, err)
    pid, status = os.wait()
    i, err = running.pop(pid)
    err.seek(0)
    results[i] = dict(rc=os.waitstatus_to_exitcode(status), stderr=err.read())
json.dump(results, open(sys.argv[2], 'w'))
