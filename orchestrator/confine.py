"""What untrusted code gets to see: an allow-listed environment, and text for an LLM without the secrets.

Every edit of train.py comes from a search, a person, an LLM or a coding agent, and then runs: it gets the
variables a run needs (autoloop's, PATH, locale, device selection, proxies, the Python and CUDA setup), never
the controller's API keys, tokens, cloud credentials or agent sockets; `--pass-env NAME` adds one on purpose.
"""

from __future__ import annotations

import os
import re

ALLOWED = {"PATH", "HOME", "XDG_CONFIG_HOME", "XDG_DATA_HOME", "LANG", "LANGUAGE", "TZ", "TERM", "USER", "LOGNAME", "SHELL", "PYTHONPATH", "PYTHONHASHSEED",
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
