"""What untrusted code gets to see: an allow-listed environment, and text for an LLM without the secrets.

Every edit of train.py comes from a search, a person, an LLM or a coding agent, and then runs: it gets the
variables a run needs (autoloop's, PATH, locale, device selection, proxies, the Python and CUDA setup), never
the controller's API keys, tokens, cloud credentials or agent sockets; `--pass-env NAME` adds one on purpose.
With bubblewrap, each step also runs in an OS sandbox (sandboxed(): below) that holds as root.
"""

from __future__ import annotations

import atexit
import glob
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterable, Mapping
from pathlib import Path

ALLOWED = {
    "PATH",
    "HOME",
    "TMPDIR",
    "PYTHONUSERBASE",
    "PYTHONNOUSERSITE",
    "XDG_CONFIG_HOME",
    "XDG_DATA_HOME",
    "LANG",
    "LANGUAGE",
    "TZ",
    "TERM",
    "USER",
    "LOGNAME",
    "SHELL",
    "PYTHONPATH",
    "PYTHONHASHSEED",
    "PYTHONUNBUFFERED",
    "VIRTUAL_ENV",
    "CONDA_PREFIX",
    "CONDA_DEFAULT_ENV",
    "LD_LIBRARY_PATH",
    "OMP_NUM_THREADS",
    "MKL_NUM_THREADS",
    "OPENBLAS_NUM_THREADS",
    "NUMEXPR_NUM_THREADS",
    "SSL_CERT_FILE",
    "SSL_CERT_DIR",
    "REQUESTS_CA_BUNDLE",
    "CURL_CA_BUNDLE",
    "HTTP_PROXY",
    "HTTPS_PROXY",
    "NO_PROXY",
    "ALL_PROXY",
    "http_proxy",
    "https_proxy",
    "no_proxy",
    "all_proxy",
    "HF_HOME",
    "HF_HUB_CACHE",
    "HF_DATASETS_CACHE",
    "HF_HUB_OFFLINE",
    "HF_ENDPOINT",
    "XDG_CACHE_HOME",
    "GLIBC_TUNABLES",
}
ALLOWED_PREFIXES = (
    "AUTOLOOP_",
    "LC_",
    "CUDA_",
    "NVIDIA_",
    "NCCL_",
    "CUBLAS_",
    "CUDNN_",
    "TORCH_",
    "TORCHINDUCTOR_",
    "PYTORCH_",
    "TRITON_",
    "HIP_",
    "ROCR_",
    "ROCM_",
    "HSA_",
    "MIOPEN_",
    "KMP_",
    "GOMP_",
)
# A name that says it holds a secret is never passed on by a pattern, even under an allowed prefix.
SECRET_NAME = re.compile(r"KEY|TOKEN|SECRET|PASSW|CREDENTIAL|AUTH|COOKIE|SESSION|PRIVATE|SIGNATURE", re.IGNORECASE)
MIN_SECRET_CHARS = 6  # shorter values ("1", "true") would redact half the prompt


def allowed_env(environ: dict[str, str] | None = None, pass_env: tuple[str, ...] = ()) -> dict[str, str]:
    """The variables of `environ` (default: this process's) that a run or an agent may see."""
    environ = dict(os.environ if environ is None else environ)
    out = {
        k: v
        for k, v in environ.items()
        if (k in ALLOWED or k.startswith(ALLOWED_PREFIXES)) and not SECRET_NAME.search(k)
    }
    out.update({k: environ[k] for k in pass_env if k in environ})
    return out


def secret_values(environ: Mapping[str, str] | None = None) -> list[str]:
    """The values of the controller's secret-looking variables, longest first."""
    env = os.environ if environ is None else environ
    return sorted(
        {v for k, v in env.items() if SECRET_NAME.search(k) and len(v) >= MIN_SECRET_CHARS}, key=len, reverse=True
    )


def redact(text: str, environ: Mapping[str, str] | None = None) -> str:
    """`text` with every secret value of the controller's environment replaced by [redacted NAME]."""
    env = os.environ if environ is None else environ
    names: dict[str, str] = {}
    for k, v in env.items():
        if SECRET_NAME.search(k) and len(v) >= MIN_SECRET_CHARS:
            names.setdefault(v, k)
    for value in secret_values(env):
        text = text.replace(value, f"[redacted {names[value]}]")
    return text


