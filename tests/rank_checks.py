"""Running a list of checks on every rank of a spawned process group."""

from __future__ import annotations

import traceback


def run_checks(checks, rank: int, world: int) -> list[str]:
    """Run every (name, check) on this rank and return the failures with their tracebacks, instead of
    raising at the first: every rank runs every check, so one failure cannot hang the other ranks."""
    failures = []
    for name, check in checks:
        try:
            check()
        except Exception:  # noqa: BLE001 - reported after the barrier, so no rank hangs
            failures.append(f"rank {rank}/{world} {name}:\n{traceback.format_exc()}")
    return failures


def finish(failures: list[str]) -> None:
    """Wait for every rank, close the process group, then raise this rank's failures (if any)."""
    import torch.distributed as dist

    dist.barrier()
    dist.destroy_process_group()
    if failures:
        raise AssertionError("\n".join(failures))
