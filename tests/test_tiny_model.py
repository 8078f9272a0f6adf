from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest

from pytest_vllm_mem import tiny_model
from pytest_vllm_mem.tiny_model import (
    MODEL_FILES,
    STAMP_FILE,
    TinyModelError,
    build_tiny_model,
    is_complete_tiny_model,
    main,
)


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


def _safetensors_header(path: Path) -> dict[str, Any]:
    raw = path.read_bytes()
    length = int.from_bytes(raw[:8], "little")
    assert (8 + length) % 8 == 0
    header: dict[str, Any] = json.loads(raw[8 : 8 + length])
    data_len = len(raw) - 8 - length
    assert max(info["data_offsets"][1] for name, info in header.items() if name != "__metadata__") == data_len
    return header


def test_builds_every_file(built: Path) -> None:
    assert built.is_absolute()
    for name in MODEL_FILES:
        assert (built / name).is_file(), name
    assert is_complete_tiny_model(built)
    # No staging or trash folders left next to the model.
    assert [p.name for p in built.parent.iterdir()] == ["model"]


def test_second_build_is_a_fast_no_op(built: Path) -> None:
    before = {name: (built / name).stat().st_mtime_ns for name in MODEL_FILES}
    assert build_tiny_model(built) == built  # no file rewritten (below): the no-op, whatever the machine's speed
    assert {name: (built / name).stat().st_mtime_ns for name in MODEL_FILES} == before


