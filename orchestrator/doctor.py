"""`autoloop doctor`: the environment problems that otherwise surface at 2 a.m., found before the night starts.

One finding per check, each with its fix. `fail` means the loop would stop (or never start); `warn` means it
runs but something is off (e.g. runs unconfined: check_sandbox says what that means). `autoloop run` runs the
blocking checks that the loop does not already make itself (free disk, an agent CLI that answers) before
experiment 1.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import math
import netrc
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from . import LoopError
from .core.settings import Settings
from .core.state import BUSY
from .executors import gpu
from .executors.runner import hidden_load
from .store import gitops
from .store.hparams import read_constants
from .trust import confine, harness

OK, WARN, FAIL = "ok", "warn", "FAIL"
EXTRAS = {
    "llm": "openai",
    "cmaes": "cmaes",
    "ray": "ray",
    "mlflow": "mlflow",
    "wandb": "wandb",
    "tensorboard": "tensorboard",
}
NEEDS = {"proposer": {"llm": "llm", "cmaes": "cmaes"}, "executor": {"ray": "ray"}}
NIGHT = 100  # experiments assumed for the disk estimate when neither --max-experiments nor --max-hours says
LOG_MB = 1.0  # a run's log, record and outputs, generously (logs are capped at --max-log-mb)
SPARE_GB = 1.0  # headroom for git objects, compile caches and the status files
GROWTH = 4  # the search may grow the model: warn without room for checkpoints this many times the default's
VOCAB = 8192  # when prepare.py does not say (the largest of autoloop's profiles)
ANSWER_TIMEOUT_S = 30.0
SLURM_PROBE_S = 120.0  # how long doctor's test job may take, queue included
SLURM_FS_LAG_S = 60.0  # how long its file may take to show here once it has ended (NFS caches attributes)


@dataclass
class Finding:
    check: str
    status: str  # ok | warn | FAIL
    detail: str
    fix: str = ""

    def line(self) -> str:
        return f"{self.status:4}  {self.check:13} {self.detail}" + (f"\n{'':19}fix: {self.fix}" if self.fix else "")


def install_hint(extra: str) -> str:
    return f'pip install "autoloop-ml[{extra}]" (in a clone: pip install -e ".[{extra}]")'


def run_checks(settings: Settings) -> list[Finding]:
    """Every check, in the order a night meets them."""
    findings = [check_repo(settings)]
    if findings[0].status == FAIL:
        return findings
    repo = gitops.Repo(settings.repo)
    findings += [check_identity(repo), check_signing(repo)]
    env = harness.run_env(
        settings.budget, settings.seed, settings.profile, settings.dataset, settings.cache, tuple(settings.pass_env)
    )
    info, torch_problem = None, None
    try:
        env = {**os.environ, **env}
        info = harness.query(settings.repo, env, torch=True)
    except LoopError as e:
        torch_problem = str(e)
    findings.append(check_gpu(settings, env, info, torch_problem))
    findings.append(check_sandbox(settings, (info.profile if info else None) or settings.profile))
    findings.append(check_data(settings, info))
    findings.append(check_disk(settings, info))
    findings.append(check_load(settings))
    findings.append(check_extras(settings))
    if settings.executor == "slurm":
        findings.append(check_slurm(settings.executor_options))
    if settings.trackers:
        findings.append(check_trackers(settings))
    # the agent proposer's own checks are check_agent's (on PATH) and more (it answers)
    findings.append(check_agent(settings.options) if settings.proposer == "agent" else check_proposer(settings, info))
    return findings


def preflight(settings: Settings, slots: list) -> None:
    """The blocking checks `autoloop run` makes before experiment 1 (the loop makes the others itself); the
    executor's slots say how many runs go at once and whether they have GPUs (no nvidia-smi call here)."""
    gpus = any(slot.env.get("CUDA_VISIBLE_DEVICES", "").strip() not in ("", "-1") for slot in slots)
    profile = settings.profile or ("gpu" if gpus else "cpu")
    findings = [check_disk(dataclasses.replace(settings, profile=profile), None, len(slots))]
    if settings.proposer == "agent":
        findings.append(check_agent(settings.options))
    failed = [f for f in findings if f.status == FAIL]
    if failed:
        raise LoopError(
            "; ".join(f"{f.detail} (fix: {f.fix})" for f in failed) + ". `autoloop doctor` checks everything at once"
        )


