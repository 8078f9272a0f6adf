"""Tests of one server config run together, so each config starts once; everything else keeps its place."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import pytest

from pytest_vllm_mem import VLLMConfig
from pytest_vllm_mem.plugin.ordering import DEFAULT_CONFIG, group_by_server_config, server_config_key

A, B = VLLMConfig("tiny", max_model_len=512), VLLMConfig("tiny", max_model_len=1024)


@dataclass
class CallSpec:
    params: dict[str, object]


@dataclass
class Item:
    name: str
    fixturenames: tuple[str, ...] = ("vllm_load", "vllm_server", "vllm_config")
    callspec: CallSpec | None = None
    extra: dict[str, object] = field(default_factory=dict)


def item(name: str, config: object = None, fixtures: tuple[str, ...] | None = None) -> Item:
    made = Item(name, callspec=CallSpec({"vllm_config": config}) if config is not None else None)
    if fixtures is not None:
        made.fixturenames = fixtures
    return made


def names(items: Sequence[Item]) -> list[str]:
    return [i.name for i in items]


def test_a_config_that_comes_back_moves_up_behind_its_first_test() -> None:
    items = [item("serves[A]", A), item("serves[B]", B), item("again[A]", A), item("plain", fixtures=("tmp_path",))]
    assert names(group_by_server_config(items)) == ["serves[A]", "again[A]", "serves[B]", "plain"]


def test_tests_without_a_known_config_keep_their_place() -> None:
    items = [
        item("plain1", fixtures=()),
        item("serves[A]", A),
        item("start", fixtures=("vllm_start",)),
        item("serves[B]", B),
        item("again[A]", A),
        item("plain2", fixtures=()),
    ]
    assert names(group_by_server_config(items)) == ["plain1", "serves[A]", "again[A]", "start", "serves[B]", "plain2"]


def test_default_config_tests_form_one_group() -> None:
    items = [item("default1"), item("serves[A]", A), item("default2", fixtures=("vllm_server",))]
    assert server_config_key(items[0]) == DEFAULT_CONFIG
    assert names(group_by_server_config(items)) == ["default1", "default2", "serves[A]"]


def test_equal_configs_built_separately_are_one_group() -> None:
    items = [
        item("x", VLLMConfig("tiny", max_model_len=512)),
        item("y", B),
        item("z", VLLMConfig("tiny", max_model_len=512)),
    ]
    assert names(group_by_server_config(items)) == ["x", "z", "y"]


def test_unhashable_indirect_params_still_group() -> None:
    items = [item("x", {"len": 1}), item("y", B), item("z", {"len": 1})]
    assert names(group_by_server_config(items)) == ["x", "z", "y"]


def test_already_grouped_order_is_unchanged() -> None:
    items = [item("a1", A), item("a2", A), item("b1", B), item("plain", fixtures=())]
    assert group_by_server_config(items) == items


SUITE = """
import pytest
from pytest_vllm_mem import VLLMConfig

A = VLLMConfig("tiny", max_model_len=512)
B = VLLMConfig("tiny", max_model_len=1024)

@pytest.mark.parametrize("vllm_config", [A, B], ids=["A", "B"])
def test_serves(vllm_load):
    pass

def test_plain():
    pass

@pytest.mark.parametrize("vllm_config", [A], ids=["A"])
def test_again(vllm_server):
    pass
"""


@pytest.mark.parametrize(
    "args, expected",
    [
        ((), ["test_serves[A]", "test_again[A]", "test_serves[B]", "test_plain"]),
        (("--vllm-keep-order",), ["test_serves[A]", "test_serves[B]", "test_plain", "test_again[A]"]),
    ],
    ids=["grouped", "keep-order"],
)
def test_collection_order(pytester: pytest.Pytester, args: tuple[str, ...], expected: list[str]) -> None:
    pytester.makepyfile(test_matrix=SUITE)
    result = pytester.runpytest("-p", "no:cacheprovider", "--collect-only", "-q", *args)
    assert result.ret == 0
    collected = [line.split("::", 1)[1] for line in result.stdout.lines if "::" in line]
    assert collected == expected
