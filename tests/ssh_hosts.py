"""Real OpenSSH servers (Debian's `openssh-server`) on this one machine, one per "host", for the tests.

Each host is a network namespace of its own (a veth into a private bridge, whose address is
the head's), with its own hostname (UTS namespace) and /etc/hosts (mount namespace), in
which every host's name resolves to that host's address, as torch's c10d rendezvous needs;
its sshd listens there with a host key made by the test. A user key, `authorized_keys`,
`known_hosts` and an ssh config file (`Host` entries, `IdentityFile`, `UserKnownHostsFile`)
are written into the test's directory: the launcher is given that file as a user's own
(`ssh_options=[-F,<file>]`), and the user's own ~/.ssh is never read or written. A host may
hide directories from its processes (`hidden`: a tmpfs mounted over each in its mount
namespace), as a host without the head's filesystem would. `stop()` ends every process in
the hosts' namespaces by PID and removes the namespaces and the bridge.

    with SshHosts(tmp_path, ["host1", "host2"]) as hosts:
        subprocess.run([..., f"hydra.launcher.ssh_options=[-F,{hosts.config}]"])

`unavailable()` says why hosts cannot run here (not root, no sshd, no namespaces).
"""

import fcntl
import hashlib
import itertools
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence

from tests import slurm_cluster

SSHD = "/usr/sbin/sshd"
START_TIMEOUT_S = 30.0
# taken while a hosts set picks its subnet and makes its bridge (every test run on the machine)
SUBNET_LOCK = "/run/lock/hydra_torchrun_ssh_hosts.lock"
# the hosts sets this process has made
_SETS = itertools.count()


def unavailable() -> Optional[str]:
    """Why ssh hosts cannot run here, or None."""
    if os.geteuid() != 0:
        return "ssh hosts need root (network namespaces, sshd)"
    if not Path(SSHD).exists() or shutil.which("ssh") is None or shutil.which("ssh-keygen") is None:
        return "OpenSSH is not installed: apt-get install openssh-server openssh-client"
    missing = [tool for tool in ("ip", "nsenter", "unshare") if shutil.which(tool) is None]
    if missing:
        return f"{', '.join(missing)} missing: apt-get install iproute2 util-linux"
    return None


def _run(command: Sequence[str]) -> str:
    return subprocess.run(list(command), check=True, capture_output=True, text=True).stdout


