"""The tuner's search with fake trials (no vLLM), its trial bookkeeping with a fake session, and the CLI's input
handling."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, TypeVar

import pytest
from fakes import FakeServer

import pytest_vllm_mem.tune.search as tune_module
from pytest_vllm_mem.cli import main as cli
from pytest_vllm_mem.config import VLLMConfig
from pytest_vllm_mem.diagnosis.diagnose import Diagnosis, StartupMemory
from pytest_vllm_mem.kinds import FailureKind
from pytest_vllm_mem.launch.flagcheck import ParserTable
from pytest_vllm_mem.launch.launcher import RunningServer
from pytest_vllm_mem.launch.server import StartupOutcome, VLLMStartupError
from pytest_vllm_mem.load.client import LoadResult, LoadSpec, Percentiles
from pytest_vllm_mem.memory import DeviceInfo
from pytest_vllm_mem.tiers import Emulation, Tier
from pytest_vllm_mem.tune.search import (
    NOT_MEMORY,
    OK,
    TOO_HIGH,
    TOO_LOW,
    TUNE_LOAD,
    Trial,
    TuneError,
    TuneResult,
    TuneSession,
    candidate_values,
    failure_side,
    run_trial,
    search,
    trial_line,
    tune,
)
from pytest_vllm_mem.units import format_bytes

GIB = 2**30
T = TypeVar("T")


@dataclass
class GpuLike:
    """Works in [u_min, u_max]; cuda_oom above, kv_cache_insufficient below. Records the values tried."""

    u_max: float
    u_min: float = 0.0
    tried: list[float] = field(default_factory=list)

    def __call__(self, u: float) -> Trial:
        self.tried.append(u)
        if u > self.u_max + 1e-9:
            return Trial(u, "cuda_oom", TOO_HIGH, summary="out of memory under load")
        if u < self.u_min - 1e-9:
            return Trial(u, "kv_cache_insufficient", TOO_LOW, summary="KV cache too small")
        return Trial(u, OK, OK, peak_memory_bytes=int(u * 24e9), kv_cache_tokens=int(u * 1e5), output_throughput=1000.0)


def gpu_like(u_max: float, u_min: float = 0.0) -> GpuLike:
    return GpuLike(u_max, u_min)


def cpu_like(u_min: float) -> Callable[[float], Trial]:
    """The CPU backend: below u_min the worker's share is used up before the KV cache (host_memory, negative KV)."""

    def trial(u: float) -> Trial:
        if u < u_min - 1e-9:
            kind: FailureKind = "host_memory"
            return Trial(u, kind, failure_side(kind, {"kv_requested_gib": -0.5}), summary="nothing left for KV")
        return Trial(u, OK, OK, peak_memory_bytes=2 * GIB)

    return trial


# --- the search -----------------------------------------------------------------------------------------------


def test_grid_ends_on_high_and_steps_by_resolution() -> None:
    assert candidate_values(0.5, 0.95, 0.05) == [0.5, 0.55, 0.6, 0.65, 0.7, 0.75, 0.8, 0.85, 0.9, 0.95]
    assert candidate_values(0.01, 0.2, 0.08) == [0.01, 0.09, 0.17, 0.2]


def test_finds_the_highest_working_value_within_the_budget() -> None:
    fake = gpu_like(u_max=0.72)
    result = search(fake, low=0.5, high=0.95, resolution=0.05, max_startups=6, goal="highest")
    best, failing = result.best, result.first_failing
    assert best is not None and best.utilization == 0.7 and failing is not None and failing.utilization == 0.75
    assert result.converged and len(result.trials) <= 6
    assert fake.tried[0] == 0.95  # the far end first: it is the answer when it works
    assert [t.number for t in result.trials] == list(range(1, len(result.trials) + 1))
    assert "highest working gpu_memory_utilization: 0.7; 0.75 fails with cuda_oom" in result.verdict


