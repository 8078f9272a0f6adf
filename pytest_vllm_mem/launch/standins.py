"""The servers the vllm_server fixture hands out besides a running VLLMServer, each a `server.Server`: a
FailedServer for a startup that failed (the test fails in its call phase), a PlannedServer under --vllm-preflight
(nothing runs, the plan says it fits), and `planned_or_raise`, the preflight's answer to a launch."""

from __future__ import annotations

from pathlib import Path
from typing import NoReturn, cast

from pytest_vllm_mem.config import VLLMConfig
from pytest_vllm_mem.diagnosis.diagnose import Diagnosis, StartupMemory
from pytest_vllm_mem.kinds import FailureKind
from pytest_vllm_mem.launch.server import StartupOutcome, VLLMStartupError
from pytest_vllm_mem.plan.memory_plan import Plan
from pytest_vllm_mem.plan.preflight import SessionPlans, Unplannable, plan_advice, plan_figures


class FailedServer:
    """Stands in for a server that did not start: the test fails in its call phase (a failed test, not a setup
    error), and whatever touches the server raises the same classified error."""

    def __init__(self, error: VLLMStartupError) -> None:
        self.error = error

    def _raise(self) -> NoReturn:
        raise self.error

    @property
    def config(self) -> VLLMConfig:
        self._raise()

    @property
    def launched(self) -> VLLMConfig:
        self._raise()

    @property
    def url(self) -> str:
        self._raise()

    @property
    def model_name(self) -> str:
        self._raise()

    @property
    def pid(self) -> int | None:
        self._raise()

    @property
    def startup(self) -> StartupOutcome | None:
        self._raise()

    @property
    def memory(self) -> StartupMemory | None:
        self._raise()

    @property
    def notes(self) -> list[str]:
        self._raise()

    @property
    def log_path(self) -> Path | None:
        self._raise()

    def alive(self) -> bool:
        self._raise()

    def log_text(self) -> str:
        self._raise()


class PlannedServer:
    """Stands in for a server under --vllm-preflight when the plan predicts it fits: nothing runs, loads are not
    measured (vllm_load returns a planned result), the report says `planned`."""

    def __init__(self, config: VLLMConfig, launched: VLLMConfig, result: Plan, notes: list[str]) -> None:
        self.config = config
        self.launched = launched
        self.plan = result
        self.pid: int | None = None
        self.memory: StartupMemory | None = None
        self.log_path: Path | None = None
        self.startup: StartupOutcome | None = StartupOutcome(True, "planned", 0.0, 0)
        self.notes = [*notes, "planned by --vllm-preflight, not measured: no server was started"]

    def _nothing_runs(self, name: str) -> NoReturn:
        raise AttributeError(
            f"{name}: under --vllm-preflight no server runs (the config was planned, not started); "
            "only vllm_load and the plan are available"
        )

    @property
    def url(self) -> str:
        self._nothing_runs("url")

    @property
    def model_name(self) -> str:
        self._nothing_runs("model_name")

    def alive(self) -> bool:
        return True

    def log_text(self) -> str:
        return ""


def predicted_failure(config: VLLMConfig, launched: VLLMConfig, result: Plan, advice: list[str]) -> VLLMStartupError:
    """The VLLMStartupError a real startup of a config predicted not to fit would raise, with the plan's figures."""
    sure = "" if result.sure else " (the verdict is within the estimate's range: a real startup may differ)"
    kind = cast(FailureKind, result.verdict)  # plan.VERDICTS other than "fits" are all failure kinds
    diagnosis = Diagnosis(
        kind=kind,
        summary=f"predicted by the plan, not measured: {result.summary}{sure}",
        root_cause=tuple(line.strip() for line in result.lines()[1:]),
        figures=plan_figures(result),
    )
    return VLLMStartupError(
        diagnosis, launched, None, StartupOutcome(False, result.verdict, 0.0, 0), advice, config=config
    )


def planned_or_raise(
    plans: SessionPlans, config: VLLMConfig, launched: VLLMConfig, result: Plan | None, notes: list[str]
) -> PlannedServer:
    """--vllm-preflight: a PlannedServer when the plan fits, else the predicted VLLMStartupError. A model that
    cannot be planned raises Unplannable with the reason (the pytest adapter reports it as a skip)."""
    if result is None:
        why = plans.reports.get(launched, {}).get("error", "no plan")
        raise Unplannable(f"--vllm-preflight cannot plan this config: {why}")
    if not result.fits:
        found = plans.plans[launched]
        raise predicted_failure(config, found.planned_config, result, plan_advice(result, found.replan))
    return PlannedServer(config, launched, result, notes)
