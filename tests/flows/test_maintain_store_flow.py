"""The store maintenance flow under Prefect's test harness."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import ArtifactCollectionFilter, ArtifactCollectionFilterKey

from flexmarl.bench.store_bench import synthetic_samples
from flows.maintain_store import maintain_store
from storage.store import ExperienceStore, StoreError


def test_maintenance_flow_compacts_checkpoints_and_vacuums_every_table(prefect_api, tmp_path: Path) -> None:
    store = ExperienceStore(tmp_path / "store", compact_after_files=0)
    store.create(["solver", "verifier"])
    rng = np.random.default_rng(0)
    for k in range(5):
        store.append_samples("solver", synthetic_samples(4 * k, 4, policy_version=0, prompt_len=4, response_len=4,
                                                         rng=rng), app_id="r", seq=k + 1)
    before = store.read_samples("solver")

    rows = maintain_store(str(tmp_path / "store"))

    by_table = {r["table"]: r for r in rows}
    assert set(by_table) == {"episodes", "updates", "samples/solver", "samples/verifier"}
    solver = by_table["samples/solver"]
    assert (solver["files_before"], solver["files_after"]) == (5, 1)
    assert solver["version"] == store.version("samples/solver")
    assert solver["data_files_vacuumed"] == 0  # the compacted files are younger than the week's retention
    assert store.read_samples("solver").equals(before)
    log = tmp_path / "store" / "samples" / "solver" / "_delta_log"
    assert (log / f"{solver['version']:020d}.checkpoint.parquet").exists()

    with get_client(sync_client=True) as client:  # the metrics are published as a table artifact
        (artifact,) = client.read_latest_artifacts(
            artifact_filter=ArtifactCollectionFilter(key=ArtifactCollectionFilterKey(any_=["store-maintenance"]))
        )
    assert artifact.type == "table" and "samples/solver" in str(artifact.data)


def test_maintenance_flow_refuses_a_path_that_is_not_a_store(prefect_api, tmp_path: Path) -> None:
    with pytest.raises(StoreError, match="no Delta table"):
        maintain_store(str(tmp_path / "nowhere"))
