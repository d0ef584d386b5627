"""A Lease's annotations by read-modify-write, against the fake API server (which answers a
stale resourceVersion with 409, as the real one does)."""

from __future__ import annotations

from typing import Any

from kubernetes import client

from kvpilot.agent.runtimes.kubernetes.lease_annotations import (
    AnnotationChange,
    LeaseAnnotations,
)
from tests.agent.k8s.conftest import NAMESPACE
from tests.fakes.k8s_apiserver import FakeKubernetesApi


def lease(fake: FakeKubernetesApi) -> LeaseAnnotations:
    return LeaseAnnotations(fake.api_client(), namespace=NAMESPACE, name="d-kvpilot-restarts")


def stored(fake: FakeKubernetesApi) -> dict[str, Any]:
    found: dict[str, Any] = fake.leases[(NAMESPACE, "d-kvpilot-restarts")]
    return found


def test_a_missing_lease_is_created_with_its_annotations_and_spec_then_changed_in_place(
    fake: FakeKubernetesApi,
) -> None:
    one = lease(fake)
    assert one.read() is None
    spec = client.V1LeaseSpec(lease_duration_seconds=30)
    assert one.write(None, AnnotationChange({"a": "1", "b": None}, spec))
    assert stored(fake)["metadata"]["annotations"] == {"a": "1"}
    assert stored(fake)["spec"] == {"leaseDurationSeconds": 30}
    # Set one, remove one, keep the rest and the spec read.
    fake.leases[(NAMESPACE, "d-kvpilot-restarts")]["metadata"]["annotations"]["c"] = "kept"
    assert one.write(one.read(), AnnotationChange({"b": "2", "a": None}))
    assert stored(fake)["metadata"]["annotations"] == {"b": "2", "c": "kept"}
    assert stored(fake)["spec"] == {"leaseDurationSeconds": 30}
    assert [r.method for r in fake.writes()] == ["POST", "PUT"]


def test_a_write_on_a_stale_read_loses_and_an_edit_reads_again(fake: FakeKubernetesApi) -> None:
    one, other = lease(fake), lease(fake)
    assert one.write(None, AnnotationChange({"holder": "a"}))
    stale = one.read()
    assert other.write(other.read(), AnnotationChange({"holder": "b"}))
    # The resourceVersion read is gone: the write is refused, the other's word stands.
    assert not one.write(stale, AnnotationChange({"holder": "a"}))
    assert stored(fake)["metadata"]["annotations"] == {"holder": "b"}
    # Two writers creating it at once: the second's create meets AlreadyExists.
    assert not other.write(None, AnnotationChange({"holder": "c"}))


def test_an_edit_retries_a_conflict_and_writes_nothing_when_told_not_to(
    fake: FakeKubernetesApi,
) -> None:
    one, racer = lease(fake), lease(fake)
    assert one.write(None, AnnotationChange({"n": "0"}))
    tries: list[str] = []

    def bump(read: Any | None) -> AnnotationChange:
        n = read.metadata.annotations["n"]
        tries.append(n)
        if len(tries) == 1:  # another writer lands between this read and its write
            assert racer.write(racer.read(), AnnotationChange({"n": "racer"}))
        return AnnotationChange({"n": f"{n}+1"})

    assert one.edit(bump, tries=2)
    assert tries == ["0", "racer"]
    assert stored(fake)["metadata"]["annotations"]["n"] == "racer+1"

    def lose_once(read: Any | None) -> AnnotationChange:
        assert racer.write(racer.read(), AnnotationChange({"n": "again"}))
        return AnnotationChange({"n": "mine"})

    assert not one.edit(lose_once, tries=1)  # one try, lost to the racer: not written
    assert stored(fake)["metadata"]["annotations"]["n"] == "again"

    writes = len(fake.writes())
    assert not one.edit(lambda read: None, tries=3)
    assert len(fake.writes()) == writes
