"""A small cluster made of network namespaces, for tests/test_runbook.py; and the stand-ins
for the cluster's own programs (sudo, systemctl, journalctl, scp, ssh, sbatch, srun).

Each machine of the runbook (``head``, ``gpu1``, ``gpu2``, ``laptop``) is a network
namespace with a mount namespace and a UTS namespace of its own, held by a process that
sleeps for as long as the machine lives, so a block entered later sees what an earlier
block left there:

- its host name (``hostname`` says ``gpu1``);
- its own ``/etc``, ``/opt`` and ``/var/lib``: overlays on this machine's, so ``useradd``
  makes a service user on that machine only, ``/etc/somatize`` is that machine's, and
  nothing is written to this machine's own folders;
- its own ``/tmp``; and one ``/shared``, the same folder on every machine (a cluster
  filesystem);
- an ``/etc/hosts`` that names the others as that machine reaches them.

The network: the laptop reaches ``head`` and ``gpu1``; ``gpu2`` (a compute node) reaches only
``head``; ``head`` forwards nothing. So work for ``gpu1`` goes Direct and work for ``gpu2``
can only go Relayed.

What cannot be the same here is replaced by stand-ins: this module run as a program, under
the name of the tool (``runbook_support.py sudo -u somatize ...``). ``sudo`` runs the command
(as another user with ``setpriv``); ``systemctl`` runs a unit's ``ExecStart=`` (drop-ins
included) as its ``User=``, with its ``StateDirectory=``, ``Environment=``,
``WorkingDirectory=`` and ``UMask=``, and waits for it to say it is listening or dialing;
``scp`` and ``ssh`` copy and run on another machine by entering its namespaces; ``sbatch``
runs a batch script on the compute node ``gpu2`` (the submitting environment exported, as
SLURM does by default) and ``srun`` runs its command there. Installing the software
(``pip install``) needs a package index the namespaces cannot reach: the blocks marked
``install`` become a virtual environment's ``bin/python`` that is this test's Python.
"""

from __future__ import annotations

import json
import os
import pwd
import re
import select
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

TOOLS = ("sudo", "systemctl", "journalctl", "scp", "ssh", "sbatch", "srun")
MACHINES = ("head", "gpu1", "gpu2", "laptop")
COMPUTE_NODES = ("gpu2",)
# (machine, device, address) on each end of a veth pair
LINKS = (
    (("laptop", "tohead", "10.210.1.1/24"), ("head", "tolaptop", "10.210.1.2/24")),
    (("laptop", "togpu1", "10.210.2.1/24"), ("gpu1", "tolaptop", "10.210.2.2/24")),
    (("head", "togpu2", "10.210.3.1/24"), ("gpu2", "tohead", "10.210.3.2/24")),
)
# how each machine reaches the others by name
NAMES = {
    "laptop": {"head": "10.210.1.2", "gpu1": "10.210.2.2"},
    "head": {"gpu2": "10.210.3.2"},
    "gpu1": {},
    "gpu2": {"head": "10.210.3.1"},
}
OVERLAID = ("/etc", "/opt", "/var/lib")
PYTHON_AT = "/opt/.runbook-python"  # this test's Python, as every machine sees it
BASE_AT = "/opt/.runbook-base"  # the interpreter under it (itself, or a virtual environment's base)
STARTED = re.compile(r"listening|dialed|serving")


def _run(argv: list[str], **options) -> subprocess.CompletedProcess:
    options.setdefault("capture_output", True)
    options.setdefault("text", True)
    options.setdefault("timeout", 60)
    return subprocess.run(argv, check=False, **options)


def _must(argv: list[str], **options) -> subprocess.CompletedProcess:
    done = _run(argv, **options)
    if done.returncode != 0:
        raise RuntimeError(f"{shlex.join(argv)}: rc {done.returncode}: {(done.stderr or '').strip()}")
    return done


# -- the cluster, built and torn down by the test ----------------------------------------------


