"""The vllm_load fixture's arguments: one LoadSpec (the load's fields and their defaults) plus its own `repeat`."""

from __future__ import annotations

import ast
import json
from dataclasses import fields
from pathlib import Path

import pytest

from pytest_vllm_mem.load.client import LoadSpec, LoadSpecError
from pytest_vllm_mem.plan.known_models import KNOWN_CONFIGS
from pytest_vllm_mem.plugin.fixtures import load_arguments, vllm_load

LLAMA2_7B = KNOWN_CONFIGS["meta-llama/Llama-2-7b-hf"]


def documented_defaults() -> dict[str, object]:
    """The `load(name=default, ...)` signature at the head of vllm_load's docstring, as values."""
    doc = vllm_load.__doc__ or ""
    signature = doc[doc.index("load(") + len("load(") : doc.index(") -> LoadResult")]
    pairs = (part.split("=") for part in " ".join(signature.split()).split(","))
    return {name.strip(): ast.literal_eval(value.strip()) for name, value in pairs}


def test_the_docstring_lists_the_specs_fields_and_defaults() -> None:
    documented = documented_defaults()
    assert documented.pop("repeat") == 1
    assert list(documented) == list(LoadSpec.names())  # every field, in the dataclass's order
    assert documented == {field.name: field.default for field in fields(LoadSpec)}


def test_arguments_become_one_spec_and_the_repeat_count() -> None:
    assert load_arguments({}) == (LoadSpec(), 1)
    spec, repeat = load_arguments({"num_prompts": 8, "request_rate": 2, "repeat": 3})
    assert spec == LoadSpec(num_prompts=8, request_rate=2.0) and repeat == 3


@pytest.mark.parametrize(
    "arguments, fragment",
    [
        ({"repeat": 0}, "repeat=0 must be an integer >= 1"),
        ({"repeat": "3"}, "repeat='3' must be an integer >= 1"),
        ({"num_prompts": -2}, "num_prompts=-2 must be an integer >= 1"),
        ({"request_rate": "fast"}, "request_rate='fast' must be a positive number of requests/s, or None"),
        ({"timeout": 30}, "timeout=30 is not an argument of vllm_load() (accepted: num_prompts, "),
    ],
)
def test_bad_arguments_are_one_paragraph_naming_the_input(arguments: dict[str, object], fragment: str) -> None:
    with pytest.raises(LoadSpecError) as error:
        load_arguments(arguments)
    message = str(error.value)
    assert message.startswith("vllm_load() got unusable arguments: ") and "\n" not in message
    assert fragment in message


def test_an_unknown_argument_lists_every_accepted_one() -> None:
    with pytest.raises(LoadSpecError) as error:
        load_arguments({"max_token": 8, "repeats": 2})
    message = str(error.value)
    assert "max_token=8, repeats=2 are not arguments of vllm_load()" in message
    assert message.endswith(f"(accepted: {', '.join(LoadSpec.names())}, repeat).")


SUITE = """
import pytest
from pytest_vllm_mem import VLLMConfig

FITS = VLLMConfig({model!r}, gpu_memory_utilization=0.8, max_model_len=2048)


@pytest.mark.vllm_tier("24gb")
@pytest.mark.parametrize("vllm_config", [FITS], ids=["fits"])
def test_planned(vllm_server, vllm_load):
    result = vllm_load(num_prompts=5, concurrency=2, request_rate=float("inf"), repeat=2)
    assert result.completed == 5 and result.concurrency == 2 and result.request_rate is None


@pytest.mark.vllm_tier("24gb")
@pytest.mark.parametrize("vllm_config", [FITS], ids=["fits"])
def test_misspelt(vllm_server, vllm_load):
    vllm_load(num_prompt=5, repeat=0)
"""


def test_preflight_checks_the_arguments_as_a_measured_load_does(pytester: pytest.Pytester, tmp_path: Path) -> None:
    model = tmp_path / "llama-2-7b"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(LLAMA2_7B))
    pytester.makepyfile(test_inner=SUITE.format(model=str(model)))
    run = pytester.runpytest("-p", "no:cacheprovider", "--vllm-preflight")
    run.assert_outcomes(passed=1, failed=1)
    text = run.stdout.str()
    expected = (
        "vllm_load() got unusable arguments: repeat=0 must be an integer >= 1 (the load runs that often; the median "
        "run is returned); num_prompt=5 is not an argument of vllm_load() (accepted: num_prompts, concurrency, "
        "max_tokens, prompt_len, ignore_eos, request_rate, timeout_s, request_timeout_s, repeat)."
    )
    assert expected in text.splitlines()  # the message alone, on one line
    assert "Traceback" not in text and "LoadSpec.of(" not in text
