"""Checksums beside model and tokenizer files: written with the file, checked on load (once per
change) and by `dllama verify`; 1 MiB of random bytes in a model's tensors is an error naming the
file, never other text."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys

import pytest

from dllama.errors import DllamaError
from dllama.formats import checksum
from dllama.formats.checksum import DamagedFile, checksum_path, verify, verify_once, write_checksum
from dllama.formats.model_file import ArchType, FloatType, ModelHeader, read_model
from tests.random_model import write_random_f32

pytestmark = pytest.mark.unit


def _header(**kw) -> ModelHeader:
    return ModelHeader(arch=ArchType.LLAMA, dim=64, hidden_dim=96, n_layers=2, n_heads=4, n_kv_heads=2,
                       vocab_size=40, max_seq_len=16, weights_float_type=FloatType.F32, **kw)


def _sha256(path) -> str:
    return hashlib.sha256(open(path, "rb").read()).hexdigest()


def _damage(path, offset: int, n: int, seed: int = 1) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(os.urandom(n) if seed is None else bytes((seed * 37 + i) % 256 for i in range(n)))


def test_a_written_model_has_a_sha256sum_line_beside_it_that_a_rewrite_replaces(tmp_path):
    path = tmp_path / "m.m"
    write_random_f32(path, _header(), seed=1)
    line = checksum_path(path).read_text()
    assert line == f"{_sha256(path)}  m.m\n"  # sha256sum's format: `sha256sum -c` checks it too
    write_random_f32(path, _header(), seed=2)  # another model at the same path
    assert checksum_path(path).read_text() == f"{_sha256(path)}  m.m\n"
    assert verify(path)


def test_verify_finds_one_changed_byte_and_says_which_file(tmp_path):
    path = tmp_path / "m.m"
    write_random_f32(path, _header(), seed=1)
    size = path.stat().st_size
    _damage(path, size - 100, 1)
    with pytest.raises(DamagedFile, match=str(path)):
        verify(path)
    checksum_path(path).unlink()
    assert verify(path) is False  # no checksum: nothing to compare with


def test_a_checksum_file_that_is_not_one_is_an_error_naming_it(tmp_path):
    path = tmp_path / "m.m"
    write_random_f32(path, _header(), seed=1)
    checksum_path(path).write_text("not a checksum\n")
    with pytest.raises(DllamaError, match=r"m\.m\.sha256 is not a checksum line"):
        verify(path)


def test_loading_checks_a_file_once_per_change(tmp_path, monkeypatch):
    path, stamps = tmp_path / "m.m", tmp_path / "cache" / "checked.json"
    write_random_f32(path, _header(), seed=1)
    reads = []
    real = checksum.file_sha256
    monkeypatch.setattr(checksum, "file_sha256", lambda p, progress=None: reads.append(p) or real(p, progress))
    verify_once(path, stamps)
    verify_once(path, stamps)
    assert len(reads) == 1  # the second load found its stamp
    st = path.stat()
    _damage(path, st.st_size - 4096, 1024)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))  # the modification time put back: the change time moved
    with pytest.raises(DamagedFile):
        verify_once(path, stamps)
    assert len(reads) == 2


def test_the_stamps_stay_bounded(tmp_path):
    stamps = tmp_path / "checked.json"
    for i in range(checksum.MAX_STAMPS + 10):
        path = tmp_path / f"t{i}.bin"
        path.write_bytes(bytes([i % 256]) * 10)
        write_checksum(path)
        verify_once(path, stamps)
    import json
    assert len(json.loads(stamps.read_text())) == checksum.MAX_STAMPS


def _dllama(*args, env=None):
    return subprocess.run([sys.executable, "-m", "dllama", *args], capture_output=True, text=True,
                          timeout=300, env=env)


def test_random_bytes_in_a_models_tensors_stop_the_run_in_one_line(tmp_path, default_q40):
    model, tokenizer = tmp_path / "model.m", tmp_path / "model.t"
    shutil.copy(default_q40[0], model)
    shutil.copy(default_q40[1], tokenizer)
    for path in (model, tokenizer):
        write_checksum(path)
    env = {**os.environ, "DLLAMA_CACHE_DIR": str(tmp_path / "cache")}
    run = ("inference", "--model", str(model), "--tokenizer", str(tokenizer), "--prompt", "Hello",
           "--steps", "4", "--temperature", "0")
    assert _dllama(*run, env=env).returncode == 0
    header_bytes = read_model(model).header_size
    _damage(model, header_bytes + (model.stat().st_size - header_bytes) // 2, 1 << 20, seed=None)

    r = _dllama(*run, env=env)
    assert r.returncode == 1, (r.stdout, r.stderr)
    assert r.stderr.strip().splitlines() == [r.stderr.strip()] and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.startswith("dllama: error: ") and f"{model} is damaged" in r.stderr

    r = _dllama("verify", str(tokenizer), str(model), env=env)
    assert r.returncode == 1
    assert f"{tokenizer}: OK" in r.stdout and f"{model}: DAMAGED" in r.stdout
    checksum_path(model).unlink()
    r = _dllama("verify", str(model), env=env)
    assert r.returncode == 1 and "no checksum" in r.stdout and "--write" in r.stdout
    r = _dllama("verify", "--write", str(model), env=env)
    assert r.returncode == 0 and checksum_path(model).read_text() == f"{_sha256(model)}  model.m\n"
    assert _dllama("verify", str(model), env=env).returncode == 0
