"""Deploy profiles for vllm-omni (``vllm-omni serve MODEL --omni --deploy-config PATH``), shipped as package data."""

from __future__ import annotations

from pathlib import Path

DEPLOY_DIR = Path(__file__).with_name("deploy")
PROFILES = {
    "high-throughput": "high_throughput.yaml",
    "low-latency": "low_latency.yaml",
    "default": "default.yaml",
}


def deploy_config_path(name: str) -> Path:
    """Path of a profile's YAML: ``high-throughput``, ``low-latency`` or ``default`` (underscores also accepted)."""
    key = str(name).strip().lower().replace("_", "-")
    if key not in PROFILES:
        raise ValueError(f"unknown deploy profile {name!r}; choose one of {', '.join(PROFILES)}")
    path = DEPLOY_DIR / PROFILES[key]
    if not path.is_file():
        raise FileNotFoundError(f"deploy profile {key!r} is missing from the installed package ({path})")
    return path