@pytest.mark.parametrize("goal", ["highest", "lowest"])
def test_every_boundary_position_is_found_in_log2_startups(goal: str) -> None:
    values = candidate_values(0.5, 0.95, 0.05)
    budget = 1 + math.ceil(math.log2(len(values)))
    for index in range(len(values)):
        boundary = values[index]
        fake = gpu_like(u_max=boundary) if goal == "highest" else gpu_like(u_max=1.0, u_min=boundary)
        result = search(fake, low=0.5, high=0.95, resolution=0.05, max_startups=budget, goal=goal)
        assert result.best is not None and result.best.utilization == boundary, (goal, boundary, fake.tried)
        assert len(result.trials) <= budget
        assert len(set(fake.tried)) == len(fake.tried)  # no value started twice


def test_top_of_the_range_working_ends_after_one_startup() -> None:
    result = search(gpu_like(u_max=1.0), low=0.5, high=0.9, resolution=0.1, goal="highest")
    assert len(result.trials) == 1 and result.best is not None and result.best.utilization == 0.9
    assert result.first_failing is None
    assert "the top of the range (0.9) works" in result.verdict and "raise --high" in result.verdict


def test_wrong_direction_is_reported_not_searched() -> None:
    # The high end fails for too LITTLE memory: every lower value fails the same way, so nothing below can work.
    result = search(gpu_like(u_max=1.0, u_min=0.99), low=0.5, high=0.95, resolution=0.05, goal="highest")
    assert len(result.trials) == 1 and result.best is None
    assert "kv_cache_insufficient, a failure of too little memory" in result.verdict
    assert "points the wrong way" in result.verdict and "Raise --high" in result.verdict


def test_lowest_goal_on_a_cpu_like_backend() -> None:
    result = search(cpu_like(u_min=0.11), low=0.01, high=0.25, resolution=0.04, max_startups=5, goal="lowest")
    best, failing = result.best, result.first_failing
    assert best is not None and best.utilization == 0.13 and failing is not None and failing.utilization == 0.09
    assert failing.outcome == "host_memory" and result.converged
    assert result.trials[0].utilization == 0.01
    assert len(result.trials) <= 5
    assert all(t.utilization < best.utilization for t in result.trials if not t.ok)
    assert "leave a margin" in result.verdict


def test_nothing_works_says_so_clearly() -> None:
    result = search(gpu_like(u_max=0.1), low=0.5, high=0.95, resolution=0.05, max_startups=6, goal="highest")
    assert result.best is None and len(result.trials) <= 6
    assert result.verdict.startswith("no gpu_memory_utilization in the range worked: 0.5 fails with cuda_oom")
    assert "does not fit this tier" in result.verdict
    assert result.to_dict()["recommended_utilization"] is None


def test_window_narrower_than_the_resolution() -> None:
    result = search(
        gpu_like(u_max=0.73, u_min=0.71), low=0.5, high=0.95, resolution=0.05, max_startups=8, goal="highest"
    )
    assert result.best is None
    kinds = {t.outcome for t in result.trials}
    assert kinds == {"cuda_oom", "kv_cache_insufficient"}
    assert "narrower than the resolution" in result.verdict


def test_budget_spent_before_the_boundary_is_resolved() -> None:
    result = search(gpu_like(u_max=0.72), low=0.5, high=0.95, resolution=0.05, max_startups=3, goal="highest")
    assert len(result.trials) == 3 and result.best is not None and not result.converged
    assert "raise --max-startups" in result.verdict


def test_a_failure_no_utilization_fixes_stops_the_search() -> None:
    def bad(u: float) -> Trial:
        return Trial(u, "bad_flag", NOT_MEMORY, summary="--swap-space is not a flag")

    result = search(bad, low=0.5, high=0.95, resolution=0.05, goal="highest")
    assert len(result.trials) == 1 and result.best is None
    assert "bad_flag, which no utilization fixes" in result.verdict


