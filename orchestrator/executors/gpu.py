"""Fail loudly on an unusable GPU: nvidia-smi lists NVIDIA GPUs, but torch in the run's Python cannot use CUDA.

torch's CUDA wheels need a recent enough driver; on an older one (or with a CPU-only build) torch sees no GPU,
the harness picks its CPU profile and the loop would quietly train on the CPU of a GPU machine all night. The
controller never imports torch (slow; `autoloop --help` stays fast): harness.query learns torch's view in the
subprocess it runs with the run's Python, and this module compares it with what nvidia-smi reports.
"""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from collections import Counter
from dataclasses import dataclass, field

from .. import LoopError

SMI_TIMEOUT_S = 10.0  # a wedged driver can make nvidia-smi hang; better no answer than no start
INDEX_URL = "https://download.pytorch.org/whl/"
CUDA_INDEXES = ((11, 8), (12, 1), (12, 4), (12, 6), (12, 8), (12, 9), (13, 0))  # PyTorch's cuXYZ wheel indexes
ESCAPE = "To run on the CPU on purpose, set AUTOLOOP_DEVICE=cpu."


@dataclass(frozen=True)
class Driver:
    """What nvidia-smi reports: the GPUs, the driver version and the newest CUDA version that driver supports."""

    gpus: tuple[str, ...]  # names, one per GPU, e.g. "NVIDIA H100 80GB HBM3"
    version: str  # e.g. "535.104.05"; "unknown" when only `nvidia-smi -L` answered
    cuda: tuple[int, int] | None  # e.g. (12, 2), from the "CUDA Version: 12.2" of the header


def parse_list(text: str) -> list[str]:
    """GPU names from `nvidia-smi -L` ("GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-...)"); MIG lines are skipped."""
    return [
        m.group(1).strip()
        for line in text.splitlines()
        if (m := re.match(r"GPU \d+: (.*?)\s*(?:\(UUID: [^)]*\))?\s*$", line))
    ]


def parse_header(text: str) -> tuple[str | None, tuple[int, int] | None]:
    """Driver version and CUDA version from plain `nvidia-smi` ("Driver Version: 535.104.05   CUDA Version: 12.2")."""
    version = re.search(r"Driver Version:\s*(\d[\d.]*)", text)
    cuda = re.search(r"CUDA Version:\s*(\d+)\.(\d+)", text)
    return (version.group(1) if version else None, (int(cuda.group(1)), int(cuda.group(2))) if cuda else None)


