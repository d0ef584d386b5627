"""Host PID to our-namespace PID mapping over hand-written /proc trees."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest

from kvpilot.collectors.pidmap import ROOT_PID_NAMESPACE, PidMapper, parse_status
from tests.fakes.nvml import OTHER_NAMESPACE, OUR_NAMESPACE, FakeProcEntry, write_proc

# The sidecar in a pod, reading the host's /proc: host PID 5000, PID 7 in the pod.
SIDECAR = FakeProcEntry(ns_pids=(5000, 7), parent_pid=4990)
VLLM = FakeProcEntry(ns_pids=(6001, 1), parent_pid=4991)  # the pod's PID 1
WORKER = FakeProcEntry(ns_pids=(6002, 30), parent_pid=6001)
# Another pod: same depth, a PID that looks like ours, a different namespace.
NEIGHBOUR = FakeProcEntry(ns_pids=(7001, 1), parent_pid=4992, namespace=OTHER_NAMESPACE)
HOST_DAEMON = FakeProcEntry(ns_pids=(800,), parent_pid=1, namespace=ROOT_PID_NAMESPACE)


@pytest.fixture
def host_view(tmp_path: Path) -> Path:
    return write_proc(tmp_path / "proc", [VLLM, WORKER, NEIGHBOUR, HOST_DAEMON], own=SIDECAR)


def test_maps_processes_of_our_namespace(host_view: Path) -> None:
    view = PidMapper(host_view).view()

    assert view.unmapped_reason is None
    assert view.to_local(6001) == 1
    assert view.to_local(6002) == 30
    assert view.to_local(5000) == 7


def test_other_namespaces_and_the_host_are_not_visible(host_view: Path) -> None:
    view = PidMapper(host_view).view()

    assert view.to_local(7001) is None
    assert view.to_local(800) is None
    assert view.to_local(424242) is None  # gone, or never existed


def test_descendants_of_a_server_pid(host_view: Path) -> None:
    view = PidMapper(host_view).view()

    assert view.is_descendant_of(6002, {1})
    assert view.is_descendant_of(6001, {1})
    assert not view.is_descendant_of(6001, {30})
    # The neighbour's PID 1 lives in another namespace: not our server.
    assert not view.is_descendant_of(7001, {1})
    assert not view.is_descendant_of(6002, set())


def test_process_in_a_namespace_nested_below_ours(tmp_path: Path) -> None:
    inner_init = FakeProcEntry(ns_pids=(6050, 39, 1), parent_pid=6001, namespace="pid:[4026533000]")
    inner_child = FakeProcEntry(
        ns_pids=(6051, 40, 2), parent_pid=6050, namespace="pid:[4026533000]"
    )
    root = write_proc(tmp_path / "proc", [VLLM, inner_init, inner_child], own=SIDECAR)
    view = PidMapper(root).view()

    assert view.to_local(6051) == 40
    assert view.local_lineage(6051) == (40, 39, 1)


def test_nested_below_a_foreign_namespace_is_not_visible(tmp_path: Path) -> None:
    inner = FakeProcEntry(ns_pids=(7050, 12, 1), parent_pid=7001, namespace="pid:[4026533001]")
    root = write_proc(tmp_path / "proc", [NEIGHBOUR, inner], own=SIDECAR)

    assert PidMapper(root).view().to_local(7050) is None


def test_unreadable_namespace_link_is_not_ours(tmp_path: Path) -> None:
    stranger = FakeProcEntry(ns_pids=(7100, 3), parent_pid=4993, namespace=None)
    root = write_proc(tmp_path / "proc", [stranger], own=SIDECAR)

    assert PidMapper(root).view().to_local(7100) is None


def test_root_namespace_maps_to_itself(tmp_path: Path) -> None:
    own = FakeProcEntry(ns_pids=(300,), namespace=ROOT_PID_NAMESPACE)
    server = FakeProcEntry(ns_pids=(6001,), parent_pid=1, namespace=ROOT_PID_NAMESPACE)
    root = write_proc(tmp_path / "proc", [server], own=own)
    view = PidMapper(root).view()

    assert view.unmapped_reason is None
    assert view.to_local(6001) == 6001
    assert view.to_local(6002) is None


def test_container_proc_maps_nothing_and_says_why(tmp_path: Path, caplog) -> None:
    # Our own /proc in a pod: PID 7 exists here, but NVML's 7 is a host PID: never confuse them.
    own = FakeProcEntry(ns_pids=(7,), namespace=OUR_NAMESPACE)
    lookalike = FakeProcEntry(ns_pids=(1,), parent_pid=0)
    root = write_proc(tmp_path / "proc", [lookalike], own=own)
    mapper = PidMapper(root)

    with caplog.at_level(logging.WARNING, logger="kvpilot.collectors.pidmap"):
        views = [mapper.view() for _ in range(3)]

    assert "container PID namespace" in (views[0].unmapped_reason or "")
    assert all(view.to_local(1) is None and view.to_local(7) is None for view in views)
    assert len([r for r in caplog.records if "not mapped" in r.getMessage()]) == 1


def test_proc_root_of_a_nested_namespace_is_refused(tmp_path: Path) -> None:
    outer_init = FakeProcEntry(ns_pids=(1,), parent_pid=0, namespace="pid:[4026532100]")
    root = write_proc(tmp_path / "proc", [outer_init], own=SIDECAR)

    assert "nested PID namespace" in (PidMapper(root).view().unmapped_reason or "")


def test_missing_proc_root(tmp_path: Path) -> None:
    view = PidMapper(tmp_path / "absent").view()

    assert view.unmapped_reason is not None
    assert view.to_local(1) is None


def test_parse_status_variants() -> None:
    assert parse_status("Pid:\t42\nPPid:\t1\nNSpid:\t42\t3\n").ns_pids == (42, 3)
    old_kernel = parse_status("Pid:\t42\nPPid:\t9\n")
    assert old_kernel is not None
    assert (old_kernel.ns_pids, old_kernel.parent_pid) == ((42,), 9)
    assert parse_status("Name:\tx\n") is None


def test_real_proc_maps_our_own_process() -> None:
    view = PidMapper("/proc").view()
    if view.unmapped_reason is not None:
        pytest.skip(f"this machine's /proc cannot map: {view.unmapped_reason}")
    assert view.to_local(os.getpid()) == os.getpid()
