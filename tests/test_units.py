from __future__ import annotations

import pytest

from pytest_vllm_mem.units import UnitError, format_bytes, format_quantity, parse_duration_ms, parse_size


@pytest.mark.parametrize(
    "text, expected",
    [
        ("8gb", 8 * 10**9),
        ("8 GB", 8 * 10**9),
        ("24GiB", 24 * 2**30),
        ("256MiB", 256 * 2**20),
        ("512mb", 512 * 10**6),
        ("1.5GiB", 3 * 2**29),
        ("4KiB", 4096),
        ("1TB", 10**12),
        ("100B", 100),
        ("1048576", 2**20),
        (" 2tib ", 2 * 2**40),
    ],
)
def test_parse_size(text: str, expected: int) -> None:
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["", "8g", "8G", "-1GiB", "lots", "1,000", "5 GiBs", "GiB"])
def test_parse_size_errors(text: str) -> None:
    with pytest.raises(UnitError) as info:
        parse_size(text)
    assert repr(text) in str(info.value) and "GiB" in str(info.value) and "10^9" in str(info.value)


def test_parse_duration_ms() -> None:
    assert parse_duration_ms("50ms") == 50.0
    assert parse_duration_ms("1.5s") == 1500.0
    assert parse_duration_ms("500us") == 0.5
    assert parse_duration_ms("20") == 20.0
    with pytest.raises(UnitError, match="'5 min'"):
        parse_duration_ms("5 min")


def test_format_bytes() -> None:
    assert format_bytes(5.21 * 2**30) == "5.21 GiB"
    assert format_bytes(256 * 2**20) == "256.00 MiB"
    assert format_bytes(256 * 2**20, trim=True) == "256 MiB"
    assert format_bytes(512) == "512 B"
    assert format_bytes(-3 * 2**30) == "-3.00 GiB"
    assert format_bytes(3 * 2**40) == "3.00 TiB"


def test_format_quantity() -> None:
    assert format_quantity(1204.5, "tok/s") == "1,204.5 tok/s"
    assert format_quantity(108000, "tokens") == "108,000 tokens"
    assert format_quantity(50.0, "ms", trim=True) == "50 ms"
    assert format_quantity(2 * 2**30, "bytes") == "2.00 GiB"
