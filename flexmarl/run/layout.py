"""The files of a run directory, named once; the runtime writes them and the report reads them::

    RUN_DIR/config.yaml                      the resolved config
    RUN_DIR/attempts.txt                     one line per start or resume: its run id [and who started it]
    RUN_DIR/report.json                      per-agent counts and timings (the flow's publish-report)
    RUN_DIR/timeline.json                    worker spans and update events (``timeline_file.py``)
    RUN_DIR/meg.png, rewards.png             the graph and the agents' rewards, as the flow run's artifacts show
    RUN_DIR/store/                           the Delta tables (or the config's store.uri)
    RUN_DIR/state/                           training states: parked, and snapshots (or training.state_uri)
    RUN_DIR/evaluation.json                  `flexmarl evaluate`: the team on held-out problems, beside its base
    RUN_DIR/evaluation_runs.jsonl            ... and every node of every episode it ran
    RUN_DIR/checkpoints/<agent>/v<N>/        Hugging Face directories: weights and tokenizer (an adapter agent's:
                                             its adapter in peft's format, adapter_config.json, and tokenizer)
"""

import os
from pathlib import Path

from flexmarl.models.names import ADAPTER_CONFIG, MODEL_CONFIG  # noqa: F401 - a checkpoint holds one of them

CONFIG_FILE = "config.yaml"
ATTEMPTS_FILE = "attempts.txt"
REPORT_FILE = "report.json"
TIMELINE_FILE = "timeline.json"
MEG_PICTURE = "meg.png"
REWARDS_PICTURE = "rewards.png"
STORE_DIR = "store"
STATE_DIR = "state"
CHECKPOINTS_DIR = "checkpoints"
EVALUATION_FILE = "evaluation.json"
EVALUATION_RUNS_FILE = "evaluation_runs.jsonl"


def store_uri(configured: str | None, run_dir: str | os.PathLike) -> str:
    """The store of the run in ``run_dir``: the config's ``store.uri``, or ``RUN_DIR/store``."""
    return configured or str(Path(run_dir).resolve() / STORE_DIR)