# ---------------------------------------------------------------------------
# The OS sandbox (Linux, bubblewrap): a step writes only its own directories, reaches no network, sees no other
# process and no socket of the host, holds no capability (root included), and leaves nothing running behind it
# ---------------------------------------------------------------------------

_PROBE: dict = {}  # "result": sandbox_problem(); "machine" (what works here: see FULL), "note"; probed once
_EMPTY: list[str] = []  # the empty file bound over a hidden one (made on first use)
# Every step gets its own PID, IPC, UTS and cgroup namespaces (our processes, their environments and our SysV
# shared memory are out of sight), no capability even as root (root keeps them in a bare bwrap: it remounted /
# read-write and joined our network namespace), its own terminal session (no keystrokes pushed into ours), and
# dies with us. With its own PID namespace, bwrap's pid 1 exits when the step does and takes every process
# left in the namespace with it: a double-forked setsid daemon does not outlive the step.
_ISOLATE = (
    "--unshare-pid",
    "--unshare-ipc",
    "--unshare-uts",
    "--unshare-cgroup-try",
    "--cap-drop",
    "ALL",
    "--new-session",
    "--die-with-parent",
)
# A user namespace, strongest first: where the kernel or a container forbids one the step keeps our uid (still
# without capabilities); --disable-userns (bubblewrap 0.8) keeps the step from making one of its own.
_USERNS = (("--unshare-user", "--disable-userns"), ("--unshare-user",), ())
FULL = {"bwrap": "bwrap", "userns": _USERNS[0], "perms": True}  # what the probe finds on a recent Linux
# Emptied for every step: where the host's Unix sockets live (tmux, ssh-agent, docker, D-Bus; the network
# namespace covers abstract ones) and its shared memory. Read-only but /dev/shm, which a step's own processes
# share (DataLoader workers, semaphores).
MASKED = ("/tmp", "/var/tmp", "/run", "/dev/shm")
SHARED_MEMORY = "/dev/shm"
NVIDIA_SHARED = (
    "/dev/nvidiactl",
    "/dev/nvidia-uvm",
    "/dev/nvidia-uvm-tools",
    "/dev/nvidia-modeset",
    "/dev/nvidia-caps",
)  # -caps: MIG instances
ROCM = ("/dev/kfd", "/dev/dri")
# Variables of a run's environment naming what it reads: bound back read-only where they lie under a mask
READ_VARS = (
    "AUTOLOOP_CACHE",
    "PYTHONUSERBASE",
    "VIRTUAL_ENV",
    "CONDA_PREFIX",
    "HF_HOME",
    "HF_HUB_CACHE",
    "HF_DATASETS_CACHE",
    "SSL_CERT_FILE",
    "SSL_CERT_DIR",
    "REQUESTS_CA_BUNDLE",
    "CURL_CA_BUNDLE",
)
READ_LIST_VARS = ("PYTHONPATH", "LD_LIBRARY_PATH")


def sandbox_problem() -> str:
    """'' where bubblewrap can confine a run on this machine, else why not (checked once per process, with the
    whole set of arguments a step gets: a user namespace that cannot be made here is left out, see sandbox_note)."""
    if "result" not in _PROBE:
        _PROBE.update(_probe())
    return _PROBE["result"]


def sandbox_note() -> str:
    """'' where the sandbox is complete, else what this machine leaves out of it (one line for the console)."""
    sandbox_problem()
    return _PROBE.get("note", "")


def _probe() -> dict:
    if not sys.platform.startswith("linux"):
        return {"result": f"no OS sandbox on {sys.platform} (bubblewrap is Linux only)"}
    bwrap = shutil.which("bwrap")
    if bwrap is None:
        return {"result": "bubblewrap is not installed (apt-get install bubblewrap, dnf install bubblewrap)"}
    known = _options(bwrap)
    _load_nvidia_uvm()
    errors = []
    for userns in _USERNS:
        if missing := [o for o in userns if known and o not in known]:  # an older bubblewrap: no need to try
            errors.append(f"this bubblewrap has no {' '.join(missing)}")
            continue
        machine = {"bwrap": bwrap, "userns": userns, "perms": not known or "--perms" in known}
        try:
            proc = subprocess.run(
                _command(machine, ["true"], [], False, [], [], [], gpu_devices(None)),
                capture_output=True,
                text=True,
                timeout=30,
            )
        except (OSError, subprocess.TimeoutExpired) as e:
            return {"result": f"bubblewrap cannot run here ({e})"}
        if proc.returncode == 0:
            return {"result": "", "machine": machine, "note": _weaker(userns, errors[0] if errors else "")}
        errors.append((proc.stderr.strip().splitlines() or ["?"])[-1][:160])
    return {"result": f"bubblewrap cannot run here ({errors[-1]})"}


