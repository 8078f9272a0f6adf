"""VLLMConfig: one vLLM server's model, CLI flags and environment, rendered to an argv."""

from __future__ import annotations

import shlex
from collections.abc import Mapping
from typing import Any, Union

FlagValue = Union[str, int, float, bool, None, tuple]

# Environment keys whose values must never appear in reports or ids.
_SECRET_HINTS = ("TOKEN", "KEY", "SECRET", "PASSWORD", "PASSWD", "CREDENTIAL", "AUTH")


class ConfigError(ValueError):
    """A VLLMConfig was built from values that cannot become a vLLM command line."""


def flag_name(key: str) -> str:
    """`max_model_len` -> `--max-model-len` (vLLM's argparse spells flags with dashes)."""
    return "--" + key.strip("-").replace("_", "-")


def _normalize_value(key: str, value: Any) -> FlagValue:
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        return tuple(str(v) for v in value)
    if isinstance(value, Mapping):
        # vLLM takes dict-valued flags (e.g. --compilation-config) as JSON strings.
        import json

        return json.dumps(value, sort_keys=True)
    raise ConfigError(
        f"VLLMConfig flag {key}={value!r}: a {type(value).__name__} cannot become a vLLM command-line value. "
        "Accepted: str, int, float, bool (True = bare flag, False/None = omitted), a list/tuple of values, "
        "or a dict (passed as JSON)."
    )


def is_secret_env_key(key: str) -> bool:
    upper = key.upper()
    return any(hint in upper for hint in _SECRET_HINTS)


class VLLMConfig:
    """A vLLM server configuration: `VLLMConfig(model, *, env=None, **flags)`.

    Any vLLM CLI flag is a keyword: `max_model_len=4096` -> `--max-model-len 4096`, `True` -> bare flag,
    `False`/`None` -> omitted. Equal configs compare and hash equal, so they can share one server.
    `str(config)` is the exact command line (without the interpreter), used in ids and reports.
    """

    __slots__ = ("model", "env", "flags", "_key")

    def __init__(self, model: str, *, env: Mapping[str, str] | None = None, **flags: Any) -> None:
        if not isinstance(model, str) or not model.strip():
            raise ConfigError(
                f"VLLMConfig model {model!r} is not usable: pass a model name or a local model folder as a "
                "non-empty string, e.g. VLLMConfig('meta-llama/Llama-2-7b-chat-hf')."
            )
        for key in ("model", "host", "port"):
            if key in flags:
                raise ConfigError(
                    f"VLLMConfig flag {key}= is set by the plugin itself (model is the first argument; the server "
                    "always binds 127.0.0.1 on a free port). Remove it from the config."
                )
        normalized = {key.replace("-", "_"): _normalize_value(key, value) for key, value in flags.items()}
        env_items = {str(k): str(v) for k, v in (env or {}).items()}
        object.__setattr__(self, "model", model)
        object.__setattr__(self, "flags", dict(sorted(normalized.items())))
        object.__setattr__(self, "env", dict(sorted(env_items.items())))
        # Omitted flags (False/None) do not change the command, so they do not change identity either.
        key = (model, tuple((k, v) for k, v in self.flags.items() if v is not None and v is not False),
               tuple(self.env.items()))
        object.__setattr__(self, "_key", key)

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError("VLLMConfig is immutable; use with_flags() to derive a new one")

    def __eq__(self, other: object) -> bool:
        return isinstance(other, VLLMConfig) and self._key == other._key

    def __hash__(self) -> int:
        return hash(self._key)

    def flag(self, name: str, default: Any = None) -> Any:
        """The value set for a flag (`max_model_len`), or default when unset or omitted."""
        value = self.flags.get(name.replace("-", "_"))
        return default if value is None or value is False else value

    def with_flags(self, **changes: Any) -> "VLLMConfig":
        """A copy with some flags changed (None removes one)."""
        merged = {**self.flags, **changes}
        return VLLMConfig(self.model, env=self.env, **merged)

    def with_env(self, **changes: str) -> "VLLMConfig":
        return VLLMConfig(self.model, env={**self.env, **changes}, **self.flags)

    def cli_args(self) -> list[str]:
        """The arguments after the server entry point: `--model M --flag value ...`."""
        args = ["--model", self.model]
        for key, value in self.flags.items():
            if value is None or value is False:
                continue
            if value is True:
                args.append(flag_name(key))
            elif isinstance(value, tuple):
                args.append(flag_name(key))
                args.extend(value)
            else:
                args.extend([flag_name(key), str(value)])
        return args

    def masked_env(self) -> dict[str, str]:
        return {k: ("***" if is_secret_env_key(k) else v) for k, v in self.env.items()}

    def __str__(self) -> str:
        env = " ".join(f"{k}={shlex.quote(v)}" for k, v in self.masked_env().items())
        command = "vllm serve " + shlex.join([self.model, *self.cli_args()[2:]])
        return f"{env} {command}" if env else command

    def __repr__(self) -> str:
        parts = [repr(self.model)]
        if self.env:
            parts.append(f"env={self.masked_env()!r}")
        parts += [f"{k}={v!r}" for k, v in self.flags.items()]
        return f"VLLMConfig({', '.join(parts)})"

    def short_id(self) -> str:
        """The flags only, compact, for pytest ids and table rows: `gmu=0.7,max-model-len=4096,enforce-eager`."""
        parts = []
        for key, value in self.flags.items():
            if value is None or value is False:
                continue
            name = key.replace("_", "-")
            parts.append(name if value is True else f"{name}={','.join(value) if isinstance(value, tuple) else value}")
        return " ".join(parts) or "defaults"