class Cluster:
    """Four machines as the module says; ``run`` runs a block of the runbook on one of them."""

    def __init__(self, root: Path, repo: Path) -> None:
        self.root = root  # outside /tmp: every machine has a /tmp of its own
        self.repo = repo
        self.tag = f"smzrb{os.getpid()}"
        self.netns: list[str] = []
        self.holders: list[subprocess.Popen] = []
        self.made_shared = False
        self.bin = root / "bin"
        self.config = root / "cluster.json"

    def home(self, machine: str) -> Path:
        # the cluster's machines share one home (as they share a filesystem); the laptop has its own
        return self.root / ("laptop-home" if machine == "laptop" else "cluster-home")

    def workdir(self, machine: str) -> Path:
        """Where blocks run: a folder with the repository's recipes, as in a clone."""
        return self.root / "work" / machine

    def build(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        self.root.chmod(0o755)  # the service users read the stand-ins and recipes under it
        if not os.path.exists("/shared"):
            os.mkdir("/shared")  # a mount point only: each machine mounts the same folder there
            self.made_shared = True
        shared = self.root / "shared"
        shared.mkdir(mode=0o755)
        self._tools()
        config = {"root": str(self.root), "repo": str(self.repo), "tag": self.tag, "machines": {}}
        for machine in MACHINES:
            config["machines"][machine] = self._machine(machine, shared)
        self.config.write_text(json.dumps(config))
        for (a, dev_a, addr_a), (b, dev_b, addr_b) in LINKS:
            na, nb = self.netns_of(a), self.netns_of(b)
            _must(["ip", "-n", na, "link", "add", dev_a, "type", "veth", "peer", "name", dev_b, "netns", nb])
            for name, dev, addr in ((na, dev_a, addr_a), (nb, dev_b, addr_b)):
                _must(["ip", "-n", name, "addr", "add", addr, "dev", dev])
                _must(["ip", "-n", name, "link", "set", dev, "up"])
        _must(["ip", "-n", self.netns_of("gpu2"), "route", "add", "10.210.1.0/24", "via", "10.210.3.1"])
        _must(["ip", "netns", "exec", self.netns_of("head"), "sysctl", "-qw", "net.ipv4.ip_forward=0"])

    def netns_of(self, machine: str) -> str:
        return f"{self.tag}{machine}"

    def _machine(self, machine: str, shared: Path) -> dict:
        netns = self.netns_of(machine)
        _must(["ip", "netns", "add", netns])
        self.netns.append(netns)
        _must(["ip", "-n", netns, "link", "set", "lo", "up"])
        base = self.root / "machines" / machine
        mounts = []
        for i, folder in enumerate(OVERLAID):
            upper, work = base / f"upper{i}", base / f"work{i}"
            upper.mkdir(parents=True)
            work.mkdir()
            mounts.append(f"mount -t overlay overlay -o lowerdir={folder},upperdir={upper},workdir={work} {folder}")
        tmp = base / "tmp"
        tmp.mkdir()
        tmp.chmod(0o1777)
        hosts = base / "hosts"
        hosts.write_text(
            f"127.0.0.1 localhost\n127.0.1.1 {machine}\n"
            + "".join(f"{address} {name}\n" for name, address in NAMES[machine].items())
        )
        # what lives under /tmp and every machine needs (a clone of the repository there, the
        # environment's Python, as on a CI machine) is kept aside, then put back at its own
        # path inside the machine's /tmp: an editable install names the checkout by that path
        kept = [p for p in dict.fromkeys((str(self.repo), sys.prefix)) if p == "/tmp" or p.startswith("/tmp/")]
        aside = [f"/opt/.runbook-aside/{i}" for i in range(len(kept))]
        setup = " && ".join(
            [
                *mounts,
                f"mkdir -p {PYTHON_AT}",
                f"mount --bind {shlex.quote(sys.prefix)} {PYTHON_AT}",
                # where any user can reach it (a base under /root is not: the service user runs it)
                f"mkdir -p {BASE_AT}",
                f"mount --bind {shlex.quote(sys.base_prefix)} {BASE_AT}",
                *(f"mkdir -p {a} && mount --bind {shlex.quote(p)} {a}" for p, a in zip(kept, aside, strict=True)),
                f"mount --bind {tmp} /tmp",
                *(
                    f"mkdir -p {shlex.quote(p)} && mount --bind {a} {shlex.quote(p)}"
                    for p, a in zip(kept, aside, strict=True)
                ),
                f"mount --bind {shared} /shared",
                f"cp {hosts} /etc/hosts",
                f"hostname {machine}",
                "echo ready",
            ]
        )
        # A process that holds the machine's mount and UTS namespaces for as long as the
        # machine lives: everything run there enters them through /proc/PID/ns, which any
        # machine can (a bind-mounted namespace file of a mount namespace is not copied into
        # another mount namespace, so files would not do).
        holder = subprocess.Popen(
            [
                "nsenter",
                f"--net=/run/netns/{netns}",
                "--",
                "unshare",
                "--mount",
                "--uts",
                "--propagation",
                "private",
                "sh",
                "-c",
                f"{setup} && exec sleep infinity",
            ],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        self.holders.append(holder)
        line = _first_line(holder, 30.0)
        if line.strip() != "ready":
            holder.kill()
            raise RuntimeError(f"could not make the machine {machine}: {line}{holder.stderr.read()}")
        self.home(machine).mkdir(exist_ok=True)
        work = self.workdir(machine)
        work.mkdir(parents=True)
        for recipes in ("brokers", "workers"):
            (work / recipes).symlink_to(self.repo / recipes)
        return {"netns": netns, "holder": holder.pid, "home": str(self.home(machine)), "work": str(work)}

    def _tools(self) -> None:
        self.bin.mkdir()
        support = Path(__file__).resolve()
        for tool in TOOLS:
            script = self.bin / tool
            script.write_text(f'#!/bin/sh\nexec {PYTHON_AT}/bin/python3 -S {support} {tool} "$@"\n')
            script.chmod(0o755)

    def env(self, machine: str) -> dict[str, str]:
        return environment(json.loads(self.config.read_text()), machine)

    def run(self, machine: str, argv: list[str], *, timeout: float = 120, stdin: str | None = None):
        """Run ``argv`` on ``machine``: in its namespaces, its folder, its environment."""
        return _run(
            enter(json.loads(self.config.read_text()), machine, argv),
            env=self.env(machine),
            timeout=timeout,
            input=stdin,
        )

    def started(self) -> list[int]:
        """Every process the stand-ins started (units, batch jobs), by the files they keep."""
        pids = []
        for pidfile in (self.root / "state").rglob("*.pid") if (self.root / "state").exists() else []:
            try:
                pids.append(int(pidfile.read_text()))
            except ValueError:
                continue
        return pids

    def log(self, machine: str, name: str) -> str:
        path = self.root / "state" / machine / f"{name}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def remove(self) -> None:
        for pid in self.started():
            _end_group(pid)
        for holder in self.holders:
            holder.kill()
            holder.wait(timeout=30)
            for stream in (holder.stdout, holder.stderr):
                stream.close()
        for name in self.netns:
            _run(["ip", "netns", "del", name], timeout=30)
        if self.made_shared:
            try:
                os.rmdir("/shared")
            except OSError:
                pass
        shutil.rmtree(self.root, ignore_errors=True)


def _first_line(process: subprocess.Popen, seconds: float) -> str:
    """The first line ``process`` writes, or what it wrote within ``seconds``."""
    ready, _, _ = select.select([process.stdout], [], [], seconds)
    return process.stdout.readline() if ready else ""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    state = Path(f"/proc/{pid}/stat")
    try:
        return state.read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def _end_group(pid: int, grace: float = 10.0) -> None:
    """SIGTERM a process group the stand-ins started (as systemd and scancel do), then SIGKILL."""
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(pid, sig)
        except (ProcessLookupError, PermissionError):
            return
        until = time.monotonic() + wait
        while _alive(pid) and time.monotonic() < until:
            time.sleep(0.05)
        if not _alive(pid):
            return


# -- shared by the test and the stand-ins -------------------------------------------------------


def environment(config: dict, machine: str) -> dict[str, str]:
    """A login's environment on ``machine``: the stand-ins first on PATH, then this Python."""
    root = Path(config["root"])
    path = [
        str(root / "bin"),
        f"{PYTHON_AT}/bin",
        "/usr/local/sbin",
        "/usr/local/bin",
        "/usr/sbin",
        "/usr/bin",
        "/sbin",
        "/bin",
    ]
    return {
        "PATH": os.pathsep.join(path),
        "HOME": config["machines"][machine]["home"],
        "USER": "root",
        "LOGNAME": "root",
        "LANG": "C.UTF-8",
        "RUNBOOK_CONFIG": str(root / "cluster.json"),
        "RUNBOOK_MACHINE": machine,
        "PYTHONDONTWRITEBYTECODE": "1",
        # your own Python has somatize (the page's premise): this checkout's, here
        "PYTHONPATH": config["repo"],
    }


def enter(config: dict, machine: str, argv: list[str], wd: str | None = None) -> list[str]:
    m = config["machines"][machine]
    return ["nsenter", f"--target={m['holder']}", "--net", "--mount", "--uts", f"--wd={wd or m['work']}", "--", *argv]


def _config() -> dict:
    return json.loads(Path(os.environ["RUNBOOK_CONFIG"]).read_text())


def _state(machine: str) -> Path:
    folder = Path(_config()["root"]) / "state" / machine
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def _say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


# -- the stand-ins --------------------------------------------------------------------------------


def sudo(args: list[str]) -> int:
    user = None
    while args and args[0].startswith("-"):
        option = args.pop(0)
        if option == "--":
            break
        if option == "-u":
            user = args.pop(0)
        elif option.startswith("-u"):
            user = option[2:]
        else:
            _say(f"sudo (stand-in): the option {option} is not one the runbook should need")
            return 1
    if not args:
        _say("sudo (stand-in): no command given")
        return 1
    if user in (None, "root"):
        os.execvp(args[0], args)
    entry = pwd.getpwnam(user)
    env = dict(os.environ, HOME=entry.pw_dir, USER=user, LOGNAME=user)
    os.execvpe(
        "setpriv", ["setpriv", f"--reuid={entry.pw_uid}", f"--regid={entry.pw_gid}", "--init-groups", *args], env
    )
    return 1


def _unit_text(unit: str) -> list[tuple[str, str]]:
    """The unit's [Service] settings, its drop-ins after it (``X=`` empty resets ``X``)."""
    name = unit if "." in unit else f"{unit}.service"
    main = Path("/etc/systemd/system") / name
    if not main.exists():
        raise FileNotFoundError(f"Unit {name} not found.")
    files = [main, *sorted(Path(f"/etc/systemd/system/{name}.d").glob("*.conf"))]
    settings: list[tuple[str, str]] = []
    for path in files:
        section = ""
        text = re.sub(r"\\\n\s*", " ", path.read_text())
        for line in text.splitlines():
            line = line.strip()
            if not line or line.startswith(("#", ";")):
                continue
            if line.startswith("["):
                section = line
                continue
            if section == "[Service]" and "=" in line:
                key, value = line.split("=", 1)
                settings.append((key.strip(), value.strip()))
    return settings


def _setting(settings, key: str, default: str | None = None) -> str | None:
    value = default
    for k, v in settings:
        if k == key:
            value = v if v else default
    return value


def _start(unit: str, machine: str) -> int:
    state = _state(machine)
    pidfile, log = state / f"{unit}.pid", state / f"{unit}.log"
    if pidfile.exists() and _alive(int(pidfile.read_text())):
        return 0
    settings = _unit_text(unit)
    host = os.uname().nodename
    exec_start = _setting(settings, "ExecStart")
    if not exec_start:
        _say(f"{unit}.service has no ExecStart=")
        return 1
    argv = [a.replace("%H", host).replace("%%", "%") for a in shlex.split(exec_start.lstrip("-@+!"))]
    user = _setting(settings, "User", "root")
    entry = pwd.getpwnam(user)
    group = _setting(settings, "Group")
    gid = entry.pw_gid if group is None else __import__("grp").getgrnam(group).gr_gid
    state_dir = _setting(settings, "StateDirectory")
    if state_dir:
        folder = Path("/var/lib") / state_dir
        folder.mkdir(parents=True, exist_ok=True)
        os.chown(folder, entry.pw_uid, gid)
        folder.chmod(0o755)
    env = {
        "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
        "LANG": "C.UTF-8",
        "HOME": entry.pw_dir,
        "USER": user,
        "LOGNAME": user,
    }
    for k, v in settings:
        if k == "Environment":
            for pair in shlex.split(v):
                name, _, value = pair.partition("=")
                env[name] = value
    umask = int(_setting(settings, "UMask", "0022"), 8)
    cwd = _setting(settings, "WorkingDirectory", "/")
    with open(log, "ab") as out:
        process = subprocess.Popen(
            ["setpriv", f"--reuid={entry.pw_uid}", f"--regid={gid}", "--init-groups", *argv],
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=out,
            env=env,
            cwd=cwd,
            start_new_session=True,
            umask=umask,
        )
    pidfile.write_text(str(process.pid))
    # Type=simple starts it and returns; this waits for the line that says it serves, so a
    # unit that refuses to start fails the block that started it, with its reason
    until = time.monotonic() + 30
    while time.monotonic() < until:
        if process.poll() is not None:
            _say(
                f"Job for {unit}.service failed: its command exited with code {process.returncode}. It said:\n"
                + log.read_text(errors="replace")[-3000:]
            )
            return 1
        if STARTED.search(log.read_text(errors="replace")):
            return 0
        time.sleep(0.05)
    _say(f"{unit}.service said nothing about serving within 30 s:\n" + log.read_text(errors="replace")[-3000:])
    return 1


def systemctl(args: list[str]) -> int:
    machine = os.environ["RUNBOOK_MACHINE"]
    words = [a for a in args if not a.startswith("-")]
    now = "--now" in args
    if not words:
        return 1
    verb, units = words[0], [u.removesuffix(".service") for u in words[1:]]
    if verb == "daemon-reload":
        return 0
    rc = 0
    for unit in units:
        pidfile = _state(machine) / f"{unit}.pid"
        pid = int(pidfile.read_text()) if pidfile.exists() else None
        if verb in ("start",) or (verb == "enable" and now):
            rc |= _start(unit, machine)
        elif verb == "enable":
            _unit_text(unit)
        elif verb == "reload":
            if pid is None or not _alive(pid):
                _say(f"{unit}.service is not active, cannot reload.")
                rc = 1
            else:
                os.kill(pid, signal.SIGHUP)
        elif verb in ("stop", "restart"):
            if pid is not None:
                _end_group(pid, 15.0)
                pidfile.unlink()
            if verb == "restart":
                rc |= _start(unit, machine)
        elif verb in ("status", "is-active"):
            active = pid is not None and _alive(pid)
            print(f"{unit}.service: {'active (running)' if active else 'inactive (dead)'}")
            if verb == "status":
                print(_tail(_state(machine) / f"{unit}.log", 10))
            rc |= 0 if active else 3
        else:
            _say(f"systemctl (stand-in): `{verb}` is not one the runbook should need")
            return 1
    return rc


def _tail(path: Path, n: int) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-n:]) if path.exists() else ""


