"""The lifeline (servers die with a killed pytest, their /dev/shm segments are removed) and the per-device startup
lock, on stand-in processes: no vLLM. The same on real servers is in test_e2e_faults.py."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from multiprocessing import resource_tracker, shared_memory
from pathlib import Path
from typing import Any

import psutil
import pytest
from stubs.helpers import kill_quietly, reap, running

from pytest_vllm_mem.launch import devicelock, lifeline
from pytest_vllm_mem.memory import DeviceInfo

linux_only = pytest.mark.skipif(
    not Path("/proc/self/maps").exists() or not Path("/dev/shm").is_dir(),
    reason="the segment clean-up reads /proc and /dev/shm (Linux)",
)

# A server stand-in: its own session, a segment it creates and never removes (as a SIGKILLed vLLM leaves it), a
# child holding a second one, and a grandchild that left the session (setsid).
SERVER = textwrap.dedent("""
    import json, os, sys, time
    from multiprocessing import resource_tracker, shared_memory

    def segment():
        shm = shared_memory.SharedMemory(create=True, size=4096)
        resource_tracker.unregister(shm._name, "shared_memory")  # leaks when killed, like vLLM's ring buffers
        return shm

    out = sys.argv[1]
    if os.fork() == 0:
        held = segment()
        if os.fork() == 0:
            os.setsid()
            time.sleep(600)
        with open(out + ".child", "w") as f:
            json.dump({"pid": os.getpid(), "segment": held.name}, f)
        time.sleep(600)
    own = segment()
    with open(out + ".tmp", "w") as f:
        json.dump({"pid": os.getpid(), "segment": own.name}, f)
    os.replace(out + ".tmp", out)
    time.sleep(600)
""")

# A pytest stand-in: starts one server as server.py does, hands it to the lifeline, then waits to be killed (or
# releases it after stopping it, with "release").
PYTEST = textwrap.dedent("""
    import os, signal, subprocess, sys, time
    import psutil
    from pytest_vllm_mem.launch import lifeline as module
    from pytest_vllm_mem.launch.lifeline import lifeline

    server = subprocess.Popen([sys.executable, "-c", open(sys.argv[1]).read(), sys.argv[2]], start_new_session=True)
    lifeline().watch(server.pid)
    while not os.path.exists(sys.argv[2] + ".child") or not os.path.exists(sys.argv[2]):
        time.sleep(0.05)
    time.sleep(2 * module.PERIOD_S + 2)  # the watchdog has started (a loaded machine: seconds) and noted the segments
    watchdog = lifeline().pid()
    if sys.argv[3] == "release":
        procs = [psutil.Process(server.pid), *psutil.Process(server.pid).children(recursive=True)]
        for proc in procs:
            proc.kill()
        psutil.wait_procs(procs, timeout=5)
        lifeline().release(server.pid)
    elif sys.argv[3] == "close":
        lifeline().close()
    open(sys.argv[2] + ".ready", "w").write(str(watchdog))
    time.sleep(600)
