"""Live progress against a real vLLM CPU server: one inner session, one startup (reused by a second test).

The phases appear in the order vLLM logged them, each at the time its log line was written (the -v header gives the
launch's wall clock, each phase line its elapsed time; the log's own timestamps have whole seconds), and the outcome
lines carry the figures the results JSON keeps."""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest
from e2e import record, run_inner

from pytest_vllm_mem.diagnosis.diagnose import STARTUP_PHASES
from pytest_vllm_mem.launch.watch import StartupReader
from pytest_vllm_mem.units import format_bytes

pytestmark = pytest.mark.e2e

INNER = """
import pytest
from pytest_vllm_mem import VLLMConfig

OK = VLLMConfig("tiny", gpu_memory_utilization=0.1, max_model_len=1024)

@pytest.mark.parametrize("vllm_config", [OK], ids=["A"])
def test_load(vllm_server, vllm_load):
    assert vllm_load(num_prompts=96, concurrency=8, max_tokens=32).ok

@pytest.mark.parametrize("vllm_config", [OK], ids=["again"])
def test_reused(vllm_server):
    pass
"""

HEADER = re.compile(r"\[vllm-mem\] (\S+): starting (.+) \(at (\d\d):(\d\d):(\d\d)\.(\d), log (.+)\)$")
PHASE = re.compile(r"\[vllm-mem\]   \+(\d+\.\d)s (.+)$")  # then the phase, then (new figures) if any
PHASE_NAMES = list(STARTUP_PHASES)
READY = re.compile(r"\[vllm-mem\]   ready in (\d+\.\d)s: (.*); peak (.+?) of the (\S+) tier(?:, ([^()]+))? \((\d+)%\)$")
TICK = re.compile(r"\[vllm-mem\]   load 1: (\d+)/96 done, (\d+) failed, (\d+) tok/s, peak (.+)$")
DONE = re.compile(
    r"\[vllm-mem\]   load 1 done: (\d+)/96 in (\d+\.\d)s, (\d+) failed, (\d+\.\d) output tok/s, "
    r"peak (.+)$"
)
LOG_TIME = re.compile(r"\b(\d\d)-(\d\d) (\d\d):(\d\d):(\d\d)\b")


def _log_phase_times(log: Path) -> dict[str, float]:
    """Epoch seconds (whole, as vLLM prints them) of the log line that started each phase."""
    reader = StartupReader()
    year = time.localtime().tm_year
    times: dict[str, float] = {}
    for line in log.read_text(errors="replace").splitlines():
        phase = reader.feed(line)
        stamp = LOG_TIME.search(line)
        if phase and stamp:
            month, day, hour, minute, second = (int(part) for part in stamp.groups())
            times[phase] = time.mktime((year, month, day, hour, minute, second, 0, 0, -1))
    return times


def test_progress_of_a_real_startup_and_load(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_inner=INNER)
    result, data = run_inner(pytester, "-v")
    result.assert_outcomes(passed=2)
    lines = [line for line in result.stdout.lines if line.startswith("[vllm-mem]")]
    print("\n".join(lines))
    assert len(lines) <= 25, "progress drowns the output"

    header = HEADER.match(lines[0])
    assert header, lines[0]
    assert (
        header.group(1).endswith("test_load[A]")
        and header.group(2) == "tiny gpu-memory-utilization=0.1 max-model-len=1024"
    )
    hour, minute, second, tenths = (int(part) for part in header.group(3, 4, 5, 6))
    now = time.localtime()
    launched = time.mktime((now.tm_year, now.tm_mon, now.tm_mday, hour, minute, second, 0, 0, -1)) + tenths / 10

    # Phases in order, each shown within a few health polls of its log line (log stamps are whole seconds: -1 s).
    ready_at = next(i for i, line in enumerate(lines) if READY.match(line))
    matched = [match for line in lines[1:ready_at] if (match := PHASE.match(line))]
    shown = [match for match in matched if not match.group(2).startswith("still ")]
    phases = [max((name for name in PHASE_NAMES if match.group(2).startswith(name)), key=len) for match in shown]
    logged = _log_phase_times(Path(header.group(7)))
    assert phases == [phase for phase in logged if phase in phases] and len(phases) >= 5, (phases, logged)
    assert phases[0] == "initializing the engine" and phases[-1] == "serving"
    elapsed = [float(match.group(1)) for match in shown]
    assert elapsed == sorted(elapsed)
    for phase, seconds in zip(phases, elapsed):
        lag = launched + seconds - logged[phase]
        assert -0.6 <= lag <= 3.0, f"{phase}: shown {lag:+.1f} s after its log line"

    fits = record(data, "test_load[A]")
    ready = READY.match(lines[ready_at])
    assert ready is not None
    assert float(ready.group(1)) == pytest.approx(fits["startup"]["duration_s"], abs=0.051)
    assert (
        f"KV cache {fits['memory']['kv_cache_gib']:.2f} GiB, {fits['memory']['kv_cache_tokens']:,} tokens"
        in ready.group(2)
    )
    assert ready.group(3) == format_bytes(fits["startup"]["peak_memory_bytes"])
    assert ready.group(4) == fits["tier"].split()[0]  # "24gb", or "auto" with the size after it
    assert ready.group(5) in (None, format_bytes(fits["tier_bytes"]))
    assert int(ready.group(6)) == round(100 * fits["startup"]["peak_memory_bytes"] / fits["tier_bytes"])

    load = fits["loads"][0]
    (done,) = [match for line in lines if (match := DONE.match(line))]
    assert int(done.group(1)) == load["completed"] == 96 and int(done.group(3)) == load["failed"] == 0
    assert float(done.group(2)) == pytest.approx(load["duration_s"], abs=0.051)
    assert float(done.group(4)) == pytest.approx(load["output_throughput"], abs=0.051)
    assert done.group(5) == format_bytes(load["peak_memory_bytes"])
    # Plain lines during the load: at most one per 5 s, counts only going up.
    ticks = [match for line in lines if (match := TICK.match(line))]
    assert len(ticks) <= load["duration_s"] / 5 + 1
    counts = [int(tick.group(1)) for tick in ticks]
    assert counts == sorted(counts) and all(count <= 96 for count in counts)
    if load["duration_s"] > 6:
        assert ticks, "a load of several seconds showed no progress"

    assert lines[-1].startswith("[vllm-mem] ") and "test_reused[again]: reusing the server for tiny " in lines[-1]
    assert data["server_startups"] == 1
