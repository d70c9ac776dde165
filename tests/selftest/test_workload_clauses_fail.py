"""Each WL-* clause fails, with a message naming the cause, on a setup that breaks it.

A suite that cannot fail proves nothing: these run the clauses' own checks on
a deliberately misconfigured local cluster and require the failure.
"""
from __future__ import annotations

import pytest

from tests.runtime import serving, training
from tests.runtime.test_head_pressure import check_head_pressure_is_oom_killed

pytestmark = pytest.mark.slow


def test_trn1_fails_when_checkpoints_are_not_on_shared_storage(local_ray, evidence):
    cluster = training.training_cluster(local_ray)
    with pytest.raises(AssertionError, match="started from step 0 instead of a checkpoint"):
        training.check_resume_matches_uninterrupted(cluster, evidence, storage_per_launch=True)


def test_trn2_fails_when_no_retries_are_allowed(local_ray, evidence):
    cluster = training.training_cluster(local_ray)
    with pytest.raises(AssertionError, match="did not survive the loss of node"):
        training.check_worker_loss_recovers(cluster, evidence, max_failures=0)


def test_trn3_fails_when_the_collective_timeout_is_left_long(local_ray, evidence):
    cluster = training.training_cluster(local_ray)
    with pytest.raises(AssertionError, match="hangs instead of failing fast"):
        training.check_blocked_collectives_fail_fast(cluster, evidence, promised_timeout_s=20,
                                                     configured_timeout_s=1800)


def test_gcs1_fails_without_gcs_fault_tolerance(local_ray, evidence, monkeypatch):
    # Without FT the application never comes back; do not wait the full tier for it.
    monkeypatch.setenv("RAYPROOF_TIMEOUT_HEAD_RECOVERY", "90")
    cluster = serving.serve_cluster(local_ray, gcs_ft=False)
    with pytest.raises(AssertionError, match="RUNNING again on the restarted head|availability while the GCS was down"):
        serving.check_serve_survives_gcs_loss(cluster, evidence)


def test_gcs2_fails_when_the_application_survives_the_kill(local_ray, evidence):
    cluster = serving.serve_cluster(local_ray, gcs_ft=True)
    with pytest.raises(AssertionError, match="the kill did not take effect"):
        serving.check_gcs_loss_without_ft_is_reported(cluster, evidence)


def test_mem1_fails_without_a_head_memory_limit(local_ray, evidence):
    cluster = local_ray(head_cpus=1)
    with pytest.raises(AssertionError, match="instead of being OOM-killed"):
        check_head_pressure_is_oom_killed(cluster, evidence, target_bytes=256 * 2**20)
