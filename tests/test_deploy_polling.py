"""Unit tests for the latency tools in fedddl.deploy (no Flower deployment needed)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from fedddl.deploy.processes import (
    ManagedProcess,
    descendant_pids,
    flower_env,
    format_node_config,
    free_ports,
)
from fedddl.deploy.warm_clientapp import SOCKET_ENV, install_shim
from fedddl.flower.fast_supernode import ScaledSleepTime, patch_supernode_polling
from fedddl.flower.grid import FastPollGrid


class _ScriptedGrid:
    """Grid double: replies to message i become available after i+1 pulls."""

    def __init__(self) -> None:
        self.pulls = 0
        self.pushed: list[str] = []

    def push_messages(self, messages: Iterable[Any]) -> list[str]:
        self.pushed = [f"m{i}" for i, _ in enumerate(messages)]
        return list(self.pushed)

    def pull_messages(self, message_ids: Iterable[str]) -> list[Any]:
        self.pulls += 1
        wanted = set(message_ids)
        ready = [mid for i, mid in enumerate(self.pushed) if i < self.pulls and mid in wanted]
        return [SimpleNamespace(metadata=SimpleNamespace(reply_to_message_id=m)) for m in ready]


def test_fast_poll_grid_collects_all_replies_quickly() -> None:
    inner = _ScriptedGrid()
    grid = FastPollGrid(inner, poll_interval_s=0.01)  # type: ignore[arg-type]
    started = time.monotonic()
    replies = list(grid.send_and_receive(["a", "b", "c"]))  # type: ignore[list-item]
    elapsed = time.monotonic() - started
    assert sorted(r.metadata.reply_to_message_id for r in replies) == ["m0", "m1", "m2"]
    assert inner.pulls == 3
    assert elapsed < 1.0  # HttpGrid would have slept 2 x 3 s here


def test_fast_poll_grid_honours_timeout_and_rejects_bad_interval() -> None:
    class _Silent(_ScriptedGrid):
        def pull_messages(self, message_ids: Iterable[str]) -> list[Any]:
            self.pulls += 1
            return []

    grid = FastPollGrid(_Silent(), poll_interval_s=0.01)  # type: ignore[arg-type]
    started = time.monotonic()
    assert list(grid.send_and_receive(["a"], timeout=0.2)) == []  # type: ignore[list-item]
    assert 0.15 < time.monotonic() - started < 1.5
    with pytest.raises(ValueError, match="poll_interval_s"):
        FastPollGrid(_Silent(), poll_interval_s=0)  # type: ignore[arg-type]


def test_fast_poll_grid_uses_its_wait_and_tells_each_push() -> None:
    inner, waits, pushes = _ScriptedGrid(), [], []  # type: ignore[var-annotated]
    grid = FastPollGrid(
        inner,  # type: ignore[arg-type]
        poll_interval_s=5.0,
        wait=waits.append,  # returns at once, as a stored reply would end the wait
        on_push=lambda: pushes.append(len(inner.pushed)),
    )
    replies = list(grid.send_and_receive(["a", "b"]))  # type: ignore[list-item]
    assert len(replies) == 2 and inner.pulls == 2
    assert pushes == [2]  # told once, after the messages were pushed
    assert waits == [5.0]  # one wait between the two pulls, never a 5 s sleep


def test_scaled_sleep_replaces_only_the_listed_durations(monkeypatch: pytest.MonkeyPatch) -> None:
    slept: list[float] = []
    monkeypatch.setattr(time, "sleep", slept.append)
    fake = ScaledSleepTime({3.0: 0.2, 0.5: 0.05})
    fake.sleep(3)
    fake.sleep(0.5)
    fake.sleep(7)
    assert slept == [0.2, 0.05, 7]
    assert fake.monotonic is time.monotonic


def test_patch_supernode_polling_targets_flowers_main_loop() -> None:
    import flwr.supernode.start_client_internal as module

    original = module.time  # type: ignore[attr-defined]
    try:
        patched = patch_supernode_polling(0.2, 0.05)
        fake = getattr(patched, "time")  # noqa: B009 - not a declared attribute
        assert isinstance(fake, ScaledSleepTime)
        assert fake.replacements == {3.0: 0.2, 0.5: 0.05}
        with pytest.raises(RuntimeError, match="not patching"):
            patch_supernode_polling(0.2, 0.05)  # already patched: refuses to stack
    finally:
        module.time = original  # type: ignore[attr-defined]
    with pytest.raises(ValueError, match="positive"):
        patch_supernode_polling(0, 0.05)


def test_node_config_rendering_and_free_ports() -> None:
    assert format_node_config({"partition-id": 0, "num-partitions": 3, "data-root": "/d a"}) \
        == 'partition-id=0 num-partitions=3 data-root="/d a"'
    ports = free_ports(5)
    assert len(set(ports)) == 5 and all(1024 <= p <= 65535 for p in ports)


def test_managed_process_stop_kills_detached_descendants(tmp_path: Path) -> None:
    # A parent that starts a grandchild in a *new session* (as Flower's SuperLink
    # does with flower-superexec): killing the process group alone would miss it.
    script = textwrap.dedent("""
        import subprocess, sys, time
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                                 start_new_session=True)
        print(child.pid, flush=True)
        time.sleep(60)
    """)
    log = tmp_path / "p.log"
    with log.open("wb") as out:
        popen = subprocess.Popen([sys.executable, "-c", script], stdout=out,
                                 start_new_session=True)
    process = ManagedProcess(name="p", popen=popen, log_path=log)
    match = process.wait_for_log(r"(\d+)\n", timeout_s=20)
    grandchild = int(match.group(1))
    assert grandchild in descendant_pids(popen.pid)
    process.stop(timeout_s=5)
    assert not process.alive()
    assert _gone_within(grandchild, timeout_s=5)


def _gone_within(pid: int, timeout_s: float) -> bool:
    """True once ``pid`` no longer runs (absent, or a zombie awaiting its reaper)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (FileNotFoundError, ProcessLookupError):
            return True
        if state == "Z":
            return True
        time.sleep(0.05)
    return False


