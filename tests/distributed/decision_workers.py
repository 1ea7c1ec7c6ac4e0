"""What each rank runs in the rank-zero decision test (importable by spawned processes)."""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from microbatch import distributed


def decisions() -> dict[str, Any]:
    rank = dist.get_rank()
    ran: list[int] = []

    def decide() -> dict[str, int]:
        ran.append(rank)
        return {"chosen_by": rank}

    result: dict[str, Any] = {"value": distributed.decided_on_rank_zero(decide, what="choosing")}
    result["ran"] = ran

    def fails() -> int:
        raise ValueError("no plan fits")

    try:
        distributed.decided_on_rank_zero(fails, what="planning for the test")
        result["error"] = None
    except Exception as error:
        result["error"] = f"{type(error).__name__}: {error}"
    return result
