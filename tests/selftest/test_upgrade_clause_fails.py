"""UPG-1 fails, for its stated cause, on a platform whose upgrade procedure recreates the KubeRay CRDs.

The case is UPG-1's self-test entry of the mutation catalogue
(``upgrade-recreates-the-kuberay-crds`` in
``clusters/embedded/mutations/catalogue.yaml``): the platform's upgrade
procedure (the embedded profile's ``kuberay.upgradeCRDs: recreate``) deletes
the CRDs and creates them again (`kubectl delete -f crds/ && kubectl create
-f crds/`, a way round client-side apply's size limit on the 1 MB KubeRay
CRDs) instead of applying them in place. The API server deletes every
RayJob, RayCluster and RayService with them, so the training and the
RayService under load are gone.

The "upgrade" redeploys the version the platform runs: the procedure is what
breaks the clause, and building a second KubeRay (17 minutes on two cores)
would prove nothing more. A platform of its own, since the procedure deletes
every Ray object of the cluster, other clauses' included.
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Iterator

import pytest

from benchmarks.mutants import clause_options
from clusters.embedded import mutations
from core.catalogue import UPGRADE_CLAUSE, clause_tests
from tests.selftest.clause_runs import expect_failure, misconfigured_platform, platforms_group, run_clause

pytestmark = [pytest.mark.slow, platforms_group(__name__)]
ENTRY = next(m for m in mutations.load() if UPGRADE_CLAUSE in m.selftest)


@pytest.fixture(scope="module")
def crd_recreating_platform(pytestconfig: pytest.Config,
                            tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    """Module scope; a platform that upgrades KubeRay by deleting and creating
    its CRDs again; taken down at teardown."""
    yield from misconfigured_platform(pytestconfig, tmp_path_factory, "selftest-crd-recreate",
                                      ENTRY.platform_profile())


def test_upg1_fails_when_the_upgrade_recreates_the_crds(crd_recreating_platform, tmp_path) -> None:
    name, platform_profile = crd_recreating_platform
    # The entry's bounds: the deletion never completes (Kueue's job webhook
    # refuses the GCS-FT Redis cleanup Job of the RayService's cluster once
    # the RayService is gone, so its finalizer holds the rayclusters CRD, and
    # later the test's namespace, until the teardown drops it). Both waits
    # are object_delete's; a shorter one only shortens how long the run looks.
    row = run_clause(tmp_path, clause_tests()[UPGRADE_CLAUSE], platform=name, platform_profile=platform_profile,
                     options=clause_options(UPGRADE_CLAUSE), bounds=ENTRY.bounds)
    expect_failure(row, *ENTRY.expect[UPGRADE_CLAUSE])
    deleted = re.search(r"deleted \[([^\]]*)\]", row["message"])
    assert deleted and "RayJob " in deleted[1] and "RayService " in deleted[1], (
        f"UPG-1 failed, but not naming the deleted RayJob and RayService: {row['message'][:800]}")
