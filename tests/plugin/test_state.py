"""Session state and server pool logic that needs no server: leftover memory on the device, model overrides."""

from __future__ import annotations

from collections.abc import Collection, Sequence
from pathlib import Path

import pytest

from pytest_vllm_mem import VLLMConfig, VLLMStartupError
from pytest_vllm_mem.launch import pool as state_module
from pytest_vllm_mem.launch.pool import ServerPool
from pytest_vllm_mem.launch.server import LaunchSettings
from pytest_vllm_mem.memory import DeviceInfo

GIB = 2**30


class HeldDeviceProbe:
    """A GPU on which another process (an earlier server still exiting) holds 60 GiB of 80."""

    device = DeviceInfo(backend="cuda", name="NVIDIA H100 80GB HBM3", total_bytes=80 * GIB, index=0)
    devices = (device,)
    default_period_s = 0.05
    attribution_notes: tuple[str, ...] = ()

    def read(self, pids: Collection[int]) -> tuple[int, ...]:
        return (0,)

    def used_bytes(self, pids: Collection[int]) -> int:
        return 0

    def other_holders(self, exclude_pids: Collection[int]) -> list[tuple[int, int, str]]:
        return [(4242, 60 * GIB, "VLLM::Worker")]

    def device_used_bytes(self) -> int:
        return 60 * GIB

    def free_bytes(self) -> tuple[int, ...]:
        return (20 * GIB,)

    def scoped(self, devices: Sequence[DeviceInfo]) -> HeldDeviceProbe:
        return self

    def close(self) -> None:
        pass


def test_memory_held_by_another_process_fails_before_launch(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(state_module, "FREE_MEMORY_WAIT_S", 0.2)
    launched = []
    monkeypatch.setattr(state_module, "launch", lambda *args, **kwargs: launched.append(args))
    pool = ServerPool(LaunchSettings(log_dir=tmp_path), HeldDeviceProbe())
    config = VLLMConfig("m", gpu_memory_utilization=0.9)
    with pytest.raises(VLLMStartupError) as error:
        pool.acquire(config, config, {"requested_bytes": int(0.9 * 80 * GIB), "tier_bytes": 80 * 10**9})
    assert error.value.kind == "insufficient_free_memory"
    message = str(error.value)
    assert "pid 4242 (VLLM::Worker) holds 60.00 GiB" in message
    assert "20.00 GiB free, the server needs 72.00 GiB" in message
    assert "next step:" in message
    assert launched == []  # vLLM was never started into a device it could not have


def test_a_startup_error_keeps_the_requested_and_the_launched_config(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # As on VLLMServer: .config is what the test asked for, .launched what would have run (tier emulation).
    monkeypatch.setattr(state_module, "FREE_MEMORY_WAIT_S", 0.2)
    pool = ServerPool(LaunchSettings(log_dir=tmp_path), HeldDeviceProbe())
    requested = VLLMConfig("m")
    launched = VLLMConfig("m", gpu_memory_utilization=0.9)
    with pytest.raises(VLLMStartupError) as error:
        pool.acquire(requested, launched, {"requested_bytes": int(0.9 * 80 * GIB)})
    assert error.value.config == requested and error.value.launched == launched
    assert "command: vllm serve m --gpu-memory-utilization 0.9" in str(error.value)  # the command that ran


def test_session_state_declares_its_attributes_and_knows_nothing_before_a_server(tmp_path: Path) -> None:
    from pytest_vllm_mem.plugin.state import SessionState
    from pytest_vllm_mem.settings import Settings

    state = SessionState(Settings.from_values({"vllm_model_override": "other/model"}, tmp_path))
    # The gate, the report writer and the records are the plugin session's, built with the state in one go: the state
    # names none of them (nothing attaches attributes from outside).
    from pytest_vllm_mem.plugin.session import PluginSession

    assert {"state", "gate", "report", "records"} <= set(PluginSession.__dataclass_fields__)
    assert not {"gate", "report", "collector"} & set(vars(state))
    assert state.records == {} and state.servers == {} and state.leaked == [] and state.unwarned == []
    # What the report reads: public, and None until a test needed the device or vLLM's flag table.
    assert state.known_device is None and state.known_vllm_version is None
    assert state.default_config() == VLLMConfig("tiny")
