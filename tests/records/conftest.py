"""Local Ray and Spark clusters for the engine tests: one of each per test session, shut down at its end.

Each fixture skips, with what to install, where its engine is missing; under ``nox -s tests``, which
installs both (the ray and spark extras) and sets PARITY_ENGINES_REQUIRED, it fails instead, so CI
never passes by skipping them. Spark needs Java 17 or later (every machine of this project has it).
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import sys

import pytest


def _missing(why: str) -> None:
    if os.environ.get("PARITY_ENGINES_REQUIRED"):
        pytest.fail(why + " (PARITY_ENGINES_REQUIRED is set)")
    pytest.skip(why)


@pytest.fixture(scope="session")
def ray_cluster():
    if importlib.util.find_spec("ray") is None:
        _missing("needs ray: pip install 'parity[ray]' (nox -s tests installs it)")
    import ray

    ray.init(num_cpus=2, include_dashboard=False, object_store_memory=256 * 2**20, log_to_driver=False,
             logging_level="WARNING")
    try:
        yield ray
    finally:
        ray.shutdown()


@pytest.fixture(scope="session")
def spark_session():
    if importlib.util.find_spec("pyspark") is None:
        _missing("needs pyspark: pip install 'parity[spark]' (nox -s tests installs it)")
    if not (os.environ.get("JAVA_HOME") or shutil.which("java")):
        _missing("Spark needs Java 17 or later: none on PATH and JAVA_HOME is not set")
    from pyspark.sql import SparkSession

    os.environ["PYSPARK_PYTHON"] = sys.executable  # the workers import parity from this environment
    spark = (
        SparkSession.builder.master("local[2]").appName("parity tests")
        .config("spark.ui.enabled", "false")
        # Small splits (the test shards are 30-60 KB): three of the four files are read by two or three tasks, so
        # rows of one file reach different workers and their summaries merge.
        .config("spark.sql.files.maxPartitionBytes", "16384")
        .config("spark.sql.files.openCostInBytes", "0")
        .getOrCreate()
    )
    spark.sparkContext.setLogLevel("ERROR")
    try:
        yield spark
    finally:
        spark.stop()
