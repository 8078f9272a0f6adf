"""A random-weight Llama-style model that vLLM can serve on a CPU, built offline in about a second.

`build_tiny_model(path)` writes a complete Hugging Face model folder (config, safetensors weights, byte-level BPE
tokenizer) so that tests and the example suite can start real vLLM servers without downloading anything.
Command line: `python -m pytest_vllm_mem.tiny_model DIR [--max-position-embeddings N] [--seed S] [--force]`.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import shutil
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

# Bump when the files written change in a way a stamp from an older build must not match.
_FORMAT_VERSION = 1
STAMP_FILE = "tiny_model_stamp.json"
MODEL_FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    STAMP_FILE,
)
BOS_TOKEN = "<s>"
EOS_TOKEN = "</s>"
PAD_TOKEN = "<pad>"
# A plain role-tagged template, so /v1/chat/completions works too.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}<|{{ message['role'] }}|>\n{{ message['content'] }}"
    "{{ eos_token }}\n{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
# 32768 lets one model serve every max_model_len the suites use, including a max_model_len larger than a small KV
# cache can hold (the kv_cache_insufficient test); rotary embeddings make the size cost nothing in the weights.
DEFAULT_MAX_POSITION_EMBEDDINGS = 32768
# vLLM on x86 CPUs serves float32 checkpoints as bfloat16 anyway ("Downcasting torch.float32 to torch.bfloat16"),
# so bfloat16 weights avoid its per-weight dtype warnings; bfloat16 also halves the KV bytes per token.
DEFAULT_DTYPE = "bfloat16"
DTYPES = ("bfloat16", "float32")


class TinyModelError(ValueError):
    """build_tiny_model was given a path or parameter it cannot build into."""


@dataclass(frozen=True)
class TinyModelSpec:
    """Everything that decides the files written; its hash is the stamp."""

    max_position_embeddings: int = DEFAULT_MAX_POSITION_EMBEDDINGS
    seed: int = 0
    hidden_size: int = 256
    intermediate_size: int = 512
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    # vLLM's CPU attention kernel supports head_dim 64 here; 16 crashes at the first request.
    head_dim: int = 64
    target_vocab_size: int = 3072
    torch_dtype: str = "bfloat16"
    format_version: int = _FORMAT_VERSION

    def digest(self) -> str:
        text = json.dumps(asdict(self), sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:16]


def build_tiny_model(
    path: Path,
    *,
    max_position_embeddings: int = DEFAULT_MAX_POSITION_EMBEDDINGS,
    seed: int = 0,
    dtype: str = DEFAULT_DTYPE,
    force: bool = False,
) -> Path:
    """Build the tiny model into `path` and return it (absolute).

    Returns at once when `path` already holds a complete model built with the same parameters (unless `force`).
    The files are written to a temporary sibling folder and renamed into place, so an interrupted build never
    leaves a half model. A folder that holds something other than a tiny model is never overwritten.
    """
    path = Path(path).expanduser().absolute()
    spec = _validated_spec(max_position_embeddings, seed, dtype)
    if not force and is_complete_tiny_model(path, spec):
        return path
    _refuse_foreign_folder(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{path.name}.building-", dir=path.parent))
    try:
        _write_model(staging, spec)
        _make_readable(staging)
        # A concurrent builder (e.g. another xdist worker) may have finished first: keep its model.
        if not force and is_complete_tiny_model(path, spec):
            return path
        _swap_into_place(staging, path)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return path


def is_complete_tiny_model(path: Path, spec: TinyModelSpec | None = None) -> bool:
    """True when `path` holds every model file and a stamp matching `spec` (default parameters if None)."""
    spec = spec or TinyModelSpec()
    stamp = _read_stamp(Path(path))
    if stamp is None or stamp.get("digest") != spec.digest():
        return False
    return all((Path(path) / name).is_file() for name in MODEL_FILES)


def _validated_spec(max_position_embeddings: int, seed: int, dtype: str) -> TinyModelSpec:
    if isinstance(max_position_embeddings, bool) or not isinstance(max_position_embeddings, int):
        raise TinyModelError(
            f"build_tiny_model max_position_embeddings={max_position_embeddings!r} is not usable: pass an int "
            "between 128 and 1048576 (the longest --max-model-len the model must accept)."
        )
    if not 128 <= max_position_embeddings <= 1_048_576:
        raise TinyModelError(
            f"build_tiny_model max_position_embeddings={max_position_embeddings} is out of range: pass an int "
            "between 128 and 1048576 (the longest --max-model-len the model must accept)."
        )
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise TinyModelError(
            f"build_tiny_model seed={seed!r} is not usable: pass a non-negative int (it seeds the random weights)."
        )
    if dtype not in DTYPES:
        raise TinyModelError(
            f"build_tiny_model dtype={dtype!r} is not usable: pass one of {', '.join(map(repr, DTYPES))} "
            "(the torch_dtype written to config.json and the dtype of the stored weights)."
        )
    return TinyModelSpec(max_position_embeddings=max_position_embeddings, seed=seed, torch_dtype=dtype)


def _read_stamp(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads((path / STAMP_FILE).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _refuse_foreign_folder(path: Path) -> None:
    if path.exists() and not path.is_dir():
        raise TinyModelError(
            f"build_tiny_model cannot build into {path}: it is a file. Pass a folder path that is missing, "
            "empty, or holds an earlier tiny model."
        )
    if path.is_dir() and any(path.iterdir()) and _read_stamp(path) is None:
        raise TinyModelError(
            f"build_tiny_model will not overwrite {path}: it is not empty and holds no {STAMP_FILE}, so it is "
            "not a tiny model built here. Pass a folder path that is missing, empty, or holds an earlier tiny model."
        )


def _make_readable(folder: Path) -> None:
    """mkdtemp and safetensors create owner-only modes; give the usual umask-based modes instead."""
    umask = os.umask(0)
    os.umask(umask)
    folder.chmod(0o777 & ~umask)
    for child in folder.iterdir():
        child.chmod(0o666 & ~umask)


def _swap_into_place(staging: Path, path: Path) -> None:
    """Rename `staging` to `path`, moving an old model aside first so `path` is never half written."""
    trash = None
    if path.exists():
        trash = Path(tempfile.mkdtemp(prefix=f".{path.name}.old-", dir=path.parent))
        os.replace(path, trash / "model")
    try:
        os.replace(staging, path)
    finally:
        if trash is not None:
            shutil.rmtree(trash, ignore_errors=True)


def _write_model(folder: Path, spec: TinyModelSpec) -> None:
    tokenizer = _train_tokenizer(spec)
    vocab_size = tokenizer.get_vocab_size()
    tokenizer.save(str(folder / "tokenizer.json"))
    bos_id = tokenizer.token_to_id(BOS_TOKEN)
    eos_id = tokenizer.token_to_id(EOS_TOKEN)
    pad_id = tokenizer.token_to_id(PAD_TOKEN)
    _write_json(folder / "tokenizer_config.json", _tokenizer_config(spec))
    _write_json(
        folder / "special_tokens_map.json",
        {"bos_token": BOS_TOKEN, "eos_token": EOS_TOKEN, "pad_token": PAD_TOKEN},
    )
    _write_json(folder / "config.json", _model_config(spec, vocab_size, bos_id, eos_id, pad_id))
    _write_json(
        folder / "generation_config.json",
        {"bos_token_id": bos_id, "eos_token_id": eos_id, "pad_token_id": pad_id, "do_sample": False},
    )
    _write_weights(folder / "model.safetensors", spec, vocab_size)
    # The stamp goes last: its presence means every other file is complete.
    _write_json(folder / STAMP_FILE, {"digest": spec.digest(), "spec": asdict(spec), "vocab_size": vocab_size})


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def _model_config(spec: TinyModelSpec, vocab_size: int, bos_id: int, eos_id: int, pad_id: int) -> dict[str, Any]:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": spec.hidden_size,
        "intermediate_size": spec.intermediate_size,
        "num_hidden_layers": spec.num_hidden_layers,
        "num_attention_heads": spec.num_attention_heads,
        "num_key_value_heads": spec.num_key_value_heads,
        "head_dim": spec.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": spec.max_position_embeddings,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "rope_scaling": None,
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "vocab_size": vocab_size,
        "bos_token_id": bos_id,
        "eos_token_id": eos_id,
        "pad_token_id": pad_id,
        "torch_dtype": spec.torch_dtype,
        "initializer_range": 0.02,
        "use_cache": True,
    }


def _tokenizer_config(spec: TinyModelSpec) -> dict[str, Any]:
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "pad_token": PAD_TOKEN,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": spec.max_position_embeddings,
        "chat_template": CHAT_TEMPLATE,
    }


def _write_weights(path: Path, spec: TinyModelSpec, vocab_size: int) -> None:
    import numpy as np

    rng = np.random.default_rng(spec.seed)
    hidden, inter, hd = spec.hidden_size, spec.intermediate_size, spec.head_dim
    q_out, kv_out = spec.num_attention_heads * hd, spec.num_key_value_heads * hd

    def normal(*shape: int) -> Any:
        return rng.standard_normal(shape, dtype=np.float32) * np.float32(0.02)

    def ones(size: int) -> Any:
        return np.ones(size, dtype=np.float32)

    tensors: dict[str, Any] = {"model.embed_tokens.weight": normal(vocab_size, hidden)}
    for layer in range(spec.num_hidden_layers):
        prefix = f"model.layers.{layer}"
        tensors[f"{prefix}.self_attn.q_proj.weight"] = normal(q_out, hidden)
        tensors[f"{prefix}.self_attn.k_proj.weight"] = normal(kv_out, hidden)
        tensors[f"{prefix}.self_attn.v_proj.weight"] = normal(kv_out, hidden)
        tensors[f"{prefix}.self_attn.o_proj.weight"] = normal(hidden, q_out)
        tensors[f"{prefix}.mlp.gate_proj.weight"] = normal(inter, hidden)
        tensors[f"{prefix}.mlp.up_proj.weight"] = normal(inter, hidden)
        tensors[f"{prefix}.mlp.down_proj.weight"] = normal(hidden, inter)
        tensors[f"{prefix}.input_layernorm.weight"] = ones(hidden)
        tensors[f"{prefix}.post_attention_layernorm.weight"] = ones(hidden)
    tensors["model.norm.weight"] = ones(hidden)
    tensors["lm_head.weight"] = normal(vocab_size, hidden)
    if spec.torch_dtype == "bfloat16":
        path.write_bytes(_safetensors_bf16_bytes(tensors))
    else:
        from safetensors.numpy import save_file

        save_file(tensors, str(path), metadata={"format": "pt"})


def _safetensors_bf16_bytes(tensors: dict[str, Any]) -> bytes:
    """Serialize float32 arrays as a BF16 safetensors file without torch (numpy has no bfloat16 dtype).

    safetensors.numpy lays out the bfloat16 bit patterns as uint16 tensors; relabelling their dtype in the
    JSON header to BF16 leaves the data offsets valid, because they count from the end of the header.
    """
    import numpy as np
    from safetensors.numpy import save

    def to_bf16_bits(array: Any) -> Any:
        bits = np.ascontiguousarray(array, dtype=np.float32).view(np.uint32)
        # Round to nearest, ties to even (what torch does), instead of truncating the low half.
        rounded = bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))
        return (rounded >> np.uint32(16)).astype(np.uint16)

    raw = save({name: to_bf16_bits(array) for name, array in tensors.items()}, metadata={"format": "pt"})
    header_len = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + header_len])
    for name, info in header.items():
        if name != "__metadata__":
            info["dtype"] = "BF16"
    header_bytes = json.dumps(header, separators=(",", ":")).encode()
    header_bytes += b" " * (-len(header_bytes) % 8)  # the format aligns the data start to 8 bytes
    return len(header_bytes).to_bytes(8, "little") + header_bytes + raw[8 + header_len :]


def _train_tokenizer(spec: TinyModelSpec) -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=spec.target_vocab_size,
        min_frequency=1,
        special_tokens=[BOS_TOKEN, EOS_TOKEN, PAD_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_training_corpus(spec.seed), trainer=trainer)
    return tokenizer


_WORDS = (
    "the of and to in is that it was for on are as with his they at be this from have or by one had not but what "
    "all were when we there can an your which their said if do will each about how up out them then she many some "
    "so these would other into has more her two like him see time could no make than first been its who now people "
    "my made over did down only way find use may water long little very after words called just where most know "
    "get through back much before go good new write our used me man too any day same right look think also around "
    "another came come work three word must because does part even place well such here take why things help put "
    "years different away again off went old number great tell men say small every found still between name should "
    "home big give air line set own under read last never us left end along while might next sound below saw "
    "something thought both few those always looked show large often together asked house world going want school "
    "important until form food keep children feet land side without boy once animals life enough took sometimes "
    "memory server model token cache request stream latency throughput batch kernel tensor layer head weight test"
).split()
_SYLLABLES = (
    "ka ke ki ko ku ra re ri ro ru ta te ti to tu na ne ni no nu ma me mi mo mu sa se si so su la le li lo lu "
    "pa pe pi po pu da de di do du ga ge gi go gu va ve vi vo vu ba be bi bo bu sha shi sho cha che chi tra tre "
    "tri pro pre bla ble bri gro str ing ion ent ous ant ism ful"
).split()
_PUNCTUATION = (".", ",", "!", "?", ";", ":", " -", "...")


def _training_corpus(seed: int) -> list[str]:
    """English-like lines, invented words and numbers: enough distinct pieces for ~3000 BPE merges."""
    rng = random.Random(seed)
    lines = []
    for _ in range(6000):
        words = []
        for _ in range(rng.randint(6, 18)):
            roll = rng.random()
            if roll < 0.6:
                words.append(rng.choice(_WORDS))
            elif roll < 0.9:
                words.append("".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(1, 4))))
            else:
                words.append(str(rng.randint(0, 99999)))
        if rng.random() < 0.5:
            words[0] = words[0].capitalize()
        lines.append(" ".join(words) + rng.choice(_PUNCTUATION))
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m pytest_vllm_mem.tiny_model",
        description="Build a random-weight Llama-style model folder that vLLM can serve on a CPU.",
    )
    parser.add_argument("path", type=Path, help="folder to build into (missing, empty, or an earlier tiny model)")
    parser.add_argument(
        "--max-position-embeddings",
        type=int,
        default=DEFAULT_MAX_POSITION_EMBEDDINGS,
        help=f"longest --max-model-len the model accepts (default {DEFAULT_MAX_POSITION_EMBEDDINGS})",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the random weights and corpus (default 0)")
    parser.add_argument(
        "--dtype", choices=DTYPES, default=DEFAULT_DTYPE, help=f"weights and config dtype (default {DEFAULT_DTYPE})"
    )
    parser.add_argument("--force", action="store_true", help="rebuild even when an identical model is there")
    args = parser.parse_args(argv)
    try:
        built = build_tiny_model(
            args.path,
            max_position_embeddings=args.max_position_embeddings,
            seed=args.seed,
            dtype=args.dtype,
            force=args.force,
        )
    except TinyModelError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(built)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
