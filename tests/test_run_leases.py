"""Who owns what a run leaves on a cluster: owner tokens judged only where a
PID means something, and each run's lease, read from any host.

The platform tests play two other runs on the session's platform: one from
another container on this host (the same host name and the same PID as this
process, another PID namespace) whose lease is renewed, and one whose
runner was SIGKILLed (its lease last renewed ten minutes ago). The janitor,
as `rayproof clean` and certify's start-up sweep run it, must remove the
second's namespaces and never the first's.
"""
from __future__ import annotations

import dataclasses
import datetime as dt
import secrets
import subprocess
from typing import Any, Iterator

import pytest

from clusters import access
from core import processes, timeouts
from core.waiting import wait_for
from fixtures import janitor, leases
from fixtures.kube import OWNER_ANNOTATION, release_namespace
from rayproof import cli
from tests.test_certify_verdict import CERTIFY_SWEEPS


def test_an_owner_token_names_boot_pid_namespace_process_and_nonce() -> None:
    me = processes.me()
    assert processes.parse_token(me.token) == me
    assert me.local and me.alive() is True
    assert me.nonce == processes.me().nonce, "one nonce per process"


def test_an_owner_stays_alive_when_the_boot_time_steps_by_a_second(monkeypatch) -> None:
    """/proc/stat's btime is derived anew at each read in whole seconds, so on
    a machine whose clock is slewed it steps by one; a wall-clock start then
    differed by 1.0 s from the recorded one and a live owner (a platform's
    user) looked dead. The start is now seconds since boot, from clock ticks."""
    import psutil

    me = processes.me()
    real = psutil.boot_time()
    monkeypatch.setattr(psutil, "boot_time", lambda: real + 1.0)
    assert processes.parse_token(me.token).alive() is True
    # An earlier rayproof's token (rp2: wall-clock start) is still judged, within the step.
    legacy = f"rp2/{me.host}/{me.boot}/{me.pidns}/{me.pid}/{real + me.started!r}/{me.nonce}"
    assert processes.parse_token(legacy).alive() is True
    assert processes.parse_token(legacy.replace(f"/{me.pid}/", f"/{_gone_pid()}/")).alive() is False


def test_a_pid_is_judged_only_in_its_own_boot_and_pid_namespace() -> None:
    me, gone = processes.me(), _gone_pid()
    assert dataclasses.replace(me, pid=gone).alive() is False, "this PID namespace, process gone"
    assert dataclasses.replace(me, started=me.started - 3600).alive() is False, "a recycled PID is not its owner"
    # Another container with the same host name: its PID is not judged from here.
    assert dataclasses.replace(me, pidns=me.pidns + 1, pid=gone).alive() is None
    assert dataclasses.replace(me, boot="another-boot", pid=gone).alive() is None, "another machine, or a reboot"
    # An older rayproof's token names no boot or PID namespace: never judged by its PID.
    assert processes.token_alive(f"{me.host}:{gone}:1.0") is None


@pytest.mark.parametrize("bad", ["", "Run1", "a-b", "x" * 21, "../etc"])
def test_run_ids_are_validated(bad: str) -> None:
    with pytest.raises(leases.BadRunId):
        leases.check_run_id(bad)


@pytest.mark.parametrize(("text", "seconds"), [("90s", 90), ("30m", 1800), ("2h", 7200), ("1.5d", 129600)])
def test_older_than_durations(text: str, seconds: float) -> None:
    assert cli._duration_s(text) == seconds


@pytest.mark.parametrize("bad", ["2", "h", "-1h", "2w", "1e3s"])
def test_older_than_rejects_what_is_not_a_duration(bad: str) -> None:
    with pytest.raises(ValueError, match="--older-than"):
        cli._duration_s(bad)


# -- on the session's platform ------------------------------------------------------------
# The played runs below are other runs' objects: a certify starting beside these
# tests would sweep the ended ones, so they share certify's xdist group.
ON_THE_PLATFORM = CERTIFY_SWEEPS


def _run_id() -> str:
    return "t" + secrets.token_hex(5)


