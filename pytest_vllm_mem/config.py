"""VLLMConfig: one vLLM server's model, CLI flags and environment, rendered to an argv."""

from __future__ import annotations

import json
import re
import shlex
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, TypeAlias

# A normalized flag value: lists become tuples of strings, dicts JSON strings.
FlagValue: TypeAlias = str | int | float | bool | tuple[str, ...] | None

# Environment keys and flags whose values must never appear in reports, ids or baseline files.
_SECRET_HINTS = ("TOKEN", "KEY", "SECRET", "SECRETS", "PASSWORD", "PASSWD", "CREDENTIAL", "CREDENTIALS", "AUTH")
_MASK = "***"


class ConfigError(ValueError):
    """A VLLMConfig was built from values that cannot become a vLLM command line."""


def flag_name(key: str) -> str:
    """`max_model_len` -> `--max-model-len` (vLLM's argparse spells flags with dashes)."""
    return "--" + key.strip("-").replace("_", "-")


def _normalize_value(key: str, value: Any) -> FlagValue:
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        # An empty list rendered as a bare `--flag`, which vLLM rejects ("expected at least one argument").
        if not value:
            raise ConfigError(
                f"VLLMConfig flag {key}=[]: an empty list cannot become a vLLM command-line value; "
                "pass at least one value, or None to omit the flag."
            )
        return tuple(str(v) for v in value)
    if isinstance(value, Mapping):
        # vLLM takes dict-valued flags (e.g. --compilation-config) as JSON strings.
        return json.dumps(value, sort_keys=True)
    raise ConfigError(
        f"VLLMConfig flag {key}={value!r}: a {type(value).__name__} cannot become a vLLM command-line value. "
        "Accepted: str, int, float, bool (True = bare flag, False/None = omitted), a list/tuple of values, "
        "or a dict (passed as JSON)."
    )


def is_secret_key(key: str) -> bool:
    """HF_TOKEN, OPENAI_API_KEY, NGROK_AUTHTOKEN, api_key, hf_token: a name part that ends with a secret word.

    Matched by name part, not substring, so TOKENIZERS_PARALLELISM and max_num_batched_tokens stay readable.
    """
    parts = re.split(r"[^A-Za-z0-9]+", key.upper())
    return any(part.endswith(hint) for part in parts for hint in _SECRET_HINTS)


def _rendered(value: FlagValue) -> tuple[str, ...]:
    """The argv words after a flag name: () for a bare flag."""
    if value is True:
        return ()
    if isinstance(value, tuple):
        return value
    return (str(value),)


def _flag_args(flags: Mapping[str, FlagValue]) -> list[str]:
    args: list[str] = []
    for key, value in flags.items():
        if value is not None and value is not False:
            args += [flag_name(key), *_rendered(value)]
    return args


