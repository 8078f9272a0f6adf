from __future__ import annotations

import sys
from typing import Any

import pytest

from pytest_vllm_mem.config import VLLMConfig
from pytest_vllm_mem.plan.batch_defaults import BatchDefaults
from pytest_vllm_mem.plan.batch_rule import BatchRule
from pytest_vllm_mem.tiers import (
    Tier,
    TierError,
    device_skip_reason,
    emulate_tier,
    parse_tier,
    resolve_tier,
    tier_skip_reason,
)
from pytest_vllm_mem.units import GIB


def sized(text: str) -> Tier:
    """The tier of a size (parse_tier gives None only for `auto`)."""
    tier = parse_tier(text)
    assert tier is not None
    return tier


@pytest.mark.parametrize(
    ("text", "name", "size"),
    [
        ("8gb", "8gb", 8 * 10**9),
        ("24GB", "24gb", 24 * 10**9),
        (" 24 gb ", "24gb", 24 * 10**9),
        ("24GiB", "24gib", 24 * GIB),
        ("0.5gb", "0.5gb", 5 * 10**8),
        ("1.25gib", "1.25gib", round(1.25 * GIB)),
        ("141gb", "141gb", 141 * 10**9),
    ],
)
def test_parse_tier(text: str, name: str, size: int) -> None:
    tier = parse_tier(text)
    assert tier == Tier(name, size)
    assert str(tier) == name
    assert not tier.auto


@pytest.mark.parametrize("text", ["24.0gb", "024gb", "24 GB", "24Gb"])
def test_spellings_of_one_tier_share_its_name(text: str) -> None:
    # The name keys baseline entries: spellings must not split them.
    assert parse_tier(text) == Tier("24gb", 24 * 10**9)


@pytest.mark.parametrize("text", ["auto", "AUTO", " auto ", ""])
def test_auto_is_resolved_later(text: str) -> None:
    assert parse_tier(text) is None


@pytest.mark.parametrize("text", ["24", "24g", "big", "-8gb", "24tb", "0gb", "gb", "8 gb extra", "1e3gb"])
def test_malformed_tiers_name_the_accepted_forms(text: str) -> None:
    with pytest.raises(TierError) as excinfo:
        parse_tier(text)
    message = str(excinfo.value)
    assert f"--vllm-gpu={text!r}" in message
    for accepted in ("24gb", "gib", "auto", "10^9"):
        assert accepted in message
    # The deliberate choice: a bare number is refused (GB or GiB?), and the message says why.
    assert "bare number" in message


def test_error_names_its_source() -> None:
    with pytest.raises(TierError, match="@pytest.mark.vllm_tier on t.py::test_x='huge'"):
        parse_tier("huge", source="@pytest.mark.vllm_tier on t.py::test_x")


def test_resolve_tier() -> None:
    assert resolve_tier("24gb", 80 * 10**9) == Tier("24gb", 24 * 10**9)
    auto = resolve_tier("auto", 84_900_000_000)
    assert auto.auto and auto.bytes == 84_900_000_000
    assert auto.name == "auto"
    assert resolve_tier(None, 10**10).auto


def test_emulation_scales_utilization_by_tier_over_device() -> None:
    config = VLLMConfig("m", gpu_memory_utilization=0.9)
    launched, emulation = emulate_tier(config, sized("24gb"), 80 * 10**9, default_utilization=0.92)
    assert launched.flag("gpu_memory_utilization") == pytest.approx(0.27)
    assert emulation is not None
    assert emulation.utilization_before == 0.9
    assert emulation.utilization_after == pytest.approx(0.27)
    text = emulation.describe()
    assert "24gb" in text and "0.9 -> 0.2700" in text
    assert config.flag("gpu_memory_utilization") == 0.9  # the requested config is left alone


def test_emulation_uses_the_default_utilization_when_unset() -> None:
    config = VLLMConfig("m", max_model_len=64)
    launched, emulation = emulate_tier(config, sized("40gb"), 80 * 10**9, default_utilization=0.92)
    assert emulation is not None and emulation.utilization_before == 0.92
    assert launched.flag("gpu_memory_utilization") == pytest.approx(0.46)
    assert launched.flag("max_model_len") == 64


