"""Training clauses: checkpoint recovery and fail-fast collectives (WL-TRN-*)."""
from __future__ import annotations

import pytest

from tests.runtime.training import (
    check_blocked_collectives_fail_fast,
    check_resume_matches_uninterrupted,
    check_worker_loss_recovers,
    training_cluster,
)

# The collective timeout the golden training image sets (TorchConfig.timeout_s):
# the design asks for minutes in production; the test model needs seconds.
COLLECTIVE_TIMEOUT_S = 20


@pytest.mark.clause("WL-TRN-1")
def test_resume_matches_uninterrupted(local_ray, evidence):
    """A training run interrupted with its driver and relaunched under the same name MUST resume from its
    latest checkpoint in shared storage and end with the same final loss as an uninterrupted run."""
    check_resume_matches_uninterrupted(training_cluster(local_ray), evidence)


@pytest.mark.clause("WL-TRN-2")
def test_worker_node_loss_recovers(local_ray, evidence):
    """When a worker node dies mid-training, Ray Train MUST restart the worker group from the last checkpoint,
    the first step after restart MUST be that checkpoint's step + 1, at most one checkpoint interval of steps
    MUST be lost, and the run MUST finish."""
    check_worker_loss_recovers(training_cluster(local_ray), evidence)


@pytest.mark.clause("WL-TRN-3")
def test_blocked_collectives_fail_fast(local_ray, evidence):
    """When traffic between the training workers is dropped, the run MUST fail within the collective timeout
    plus the stated slack, with a reason that names the timeout, and no training step MUST run."""
    check_blocked_collectives_fail_fast(training_cluster(local_ray), evidence,
                                        promised_timeout_s=COLLECTIVE_TIMEOUT_S,
                                        configured_timeout_s=COLLECTIVE_TIMEOUT_S)
