"""TensorBoard backend: scalars in event files under RUN_DIR/tensorboard."""

from __future__ import annotations

import time
from pathlib import Path


class TensorBoardWriter:
    """Writes scalars with torch's ``SummaryWriter`` (which needs the ``tensorboard`` package).

    Args:
        log_dir: where the event files go.
    """

    def __init__(self, log_dir: Path) -> None:
        from torch.utils.tensorboard import SummaryWriter  # imported here: only runs that ask for it pay for it

        self.log_dir = log_dir
        self._writer = SummaryWriter(log_dir=str(log_dir))

    def log_params(self, params: dict[str, str], config_yaml: str) -> None:
        # TensorBoard's text plugin renders markdown: indenting makes the YAML a code block
        self._writer.add_text("config", "\n".join("    " + line for line in config_yaml.splitlines()))

    def log_metrics(self, metrics: dict[str, float], *, step: int) -> None:
        now = time.time()
        for key, value in metrics.items():
            self._writer.add_scalar(key, value, global_step=step, walltime=now)
        self._writer.flush()  # so that a live `tensorboard --logdir` sees each update as it lands

    def close(self, *, failed: bool) -> None:
        self._writer.close()
