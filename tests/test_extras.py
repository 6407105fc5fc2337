"""
The optional packages for real (requirements-extra.txt, which CI installs): a run with wandb_log=True in wandb's
offline mode logs to wandb exactly what it writes to metrics.jsonl, scripts/plot.py draws a PNG from a run's metrics.jsonl,
and without either package the flag or the script fails with one line that says what to install.
"""
import glob
import importlib
import json
import os
import struct
import subprocess
import sys
import zlib

import pytest

from test_train import ROOT, metrics, run


def need(name):
    """Training does not need the extras, so a plain `pip install -r requirements.txt` lacks them; fail (not skip)
    so that a CI that forgot them cannot pass with these tests unrun."""
    try:
        return importlib.import_module(name)
    except ImportError:
        pytest.fail(f"{name} is not installed: pip install -r requirements-extra.txt (CI installs it)")


def wandb_records(path):
    """The records of a run-*.wandb file. Since wandb-core (Go) writes and reads these, the Python package has no
    reader left, only the protobuf; the file is a 7-byte header (':W&B', magic 0xBEE1, version 0) and then a
    LevelDB log: 32 KiB blocks of chunks, each with a 7-byte header (CRC-32 of type + data, length, type), a record
    split over FIRST/MIDDLE/LAST chunks or whole in a FULL one, and a block's tail under 7 bytes left as padding."""
    from wandb.proto import wandb_internal_pb2
    data = open(path, 'rb').read()
    assert data[:7] == b':W&B' + struct.pack('<HB', 0xBEE1, 0), f"{path}: not a version-0 wandb datastore"
    pos, chunks, records = 7, b'', []
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:
            pos += 32768 - pos % 32768
            continue
        crc, length, kind = struct.unpack('<IHB', data[pos:pos + 7])
        chunk = data[pos + 7:pos + 7 + length]
        assert zlib.crc32(chunk, zlib.crc32(bytes([kind]))) == crc, f"{path}: bad checksum at byte {pos}"
        pos, chunks = pos + 7 + length, chunks + chunk
        if kind in (1, 4):  # FULL or LAST: a record is complete
            record = wandb_internal_pb2.Record()
            record.ParseFromString(chunks)
            records.append(record)
            chunks = b''
    assert pos == len(data) and not chunks, f"{path}: ends inside a record"
    return records


def history(records):
    """[(step, row)] of the history records, without wandb's own keys (_step, _runtime, _timestamp)."""
    rows = []
    for r in records:
        if r.WhichOneof('record_type') == 'history':
            row = {}
            for item in r.history.item:
                # wandb writes values as JSON (never ''); newer protos also have typed values, unused so far
                assert item.value_json, f"wandb now writes typed values ({item}): read them here"
                row[item.key or '.'.join(item.nested_key)] = json.loads(item.value_json)
            rows.append((r.history.step.num, {k: v for k, v in row.items() if not k.startswith('_')}))
    return rows


def test_wandb_offline_logs_the_metrics_of_metrics_jsonl(tmp_path, monkeypatch):
    need('wandb')
    # offline: no network (CI has none) and no account; silent: no banner; what wandb writes outside the run
    # (settings, caches, core logs) goes to tmp_path, not $HOME; no git, code or system-metrics capture, which is
    # not under test and only slower. WANDB_DIR points elsewhere so that the run's files landing in out_dir/wandb
    # shows train.py's dir=out_dir at work.
    for var, value in [('WANDB_MODE', 'offline'), ('WANDB_SILENT', 'true'), ('WANDB_DIR', tmp_path / 'elsewhere'),
                       ('WANDB_CONFIG_DIR', tmp_path / 'config'), ('WANDB_CACHE_DIR', tmp_path / 'cache'),
                       ('WANDB_DATA_DIR', tmp_path / 'data'), ('WANDB_DISABLE_GIT', 'true'),
                       ('WANDB_DISABLE_CODE', 'true'), ('WANDB_X_DISABLE_STATS', 'true')]:
        monkeypatch.setenv(var, str(value))
    (tmp_path / 'elsewhere').mkdir()
    out = tmp_path / 'out'
    run(['config/dr_grpo.py', '--max_iters=2', '--wandb_log=True'], out)
    runs = glob.glob(str(out / 'wandb' / 'offline-run-*'))
    assert len(runs) == 1, f"expected one offline run under {out / 'wandb'}, found {runs}"
    assert os.path.isdir(os.path.join(runs[0], 'files')) and os.path.isdir(os.path.join(runs[0], 'logs'))
    assert not os.listdir(tmp_path / 'elsewhere')
    [store] = glob.glob(os.path.join(runs[0], 'run-*.wandb'))
    records = wandb_records(store)
    # wandb.log(m, step=iter) merges the eval and train lines of an iteration into one row of that step
    expected = {}
    for m in metrics(out):
        expected.setdefault(m['iter'], {}).update(m)
    logged = history(records)
    assert [step for step, _ in logged] == sorted(expected) == [0, 1, 2]
    for step, row in logged:
        assert row == expected[step], f"iteration {step}: wandb has {row}, metrics.jsonl {expected[step]}"
    assert any(r.WhichOneof('record_type') == 'exit' for r in records), "no exit record: the run was not finished"


def test_plot_draws_a_png_from_a_run(tmp_path):
    need('matplotlib')
    from matplotlib import image
    out = tmp_path / 'out'
    run(['config/dr_grpo.py', '--max_iters=2'], out)
    p = subprocess.run([sys.executable, 'scripts/plot.py', str(out)], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    png = out / 'curves.png'
    assert open(png, 'rb').read(8) == b'\x89PNG\r\n\x1a\n'
    pixels = image.imread(png)
    assert pixels.shape[0] >= 300 and pixels.shape[1] >= 600, pixels.shape
    assert len({tuple(px) for px in pixels.reshape(-1, pixels.shape[2])}) > 10, "a blank picture"


def without(tmp_path, monkeypatch, package):
    """A package that fails to import, as if it were not installed, ahead of the real one on the path."""
    (tmp_path / 'fake' / package).mkdir(parents=True)
    (tmp_path / 'fake' / package / '__init__.py').write_text(f"raise ImportError('no {package} here (a test)')\n")
    monkeypatch.setenv('PYTHONPATH', str(tmp_path / 'fake'))


def test_wandb_log_without_wandb_is_one_line(tmp_path, monkeypatch):
    without(tmp_path, monkeypatch, 'wandb')
    out = tmp_path / 'out'
    p = run(['config/dr_grpo.py', '--max_iters=2', '--wandb_log=True'], out, check=False)
    assert p.returncode != 0
    assert p.stderr.splitlines() == ["error: wandb_log=True needs the wandb package: pip install wandb (or pip "
                                     "install -r requirements-extra.txt)"], p.stderr
    assert not (out / 'latest').exists() and not (out / 'metrics.jsonl').exists(), "it trained before failing"


def test_plot_without_matplotlib_is_one_line(tmp_path, monkeypatch):
    without(tmp_path, monkeypatch, 'matplotlib')
    p = subprocess.run([sys.executable, 'scripts/plot.py', str(tmp_path)], cwd=ROOT, capture_output=True, text=True,
                       timeout=120)
    assert p.returncode != 0
    assert p.stderr.splitlines() == ["error: plot.py needs matplotlib: pip install matplotlib (or pip install -r "
                                     "requirements-extra.txt)"], p.stderr
    assert not (tmp_path / 'curves.png').exists()
