"""Every GPU of a server, on a fake NVML (tests/fake_nvml.py): the devices a session and a config use, the wait for
free memory on all of them, emulation on the smallest, and the tier gate on the fullest GPU."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from fake_nvml import FakeGpu, FakeMig, FakeNvml, gpu_uuid, gpus, mig_uuid

from pytest_vllm_mem import VLLMConfig, VLLMStartupError
from pytest_vllm_mem.baseline.results import TestRecord
from pytest_vllm_mem.launch import pool as state_module
from pytest_vllm_mem.launch.pool import ServerPool
from pytest_vllm_mem.launch.server import LaunchSettings
from pytest_vllm_mem.memory import DeviceError, detect_devices, make_probe
from pytest_vllm_mem.plugin.gate import tier_problem
from pytest_vllm_mem.plugin.state import SessionState
from pytest_vllm_mem.settings import Settings, UsageError
from pytest_vllm_mem.units import GIB


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> FakeNvml:
    """Four H100s, the third one in MIG mode with a 40 GiB slice; the session's NVML is this fake."""
    host = FakeNvml(gpus(4))
    host.gpus[2] = FakeGpu(
        gpu_uuid(2),
        name="NVIDIA A100-SXM4-80GB",
        mig_capable=True,
        mig_enabled=True,
        migs={0: FakeMig(mig_uuid(20), total=40 * GIB)},
    )
    monkeypatch.setattr(state_module, "detect_devices", lambda visible: detect_devices(visible, nvml=host))
    return host


def session(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, visible: str | None, tier: str = "auto") -> SessionState:
    if visible is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    return SessionState(Settings.from_values({"vllm_gpu": tier}, tmp_path))