@dataclass(frozen=True, init=False, eq=False, repr=False)
class VLLMConfig:
    """A vLLM server configuration: `VLLMConfig(model, *, env=None, **flags)`.

    Any vLLM CLI flag is a keyword: `max_model_len=4096` -> `--max-model-len 4096`, `True` -> bare flag,
    `False`/`None` -> omitted. Equal configs compare and hash equal, so they can share one server.
    `str(config)` is the exact command line (without the interpreter), used in ids and reports.
    """

    model: str
    # Flags keep the caller's order, so the command line reads as written (identity below is sorted).
    flags: Mapping[str, FlagValue]
    env: Mapping[str, str]  # sorted by name
    # Identity is the command the server runs, in sorted flag order: omitted flags (False/None) do not count, 4096
    # and "4096" are the same server. Comparing raw values made `x=1` equal `x=True` (1 == True in Python) although
    # one is `--x 1` and the other a bare `--x`.
    _key: tuple[str, tuple[tuple[str, tuple[str, ...]], ...], tuple[tuple[str, str], ...]]

    def __init__(self, model: str, *, env: Mapping[str, object] | None = None, **flags: Any) -> None:
        if not isinstance(model, str) or not model.strip():
            raise ConfigError(
                f"VLLMConfig model {model!r} is not usable: pass a model name or a local model folder as a "
                "non-empty string, e.g. VLLMConfig('meta-llama/Llama-2-7b-chat-hf')."
            )
        # Compared by flag name, so spellings such as "--port" are refused too, not passed twice. (A
        # plain model= keyword never reaches here: Python reports it as a second value for the model argument.)
        for key in flags:
            if flag_name(key) in ("--model", "--host", "--port"):
                raise ConfigError(
                    f"VLLMConfig flag {key}= is set by the plugin itself (model is the first argument; the server "
                    "always binds 127.0.0.1 on a free port). Remove it from the config."
                )
        normalized = {key.replace("-", "_"): _normalize_value(key, value) for key, value in flags.items()}
        env_items = dict(sorted((str(k), str(v)) for k, v in (env or {}).items()))
        rendered = sorted(
            (flag_name(k), _rendered(v)) for k, v in normalized.items() if v is not None and v is not False
        )
        # A frozen dataclass: its fields are set once, here, through object.__setattr__ (dataclasses' own way).
        object.__setattr__(self, "model", model)
        object.__setattr__(self, "flags", normalized)
        object.__setattr__(self, "env", env_items)
        object.__setattr__(self, "_key", (model, tuple(rendered), tuple(env_items.items())))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, VLLMConfig) and self._key == other._key

    def __hash__(self) -> int:
        return hash(self._key)

    def flag(self, name: str, default: Any = None) -> Any:
        """The value set for a flag (`max_model_len`), or default when unset or omitted."""
        value = self.flags.get(name.replace("-", "_"))
        return default if value is None or value is False else value

    def with_flags(self, **changes: Any) -> VLLMConfig:
        """A copy with some flags changed (None removes one)."""
        # Normalize dashes as __init__ does, so with_flags(**{"max-model-len": None}) removes max_model_len.
        merged = {**self.flags, **{key.replace("-", "_"): value for key, value in changes.items()}}
        return VLLMConfig(self.model, env=self.env, **merged)

    def with_env(self, **changes: str) -> VLLMConfig:
        return VLLMConfig(self.model, env={**self.env, **changes}, **self.flags)

    def cli_args(self) -> list[str]:
        """The arguments after the server entry point: `--model M --flag value ...`."""
        return ["--model", self.model, *self.flag_args()]

    def flag_args(self) -> list[str]:
        """The flags as arguments, `--flag value ...`, without the model (`vllm serve` takes it positionally)."""
        return _flag_args(self.flags)

    def masked_env(self) -> dict[str, str]:
        return {k: (_MASK if is_secret_key(k) else v) for k, v in self.env.items()}

    def masked_flags(self) -> dict[str, FlagValue]:
        """Flags with secret values (api_key, hf_token) replaced by ***; a bare flag (True) shows nothing secret.

        Str()/repr()/short_id() end up in test ids, reports and committed baseline files; only env was masked.
        """
        return {
            k: (_MASK if is_secret_key(k) and v is not None and not isinstance(v, bool) else v)
            for k, v in self.flags.items()
        }

    def __str__(self) -> str:
        env = " ".join(f"{k}={shlex.quote(v)}" for k, v in self.masked_env().items())
        command = "vllm serve " + shlex.join([self.model, *_flag_args(self.masked_flags())])
        return f"{env} {command}" if env else command

    def __repr__(self) -> str:
        parts = [repr(self.model)]
        if self.env:
            parts.append(f"env={self.masked_env()!r}")
        parts += [f"{k}={v!r}" for k, v in self.masked_flags().items()]
        return f"VLLMConfig({', '.join(parts)})"

    def short_id(self) -> str:
        """The flags only, compact, for pytest ids and table rows: `gmu=0.7,max-model-len=4096,enforce-eager`."""
        parts = []
        for key, value in self.masked_flags().items():
            if value is None or value is False:
                continue
            name = key.replace("_", "-")
            parts.append(name if value is True else f"{name}={','.join(value) if isinstance(value, tuple) else value}")
        return " ".join(parts) or "defaults"
