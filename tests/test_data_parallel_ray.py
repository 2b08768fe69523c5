"""The data-parallel server's tests again, with the replicas as Ray actors: `sluice
serve --distributed-executor-backend ray` starts a local Ray cluster of its own
(RAY_ADDRESS=local), places two replica actors on it, and a replica is killed by its
actor's pid. Needs the `dist` extra (Ray): `make test-dist` installs it."""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Iterator

import pytest
from serving import Server, serve
from test_data_parallel import (  # noqa: F401  (collected here, on this module's server)
    test_a_shared_prefix_goes_to_the_replica_that_holds_it,
    test_outputs_equal_one_engine,
    test_zz_a_killed_replica_loses_only_what_it_streamed,
)

pytestmark = [
    pytest.mark.dist,
    pytest.mark.ray,
    pytest.mark.skipif(
        importlib.util.find_spec("ray") is None,
        reason="Ray is not installed: pip install -e '.[dist]' (make test-dist does)",
    ),
]


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    saved = os.environ.get("RAY_ADDRESS")
    os.environ["RAY_ADDRESS"] = "local"  # a cluster of its own, not one found running
    try:
        with serve(
            "--data-parallel-size", "2",
            "--distributed-executor-backend", "ray",
            "--dtype", "float32",
            "--kv-cache-memory", "0.25",
            "--max-model-len", "1024",
            "--max-num-seqs", "2",
            "--shutdown-timeout", "60",
        ) as srv:  # fmt: skip
            yield srv
    finally:
        if saved is None:
            os.environ.pop("RAY_ADDRESS", None)
        else:
            os.environ["RAY_ADDRESS"] = saved