def journalctl(args: list[str]) -> int:
    unit, n = None, 10
    it = iter(args)
    for a in it:
        if a == "-u":
            unit = next(it)
        elif a == "-n":
            n = int(next(it))
    if unit is None:
        return 1
    print(_tail(_state(os.environ["RUNBOOK_MACHINE"]) / f"{unit.removesuffix('.service')}.log", n))
    return 0


def _on(machine: str, argv: list[str], **options) -> subprocess.CompletedProcess:
    config = _config()
    if machine not in config["machines"]:
        raise SystemExit(f"ssh: Could not resolve hostname {machine}: Name or service not known")
    return subprocess.run(enter(config, machine, argv), env=environment(config, machine), check=False, **options)


def scp(args: list[str]) -> int:
    paths = [a for a in args if not a.startswith("-")]
    if len(paths) != 2:
        _say("scp (stand-in): give one source and one destination")
        return 1
    source, target = paths

    def split(spec: str):
        head, sep, rest = spec.partition(":")
        return (head, rest) if sep and "/" not in head else (None, spec)

    where, path = split(source)
    if where is None:
        data = Path(path).read_bytes()
    else:
        done = _on(where, ["cat", path], capture_output=True)
        if done.returncode != 0:
            _say(f"scp: {where}:{path}: {done.stderr.decode(errors='replace').strip()}")
            return 1
        data = done.stdout
    where, path = split(target)
    name = os.path.basename(split(source)[1])
    if where is None:
        out = Path(path)
        (out / name if out.is_dir() else out).write_bytes(data)
        return 0
    script = f'p={shlex.quote(path)}; [ -d "$p" ] && p="$p/{name}"; cat > "$p"'
    return _on(where, ["sh", "-c", script], input=data).returncode


