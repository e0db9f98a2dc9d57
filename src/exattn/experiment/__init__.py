"""The tile x length x precision study behind `exattn experiment`, `exattn memory` and `exattn plan`."""

from .config import ConfigError, ExperimentConfig, build_config
from .sweep import Results, plan_runs, run_sweep

__all__ = ["ConfigError", "ExperimentConfig", "Results", "build_config", "plan_runs", "run_sweep"]
