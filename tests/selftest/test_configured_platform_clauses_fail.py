"""Each Kubernetes clause fails, for its stated cause, on the reference platform with one configuration change.

A suite that cannot fail proves nothing. Each case runs the real clause (a
pytest subprocess, exactly as `rayproof certify` runs it) against an embedded
platform with the default settings and requires the clause's outcome to be
``failed`` with a message that names the cause.

Each case is the self-test entry of its clause in the mutation catalogue
(``clusters/embedded/mutations/catalogue.yaml``, entries marked
``selftest``); ``bin/rayproof bench mutants`` runs the whole catalogue.

The change is one a platform team makes. Most are a change to one of the
platform's golden templates (``clusters/embedded/golden/``), which the
profile points at exactly as a platform points it at its own: a golden image
that leaves Ray Train's 30-minute collective timeout, a RayService without
GCS fault tolerance, a head on its node's network, finished clusters kept for
ten minutes. Others change an onboarding class of the platform
(``clusters/embedded/onboarding/``), installed beside the reference one as
its operators would and named by the profile's ``teams.namespaceLabels``:
ClusterQueues that never preempt, a worker policy that admits the head
only, team namespaces whose heads are left open. One points the profile at
another of the platform's storage classes, a node-local one.

None of these changes needs a platform of its own, yet they run on one (with
the default settings): SEC-1, which judges every Service and Ray pod of the
cluster, would see on the session's platform the host-network head its
self-test exposes on purpose.
Each lane holds one of the machine's host slots while it uses the platform,
and its nested runs inherit it (fixtures/sharing.py): beside the clauses on the session's platform on
two cores they once made it slow enough that Kueue evicted the gangs of
other clauses by waitForPodsReady (measured: TRN-1's gang evicted four times
in ten minutes, its head's container started 74 s after it was scheduled).
"""
from __future__ import annotations

from pathlib import Path
from typing import Iterator

import pytest

from benchmarks import mutants
from clusters.embedded.mutations import Mutation
from tests.selftest.clause_runs import catalogue_params, expect_failure, misconfigured_platform, platforms_group, run_clause

pytestmark = pytest.mark.slow
# Three lanes (xdist groups) of nested runs on the one platform these share
# (each lane's worker joins it; the last to leave takes it down): one lane
# alone was the run's longest (eleven nested runs, 55 minutes on two cores).
TIMEOUT_LANE, TEMPLATE_LANE, ONBOARDING_LANE = (platforms_group(f"{__name__}-{lane}")
                                                 for lane in ("collective-timeout", "templates", "onboarding"))


@pytest.fixture(scope="module")
def default_platform(pytestconfig: pytest.Config,
                     tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    """Module scope; an embedded platform with the default settings, shared by
    the workers of this module's lanes; taken down by the last to leave it."""
    yield from misconfigured_platform(pytestconfig, tmp_path_factory, "selftest-default", {})


def lane(m: Mutation) -> pytest.MarkDecorator:
    """The lane an entry's self-tests run in: the three collective-timeout
    runs together, the other template changes, the onboarding and pointer changes."""
    if m.id == "collective-timeout-left-at-ray-trains-default":
        return TIMEOUT_LANE
    return TEMPLATE_LANE if m.kind == "template" else ONBOARDING_LANE


@pytest.mark.parametrize(("clause", "mutation", "causes"), catalogue_params(("template",), lane))
def test_clause_fails_on_a_changed_golden_template(default_platform, tmp_path, clause: str, mutation: Mutation,
                                                   causes: tuple[str, ...]) -> None:
    name, platform_profile = default_platform
    row = run_clause(tmp_path, clause, profile=mutants.template_profile(mutation, tmp_path / "golden"),
                     platform=name, platform_profile=platform_profile, bounds=mutation.bounds)
    expect_failure(row, *causes)


@pytest.mark.parametrize(("clause", "mutation", "causes"), catalogue_params(("onboarding",), lane))
def test_clause_fails_on_a_changed_onboarding(default_platform, tmp_path, clause: str, mutation: Mutation,
                                              causes: tuple[str, ...]) -> None:
    """The reference ``standard`` onboarding class with the entry's change is
    installed beside it, as the platform's operators would, and removed at the end."""
    from clusters.embedded.platform import EmbeddedPlatform

    name, platform_profile = default_platform
    profile, remove = mutants.installed_onboarding_class(EmbeddedPlatform(name).api_client(), mutation)
    try:
        row = run_clause(tmp_path, clause, profile=profile, platform=name, platform_profile=platform_profile)
    finally:
        remove()
    expect_failure(row, *causes)


@pytest.mark.parametrize(("clause", "mutation", "causes"), catalogue_params(("profile",), lane))
def test_clause_fails_where_the_profile_points_at_a_broken_platform_object(default_platform, tmp_path, clause: str,
                                                                          mutation: Mutation,
                                                                          causes: tuple[str, ...]) -> None:
    name, platform_profile = default_platform
    row = run_clause(tmp_path, clause, profile=mutation.profile(), platform=name, platform_profile=platform_profile)
    expect_failure(row, *causes)