@pytest.mark.parametrize(
    "kind, figures, during_load, side",
    [
        ("cuda_oom", {}, False, TOO_HIGH),
        ("insufficient_free_memory", {}, False, TOO_HIGH),
        ("tier_exceeded", {}, False, TOO_HIGH),
        ("kv_cache_insufficient", {}, False, TOO_LOW),
        ("external_weights_over_budget", {"external_gib": 20.0, "requested_gib": 18.0}, False, TOO_LOW),
        ("host_memory", {"kv_requested_gib": -0.62}, False, TOO_LOW),  # the CPU worker's share used up before the KV
        ("host_memory", {"kv_requested_gib": 3.0}, False, TOO_HIGH),  # the reservation did not fit in RAM
        # vLLM 0.33's CPU worker over its reservation (diagnose: kv_requested_gib = reserved - used, <= 0)
        ("host_memory", {"non_kv_gib": 1.37, "requested_gib": 1.25, "kv_requested_gib": -0.12}, False, TOO_LOW),
        ("host_memory", {}, True, TOO_HIGH),
        ("crash", {}, True, TOO_HIGH),  # dying under load: the OOM killer looks like this
        ("crash", {}, False, NOT_MEMORY),
        ("bad_flag", {}, False, NOT_MEMORY),
        ("timeout", {}, False, NOT_MEMORY),
        ("ok", {}, False, OK),
    ],
)
def test_failure_sides(kind: str, figures: dict[str, float], during_load: bool, side: str) -> None:
    assert failure_side(kind, figures, during_load=during_load) == side


@pytest.mark.parametrize(
    "kwargs, named",
    [
        ({"low": 0.9, "high": 0.5}, "low=0.9, high=0.5"),
        ({"low": 0.0, "high": 0.5}, "low=0.0"),
        ({"low": 0.5, "high": 1.5}, "high=1.5"),
        ({"low": 0.5, "high": 0.6, "resolution": 0.5}, "resolution=0.5"),
        ({"low": 0.5, "high": 0.6, "max_startups": 0}, "max_startups=0"),
    ],
)
def test_unusable_ranges_are_refused_by_name(kwargs: dict[str, Any], named: str) -> None:
    with pytest.raises(TuneError, match=named.replace(".", r"\.")):
        search(gpu_like(1.0), **{"resolution": 0.05, **kwargs})


# --- one real-shaped trial, with a fake session ---------------------------------------------------------------


class FakePool:
    def __init__(self) -> None:
        self.releases = 0

    def release_all(self) -> None:
        self.releases += 1


class FakeState:
    """A session as the tuner sees one (tune.search.TuneSession): a CPU device, a fake parser table, fake servers."""

    preflight = False

    def __init__(self, fail_below: float = 0.0, peak: int = 2 * GIB, per_gpu: tuple[int, ...] = ()) -> None:
        self.pool = FakePool()
        self.fail_below = fail_below
        self.peak = peak
        self.per_gpu = per_gpu
        self.started: list[VLLMConfig] = []
        self.tier = Tier("8gb", 8 * 10**9)
        self.device = DeviceInfo("cpu", "fake CPU", 16 * GIB, None)
        self.parser_table = ParserTable(
            "0.32.0",
            {
                "--max-model-len": {"takes_value": True, "choices": None},
                "--gpu-memory-utilization": {"takes_value": True, "choices": None},
            },
            {},
        )

    def device_total_now(self, config: VLLMConfig | None = None) -> int:
        return self.device.total_bytes

    def launched_config(self, config: VLLMConfig) -> tuple[VLLMConfig, Emulation | None, list[str]]:
        return config, None, []

    def plan(self, config: VLLMConfig, launched: VLLMConfig) -> None:
        return None  # plans nothing: every trial is a startup

    def launch(self, config: VLLMConfig) -> RunningServer:
        self.started.append(config)
        utilization = float(config.flag("gpu_memory_utilization"))
        if utilization < self.fail_below:
            diagnosis = Diagnosis("host_memory", "nothing left for the KV cache", figures={"kv_requested_gib": -0.6})
            raise VLLMStartupError(
                diagnosis, config, Path("failed.log"), StartupOutcome(False, "host_memory", 20.0, GIB)
            )
        startup = StartupOutcome(True, "started", 30.0, self.peak, self.per_gpu)
        return FakeServer(config, startup, StartupMemory(kv_cache_tokens=120_000))


