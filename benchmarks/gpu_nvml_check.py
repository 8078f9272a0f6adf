"""Check the GPU memory probe against nvidia-smi on a real torch allocation (needs an NVIDIA GPU; about a minute).

A child process makes a CUDA context on the first visible GPU, then allocates and fills N GiB with torch, then frees
it. The plugin's probe (detect_devices -> make_probe -> MemorySampler over the child's process tree, exactly as a
server is measured) reads each phase, and so does `nvidia-smi` (device `memory.used`, and the child's `used_memory`
from `--query-compute-apps`). Checks, each printed with its figures:

- device resolution: the first visible GPU found by index, by full UUID and by a UUID prefix is the same device, and
  its total is nvidia-smi's `memory.total`;
- the allocation: the probe's rise from context to allocated is N GiB (within torch's 2 MiB rounding and 64 MiB);
- per process (when the driver lists the child: not under some container runtimes): the probe's reading equals
  nvidia-smi's `used_memory` for the child, to the MiB;
- per device: the probe's device `used` moved as nvidia-smi's `memory.used` did (deltas: NVML's v1 `used` that the
  probe reads counts reserved memory that nvidia-smi shows apart, so absolute values differ by a constant);
- the sampler's peak over the allocation is at least N GiB, it saw the free, and it missed no sample.

    python3 benchmarks/gpu_nvml_check.py [--gib 4] [--json out.json]      (exit 0: every check passed)

It has not been run yet on a real GPU: no session so far had one (see the README's GPU section).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pytest_vllm_mem.memory import MemorySampler, detect_devices, make_probe, server_devices  # noqa: E402
from pytest_vllm_mem.units import GIB, format_bytes  # noqa: E402

MIB = 2**20
ALLOCATION_SLACK = 64 * MIB  # torch rounds to 2 MiB blocks; the caching allocator may add a block
SETTLE_S = 0.3  # the sampler's period is 50 ms: a few samples land in each phase

# The child: a CUDA context, then N GiB allocated and written (so it is resident on the device), then freed.
_CHILD = r"""
import sys, torch
size = int(float(sys.argv[1]) * 2**30)
torch.zeros(1, device="cuda:0"); torch.cuda.synchronize()
print("context", flush=True)
sys.stdin.readline()
block = torch.empty(size, dtype=torch.uint8, device="cuda:0"); block.fill_(1); torch.cuda.synchronize()
print("allocated", torch.cuda.memory_reserved(0), flush=True)
sys.stdin.readline()
del block; torch.cuda.empty_cache(); torch.cuda.synchronize()
print("freed", flush=True)
sys.stdin.readline()
"""


@dataclass
class Phase:
    """One phase of the child, read by the probe and by nvidia-smi at about the same moment."""

    t: float
    probe_bytes: int  # the sampler's reading for the child (0 where it missed: a failed check shows it)
    probe_device_used: int
    smi_used: int
    smi_process: int | None  # None: nvidia-smi lists no compute process for the child


def smi(*args: str) -> list[list[str]]:
    output = subprocess.run(
        ["nvidia-smi", *args, "--format=csv,noheader,nounits"], capture_output=True, text=True, timeout=30, check=True
    ).stdout
    return [[cell.strip() for cell in line.split(",")] for line in output.splitlines() if line.strip()]


def smi_device(query: str, device: str) -> int:
    return int(float(smi(f"--query-gpu={query}", "-i", device)[0][0])) * MIB


def smi_process(pid: int, device_uuid: str | None) -> int | None:
    for row in smi("--query-compute-apps=pid,gpu_uuid,used_memory"):
        if int(row[0]) == pid and (device_uuid is None or row[1] == device_uuid):
            return int(float(row[2])) * MIB
    return None


def expect(child: subprocess.Popen[str], word: str) -> list[str]:
    assert child.stdout is not None
    line = child.stdout.readline().split()
    if not line or line[0] != word:
        raise SystemExit(f"the torch child said {line!r}, expected {word!r} (does torch see a GPU?)")
    return line


def send(child: subprocess.Popen[str]) -> None:
    assert child.stdin is not None
    child.stdin.write("\n")
    child.stdin.flush()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, default=4.0, help="GiB the child allocates (default 4)")
    parser.add_argument("--json", type=Path, help="write every figure and check here")
    args = parser.parse_args()
    if shutil.which("nvidia-smi") is None:
        print("nvidia-smi is not on PATH: this check needs an NVIDIA GPU host", file=sys.stderr)
        return 2
    checks: list[dict[str, Any]] = []

    def check(name: str, ok: bool, detail: str) -> None:
        checks.append({"check": name, "ok": bool(ok), "detail": detail})
        print(f"{'PASS' if ok else 'FAIL'}  {name}: {detail}", flush=True)

    visible = detect_devices()
    device = visible[0]
    if device.backend != "cuda":
        print(f"no GPU found through NVML (device {device.name}): this check needs an NVIDIA GPU", file=sys.stderr)
        return 2
    smi_id = device.uuid or str(device.index)
    print(f"device: {device.label} {device.name} {format_bytes(device.total_bytes)} {device.uuid}", flush=True)
    if device.uuid:
        by_uuid = detect_devices(device.uuid)[0]
        by_prefix = detect_devices(device.uuid[:12])[0]
        check(
            "resolution",
            by_uuid == device == by_prefix and detect_devices(str(device.index))[0].index == device.index,
            f"index {device.index}, UUID {device.uuid} and prefix {device.uuid[:12]} name one device",
        )
    smi_total = smi_device("memory.total", smi_id)
    check(
        "total",
        abs(smi_total - device.total_bytes) < MIB,
        f"probe {device.total_bytes / MIB:.0f} MiB, nvidia-smi {smi_total / MIB:.0f} MiB",
    )

    probe = make_probe(server_devices(visible, {}))  # as a server is measured: created before its processes
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": smi_id}
    child = subprocess.Popen(
        [sys.executable, "-c", _CHILD, str(args.gib)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env
    )
    sampler = MemorySampler(probe, child.pid, close_probe=True).start()
    figures: dict[str, Any] = {"gib": args.gib, "device": device.name, "uuid": device.uuid}
    try:
        phases: dict[str, Phase] = {}
        for phase in ("context", "allocated", "freed"):
            if phase != "context":
                send(child)
            line = expect(child, phase)
            if phase == "allocated":
                figures["torch_reserved_bytes"] = int(line[1])
            time.sleep(SETTLE_S)
            started = sampler.mark(phase)
            reading = sampler.sample_now()
            phases[phase] = Phase(
                started,
                reading or 0,
                probe.device_used_bytes(),
                smi_device("memory.used", smi_id),
                smi_process(child.pid, device.uuid),
            )
        send(child)
        child.wait(timeout=60)
    finally:
        if child.poll() is None:
            child.kill()
        sampler.stop()
    figures["phases"] = {name: asdict(phase) for name, phase in phases.items()}
    figures["mode"] = getattr(probe, "mode", None)
    context, allocated, freed = phases["context"], phases["allocated"], phases["freed"]
    size = int(args.gib * GIB)

    rise = allocated.probe_bytes - context.probe_bytes
    check(
        "allocation",
        size - 2 * MIB <= rise <= size + ALLOCATION_SLACK,
        f"probe rose {rise / MIB:.0f} MiB for a {size / MIB:.0f} MiB tensor (torch reserved "
        f"{figures['torch_reserved_bytes'] / MIB:.0f} MiB; mode {figures['mode']})",
    )
    if allocated.smi_process is None:
        check(
            "per process",
            figures["mode"] == "device_delta",
            "nvidia-smi lists no compute process for the child (PID namespace?): the probe must then be in "
            f"device_delta mode; it is in {figures['mode']}",
        )
    else:
        for phase in ("context", "allocated"):
            ours, theirs = phases[phase].probe_bytes, phases[phase].smi_process or 0
            check(
                f"per process ({phase})",
                abs(ours - theirs) < MIB,
                f"probe {ours / MIB:.0f} MiB, nvidia-smi used_memory {theirs / MIB:.0f} MiB",
            )
    probe_delta = allocated.probe_device_used - context.probe_device_used
    smi_delta = allocated.smi_used - context.smi_used
    check(
        "per device",
        abs(probe_delta - smi_delta) <= 4 * MIB,
        f"device used rose {probe_delta / MIB:.0f} MiB (probe) and {smi_delta / MIB:.0f} MiB (nvidia-smi); "
        f"absolute: probe {allocated.probe_device_used / MIB:.0f} MiB, nvidia-smi "
        f"{allocated.smi_used / MIB:.0f} MiB",
    )
    peak = sampler.peak_between(context.t, freed.t)
    check(
        "peak",
        peak - context.probe_bytes >= size - 2 * MIB,
        f"peak {peak / MIB:.0f} MiB over the context's {context.probe_bytes / MIB:.0f} MiB",
    )
    check(
        "free seen",
        freed.probe_bytes <= allocated.probe_bytes - size + ALLOCATION_SLACK,
        f"after the free the probe read {freed.probe_bytes / MIB:.0f} MiB",
    )
    check(
        "no missing sample",
        sampler.missed_samples == 0,
        f"{sampler.missed_samples} missed of {sampler.missed_samples + len(sampler.samples)}"
        + (f": {sampler.missed_reason}" if sampler.missed_reason else ""),
    )
    figures["samples"] = len(sampler.samples)
    figures["checks"] = checks
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2) + "\n")
    failed = [c["check"] for c in checks if not c["ok"]]
    print("all checks passed" if not failed else f"FAILED: {', '.join(failed)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
