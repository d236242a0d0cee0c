"""`archscale doctor`: each finding one line with what to do; a missing compiler, a busy port and a missing data
folder are failures."""

from __future__ import annotations

import socket

from archscale import doctor
from archscale.models.mixers.base import REGISTRY


def test_missing_compiler_is_a_failure_with_the_fix(monkeypatch):
    monkeypatch.setenv("CXX", "no-such-compiler-xyz")
    f = doctor.compiler()
    assert f.status == "fail" and "no-such-compiler-xyz" in f.what and "g++" in f.todo
    monkeypatch.setenv("CXX", "sh")  # any program on PATH stands for a compiler here
    assert doctor.compiler().status == "ok"


def test_busy_master_port_is_a_failure_and_a_free_one_is_ok(monkeypatch):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
        monkeypatch.setenv("MASTER_PORT", str(port))
        found = doctor.rendezvous()
        assert found[-1].status == "fail" and str(port) in found[-1].what and "--master_port" in found[-1].todo
    monkeypatch.setenv("MASTER_PORT", str(port))  # released now
    assert [f.status for f in doctor.rendezvous()] == ["ok", "ok"]
    monkeypatch.setenv("MASTER_PORT", "not-a-port")
    assert doctor.rendezvous()[0].status == "fail"


def test_missing_data_folder_fails_and_a_prepared_one_passes(tmp_path, monkeypatch, capsys):
    class A:
        tokenizer = None
        train_data_dir = str(tmp_path / "missing")

    [f] = doctor.data(A)
    assert f.status == "fail" and "archscale prepare" in f.todo
    (tmp_path / "ok").mkdir()
    (tmp_path / "ok" / "train_000.bin").write_bytes(b"")
    A.train_data_dir = str(tmp_path / "ok")
    assert doctor.data(A)[0].status == "ok"
    # the command: one line per finding, exit status 1 when any fails
    monkeypatch.setattr(doctor, "kernels", lambda: [])
    assert doctor.main(["--train_data_dir", str(tmp_path / "missing"), "--out_dir", str(tmp_path)]) == 1
    lines = capsys.readouterr().out.splitlines()
    assert any(line.startswith("[fail] data folder") for line in lines)
    assert doctor.main(["--train_data_dir", str(tmp_path / "ok"), "--out_dir", str(tmp_path), "--depth", "2"]) == 0


def test_kernel_lines_walk_the_registry():
    lines = [f.what for f in doctor.kernels()]
    for spec in REGISTRY.values():
        assert sum(line.startswith(f"{spec.name}:") for line in lines) == max(1, len(spec.kernels))
    unavailable = [f for f in doctor.kernels() if f.status == "warn" and "unavailable" in f.what]
    assert all(f.todo for f in unavailable)  # every missing kernel says how to get it


def test_a_hanging_kernel_check_times_out():
    import threading

    ok, note = doctor._available(threading.Event().wait, timeout=0.2)
    assert not ok and "still building" in note