def check_repo(settings: Settings) -> Finding:
    try:
        repo = gitops.open_repo(settings.repo)
        gitops.require_clean(repo)
    except LoopError as e:
        return Finding(
            "repository",
            FAIL,
            str(e).split("; ")[0],
            str(e).partition("; ")[2] or "autoloop init DIR makes a ready workspace",
        )
    branch = "detached HEAD" if repo.head.is_detached else repo.active_branch.name
    return Finding(
        "repository", OK, f"{settings.repo} on {branch} at {repo.head.commit.hexsha[:7]}, train.py committed"
    )


def check_identity(repo) -> Finding:
    name, email = (_git_config(repo, key) for key in ("user.name", "user.email"))
    if name and email:
        return Finding("git identity", OK, f"commits as {name} <{email}>")
    return Finding(
        "git identity",
        WARN,
        "no user.name / user.email: the loop's commits are by autoloop <autoloop@localhost>",
        'git config --global user.name "Your Name" && git config --global user.email you@example.com',
    )


def _git_config(repo, key: str, *flags: str) -> str:
    """A git setting as git itself resolves it (GIT_CONFIG_GLOBAL and includes too); '' when unset."""
    try:
        proc = answer(["git", "-C", str(repo.working_tree_dir), "config", *flags, "--get", key])
    except subprocess.TimeoutExpired:
        return ""
    return proc.stdout.strip() if proc.returncode == 0 else ""