def ssh(args: list[str]) -> int:
    if not args:
        return 1
    where, command = args[0], args[1:]
    return _on(where, ["bash", "-c", " ".join(command)]).returncode


def sbatch(args: list[str]) -> int:
    options, script = {}, None
    it = iter(args)
    for a in it:
        if a.startswith("--") and "=" in a:
            k, v = a[2:].split("=", 1)
            options[k] = v
        elif a.startswith("-"):
            options[a.lstrip("-")] = next(it)
        else:
            script = a
            break
    if script is None:
        _say("sbatch: error: no batch script given")
        return 1
    text = Path(script).read_text()
    directives = dict(re.findall(r"^#SBATCH --([a-z-]+)=(\S+)", text, re.M))
    directives.update(options)
    nodes = int(directives.get("nodes", "1"))
    if nodes > len(COMPUTE_NODES):
        _say(
            f"sbatch: error: Batch job submission failed: Requested node configuration is not available "
            f"({nodes} nodes; this stand-in cluster has {len(COMPUTE_NODES)})"
        )
        return 1
    config = _config()
    counter = Path(config["root"]) / "state" / "jobs"
    counter.parent.mkdir(parents=True, exist_ok=True)
    job = int(counter.read_text()) + 1 if counter.exists() else 1001
    counter.write_text(str(job))
    output = directives.get("output", "slurm-%j.out").replace("%j", str(job))
    env = dict(os.environ)  # --export=ALL, SLURM's default: the job runs in the submitting environment
    node = COMPUTE_NODES[0]
    env.update(
        SLURM_JOB_ID=str(job),
        SLURM_JOB_NUM_NODES=str(nodes),
        SLURMD_NODENAME=node,
        RUNBOOK_MACHINE=node,
        SLURM_SUBMIT_DIR=os.getcwd(),
    )
    with open(Path(os.getcwd()) / output, "ab") as out:
        process = subprocess.Popen(
            enter(config, node, ["bash", str(Path(script).resolve())], wd=os.getcwd()),
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=out,
            start_new_session=True,
        )
    (_state(node) / f"job-{job}.pid").write_text(str(process.pid))
    print(f"Submitted batch job {job}")
    return 0


def srun(args: list[str]) -> int:
    while args and args[0].startswith("-"):
        args.pop(0)  # the runbook's srun options all carry their value after `=`
    os.execvp(args[0], args)
    return 1


def main(argv: list[str]) -> int:
    tool, args = argv[0], argv[1:]
    if tool not in TOOLS:
        _say(f"runbook_support: no stand-in named {tool}")
        return 1
    try:
        return globals()[tool](args)
    except (FileNotFoundError, KeyError, PermissionError) as exc:
        _say(f"{tool}: {exc}")
        return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