def test_config_fields(built: Path) -> None:
    config = json.loads((built / "config.json").read_text())
    tokenizer = json.loads((built / "tokenizer.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["model_type"] == "llama"
    assert (config["hidden_size"], config["num_attention_heads"], config["num_key_value_heads"]) == (256, 4, 2)
    assert (config["num_hidden_layers"], config["head_dim"], config["intermediate_size"]) == (2, 64, 512)
    assert config["max_position_embeddings"] == tiny_model.DEFAULT_MAX_POSITION_EMBEDDINGS >= 8192
    assert config["torch_dtype"] == "bfloat16"
    assert 2000 <= config["vocab_size"] <= 4000
    assert config["vocab_size"] == len(tokenizer["model"]["vocab"]) + len(
        [t for t in tokenizer["added_tokens"] if t["content"] not in tokenizer["model"]["vocab"]]
    )
    generation = json.loads((built / "generation_config.json").read_text())
    assert generation["eos_token_id"] == config["eos_token_id"]


def test_weights_are_bf16_with_llama_names_and_shapes(built: Path) -> None:
    config = json.loads((built / "config.json").read_text())
    header = _safetensors_header(built / "model.safetensors")
    vocab = config["vocab_size"]
    assert header["model.embed_tokens.weight"]["shape"] == [vocab, 256]
    assert header["lm_head.weight"]["shape"] == [vocab, 256]
    assert header["model.layers.1.self_attn.q_proj.weight"]["shape"] == [256, 256]
    assert header["model.layers.1.self_attn.k_proj.weight"]["shape"] == [128, 256]
    assert header["model.layers.0.mlp.down_proj.weight"]["shape"] == [256, 512]
    assert header["model.norm.weight"]["shape"] == [256]
    assert {info["dtype"] for name, info in header.items() if name != "__metadata__"} == {"BF16"}
    assert len(header) - 1 == 2 + 1 + 2 * 9


def test_bf16_weights_match_torch_rounding(built: Path) -> None:
    torch = pytest.importorskip("torch")
    safetensors_torch = pytest.importorskip("safetensors.torch")
    import numpy as np

    tensors = safetensors_torch.load_file(str(built / "model.safetensors"))
    embed = tensors["model.embed_tokens.weight"]
    assert embed.dtype == torch.bfloat16
    expected = np.random.default_rng(0).standard_normal(tuple(embed.shape), dtype=np.float32) * np.float32(0.02)
    assert torch.equal(torch.from_numpy(expected).to(torch.bfloat16), embed)
    assert torch.equal(tensors["model.norm.weight"], torch.ones(256, dtype=torch.bfloat16))


def test_float32_dtype_uses_safetensors_numpy(tmp_path: Path) -> None:
    from safetensors.numpy import load_file

    path = build_tiny_model(tmp_path / "fp32", dtype="float32", max_position_embeddings=4096)
    assert json.loads((path / "config.json").read_text())["torch_dtype"] == "float32"
    tensors = load_file(str(path / "model.safetensors"))
    assert str(tensors["model.layers.0.mlp.up_proj.weight"].dtype) == "float32"
    assert abs(float(tensors["model.layers.0.mlp.up_proj.weight"].std()) - 0.02) < 0.002


def test_tokenizer_round_trips_text(built: Path) -> None:
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(built / "tokenizer.json"))
    for text in (
        "Hello, world!",
        "The memory server streams 12345 tokens.",
        "  spaces\tand\nnewlines ",
        "Ünïcødé 漢字 🙂",
    ):
        ids = tokenizer.encode(text).ids
        assert tokenizer.decode(ids) == text
    common = tokenizer.encode("the memory server").ids
    assert len(common) <= 4  # trained merges, not raw bytes
    assert tokenizer.token_to_id("<s>") is not None and tokenizer.token_to_id("</s>") is not None


def test_build_is_deterministic(built: Path, tmp_path: Path) -> None:
    again = build_tiny_model(tmp_path / "again")
    for name in ("model.safetensors", "tokenizer.json", "config.json"):
        assert (again / name).read_bytes() == (built / name).read_bytes(), name


def test_changed_parameters_rebuild_in_place(tmp_path: Path) -> None:
    path = build_tiny_model(tmp_path / "m", max_position_embeddings=4096)
    assert json.loads((path / "config.json").read_text())["max_position_embeddings"] == 4096
    build_tiny_model(path, max_position_embeddings=8192)
    assert json.loads((path / "config.json").read_text())["max_position_embeddings"] == 8192
    assert not is_complete_tiny_model(path, tiny_model.TinyModelSpec(max_position_embeddings=4096))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m"]


def test_force_rebuilds(tmp_path: Path) -> None:
    path = build_tiny_model(tmp_path / "m", max_position_embeddings=4096)
    stamp_before = (path / STAMP_FILE).stat().st_mtime_ns
    time.sleep(0.01)
    build_tiny_model(path, max_position_embeddings=4096, force=True)
    assert (path / STAMP_FILE).stat().st_mtime_ns != stamp_before


def test_builds_into_an_existing_empty_folder(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    assert is_complete_tiny_model(
        build_tiny_model(tmp_path / "empty", max_position_embeddings=4096),
        tiny_model.TinyModelSpec(max_position_embeddings=4096),
    )


def test_refuses_a_foreign_folder(tmp_path: Path) -> None:
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    with pytest.raises(TinyModelError, match="will not overwrite"):
        build_tiny_model(tmp_path / "mine")
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep me"


def test_interrupted_build_leaves_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def explode(*args: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(tiny_model, "_write_weights", explode)
    with pytest.raises(KeyboardInterrupt):
        build_tiny_model(tmp_path / "m")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    "kwargs",
    [{"max_position_embeddings": 64}, {"max_position_embeddings": "4096"}, {"seed": -1}, {"dtype": "float16"}],
)
def test_bad_parameters_are_rejected(tmp_path: Path, kwargs: dict[str, Any]) -> None:
    with pytest.raises(TinyModelError, match="build_tiny_model"):
        build_tiny_model(tmp_path / "m", **kwargs)


def test_command_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main([str(tmp_path / "cli"), "--max-position-embeddings", "4096"]) == 0
    assert capsys.readouterr().out.strip() == str(tmp_path / "cli")
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "x").write_text("")
    assert main([str(tmp_path / "other")]) == 2
    assert "will not overwrite" in capsys.readouterr().err


def test_loads_in_transformers(built: Path) -> None:
    transformers = pytest.importorskip("transformers")

    config = transformers.AutoConfig.from_pretrained(built)
    assert config.model_type == "llama" and config.num_key_value_heads == 2
    tokenizer = transformers.AutoTokenizer.from_pretrained(built)
    assert tokenizer.bos_token == "<s>" and tokenizer.eos_token == "</s>"
    assert len(tokenizer) == config.vocab_size
    text = "The memory server streams 12345 tokens."
    assert tokenizer.decode(tokenizer.encode(text)) == text
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert prompt.endswith("<|assistant|>\n")