""")


def _start(tmp_path: Path, mode: str) -> tuple[subprocess.Popen[bytes], dict[str, Any], dict[str, Any], list[int]]:
    (tmp_path / "server.py").write_text(SERVER)
    out = tmp_path / "server.json"
    stand_in = subprocess.Popen([sys.executable, "-c", PYTEST, str(tmp_path / "server.py"), str(out), mode])
    deadline = time.monotonic() + 60
    ready = Path(f"{out}.ready")
    while not ready.exists():
        assert stand_in.poll() is None and time.monotonic() < deadline, "the stand-in pytest did not get ready"
        time.sleep(0.05)
    server = json.loads(out.read_text())
    child = json.loads(Path(f"{out}.child").read_text())
    pids = [server["pid"], child["pid"]]
    try:  # the grandchild in its own session, the resource trackers multiprocessing started
        pids += [p.pid for p in psutil.Process(server["pid"]).children(recursive=True) if p.pid not in pids]
    except psutil.Error:
        pass
    return stand_in, server, child, pids


def _segment_exists(name: str) -> bool:
    return Path("/dev/shm", name.lstrip("/")).exists()


def _unlink(name: str) -> None:
    try:
        os.unlink(Path("/dev/shm", name.lstrip("/")))
    except OSError:
        pass


@linux_only
def test_sigkilled_pytest_takes_its_servers_and_their_segments_but_no_other_segment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    trace = tmp_path / "lifeline.trace"
    monkeypatch.setenv(lifeline.TRACE_VAR, str(trace))  # the stand-in pytest's watchdog inherits it
    # Segments that are not the server's: one this process keeps mapped, one nobody maps. Neither may go.
    mapped = shared_memory.SharedMemory(create=True, size=4096)
    unmapped = shared_memory.SharedMemory(create=True, size=4096)
    unmapped.close()
    stand_in, server, child, pids = _start(tmp_path, "kill")
    try:
        assert len(running(pids)) >= 3 and _segment_exists(server["segment"]) and _segment_exists(child["segment"])
        killed = time.monotonic()
        stand_in.send_signal(signal.SIGKILL)
        deadline = killed + 15
        while running(pids) or _segment_exists(server["segment"]) or _segment_exists(child["segment"]):
            assert time.monotonic() < deadline, f"left 15 s after SIGKILL: {running(pids)}"
            time.sleep(0.05)
        took = time.monotonic() - killed
        print(f"[faults] stand-in servers and segments gone {took:.2f} s after SIGKILL of their pytest")
        assert took < lifeline.TERM_GRACE_S + 10  # well inside the 15 s deadline; a busy machine delays the watchdog
        assert _segment_exists(mapped.name) and _segment_exists(unmapped.name)
        lines = trace.read_text().splitlines()  # the watchdog's record, in order, with its times
        assert re.search(r"^lifeline \d+ \+0\.\d\d s: pytest \d+ gone; 1 servers to stop$", lines[0]), lines
        assert re.search(r": [12] segments removed: \['/dev/shm/", lines[-1]), lines
    finally:
        reap(stand_in)
        kill_quietly(pids)
        for segment in (server["segment"], child["segment"]):
            _unlink(segment)
        mapped.close()
        mapped.unlink()
        unmapped.unlink()


@linux_only
def test_a_server_pytest_stopped_leaves_no_segment_and_nothing_else_is_stopped(tmp_path: Path) -> None:
    stand_in, server, child, pids = _start(tmp_path, "release")  # killed by pytest, then released
    try:
        deadline = time.monotonic() + 10
        while _segment_exists(server["segment"]) or _segment_exists(child["segment"]):
            assert time.monotonic() < deadline, "the stopped server's segments were not removed"
            time.sleep(0.05)
        assert running(pids) == []
        assert stand_in.poll() is None  # pytest lives on
    finally:
        reap(stand_in)
        kill_quietly(pids)
        _unlink(server["segment"])
        _unlink(child["segment"])


@linux_only
def test_a_segment_another_live_process_maps_is_never_removed(tmp_path: Path) -> None:
    watched = lifeline.Watched(psutil.Process())  # this process as "the server": its mappings get noted
    shm = shared_memory.SharedMemory(create=True, size=4096)
    resource_tracker.unregister(f"/{shm.name}", "shared_memory")  # the tracker's name: POSIX's, with its slash
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time\nfrom multiprocessing import shared_memory\n"
            "from multiprocessing import resource_tracker\n"
            "s = shared_memory.SharedMemory(name=sys.argv[1])\n"
            "resource_tracker.unregister(s._name, 'shared_memory')\nprint('ok', flush=True)\n"
            "time.sleep(600)",
            shm.name,
        ],
        stdout=subprocess.PIPE,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == b"ok"
        lifeline.note(watched)
        assert f"/dev/shm/{shm.name.lstrip('/')}" in watched.segments
        shm.close()  # "the server" let go of it; the holder still maps it
        assert lifeline.remove_segments(watched) == []
        assert _segment_exists(shm.name)
        holder.kill()
        holder.wait()
        assert lifeline.remove_segments(watched) == [f"/dev/shm/{shm.name.lstrip('/')}"]
    finally:
        reap(holder)
        _unlink(shm.name)


@linux_only
def test_a_file_recreated_under_a_noted_name_is_not_removed(tmp_path: Path) -> None:
    shm = shared_memory.SharedMemory(create=True, size=4096)
    watched = lifeline.Watched(psutil.Process())
    lifeline.note(watched)
    path = f"/dev/shm/{shm.name.lstrip('/')}"
    shm.close()
    shm.unlink()
    Path(path).write_bytes(b"someone else's")  # same name, another file
    try:
        assert lifeline.remove_segments(watched) == []
        assert Path(path).exists()
    finally:
        os.unlink(path)


@linux_only
def test_orderly_close_stops_what_is_registered_and_the_watchdog_exits(tmp_path: Path) -> None:
    stand_in, server, child, pids = _start(tmp_path, "close")
    try:
        watchdog = int(Path(f"{tmp_path / 'server.json'}.ready").read_text())
        assert running([watchdog]) == []  # close() waited for it
        assert running(pids) == []
        assert not _segment_exists(server["segment"]) and not _segment_exists(child["segment"])
    finally:
        reap(stand_in)
        kill_quietly(pids)
        _unlink(server["segment"])
        _unlink(child["segment"])


@linux_only
def test_a_dead_watchdog_is_replaced_and_the_pipe_to_it_closed() -> None:
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True)
    guard = lifeline.Lifeline()
    try:
        guard.watch(sleeper.pid)
        first = guard._process
        assert first is not None and first.stdin is not None
        first.kill()
        first.wait()
        guard.watch(sleeper.pid)  # the next launch starts another watchdog
        assert guard._process is not first and guard.pid() is not None
        assert first.stdin.closed  # not left to the garbage collector (a ResourceWarning)
    finally:
        guard.close()
        reap(sleeper)


def test_a_watch_line_for_a_reused_pid_is_ignored() -> None:
    watched: dict[int, lifeline.Watched] = {}
    me = psutil.Process()
    lifeline.parse(f"watch {me.pid} {me.create_time() - 100!r}", watched)
    lifeline.parse("watch nonsense", watched)
    assert watched == {}
    lifeline.parse(f"watch {me.pid} {me.create_time()!r}", watched)
    assert list(watched) == [me.pid]
    assert lifeline.parse(f"release {me.pid}", watched) is not None and watched == {}


def test_the_watchdog_refuses_to_run_without_a_parent_pid() -> None:
    result = subprocess.run([sys.executable, lifeline.__file__], capture_output=True, text=True, timeout=30)
    assert result.returncode == 2 and "started by pytest-vllm-mem" in result.stderr


# ---------------------------------------------------------------- per-device startup lock

HOLD = textwrap.dedent("""
    import json, sys, time
    from pytest_vllm_mem.launch.devicelock import startup_lock
    from pytest_vllm_mem.memory import DeviceInfo
    device = DeviceInfo("cuda", "GPU", 1, int(sys.argv[1]), sys.argv[2])
    asked = time.time()
    with startup_lock([device], timeout_s=60) as waits:
        got = time.time()
        time.sleep(float(sys.argv[3]))
        done = time.time()
    print(json.dumps({"asked": asked, "got": got, "done": done, "waited": waits[0].waited_s,
                      "note": waits[0].note()}))
