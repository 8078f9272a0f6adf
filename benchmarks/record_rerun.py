"""The first thing a new user does, done for real N times: record a baseline, run the same suite again with the
defaults, and count the reruns the gate fails (issue 25's target: no failure in 20 tries).

Each try is a fresh directory with a one-test suite (the README's first test shape: the tiny model, `vllm_load`
of 64 prompts at concurrency 8, 64 tokens, the defaults: `repeat=1`, confirmation on); `pytest
--vllm-update-baseline` records, then a plain `pytest` reruns it against that baseline, each a separate pytest
process with its own vLLM CPU server, as two CI jobs would be. What the gate decided (every comparison, the
confirmation notes, the fresh servers it started) comes from the rerun's results JSON.

    python benchmarks/record_rerun.py [--tries 20] [--json results/record_rerun.json]

About 2-3 minutes a try on 2 cores (two server startups, more when a confirmation starts fresh servers).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from gate_noise import write_json  # noqa: E402  (the atomic JSON write the gate benchmarks share)

SUITE = """
from pytest_vllm_mem import VLLMConfig
import pytest

@pytest.mark.parametrize("vllm_config", [VLLMConfig("tiny", gpu_memory_utilization=0.1, max_model_len=1024)])
def test_serving(vllm_server, vllm_load):
    assert vllm_load(num_prompts=64, concurrency=8, max_tokens=64).ok
"""


def _pytest(workdir: Path, results: Path, *args: str) -> tuple[int, str]:
    """One pytest process over the suite (the plugin as installed); its exit code and the tail of its output."""
    command = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", f"--vllm-results={results}", *args]
    done = subprocess.run(command, cwd=workdir, capture_output=True, text=True, timeout=1800)
    return done.returncode, (done.stdout + done.stderr)[-3000:]


def _load_figures(load: dict[str, Any]) -> dict[str, Any]:
    keys = ("output_throughput", "cpu_ms_per_token", "others_cpu_share")
    return {key: load.get(key) for key in keys}


def one_try(workdir: Path) -> dict[str, Any]:
    (workdir / "test_first.py").write_text(SUITE)
    baseline = workdir / "baselines.json"
    started = time.monotonic()
    code, output = _pytest(workdir, workdir / "record.json", f"--vllm-baseline={baseline}", "--vllm-update-baseline")
    if code != 0:
        return {"recorded": False, "exit": code, "output": output}
    code, output = _pytest(workdir, workdir / "rerun.json", f"--vllm-baseline={baseline}")
    (test,) = json.loads((workdir / "rerun.json").read_text())["tests"]
    (recorded,) = json.loads((workdir / "record.json").read_text())["tests"]
    return {
        "recorded": True,
        "exit": code,
        "outcome": test.get("outcome"),
        "baseline_status": test.get("baseline_status"),  # "compared": the rerun was judged against the record
        "failing": [
            f"{c['metric']} {c['status']}: {c.get('detail', '')}"
            for c in test.get("comparisons", [])
            if c.get("status") == "regressed"
        ],
        # Provisional: near-limit throughput and latency verdicts against a baseline of one session warn, not fail.
        "warned": [
            f"{c['metric']}: {c.get('detail', '')}" for c in test.get("comparisons", []) if c.get("status") == "warned"
        ],
        "notes": test.get("notes", []),
        "sessions": len(test.get("loads", [])),
        # What each load read, to tell a busy moment from a slow server: the recording's, then the rerun's sessions.
        "loads": [_load_figures(load) for load in (*recorded.get("loads", []), *test.get("loads", []))],
        "seconds": time.monotonic() - started,
        "output": output if code != 0 else "",
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tries", type=int, default=20)
    parser.add_argument("--json", default=str(ROOT / "results" / "record_rerun.json"))
    args = parser.parse_args()
    out = Path(args.json)
    data: dict[str, Any] = {"date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "tries": []}
    for number in range(1, args.tries + 1):
        with tempfile.TemporaryDirectory(prefix="vllm-mem-record-rerun-") as tmp:
            found = one_try(Path(tmp))
        data["tries"].append(found)
        write_json(out, data)  # after every try: a stopped run keeps what it measured
        if not found["recorded"]:
            verdict = "not recorded"
        elif found["baseline_status"] != "compared":
            verdict = "not compared"
        else:
            verdict = "FAILED" if found["exit"] else "passed"
        extra = f" ({'; '.join(found['failing'])})" if found.get("failing") else ""
        if found.get("warned"):
            extra += f" warned: {', '.join(item.split(':')[0] for item in found['warned'])}"
        print(f"try {number}: {verdict} on {found.get('sessions', 0)} session(s){extra}", flush=True)
    recorded = [t for t in data["tries"] if t["recorded"] and t["baseline_status"] == "compared"]
    failed = [t for t in recorded if t["exit"]]
    warned = [t for t in recorded if t.get("warned")]
    print(
        f"record, then rerun with the defaults: {len(failed)} of {len(recorded)} reruns failed, {len(warned)} warned",
        flush=True,
    )


if __name__ == "__main__":
    main()