def answer(argv: list[str], env: dict | None = None) -> subprocess.CompletedProcess:
    """Run a short command in its own process group; TimeoutExpired after ANSWER_TIMEOUT_S, with the whole
    group killed (a CLI that waits for a login or a passphrase leaves nothing behind)."""
    proc = subprocess.Popen(
        argv,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
        text=True,
        env=env,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=ANSWER_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise
    return subprocess.CompletedProcess(argv, proc.returncode, out, err)


def check_signing(repo) -> Finding:
    """The loop's own commits never sign (a signer that prompts or fails must not stop a night), but a signer
    that fails will stop the user's own commits, merges of the results included: say so now."""
    on = _git_config(repo, "commit.gpgsign", "--type=bool") == "true"
    if not on:
        return Finding("git signing", OK, "commit.gpgsign is off")
    try:
        proc = answer(
            ["git", "-C", str(repo.working_tree_dir), "commit-tree", "-S", "-m", "autoloop doctor", "HEAD^{tree}"],
            env={**os.environ, "GIT_TERMINAL_PROMPT": "0"},
        )
    except subprocess.TimeoutExpired:
        return Finding(
            "git signing",
            WARN,
            f"commit.gpgsign is on and the signer did not answer in "
            f"{ANSWER_TIMEOUT_S:.0f} s (it may wait for a passphrase); the loop runs "
            "(its commits are unsigned), your own commits here may hang",
            "cache the passphrase (gpg-agent) or `git config commit.gpgsign false` in this repo",
        )
    if proc.returncode == 0:
        return Finding(
            "git signing",
            OK,
            "commit.gpgsign is on and the signer works (the loop's own commits are "
            "unsigned: a signer must never prompt at night)",
        )
    said = [ln.strip() for ln in proc.stderr.splitlines() if ln.strip() and not ln.startswith("fatal:")]
    why = " | ".join(said[:3]) or f"exit {proc.returncode}"  # the signer's own words, then git's
    program = _git_config(repo, "gpg.program") or "gpg"
    return Finding(
        "git signing",
        WARN,
        f"commit.gpgsign is on but signing fails ({why}); the loop runs (its "
        "commits are unsigned), your own commits and merges here will fail",
        f"fix the signer ({program}, user.signingkey), or `git config commit.gpgsign false` in this repo",
    )


def check_gpu(settings: Settings, env: dict[str, str], info, problem: str | None) -> Finding:
    """As the loop checks before experiment 1 (gpu.Check): only where runs use this machine's GPUs, not when
    the CPU is chosen on purpose (AUTOLOOP_DEVICE=cpu, --gpus '', CUDA_VISIBLE_DEVICES=)."""
    if problem:
        return Finding(
            "gpu / torch",
            FAIL,
            problem.split(". Install")[0],
            "install autoloop's dependencies into this Python (pip install autoloop-ml; in a clone: "
            "pip install -e .), or fix prepare.py",
        )
    torch = (info.torch if info else None) or {}
    check = gpu.Check.start(settings, env)
    usable = bool(torch.get("available"))
    if check.check_driver and not usable:
        lines = gpu.driver_problem(check.driver, torch, sys.executable, env).splitlines()
        return Finding(
            "gpu / torch",
            FAIL,
            " ".join(line.strip() for line in lines[:3]),
            f"\n{'':19}".join(line.strip() for line in lines[3:]),
        )
    if check.check_profile and not usable:
        text = gpu.profile_problem(check.driver, torch, sys.executable).split("\n")
        return Finding("gpu / torch", FAIL, text[0], " ".join(text[1:]))
    if check.driver is None:
        why = (
            "not checked: the CPU is chosen"
            if settings.profile != "gpu"
            and (gpu._device_chosen(env) or gpu._gpus_hidden(env, settings.executor_options.get("gpus")))
            else "no NVIDIA GPU (nvidia-smi lists none)"
        )
        return Finding("gpu / torch", OK, f"{why}; torch {torch.get('version', '?')} runs on the CPU")
    return Finding(
        "gpu / torch",
        OK,
        f"{len(check.driver.gpus)} x {check.driver.gpus[0]}, driver "
        f"{check.driver.version}; torch {torch.get('version')} built for CUDA "
        f"{torch.get('cuda')} sees {torch.get('devices')} device(s)",
    )


# Where the kernel keeps user namespaces from an unprivileged bubblewrap: (file, value that forbids, the fix)
USERNS_SWITCHES = (
    ("/proc/sys/kernel/unprivileged_userns_clone", "0", "sysctl -w kernel.unprivileged_userns_clone=1"),
    ("/proc/sys/user/max_user_namespaces", "0", "sysctl -w user.max_user_namespaces=15000"),
    (
        "/proc/sys/kernel/apparmor_restrict_unprivileged_userns",
        "1",
        "sysctl -w kernel.apparmor_restrict_unprivileged_userns=0 (Ubuntu 23.10+; or an AppArmor profile for bwrap)",
    ),
)
INSTALL_BWRAP = "apt-get install bubblewrap (Debian, Ubuntu) or dnf install bubblewrap (Fedora, RHEL)"


def check_sandbox(settings: Settings, profile: str | None) -> Finding:
    """As the loop decides it (Workspace.confine): bubblewrap present, user namespaces allowed, and a test
    confinement with a step's whole set of arguments (confine.sandbox_problem()). Without one, the gpu profile's
    night and --sandbox on stop (FAIL); elsewhere runs are unconfined (warn), with what that means."""
    from .core.workspace import UNCONFINED

    if settings.sandbox == "off":
        return Finding(
            "sandbox",
            WARN,
            f"--sandbox off: runs are unconfined: {UNCONFINED}",
            "leave out --sandbox off where bubblewrap works (`autoloop doctor` without it checks)",
        )
    problem = confine.sandbox_problem()
    blocked = userns_blocked()
    if problem:
        stops = settings.sandbox == "on" or profile == "gpu"
        why = "--sandbox on" if settings.sandbox == "on" else "the gpu profile runs confined"
        fix = INSTALL_BWRAP if shutil.which("bwrap") is None else "; ".join(blocked) or USERNS_FIX
        return Finding(
            "sandbox",
            FAIL if stops else WARN,
            f"{problem.split(' (apt-get')[0]}: "
            + (f"the loop stops before experiment 1 ({why})" if stops else "runs would be unconfined")
            + f". Unconfined, {UNCONFINED}",
            fix + (" - or run unconfined on purpose with --sandbox off" if stops else ""),
        )
    found = f"bubblewrap at {shutil.which('bwrap')}; a test confinement ran"
    if note := confine.sandbox_note():
        return Finding("sandbox", WARN, f"{found}, but weaker here: {note}", "; ".join(blocked) or USERNS_FIX)
    return Finding("sandbox", OK, f"{found}: each run is confined (docs/trust.md)")


USERNS_FIX = (
    "allow user namespaces (in a container: run it with --security-opt seccomp=unconfined, or on the host); "
    "or update bubblewrap (0.8 has --disable-userns)"
)


def userns_blocked() -> list[str]:
    """The fixes for the kernel switches that forbid user namespaces here (none where none does)."""
    fixes = []
    for path, forbids, fix in USERNS_SWITCHES:
        try:
            if Path(path).read_text().strip() == forbids:
                fixes.append(fix)
        except OSError:
            continue
    return fixes


def check_data(settings: Settings, info) -> Finding:
    if info is None:
        return Finding("data", WARN, "not checked (prepare.py could not be imported)")
    if info.manifest is None:
        return Finding("data", OK, "this prepare.py keeps no manifest (e.g. upstream autoresearch's): not checked")
    problems = harness.verify(info.manifest, settings.repo / "prepare.py")
    what = f"{info.dataset or 'default'} data for the {info.profile or 'default'} profile"
    if problems:
        flags = "".join(f" --{k} {v}" for k, v in (("profile", settings.profile), ("dataset", settings.dataset)) if v)
        return Finding(
            "data",
            WARN,
            f"{what} is not prepared ({problems[0]})",
            f"`autoloop run` prepares it before experiment 1; to do it now: python prepare.py{flags}",
        )
    return Finding("data", OK, f"{what} is prepared and verifies ({info.manifest.parent})")


def planned_experiments(settings: Settings) -> int:
    if settings.max_experiments:
        return settings.max_experiments
    if settings.max_hours:
        return max(1, math.ceil(settings.max_hours * 3600 / (settings.budget + 60)))
    return NIGHT


def model_bytes(settings: Settings, profile: str | None, vocab: int | None) -> tuple[int, bool]:
    """A saved model's size, and whether it was measured: the largest this session kept, else an estimate from
    train.py's size constants (a GPT: 12 L d^2 + 2 V d parameters, saved in fp32), else 1 GiB."""
    saved = [p.stat().st_size for p in (settings.repo / ".autoloop" / settings.tag / "runs").glob("*/model.pt")]
    if saved:
        return max(saved), True
    try:
        values = {c.name: c.value for c in read_constants((settings.repo / "train.py").read_text(), profile)}
        depth, head = int(values["DEPTH"]), int(values.get("HEAD_DIM", 64))
        width = math.ceil(depth * int(values["ASPECT_RATIO"]) / head) * head
        return 4 * (12 * depth * width**2 + 2 * (vocab or VOCAB) * width), False
    except (OSError, KeyError, TypeError, ValueError):
        return 1 << 30, False


def check_disk(settings: Settings, info, slots: int | None = None) -> Finding:
    """The night's footprint: the models kept at once (baseline, best, one in flight per slot), every run's
    logs, and some spare, against the free space where the session's state lives. Below that: FAIL. Below room
    for models GROWTH times the default's (the search may grow the model; a measured size already has): warn."""
    driver = None if (info and info.profile or settings.profile) and (slots or settings.workers) else gpu.nvidia_smi()
    profile = (info.profile if info else None) or settings.profile or ("gpu" if driver else "cpu")
    slots = slots or settings.workers or (len(driver.gpus) if driver else 1)
    n = planned_experiments(settings)
    model, measured = model_bytes(settings, profile, info.vocab if info else None)
    logs = n * LOG_MB * 2**20 + SPARE_GB * 2**30
    need = (2 + slots) * model + logs
    roomy = need if measured else (2 + slots) * GROWTH * model + logs
    where = settings.repo / ".autoloop"
    free = shutil.disk_usage(where if where.exists() else settings.repo).free
    text = (
        f"{free / 2**30:.1f} GiB free at {settings.repo}; {n} experiment{'s' if n != 1 else ''} need about "
        f"{need / 2**30:.1f} GiB ({2 + slots} models of ~{model / 2**20:.0f} MiB at once, logs, 1 GiB spare)"
    )
    if free < need:
        return Finding("disk", FAIL, text, "free some space, or plan fewer experiments (--max-experiments)")
    if free < roomy:
        return Finding("disk", WARN, text + f"; a model grown {GROWTH}x would not fit", "free some space")
    return Finding("disk", OK, text)


def check_load(settings: Settings | None = None, seconds: float = 1.0) -> Finding:
    """Whether the load other processes put on the machine is in sight (runner.CpuShare counts it: a run that
    waited for the CPU while others kept it busy is set aside and run again). Out of sight (another container's
    processes, other users' under /proc's hidepid) a run they slow is judged as the idea's own: warn where at
    least state.BUSY CPUs' time now is nobody's in sight (runner.hidden_load), or where /proc hides other users'
    processes from this user. Runs on other machines (Ray, Slurm) are measured there: not checked here."""
    if settings is not None and settings.executor not in ("local", "inline"):
        return Finding("load", OK, f"not checked here: runs train on other machines (--executor {settings.executor})")
    hidden = hidden_load(seconds, confirm=BUSY)
    if hidden is None:
        return Finding("load", OK, "not measured here (no /proc): no run is set aside as slowed by other processes")
    if hidden >= BUSY:
        return Finding(
            "load",
            WARN,
            f"{hidden:.1f} CPUs busy with processes out of sight (another container's?): a run they slow is judged "
            "as the idea's own (docs/trust.md)",
            "run the loop where the machine's processes are in sight (on the host, or a container started with "
            "--pid=host), or where nobody else's jobs run",
        )
    if hides_processes():
        return Finding(
            "load",
            WARN,
            "/proc is mounted with hidepid: other users' processes are out of sight, so a run they slow is judged "
            "as the idea's own (docs/trust.md)",
            "mount /proc without hidepid (or add this user to the group its gid= option names), or run the loop "
            "where nobody else's jobs run",
        )
    return Finding("load", OK, f"the machine's load is in sight ({hidden:.1f} CPUs out of sight, under {BUSY:g})")


def hides_processes() -> bool:
    """Does /proc hide other users' processes from this one (mounted with hidepid, this user neither root nor
    in the group its gid= option exempts)?"""
    try:
        lines = Path("/proc/self/mountinfo").read_text().splitlines()
    except OSError:
        return False
    options: list[str] = []
    for line in lines:  # the last mount at /proc is the one in sight (one may be mounted over another)
        mount, _, rest = line.partition(" - ")
        fields = mount.split()
        if len(fields) > 4 and fields[4] == "/proc" and len(rest.split()) > 2:
            options = rest.split()[2].split(",")
    values = dict(o.split("=", 1) for o in options if "=" in o)
    if values.get("hidepid", "0") in ("0", "off") or os.geteuid() == 0:
        return False
    gid = values.get("gid")
    return not (gid and gid.isdigit() and int(gid) in (os.getegid(), *os.getgroups()))


def check_extras(settings: Settings) -> Finding:
    installed = {extra for extra, module in EXTRAS.items() if importlib.util.find_spec(module) is not None}
    needed = {NEEDS["proposer"].get(settings.proposer), NEEDS["executor"].get(settings.executor)} - {None}
    missing = sorted(needed - installed)
    absent = sorted(set(EXTRAS) - installed)
    listed = f"installed: {', '.join(sorted(installed)) or 'none'}; not: {', '.join(absent) or 'none'}"
    if missing:
        return Finding(
            "extras",
            FAIL,
            f"this run needs {', '.join(missing)} ({listed})",
            " && ".join(install_hint(m) for m in missing),
        )
    untracked = sorted(set(settings.trackers) & set(EXTRAS) - installed)  # a module:Class tracker brings its own
    if untracked:
        return Finding(
            "extras",
            WARN,
            f"--tracker {', '.join(untracked)} {'is' if len(untracked) == 1 else 'are'} "
            f"not installed: switched off for the night ({listed})",
            install_hint(",".join(untracked)),
        )
    return Finding("extras", OK, listed)


def check_slurm(options: dict, wait_s: float = SLURM_PROBE_S) -> Finding:
    """--executor slurm: the commands, the partition's nodes, and the shared path - a small job writes a file
    under --slurm-workdir that this machine must then see (cancelled, with a warning, if it waits in the queue
    longer than `wait_s`)."""
    import shlex
    import uuid

    from .executors import slurm

    try:
        ex = slurm.SlurmExecutor.create(None, options)
    except (ValueError, slurm.SlurmError) as e:
        return Finding("slurm", FAIL, str(e), "see `autoloop run --help`, options --slurm-*")
    try:
        cpus, gpus = slurm.partition_size(ex.partition)
        where = f"partition {ex.partition}" if ex.partition else "the default partition"
        text = (
            f"{where}: {cpus} CPUs, {gpus} GPUs; {len(ex.slots)} runs at once, {ex.gpus} GPU(s) and "
            f"{ex.cpus or 'the default'} CPU(s) each"
        )
        probe = ex.workdir / f".doctor-{uuid.uuid4().hex[:12]}"
        write = (
            f"hostname > {shlex.quote(f'{probe}.tmp')} && mv {shlex.quote(f'{probe}.tmp')} {shlex.quote(str(probe))}"
        )
        args = ["sbatch", "--parsable", "--job-name=autoloop-doctor", "--time=1", "--ntasks=1", "--output=/dev/null"]
        args += ["--export=" + (",".join(slurm.exported()) or "NONE")]  # as a run's: never the secrets
        args += [f"--partition={ex.partition}"] if ex.partition else []
        args += [f"--account={ex.account}"] if ex.account else []
        args += [f"--qos={ex.qos}"] if ex.qos else []
        args += [*ex.extra, f"--wrap={write}"]
        try:
            job = slurm.command(args).strip().split(";")[0]
        except slurm.SlurmError as e:
            return Finding(
                "slurm", FAIL, f"{text}; a test job was refused: {e}", "check the partition, account and qos"
            )
        deadline = time.monotonic() + wait_s
        state = ("PENDING", "", "")
        ended: float | None = None
        while time.monotonic() < deadline and not probe.exists():
            if ended is None:
                state = slurm.queue(["autoloop-doctor"]).get(job, ("GONE", "", ""))
                if state[0] not in slurm.ACTIVE:
                    ended = time.monotonic()
            elif time.monotonic() - ended > SLURM_FS_LAG_S:  # ended, and its file never came: not shared
                break
            time.sleep(0.5)
        try:
            if probe.exists():
                node = probe.read_text().strip()
                return Finding("slurm", OK, f"{text}; a test job on {node} wrote to {ex.workdir}")
            if ended is None:
                slurm.cancel_jobs([job])
                return Finding(
                    "slurm",
                    WARN,
                    f"{text}; a test job waited in the queue over {wait_s:g}s ({state[1]}): the shared path is "
                    "not checked",
                    "run doctor again when the queue is shorter",
                )
            return Finding(
                "slurm",
                FAIL,
                f"{text}; a test job ended ({state[0]}) but its file is not under {ex.workdir} here",
                "name a --slurm-workdir on a file system the compute nodes share with this machine",
            )
        finally:
            probe.unlink(missing_ok=True)
            probe.with_name(probe.name + ".tmp").unlink(missing_ok=True)
    except slurm.SlurmError as e:
        return Finding("slurm", FAIL, f"the Slurm cluster cannot be read: {e}", "check that slurmctld is up (sinfo)")
    finally:
        ex.close()


def check_trackers(settings: Settings) -> Finding:
    """Each --tracker reachable: a tracker that is not is switched off for the night (it never stops the loop)."""
    said, problems = [], []
    for name in dict.fromkeys(settings.trackers):
        if name not in EXTRAS or importlib.util.find_spec(name) is None:
            continue  # check_extras says so; a module:Class tracker is not checked
        if name == "mlflow":
            uri = os.environ.get("MLFLOW_TRACKING_URI", "")
            if uri.startswith(("http://", "https://")):
                try:
                    urllib.request.urlopen(uri.rstrip("/") + "/health", timeout=5).close()
                    said.append(f"mlflow server {uri} answers")
                except (OSError, ValueError) as e:
                    problems.append(
                        (
                            f"mlflow: cannot reach {uri} ({getattr(e, 'reason', e)})",
                            "start the server, or fix MLFLOW_TRACKING_URI",
                        )
                    )
            else:
                said.append(f"mlflow store {uri or 'sqlite:///.autoloop/mlflow.db (the default)'}")
        elif name == "wandb":
            mode = os.environ.get("WANDB_MODE", "")
            if mode in ("offline", "dryrun", "disabled"):
                said.append(f"wandb {mode} (files in .autoloop/wandb/, `wandb sync` them later)")
            elif os.environ.get("WANDB_API_KEY") or _netrc_has("api.wandb.ai"):
                said.append("wandb logged in (the key is not verified here)")
            else:
                problems.append(("wandb: not logged in", "wandb login, or WANDB_MODE=offline"))
    if problems:
        return Finding(
            "trackers",
            WARN,
            "; ".join(p for p, _ in problems)
            + ": switched off for the night"
            + (f" ({'; '.join(said)})" if said else ""),
            "; ".join(f for _, f in problems),
        )
    chosen = ", ".join(dict.fromkeys(settings.trackers))
    return Finding("trackers", OK, "; ".join(said) or f"{chosen}: nothing to check")


def _netrc_has(host: str) -> bool:
    try:
        return netrc.netrc().authenticators(host) is not None
    except (OSError, netrc.NetrcParseError):
        return False


def check_proposer(settings: Settings, info) -> Finding:
    """The proposer loads and accepts its options (a model name, an API key, an agent command), as the loop
    makes it before experiment 1; nothing is asked of it."""
    from .proposers import Context, load
    from .store.spend import Spend

    try:
        cls = load(settings.proposer)
        with tempfile.TemporaryDirectory() as tmp:
            proposer = cls(
                Context(
                    repo=settings.repo,
                    tag=settings.tag,
                    seed=settings.seed,
                    profile=(info.profile if info else None) or settings.profile,
                    options=dict(settings.options),
                    spend=Spend(Path(tmp) / "spend.jsonl"),
                    pass_env=tuple(settings.pass_env),
                )
            )
            proposer.close()
    except LoopError as e:
        return Finding(
            "proposer",
            FAIL,
            str(e).split("; ")[0],
            str(e).partition("; ")[2] or "see `autoloop proposers` and `autoloop run --help`",
        )
    return Finding("proposer", OK, f"{settings.proposer} loads with these options")


def check_agent(options: dict) -> Finding:
    """The agent CLI is on PATH and answers `--version` (presets only: a custom --agent-cmd may not have one)."""
    from .proposers.agent import agent_argv

    try:
        argv = agent_argv(options)
    except LoopError as e:
        return Finding("agent", FAIL, str(e), "see `autoloop run --help` (--agent, --agent-cmd)")
    exe = shutil.which(argv[0]) or (argv[0] if Path(argv[0]).exists() else None)
    if exe is None:
        return Finding(
            "agent",
            FAIL,
            f"agent command {argv[0]!r} not found on PATH",
            "install it (or put it on PATH), or choose another with --agent / --agent-cmd",
        )
    if options.get("agent_cmd"):
        return Finding("agent", OK, f"{exe} (a custom --agent-cmd: not asked to answer)")
    try:
        proc = answer([exe, "--version"])
    except (OSError, subprocess.TimeoutExpired) as e:
        return Finding(
            "agent",
            FAIL,
            f"{exe} --version did not answer ({type(e).__name__})",
            "run it by hand: it may wait for a login or an update prompt",
        )
    out = (proc.stdout.strip() or proc.stderr.strip()).splitlines()
    if proc.returncode != 0:
        return Finding(
            "agent",
            FAIL,
            f"{exe} --version failed (exit {proc.returncode}: {out[-1] if out else ''})",
            f"run `{argv[0]} --version` by hand, and log in (`{argv[0]}` interactively) if it asks",
        )
    return Finding("agent", OK, f"{exe}: {out[0] if out else 'answers'} (log in once by hand if it has not been)")
