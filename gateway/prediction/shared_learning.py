"""The gateway's end of shared learning (`predictor.shared`): started from the config beside
the predictor and stopped before its last snapshot (`gateway.prediction.predict.Prediction`); the
app
exports its numbers (`GatewayMetrics.watch_shared_learning`)."""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING

from gateway.config import GatewayConfig

if TYPE_CHECKING:
    from predictor import LengthPredictor
    from predictor.shared import SharedLearning

log = logging.getLogger("sagesched.gateway")


async def start(config: GatewayConfig, predictor: LengthPredictor | None) -> SharedLearning | None:
    """Shared learning started for `predictor` (None when not configured, or with no
    predictor to share). An unreachable Redis is not an error: it is retried in the
    background while this replica learns locally."""
    settings = config.shared_learning
    if settings.redis_url is None:
        return None
    if predictor is None:
        log.warning("shared_learning.redis_url is set but the predictor is off: nothing to share")
        return None
    from predictor.shared import SharedLearning

    snapshot = config.predictor.snapshot_path
    shared = SharedLearning(
        predictor,
        settings.redis_url,
        stream=settings.stream,
        maxlen=settings.maxlen,
        replica_id=settings.replica_id or None,
        encoding=settings.encoding,
        buffer_items=settings.buffer,
        # what the snapshot holds is not warmed again (the predictor was loaded from it)
        warm_after_s=os.path.getmtime(snapshot) if snapshot and os.path.exists(snapshot) else None,
    )
    await shared.start()
    return shared