def _load_result(**changes: Any) -> LoadResult:
    zero = Percentiles(0, 0, 0, 0)
    result = LoadResult(
        num_prompts=8,
        concurrency=4,
        request_rate=None,
        completed=8,
        failed=0,
        errors=[],
        duration_s=1.0,
        request_throughput=8.0,
        output_throughput=512.0,
        total_output_tokens=512,
        total_input_tokens=256,
        ttft=zero,
        tpot=zero,
        itl=zero,
        e2el=zero,
        peak_memory_bytes=3 * GIB,
    )
    for key, value in changes.items():
        setattr(result, key, value)
    return result


@pytest.fixture
def fake_load(monkeypatch: pytest.MonkeyPatch) -> list[LoadSpec]:
    """The tuner's loads, answered without a server: each returns _load_result(); the specs asked for."""
    calls: list[LoadSpec] = []

    def measure_load(server: RunningServer, spec: LoadSpec) -> LoadResult:
        calls.append(spec)
        return _load_result()

    monkeypatch.setattr(tune_module, "measure_load", measure_load)
    return calls


def test_trial_starts_loads_and_stops(fake_load: list[LoadSpec]) -> None:
    state = FakeState()
    lines: list[str] = []
    trial = run_trial(
        state,
        VLLMConfig("tiny", max_model_len=1024),
        0.2,
        LoadSpec(num_prompts=8, concurrency=4),
        state.tier,
        lines.append,
    )
    assert trial.ok and trial.peak_memory_bytes == 3 * GIB and trial.kv_cache_tokens == 120_000
    assert trial.output_throughput == 512.0
    assert state.started[0].flag("gpu_memory_utilization") == 0.2 and state.started[0].flag("max_model_len") == 1024
    assert fake_load[0] == LoadSpec(num_prompts=8, concurrency=4)
    assert state.pool.releases == 2  # before (fresh server) and after (stopped)
    assert "KV cache 120,000 tokens" in lines[0]
    trial.number = 2
    line = trial_line(trial, 6)
    assert line.startswith("trial 2/6  gpu_memory_utilization=0.2 ")
    assert "ok" in line and "peak 3.00 GiB" in line and "KV 120,000 tokens" in line and "512 tok/s" in line


def test_trial_over_the_tier_fails_as_too_high(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tune_module, "measure_load", lambda server, spec: _load_result(peak_memory_bytes=9 * GIB))
    state = FakeState()
    trial = run_trial(state, VLLMConfig("tiny"), 0.9, LoadSpec(), state.tier, lambda line: None)
    assert trial.outcome == "tier_exceeded" and trial.side == TOO_HIGH and trial.phase == "peak"
    assert "exceeds the 8gb tier" in trial.summary


def test_trial_failing_at_startup_keeps_the_diagnosis(fake_load: list[LoadSpec]) -> None:
    state = FakeState(fail_below=0.1)
    trial = run_trial(state, VLLMConfig("tiny"), 0.05, LoadSpec(), state.tier, lambda line: None)
    assert trial.outcome == "host_memory" and trial.side == TOO_LOW and trial.log_path == "failed.log"
    assert not fake_load  # no load against a server that never came up
    assert "at startup: nothing left for the KV cache" in trial_line(trial, 5)


def test_trial_stops_the_server_when_the_load_is_interrupted(monkeypatch: pytest.MonkeyPatch) -> None:
    def interrupted(server: RunningServer, spec: LoadSpec) -> LoadResult:
        raise KeyboardInterrupt

    monkeypatch.setattr(tune_module, "measure_load", interrupted)
    state = FakeState()
    with pytest.raises(KeyboardInterrupt):
        run_trial(state, VLLMConfig("tiny"), 0.5, LoadSpec(), state.tier, lambda line: None)
    assert state.pool.releases == 2


