"""Real containers for the suite: Debian's podman with runc, configured as DESIGN.md says.

`podman kube play` runs the Pods and Deployments that kustomize renders as real containers
(shareProcessNamespace, readOnlyRootFilesystem, runAsUser, emptyDir and ConfigMap volumes
honoured). Pods here use host networking on free loopback ports: podman's default bridge is
a private address range, where no traffic may go from these machines.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[2]
CACHE = ROOT / ".cache" / "podman"
# default_ulimits: the machine's limits cannot be raised inside its sandbox; cgroupfs: no
# systemd runs here to manage cgroups.
CONTAINERS_CONF = """\
[containers]
default_ulimits = []

[engine]
cgroup_manager = "cgroupfs"
"""


class PodmanError(RuntimeError):
    """A podman command failed; the message holds its command line and its stderr."""


def podman_missing() -> str | None:
    """Why podman cannot run containers here, or None."""
    for tool in ("podman", "runc", "mmdebstrap"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed: ./scripts/setup installs it"
    return None


def environment() -> dict[str, str]:
    CACHE.mkdir(parents=True, exist_ok=True)
    conf = CACHE / "containers.conf"
    if not conf.exists() or conf.read_text() != CONTAINERS_CONF:
        conf.write_text(CONTAINERS_CONF)
    return {**os.environ, "CONTAINERS_CONF": str(conf)}


def podman(
    *args: str, timeout: float = 120, check: bool = True
) -> subprocess.CompletedProcess[str]:
    """`podman --runtime runc ARGS`, its output as text; PodmanError when `check` and it fails."""
    argv = ["podman", "--runtime", "runc", *args]
    result = subprocess.run(
        argv, capture_output=True, text=True, timeout=timeout, env=environment(), check=False
    )
    if check and result.returncode != 0:
        raise PodmanError(f"{' '.join(argv)}: exit {result.returncode}: {result.stderr[-4000:]}")
    return result


def image_exists(name: str) -> bool:
    return podman("image", "exists", name, check=False).returncode == 0


def inspect(kind: str, name: str) -> dict[str, Any]:
    """`podman KIND inspect NAME`, the first object."""
    return json.loads(podman(kind, "inspect", name).stdout)[0]


class PlayedPod:
    """`podman kube play FILE`: the pod of one Deployment, taken down on exit whatever
    happened (its containers' logs are kept beside FILE first, for a failing test)."""

    def __init__(self, yaml_file: Path, deployment: str, *, is_pod: bool = False) -> None:
        self.yaml_file = yaml_file
        # podman names a Deployment's pod DEPLOYMENT-pod-0 and its containers POD-CONTAINER.
        self.pod = deployment if is_pod else f"{deployment}-pod-0"

    def container(self, name: str) -> str:
        return f"{self.pod}-{name}"

    def __enter__(self) -> PlayedPod:
        try:
            podman("kube", "play", str(self.yaml_file), timeout=300)
        except BaseException:
            self.__exit__()
            raise
        return self

    def wait_exited(self, container: str, timeout: float = 120) -> int:
        """The exit code of a container of this pod, once it has exited."""
        return int(podman("wait", self.container(container), timeout=timeout).stdout.split()[0])

    def __exit__(self, *exc: object) -> None:
        self.save_logs()
        podman("kube", "down", str(self.yaml_file), timeout=180, check=False)
        podman("pod", "rm", "--force", "--time", "5", self.pod, timeout=120, check=False)

    def exec(
        self, container: str, *argv: str, timeout: float = 60
    ) -> subprocess.CompletedProcess[str]:
        return podman("exec", self.container(container), *argv, timeout=timeout, check=False)

    def logs(self, container: str) -> str:
        result = podman("logs", self.container(container), check=False, timeout=60)
        return result.stdout + result.stderr

    def restart_count(self, container: str) -> int:
        return int(inspect("container", self.container(container)).get("RestartCount", 0))

    def save_logs(self) -> None:
        listed = podman("pod", "inspect", self.pod, check=False)
        if listed.returncode != 0:
            return
        found = json.loads(listed.stdout)
        found = found[0] if isinstance(found, list) else found  # podman 4.3: one object
        for each in found.get("Containers", []):
            name = each["Name"]
            out = self.yaml_file.with_name(f"{name}.log")
            result = podman("logs", name, check=False, timeout=60)
            out.write_text(result.stdout + result.stderr)


class Volumes:
    """Named podman volumes (what a pod's claims refer to), removed on exit.

    A `shared` volume is a directory that outlives its containers (what an init container
    fills); the others are a tmpfs per mount owned by the pod's UID and GID, writable to its
    containers as Kubernetes makes an emptyDir (podman 4.3 ignores a tmpfs volume's mode and
    mounts emptyDirs root-owned)."""

    def __init__(self, names: list[str], *, shared: set[str], uid: int, gid: int) -> None:
        self.names = names
        self.shared = shared
        self.owner = f"uid={uid},gid={gid}"

    def __enter__(self) -> Volumes:
        for name in self.names:
            tmpfs = ["--opt", "type=tmpfs", "--opt", "device=tmpfs", "--opt", f"o={self.owner}"]
            podman("volume", "create", *([] if name in self.shared else tmpfs), name)
        return self

    def __exit__(self, *exc: object) -> None:
        for name in self.names:
            podman("volume", "rm", "--force", name, check=False)


@contextlib.contextmanager
def played(here: Any, tmp: Path, name: str, *, uid: int) -> Iterator[PlayedPod]:
    """A `manifests.PodHere` played: its volumes made, its init containers run to their end
    (each must exit 0), then its Deployment; all taken down on exit."""
    with Volumes(here.volumes, shared=here.filled, uid=uid, gid=uid):
        init_name = here.init_pod["metadata"]["name"]
        init_file = tmp / "init.yaml"
        init_file.write_text(yaml.safe_dump(here.init_pod, sort_keys=False))
        with PlayedPod(init_file, init_name, is_pod=True) as init:
            for each in here.init_pod["spec"]["containers"]:
                code = init.wait_exited(each["name"])
                assert code == 0, (
                    f"init container {each['name']} exited {code}: {init.logs(each['name'])}"
                )
        pod_file = tmp / "pod.yaml"
        pod_file.write_text(yaml.safe_dump_all(here.docs, sort_keys=False))
        try:
            with PlayedPod(pod_file, name) as pod:
                yield pod
        finally:  # podman keeps a ConfigMap's volume after the pod, by the ConfigMap's name
            for config_map in here.config_maps:
                podman("volume", "rm", "--force", config_map, check=False)
