from __future__ import annotations

import json
from typing import Any

import pytest

from pytest_vllm_mem.config import ConfigError, VLLMConfig, flag_name, is_secret_key


def example() -> VLLMConfig:
    return VLLMConfig("m", max_model_len=4096, enforce_eager=True, quantization=None, trust_remote_code=False)


def test_cli_args_keep_the_callers_order_and_drop_omitted_flags() -> None:
    assert example().cli_args() == ["--model", "m", "--max-model-len", "4096", "--enforce-eager"]


def test_str_is_the_exact_command_line() -> None:
    assert str(example()) == "vllm serve m --max-model-len 4096 --enforce-eager"


def test_flag_name_uses_dashes() -> None:
    assert flag_name("max_model_len") == "--max-model-len"
    assert flag_name("--max-model-len") == "--max-model-len"


def test_equality_and_hash_ignore_omitted_flags_and_order() -> None:
    other = VLLMConfig("m", enforce_eager=True, max_model_len=4096)
    assert example() == other
    assert hash(example()) == hash(other)
    assert len({example(), other}) == 1


def test_dashes_and_underscores_in_keywords_are_the_same_flag() -> None:
    dashed: dict[str, Any] = {"max-model-len": 4096}  # no identifier: only ** can pass it
    assert VLLMConfig("m", **dashed) == VLLMConfig("m", max_model_len=4096)


def test_same_command_is_the_same_config() -> None:
    assert VLLMConfig("m", max_model_len=4096) == VLLMConfig("m", max_model_len="4096")


def test_bare_flag_differs_from_a_value_of_one() -> None:
    # 1 == True in Python, but `--x 1` and `--x` are different command lines.
    assert VLLMConfig("m", seed=1) != VLLMConfig("m", seed=True)


@pytest.mark.parametrize(
    "other",
    [
        VLLMConfig("m2", max_model_len=4096, enforce_eager=True),
        VLLMConfig("m", max_model_len=2048, enforce_eager=True),
        VLLMConfig("m", max_model_len=4096),
        VLLMConfig("m", max_model_len=4096, enforce_eager=True, env={"A": "1"}),
    ],
)
def test_different_configs_are_not_equal(other: VLLMConfig) -> None:
    assert example() != other


def test_env_participates_in_identity() -> None:
    a = VLLMConfig("m", env={"VLLM_CPU_KVCACHE_SPACE": "1"})
    b = VLLMConfig("m", env={"VLLM_CPU_KVCACHE_SPACE": "2"})
    assert a != b
    assert a == VLLMConfig("m", env={"VLLM_CPU_KVCACHE_SPACE": 1})  # values become strings
    assert a.cli_args() == b.cli_args()


def test_secret_env_values_are_masked_in_str_and_repr() -> None:
    config = VLLMConfig("m", env={"HF_TOKEN": "abc", "OPENAI_API_KEY": "sk-xyz", "OTHER": "visible"})
    for text in (str(config), repr(config)):
        assert "abc" not in text and "sk-xyz" not in text
        assert "***" in text
        assert "visible" in text
    assert config.env["HF_TOKEN"] == "abc"  # the server still gets the real value


def test_secret_flag_values_are_masked_but_passed_to_the_server() -> None:
    config = VLLMConfig("m", api_key="sk-secret", hf_token="hf_abc", max_model_len=64)
    for text in (str(config), repr(config), config.short_id()):
        assert "sk-secret" not in text and "hf_abc" not in text
        assert "max-model-len" in text or "max_model_len" in text
    assert config.cli_args() == [
        "--model",
        "m",
        "--api-key",
        "sk-secret",
        "--hf-token",
        "hf_abc",
        "--max-model-len",
        "64",
    ]
    assert str(VLLMConfig("m", hf_token=True)) == "vllm serve m --hf-token"  # a bare flag hides nothing


@pytest.mark.parametrize(
    "key",
    ["HF_TOKEN", "OPENAI_API_KEY", "AWS_SECRET_ACCESS_KEY", "DB_PASSWORD", "NGROK_AUTHTOKEN", "api_key", "hf_token"],
)
def test_secret_names(key: str) -> None:
    assert is_secret_key(key)


@pytest.mark.parametrize(
    "key",
    [
        "TOKENIZERS_PARALLELISM",
        "max_num_batched_tokens",
        "ssl_keyfile",
        "VLLM_CPU_KVCACHE_SPACE",
        "CUDA_VISIBLE_DEVICES",
    ],
)
def test_ordinary_names_are_not_secret(key: str) -> None:
    assert not is_secret_key(key)


def test_list_values_become_repeated_arguments() -> None:
    config = VLLMConfig("m", served_model_name=["a", "b"], cudagraph_capture_sizes=(1, 2, 4))
    assert config.cli_args() == [
        "--model",
        "m",
        "--served-model-name",
        "a",
        "b",
        "--cudagraph-capture-sizes",
        "1",
        "2",
        "4",
    ]
    assert config.flag("cudagraph_capture_sizes") == ("1", "2", "4")