""")


def _holders(tmp_path: Path, devices: list[tuple[int, str]], hold_s: float) -> list[dict[str, Any]]:
    env = {**os.environ, devicelock.LOCK_DIR_VAR: str(tmp_path / "locks")}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", HOLD, str(index), uuid, str(hold_s)], env=env, stdout=subprocess.PIPE, text=True
        )
        for index, uuid in devices
    ]
    return [json.loads(proc.communicate(timeout=60)[0]) for proc in procs]


def test_two_startups_on_one_device_are_serialized_across_processes(tmp_path: Path) -> None:
    first, second = sorted(_holders(tmp_path, [(0, "GPU-aaaa"), (0, "GPU-aaaa")], 1.5), key=lambda r: r["got"])
    assert second["got"] >= first["done"]  # no overlap
    assert second["waited"] > 1.0 and "waited" in second["note"] and "pid" in second["note"]


def test_startups_on_different_devices_run_at_once(tmp_path: Path) -> None:
    first, second = _holders(tmp_path, [(0, "GPU-aaaa"), (1, "GPU-bbbb")], 1.5)
    assert first["got"] < second["done"] and second["got"] < first["done"]  # overlap


def test_a_killed_holder_frees_the_device_at_once(tmp_path: Path) -> None:
    env = {**os.environ, devicelock.LOCK_DIR_VAR: str(tmp_path / "locks")}
    holder = subprocess.Popen([sys.executable, "-c", HOLD, "0", "GPU-aaaa", "600"], env=env, stdout=subprocess.PIPE)
    try:
        lock = tmp_path / "locks" / "GPU-aaaa.holder"
        deadline = time.monotonic() + 30
        while not lock.exists():
            assert time.monotonic() < deadline
            time.sleep(0.05)
        holder.kill()
        holder.wait()
        os.environ[devicelock.LOCK_DIR_VAR] = str(tmp_path / "locks")
        started = time.monotonic()
        with devicelock.startup_lock([DeviceInfo("cuda", "GPU", 1, 0, "GPU-aaaa")], timeout_s=60) as waits:
            assert waits[0].locked
        assert time.monotonic() - started < 20  # taken from the dead holder at once, not after the 60 s timeout
    finally:
        os.environ.pop(devicelock.LOCK_DIR_VAR, None)
        reap(holder)


def test_a_lock_held_too_long_is_a_clear_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(devicelock.LOCK_DIR_VAR, str(tmp_path / "locks"))
    device = DeviceInfo("cuda", "GPU", 1, 3, None)
    # filelock's locks are per open file: a second one in this process waits as another process would
    with (
        devicelock.startup_lock([device], timeout_s=5),
        pytest.raises(devicelock.DeviceBusyError, match=r"gpu-index-3.*held by pid \d+"),
        devicelock.startup_lock([device], timeout_s=0.3),
    ):
        pass


def test_an_unusable_lock_folder_degrades_to_a_note(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv(devicelock.LOCK_DIR_VAR, str(blocker / "locks"))  # a folder under a file
    with devicelock.startup_lock([DeviceInfo("cuda", "H200", 1, 0, "GPU-a")], timeout_s=1) as waits:
        assert not waits[0].locked
    assert "not serialized" in devicelock.notes(waits)[0]


def test_device_keys() -> None:
    assert devicelock.device_key(DeviceInfo("cuda", "H200", 1, 0, "GPU-12ab/x")) == "GPU-12ab_x"
    assert devicelock.device_key(DeviceInfo("cuda", "H200", 1, 2, None, 1)) == "gpu-index-2-mig-1"
    assert devicelock.device_key(DeviceInfo("cpu", "Xeon", 1, None)).startswith("cpu-")
    # every device of a tensor-parallel server, each once, in one order
    devices = [DeviceInfo("cuda", "H200", 1, 1, "GPU-b"), DeviceInfo("cuda", "H200", 1, 0, "GPU-a")]
    os.environ[devicelock.LOCK_DIR_VAR] = str(Path(os.environ.get("TMPDIR", "/tmp")) / f"locks-{os.getpid()}")
    try:
        with devicelock.startup_lock([*devices, devices[0]], timeout_s=1) as waits:
            assert [wait.key for wait in waits] == ["GPU-a", "GPU-b"]
    finally:
        os.environ.pop(devicelock.LOCK_DIR_VAR, None)


def test_gpus_take_turns_by_default_cpus_when_asked_and_a_bad_switch_is_named(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(devicelock.LOCK_DIR_VAR, str(tmp_path / "locks"))
    cpu, gpu = DeviceInfo("cpu", "cpu", 1, None), DeviceInfo("cuda", "H200", 1, 0, "GPU-a")
    for switch, keys in [
        (None, ["GPU-a"]),
        ("auto", ["GPU-a"]),
        ("on", ["GPU-a", devicelock.device_key(cpu)]),
        ("off", []),
    ]:
        if switch is None:
            monkeypatch.delenv(devicelock.SWITCH_VAR, raising=False)
        else:
            monkeypatch.setenv(devicelock.SWITCH_VAR, switch)
        with devicelock.startup_lock([cpu, gpu], timeout_s=1) as waits:
            assert sorted(wait.key for wait in waits) == sorted(keys), switch
    monkeypatch.setenv(devicelock.SWITCH_VAR, "sometimes")
    with (
        pytest.raises(devicelock.DeviceLockError, match="PYTEST_VLLM_MEM_DEVICE_LOCK='sometimes'.*auto .*on .*off"),
        devicelock.startup_lock([gpu], timeout_s=1),
    ):
        pass


# A server stand-in holding a named semaphore as vLLM's processes do (multiprocessing's spawn context registers it
# with the session's resource tracker, which unlinks it once the processes it serves are gone).
SEMAPHORE_SERVER = textwrap.dedent("""
    import multiprocessing, sys, time
    lock = multiprocessing.get_context("spawn").Lock()
    print(lock._semlock.name, flush=True)
    time.sleep(600)