def smi(args: list[str], timeout: float = SMI_TIMEOUT_S) -> str | None:
    """stdout of a successful nvidia-smi call, else None. A driver wedged in the kernel can leave nvidia-smi
    unkillable: after the timeout it is killed and, if it still does not end, abandoned (never waited on)."""
    try:
        proc = subprocess.Popen(["nvidia-smi", *args], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    except OSError:
        return None
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        try:
            proc.communicate(timeout=1.0)
        except subprocess.TimeoutExpired:
            pass
        return None
    return out if proc.returncode == 0 else None


def nvidia_smi(timeout: float = SMI_TIMEOUT_S) -> Driver | None:
    """The NVIDIA GPUs this machine has, by nvidia-smi; None without nvidia-smi, when it fails, or lists none."""
    gpus = parse_list(smi(["-L"], timeout) or "")
    if not gpus:
        return None
    version, cuda = parse_header(smi([], timeout) or "")  # GPUs listed but no header: still GPUs, version unknown
    return Driver(tuple(gpus), version or "unknown", cuda)


def wheel_index(driver_cuda: tuple[int, int]) -> str | None:
    """The newest PyTorch CUDA wheel index (cu121, ...) not newer than what the driver supports; None: too old."""
    fitting = [v for v in CUDA_INDEXES if v <= driver_cuda]
    return f"cu{fitting[-1][0]}{fitting[-1][1]}" if fitting else None


def pip_command(python: str, torch_version: str | None, index: str) -> str:
    pin = f"torch=={torch_version.split('+')[0]}" if torch_version else "torch"
    return f"{shlex.quote(python)} -m pip install {pin} --index-url {INDEX_URL}{index}"


def _cuda_str(v: tuple[int, int]) -> str:
    return f"{v[0]}.{v[1]}"


def _parse_cuda(text: str | None) -> tuple[int, int] | None:
    m = re.match(r"(\d+)\.(\d+)", text or "")
    return (int(m.group(1)), int(m.group(2))) if m else None


def _gpu_names(gpus: tuple[str, ...]) -> str:
    return ", ".join(f"{n} x {name}" if n > 1 else name for name, n in Counter(gpus).items())


def _torch_build(torch: dict | None) -> str:
    if not torch or "version" not in torch:
        return "cannot be imported" + (f" ({torch['error']})" if torch and torch.get("error") else "")
    if torch.get("cuda"):
        return f"{torch['version']}, built for CUDA {torch['cuda']}"
    return f"{torch['version']}, {'a ROCm build' if torch.get('hip') else 'a CPU-only build'}"


def driver_problem(driver: Driver, torch: dict | None, python: str, env: dict[str, str]) -> str:
    """Why torch cannot use the GPUs nvidia-smi lists, and the command that fixes it."""
    torch_version = torch.get("version") if torch else None
    built_for = _parse_cuda(torch.get("cuda") if torch else None)
    supports = (
        f", which supports CUDA up to {_cuda_str(driver.cuda)}"
        if driver.cuda
        else " (nvidia-smi does not say which CUDA version it supports)"
    )
    lines = [
        f"nvidia-smi lists {len(driver.gpus)} NVIDIA GPU{'s' if len(driver.gpus) > 1 else ''} "
        f"({_gpu_names(driver.gpus)}), but torch cannot use CUDA: every experiment would run on the CPU.",
        f"  driver: {driver.version}{supports}",
        f"  torch:  {_torch_build(torch)} (python {python})",
    ]
    index = wheel_index(driver.cuda) if driver.cuda else None
    if driver.cuda and index is None:
        lines.append(
            "This driver is too old for every PyTorch CUDA build (the oldest, cu118, needs CUDA 11.8): "
            "update the driver."
        )
    elif driver.cuda is None:
        lines.append(
            "Install a torch build for a CUDA version this driver supports "
            "(https://pytorch.org/get-started/locally/), or update the driver."
        )
    elif built_for is not None and built_for <= driver.cuda and not (torch or {}).get("hip"):
        visible = env.get("CUDA_VISIBLE_DEVICES")
        lines.append(
            "This torch build should run on this driver, so the wheel is not the problem: check "
            + (f"CUDA_VISIBLE_DEVICES={visible!r}, " if visible is not None else "")
            + "that this process may open /dev/nvidia* (in a container: --gpus all), and "
            + f"`{shlex.quote(python)} -c 'import torch; torch.cuda.init()'` for torch's own reason."
        )
    else:
        why = f" (the installed one needs CUDA {_cuda_str(built_for)})" if built_for and built_for > driver.cuda else ""
        lines += [
            f"Install the build for CUDA {_cuda_str(max(v for v in CUDA_INDEXES if v <= driver.cuda))}, "
            f"the newest this driver runs{why}:",
            f"  {pip_command(python, torch_version, index)}",
            f"(if that index has no torch {torch_version.split('+')[0]}, leave out the version to get the "
            f"newest it has; or update the driver)"
            if torch_version
            else "(or update the driver)",
        ]
    lines.append(ESCAPE)
    return "\n".join(lines)


def profile_problem(driver: Driver | None, torch: dict | None, python: str) -> str:
    where = "nvidia-smi lists no NVIDIA GPU" if driver is None else f"driver {driver.version}"
    return (
        f"the gpu profile (--profile gpu / AUTOLOOP_PROFILE=gpu) needs CUDA, but torch "
        f"{_torch_build(torch)} (python {python}) cannot use it ({where}).\n"
        "Leave out --profile (the harness picks cpu without CUDA) or choose --profile cpu; or set "
        "AUTOLOOP_DEVICE=cpu to run the gpu profile's harness on the CPU on purpose (e.g. for a test)."
    )


def _device_chosen(env: dict[str, str]) -> bool:
    """AUTOLOOP_DEVICE names a device other than CUDA: the CPU (or mps) is chosen on purpose."""
    device = env.get("AUTOLOOP_DEVICE", "").strip()
    return bool(device) and not device.startswith("cuda")


def _gpus_hidden(env: dict[str, str], gpus: list[str] | None) -> bool:
    """`--gpus ''` or a CUDA_VISIBLE_DEVICES that lists none: CPU slots on purpose."""
    if gpus is not None:
        return not gpus
    visible = env.get("CUDA_VISIBLE_DEVICES")
    return visible is not None and not [d for d in visible.split(",") if d.strip() and d.strip() != "-1"]


@dataclass
class Check:
    """The GPU check before experiment 1: start() before harness.query (nvidia-smi), finish() with its torch view.

    It applies where the runs execute on this machine (the local executor, or Ray without a cluster address).
    """

    env: dict[str, str]
    profile: str | None = None
    driver: Driver | None = None
    check_driver: bool = False
    check_profile: bool = False
    python: str = field(default=sys.executable)  # the run's Python, as harness.query uses

    @classmethod
    def start(cls, settings, env: dict[str, str]) -> Check:
        options = settings.executor_options
        here = settings.executor in ("local", "inline") or not (options.get("ray_address") or env.get("RAY_ADDRESS"))
        check = cls(env=env, profile=settings.profile)
        if here and not _device_chosen(env):
            check.check_profile = settings.profile == "gpu"
            if not _gpus_hidden(env, options.get("gpus")):
                check.driver = nvidia_smi()
                check.check_driver = check.driver is not None
        return check

    @property
    def needs_torch(self) -> bool:
        return self.check_driver or self.check_profile

    def finish(self, torch: dict | None) -> None:
        """LoopError when nvidia-smi lists GPUs torch cannot use, or the gpu profile is asked for without CUDA."""
        usable = bool(torch and torch.get("available"))
        if self.check_driver and not usable:
            raise LoopError(driver_problem(self.driver, torch, self.python, self.env))
        if self.check_profile and not usable:
            raise LoopError(profile_problem(self.driver, torch, self.python))