def test_warm_fork_server_runs_entry_with_shim_argv_env_cwd_and_exit_code(
    tmp_path: Path,
) -> None:
    (tmp_path / "probe_entry.py").write_text(textwrap.dedent("""
        import os, sys
        def main():
            print("argv", sys.argv[1:], "cwd", os.getcwd(), "tag", os.environ.get("PROBE_TAG"))
            print("to-stderr", file=sys.stderr)
            sys.exit(int(os.environ.get("PROBE_EXIT", "0")))
    """))
    runtime = Path(os.environ.get("TMPDIR", "/tmp")) / f"fedddl-warm-test-{os.getpid()}"
    runtime.mkdir(exist_ok=True)
    socket_path = runtime / "s.sock"
    env = flower_env(None, extra={"PYTHONPATH": str(tmp_path)})
    server_log = tmp_path / "server.log"
    with server_log.open("wb") as out:
        popen = subprocess.Popen(
            [sys.executable, "-m", "fedddl.deploy.warm_clientapp", "serve", "--socket",
             str(socket_path), "--preload", "json", "--entry", "probe_entry:main"],
            stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    server = ManagedProcess(name="warm", popen=popen, log_path=server_log,
                            cleanup_dirs=[runtime])
    try:
        server.wait_for_log("warm clientapp server ready", timeout_s=60)
        shim = install_shim(tmp_path / "bin")
        workdir = tmp_path / "work"
        workdir.mkdir()
        shim_env = {**env, SOCKET_ENV: str(socket_path), "PROBE_TAG": "t1", "PROBE_EXIT": "3"}
        started = time.monotonic()
        result = subprocess.run([str(shim), "--token", "abc"], env=shim_env, cwd=workdir,
                                capture_output=True, text=True, timeout=30)
        elapsed = time.monotonic() - started
        assert result.returncode == 3, result
        assert f"argv ['--token', 'abc'] cwd {workdir} tag t1" in result.stdout
        assert "to-stderr" in result.stderr
        assert elapsed < 5
        # A second request from the same server: fresh child, new environment.
        shim_env["PROBE_TAG"], shim_env["PROBE_EXIT"] = "t2", "0"
        again = subprocess.run([str(shim)], env=shim_env, cwd=workdir, capture_output=True,
                               text=True, timeout=30)
        assert again.returncode == 0 and "tag t2" in again.stdout
    finally:
        server.stop()
    assert not runtime.exists()


def test_shim_falls_back_to_the_real_program_without_a_server(tmp_path: Path) -> None:
    fake_real = tmp_path / "real-clientapp"
    fake_real.write_text("#!/bin/sh\necho real \"$@\"\nexit 4\n")
    fake_real.chmod(0o755)
    shim = install_shim(tmp_path / "bin", real_clientapp=fake_real)
    env = {**os.environ, SOCKET_ENV: str(tmp_path / "nobody-listens.sock")}
    result = subprocess.run([str(shim), "--x", "1"], env=env, capture_output=True, text=True,
                            timeout=30)
    assert result.returncode == 4
    assert result.stdout.strip() == "real --x 1"