""")


def _semaphore_server() -> tuple[subprocess.Popen[bytes], Path, list[psutil.Process]]:
    server = subprocess.Popen([sys.executable, "-c", SEMAPHORE_SERVER], stdout=subprocess.PIPE, start_new_session=True)
    assert server.stdout is not None
    path = Path("/dev/shm", "sem." + server.stdout.readline().decode().strip().lstrip("/"))
    deadline = time.monotonic() + 30
    while not any(lifeline.is_resource_tracker(p) for p in lifeline.in_session(server.pid).values()):
        assert time.monotonic() < deadline, "the stand-in's resource tracker did not start"
        time.sleep(0.05)
    return server, path, list(lifeline.in_session(server.pid).values())


@linux_only
def test_a_group_sigkill_leaks_the_semaphore_and_kill_lets_the_resource_tracker_remove_it() -> None:
    # What server.stop and the watchdog did before: SIGKILL the whole group, the tracker with it.
    server, path, members = _semaphore_server()
    try:
        assert path.exists()
        os.killpg(server.pid, signal.SIGKILL)
        server.wait(timeout=10)
        psutil.wait_procs(members, timeout=10)
        assert path.exists(), "a killed tracker no longer leaks: the premise of lifeline.kill's order is gone"
    finally:
        kill_quietly([p.pid for p in members])
        reap(server)
        path.unlink(missing_ok=True)
    # lifeline.kill: the processes first, the tracker last; it removes the semaphore before it exits.
    server, path, members = _semaphore_server()
    try:
        assert path.exists() and len(members) == 2
        alive = lifeline.kill(members, grace_s=1.0)
        server.wait(timeout=10)
        assert alive == [] and running([p.pid for p in members]) == []
        assert not path.exists(), f"{path} left by the stand-in after lifeline.kill"
    finally:
        kill_quietly([p.pid for p in members])
        reap(server)
        path.unlink(missing_ok=True)


# A parent that never reaps: its child, once killed, stays a zombie until the parent exits (as a dead server's
# orphans do while a container's init is slow to reap them; this machine's reaps every ~2 s).
NEGLECTFUL_PARENT = textwrap.dedent("""
    import subprocess, sys, time
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    print(child.pid, flush=True)
    time.sleep(600)