class SshHosts:
    """sshd on each of `names`; `hidden`: per host, directories a tmpfs hides there."""

    def __init__(
        self, root: Path, names: Sequence[str], hidden: Optional[Dict[str, List[str]]] = None
    ) -> None:
        self.names = list(names)
        self.root = root / "ssh"
        self.hidden = hidden or {}
        if len(self.names) > 10:
            raise ValueError("at most 10 hosts (one digit in their interface names)")
        # names of this process's own (its pid, and a count of its hosts sets): no other test
        # run on the machine, nor another set of this one, makes the same
        tag = f"{os.getpid():06x}{next(_SETS) % 256:02x}"
        self.bridge = f"hsb{tag}"
        self.namespaces = {name: f"htlssh-{tag}-{i}" for i, name in enumerate(self.names)}
        self.veths = {name: (f"hs{tag}{i}h", f"hs{tag}{i}n") for i, name in enumerate(self.names)}
        # a private /24 that no interface of the machine has (`_free_subnet`), chosen when the
        # bridge is made; apart from the SLURM cluster's (10.200-249) and the pods' (10.150-199)
        self.subnet = ""
        self.addresses: Dict[str, str] = {}
        self.head_address = ""
        self.config = self.root / "ssh_config"
        self.sshd: Dict[str, subprocess.Popen] = {}

    def __enter__(self) -> "SshHosts":
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- set-up -------------------------------------------------------------------------

    def start(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        os.chmod(self.root, 0o700)
        _run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(self.root / "id_user")])
        (self.root / "authorized_keys").write_text((self.root / "id_user.pub").read_text())
        self._network()
        known = []
        for name in self.names:
            key = self.root / f"host_key.{name}"
            _run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(key)])
            public = " ".join(Path(f"{key}.pub").read_text().split()[:2])
            known.append(f"{name},{self.addresses[name]} {public}")
            (self.root / f"sshd_config.{name}").write_text(
                "\n".join(
                    [
                        f"ListenAddress {self.addresses[name]}",
                        f"HostKey {key}",
                        f"AuthorizedKeysFile {self.root / 'authorized_keys'}",
                        f"PidFile {self.root / f'sshd.{name}.pid'}",
                        "PermitRootLogin prohibit-password",
                        "PasswordAuthentication no",
                        "KbdInteractiveAuthentication no",
                        "UsePAM no",
                        "StrictModes no",
                        "PrintMotd no",
                        "",
                    ]
                )
            )
            self._start_sshd(name)
        (self.root / "known_hosts").write_text("\n".join(known) + "\n")
        entries = [f"Host {name}\n    HostName {self.addresses[name]}\n" for name in self.names]
        # a host no sshd answers on: its port refuses the connection at once
        entries.append(f"Host unreachable\n    HostName {self.head_address}\n    Port 9\n")
        entries.append(
            "Host *\n"
            "    User root\n"
            f"    IdentityFile {self.root / 'id_user'}\n"
            "    IdentitiesOnly yes\n"
            f"    UserKnownHostsFile {self.root / 'known_hosts'}\n"
            "    StrictHostKeyChecking yes\n"
            "    ConnectTimeout 10\n"
        )
        self.config.write_text("\n".join(entries))
        self._wait_listening()

    def _network(self) -> None:
        # chosen and taken under a lock that every test run on the machine takes
        with open(SUBNET_LOCK, "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            self.subnet = _free_subnet(self.bridge)
            self.addresses = {name: f"{self.subnet}.{i + 1}" for i, name in enumerate(self.names)}
            self.head_address = f"{self.subnet}.254"
            _run(["ip", "link", "add", self.bridge, "type", "bridge"])
            _run(["ip", "addr", "add", f"{self.head_address}/24", "dev", self.bridge])
        _run(["ip", "link", "set", self.bridge, "up"])
        lines = ["127.0.0.1 localhost", *(f"{self.addresses[n]} {n}" for n in self.names)]
        (self.root / "hosts").write_text("\n".join(lines) + "\n")
        for name in self.names:
            ns = self.namespaces[name]
            host_end, ns_end = self.veths[name]
            _run(["ip", "netns", "add", ns])
            _run(["ip", "link", "add", host_end, "type", "veth", "peer", "name", ns_end])
            _run(["ip", "link", "set", host_end, "master", self.bridge, "up"])
            _run(["ip", "link", "set", ns_end, "netns", ns])
            _run(["ip", "-n", ns, "addr", "add", f"{self.addresses[name]}/24", "dev", ns_end])
            _run(["ip", "-n", ns, "link", "set", ns_end, "up"])
            _run(["ip", "-n", ns, "link", "set", "lo", "up"])

    def _start_sshd(self, name: str) -> None:
        hide = "".join(f'mount -t tmpfs tmpfs "{path}" && ' for path in self.hidden.get(name, []))
        inner = (
            f'hostname "$0" && mount --bind "$1" /etc/hosts && {hide}'
            # sshd's privilege separation dir, in a /run of the host's own
            "mount -t tmpfs -o mode=755 tmpfs /run && mkdir /run/sshd && "
            f'exec {SSHD} -D -e -f "$2"'
        )
        command = [
            "nsenter",
            f"--net=/run/netns/{self.namespaces[name]}",
            "unshare",
            "--uts",
            "--mount",
            "--propagation",
            "private",
            "sh",
            "-c",
            inner,
            name,
            str(self.root / "hosts"),
            str(self.root / f"sshd_config.{name}"),
        ]
        with (self.root / f"sshd.{name}.log").open("w") as log:
            self.sshd[name] = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
        # a daemon that outlives a test (the suite's leftover check skips it; its sessions are checked)
        slurm_cluster.RUNNING_DAEMONS.add(self.sshd[name].pid)

    def _wait_listening(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        for name in self.names:
            while True:
                probe = subprocess.run(
                    ["ssh", "-F", str(self.config), "-o", "BatchMode=yes", name, "true"],
                    capture_output=True,
                    text=True,
                )
                if probe.returncode == 0:
                    break
                if self.sshd[name].poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(
                        f"sshd on {name} did not answer: {probe.stderr.strip()}; its log: "
                        f"{(self.root / f'sshd.{name}.log').read_text()[-2000:]}"
                    )
                time.sleep(0.1)

    # -- use ----------------------------------------------------------------------------

    def ssh_options(self) -> str:
        """The launcher's `ssh_options` override value that names this config file."""
        return f"[-F,{self.config}]"

    def processes(self, name: str) -> List[int]:
        """The live processes in `name`'s namespace other than its listening sshd (and the
        shell that exec'd it): what sessions and jobs left there."""
        listed = subprocess.run(
            ["ip", "netns", "pids", self.namespaces[name]], capture_output=True, text=True
        )
        daemon = self.sshd[name].pid
        return [pid for pid in (int(p) for p in listed.stdout.split()) if pid != daemon and _alive(pid)]

    def command_lines(self, name: str) -> List[str]:
        lines = []
        for pid in self.processes(name):
            try:
                lines.append(Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode().strip())
            except OSError:
                continue
        return lines

    def wait_no_processes(self, timeout_s: float = 30.0) -> Dict[str, List[str]]:
        """Wait until no host runs anything but its sshd; what is left after `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        while True:
            left = {name: self.command_lines(name) for name in self.names}
            left = {name: lines for name, lines in left.items() if lines}
            if not left or time.monotonic() > deadline:
                return left
            time.sleep(0.1)

    def crash(self, name: str) -> List[int]:
        """Kill (SIGKILL) every process of `name` but its listening sshd, as a host that dies
        takes its sessions and jobs with it: its kernel closes their connections. The pids
        killed (all started through this host's sshd)."""
        pids = self.processes(name)
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                continue
        return pids

    def cut(self, name: str, up: bool = False) -> None:
        """Take `name`'s link to the others down (`up`: back up), as a network cut: nothing
        reaches either side, and no connection is closed."""
        _run(["ip", "link", "set", self.veths[name][0], "up" if up else "down"])

    # -- tear-down ----------------------------------------------------------------------

    def stop(self) -> None:
        """End every process in the hosts' namespaces (sshd first), then the namespaces and bridge."""
        for process in self.sshd.values():
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        for process in self.sshd.values():
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
            slurm_cluster.RUNNING_DAEMONS.discard(process.pid)
        pids = []
        for ns in self.namespaces.values():
            listed = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True)
            pids += [int(pid) for pid in listed.stdout.split()]
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                continue
        deadline = time.monotonic() + START_TIMEOUT_S
        while any(_alive(pid) for pid in pids) and time.monotonic() < deadline:
            time.sleep(0.05)
        for ns in self.namespaces.values():
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        subprocess.run(["ip", "link", "del", self.bridge], capture_output=True)


def _free_subnet(seed: str) -> str:
    """A 10.100-149.x /24 that no interface of the machine has an address in (the first free
    one from a place `seed` picks); under SUBNET_LOCK, which the caller holds."""
    listed = _run(["ip", "-o", "-4", "addr", "show"])
    used = {word.rsplit(".", 1)[0] for word in listed.split() if word.startswith("10.") and "/" in word}
    start = int(hashlib.sha1(seed.encode()).hexdigest()[:8], 16)
    for step in range(50 * 256):
        spot = (start + step) % (50 * 256)
        subnet = f"10.{100 + spot // 256}.{spot % 256}"
        if subnet not in used:
            return subnet
    raise RuntimeError("no free 10.100-149.x subnet for the ssh hosts")


def _alive(pid: int) -> bool:
    """Alive and not a zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"