def test_a_tensor_parallel_config_uses_the_first_visible_gpus(
    fake: FakeNvml, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    state = session(tmp_path, monkeypatch, "3,1,0")
    assert [device.index for device in state.devices] == [3, 1, 0]
    assert state.device.index == 3  # tier auto and the report name the first visible GPU
    assert [d.index for d in state.server_devices(VLLMConfig("m"))] == [3]
    assert [d.index for d in state.server_devices(VLLMConfig("m", tensor_parallel_size=2))] == [3, 1]
    assert [
        d.index for d in state.server_devices(VLLMConfig("m", tensor_parallel_size=2, pipeline_parallel_size=2))
    ] == [3, 1, 0]  # 3 visible
    # A config's own CUDA_VISIBLE_DEVICES decides for its server.
    own = VLLMConfig("m", env={"CUDA_VISIBLE_DEVICES": gpu_uuid(0)[:12]}, tensor_parallel_size=1)
    assert [d.uuid for d in state.server_devices(own)] == [gpu_uuid(0)]


def test_a_mig_slice_sizes_tier_auto_and_emulation(
    fake: FakeNvml, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    state = session(tmp_path, monkeypatch, mig_uuid(20))
    assert state.device.total_bytes == 40 * GIB and state.device.mig_index == 0
    assert state.tier.bytes == 40 * GIB  # auto: the slice, not the 80 GB card
    assert state.device_total_now(VLLMConfig("m")) == 40 * GIB


def test_emulation_uses_the_smallest_gpu_of_the_server(
    fake: FakeNvml, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake.gpus[1].total = 40 * GIB  # a mixed host: the server's second GPU is the small one
    state = session(tmp_path, monkeypatch, "0,1")
    assert state.device_total_now(VLLMConfig("m")) == 80 * GIB
    assert state.device_total_now(VLLMConfig("m", tensor_parallel_size=2)) == 40 * GIB


@pytest.mark.parametrize(
    "visible, message", [("7", "names GPU 7, but NVML sees 4"), ("GPU-nope", "matches no GPU UUID")]
)
def test_a_wrong_cuda_visible_devices_is_a_usage_error(
    fake: FakeNvml, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, visible: str, message: str
) -> None:
    state = session(tmp_path, monkeypatch, visible)
    with pytest.raises(UsageError, match=message):
        _ = state.device  # the property raises


def test_a_lost_gpu_at_session_start_is_a_usage_error_not_a_traceback(
    fake: FakeNvml, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake.gpus[0].lost = True
    state = session(tmp_path, monkeypatch, "0")
    with pytest.raises(UsageError, match="NVML could not open a handle of GPU 0: GPU is lost"):
        _ = state.device  # the property raises


def test_the_pool_waits_for_every_gpu_of_the_server(
    fake: FakeNvml, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # GPU 0 is free; on GPU 1 an earlier server is still exiting with 60 GiB: a TP=2 server must not start.
    fake.gpus[1].compute, fake.gpus[1].used = [(4242, 60 * GIB)], 61 * GIB
    fake.names[4242] = "VLLM::Worker"
    monkeypatch.setattr(state_module, "FREE_MEMORY_WAIT_S", 0.1)
    launched: list[dict[str, Any]] = []

    def fake_launch(*args: Any, **kwargs: Any) -> str:
        launched.append(kwargs)
        return "server"

    monkeypatch.setattr(state_module, "launch", fake_launch)
    visible = detect_devices("0,1", nvml=fake)
    probe = make_probe(visible, nvml=fake)
    pool = ServerPool(
        LaunchSettings(log_dir=tmp_path),
        probe,
        devices_for=lambda config: visible[: int(config.flag("tensor_parallel_size", 1))],
    )
    tp2 = VLLMConfig("m", tensor_parallel_size=2)
    with pytest.raises(VLLMStartupError) as error:
        pool.acquire(tp2, tp2, {"requested_bytes": int(0.9 * 80 * GIB)})
    assert error.value.kind == "insufficient_free_memory"
    assert "of GPU 1 (NVIDIA H100 80GB HBM3, the fullest of 2)" in str(error.value)
    assert "pid 4242 (VLLM::Worker) holds 60.00 GiB" in str(error.value)
    tp1 = VLLMConfig("m")
    started: object = pool.acquire(tp1, tp1, {"requested_bytes": int(0.9 * 80 * GIB)})
    assert started == "server"  # GPU 0 alone is free
    assert [d.index for d in launched[0]["devices"]] == [0]
    assert fake.refcount == 1  # the wait's own probes were closed; the pool's is still open
    probe.close()


def gpu_record(startup_per_gpu: list[int], load_per_gpu: list[int], tier_bytes: int = 24 * 10**9) -> TestRecord:
    return TestRecord(
        test_id="t::tp2",
        config="vllm serve m",
        launched="vllm serve m",
        tier="24gb",
        tier_bytes=tier_bytes,
        device="NVIDIA H100 80GB HBM3",
        backend="cuda",
        vllm_version="0.33.0",
        startup={"ok": True, "peak_memory_bytes": sum(startup_per_gpu), "peak_memory_per_gpu": startup_per_gpu},
        loads=[{"completed": 4, "peak_memory_bytes": sum(load_per_gpu), "peak_memory_per_gpu": load_per_gpu}],
    )


def test_the_tier_gate_judges_the_fullest_gpu_not_the_sum() -> None:
    # A TP=2 server: 42 GiB in all, 21 GiB on each card, on the 24gb tier: it fits.
    fits = gpu_record([20 * GIB, 19 * GIB], [21 * GIB, 21 * GIB])
    assert fits.peak_memory_bytes == 42 * GIB and fits.peak_memory_per_gpu == [21 * GIB, 21 * GIB]
    assert tier_problem(fits, tier_is_auto=False) is None
    over = gpu_record([20 * GIB, 23 * GIB], [21 * GIB, 22 * GIB])
    assert over.largest_gpu_peak_bytes == 23 * GIB
    problem = tier_problem(over, tier_is_auto=False)
    assert problem is not None and problem.startswith("peak memory 23.00 GiB on GPU 1 of 2 exceeds the 24gb tier")


def test_records_without_per_gpu_figures_keep_the_total() -> None:
    record = gpu_record([], [])
    record.startup["peak_memory_bytes"] = 25 * GIB
    assert record.peak_memory_per_gpu == [] and record.largest_gpu_peak_bytes == 25 * GIB
    assert tier_problem(record, tier_is_auto=False) is not None


def test_the_free_memory_wait_runs_under_the_devices_startup_lock(
    fake: FakeNvml, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Issue 23 item 5: the wait ran before the lock was taken, so another startup could take the memory between
    # the check and vLLM's own. While the wait runs, a second taker of GPU 0's lock must find it held.
    import filelock

    from pytest_vllm_mem.launch.devicelock import device_key

    monkeypatch.setenv("PYTEST_VLLM_MEM_LOCK_DIR", str(tmp_path / "locks"))
    visible = detect_devices("0", nvml=fake)
    seen: list[bool] = []

    def wait(probe: Any, *args: Any, **kwargs: Any) -> list[tuple[int, int, str]]:
        other = filelock.FileLock(str(tmp_path / "locks" / f"{device_key(visible[0])}.lock"))
        try:
            other.acquire(timeout=0)
            other.release()
            seen.append(False)
        except filelock.Timeout:
            seen.append(True)
        return []

    monkeypatch.setattr(state_module, "wait_for_free_memory", wait)
    monkeypatch.setattr(state_module, "launch", lambda *args, **kwargs: "server")
    probe = make_probe(visible, nvml=fake)
    pool = ServerPool(LaunchSettings(log_dir=tmp_path), probe, devices_for=lambda config: visible)
    config = VLLMConfig("m")
    server: object = pool.acquire(config, config, {"requested_bytes": 1})
    assert server == "server"
    assert seen == [True]
    probe.close()


def test_numeric_cuda_visible_devices_means_pci_order_on_a_mixed_host(monkeypatch: pytest.MonkeyPatch) -> None:
    # Issue 23 item 6: an L4 on bus 0 and an H100 on bus 1. CUDA's default order is fastest first (the H100 would
    # be CUDA 0); the plugin resolves "0" in NVML's PCI order, so it must launch servers with PCI_BUS_ID.
    from pytest_vllm_mem.launch.server import server_env

    host = FakeNvml([FakeGpu(gpu_uuid(0), name="NVIDIA L4", total=23034 * 2**20), FakeGpu(gpu_uuid(1))])
    assert [device.name for device in detect_devices("0", nvml=host)] == ["NVIDIA L4"]
    monkeypatch.delenv("CUDA_DEVICE_ORDER", raising=False)
    assert server_env(VLLMConfig("m"), LaunchSettings())["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
    monkeypatch.setenv("CUDA_DEVICE_ORDER", "FASTEST_FIRST")
    with pytest.raises(DeviceError, match="CUDA_DEVICE_ORDER=FASTEST_FIRST"):
        detect_devices("0", nvml=host)  # the plugin cannot know CUDA's speed ranking: refused, with the fix
    assert [d.name for d in detect_devices(gpu_uuid(0), nvml=host)] == ["NVIDIA L4"]  # UUIDs mean one GPU
    same = FakeNvml(gpus(2))
    assert [d.index for d in detect_devices("1", nvml=same)] == [1]  # one model: both orders agree


def test_the_gpu_check_dry_runs_against_the_fake_nvml_and_a_fake_libcuda(tmp_path: Path) -> None:
    # benchmarks/gpu_nvml_check.py --fake: every check of the GPU script runs (real child processes, real process
    # trees and sampler, NVML and libcuda faked); the GPU run itself needs a GPU host.
    import json
    import subprocess
    import sys

    script = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_nvml_check.py"
    out = tmp_path / "check.json"
    run = subprocess.run(
        [sys.executable, str(script), "--fake", "--vllm-python", "none", "--json", str(out), "--gib", "1"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    result = json.loads(out.read_text())
    names = [check["name"] for check in result["checks"]]
    assert names == [
        "totals",
        "allocation",
        "transient_100ms",
        "outside_process_not_counted",
        "wait_with_a_real_holder",
        "batch_defaults",
    ]
    assert all(check["ok"] for check in result["checks"]) and result["mode"] == "fake"
    assert {"driver", "nvml", "cuda_driver", "vllm"} <= result["versions"].keys()
    assert result["nvml_memory"] == "v2"
    batch = next(check for check in result["checks"] if check["name"] == "batch_defaults")["figures"]
    assert batch["24gb"]["launched"] == [2048, 256]  # an 80 GB card's 24gb tier: a 24 GB card's defaults
