"""Running one clause as `rayproof certify` does, and the embedded platforms the self-tests run it on."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Iterator

import pytest
import yaml

from benchmarks import mutants
from clusters.embedded import mutations
from clusters.embedded.mutations import Mutation
from clusters.embedded.target import EmbeddedTarget
from core.catalogue import clause_tests
from core.schema import merged
from fixtures.sharing import host_slot


# Each self-test module that starts platforms of its own is one xdist group:
# one worker starts and takes down that module's platforms (their names are
# fixed), beside the workers that run other modules and the clauses on the
# session's platform. How much of this runs at once is set by the machine's
# host slots (fixtures/sharing.py), which every platform start, clause and
# nested clause run here holds, not by the grouping.
def platforms_group(module: str) -> pytest.MarkDecorator:
    """The xdist group of the self-test module ``module`` (its ``__name__``)."""
    return pytest.mark.xdist_group(f"selftest-platforms-{module.rsplit('.', 1)[-1]}")


def run_clause(tmp_path: Path, test: str, **kwargs: Any) -> dict[str, Any]:
    """Run one clause (``path::test``) as certify does; its result row (see
    :func:`benchmarks.mutants.run_clause`, which ``bench mutants`` runs too)."""
    return mutants.run_clause(tmp_path, test, **kwargs)


def expect_failure(row: dict[str, Any], *causes: str) -> None:
    """The clause failed, and its message names one of ``causes``."""
    output = row.get("output", "")
    assert row["outcome"] == "failed", (f"{row['clause']} {row['outcome']} on a platform that breaks it: "
                                        f"{row['message'][:500]}\n--- the clause run's output, last part:\n{output[-6000:]}")
    assert mutants.verdict(row, causes) == mutants.KILLED, (
        f"{row['clause']} failed, but its message does not name the cause ({causes}): {row['message'][:800]}"
        f"\n--- the clause run's output, last part:\n{output[-12000:]}")


def catalogue_params(kinds: tuple[str, ...], lane: Callable[[Mutation], pytest.MarkDecorator]) -> list[Any]:
    """One ``pytest.param(clause test, entry, causes)`` per clause whose
    self-test is an entry of the mutation catalogue of one of ``kinds``
    (clusters/embedded/mutations/catalogue.yaml), in the xdist group ``lane(entry)``."""
    tests = clause_tests()
    return [pytest.param(tests[clause], m, m.expect[clause], id=f"{clause.lower()}-{m.id}", marks=lane(m))
            for m in mutations.load() if m.kind in kinds for clause in m.selftest]


def run_platform_profile(config: pytest.Config) -> dict[str, Any]:
    """The fields of the run's ``--platform-profile`` file (none without one)."""
    path = config.getoption("--platform-profile")
    return (yaml.safe_load(Path(path).read_text()) or {}) if path else {}


def misconfigured_platform(config: pytest.Config, tmp_path_factory: pytest.TempPathFactory, name: str,
                           profile: dict) -> Iterator[tuple[str, Path]]:
    """An embedded platform started with ``profile`` over the run's own
    platform profile (``--platform-profile``, so ``bin/rayproof test
    --platform-profile real-nodes.yaml`` puts every platform of the run on
    real nodes) over the defaults, or joined, where another session started
    it with the same; taken down by the last session to leave it.

    The session holds one host slot from before the start until it leaves,
    and its nested clause runs inherit it: they run back to back instead of
    each waiting for a slot while the platform's control plane idles beside
    the rest of the run (in the rehearsal before this, the Kueue-unmanaged
    platform stood 20 minutes for three clause runs of about a minute each)."""
    path = tmp_path_factory.mktemp(name) / "platform-profile.yaml"
    path.write_text(yaml.safe_dump(merged(run_platform_profile(config), profile)))
    EmbeddedTarget.wait_for_room(name=name, profile=path)  # before the slot: it would stand idle meanwhile
    with host_slot():
        target = EmbeddedTarget.start(name=name, profile=path, progress=print, wait_for_room=True)
        try:
            yield name, path
        finally:
            target.close()  # down when no other session of this machine uses it


class OnePlatformAtATime:
    """A self-test module's misconfigured platforms (:func:`misconfigured_platform`), one up at a time: asking
    for another takes the last one down first. A module's tests run one after another in one worker (its
    xdist group), so a module of several platforms holds one of them at a time, where module-scoped fixtures
    would hold every one until the module ends (on real nodes two cores' inotify instances hold two four-node
    platforms, the session's and one more)."""

    def __init__(self, config: pytest.Config, tmp_path_factory: pytest.TempPathFactory):
        self.config, self.tmp_path_factory = config, tmp_path_factory
        self.name: str | None = None
        self.platform: tuple[str, Path] | None = None
        self._running: Iterator[tuple[str, Path]] | None = None

    def get(self, name: str, profile: dict) -> tuple[str, Path]:
        """Platform ``name`` started with ``profile`` (as :func:`misconfigured_platform`), the last one down."""
        if self.platform is None or self.name != name:
            self.close()
            self._running = misconfigured_platform(self.config, self.tmp_path_factory, name, profile)
            self.name, self.platform = name, next(self._running)
        return self.platform

    def close(self) -> None:
        """Take the platform up now down (its session leaves it), if any."""
        running, self._running, self.name, self.platform = self._running, None, None, None
        if running is not None:
            running.close()