@pytest.mark.parametrize("device_bytes", [24 * 10**9, 20 * 10**9, int(24 * 10**9 * 1.005)])
def test_no_emulation_when_the_device_is_not_larger_than_the_tier(device_bytes: int) -> None:
    config = VLLMConfig("m")
    launched, emulation = emulate_tier(config, sized("24gb"), device_bytes, default_utilization=0.9)
    assert emulation is None
    assert launched is config


def test_emulation_just_above_the_threshold() -> None:
    _, emulation = emulate_tier(VLLMConfig("m"), sized("24gb"), int(24 * 10**9 * 1.01), 0.9)
    assert emulation is not None


def test_no_emulation_on_the_auto_tier() -> None:
    config = VLLMConfig("m")
    launched, emulation = emulate_tier(config, resolve_tier("auto", 80 * 10**9), 80 * 10**9, 0.9)
    assert emulation is None and launched is config


def test_tier_skip_reasons() -> None:
    tier8, tier16, tier24 = sized("8gb"), sized("16gb"), sized("24gb")
    reason = tier_skip_reason(tier8, tier24, None)
    assert reason is not None and "24gb" in reason and "8gb" in reason
    reason = tier_skip_reason(tier24, None, tier16)
    assert reason is not None and "16gb" in reason and "24gb" in reason
    assert tier_skip_reason(tier24, tier24, None) is None
    assert tier_skip_reason(tier16, tier8, tier24) is None
    assert tier_skip_reason(tier8, None, None) is None


def test_device_skip_reason() -> None:
    reason = device_skip_reason(sized("80gb"), "NVIDIA L4", 24_150_000_000)
    assert reason is not None
    assert "80gb" in reason and "NVIDIA L4" in reason and "larger than this device" in reason
    assert device_skip_reason(sized("24gb"), "NVIDIA L4", 24_150_000_000) is None


# --- issue 23 items 2 and 4: batch defaults and the user's units under emulation ---------------------------------

H200_CUDA_TOTAL = (143771 - 698) * 2**20  # NVML v1 143771 MiB, less the 698 MiB the driver reserves (CUDA's total)
B200_CUDA_TOTAL = 179 * GIB


def pair(defaults: BatchDefaults) -> tuple[int, int]:
    return defaults.max_num_batched_tokens, defaults.max_num_seqs


def vllm_rule() -> BatchRule:
    """The rule of the vLLM in .venv, read from its source: the figures the launch must match."""
    from pathlib import Path

    from pytest_vllm_mem.launch.flagcheck import vllm_package_dir
    from pytest_vllm_mem.plan.batch_rule import rule_from_source

    package = vllm_package_dir(sys.executable)
    assert package is not None
    rule = rule_from_source(Path(package, "engine", "arg_utils.py").read_text())
    assert rule is not None
    return rule


def as_batch_rule(rule: BatchRule, device_name: str) -> Any:
    def batch(device_bytes: int) -> tuple[int, int]:  # the card by name, a tier's card by size only (pool.py)
        return pair(rule.defaults(device_bytes, device_name if device_bytes > 150 * GIB else ""))

    return batch


def test_installed_vllms_rule_reads_as_its_source_says() -> None:
    # vllm 0.32 engine/arg_utils.py get_batch_defaults, OPENAI_API_SERVER entries: >= 160 GiB 16384/1024,
    # >= 70 GiB and not "a100" 8192/1024, else 2048/256.
    rule = vllm_rule()
    assert pair(rule.defaults(H200_CUDA_TOTAL, "NVIDIA H200")) == (8192, 1024)
    assert pair(rule.defaults(B200_CUDA_TOTAL, "NVIDIA B200")) == (16384, 1024)
    assert pair(rule.defaults(80 * GIB, "NVIDIA A100-SXM4-80GB")) == (2048, 256)
    assert pair(rule.defaults(sized("24gb").bytes)) == (2048, 256)