def _options(bwrap: str) -> set[str]:
    """The options this bubblewrap knows (its --help), or none where it does not say: then all are tried."""
    try:
        text = subprocess.run([bwrap, "--help"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return set()
    return set(re.findall(r"^\s*(--[a-z0-9-]+)", text, re.MULTILINE))


def _weaker(userns: tuple[str, ...], why: str) -> str:
    if userns == _USERNS[0]:
        return ""
    if userns:
        return f"runs may make user namespaces of their own in the sandbox ({why})"
    return f"no user namespace for runs here ({why}): they keep our uid, without capabilities"


def _load_nvidia_uvm() -> None:
    """CUDA makes /dev/nvidia-uvm on first use (setuid nvidia-modprobe), which a sandboxed step cannot: make it."""
    if os.path.exists("/dev/nvidiactl") and not os.path.exists("/dev/nvidia-uvm") and shutil.which("nvidia-modprobe"):
        try:
            subprocess.run(["nvidia-modprobe", "-u", "-c=0"], capture_output=True, timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            pass  # CUDA in the sandbox will say what is missing


def gpu_devices(visible: str | None) -> list[str]:
    """The device nodes a step with this CUDA_VISIBLE_DEVICES needs: every NVIDIA GPU where it is unset (or
    names GPUs by UUID), those it lists by number, none where it is empty; ROCm's where they exist."""
    nodes = _nvidia_nodes()
    if visible is not None:
        ids = [v.strip() for v in visible.split(",") if v.strip()]
        if all(v.lstrip("-").isdigit() for v in ids):  # CUDA reads up to the first invalid (e.g. -1) entry
            numbers = [int(v) for v in ids]
            cut = next((k for k, n in enumerate(numbers) if not 0 <= n < len(nodes)), len(numbers))
            nodes = [nodes[n] for n in numbers[:cut]]
    return [*(NVIDIA_SHARED if nodes else ()), *nodes, *ROCM]


def _nvidia_nodes() -> list[str]:
    """/dev/nvidiaN of each GPU in nvidia-smi's order (PCI bus; CUDA's too on a machine of one GPU model), from
    the driver; else the nodes by number (in a container, only its own GPUs' nodes exist: index 0 is the first)."""
    by_bus = {}
    for info in glob.glob("/proc/driver/nvidia/gpus/*/information"):
        try:
            found = re.search(r"Device Minor:\s*(\d+)", Path(info).read_text())
        except OSError:
            continue
        if found and os.path.exists(f"/dev/nvidia{found[1]}"):
            by_bus[Path(info).parent.name.lower()] = int(found[1])
    minors = (
        [by_bus[bus] for bus in sorted(by_bus)]
        if by_bus
        else sorted(
            int(p[len("/dev/nvidia") :]) for p in glob.glob("/dev/nvidia[0-9]*") if p[len("/dev/nvidia") :].isdigit()
        )
    )
    return [f"/dev/nvidia{minor}" for minor in minors]


def python_paths() -> list[str]:
    """Where this Python and its packages live: a step runs our interpreter ({python})."""
    paths = {sys.prefix, sys.base_prefix, sys.exec_prefix, os.path.dirname(os.path.realpath(sys.executable))}
    return sorted(paths | {p for p in sys.path if os.path.isabs(p)})


def readable_paths(env: dict[str, str]) -> list[str]:
    """What a step with this environment reads besides the system: our Python, the prepared data
    (AUTOLOOP_CACHE), its PYTHONPATH and the like."""
    paths = [env[k] for k in READ_VARS if env.get(k)]
    paths += [p for k in READ_LIST_VARS for p in env.get(k, "").split(os.pathsep) if p]
    return [*python_paths(), *(p for p in paths if os.path.isabs(p))]


def sandboxed(
    cmd: list[str],
    writable: Iterable[str],
    net: bool,
    readable: Iterable[str] = (),
    hidden: Iterable[str] = (),
    read_only: Iterable[str] = (),
    devices: Iterable[str] | None = None,
) -> list[str]:
    """cmd run by bubblewrap: the filesystem read-only but `writable`, and within those `read_only`; empty
    /tmp, /var/tmp, /run, /dev/shm and $XDG_RUNTIME_DIR, with `readable` bound back where it lies in one;
    `hidden` files read as empty, hidden directories as empty ones; of /dev, the basic nodes and `devices`
    (default: gpu_devices(None)); no network unless `net`; no capability, no process of ours in sight.
    The step's processes stay under ours and end with its first: a timeout still kills all of them."""
    sandbox_problem()  # which bwrap, and whether a user namespace can be made here
    return _command(
        _PROBE.get("machine", FULL),
        cmd,
        writable,
        net,
        readable,
        hidden,
        read_only,
        gpu_devices(None) if devices is None else devices,
    )


def _command(
    machine: dict,
    cmd: list[str],
    writable: Iterable[str],
    net: bool,
    readable: Iterable[str],
    hidden: Iterable[str],
    read_only: Iterable[str],
    devices: Iterable[str],
) -> list[str]:
    """The bwrap command line. Order matters: a later mount lies on top of an earlier one (the masks, then what
    is bound back into them, then the writable directories, then what stays read-only or hidden within those)."""
    masks = _masks()
    if net:  # /etc/resolv.conf may point into /run (systemd-resolved)
        readable = [*readable, os.path.realpath("/etc/resolv.conf")]
    args = [
        machine["bwrap"],
        "--ro-bind",
        "/",
        "/",
        *machine["userns"],
        *_ISOLATE,
        *([] if net else ["--unshare-net"]),
        "--proc",
        "/proc",
        "--dev",
        "/dev",
    ]
    args += [a for d in _unique(devices) for a in ("--dev-bind-try", d, d)]
    sticky = ["--perms", "01777"] if machine["perms"] else []  # bubblewrap 0.5; for a setuid one without userns
    args += [a for m in masks for a in (*(sticky if m == SHARED_MEMORY else []), "--tmpfs", m)]
    # (never a mask itself: AUTOLOOP_CACHE=/tmp would bring back every socket in /tmp)
    args += [a for p in _forms(readable) if _under(p, masks) and p not in masks for a in ("--ro-bind-try", p, p)]
    args += [a for p in _unique(os.path.abspath(w) for w in writable) for a in ("--bind", p, p)]
    args += [a for p in _forms(read_only) if os.path.lexists(p) for a in ("--ro-bind-try", p, p)]
    args += [a for p in _forms(hidden) if os.path.lexists(p) for a in _hide(p)]
    args += [a for m in masks if m != SHARED_MEMORY for a in ("--remount-ro", m)]
    return [*args, "--", *cmd]


def _masks() -> list[str]:
    """MASKED and $XDG_RUNTIME_DIR (the user's sockets) where it exists outside them."""
    runtime = os.environ.get("XDG_RUNTIME_DIR", "")
    extra = [runtime] if os.path.isabs(runtime) and os.path.isdir(runtime) and not _under(runtime, MASKED) else []
    return [*MASKED, *extra]


def _hide(path: str) -> list[str]:
    if os.path.isdir(path):
        return ["--tmpfs", path, "--remount-ro", path]
    return ["--ro-bind", _empty_file(), path]  # not /dev/null: a bound device node cannot be opened (nodev)


def _empty_file() -> str:
    """A read-only empty file of ours (made again if a cleaner of /tmp removed it during a long session)."""
    if not _EMPTY or not os.path.isfile(_EMPTY[0]) or os.path.getsize(_EMPTY[0]):
        fd, path = tempfile.mkstemp(prefix="autoloop-empty-")
        os.close(fd)
        os.chmod(path, 0o444)
        atexit.register(lambda: Path(path).unlink(missing_ok=True))
        _EMPTY[:] = [path]
    return _EMPTY[0]


def _forms(paths: Iterable[str]) -> list[str]:
    """Each path as given (made absolute) and, where a symlink leads elsewhere, as resolved: a mount covers one
    place, and a step may reach the file through either."""
    forms = [f for p in paths for f in (os.path.abspath(p), os.path.realpath(p))]
    return _unique(forms)


def _unique(paths: Iterable[str]) -> list[str]:
    """Without repeats, parents before their children (a parent bound later would cover the child)."""
    return sorted(set(paths), key=lambda p: (p.rstrip("/").count("/"), p))


def _under(path: str, roots: Iterable[str]) -> bool:
    return any(path == root or path.startswith(root.rstrip("/") + "/") for root in roots)