def test_dict_values_become_json() -> None:
    config = VLLMConfig("m", compilation_config={"level": 0, "cudagraph_mode": "NONE"})
    args = config.cli_args()
    assert args[2] == "--compilation-config"
    assert json.loads(args[3]) == {"level": 0, "cudagraph_mode": "NONE"}
    # Key order does not matter: the JSON is sorted.
    assert config == VLLMConfig("m", compilation_config={"cudagraph_mode": "NONE", "level": 0})


@pytest.mark.parametrize("value", [object(), {1, 2}, b"bytes"])
def test_unusable_values_raise_config_error_naming_the_flag(value: object) -> None:
    with pytest.raises(ConfigError, match="max_model_len") as excinfo:
        VLLMConfig("m", max_model_len=value)
    assert "Accepted" in str(excinfo.value)


def test_empty_list_is_refused() -> None:
    with pytest.raises(ConfigError, match="served_model_name"):
        VLLMConfig("m", served_model_name=[])


@pytest.mark.parametrize("key", ["host", "port", "--port", "--model"])
def test_plugin_owned_keywords_are_refused(key: str) -> None:
    with pytest.raises(ConfigError, match=f"{key}=.*set by the plugin"):
        owned: dict[str, Any] = {key: "x"}
        VLLMConfig("m", **owned)


def test_model_keyword_is_refused() -> None:
    with pytest.raises(TypeError, match="model"):
        VLLMConfig("m", model="other")  # type: ignore[misc]


@pytest.mark.parametrize("model", ["", "   ", None, 3])
def test_model_must_be_a_non_empty_string(model: object) -> None:
    with pytest.raises(ConfigError, match="model"):
        VLLMConfig(model)  # type: ignore[arg-type]


def test_with_flags_changes_adds_and_removes() -> None:
    base = example()
    changed = base.with_flags(max_model_len=2048, gpu_memory_utilization=0.5)
    assert changed.cli_args() == [
        "--model",
        "m",
        "--max-model-len",
        "2048",
        "--enforce-eager",
        "--gpu-memory-utilization",
        "0.5",
    ]
    removed = base.with_flags(max_model_len=None)
    assert removed == VLLMConfig("m", enforce_eager=True)
    assert removed.flag("max_model_len") is None
    assert base.with_flags(**{"max-model-len": None}) == removed
    assert base.cli_args() == ["--model", "m", "--max-model-len", "4096", "--enforce-eager"]  # unchanged


def test_with_env_keeps_flags() -> None:
    config = example().with_env(A="1")
    assert config.env == {"A": "1"}
    assert config.cli_args() == example().cli_args()


def test_flag_lookup() -> None:
    config = example()
    assert config.flag("max_model_len") == 4096
    assert config.flag("max-model-len") == 4096
    assert config.flag("trust_remote_code", "unset") == "unset"
    assert config.flag("gpu_memory_utilization", 0.9) == 0.9


def test_configs_are_immutable() -> None:
    config = example()
    with pytest.raises(AttributeError):
        config.model = "other"  # type: ignore[misc]
    with pytest.raises(AttributeError):
        config.extra = 1  # type: ignore[attr-defined]


def test_short_id() -> None:
    assert example().short_id() == "max-model-len=4096 enforce-eager"
    assert VLLMConfig("m").short_id() == "defaults"
    assert VLLMConfig("m", served_model_name=["a", "b"]).short_id() == "served-model-name=a,b"


def test_usable_as_parametrize_value_with_ids(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        """
        import pytest
        from pytest_vllm_mem.config import VLLMConfig

        CONFIGS = [VLLMConfig("m", max_model_len=64), VLLMConfig("m", max_model_len=128, enforce_eager=True)]

        @pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: c.short_id())
        def test_ids(cfg):
            assert isinstance(cfg, VLLMConfig)

        @pytest.mark.parametrize("cfg", CONFIGS, ids=str)
        def test_str_ids(cfg):
            pass
        """
    )
    result = pytester.runpytest("-v", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=4)
    result.stdout.fnmatch_lines(
        [
            "*test_ids?max-model-len=64? PASSED*",
            "*test_ids?max-model-len=128 enforce-eager? PASSED*",
            "*test_str_ids?vllm serve m --max-model-len 64? PASSED*",
        ]
    )


def test_fields_are_declared_for_type_checkers_and_copies_round_trip() -> None:
    import copy
    import dataclasses
    import pickle

    assert [f.name for f in dataclasses.fields(VLLMConfig)][:3] == ["model", "flags", "env"]
    config = VLLMConfig("m", env={"HF_TOKEN": "abc"}, max_model_len=64, served_model_name=["a"])
    for clone in (pickle.loads(pickle.dumps(config)), copy.deepcopy(config)):
        assert clone == config and hash(clone) == hash(config)
        assert clone.cli_args() == config.cli_args() and clone.env == {"HF_TOKEN": "abc"}
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.flags = {}  # type: ignore[misc]