def test_emulating_24gb_on_an_h200_launches_a_24gb_cards_batch_defaults() -> None:
    tier = sized("24gb")
    assert tier is not None
    batch = as_batch_rule(vllm_rule(), "NVIDIA H200")
    launched, emulation = emulate_tier(VLLMConfig("m"), tier, H200_CUDA_TOTAL, 0.92, batch)
    assert emulation is not None
    assert (launched.flag("max_num_batched_tokens"), launched.flag("max_num_seqs")) == (2048, 256)
    assert "max_num_batched_tokens 2048, max_num_seqs 256" in emulation.describe()
    own, _ = emulate_tier(VLLMConfig("m", max_num_seqs=64), tier, H200_CUDA_TOTAL, 0.92, batch)
    assert (own.flag("max_num_batched_tokens"), own.flag("max_num_seqs")) == (2048, 64)  # the config's own stays
    throughput, _ = emulate_tier(VLLMConfig("m", performance_mode="throughput"), tier, H200_CUDA_TOTAL, 0.92, batch)
    assert throughput.flag("max_num_batched_tokens") == 4096  # vLLM doubles its defaults in throughput mode
    # 80gb on a B200: a >= 70 GiB card's 8192/1024, not the B200's 16384.
    big, _ = emulate_tier(VLLMConfig("m"), sized("80gb"), B200_CUDA_TOTAL, 0.92, as_batch_rule(vllm_rule(), "B200"))
    assert (big.flag("max_num_batched_tokens"), big.flag("max_num_seqs")) == (8192, 1024)


def test_advice_under_emulation_is_in_the_users_units_and_names_the_tier() -> None:
    # Issue 23 item 4: 0.92 on --vllm-gpu=24gb on an H200 was advised "gpu_memory_utilization 0.15 -> 0.13".
    from pytest_vllm_mem.diagnosis.advice import advise
    from pytest_vllm_mem.diagnosis.diagnose import StartupMemory

    tier = parse_tier("24gb")
    assert tier is not None
    asked = VLLMConfig("m", gpu_memory_utilization=0.92)
    launched, emulation = emulate_tier(asked, tier, H200_CUDA_TOTAL, 0.92)
    assert emulation is not None and launched.flag("gpu_memory_utilization") == 0.1472
    rungs = advise(None, launched, None, tier_bytes=tier.bytes, peak_bytes=24 * GIB, requested=asked)
    assert rungs[0].startswith("peak 24.00 GiB exceeds the 24gb tier by 1.65 GiB: gpu_memory_utilization 0.92 -> 0.")
    assert "launches it as 0.1472 -> " in rungs[0]
    unset = VLLMConfig("m")
    launched, _ = emulate_tier(unset, tier, H200_CUDA_TOTAL, 0.92)
    memory = StartupMemory(vllm_version="0.32.0")  # vLLM 0.32's default: 0.92
    rungs = advise(None, launched, memory, tier_bytes=tier.bytes, peak_bytes=24 * GIB, requested=unset)
    assert "gpu_memory_utilization default 0.92 -> 0." in rungs[0]


def test_a_24gb_card_still_runs_the_24gb_tier_when_cuda_sees_less() -> None:
    # An L4 "24GB" reports 23034 MiB (24.15e9 bytes) through NVML v1; CUDA's total leaves out what the driver
    # reserves (698 MiB on an H200; the L4's share is assumed here), which drops below 24e9. The tier is the label's
    # size: compared with the card's memory (DeviceInfo.card_bytes), never skipped for the driver's share.
    from pytest_vllm_mem.memory import DeviceInfo

    l4 = DeviceInfo("cuda", "NVIDIA L4", 23034 * 2**20 - 500 * 2**20, 0, reserved_bytes=500 * 2**20)
    tier = parse_tier("24gb")
    assert tier is not None and l4.total_bytes < tier.bytes
    assert device_skip_reason(tier, l4.name, l4.card_bytes) is None