def test_tune_prints_progress_and_recommends(fake_load: list[LoadSpec]) -> None:
    state = FakeState(fail_below=0.11)
    lines: list[str] = []
    result = tune(
        state,
        VLLMConfig("tiny", max_model_len=1024),
        low=0.01,
        high=0.25,
        resolution=0.04,
        max_startups=5,
        out=lines.append,
    )
    text = "\n".join(lines)
    assert (
        result.ok and result.recommended is not None and result.recommended.utilization == 0.13
    )  # CPU backend: the lowest working value
    starts = [line for line in lines if line.startswith("starting trial ")]
    assert len(starts) == len(result.search.trials) <= 5
    assert starts[0] == "starting trial 1/5: gpu_memory_utilization=0.01 max-model-len=1024 on the 8gb tier ..."
    assert "boundary: 0.13 works, 0.09 fails (host_memory)" in text
    assert (
        "recommended: vllm serve tiny --max-model-len 1024 --gpu-memory-utilization 0.13  (headroom: peak "
        "3.00 GiB of the 8gb tier = 4.45 GiB free)"
    ) in text
    data = result.to_dict()
    assert data["recommended_utilization"] == 0.13 and data["headroom_bytes"] == 8 * 10**9 - 3 * GIB
    assert data["trials"][0]["outcome"] == "host_memory" and data["startups"] == len(starts)


def test_tune_refuses_a_config_that_sets_the_utilization() -> None:
    with pytest.raises(TuneError, match="gpu_memory_utilization=0.5: that is the value the tuner searches"):
        tune(FakeState(), VLLMConfig("tiny", gpu_memory_utilization=0.5))


def test_tune_refuses_a_tier_larger_than_the_device() -> None:
    state = FakeState()
    state.tier = Tier("24gb", 24 * 10**9)
    with pytest.raises(TuneError, match="the 24gb tier .* is larger than this device"):
        tune(state, VLLMConfig("tiny"))


def test_tune_refuses_an_unknown_flag_before_any_startup() -> None:
    state = FakeState()
    with pytest.raises(TuneError, match="--swap-space is not a flag of vLLM 0.32.0"):
        tune(state, VLLMConfig("tiny", swap_space=4))
    assert state.started == []