class PlayedRun:
    """Another run's objects, written as that run would have: its lease
    namespace with one Lease renewed at ``renewed``, and one team namespace
    owned by ``owner``."""

    def __init__(self, api: Any, owner: processes.Owner, renewed: dt.datetime) -> None:
        from kubernetes import client

        self.owner = owner
        self.core, self.custom = client.CoreV1Api(api), client.CustomObjectsApi(api)
        self.run_id = _run_id()
        self.lease_namespace = leases.lease_namespace(self.run_id)
        self.team_namespace = f"rp-{self.run_id}-a"
        labels = {leases.RUN_LABEL: self.run_id}
        self.core.create_namespace({"metadata": {"name": self.lease_namespace,
                                                 "labels": {**labels, leases.ROLE_LABEL: leases.LEASE_ROLE}}})
        access.bind_run_role(api, self.lease_namespace, labels)  # as a run binds its role in what it makes
        at = renewed.strftime("%Y-%m-%dT%H:%M:%S.%fZ")
        client.CoordinationV1Api(api).create_namespaced_lease(self.lease_namespace, {
            "metadata": {"name": "holder", "labels": labels},
            "spec": {"holderIdentity": owner.token, "leaseDurationSeconds": leases.LEASE_DURATION_S,
                     "acquireTime": at, "renewTime": at}})
        self.core.create_namespace({"metadata": {"name": self.team_namespace, "labels": labels,
                                                 "annotations": {OWNER_ANNOTATION: owner.token}}})
        access.bind_run_role(api, self.team_namespace, labels)

    @property
    def namespaces(self) -> set[str]:
        return {self.lease_namespace, self.team_namespace}

    def present(self) -> set[str]:
        """Those of its namespaces that exist and are not being deleted."""
        return {ns.metadata.name for ns in self.core.list_namespace(label_selector=f"{leases.RUN_LABEL}={self.run_id}")
                .items if not ns.metadata.deletion_timestamp}

    def remove(self) -> None:
        for ns in self.namespaces:
            release_namespace(self.core, self.custom, ns)


def _gone_pid() -> int:
    """A PID no process of this PID namespace has now."""
    gone = subprocess.Popen(["true"])
    gone.wait()
    return gone.pid


@pytest.fixture
def other_container(kube_api) -> Iterator[PlayedRun]:
    """A live run in another container of this host: same host name, another
    PID namespace, in which its runner has a PID that no process here has;
    its lease renewed just now."""
    me = processes.me()
    run = PlayedRun(kube_api, dataclasses.replace(me, pidns=me.pidns + 1, pid=_gone_pid(), nonce="0ther"),
                    dt.datetime.now(dt.timezone.utc))
    try:
        yield run
    finally:
        run.remove()


@pytest.fixture
def killed_runner(kube_api) -> Iterator[PlayedRun]:
    """A run whose runner (another container, same host name) was SIGKILLed
    ten minutes ago: its lease expired."""
    me = processes.me()
    ten_minutes_ago = dt.datetime.now(dt.timezone.utc) - dt.timedelta(minutes=10)
    run = PlayedRun(kube_api, dataclasses.replace(me, pidns=me.pidns + 1, pid=_gone_pid(), nonce="k1lled"),
                    ten_minutes_ago)
    try:
        yield run
    finally:
        run.remove()


def _found(api: Any, run: PlayedRun, **kwargs: Any) -> set[str]:
    return {left.namespace for left in janitor.orphaned_on_cluster(api, **kwargs) if left.run_id == run.run_id}


@ON_THE_PLATFORM
def test_a_run_of_another_container_with_this_host_and_pid_is_never_swept(kube_api, other_container,
                                                                          killed_runner) -> None:
    """Two runs with the same host name and PID space never delete each
    other's objects; a run whose lease expired is removed from any host."""
    states = leases.run_states(kube_api)
    assert states[other_container.run_id].live, states[other_container.run_id]
    assert not states[killed_runner.run_id].live, states[killed_runner.run_id]

    assert _found(kube_api, other_container) == set(), "its lease is renewed"
    other_pid = processes.token_pid(other_container.owner.token)
    assert _found(kube_api, other_container, owners={other_pid}) == set(), \
        "a PID of another PID namespace is not one of this session's workers, though the number matches"
    assert _found(kube_api, other_container, older_than_s=0) == set(), "--older-than never passes a live lease"
    assert _found(kube_api, killed_runner) == killed_runner.namespaces

    # As `rayproof clean` and certify's start-up sweep remove them (the lease namespace last).
    leftovers = [left for left in janitor.orphaned_on_cluster(kube_api) if left.run_id == killed_runner.run_id]
    assert [left.lease for left in leftovers] == [False, True]
    done = janitor.clean_on_cluster(kube_api, leftovers)
    assert all("lease last renewed" in line for line in done), done
    wait_for(killed_runner.present, lambda left: not left, timeout=timeouts.OBJECT_DELETE,
             description=f"the killed runner's namespaces {sorted(killed_runner.namespaces)} to be deleted")
    assert other_container.present() == other_container.namespaces


