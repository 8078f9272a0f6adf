from __future__ import annotations

import pytest

from pytest_vllm_mem.config import VLLMConfig
from pytest_vllm_mem.tiers import (
    GIB,
    Tier,
    TierError,
    device_skip_reason,
    emulate_tier,
    parse_tier,
    resolve_tier,
    tier_skip_reason,
)


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
    launched, emulation = emulate_tier(config, parse_tier("24gb"), 80 * 10**9, default_utilization=0.92)
    assert launched.flag("gpu_memory_utilization") == pytest.approx(0.27)
    assert emulation is not None
    assert emulation.utilization_before == 0.9
    assert emulation.utilization_after == pytest.approx(0.27)
    text = emulation.describe()
    assert "24gb" in text and "0.9 -> 0.2700" in text
    assert config.flag("gpu_memory_utilization") == 0.9  # the requested config is left alone


def test_emulation_uses_the_default_utilization_when_unset() -> None:
    config = VLLMConfig("m", max_model_len=64)
    launched, emulation = emulate_tier(config, parse_tier("40gb"), 80 * 10**9, default_utilization=0.92)
    assert emulation is not None and emulation.utilization_before == 0.92
    assert launched.flag("gpu_memory_utilization") == pytest.approx(0.46)
    assert launched.flag("max_model_len") == 64


@pytest.mark.parametrize("device_bytes", [24 * 10**9, 20 * 10**9, int(24 * 10**9 * 1.005)])
def test_no_emulation_when_the_device_is_not_larger_than_the_tier(device_bytes: int) -> None:
    config = VLLMConfig("m")
    launched, emulation = emulate_tier(config, parse_tier("24gb"), device_bytes, default_utilization=0.9)
    assert emulation is None
    assert launched is config


def test_emulation_just_above_the_threshold() -> None:
    _, emulation = emulate_tier(VLLMConfig("m"), parse_tier("24gb"), int(24 * 10**9 * 1.01), 0.9)
    assert emulation is not None


def test_no_emulation_on_the_auto_tier() -> None:
    config = VLLMConfig("m")
    launched, emulation = emulate_tier(config, resolve_tier("auto", 80 * 10**9), 80 * 10**9, 0.9)
    assert emulation is None and launched is config


def test_tier_skip_reasons() -> None:
    tier8, tier16, tier24 = parse_tier("8gb"), parse_tier("16gb"), parse_tier("24gb")
    reason = tier_skip_reason(tier8, tier24, None)
    assert reason is not None and "24gb" in reason and "8gb" in reason
    reason = tier_skip_reason(tier24, None, tier16)
    assert reason is not None and "16gb" in reason and "24gb" in reason
    assert tier_skip_reason(tier24, tier24, None) is None
    assert tier_skip_reason(tier16, tier8, tier24) is None
    assert tier_skip_reason(tier8, None, None) is None


def test_device_skip_reason() -> None:
    reason = device_skip_reason(parse_tier("80gb"), "NVIDIA L4", 24_150_000_000)
    assert reason is not None
    assert "80gb" in reason and "NVIDIA L4" in reason and "larger than this device" in reason
    assert device_skip_reason(parse_tier("24gb"), "NVIDIA L4", 24_150_000_000) is None
