"""What untrusted code gets to see: an allow-listed environment, and text for an LLM without the secrets.

Every edit of train.py comes from a search, a person, an LLM or a coding agent, and then runs: it gets the
variables a run needs (autoloop's, PATH, locale, device selection, proxies, the Python and CUDA setup), never
the controller's API keys, tokens, cloud credentials or agent sockets; `--pass-env NAME` adds one on purpose.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys

ALLOWED = {"PATH", "HOME", "TMPDIR", "PYTHONUSERBASE", "PYTHONNOUSERSITE", "XDG_CONFIG_HOME", "XDG_DATA_HOME", "LANG", "LANGUAGE", "TZ", "TERM", "USER", "LOGNAME", "SHELL", "PYTHONPATH", "PYTHONHASHSEED",
           "PYTHONUNBUFFERED", "VIRTUAL_ENV", "CONDA_PREFIX", "CONDA_DEFAULT_ENV", "LD_LIBRARY_PATH",
           "OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "NUMEXPR_NUM_THREADS",
           "SSL_CERT_FILE", "SSL_CERT_DIR", "REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE",
           "HTTP_PROXY", "HTTPS_PROXY", "NO_PROXY", "ALL_PROXY", "http_proxy", "https_proxy", "no_proxy",
           "all_proxy", "HF_HOME", "HF_HUB_CACHE", "HF_DATASETS_CACHE", "HF_HUB_OFFLINE", "HF_ENDPOINT",
           "XDG_CACHE_HOME", "GLIBC_TUNABLES"}
ALLOWED_PREFIXES = ("AUTOLOOP_", "LC_", "CUDA_", "NVIDIA_", "NCCL_", "CUBLAS_", "CUDNN_", "TORCH_",
                    "TORCHINDUCTOR_", "PYTORCH_", "TRITON_", "HIP_", "ROCR_", "ROCM_", "HSA_", "MIOPEN_",
                    "KMP_", "GOMP_")
# A name that says it holds a secret is never passed on by a pattern, even under an allowed prefix.
SECRET_NAME = re.compile(r"KEY|TOKEN|SECRET|PASSW|CREDENTIAL|AUTH|COOKIE|SESSION|PRIVATE|SIGNATURE", re.IGNORECASE)
MIN_SECRET_CHARS = 6  # shorter values ("1", "true") would redact half the prompt


def allowed_env(environ: dict[str, str] | None = None, pass_env: tuple[str, ...] = ()) -> dict[str, str]:
    """The variables of `environ` (default: this process's) that a run or an agent may see."""
    environ = dict(os.environ if environ is None else environ)
    out = {k: v for k, v in environ.items()
           if (k in ALLOWED or k.startswith(ALLOWED_PREFIXES)) and not SECRET_NAME.search(k)}
    out.update({k: environ[k] for k in pass_env if k in environ})
    return out


def secret_values(environ: dict[str, str] | None = None) -> list[str]:
    """The values of the controller's secret-looking variables, longest first."""
    environ = os.environ if environ is None else environ
    return sorted({v for k, v in environ.items() if SECRET_NAME.search(k) and len(v) >= MIN_SECRET_CHARS},
                  key=len, reverse=True)


def redact(text: str, environ: dict[str, str] | None = None) -> str:
    """`text` with every secret value of the controller's environment replaced by [redacted NAME]."""
    environ = os.environ if environ is None else environ
    names = {}
    for k, v in environ.items():
        if SECRET_NAME.search(k) and len(v) >= MIN_SECRET_CHARS:
            names.setdefault(v, k)
    for value in secret_values(environ):
        text = text.replace(value, f"[redacted {names[value]}]")
    return text


# ---------------------------------------------------------------------------
# The OS sandbox (Linux, bubblewrap): a run may write only its own directories and reach no network
# ---------------------------------------------------------------------------

_PROBE: dict[str, str] = {}


def sandbox_problem() -> str:
    """'' where bubblewrap can confine a run on this machine, else why not (checked once per process)."""
    if "result" not in _PROBE:
        if not sys.platform.startswith("linux"):
            _PROBE["result"] = f"no OS sandbox on {sys.platform} (bubblewrap is Linux only)"
        elif shutil.which("bwrap") is None:
            _PROBE["result"] = "bubblewrap is not installed (apt-get install bubblewrap, dnf install bubblewrap)"
        else:
            try:
                proc = subprocess.run(["bwrap", *_BASE, "--unshare-net", "--", "true"], capture_output=True,
                                      text=True, timeout=30)
                _PROBE["result"] = "" if proc.returncode == 0 else \
                    f"bubblewrap cannot run here ({(proc.stderr.strip().splitlines() or ['?'])[-1][:160]})"
            except (OSError, subprocess.TimeoutExpired) as e:
                _PROBE["result"] = f"bubblewrap cannot run here ({e})"
    return _PROBE["result"]


_BASE = ("--ro-bind", "/", "/", "--dev-bind", "/dev", "/dev", "--proc", "/proc", "--die-with-parent")


def sandboxed(cmd: list[str], writable: list[str], net: bool) -> list[str]:
    """cmd run by bubblewrap: the whole filesystem read-only but `writable`, devices (GPUs) visible, no network
    unless `net`. The process keeps its pid tree under ours, so a timeout still kills all of it."""
    binds = [arg for path in writable for arg in ("--bind", path, path)]
    return ["bwrap", *_BASE, *binds, *([] if net else ["--unshare-net"]), "--", *cmd]
