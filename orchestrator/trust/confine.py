"""What untrusted code gets to see: an allow-listed environment, and text for an LLM without the secrets.

Every edit of train.py comes from a search, a person, an LLM or a coding agent, and then runs: it gets the
variables a run needs (autoloop's, PATH, locale, device selection, proxies, the Python and CUDA setup), never
the controller's API keys, tokens, cloud credentials or agent sockets; `--pass-env NAME` adds one on purpose.
With bubblewrap, each step also runs in an OS sandbox (sandboxed(): below) that holds as root.
"""

from __future__ import annotations

import atexit
import glob
import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
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
FULL = {"bwrap": "bwrap", "userns": _USERNS[0], "perms": True, "size": True}  # what the probe finds on a recent Linux
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
# Deny by default: a step's filesystem starts empty (bubblewrap's own root, read-only once built) and holds only
# what a Python and torch need to run, the step's own directories and what it is given to read: not the
# repository (its .autoloop/: other runs' checkpoints and models, verify runs, other sessions), not HOME, not the
# machine's other Pythons (their test suites hold the offline corpus's scored text byte for byte).
SYSTEM = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")  # read-only; a link (merged /usr) stays one
# Of /etc, what a process reads to start (the loader's cache), to name users, resolve hosts, check certificates
# and find its drivers: not the rest of the machine's configuration, nor its secrets (shadow, ssh host keys)
ETC = (
    "ld.so.cache",
    "ld.so.conf",
    "ld.so.conf.d",
    "ld.so.preload",
    "passwd",
    "group",
    "nsswitch.conf",
    "hosts",
    "host.conf",
    "resolv.conf",
    "gai.conf",
    "services",
    "protocols",
    "networks",
    "localtime",
    "timezone",
    "locale.alias",
    "locale.conf",
    "ssl",
    "ca-certificates",
    "ca-certificates.conf",
    "pki",
    "crypto-policies",
    "alternatives",
    "os-release",
    "lsb-release",
    "debian_version",
    "redhat-release",
    "system-release",
    "mime.types",
    "fonts",
    "matplotlibrc",
    "OpenCL",
    "vulkan",
    "nvidia",
    "glvnd",
    "python[0-9]*",  # Debian's sitecustomize lives there
)
SYSFS = "/sys"  # read-only: torch and CUDA read the CPU and PCI topology there
# The test suites of a standard library (prepare.py's HELD_DIRS): what the offline corpora score on. Hidden from
# every step (nothing a run or the evaluation imports lies in them), whatever the manifest says.
STDLIB_HELD = frozenset({"test", "tests", "idle_test"})
# Where a prefix (or /usr) keeps a Python's library tree: each one that is not the step's Python's is hidden, and a
# conda base's other environments and package cache with it
PYTHON_TREES = (
    "lib/python[0-9]*",
    "lib32/python[0-9]*",
    "lib64/python[0-9]*",
    "local/lib/python[0-9]*",
    "local/lib64/python[0-9]*",
    "share/python[0-9]*",
    "share/pyshared",
    "envs",
    "pkgs",
)
# Variables of a run's environment naming what it reads: bound read-only (the user site comes with the Python:
# python_env; its whole base, PYTHONUSERBASE, holds other Pythons' packages and the user's keyrings)
READ_VARS = (
    "AUTOLOOP_CACHE",
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
HF_SECRETS = ("token", "stored_tokens")  # in HF_HOME: the user's Hugging Face tokens
# A harness without a manifest keeps the user's HOME for its steps (upstream's reads its data from
# ~/.cache/autoresearch): of HOME they see this directory, read-only, without the Hugging Face tokens in it
HOME_CACHE = ".cache"
# What of a step's environment decides which Python environment it gets (python_env's cache key)
PYTHON_VARS = ("PYTHONPATH", "PYTHONHOME", "PYTHONUSERBASE", "PYTHONNOUSERSITE", "VIRTUAL_ENV", "CONDA_PREFIX")
_PYTHONS: dict[tuple, dict] = {}  # python_env's answers, per interpreter and environment


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
        machine = {
            "bwrap": bwrap,
            "userns": userns,
            "perms": not known or "--perms" in known,
            "size": not known or "--size" in known,
        }
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


_QUERY = """import json, os, sys, sysconfig
paths = sysconfig.get_paths()
print(json.dumps({"prefixes": [sys.prefix, sys.base_prefix, sys.exec_prefix],
    "bin": os.path.dirname(os.path.realpath(sys.executable)), "path": [p for p in sys.path if os.path.isabs(p)],
    "stdlib": [paths["stdlib"], paths["platstdlib"]], "include": [paths["include"], paths["platinclude"]],
    "libdir": sysconfig.get_config_var("LIBDIR") or ""}))
"""


def python_env(python: str = "", env: Mapping[str, str] | None = None) -> dict:
    """Where the Python a step runs (`python`, default ours) reads from with the step's environment: its prefixes,
    its sys.path (site-packages, the user site, PYTHONPATH, what .pth files add), its headers (a compile needs them)
    and its standard library; asked once per interpreter and environment. Not a Python (or one that fails): ours."""
    python = python or sys.executable
    env = dict(os.environ if env is None else env)
    key = (python, *(env.get(k) for k in PYTHON_VARS), None if env.get("PYTHONUSERBASE") else env.get("HOME"))
    if key not in _PYTHONS:
        _PYTHONS[key] = _ask(python, env) or (python_env("", env) if python != sys.executable else _ours())
    return _PYTHONS[key]


def _ask(python: str, env: dict[str, str]) -> dict | None:
    try:  # from /, so that sys.path[0] is no directory of ours
        proc = subprocess.run([python, "-c", _QUERY], capture_output=True, text=True, timeout=60, env=env, cwd="/")
        return json.loads(proc.stdout) if proc.returncode == 0 else None
    except (OSError, ValueError, subprocess.TimeoutExpired):
        return None


def _ours() -> dict:
    """This process's Python (its sys.path without the directory it was started from)."""
    paths = sysconfig.get_paths()
    return {
        "prefixes": [sys.prefix, sys.base_prefix, sys.exec_prefix],
        "bin": os.path.dirname(os.path.realpath(sys.executable)),
        "path": [p for p in sys.path[1:] if os.path.isabs(p)],
        "stdlib": [paths["stdlib"], paths["platstdlib"]],
        "include": [paths["include"], paths["platinclude"]],
        "libdir": sysconfig.get_config_var("LIBDIR") or "",
    }


def python_paths(python: str = "", env: Mapping[str, str] | None = None) -> list[str]:
    """Where the step's Python and its packages live (default: ours, {python})."""
    found = python_env(python, env)
    paths = [*found["prefixes"], found["bin"], *found["path"], *found["include"], found["libdir"]]
    return sorted({p for p in paths if p and os.path.isabs(p)})


def readable_paths(env: dict[str, str], python: str = "") -> list[str]:
    """What a step with this environment reads besides the system: its Python, the prepared data
    (AUTOLOOP_CACHE), its PYTHONPATH and the like."""
    paths = [env[k] for k in READ_VARS if env.get(k)]
    paths += [p for k in READ_LIST_VARS for p in env.get(k, "").split(os.pathsep) if p]
    return [*python_paths(python, env), *(p for p in paths if os.path.isabs(p))]


def home_cache(home: str) -> tuple[list[str], list[str]]:
    """(readable, hidden) for a step whose HOME is the user's: HOME_CACHE, less the Hugging Face tokens."""
    if not os.path.isabs(home) or home == "/":
        return [], []
    cache = os.path.join(home, HOME_CACHE)
    return [cache], [os.path.join(cache, "huggingface", name) for name in HF_SECRETS]


def hidden_paths(readable: Iterable[str], env: Mapping[str, str], python: str = "") -> list[str]:
    """What no step reads within what it may read: the test suites of its Python's standard library, the library
    trees of the machine's other Pythons (under /usr and under what is bound), the user's Hugging Face tokens."""
    found = python_env(python, env)
    ours = [os.path.realpath(p) for p in (*found["path"], *found["stdlib"], found["bin"]) if p]
    ours = [p for p in ours if p != "/"]  # (an empty PYTHONPATH entry asked from /: it holds every tree)
    hidden = list(_stdlib_tests(tuple(found["stdlib"])))
    for root in _unique([*SYSTEM, *(p for p in readable if os.path.isabs(p) and p != "/")]):
        for pattern in PYTHON_TREES:
            hidden += [t for t in glob.glob(os.path.join(root, pattern)) if os.path.isdir(t) and not _holds(t, ours)]
    hidden += [os.path.join(env[k], name) for k in ("HF_HOME",) if env.get(k) for name in HF_SECRETS]
    return hidden


def _holds(tree: str, ours: list[str]) -> bool:
    """tree is or holds a directory of the step's Python (/usr/lib/python3 holds Debian's dist-packages)."""
    real = os.path.realpath(tree)
    return any(_under(p, [real]) for p in ours)


_STDLIB_TESTS: dict[tuple[str, ...], list[str]] = {}


def _stdlib_tests(stdlib: tuple[str, ...]) -> list[str]:
    """The outermost STDLIB_HELD directories of a standard library (its site-packages aside), found once."""
    if stdlib not in _STDLIB_TESTS:
        found: set[str] = set()
        for root in {os.path.realpath(p) for p in stdlib if p}:
            for top, dirs, _ in os.walk(root):
                dirs[:] = [d for d in dirs if d not in ("site-packages", "dist-packages", "__pycache__")]
                found.update(os.path.join(top, d) for d in dirs if d in STDLIB_HELD)
                dirs[:] = [d for d in dirs if d not in STDLIB_HELD]
        _STDLIB_TESTS[stdlib] = sorted(found)
    return _STDLIB_TESTS[stdlib]


def private_places(*places: Path) -> list[str]:
    """What no step may see even where something it reads holds it: the repository each of `places` (a run's
    directory, its worktree) belongs to with its .autoloop/ state, found from a `.autoloop` above it or from the
    worktree's git link, and the controller's HOME."""
    found = {str(Path.home())}
    for place in places:
        place = Path(place).resolve()
        found.update(str(p.parent) for p in (place, *place.parents) if p.name == ".autoloop")
        if (repo := _repository_of(place)) is not None:
            found.add(str(repo))
    return sorted(p for p in found if p != "/")


def _repository_of(worktree: Path) -> Path | None:
    """The repository whose worktree this is (its .git a link to <repo>/.git/worktrees/<name>), or None."""
    try:
        text = (worktree / ".git").read_text(errors="replace") if (worktree / ".git").is_file() else ""
    except OSError:
        return None
    if not text.startswith("gitdir:"):
        return None
    gitdir = (worktree / text[len("gitdir:") :].strip()).resolve()
    try:
        common = (gitdir / (gitdir / "commondir").read_text().strip()).resolve()
    except OSError:
        return None
    return common.parent if common.name == ".git" else None


def sandboxed(
    cmd: list[str],
    writable: Iterable[str],
    net: bool,
    readable: Iterable[str] = (),
    hidden: Iterable[str] = (),
    read_only: Iterable[str] = (),
    devices: Iterable[str] | None = None,
    private: Iterable[str] = (),
    shm_bytes: int = 0,
) -> list[str]:
    """cmd run by bubblewrap in a filesystem of its own: the system (SYSTEM, a few files of /etc, /sys) and
    `readable` read-only, `writable` writable and within those `read_only`; nothing else. Within what it reads,
    `private` places (the repository, HOME) are empty, and `hidden` files read as empty, hidden directories as
    empty ones; empty /tmp, /var/tmp, /run, and a /dev/shm of `shm_bytes` at most (0: the kernel's default,
    half the memory). Of /dev, the basic nodes and `devices` (default:
    gpu_devices(None)); no network unless `net`; no capability, no process of ours in sight.
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
        private,
        shm_bytes,
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
    private: Iterable[str] = (),
    shm_bytes: int = 0,
) -> list[str]:
    """The bwrap command line. Order matters: a later mount lies on top of an earlier one (the system, the masks,
    what is read, the private places within that, what is read within those, then the writable directories, then
    what stays read-only or hidden within them; last, all but /dev/shm made read-only, the root too)."""
    masks, writable = _masks(), list(writable)
    readable = [p for p in _forms(readable) if _bindable(p)]
    private = [p for p in _forms(private) if os.path.isdir(p) and any(_under(p, [r]) for r in readable)]
    args = [
        machine["bwrap"],
        *machine["userns"],
        *_ISOLATE,
        *([] if net else ["--unshare-net"]),
        *_system(),
        "--proc",
        "/proc",
        "--dev",
        "/dev",
    ]
    args += [a for d in _unique(devices) for a in ("--dev-bind-try", d, d)]
    sticky = ["--perms", "01777"] if machine["perms"] else []  # bubblewrap 0.5; for a setuid one without userns
    # a step's files in /dev/shm are memory that none of its processes holds (the memory limit's blind spot)
    sticky += ["--size", str(shm_bytes)] if shm_bytes and machine.get("size") else []
    args += [a for m in masks for a in (*(sticky if m == SHARED_MEMORY else []), "--tmpfs", m)]
    # (never a mask itself: AUTOLOOP_CACHE=/tmp would bring back every socket in /tmp)
    args += [a for p in readable if p not in masks and not _under(p, private) for a in ("--ro-bind-try", p, p)]
    args += [a for p in private for a in ("--tmpfs", p)]
    args += [a for p in readable if _under(p, private) and p not in private for a in ("--ro-bind-try", p, p)]
    args += [a for p in _unique(os.path.abspath(w) for w in writable) for a in ("--bind", p, p)]
    args += [a for p in _forms(read_only) if os.path.lexists(p) for a in ("--ro-bind-try", p, p)]
    args += [a for p in _hidden(hidden, [*SYSTEM, *readable, *writable]) for a in _hide(p)]
    args += [a for m in [*masks, *private] if m != SHARED_MEMORY for a in ("--remount-ro", m)]
    return [*args, "--remount-ro", "/", "--", *cmd]


def _hidden(hidden: Iterable[str], visible: list[str]) -> list[str]:
    """What to hide: only what the sandbox holds (an unbound place is not there anyway), and not what lies in a
    directory hidden already (it cannot be made in an emptied, read-only one)."""
    found = [p for p in _forms(hidden) if os.path.lexists(p) and _under(p, _forms(visible))]
    dirs = [p for p in found if os.path.isdir(p) and not os.path.islink(p)]
    return [p for p in found if not any(p != d and _under(p, [d]) for d in dirs)]


def _system() -> list[str]:
    """The system read-only (a top-level link, as /bin -> usr/bin, made again), the files of ETC, /sys."""
    args: list[str] = []
    for path in SYSTEM:
        if os.path.islink(path):
            args += ["--symlink", os.readlink(path), path]
        elif os.path.isdir(path):
            args += ["--ro-bind", path, path]
    names = sorted({p for pattern in ETC for p in glob.glob(os.path.join("/etc", pattern))})
    args += [a for p in names for a in ("--ro-bind-try", p, p)]
    return [*args, *(["--ro-bind", SYSFS, SYSFS] if os.path.isdir(SYSFS) else [])]


def _bindable(path: str) -> bool:
    """Never / (it would bring back everything), nor what the sandbox makes itself."""
    return os.path.isabs(path) and path != "/" and not _under(path, ("/proc", "/dev", SYSFS))


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