""")


def test_kill_counts_a_zombie_as_gone_and_does_not_wait_for_its_reaping() -> None:
    parent = subprocess.Popen([sys.executable, "-c", NEGLECTFUL_PARENT], stdout=subprocess.PIPE, start_new_session=True)
    try:
        assert parent.stdout is not None
        child = psutil.Process(int(parent.stdout.readline()))
        started = time.monotonic()
        alive = lifeline.kill([child], grace_s=30.0)
        took = time.monotonic() - started
        assert alive == [] and child.status() == psutil.STATUS_ZOMBIE  # dead, still in the process table
        # psutil.wait_procs would have waited the whole 30 s grace and the 5 s after SIGKILL, and called it alive.
        assert took < 15.0, f"lifeline.kill took {took:.1f} s over a process that died at SIGTERM"
        assert lifeline.wait_gone([child], 0.0) == [] and not lifeline.is_alive(child)
        assert list(lifeline.in_session(parent.pid)) == [parent.pid]  # nor is it in its session any more
    finally:
        reap(parent)


# A starting server stand-in: it ignores SIGTERM (as a starting vLLM 0.32 API server does) and starts a process in
# its session when it gets one, as a startup spawns its engine and workers while it is being stopped.
LATE_SPAWNER = textwrap.dedent("""
    import signal, subprocess, sys, time
    signal.signal(signal.SIGTERM, lambda *_: subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"]))
    print("ready", flush=True)
    while True:
        time.sleep(600)
""")


def _late_spawner() -> tuple[subprocess.Popen[bytes], lifeline.Watched, list[psutil.Process]]:
    server = subprocess.Popen([sys.executable, "-c", LATE_SPAWNER], stdout=subprocess.PIPE, start_new_session=True)
    assert server.stdout is not None and server.stdout.readline() == b"ready\n"
    watched = lifeline.Watched(psutil.Process(server.pid))
    return server, watched, lifeline.note(watched)


@linux_only
def test_what_a_server_starts_while_it_is_being_stopped_is_killed_too() -> None:
    server, watched, members = _late_spawner()
    try:  # without a second look the late process survives: the premise
        assert [p.pid for p in members] == [server.pid]
        assert lifeline.kill(members, grace_s=1.0) == []
        server.wait(timeout=10)
        late = list(lifeline.in_session(server.pid).values())
        assert len(late) == 1, late
    finally:
        kill_quietly([server.pid] + [p.pid for p in lifeline.in_session(server.pid).values()])
        reap(server)
    server, watched, members = _late_spawner()
    try:  # the watchdog's way: the server's processes looked for again before the SIGKILL
        alive = lifeline.kill(members, grace_s=1.0, rescan=lambda: lifeline.note(watched))
        server.wait(timeout=10)
        assert alive == [] and lifeline.in_session(server.pid) == {}
        assert len(watched.members) == 2  # the server and the one it started during the grace
    finally:
        kill_quietly([server.pid] + [p.pid for p in lifeline.in_session(server.pid).values()])
        reap(server)