# --- the command line -----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "argv, named",
    [
        (["tune", "--model", "tiny", "--tier", "24"], "argument --tier: --tier='24' is not a GPU memory tier"),
        (["tune", "--model", "tiny", "--low", "1.5"], "argument --low: '1.5' is not a gpu_memory_utilization"),
        (["tune", "--model", "tiny", "--resolution", "x"], "argument --resolution: 'x' is not a search step"),
        (["tune", "--model", "tiny", "--max-startups", "0"], "argument --max-startups: '0' is not a positive"),
        (["tune", "--model", "tiny", "--flag", "gpu_memory_utilization=0.5"], "what the tuner searches"),
        (["tune", "--model", "tiny", "--flag", "=3"], "argument --flag: '=3' is not a vLLM flag"),
        (["tune", "--model", "./no/such/folder"], "argument --model: model folder ./no/such/folder does not exist"),
        (["tune"], "the following arguments are required: --model"),
    ],
)
def test_bad_arguments_exit_2_naming_the_input(argv: list[str], named: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        cli.main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert named in err and "Traceback" not in err


def test_help_lists_the_subcommands(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["--help"])
    assert exit_info.value.code == 0
    assert "tune" in capsys.readouterr().out
    assert cli.main([]) == 2  # no subcommand: the help, and a usage exit code


def test_flags_parse_to_a_config() -> None:
    args = cli.build_parser().parse_args(
        ["tune", "--model", "tiny", "--flag", "max-model-len=1024", "--flag=--enforce-eager", "--env", "A=1"]
    )
    assert dict(args.flag) == {"max_model_len": "1024", "enforce_eager": True} and dict(args.env) == {"A": "1"}
    settings = cli.build_settings(args)
    assert settings.vllm_model == "tiny" and settings.vllm_gpu == "auto" and settings.vllm_max_servers == 1


def test_ctrl_c_stops_the_session_and_exits_130(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    closed = []

    def interrupted(state: TuneSession, config: VLLMConfig, **kwargs: Any) -> TuneResult:
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "tune", interrupted)
    monkeypatch.setattr("pytest_vllm_mem.launch.pool.Session.close", lambda self: closed.append(True))
    code = cli.main(["tune", "--model", "tiny", "--cache-dir", str(tmp_path)])
    assert code == 130 and closed == [True]
    assert "interrupted" in capsys.readouterr().err


@pytest.mark.parametrize(
    "flags, changed", [([], {}), (["--concurrency", "4", "--max-tokens", "8"], {"concurrency": 4, "max_tokens": 8})]
)
def test_the_cli_load_is_the_tuners_load_with_its_flags(
    flags: list[str], changed: dict[str, Any], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    loads = []

    def recorded(state: TuneSession, config: VLLMConfig, **kwargs: Any) -> TuneResult:
        loads.append(kwargs["load"])
        raise KeyboardInterrupt  # stop before any startup

    monkeypatch.setattr(cli, "tune", recorded)
    monkeypatch.setattr("pytest_vllm_mem.launch.pool.Session.close", lambda self: None)
    assert cli.main(["tune", "--model", "tiny", "--cache-dir", str(tmp_path), *flags]) == 130
    assert loads == [replace(TUNE_LOAD, **changed)]  # the CLI's defaults and the tuner's timeout are TUNE_LOAD's


def test_exit_codes_follow_the_recommendation(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    def fake_tune(state: TuneSession, config: VLLMConfig, **kwargs: Any) -> TuneResult:
        fake = gpu_like(u_max=kwargs["high"] if kwargs["low"] < 0.5 else 0.1)
        found = search(
            fake,
            low=kwargs["low"],
            high=kwargs["high"],
            resolution=kwargs["resolution"],
            max_startups=kwargs["max_startups"],
            goal="highest",
        )
        return tune_module.TuneResult(
            found, config.model, dict(config.flags), Tier("8gb", 8 * 10**9), kwargs["load"], 1.0
        )

    monkeypatch.setattr(cli, "tune", fake_tune)
    out = tmp_path / "tune.json"
    assert (
        cli.main(
            [
                "tune",
                "--model",
                "tiny",
                "--low",
                "0.2",
                "--high",
                "0.4",
                "--json",
                str(out),
                "--cache-dir",
                str(tmp_path),
            ]
        )
        == 0
    )
    assert '"recommended_utilization": 0.4' in out.read_text()
    assert cli.main(["tune", "--model", "tiny", "--low", "0.6", "--high", "0.9", "--cache-dir", str(tmp_path)]) == 1


@pytest.mark.parametrize(
    "load_per_gpu, outcome",
    [
        ([5 * GIB, 5 * GIB], OK),  # 10 GiB in all, but each card holds 5: fits an 8 GB tier per GPU
        ([5 * GIB, 9 * GIB], "tier_exceeded"),
    ],
)
def test_a_multi_gpu_trial_holds_the_fullest_gpu_against_the_tier(
    monkeypatch: pytest.MonkeyPatch, load_per_gpu: list[int], outcome: str
) -> None:
    total = sum(load_per_gpu)
    monkeypatch.setattr(
        tune_module,
        "measure_load",
        lambda server, spec: _load_result(peak_memory_bytes=total, peak_memory_per_gpu=load_per_gpu),
    )
    state = FakeState(peak=4 * GIB, per_gpu=(2 * GIB, 2 * GIB))
    trial = run_trial(state, VLLMConfig("tiny"), 0.9, LoadSpec(), state.tier, lambda line: None)
    assert trial.outcome == outcome
    assert trial.peak_memory_bytes == total and trial.largest_gpu_peak_bytes == max(load_per_gpu)
    assert trial.tier_peak_bytes == max(load_per_gpu) and trial.to_dict()["largest_gpu_peak_bytes"] == max(load_per_gpu)
    trial.number = 1
    assert f"(fullest GPU {format_bytes(max(load_per_gpu))})" in trial_line(trial, 3)
    if outcome != OK:
        assert trial.summary.startswith("peak on the fullest GPU 9.00 GiB exceeds the 8gb tier")


def test_a_cpu_trial_has_no_gpu_peak_and_keeps_the_total() -> None:
    trial = Trial(0.5, OK, OK, peak_memory_bytes=3 * GIB)
    assert trial.largest_gpu_peak_bytes is None and trial.tier_peak_bytes == 3 * GIB