@ON_THE_PLATFORM
def test_clean_run_refuses_a_live_run_and_removes_an_ended_one(target, kube_api, other_container, killed_runner,
                                                               capsys) -> None:
    kubeconfig = ["--kubeconfig", str(target.kubeconfig)]
    assert cli.main(["clean", "--run", other_container.run_id, *kubeconfig]) == cli.CLEAN_REFUSED_EXIT
    assert "is live" in capsys.readouterr().err
    assert other_container.present() == other_container.namespaces

    assert cli.main(["clean", "--run", killed_runner.run_id, *kubeconfig]) == 0
    out = capsys.readouterr().out
    assert f"namespace {killed_runner.team_namespace}" in out and f"namespace {killed_runner.lease_namespace}" in out
    wait_for(killed_runner.present, lambda left: not left, timeout=timeouts.OBJECT_DELETE,
             description="the ended run's namespaces to be deleted by `clean --run`")

    assert cli.main(["clean", "--run", "Not/A-Run", *kubeconfig]) == cli.BAD_INPUT_EXIT


@ON_THE_PLATFORM
def test_a_run_lease_is_live_while_held_and_gone_with_its_last_holder(kube_api) -> None:
    run_id = _run_id()
    first = leases.RunLease(kube_api, run_id).acquire()
    second = leases.RunLease(kube_api, run_id)
    second.name += "-2"  # a second process of the run (an xdist worker)
    second.acquire()
    try:
        state = leases.run_states(kube_api)[run_id]
        assert state.live and state.holders == (processes.owner_token(),) * 2, state
        first.release()
        assert leases.run_states(kube_api)[run_id].live, "one holder left"
    finally:
        first.release()
        second.release()
    state = leases.run_states(kube_api).get(run_id)
    assert state is None or not state.live, state


@ON_THE_PLATFORM
def test_a_session_removes_the_lease_its_killed_workers_could_not_give_back(kube_api) -> None:
    """xdist stops interrupted workers before they give their Lease back: the
    session's controller removes the run's lease namespace once every holder
    is one of its workers and gone, though the lease has not expired yet."""
    worker = dataclasses.replace(processes.me(), pid=_gone_pid(), nonce="w0rker")
    run = PlayedRun(kube_api, worker, dt.datetime.now(dt.timezone.utc))
    try:
        assert leases.run_states(kube_api)[run.run_id].live, "renewed a moment ago"
        assert _found(kube_api, run, owners={worker.pid + 1}) == set(), "not this session's worker"
        assert _found(kube_api, run, owners={worker.pid}) == run.namespaces
        assert _found(kube_api, run) == {run.team_namespace}, \
            "without the session's word only the team namespace, whose owner is gone here, goes before the lease expires"
    finally:
        run.remove()


def test_a_process_whose_lease_renewals_fail_stops_writing(monkeypatch) -> None:
    """Renewals that keep failing for LOST_AFTER_S make the process's lease
    lost (the lab fixture then ends the run, INCOMPLETE), with the error said."""
    from types import SimpleNamespace as NS

    lease = leases.RunLease.__new__(leases.RunLease)
    lease.namespace, lease.name = "rp-run-x", "holder-1-n"
    lease.renew_errors, lease.last_error = 0, ""
    lease._renewed_at = 1000.0
    clock = {"now": 1000.0}
    monkeypatch.setattr(leases.time, "monotonic", lambda: clock["now"])
    assert lease.lost is None
    clock["now"] += leases.LOST_AFTER_S - 1
    assert lease.lost is None, "one renewal from expiry is still held"

    def refuse(*_a, **_k):
        raise RuntimeError("connection refused")

    lease._leases = NS(patch_namespaced_lease=refuse)
    stops = iter([False, True])
    lease._stop = NS(wait=lambda _s: next(stops))
    lease._renew()
    clock["now"] += 2
    lost = lease.lost
    assert lost and "rp-run-x/holder-1-n" in lost and "connection refused" in lost and "stops writing" in lost
