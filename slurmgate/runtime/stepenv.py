"""Step environments: the allow-listed part of the controller's environment, then the spec's own."""

from __future__ import annotations

from collections.abc import Mapping

from slurmgate.runtime.redact import CREDENTIAL_NAME

# What a lane, an endpoint or the client needs from the controller: the basics of a login,
# the Slurm client's configuration, and the CUDA/NCCL/Python/Hugging Face runtime settings.
ALLOWED_NAMES = frozenset(
    {
        "PATH",
        "HOME",
        "USER",
        "LOGNAME",
        "SHELL",
        "LANG",
        "LANGUAGE",
        "TERM",
        "TZ",
        "TMPDIR",
        "SLURM_CONF",
        "LD_LIBRARY_PATH",
        "PYTHONPATH",
        "PYTHONUNBUFFERED",
        "VIRTUAL_ENV",
        # where TLS finds its certificate authorities (a site's own CA for its model hub)
        "SSL_CERT_FILE",
        "SSL_CERT_DIR",
        "REQUESTS_CA_BUNDLE",
        "CURL_CA_BUNDLE",
    }
)
ALLOWED_PREFIXES = ("LC_", "CUDA_", "NCCL_", "NVIDIA_", "HF_", "TRANSFORMERS_", "VLLM_", "TORCH")
# Proxies are left out: their URLs often carry a user and password. A spec that needs one names
# it, e.g. `HTTPS_PROXY: {from_env: HTTPS_PROXY}`.
# A name that passes the allow-list but reads as a credential still stays behind, unless the
# spec names it (the spec's env is applied after this filter).


def allowed(name: str) -> bool:
    """`name` may pass from the controller's environment into a step."""
    if CREDENTIAL_NAME.search(name):
        return False
    return name in ALLOWED_NAMES or name.startswith(ALLOWED_PREFIXES)


def step_env(
    controller: Mapping[str, str], named: Mapping[str, str] | None = None
) -> dict[str, str]:
    """The allow-listed controller variables, then `named` (what the spec and runtime set)."""
    env = {k: v for k, v in controller.items() if allowed(k)}
    env.update(named or {})
    return env
