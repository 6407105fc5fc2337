"""
How much of the project one GRPO iteration runs (issue 48's measure of how plain the core reads): the files and
named functions of this repository called from the first rollout() to the second, one process, single turn, plain=True
(the reading path), then the same on the default path (plain=False: packing, the chunked output layer). Comprehensions,
generator expressions and lambdas are not counted.

$ python -m scripts.count_calls                   # the default task, plain=True, then plain=False
$ python -m scripts.count_calls --lora_rank=8     # any train.py flag may follow, for both counts
"""
import os
import runpy
import shutil
import sys
import tempfile
import threading

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
UNNAMED = ("<listcomp>", "<dictcomp>", "<setcomp>", "<genexpr>", "<lambda>")


def count(flags):
    """{file: the qualified names of its functions that one iteration called}."""
    seen, state = {}, dict(rollouts=0)

    def hook(frame, event, arg):
        if event != "call":
            return
        code = frame.f_code
        if code.co_filename.startswith("<"):  # frozen modules, dataclasses' generated methods
            return
        path = os.path.abspath(code.co_filename)
        if path == os.path.join(ROOT, "rollout.py") and code.co_name == "rollout":
            state["rollouts"] += 1
            if state["rollouts"] == 2:  # the iteration is over: stop the run here
                raise SystemExit(0)
        inside = path.startswith(ROOT + os.sep) and os.sep + ".venv" not in path and "/tests/" not in path
        if state["rollouts"] == 1 and inside and code.co_name not in UNNAMED and path != __file__:
            seen.setdefault(os.path.relpath(path, ROOT), set()).add(code.co_qualname)

    # a folder of its own, removed after: never another run's, nor a second count's
    out_dir = tempfile.mkdtemp(prefix="count_calls")
    sys.argv = ["train.py", "--max_iters=2", "--sft_iters=0", "--eval_interval=0",
                "--save_interval=0", f"--out_dir={out_dir}", *flags]
    sys.path.insert(0, ROOT)
    os.chdir(ROOT)
    threading.setprofile(hook)
    sys.setprofile(hook)
    try:
        runpy.run_path(os.path.join(ROOT, "train.py"), run_name="__main__")
    except SystemExit:
        pass
    finally:
        sys.setprofile(None)
        threading.setprofile(None)
        shutil.rmtree(out_dir, ignore_errors=True)
    return seen


def main(flags):
    for path_name, plain in (("the plain path", "--plain=True"), ("the default path", "--plain=False")):
        seen = count([plain, *flags])
        functions = sum(len(names) for names in seen.values())
        print(f"{path_name}: one iteration ran {functions} named functions in {len(seen)} files of the "
              f"project:")
        for path in sorted(seen):
            print(f"  {path} ({len(seen[path])}): {', '.join(sorted(seen[path]))}")


if __name__ == "__main__":
    main(sys.argv[1:])
