"""Two Kubernetes "pods" on this one machine, for the tests: two network namespaces.

Each pod is a network namespace of its own, the two joined by one veth pair in a private
/24 (10.150-199.x, apart from tests/slurm_cluster.py's 10.200-249.x); a process started in
a pod also gets its own hostname (UTS namespace) and its own /etc/hosts (mount namespace),
in which every pod's names resolve to that pod's address, as a headless Service's DNS does
in Kubernetes. `stop()` removes the namespaces (their veth ends go with them).

    with Pods(["job-master-0", "job-worker-0"]) as pods:
        subprocess.Popen(pods.command("job-worker-0", ["python", "app.py"]), ...)

`unavailable()` says why pods cannot be made here (not root, no ip/nsenter/unshare).
"""

import os
import shutil
import subprocess
import tempfile
import uuid
from pathlib import Path
from typing import Dict, List, Optional, Sequence

# in a pod: its hostname, its /etc/hosts, then the command
_ENTER = 'hostname "$0" && mount --bind "$1" /etc/hosts && shift && exec "$@"'


def unavailable() -> Optional[str]:
    """Why pods cannot be made here, or None."""
    if os.geteuid() != 0:
        return "pods (network namespaces) need root"
    missing = [tool for tool in ("ip", "nsenter", "unshare") if shutil.which(tool) is None]
    if missing:
        return f"{', '.join(missing)} missing: apt-get install iproute2 util-linux"
    return None


class Pods:
    """Pods named `hostnames` (pod i: hostnames[i]), with extra DNS names per pod (`aliases`)."""

    def __init__(self, hostnames: Sequence[str], aliases: Optional[Dict[str, List[str]]] = None) -> None:
        tag = uuid.uuid4().hex[:6]
        self.hostnames = list(hostnames)
        self.aliases = aliases or {}
        self.namespaces = {name: f"htlpod-{tag}-{i}" for i, name in enumerate(self.hostnames)}
        subnet = f"10.{150 + int(tag[:2], 16) % 50}.{int(tag[2:4], 16)}"
        self.addresses = {name: f"{subnet}.{i + 1}" for i, name in enumerate(self.hostnames)}
        self.links = (f"hp{tag}a", f"hp{tag}b")
        self.dir = Path(tempfile.mkdtemp(prefix="htl-pods-"))

    def __enter__(self) -> "Pods":
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> None:
        assert len(self.hostnames) == 2, "one veth pair joins two pods"
        for name in self.hostnames:
            _run(["ip", "netns", "add", self.namespaces[name]])
        _run(["ip", "link", "add", self.links[0], "type", "veth", "peer", "name", self.links[1]])
        lines = ["127.0.0.1 localhost"]
        lines += [f"{self.addresses[n]} {' '.join([n, *self.aliases.get(n, [])])}" for n in self.hostnames]
        (self.dir / "hosts").write_text("\n".join(lines) + "\n")
        for name, link in zip(self.hostnames, self.links):
            ns = self.namespaces[name]
            _run(["ip", "link", "set", link, "netns", ns])
            _run(["ip", "-n", ns, "addr", "add", f"{self.addresses[name]}/24", "dev", link])
            _run(["ip", "-n", ns, "link", "set", link, "up"])
            _run(["ip", "-n", ns, "link", "set", "lo", "up"])

    def command(self, pod: str, argv: Sequence[str]) -> List[str]:
        """`argv` as a process of pod `pod`: its network, hostname and /etc/hosts."""
        return [
            "nsenter",
            f"--net=/run/netns/{self.namespaces[pod]}",
            "unshare",
            "--uts",
            "--mount",
            "--propagation",
            "private",
            "sh",
            "-c",
            _ENTER,
            pod,
            str(self.dir / "hosts"),
            *argv,
        ]

    def stop(self) -> None:
        """Remove the namespaces (with their veth ends) and the hosts file."""
        for ns in self.namespaces.values():
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        subprocess.run(["ip", "link", "del", self.links[0]], capture_output=True)
        shutil.rmtree(self.dir, ignore_errors=True)


def _run(command: Sequence[str]) -> None:
    subprocess.run(list(command), check=True, capture_output=True, text=True)
